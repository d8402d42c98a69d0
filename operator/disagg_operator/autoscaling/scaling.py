"""Occupancy autoscaling in the operator, the pure part: from a pipeline, its pods and their
metrics to `disagg_core.autoscale` (the algorithm `disagg up --autoscale` runs too) and
from its decisions to status and Events. The I/O is in `podmetrics` and `scaling_loop`.

Units. The operator scales workload units (one StatefulSet: a lone role, or a colocation
group), so the algorithm's "roles" are unit names here:
- policies: a unit whose role has `autoscaling` (a group's members have equal policies, the
  spec checks it), unless an external scaler owns it (`model.external_units`);
- ratio locks: `spec.ratioLocks` between the units of the leader and the follower; a lock
  inside one unit or touching an externally scaled unit is dropped;
- managed units: those with a policy, plus the followers of locks led by a managed unit. The
  operator sets their replicas (`PlanOptions.replicas`) and records them in
  `status.autoscaledReplicas`.

Samples, one per pod of a unit (label disagg.dev/role = unit), as the algorithm expects:
- a pod being deleted, or finished, is left out;
- a pod that is not Ready (its condition) or has no IP yet: `ready=False`, occupancy None.
  The algorithm counts it as a replica that will soon take load (which damps a scale-up)
  and lets it block a scale-down;
- a ready pod is scraped on the metrics port of each container of its unit's roles (the
  container port named `metrics`, an engine's named `engine`, else its DISAGG_METRICS_PORT,
  else 9400). An engine unit's policy reads the engine's own signals, KV cache usage and
  waiting requests (`autoscale.ENGINE_SIGNALS`), named so in its decisions' reasons. Its occupancy
  is the highest of its containers' (the slowest member of a group sets the pace), its queue
  depth their sum; one failed scrape makes the pod's occupancy None (never a scale-down).

A fresh autoscaler (new pipeline, changed policies, operator restart) does not scale down
during its first down window (held by `autoscale.Autoscaler`).

Resume (`resumed_replicas`, before every reconcile): a managed unit's replicas are the
in-memory decision, else `status.autoscaledReplicas[unit]`, else absent (the planner then uses
spec.roles[].replicas: the starting point). Units no longer managed drop out, so removing
`autoscaling` (or handing a unit to an HPA) gives the replica count back to the spec.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from disagg_core import contract, spec
from disagg_core.autoscale import (
    ENGINE_SIGNALS,
    STALE_AFTER_S,
    Autoscaler,
    Decision,
    Policy,
    RatioLock,
    Sample,
    policy_of,
)
from disagg_core.spec import Pipeline, SpecError
from disagg_operator import names
from disagg_operator.k8s import times
from disagg_operator.plan import model
from disagg_operator.plan.engines import ENGINE_PORT_NAME

MAX_STATUS_DECISIONS: Final = 10
MAX_REASON: Final = 512
STATUS_DECISIONS: Final = "scaleDecisions"
STATUS_REPLICAS: Final = "autoscaledReplicas"
EVENT_SCALED_UP: Final = "ScaledUp"
EVENT_SCALED_DOWN: Final = "ScaledDown"
METRICS_PORT_NAME: Final = "metrics"
METRICS_PORT_NAMES: Final = (METRICS_PORT_NAME, ENGINE_PORT_NAME)
METRICS_PORT_ENV: Final = contract.PREFIX + "METRICS_PORT"


@dataclass(frozen=True)
class ScalingPlan:
    """What the operator scales in one pipeline, by unit (see the module docstring)."""

    policies: Mapping[str, Policy]
    locks: tuple[RatioLock, ...]
    roles: Mapping[str, tuple[str, ...]]  # every unit not scaled externally: its roles
    spec_replicas: Mapping[str, int]  # ... and its replicas from the spec

    @property
    def managed(self) -> frozenset[str]:
        managed = set(self.policies)
        grew = True
        while grew:  # chains of locks (the spec rejects cycles)
            grew = False
            for lock in self.locks:
                if lock.leader in managed and lock.follower not in managed:
                    managed.add(lock.follower)
                    grew = True
        return frozenset(managed)

    def current(self, decided: Mapping[str, int]) -> dict[str, int]:
        """Replicas per unit as the operator intends them: decided, else the spec's."""
        return {unit: decided.get(unit, n) for unit, n in self.spec_replicas.items()}


def scaling_plan(pipeline: Pipeline) -> ScalingPlan:
    external = model.external_units(pipeline)
    units = [u for u in model.workloads(pipeline) if u.unit not in external]
    home = {role.name: unit.unit for unit in units for role in unit.roles}
    policies = {
        unit.unit: _policy(unit.roles[0].autoscaling, unit.roles)
        for unit in units
        if unit.roles[0].autoscaling is not None
    }
    locks = tuple(
        RatioLock(
            home[lock.leader],
            home[lock.follower],
            lock.leader_share,
            lock.follower_share,
            lock.tolerance,
        )
        for lock in pipeline.ratio_locks
        if lock.leader in home
        and lock.follower in home
        and home[lock.leader] != home[lock.follower]
    )
    return ScalingPlan(
        policies=policies,
        locks=locks,
        roles={unit.unit: tuple(r.name for r in unit.roles) for unit in units},
        spec_replicas={unit.unit: unit.replicas for unit in units},
    )


def _policy(autoscaling: spec.Autoscaling, roles: Sequence[spec.Role]) -> Policy:
    """The unit's policy; an engine unit's is on the engine's own signals."""
    policy = policy_of(autoscaling)
    if any(role.engine is not None for role in roles):
        return dataclasses.replace(policy, names=ENGINE_SIGNALS)
    return policy


@dataclass
class ScalingState:
    """A pipeline's autoscaler (its recommendation history), kept while its policies hold."""

    key: tuple[object, ...]
    autoscaler: Autoscaler


def scaling_state(
    previous: ScalingState | None,
    plan: ScalingPlan,
    *,
    stale_after_s: float = STALE_AFTER_S,
) -> ScalingState:
    """`previous` if the policies and locks are unchanged, else a fresh autoscaler."""
    key: tuple[object, ...] = (tuple(sorted(plan.policies.items())), plan.locks, stale_after_s)
    if previous is not None and previous.key == key:
        return previous
    autoscaler = Autoscaler(plan.policies, plan.locks, stale_after_s=stale_after_s)
    return ScalingState(key, autoscaler)


def to_apply(decisions: Iterable[Decision]) -> list[Decision]:
    """The decisions that change a replica count. (A fresh autoscaler's first down window is
    held by `autoscale.Autoscaler` itself, for the operator and `disagg up` alike.)"""
    return [decision for decision in decisions if decision.changed]


def resumed_replicas(body: Mapping[str, Any], decided: Mapping[str, int]) -> dict[str, int]:
    """The replicas the planner should use for the managed units of the pipeline `body`."""
    try:
        pipeline = spec.parse_pipeline({key: value for key, value in body.items()})
    except SpecError:
        return dict(decided)  # nothing gets planned for an invalid spec anyway
    stored = (body.get("status") or {}).get(STATUS_REPLICAS) or {}
    result: dict[str, int] = {}
    for unit in sorted(scaling_plan(pipeline).managed):
        if unit in decided:
            result[unit] = decided[unit]
        elif _count(stored.get(unit)):
            result[unit] = int(stored[unit])
    return result


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ---------------------------------------------------------------------------- pods


@dataclass(frozen=True)
class Reading:
    """What one container's /metrics said."""

    occupancy: float
    queue_depth: int


@dataclass(frozen=True)
class PodView:
    name: str
    unit: str
    ready: bool
    ip: str | None
    ports: tuple[int, ...]  # the metrics port of each container of the unit's roles

    @property
    def urls(self) -> tuple[str, ...]:
        if not self.ready or not self.ip:
            return ()
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return tuple(f"http://{host}:{port}/metrics" for port in self.ports)


def metrics_port(container: Mapping[str, Any]) -> int:
    """The container's metrics port: the port named `metrics`, or an engine's `engine`
    (`<name>-<k>` in the k-th container of a colocation pod), else DISAGG_METRICS_PORT."""
    for port in container.get("ports") or ():
        name = str(port.get("name", "")).split("-")[0]
        runtime = name in METRICS_PORT_NAMES
        if runtime and _count(port.get("containerPort")):
            return int(port["containerPort"])
    for env in container.get("env") or ():
        if env.get("name") == METRICS_PORT_ENV and str(env.get("value", "")).isdigit():
            return int(env["value"])
    return contract.DEFAULT_METRICS_PORT


def pod_view(pod: Mapping[str, Any], plan: ScalingPlan) -> PodView | None:
    """The pod as the autoscaler sees it; None when it does not count (see the docstring)."""
    meta = pod.get("metadata") or {}
    unit = str((meta.get("labels") or {}).get(names.LABEL_ROLE, ""))
    pod_status = pod.get("status") or {}
    if unit not in plan.roles or meta.get("deletionTimestamp"):
        return None
    if (meta.get("labels") or {}).get(names.LABEL_NODE_RANK, "0") != "0":
        return None  # a group's worker: its leader serves the group's metrics
    if pod_status.get("phase") in ("Succeeded", "Failed"):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in pod_status.get("conditions") or ()
    )
    containers = (pod.get("spec") or {}).get("containers") or ()
    ports = tuple(metrics_port(c) for c in containers if c.get("name") in plan.roles[unit])
    ip = pod_status.get("podIP") or None
    return PodView(str(meta.get("name", "")), unit, ready and bool(ports), ip, ports)


def pod_views(pods: Iterable[Mapping[str, Any]], plan: ScalingPlan) -> dict[str, list[PodView]]:
    """The counted pods of each unit (sorted by name)."""
    result: dict[str, list[PodView]] = {}
    for pod in pods:
        view = pod_view(pod, plan)
        if view is not None:
            result.setdefault(view.unit, []).append(view)
    return {unit: sorted(views, key=lambda v: v.name) for unit, views in result.items()}


def pod_sample(view: PodView, readings: Mapping[str, Reading | None], at: float) -> Sample:
    if not view.urls:
        return Sample(view.name, None, ready=False, at=at)
    got = [readings.get(url) for url in view.urls]
    values = [r for r in got if r is not None]
    if len(values) != len(got):
        return Sample(view.name, None, at=at)
    occupancy = max(r.occupancy for r in values)
    return Sample(view.name, occupancy, queue_depth=sum(r.queue_depth for r in values), at=at)


def observed(samples: Sequence[Sample], now: float, stale_after_s: float) -> float | None:
    """The mean occupancy the algorithm compared with the target (None without samples)."""
    fresh = [
        s.occupancy
        for s in samples
        if s.ready and s.occupancy is not None and now - s.at <= stale_after_s
    ]
    return sum(fresh) / len(fresh) if fresh else None


# ---------------------------------------------------------------------------- results


def decision_record(
    decision: Decision, at: datetime.datetime, occupancy: float | None
) -> dict[str, Any]:
    """One entry of status.scaleDecisions."""
    record: dict[str, Any] = {
        "time": times.format_time(at),
        "role": decision.role,
        "fromReplicas": decision.current,
        "toReplicas": decision.desired,
        "signal": decision.signal,
    }
    if occupancy is not None:
        record["occupancy"] = round(occupancy, 4)
    record["reason"] = decision.reason[:MAX_REASON]
    return record


def decision_event(decision: Decision) -> tuple[str, str, str]:
    """(type, reason, message) of the Event for a decision."""
    reason = EVENT_SCALED_UP if decision.desired > decision.current else EVENT_SCALED_DOWN
    message = (
        f"{decision.role}: {decision.current} -> {decision.desired} replicas on {decision.signal}"
    )
    return "Normal", reason, f"{message} ({decision.reason})"


def status_patch(
    previous: Mapping[str, Any] | None,
    records: Sequence[Mapping[str, Any]],
    replicas: Mapping[str, int],
) -> dict[str, Any]:
    """A merge patch of the status: `records` appended to scaleDecisions (the last
    MAX_STATUS_DECISIONS kept), autoscaledReplicas = `replicas` (others removed). Empty when
    it would change nothing."""
    previous = previous or {}
    patch: dict[str, Any] = {}
    if records:
        decisions = [*(previous.get(STATUS_DECISIONS) or ()), *records]
        patch[STATUS_DECISIONS] = decisions[-MAX_STATUS_DECISIONS:]
    stored = dict(previous.get(STATUS_REPLICAS) or {})
    if stored != dict(replicas):
        removed: dict[str, Any] = {unit: None for unit in stored if unit not in replicas}
        patch[STATUS_REPLICAS] = {**removed, **replicas}
    return patch
