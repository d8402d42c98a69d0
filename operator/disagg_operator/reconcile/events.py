"""The Events a reconcile posts on its pipeline, pure: what it created, updated, deleted and
could not take over, an invalid spec, entering Ready or Degraded, weakened pods, a stalled
rollout step; and `kopf_event`, the default poster (kopf's)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, cast

import kopf

from disagg_core.spec import Pipeline, pod_policy_findings
from disagg_operator import names
from disagg_operator.reconcile import apply, status

# Event reasons.
EVENT_CREATED: Final = "Created"
EVENT_UPDATED: Final = "Updated"
EVENT_DELETED: Final = "Deleted"
EVENT_CONFLICT: Final = "ChildConflict"
EVENT_INVALID: Final = "InvalidSpec"
EVENT_READY: Final = "PipelineReady"
EVENT_DEGRADED: Final = "PipelineDegraded"
EVENT_FAILED: Final = "ReconcileFailed"
EVENT_PRIVILEGED: Final = "PrivilegedPodTemplate"
EVENT_ROLLOUT_STALLED: Final = "RolloutStalled"
MAX_EVENT_MESSAGE: Final = 1024

Event = tuple[str, str, str]  # type (Normal, Warning), reason, message
PostEvent = Callable[[Mapping[str, Any], str, str, str], None]


def kopf_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """Post through kopf's event poster (needs kopf's context: call from a handler)."""
    raw = cast(kopf.RawBody, dict(body))
    kopf.event(kopf.Body(raw), type=type_, reason=reason, message=message)


def privileged_events(pipeline: Pipeline, warned: Sequence[str]) -> list[Event]:
    """A Warning when the pipeline's opted-in podTemplates weaken its pods in a way not
    warned about before (by this operator process)."""
    found = [str(problem) for problem in pod_policy_findings(pipeline)]
    if not found or tuple(found) == tuple(warned):
        return []
    message = (
        f'{names.ANNOTATION_ALLOW_PRIVILEGED_PODS}: "true" lets these podTemplate settings '
        "weaken the role pods: " + "; ".join(found)
    )
    return [("Warning", EVENT_PRIVILEGED, message)]


def decision_events(
    *,
    result: apply.ApplyResult | None,
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    known_conflicts: Sequence[apply.Conflict] = (),
) -> list[Event]:
    """The Events a reconcile posts on the pipeline: what it created, updated, deleted and
    could not take over; an invalid spec (when its problems are new); entering Ready or
    Degraded. Nothing when nothing changed, so a resume or a retry posts nothing new."""
    events: list[Event] = []
    if result is not None:
        for refs, reason, verb in (
            (result.created, EVENT_CREATED, "created"),
            (result.updated, EVENT_UPDATED, "updated"),
            (result.pruned, EVENT_DELETED, "deleted (no longer planned)"),
        ):
            if refs:
                events.append(("Normal", reason, f"{verb} {', '.join(str(r) for r in refs)}"))
        if result.conflicts and set(result.conflicts) != set(known_conflicts):
            message = "; ".join(str(c) for c in result.conflicts)
            events.append(("Warning", EVENT_CONFLICT, message))
    phase, was = after.get("phase"), before.get("phase")
    if phase == names.PHASE_INVALID:
        if was != phase or before.get("problems") != after.get("problems"):
            problems = after.get("problems") or []
            events.append(("Warning", EVENT_INVALID, "invalid spec: " + "; ".join(problems)))
    elif phase != was and phase == names.PHASE_READY:
        events.append(("Normal", EVENT_READY, f"all roles ready ({after.get('readyRoles')})"))
    elif phase != was and phase == names.PHASE_DEGRADED:
        degraded = status.condition(after, names.CONDITION_DEGRADED)
        message = f"{degraded.get('reason')}: {degraded.get('message')}"
        events.append(("Warning", EVENT_DEGRADED, message))
    return events
