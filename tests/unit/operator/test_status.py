"""The status builder: every phase and condition transition, lastTransitionTime, invalid specs."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from disagg_core import spec
from disagg_operator import names
from disagg_operator.k8s import times
from disagg_operator.plan import model
from disagg_operator.reconcile import status

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
Obj = dict[str, Any]


def _doc() -> Obj:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "p"},
        "spec": {
            "image": "img:1",
            "roles": [
                {"name": "a", "handler": "m:f"},
                {"name": "b", "handler": "m:g", "replicas": 2},
                {"name": "c", "handler": "m:h", "replicas": 2},
            ],
            "edges": [{"from": "a", "to": "b"}, {"from": "a", "to": "c"}],
            "colocation": [{"name": "bc", "roles": ["b", "c"]}],
        },
    }


PIPELINE = spec.parse_pipeline(_doc())


def sts(
    name: str,
    desired: int,
    *,
    ready: int | None = None,
    updated: int | None = None,
    current: int | None = None,
    generation: int = 1,
    observed: int | None = 1,
    revisions: tuple[str, str] = ("r1", "r1"),
) -> Obj:
    """A StatefulSet as the API returns it; by default settled with every replica ready."""
    state: Obj = {
        "replicas": desired if current is None else current,
        "readyReplicas": desired if ready is None else ready,
        "updatedReplicas": desired if updated is None else updated,
        "currentRevision": revisions[0],
        "updateRevision": revisions[1],
    }
    if observed is not None:
        state["observedGeneration"] = observed
    return {
        "metadata": {"name": name, "generation": generation},
        "spec": {"replicas": desired},
        "status": state,
    }


def settled() -> list[Obj]:
    return [sts("p-a", 1), sts("p-bc", 2)]


def build(observed: list[Obj], *, now: datetime.datetime = T0, previous: Any = ()) -> Obj:
    return status.build_status(
        PIPELINE, observed, generation=3, now=now, previous_conditions=previous
    )


def conditions(result: Obj) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in result["conditions"]}


def test_all_ready() -> None:
    result = build(settled())
    assert result["phase"] == names.PHASE_READY
    assert result["readyRoles"] == "3/3"
    assert result["observedGeneration"] == 3
    assert result["problems"] == []
    assert conditions(result) == {
        "Ready": ("True", "AllRolesReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AllRolesReady"),
    }
    assert result["roles"] == [
        {"name": "a", "workload": "p-a", "desired": 1, "current": 1, "ready": 1, "updated": 1},
        {"name": "b", "workload": "p-bc", "desired": 2, "current": 2, "ready": 2, "updated": 2},
        {"name": "c", "workload": "p-bc", "desired": 2, "current": 2, "ready": 2, "updated": 2},
    ]
    for condition in result["conditions"]:
        assert condition["lastTransitionTime"] == "2026-01-01T12:00:00Z"
        assert condition["observedGeneration"] == 3


def test_nothing_created_yet_is_pending() -> None:
    result = build([])
    assert result["phase"] == names.PHASE_PENDING
    assert result["readyRoles"] == "0/3"
    assert conditions(result) == {
        "Ready": ("False", "ChildMissing"),
        "Progressing": ("True", "ChildMissing"),
        "Degraded": ("False", "ChildMissing"),
    }
    ready = result["conditions"][0]
    assert "StatefulSet p-a missing" in ready["message"]
    assert result["roles"][0] == {
        "name": "a",
        "workload": "p-a",
        "desired": 1,
        "current": 0,
        "ready": 0,
        "updated": 0,
    }


def test_one_child_missing_is_progressing() -> None:
    result = build([sts("p-a", 1)])
    assert result["phase"] == names.PHASE_PROGRESSING
    assert result["readyRoles"] == "1/3"
    assert conditions(result)["Progressing"] == ("True", "ChildMissing")
    message = result["conditions"][1]["message"]
    assert "b (StatefulSet p-bc missing)" in message and "c (" in message


def test_pods_starting_is_progressing_then_degraded_after_a_rollout() -> None:
    starting = [sts("p-a", 1), sts("p-bc", 2, ready=0)]  # created and updated, not ready
    result = build(starting)
    assert result["phase"] == names.PHASE_PROGRESSING
    assert conditions(result) == {
        "Ready": ("False", "RolloutInProgress"),
        "Progressing": ("True", "RolloutInProgress"),
        "Degraded": ("False", "RolloutInProgress"),
    }
    assert "waiting for ready replicas: b (0/2 ready" in result["conditions"][1]["message"]
    done = build(settled(), previous=result["conditions"])
    assert done["phase"] == names.PHASE_READY
    # Once the rollout completed, losing ready replicas is degradation, not progress.
    broken = build([sts("p-a", 1), sts("p-bc", 2, ready=1)], previous=done["conditions"])
    assert broken["phase"] == names.PHASE_DEGRADED
    assert conditions(broken) == {
        "Ready": ("False", "RolesNotReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("True", "RolesNotReady"),
    }
    assert broken["readyRoles"] == "1/3"


def test_rollout_in_progress() -> None:
    observed = [sts("p-a", 1), sts("p-bc", 2, updated=1, ready=1, revisions=("r1", "r2"))]
    result = build(observed)
    assert result["phase"] == names.PHASE_PROGRESSING
    assert conditions(result) == {
        "Ready": ("False", "RolloutInProgress"),
        "Progressing": ("True", "RolloutInProgress"),
        "Degraded": ("False", "RolloutInProgress"),
    }
    assert "b (1/2 ready, 1 updated)" in result["conditions"][1]["message"]


def test_stale_generation_is_progressing_even_when_ready() -> None:
    result = build([sts("p-a", 1, generation=2, observed=1), sts("p-bc", 2)])
    assert conditions(result)["Progressing"] == ("True", "RolloutInProgress")
    assert conditions(result)["Ready"] == ("True", "AllRolesReady")
    assert result["phase"] == names.PHASE_PROGRESSING
    assert build([sts("p-a", 1, observed=None), sts("p-bc", 2)])["phase"] == "Progressing"


def test_scaling_up_is_progressing() -> None:
    result = build([sts("p-a", 1), sts("p-bc", 4, current=2, ready=2, updated=2)])
    assert conditions(result)["Progressing"] == ("True", "RolloutInProgress")
    assert conditions(result)["Ready"] == ("False", "RolloutInProgress")
    assert result["roles"][1]["desired"] == 4


def test_progress_deadline() -> None:
    observed = [sts("p-a", 1), sts("p-bc", 2, updated=1, ready=1)]
    first = build(observed, now=T0)
    later = T0 + datetime.timedelta(seconds=status.DEFAULT_PROGRESS_DEADLINE - 1)
    assert build(observed, now=later, previous=first["conditions"])["phase"] == "Progressing"
    late = T0 + datetime.timedelta(seconds=status.DEFAULT_PROGRESS_DEADLINE + 1)
    result = build(observed, now=late, previous=first["conditions"])
    assert result["phase"] == names.PHASE_DEGRADED
    assert conditions(result)["Degraded"] == ("True", "ProgressDeadlineExceeded")
    assert "deadline 600s" in result["conditions"][2]["message"]


def test_last_transition_time_changes_only_with_status() -> None:
    first = build([], now=T0)
    t1 = T0 + datetime.timedelta(minutes=1)
    second = build([sts("p-a", 1)], now=t1, previous=first["conditions"])
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    # Ready stays False and Progressing stays True although their reasons could change.
    assert times == {
        "Ready": "2026-01-01T12:00:00Z",
        "Progressing": "2026-01-01T12:00:00Z",
        "Degraded": "2026-01-01T12:00:00Z",
    }
    t2 = T0 + datetime.timedelta(minutes=2)
    third = build(settled(), now=t2, previous=second["conditions"])
    times = {c["type"]: c["lastTransitionTime"] for c in third["conditions"]}
    assert times == {
        "Ready": "2026-01-01T12:02:00Z",
        "Progressing": "2026-01-01T12:02:00Z",
        "Degraded": "2026-01-01T12:00:00Z",
    }
    t3 = T0 + datetime.timedelta(minutes=3)
    fourth = build([sts("p-a", 1, ready=0), sts("p-bc", 2)], now=t3, previous=third["conditions"])
    assert conditions(fourth)["Degraded"] == ("True", "RolesNotReady")
    times = {c["type"]: c["lastTransitionTime"] for c in fourth["conditions"]}
    assert times["Degraded"] == times["Ready"] == "2026-01-01T12:03:00Z"
    assert times["Progressing"] == "2026-01-01T12:02:00Z"


def test_invalid_spec() -> None:
    doc = _doc()
    doc["spec"]["edges"].append({"from": "c", "to": "nobody"})
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_pipeline(doc)
    result = status.build_status(caught.value, settled(), generation=4, now=T0)
    assert result["phase"] == names.PHASE_INVALID
    assert result["readyRoles"] == "-"
    assert result["roles"] == []
    assert result["problems"] == ["spec.edges[2].to: unknown role 'nobody'"]
    assert conditions(result) == {
        "Ready": ("False", "InvalidSpec"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }
    assert result["conditions"][2]["message"] == "spec.edges[2].to: unknown role 'nobody'"
    assert result["observedGeneration"] == 4


def test_invalid_then_fixed() -> None:
    error = spec.SpecError([spec.Problem("spec.edges", "bad")])
    invalid = status.build_status(error, [], generation=1, now=T0)
    t1 = T0 + datetime.timedelta(seconds=30)
    fixed = build(settled(), now=t1, previous=invalid["conditions"])
    assert fixed["phase"] == names.PHASE_READY
    times = {c["type"]: c["lastTransitionTime"] for c in fixed["conditions"]}
    assert times == {
        "Ready": "2026-01-01T12:00:30Z",
        "Progressing": "2026-01-01T12:00:00Z",  # False before and after
        "Degraded": "2026-01-01T12:00:30Z",
    }


def test_many_problems_are_capped() -> None:
    error = spec.SpecError([spec.Problem(f"spec.roles[{i}]", "bad") for i in range(80)])
    result = status.build_status(error, [], generation=None, now=T0)
    assert len(result["problems"]) == status.MAX_PROBLEMS + 1
    assert result["problems"][-1] == "... and 30 more"
    assert "observedGeneration" not in result
    assert "observedGeneration" not in result["conditions"][0]


def test_replica_overrides_and_unrelated_statefulsets() -> None:
    options = model.PlanOptions(replicas={"bc": 3})
    observed = [*settled(), sts("other", 5, ready=0)]
    result = status.build_status(PIPELINE, observed, generation=1, now=T0, options=options)
    assert result["phase"] == names.PHASE_READY  # desired comes from the StatefulSet itself
    missing = status.build_status(PIPELINE, [], generation=1, now=T0, options=options)
    assert missing["roles"][1]["desired"] == 3


def test_status_matches_the_crd(crd_checker: Any) -> None:
    """Every status this module writes is valid under the CRD's status schema."""
    error = spec.SpecError([spec.Problem("spec.edges", "bad")])
    results = [
        build(settled()),
        build([]),
        build([sts("p-a", 1), sts("p-bc", 2, updated=1)]),
        status.build_status(error, [], generation=1, now=T0),
    ]
    for result in results:
        doc = {**_doc(), "status": result}
        assert crd_checker.errors(doc) == []
        assert result["phase"] in names.PHASES
        assert {c["reason"] for c in result["conditions"]} <= set(names.REASONS)


def test_time_helpers() -> None:
    assert times.format_time(T0) == "2026-01-01T12:00:00Z"
    assert times.parse_time("2026-01-01T12:00:00Z") == T0
    assert times.parse_time("garbage") is None
    with pytest.raises(ValueError, match="timezone"):
        times.format_time(datetime.datetime(2026, 1, 1))


def test_gateway_url_and_readiness_apart_from_the_roles() -> None:
    doc = _doc()
    doc["metadata"]["namespace"] = "ml"
    doc["spec"]["gateway"] = {"replicas": 2}
    pipeline = spec.parse_pipeline(doc)
    deployment = {"metadata": {"name": "p-gateway"}, "status": {"readyReplicas": 1}}
    result = status.build_status(pipeline, [*settled(), deployment], generation=3, now=T0)
    warning = result["gateway"].pop("warning")  # no auth: said plainly
    assert warning.startswith("spec.gateway.auth: the gateway is unauthenticated")
    assert result["gateway"] == {"url": "http://p.ml.svc:8080", "desired": 2, "ready": 1}
    assert result["phase"] == names.PHASE_READY  # the roles decide the conditions
    missing = status.build_status(pipeline, settled(), generation=3, now=T0)
    assert missing["gateway"]["ready"] == 0
    doc["spec"]["gateway"] = {"enabled": False}
    off = status.build_status(spec.parse_pipeline(doc), settled(), generation=3, now=T0)
    assert "gateway" not in off
