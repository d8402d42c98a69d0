"""Coordinated rollouts: which pods of each role may run the new revision now. Pure.

Each workload unit (a StatefulSet) rolls with `updateStrategy.rollingUpdate.partition`: the
controller moves pods with ordinal >= partition to the update revision, highest first. The
operator lowers the partitions step by step, so that coupled units (bound by a ratio lock or
listed in one rollout group) advance together. Per reconcile, from what the StatefulSets
report (`Unit`), `step` decides the next targets (pods at the update revision) with these
rules:

    n        = the unit's replicas, u = its pods at the update revision, f = u / n
    cap      = n - partition(n)                (pods kept back: a canary hold)
    (maxUnavailable, maxSkew and partition are int-or-percent: a percentage of maxUnavailable
    is of n rounded down but at least 1, of partition rounded up; maxSkew as a fraction of
    n is a percentage over 100, or a count of pods over n)
    a step is done when every rolling unit has u >= its target and all n pods ready, and
    no unit's controller is behind its latest spec (`stale`)
    while a step is not done:        hold every target (no unit advances)
    paused:                           hold every target
    uncoupled (alone, or maxSkew 1): next(unit) = cap at once: the StatefulSet controller
               rolls it natively, one pod at a time, each ready before the next
    coupled:   next(unit) = min(cap, u + maxUnavailable(n),
                                floor((min f over its coupled units + maxSkew(n)) * n))
               but at least u + 1 for the units at the minimum f (progress: a maxSkew
               smaller than one pod's share is rounded up to one pod), never above cap
    partition = n - next
    senders first (`feeds`: unit -> the coupled units that send to it, given where the
               roles pair by compat token): a unit keeps at least one pod on the old
               revision while a unit feeding it has old pods left (next <= cap - 1), so
               an old sender never loses its last partner; new senders wait for a new
               partner by themselves (not ready until one pairs). When that would leave a
               step with nothing to move, it is dropped for the step (progress first).

Because a step starts only when the last one is done and bounds every target by the
*current* minimum fraction plus maxSkew, every fraction observed during the step lies in
[min f, min f + maxSkew]: coupled units never differ by more than maxSkew, at any moment.
A rollback is the same walk: when the spec returns to the old template, the old revision is
the update revision again and the pods that moved are the ones still to update.

A step that is not done within `step_deadline_s` of its start marks the rollout `stalled`
(the caller sets a condition and an Event and holds; nothing advances until the pods get
ready or the spec changes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from disagg_core.spec import ALL_PODS, NO_PODS, ONE_POD, IntOrPercent


@dataclass(frozen=True)
class RolloutPolicy:
    """`spec.rollout`."""

    max_unavailable: IntOrPercent = ONE_POD
    max_skew: IntOrPercent = ALL_PODS  # 100%: units roll independently
    partition: IntOrPercent = NO_PODS  # pods per unit kept on the old revision
    paused: bool = False
    step_deadline_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_unavailable.value < 1:
            raise ValueError(f"maxUnavailable must be >= 1, got {self.max_unavailable}")
        if self.max_skew.value < 1 or (self.max_skew.percent and self.max_skew.value > 100):
            raise ValueError(f"maxSkew must be at least 1 and at most 100%, got {self.max_skew}")
        if self.partition.value < 0:
            raise ValueError(f"partition must be >= 0, got {self.partition}")

    def unavailable(self, replicas: int) -> int:
        """Pods of a unit of `replicas` moved per step (a percentage rounds down, to 1 at least)."""
        return max(1, self.max_unavailable.of(replicas))

    def kept(self, replicas: int) -> int:
        """Pods of a unit kept on the old revision (a percentage rounds up)."""
        return self.partition.of(replicas, round_up=True)

    @property
    def independent(self) -> bool:
        """maxSkew 100%: coupled units roll on their own."""
        return self.max_skew.percent and self.max_skew.value >= 100


@dataclass(frozen=True)
class Unit:
    """One StatefulSet as observed: `rolling` when its pods should move to a new revision
    (the planned template differs from the live one, or the controller reports two
    revisions); `updated` = pods at the update revision (0 before the new template is
    applied); `target` = the pods the current partition lets update (n - partition)."""

    replicas: int
    updated: int
    ready: int
    rolling: bool
    target: int
    stale: bool = False  # the controller has not observed the latest spec: wait for it

    @property
    def fraction(self) -> float:
        return self.updated / self.replicas if self.replicas else 1.0

    @property
    def step_done(self) -> bool:
        if self.stale:
            return False
        return not self.rolling or (self.updated >= self.target and self.ready >= self.replicas)


@dataclass(frozen=True)
class Step:
    """The partition of every unit, what each is waiting for, and whether all are done."""

    partitions: Mapping[str, int]
    targets: Mapping[str, int]
    waiting: tuple[str, ...] = ()  # rolling units whose step is not done yet
    held: bool = False  # paused, or waiting for a step
    complete: bool = False  # nothing left to roll (up to the partition hold)
    stalled: tuple[str, ...] = ()  # units past the step deadline
    groups: tuple[frozenset[str], ...] = field(default_factory=tuple)


def coupled(units: Sequence[str], groups: Sequence[Sequence[str]]) -> list[frozenset[str]]:
    """The units that roll together: connected components of the groups (ratio locks and
    rollout groups), and every other unit alone."""
    parent = {u: u for u in units}

    def root(u: str) -> str:
        while parent[u] != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    for group in groups:
        members = [u for u in group if u in parent]
        for other in members[1:]:
            parent[root(other)] = root(members[0])
    components: dict[str, set[str]] = {}
    for u in units:
        components.setdefault(root(u), set()).add(u)
    return [frozenset(c) for c in components.values()]


def _senders_first(
    units: Mapping[str, Unit],
    rolling: Sequence[str],
    caps: Mapping[str, int],
    targets: dict[str, int],
    feeds: Mapping[str, frozenset[str]],
) -> None:
    """Hold back the last old pod of units whose senders still have old pods (in place),
    unless then nothing of the component would move."""
    held = {
        name: max(units[name].updated, caps[name] - 1)
        for name in rolling
        if targets[name] >= caps[name]
        and any(units[u].updated < caps[u] for u in feeds.get(name, ()) if u in rolling)
    }
    moves = any(held.get(name, targets[name]) > units[name].updated for name in rolling)
    if moves:
        targets.update(held)


def step(
    policy: RolloutPolicy,
    units: Mapping[str, Unit],
    groups: Sequence[Sequence[str]] = (),
    *,
    step_age_s: float = 0.0,
    feeds: Mapping[str, frozenset[str]] | None = None,
) -> Step:
    """The next partitions. `step_age_s`: how long the current step has been running;
    `feeds`: per unit, the units that send to it (the senders-first rule)."""
    components = tuple(coupled(list(units), groups))
    current = {name: unit.target if unit.rolling else unit.replicas for name, unit in units.items()}
    waiting = tuple(sorted(n for n, u in units.items() if not u.step_done))
    caps = {n: max(0, u.replicas - policy.kept(u.replicas)) for n, u in units.items()}
    complete = all(not u.rolling or u.updated >= caps[n] for n, u in units.items())
    if waiting or policy.paused or complete:
        stalled = waiting if waiting and step_age_s > policy.step_deadline_s else ()
        return Step(
            partitions={n: units[n].replicas - t for n, t in current.items()},
            targets=current,
            waiting=waiting,
            held=bool(waiting) or policy.paused,
            complete=complete and not waiting,
            stalled=stalled,
            groups=components,
        )
    targets = dict(current)
    for component in components:
        rolling = [n for n in component if units[n].rolling]
        if len(rolling) < 2 or policy.independent:
            # nothing to coordinate: the StatefulSet controller rolls on its own (one pod at
            # a time, each ready before the next), down to the partition hold
            targets.update({name: max(units[name].updated, caps[name]) for name in rolling})
            continue
        lowest = min(units[n].fraction for n in rolling)
        for name in rolling:
            unit = units[name]
            nxt = min(caps[name], unit.updated + policy.unavailable(unit.replicas))
            if len(rolling) > 1:  # maxSkew binds coupled units only
                skew = policy.max_skew.fraction(unit.replicas)
                nxt = min(nxt, math.floor((lowest + skew) * unit.replicas + 1e-9))
            if unit.fraction <= lowest:
                nxt = max(nxt, min(caps[name], unit.updated + 1))
            targets[name] = max(unit.updated, nxt)
        _senders_first(units, rolling, caps, targets, feeds or {})
    return Step(
        partitions={n: units[n].replicas - t for n, t in targets.items()},
        targets=targets,
        groups=components,
    )
