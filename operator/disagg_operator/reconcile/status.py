"""Status builder: the pipeline (or why it is invalid) + the observed StatefulSets -> `status`.

Pure: the caller passes the clock (`now`) and the conditions it last wrote. The result holds
every field this module owns (`observedGeneration`, `phase`, `readyRoles`, `roles`,
`problems`, `conditions`), so a merge patch of it replaces stale values; `scaleDecisions`
and `autoscaledReplicas` belong to the autoscaler (`scaling_loop`) and are left out.

Per role, from the StatefulSet of its unit (see `planner`): `desired` = spec.replicas,
`current` = status.replicas, `ready` = status.readyReplicas, `updated` =
status.updatedReplicas. A unit (and each of its roles) is

    missing   no StatefulSet of the unit's name was observed;
    ready     present and ready >= desired;
    rolling   present, and the StatefulSet controller has not observed the latest
              generation, or updated < desired, or current != desired (scaling), or
              currentRevision != updateRevision.

A rollout lasts until every unit is ready: units that are not ready yet while Progressing
was True (or never written: a new pipeline) count as progressing, not as degraded; after
the rollout completed, a unit that loses ready replicas makes the pipeline Degraded.

The gateway (spec.gateway enabled) is reported apart, in `gateway`: its `url` (the
Service's in-cluster address) and `desired`/`ready` replicas of Deployment P-gateway (0
ready while the Deployment is missing). It does not enter the conditions: a pipeline
whose roles are ready can be used in-cluster even while the gateway rolls.

`readyRoles` = "<ready roles>/<roles>". Conditions, as (status, reason):

    Ready        all units ready: (True, AllRolesReady); else False with ChildMissing (a unit
                 missing), RolloutInProgress (a unit rolling) or RolesNotReady
    Progressing  a unit missing: (True, ChildMissing); a unit rolling, or not ready during
                 a rollout: (True, RolloutInProgress); else (False, RolloutComplete)
    Degraded     (True, RolesNotReady) when nothing progresses but a unit is not ready;
                 (True, ProgressDeadlineExceeded) when Progressing has been True for longer
                 than `progress_deadline` seconds; else False, with Progressing's reason while
                 progressing and AllRolesReady otherwise
    invalid spec all three have reason InvalidSpec: Ready False, Progressing False, Degraded
                 True; the message (and `problems`) list the validator's lines

The message of a condition that is not fine names the roles concerned. `lastTransitionTime`
is kept while a condition's status stays the same. Phase, first match: Invalid (invalid spec),
Degraded (Degraded True), Pending (no unit observed yet), Progressing (Progressing True), Ready.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from disagg_core import spec
from disagg_core.spec import ROOT, Pipeline, SpecError
from disagg_operator import names
from disagg_operator.k8s import times
from disagg_operator.plan import gateway, groups, model
from disagg_operator.reconcile import apply

# Degraded reason when a planned child's name is taken by an object this pipeline does not
# control. (Not in names.REASONS: that tuple feeds the generated CRD's descriptions.)
REASON_CHILD_CONFLICT: Final = "ChildConflict"


DEFAULT_PROGRESS_DEADLINE: Final = 600.0  # seconds, like a Deployment's progressDeadlineSeconds
MAX_PROBLEMS: Final = 50  # keeps the status small; the message says how many were left out
Condition = tuple[str, bool, str, str]  # type, status, reason, message


@dataclass(frozen=True)
class UnitState:
    """What one StatefulSet says about its unit."""

    present: bool
    desired: int
    current: int = 0
    ready: int = 0
    updated: int = 0
    stale: bool = False  # the controller has not caught up with the spec or revision

    @property
    def is_ready(self) -> bool:
        return self.present and self.ready >= self.desired

    @property
    def rolling(self) -> bool:
        moving = self.updated < self.desired or self.current != self.desired
        return self.present and (self.stale or moving)

    def describe(self, workload: str) -> str:
        if not self.present:
            return f"StatefulSet {workload} missing"
        return f"{self.ready}/{self.desired} ready, {self.updated} updated"


def unit_state(statefulset: Mapping[str, Any] | None, planned: int) -> UnitState:
    """The state of a unit from its observed StatefulSet (None: missing)."""
    if statefulset is None:
        return UnitState(present=False, desired=planned)
    spec = statefulset.get("spec") or {}
    status = statefulset.get("status") or {}
    generation = (statefulset.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    behind = generation is not None and (observed is None or observed < generation)
    revisions = (status.get("currentRevision"), status.get("updateRevision"))
    switching = None not in revisions and revisions[0] != revisions[1]
    return UnitState(
        present=True,
        desired=int(spec.get("replicas", 1)),
        current=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        stale=behind or switching,
    )


def _unit_state(
    pipeline: Pipeline, unit: model.Workload, by_name: Mapping[Any, Mapping[str, Any]]
) -> UnitState:
    """A role of groups (roles[].nodes): its StatefulSets' ordinals are its groups, so a
    group counts (current, ready, updated) only as far as every member's StatefulSet does."""
    members = groups.member_names(pipeline, unit)
    states = [unit_state(by_name.get(name), unit.replicas) for name in members]
    if len(states) == 1:
        return states[0]
    return UnitState(
        present=all(s.present for s in states),
        desired=states[0].desired,
        current=min(s.current for s in states),
        ready=min(s.ready for s in states),
        updated=min(s.updated for s in states),
        stale=any(s.stale for s in states),
    )


def build_status(
    pipeline_or_error: Pipeline | SpecError,
    observed_statefulsets: Sequence[Mapping[str, Any]],
    *,
    generation: int | None,
    now: datetime.datetime,
    previous_conditions: Sequence[Mapping[str, Any]] = (),
    progress_deadline: float = DEFAULT_PROGRESS_DEADLINE,
    options: model.PlanOptions | None = None,
) -> dict[str, Any]:
    """The pipeline's `status` (see the module docstring).

    `observed_statefulsets` are the pipeline's StatefulSets as read from the API (others are
    ignored); `now` must be timezone-aware; `options` must be the ones given to the planner.
    """
    if isinstance(pipeline_or_error, SpecError):
        problems = [f"{p.path or ROOT}: {p.reason}" for p in pipeline_or_error.problems]
        message = "\n".join(problems)
        conditions = [
            (names.CONDITION_READY, False, names.REASON_INVALID_SPEC, message),
            (names.CONDITION_PROGRESSING, False, names.REASON_INVALID_SPEC, message),
            (names.CONDITION_DEGRADED, True, names.REASON_INVALID_SPEC, message),
        ]
        if len(problems) > MAX_PROBLEMS:
            problems = [*problems[:MAX_PROBLEMS], f"... and {len(problems) - MAX_PROBLEMS} more"]
        fields: dict[str, Any] = {"phase": names.PHASE_INVALID, "readyRoles": "-", "roles": []}
        return _status(fields, problems, conditions, generation, now, previous_conditions)
    pipeline = pipeline_or_error
    by_name = {(sts.get("metadata") or {}).get("name"): sts for sts in observed_statefulsets}
    units = model.workloads(pipeline, options)
    states = {unit.name: _unit_state(pipeline, unit, by_name) for unit in units}
    home = {role.name: unit.name for unit in units for role in unit.roles}
    roles = [_role_entry(name, home[name], states[home[name]]) for name in pipeline.role_names]
    ready = sum(1 for name in pipeline.role_names if states[home[name]].is_ready)
    conditions = _conditions(pipeline, home, states, now, previous_conditions, progress_deadline)
    fields = {
        "phase": _phase(conditions, states),
        "readyRoles": f"{ready}/{len(roles)}",
        "roles": roles,
    }
    if pipeline.gateway.enabled:
        namespace = pipeline.namespace or ""
        deployment = by_name.get(gateway.deployment_name(pipeline)) or {}
        fields["gateway"] = {
            "url": gateway.url(pipeline, namespace) if namespace else "",
            "desired": pipeline.gateway.replicas,
            "ready": int((deployment.get("status") or {}).get("readyReplicas") or 0),
        }
        for problem in spec.warnings(pipeline):  # an unauthenticated gateway, said plainly
            fields["gateway"]["warning"] = f"{problem.path}: {problem.reason}"
    return _status(fields, [], conditions, generation, now, previous_conditions)


def _role_entry(role: str, workload: str, state: UnitState) -> dict[str, Any]:
    return {
        "name": role,
        "workload": workload,
        "desired": state.desired,
        "current": state.current,
        "ready": state.ready,
        "updated": state.updated,
    }


def _conditions(
    pipeline: Pipeline,
    home: Mapping[str, str],
    states: Mapping[str, UnitState],
    now: datetime.datetime,
    previous: Sequence[Mapping[str, Any]],
    deadline: float,
) -> list[Condition]:
    def roles_where(test: str) -> str:
        chosen = [
            f"{role} ({states[home[role]].describe(home[role])})"
            for role in pipeline.role_names
            if _matches(states[home[role]], test)
        ]
        return ", ".join(chosen)

    missing, rolling = roles_where("missing"), roles_where("rolling")
    not_ready = roles_where("not-ready")
    kind = names.CONDITION_PROGRESSING
    before = _find(previous, kind)
    starting = before is None or before.get("status") == "True"
    if missing:
        progress: Condition = (kind, True, names.REASON_CHILD_MISSING, f"waiting for: {missing}")
    elif rolling:
        progress = (kind, True, names.REASON_ROLLOUT_IN_PROGRESS, f"rolling out: {rolling}")
    elif not_ready and starting:
        message = f"waiting for ready replicas: {not_ready}"
        progress = (kind, True, names.REASON_ROLLOUT_IN_PROGRESS, message)
    else:
        progress = (kind, False, names.REASON_ROLLOUT_COMPLETE, "")
    if not_ready:
        reason = progress[2] if progress[1] else names.REASON_ROLES_NOT_READY
        ready: Condition = (names.CONDITION_READY, False, reason, f"not ready: {not_ready}")
    else:
        ready = (names.CONDITION_READY, True, names.REASON_ALL_ROLES_READY, "")
    return [ready, progress, _degraded(progress, ready, now, previous, deadline)]


def _matches(state: UnitState, test: str) -> bool:
    if test == "missing":
        return not state.present
    if test == "rolling":
        return state.rolling
    return not state.is_ready


def _degraded(
    progress: Condition,
    ready: Condition,
    now: datetime.datetime,
    previous: Sequence[Mapping[str, Any]],
    deadline: float,
) -> Condition:
    kind = names.CONDITION_DEGRADED
    if progress[1]:
        since = _true_since(previous, names.CONDITION_PROGRESSING) or now
        elapsed = (now - since).total_seconds()
        if elapsed > deadline:
            message = f"progressing for {elapsed:.0f}s (deadline {deadline:.0f}s); {progress[3]}"
            return (kind, True, names.REASON_PROGRESS_DEADLINE, message)
        return (kind, False, progress[2], "")
    if not ready[1]:
        return (kind, True, names.REASON_ROLES_NOT_READY, ready[3])
    return (kind, False, names.REASON_ALL_ROLES_READY, "")


def _phase(conditions: Sequence[Condition], states: Mapping[str, UnitState]) -> str:
    status = {kind: value for kind, value, _, _ in conditions}
    if status[names.CONDITION_DEGRADED]:
        return names.PHASE_DEGRADED
    if not any(state.present for state in states.values()):
        return names.PHASE_PENDING
    if status[names.CONDITION_PROGRESSING]:
        return names.PHASE_PROGRESSING
    return names.PHASE_READY


def _status(
    fields: dict[str, Any],
    problems: list[str],
    conditions: Sequence[Condition],
    generation: int | None,
    now: datetime.datetime,
    previous: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if generation is not None:
        result["observedGeneration"] = generation
    result.update(fields)
    result["problems"] = problems
    result["conditions"] = [_condition(c, generation, now, previous) for c in conditions]
    return result


def _condition(
    condition: Condition,
    generation: int | None,
    now: datetime.datetime,
    previous: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    kind, value, reason, message = condition
    status = "True" if value else "False"
    before = _find(previous, kind)
    stamp = times.format_time(now)
    if before is not None and before.get("status") == status and before.get("lastTransitionTime"):
        stamp = str(before["lastTransitionTime"])
    result: dict[str, Any] = {"type": kind, "status": status}
    if generation is not None:
        result["observedGeneration"] = generation
    result.update({"lastTransitionTime": stamp, "reason": reason, "message": message})
    return result


def _find(conditions: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def _true_since(conditions: Sequence[Mapping[str, Any]], kind: str) -> datetime.datetime | None:
    before = _find(conditions, kind)
    if before is None or before.get("status") != "True":
        return None
    return times.parse_time(before.get("lastTransitionTime"))


def with_conflicts(
    built: Mapping[str, Any],
    conflicts: Sequence[apply.Conflict],
    *,
    now: datetime.datetime,
    previous: Mapping[str, Any],
) -> dict[str, Any]:
    """`built` (from status.build_status) with Degraded True/ChildConflict and phase Degraded
    when planned children are held by someone else."""
    result = dict(built)
    if not conflicts:
        return result
    message = "; ".join(str(c) for c in conflicts)
    before = next(
        (c for c in previous.get("conditions") or () if c.get("type") == names.CONDITION_DEGRADED),
        None,
    )
    stamp = times.format_time(now)
    if before is not None and before.get("status") == "True" and before.get("lastTransitionTime"):
        stamp = str(before["lastTransitionTime"])
    conditions = []
    for condition in result.get("conditions") or ():
        if condition.get("type") == names.CONDITION_DEGRADED:
            condition = {
                **condition,
                "status": "True",
                "lastTransitionTime": stamp,
                "reason": REASON_CHILD_CONFLICT,
                "message": message,
            }
        conditions.append(condition)
    result["conditions"] = conditions
    result["phase"] = names.PHASE_DEGRADED
    return result


def condition(built: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    """The condition of type `kind` in a built status ({} when absent)."""
    return next((c for c in built.get("conditions") or () if c.get("type") == kind), {})


def recheck_delay(
    built: Mapping[str, Any], *, now: datetime.datetime, deadline: float
) -> float | None:
    """Seconds until the progress deadline of a Progressing pipeline passes (then its status
    must be rebuilt even if nothing else happens); None when not progressing or already past
    the deadline."""
    progressing = condition(built, names.CONDITION_PROGRESSING)
    if progressing.get("status") != "True":
        return None
    since = times.parse_time(progressing.get("lastTransitionTime")) or now
    remaining = deadline - (now - since).total_seconds()
    if remaining < 0:
        return None  # already past: the status says ProgressDeadlineExceeded
    return remaining + 1.0  # lastTransitionTime has whole seconds
