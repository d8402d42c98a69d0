"""Replica decisions from backlog: pure, shared by the operator and `disagg up`.

A stage that cannot keep up holds its receive slots longer, so its pool fills, and its
requests wait for a worker; an idle stage drains both. Two signals, each a ratio to its
target, combined by max (HPA-like, with the rules written out):

    occupancy = mean pool occupancy (payload bytes / pool bytes) over ready replicas with a
                fresh sample, / targetPoolOccupancy
    queue     = mean queue depth (requests waiting for a worker) over the same replicas,
                / targetQueuePerReplica                      (only when that target is set)
    ratio     = max(occupancy, queue); `signal` names the larger one
    raw       = current                       if |ratio - 1| <= tolerance
              = ceil(current * ratio)         otherwise
    up:   replicas not ready or without a fresh sample count as 0 on both signals (they
          will take load soon), which damps the step; raw <= current + max_step_up
    down: blocked while any replica lacks a fresh sample; without a queue target also
          while any replica has requests queued; raw >= current - max_step_down

Why two: occupancy alone misses backlogs of small payloads (eight queued 1 MiB requests
fill 6 % of a 128 MiB pool while their latency grows without bound); queue depth alone
misses a pool that fills with a few huge payloads.
    stabilized = min(raws in the last up window)    when raw > current
               = max(raws in the last down window)  when raw < current
    desired    = clamp(stabilized, minReplicas, maxReplicas)

So a spike scales up within one decision (up window 0 by default), scale-down waits for its
whole window of lower recommendations, and load that oscillates inside the window does not
flap. A window counts in scrape results, not wall time alone: a move (past a window above 0)
needs the recommendation to hold in every result inside the window, at least `MIN_RESULTS`
of them, the first within half a window of its start (`held`). A decision without a fresh
sample of any replica (the scrapes timed out: a machine starved of CPU) is no signal: it
moves nothing, and a window holding it is no window. A fresh autoscaler (a new pipeline,
changed policies, a restarted operator) has seen no window yet: it holds scale-downs until
one full down window has passed since its first decision for the role, as if the window had
been full of the current count.
An engine role (vLLM; spec/engines.py) has no pool: its own signals take the two places
(`ENGINE_SIGNALS`), KV cache usage (`vllm:kv_cache_usage_perc`, 0..1: the paged cache is the
engine's pool, and a full one preempts requests) against targetPoolOccupancy, and waiting
requests (`vllm:num_requests_waiting`: admitted, not yet scheduled) against
targetQueuePerReplica; each decision's signal and reason name them.
Ratio locks then hold declared proportions between roles (e.g.
denoiser:decoder = 4:1): when the leader's desired count moves, followers outside the
lock's tolerance are set to the proportional count (clamped to their own bounds).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from disagg_core.spec import Autoscaling

STALE_AFTER_S = 30.0
MIN_RESULTS = 2  # signal results a window of more than 0 s must hold before a move
# The role metrics the algorithm reads (runtime/disagg_runtime/role/metrics.py exports them):
OCCUPANCY_METRIC = "disagg_pool_occupancy"
QUEUE_DEPTH_METRIC = "disagg_queue_depth"


# An engine's (vLLM 0.32: vllm/v1/metrics/loggers.py; gpu_cache_usage_perc before 0.10):
ENGINE_KV_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
ENGINE_WAITING_METRIC = "vllm:num_requests_waiting"


@dataclass(frozen=True)
class SignalNames:
    """How a policy's two signals are named in decisions (`signal`) and their reasons."""

    load: str  # the 0..1 signal compared with target_occupancy
    queue: str  # the per-replica count compared with target_queue
    load_words: str
    queue_words: str
    source: str  # whose samples: "pool", "engine"
    blocked_words: str  # what blocks a scale-down without a queue target


POOL_SIGNALS = SignalNames(
    "occupancy", "queue", "pool occupancy", "queue", "pool", "requests still queued"
)
ENGINE_SIGNALS = SignalNames(
    "kv-cache", "waiting", "KV cache usage", "waiting requests", "engine", "waiting requests"
)


def signals(values: Mapping[str, float]) -> tuple[float | None, int]:
    """(occupancy clamped to 0..1, queue depth) from one replica's scraped metrics; occupancy
    None when missing or not finite (the replica then counts as without a sample)."""
    occupancy = values.get(OCCUPANCY_METRIC)
    queued = values.get(QUEUE_DEPTH_METRIC, 0.0)
    queue_depth = int(queued) if math.isfinite(queued) and queued > 0 else 0
    if occupancy is None or not math.isfinite(occupancy):
        return None, queue_depth
    return min(1.0, max(0.0, occupancy)), queue_depth


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target_occupancy: float = 0.7
    tolerance: float = 0.1
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    max_step_up: int | None = None  # default: max(4, current), as the HPA
    max_step_down: int | None = None  # default: no limit beyond the window
    target_queue: float | None = None  # requests waiting per replica; None: occupancy only
    names: SignalNames = POOL_SIGNALS  # ENGINE_SIGNALS for an engine role

    def __post_init__(self) -> None:
        if not 0 < self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 < minReplicas <= maxReplicas, got {self}")
        if not 0 < self.target_occupancy <= 1:
            raise ValueError(f"targetPoolOccupancy must be in (0, 1], got {self.target_occupancy}")
        if self.target_queue is not None and not self.target_queue > 0:
            raise ValueError(f"targetQueuePerReplica must be > 0, got {self.target_queue}")


@dataclass(frozen=True)
class Sample:
    """One replica's reading: occupancy 0..1 (None if the scrape failed)."""

    replica: str
    occupancy: float | None
    queue_depth: int = 0
    ready: bool = True
    at: float = 0.0


@dataclass(frozen=True)
class RatioLock:
    """`follower` replicas per `leader` replica = follower_share / leader_share."""

    leader: str
    follower: str
    leader_share: int
    follower_share: int
    tolerance: float = 0.0

    def follower_for(self, leader_replicas: int) -> int:
        return max(1, math.ceil(leader_replicas * self.follower_share / self.leader_share))


SIGNALS = (
    *dict.fromkeys(
        n for names in (POOL_SIGNALS, ENGINE_SIGNALS) for n in (names.load, names.queue)
    ),
    "ratio-lock",
)


@dataclass(frozen=True)
class Decision:
    role: str
    current: int
    desired: int
    reason: str
    at: float
    signal: str = "occupancy"  # which of SIGNALS drove it

    @property
    def changed(self) -> bool:
        return self.desired != self.current


@dataclass
class _History:
    raws: deque[tuple[float, int | None]] = field(default_factory=deque)  # None: no signal


class Autoscaler:
    """Keeps the recommendation history the stabilization windows need."""

    def __init__(
        self,
        policies: Mapping[str, Policy],
        locks: Sequence[RatioLock] = (),
        *,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        self.policies = dict(policies)
        self.locks = list(locks)
        self.stale_after_s = stale_after_s
        self._history: dict[str, _History] = {role: _History() for role in self.policies}
        self._first_seen: dict[str, float] = {}

    def decide(
        self, now: float, current: Mapping[str, int], samples: Mapping[str, Sequence[Sample]]
    ) -> dict[str, Decision]:
        decisions = {
            role: self._decide_role(role, policy, now, current[role], samples.get(role, ()))
            for role, policy in self.policies.items()
            if role in current
        }
        for lock in self.locks:
            self._apply_lock(lock, decisions, current, now)
        return decisions

    def _decide_role(
        self, role: str, policy: Policy, now: float, current: int, samples: Sequence[Sample]
    ) -> Decision:
        raw, reason, signal = recommend(policy, current, samples, now, self.stale_after_s)
        first_seen = self._first_seen.setdefault(role, now)
        history = self._history[role].raws
        if not fresh(samples, now, self.stale_after_s):  # no signal: it breaks any run
            history.append((now, None))
            return Decision(role, current, current, reason, now, signal)
        history.append((now, raw))
        longest = max(policy.scale_up_window_s, policy.scale_down_window_s)
        while history and history[0][0] < now - longest:
            history.popleft()
        if raw > current:
            up = policy.scale_up_window_s
            window = [r for t, r in history if t >= now - up and r is not None]
            stabilized = max(current, min(window))
            if up > 0 and not held(history, now, up, lambda r: r > current):
                stabilized = current
            if stabilized < raw:
                reason += f"; held to {stabilized} by the {up:g}s up window"
        elif raw < current:
            down = policy.scale_down_window_s
            window = [r for t, r in history if t >= now - down and r is not None]
            stabilized = min(current, max(window))
            if now - first_seen < down:
                stabilized = current  # no full window observed yet
            if down > 0 and not held(history, now, down, lambda r: r < current):
                stabilized = current  # not seen to hold in enough scrape results
            if stabilized > raw:
                reason += f"; waiting for the {down:g}s scale-down window"
        else:
            stabilized = current
        desired = min(policy.max_replicas, max(policy.min_replicas, stabilized))
        if desired != stabilized:
            reason += f"; clamped to [{policy.min_replicas}, {policy.max_replicas}]"
        return Decision(role, current, desired, reason, now, signal)

    def _apply_lock(
        self,
        lock: RatioLock,
        decisions: dict[str, Decision],
        current: Mapping[str, int],
        now: float,
    ) -> None:
        leader = decisions.get(lock.leader)
        follower_now = current.get(lock.follower)
        if leader is None or follower_now is None:
            return
        want = lock.follower_for(leader.desired)
        policy = self.policies.get(lock.follower)
        if policy is not None:
            want = min(policy.max_replicas, max(policy.min_replicas, want))
        own = decisions.get(lock.follower)
        proposed = own.desired if own is not None else follower_now
        if abs(proposed - want) <= lock.tolerance * want:
            return
        reason = (
            f"ratio lock {lock.leader}:{lock.follower} = "
            f"{lock.leader_share}:{lock.follower_share} with {lock.leader} at {leader.desired}"
        )
        decisions[lock.follower] = Decision(
            lock.follower, follower_now, want, reason, now, "ratio-lock"
        )


def fresh(samples: Sequence[Sample], now: float, stale_after_s: float) -> list[Sample]:
    """The samples that are a signal: of a ready replica, with occupancy, not stale."""
    return [
        s for s in samples if s.ready and s.occupancy is not None and now - s.at <= stale_after_s
    ]


def held(
    history: Sequence[tuple[float, int | None]],
    now: float,
    window_s: float,
    holds: Callable[[int], bool],
) -> bool:
    """Whether the results inside the window (`now - window_s` .. `now`) show the
    recommendation holding: every one satisfies `holds` (a decision without a signal, None,
    breaks it), at least MIN_RESULTS of them, the first within half a window of its start
    and none more than a window after the one before (results cover it, not wall time)."""
    start = now - window_s
    inside = [(at, raw) for at, raw in history if at >= start]
    if len(inside) < MIN_RESULTS or inside[0][0] - start > window_s / 2:
        return False
    if any(raw is None or not holds(raw) for _, raw in inside):
        return False
    return all(b[0] - a[0] <= window_s for a, b in itertools.pairwise(inside))


def recommend(
    policy: Policy, current: int, samples: Sequence[Sample], now: float, stale_after_s: float
) -> tuple[int, str, str]:
    """The unstabilized recommendation for one role, the reason in words, and the signal
    that drove it."""
    names = policy.names
    live = fresh(samples, now, stale_after_s)
    if not live:
        return (
            current,
            f"no fresh {names.source} samples: keeping the replica count",
            names.load,
        )
    occupancy = sum(s.occupancy or 0.0 for s in live)
    queued = sum(s.queue_depth for s in live)
    ratios = {names.load: occupancy / len(live) / policy.target_occupancy}
    described = (
        f"{names.load_words} {occupancy / len(live):.2f} vs target {policy.target_occupancy:.2f}"
    )
    if policy.target_queue is not None:
        ratios[names.queue] = queued / len(live) / policy.target_queue
        described += (
            f", {names.queue_words} {queued / len(live):.1f}/replica vs target "
            f"{policy.target_queue:g}"
        )
    signal = max(ratios, key=lambda name: ratios[name])
    ratio = ratios[signal]
    if abs(ratio - 1) <= policy.tolerance:
        return current, f"{described}: within tolerance", signal
    if ratio > 1:
        counted = max(current, len(samples))
        on_load = signal == names.load
        total = occupancy if on_load else float(queued)
        target = policy.target_occupancy if on_load else policy.target_queue or 1.0
        raw = math.ceil(current * total / counted / target)
        step = policy.max_step_up if policy.max_step_up is not None else max(4, current)
        raw = min(raw, current + step)
        if raw <= current:
            return current, f"{described}: replicas not yet ready absorb the load", signal
        return raw, f"{described}: scale up on {signal}", signal
    missing = current - len(live)
    if missing > 0:
        reason = f"{described}: {missing} replica(s) without fresh samples block scale-down"
        return current, reason, signal
    if policy.target_queue is None and queued > 0:
        return current, f"{described}: {names.blocked_words} block scale-down", names.queue
    raw = max(1, math.ceil(current * ratio))
    if policy.max_step_down is not None:
        raw = max(raw, current - policy.max_step_down)
    return raw, f"{described}: scale down", signal


def policy_of(autoscaling: Autoscaling) -> Policy:
    """The algorithm's policy for a role's `autoscaling` (the operator and `disagg up`)."""
    return Policy(
        min_replicas=autoscaling.min_replicas,
        max_replicas=autoscaling.max_replicas,
        target_occupancy=autoscaling.target_pool_occupancy,
        tolerance=autoscaling.tolerance,
        scale_up_window_s=autoscaling.scale_up_stabilization_seconds,
        scale_down_window_s=autoscaling.scale_down_stabilization_seconds,
        target_queue=autoscaling.target_queue_per_replica,
    )
