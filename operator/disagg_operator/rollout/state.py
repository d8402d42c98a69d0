"""A pipeline's rollout from what its StatefulSets say, and back to partitions and status. Pure.

The reconciler plans the pipeline, reads its live StatefulSets, and calls `decide`: per
workload unit, the live object's disagg.dev/template-hash against the planned one says
whether its pods must move to a new revision (before the new template is applied, none has);
`rollout.step` then gives the partitions to apply with the plan. `status` is the pipeline's
`status.rollout`, `summary` its one-line printer column.

Coupling: a ratio lock between two roles couples their units, and so does every
`spec.rollout.groups` entry (roles mapped to their units).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from disagg_core.spec import Pipeline
from disagg_operator import names
from disagg_operator.plan import model
from disagg_operator.rollout import steps as rollout


@dataclass(frozen=True)
class RolloutDecision:
    step: rollout.Step
    units: Mapping[str, rollout.Unit]

    @property
    def active(self) -> bool:
        return any(u.rolling for u in self.units.values())


def policy_of(pipeline: Pipeline) -> rollout.RolloutPolicy:
    r = pipeline.rollout
    return rollout.RolloutPolicy(
        max_unavailable=r.max_unavailable,
        max_skew=r.max_skew,
        partition=r.partition,
        paused=r.paused,
        step_deadline_s=float(r.step_deadline_seconds),
    )


def groups_of(pipeline: Pipeline) -> list[list[str]]:
    """Coupled units: ratio-locked roles and rollout groups, by unit."""
    unit_of = {role.name: unit.unit for unit in model.workloads(pipeline) for role in unit.roles}
    pairs = [[lock.leader, lock.follower] for lock in pipeline.ratio_locks]
    return [
        sorted({unit_of[r] for r in group if r in unit_of})
        for group in [*pairs, *pipeline.rollout.groups]
    ]


def feeds_of(pipeline: Pipeline) -> dict[str, frozenset[str]]:
    """Per unit, the units that send to it where both roles declare a compat token (their
    replicas pair by revision, so senders roll first: rollout.py)."""
    unit_of = {role.name: unit.unit for unit in model.workloads(pipeline) for role in unit.roles}
    declared = {role.name for role in pipeline.roles if role.compat is not None}
    links = [(e.source, e.target) for e in pipeline.edges]
    links += [(e.source, ref.to) for e in pipeline.edges for ref in e.tensor_refs]
    feeds: dict[str, set[str]] = {}
    for source, target in links:
        if (
            {source, target} <= declared
            and source in unit_of
            and target in unit_of
            and unit_of[source] != unit_of[target]
        ):
            feeds.setdefault(unit_of[target], set()).add(unit_of[source])
    return {unit: frozenset(senders) for unit, senders in feeds.items()}


def _unit_name(obj: Mapping[str, Any]) -> str:
    return str(((obj.get("metadata") or {}).get("labels") or {}).get(names.LABEL_ROLE, ""))


def observe(
    planned: Sequence[Mapping[str, Any]], live: Sequence[Mapping[str, Any]]
) -> dict[str, rollout.Unit]:
    """Each planned StatefulSet's unit as the live object shows it (missing: nothing to
    roll, the apply creates it)."""
    by_name = {(o.get("metadata") or {}).get("name"): o for o in live}
    units: dict[str, rollout.Unit] = {}
    for sts in planned:
        if sts.get("kind") != "StatefulSet":
            continue
        meta = sts["metadata"]
        current = by_name.get(meta["name"])
        if current is None:
            continue
        # an externally scaled unit (an HPA's) plans no replicas: the live count is the one
        live_replicas = (current.get("spec") or {}).get("replicas", 1)
        replicas = int(sts["spec"].get("replicas", live_replicas))
        want = meta.get("annotations", {}).get(names.ANNOTATION_TEMPLATE_HASH)
        have = ((current.get("metadata") or {}).get("annotations") or {}).get(
            names.ANNOTATION_TEMPLATE_HASH
        )
        spec = current.get("spec") or {}
        st = current.get("status") or {}
        partition = int(
            ((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition") or 0
        )
        two_revisions = st.get("currentRevision") != st.get("updateRevision")
        generation = (current.get("metadata") or {}).get("generation")
        observed = st.get("observedGeneration")
        stale = generation is not None and observed is not None and observed < generation
        new_template = want != have
        ready = int(st.get("readyReplicas") or 0)
        held = max(0, int(spec.get("replicas", 1)) - partition)
        if new_template:  # not applied yet: no pod runs it, whatever the status counts
            unit = rollout.Unit(replicas, 0, ready, rolling=True, target=0)
        elif stale:  # the controller has not seen our last write: keep its partition
            updated = int(st.get("updatedReplicas") or 0)
            unit = rollout.Unit(replicas, updated, ready, rolling=True, target=held, stale=True)
        else:
            unit = rollout.Unit(
                replicas,
                int(st.get("updatedReplicas") or 0),
                ready,
                rolling=two_revisions and bool(st.get("updateRevision")),
                target=held,
            )
        name = _unit_name(sts)
        units[name] = _whole(units[name], unit) if name in units else unit
    return units


def _whole(a: rollout.Unit, b: rollout.Unit) -> rollout.Unit:
    """A role of groups (roles[].nodes) has a StatefulSet per node rank whose ordinals are
    its groups: a group is updated, ready or held only where every member is."""
    return rollout.Unit(
        replicas=a.replicas,
        updated=min(a.updated, b.updated),
        ready=min(a.ready, b.ready),
        rolling=a.rolling or b.rolling,
        target=min(a.target, b.target),
        stale=a.stale or b.stale,
    )


def decide(
    pipeline: Pipeline,
    planned: Sequence[Mapping[str, Any]],
    live: Sequence[Mapping[str, Any]],
    *,
    step_age_s: float = 0.0,
) -> RolloutDecision:
    units = observe(planned, live)
    step = rollout.step(
        policy_of(pipeline),
        units,
        groups_of(pipeline),
        step_age_s=step_age_s,
        feeds=feeds_of(pipeline),
    )
    return RolloutDecision(step=step, units=units)


def phase(decision: RolloutDecision, paused: bool) -> str:
    if not decision.active or decision.step.complete:
        return "Complete"
    if decision.step.stalled:
        return "Stalled"
    return "Paused" if paused else "Rolling"


def status(decision: RolloutDecision, paused: bool) -> dict[str, Any]:
    """`status.rollout`: the phase, per unit what moved, and a one-line summary."""
    units = decision.units
    return {
        "phase": phase(decision, paused),
        "summary": summary(decision, paused),
        "units": [
            {
                "name": name,
                "replicas": u.replicas,
                "updated": u.updated,
                "ready": u.ready,
                "target": decision.step.targets.get(name, u.replicas),
            }
            for name, u in sorted(units.items())
            if u.rolling
        ],
        **({"stalled": list(decision.step.stalled)} if decision.step.stalled else {}),
    }


def summary(decision: RolloutDecision, paused: bool) -> str:
    rolling = {n: u for n, u in decision.units.items() if u.rolling}
    if not rolling or decision.step.complete:
        return "-"
    updated = sum(u.updated for u in rolling.values())
    total = sum(u.replicas for u in rolling.values())
    return f"{phase(decision, paused)} {updated}/{total}"
