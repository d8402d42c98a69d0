"""The reconciler's pure parts: conflicts in the status, which Events a reconcile posts, when
the progress deadline needs a recheck, ownership and pruning rules, kopf settings, the
`disagg operator` command line; and the metrics of a failing reconcile."""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
from typing import Any, cast

import kopf
import pytest

from disagg_operator import names
from disagg_operator.app import handlers, main
from disagg_operator.k8s import client as kube
from disagg_operator.k8s import times
from disagg_operator.plan import model
from disagg_operator.reconcile import apply, reconcile, status, tracked
from disagg_operator.reconcile import events as reconcile_events
from disagg_operator.reconcile.metrics import Metrics
from disagg_runtime import cli

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
OWNER = model.Owner(name="p", uid="uid-1")
REF = kube.ObjectRef("v1", "Service", "ns", "p-a")


def built(phase: str = names.PHASE_READY, **conditions: tuple[str, str]) -> dict[str, Any]:
    """A status with the given conditions as {type: (status, reason)}."""
    return {
        "phase": phase,
        "readyRoles": "2/2",
        "problems": [],
        "conditions": [
            {
                "type": kind,
                "status": value,
                "reason": reason,
                "message": "",
                "lastTransitionTime": "2026-01-02T03:00:00Z",
            }
            for kind, (value, reason) in conditions.items()
        ],
    }


def child(uid: str | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p-a", "namespace": "ns", "labels": labels or {}}
    if uid is not None:
        meta["ownerReferences"] = [
            {"kind": "DisaggregatedPipeline", "name": "x", "uid": uid, "controller": True}
        ]
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta}


# ---------------------------------------------------------------------------- conflicts


def test_conflicts_degrade_the_status_and_keep_the_transition_time() -> None:
    ok = built(Degraded=("False", names.REASON_ALL_ROLES_READY))
    assert status.with_conflicts(ok, [], now=NOW, previous={}) == ok
    conflict = apply.Conflict(REF, "controlled by DisaggregatedPipeline/q, uid 2")
    degraded = status.with_conflicts(ok, [conflict], now=NOW, previous={})
    assert degraded["phase"] == names.PHASE_DEGRADED
    (condition,) = degraded["conditions"]
    assert condition["status"] == "True"
    assert condition["reason"] == status.REASON_CHILD_CONFLICT
    assert condition["message"] == str(conflict)
    assert "Service/p-a exists and is not this pipeline's" in condition["message"]
    assert condition["lastTransitionTime"] == times.format_time(NOW)
    again = status.with_conflicts(ok, [conflict], now=NOW, previous=degraded)
    later = NOW + datetime.timedelta(minutes=5)
    kept = status.with_conflicts(ok, [conflict], now=later, previous=again)
    assert kept["conditions"][0]["lastTransitionTime"] == times.format_time(NOW)


# ---------------------------------------------------------------------------- events


def test_events_name_what_changed_and_nothing_else() -> None:
    same = built()
    result = apply.ApplyResult(
        created=(REF,),
        updated=(kube.ObjectRef("apps/v1", "StatefulSet", "ns", "p-b"),),
        pruned=(kube.ObjectRef("v1", "Service", "ns", "p-c"),),
    )
    events = reconcile_events.decision_events(result=result, before=same, after=same)
    assert events == [
        ("Normal", "Created", "created Service/p-a"),
        ("Normal", "Updated", "updated StatefulSet/p-b"),
        ("Normal", "Deleted", "deleted (no longer planned) Service/p-c"),
    ]
    quiet = apply.ApplyResult(unchanged=(REF,))
    assert reconcile_events.decision_events(result=quiet, before=same, after=same) == []
    assert reconcile_events.decision_events(result=None, before=same, after=same) == []


def test_conflict_events_only_when_the_conflicts_change() -> None:
    conflict = apply.Conflict(REF, "someone")
    result = apply.ApplyResult(conflicts=(conflict,))
    first = reconcile_events.decision_events(result=result, before={}, after={})
    assert first == [("Warning", "ChildConflict", str(conflict))]
    repeat = reconcile_events.decision_events(
        result=result, before={}, after={}, known_conflicts=[conflict]
    )
    assert repeat == []


def test_invalid_spec_events_only_for_new_problems() -> None:
    invalid = {"phase": names.PHASE_INVALID, "problems": ["spec.edges[0].to: unknown role"]}
    events = reconcile_events.decision_events(result=None, before={}, after=invalid)
    assert events == [("Warning", "InvalidSpec", "invalid spec: spec.edges[0].to: unknown role")]
    assert reconcile_events.decision_events(result=None, before=invalid, after=invalid) == []
    other = {**invalid, "problems": ["spec.roles: a cycle"]}
    assert len(reconcile_events.decision_events(result=None, before=invalid, after=other)) == 1


def test_phase_events_on_entering_ready_or_degraded() -> None:
    progressing = {"phase": names.PHASE_PROGRESSING}
    ready = built(names.PHASE_READY)
    degraded = built(names.PHASE_DEGRADED, Degraded=("True", names.REASON_ROLES_NOT_READY))
    assert reconcile_events.decision_events(result=None, before=progressing, after=ready) == [
        ("Normal", "PipelineReady", "all roles ready (2/2)")
    ]
    assert reconcile_events.decision_events(result=None, before=ready, after=degraded) == [
        ("Warning", "PipelineDegraded", "RolesNotReady: ")
    ]
    assert reconcile_events.decision_events(result=None, before=ready, after=progressing) == []


# ---------------------------------------------------------------------------- recheck


def test_a_recheck_is_due_when_the_progress_deadline_passes() -> None:
    ready = built(Progressing=("False", names.REASON_ROLLOUT_COMPLETE))
    assert status.recheck_delay(ready, now=NOW, deadline=600) is None
    moving = built(Progressing=("True", names.REASON_ROLLOUT_IN_PROGRESS))  # since 03:00:00
    assert status.recheck_delay(moving, now=NOW, deadline=600) == pytest.approx(356.0)
    assert status.recheck_delay(moving, now=NOW, deadline=60) is None  # already past


# ---------------------------------------------------------------------------- ownership


def test_ownership_rules() -> None:
    assert apply.ownership(None, OWNER) == "absent"
    assert apply.ownership(child("uid-1"), OWNER) == "ours"
    assert apply.ownership(child(None, {names.LABEL_PIPELINE: "p"}), OWNER) == "adopt"
    foreign = apply.ownership(child("uid-2"), OWNER)
    assert isinstance(foreign, apply.Conflict) and "uid-2" in foreign.holder
    stray = apply.ownership(child(None, {names.LABEL_PIPELINE: "q"}), OWNER)
    assert isinstance(stray, apply.Conflict)
    not_controller = child("uid-1")
    not_controller["metadata"]["ownerReferences"][0]["controller"] = False
    assert isinstance(apply.ownership(not_controller, OWNER), apply.Conflict)


def test_only_our_labelled_children_are_prunable() -> None:
    labels = model.child_selector("p")
    assert apply.prunable(child("uid-1", labels), OWNER)
    assert not apply.prunable(child("uid-2", labels), OWNER)
    assert not apply.prunable(child("uid-1", {names.LABEL_PIPELINE: "p"}), OWNER)
    assert not apply.prunable(child(None, labels), OWNER)


def test_paths_and_status_comparison() -> None:
    assert kube.collection_path("v1", "ConfigMap", "ns") == "/api/v1/namespaces/ns/configmaps"
    sts = kube.ObjectRef("apps/v1", "StatefulSet", "ns", "p-a")
    assert sts.path("scale") == "/apis/apps/v1/namespaces/ns/statefulsets/p-a/scale"
    pipeline = apply.pipeline_ref("ns", "p")
    assert pipeline.path("status") == (
        "/apis/disagg.dev/v1alpha1/namespaces/ns/disaggregatedpipelines/p/status"
    )
    assert not apply.status_differs({"phase": "Ready", "scaleDecisions": [1]}, {"phase": "Ready"})
    assert apply.status_differs({"phase": "Ready"}, {"phase": "Degraded"})
    assert apply.status_differs(None, {"phase": "Ready"})
    assert kube.ApiError(503, "ServiceUnavailable", "x").retryable
    assert not kube.ApiError(403, "Forbidden", "x").retryable


def test_the_owning_pipeline_of_a_statefulset() -> None:
    sts = child("uid-1")
    sts["metadata"]["ownerReferences"][0]["apiVersion"] = names.PIPELINE_API_VERSION
    assert handlers.owning_pipeline(sts) == "x"
    sts["metadata"]["ownerReferences"][0]["apiVersion"] = "example.dev/v1"
    assert handlers.owning_pipeline(sts) is None
    assert handlers.owning_pipeline(child(None)) is None


# ---------------------------------------------------------------------------- kopf settings


def test_kopf_keeps_its_bookkeeping_in_annotations_of_its_own_prefix() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    assert settings.persistence.finalizer == "operator.disagg.dev/finalizer"
    progress = settings.persistence.progress_storage
    diffbase = settings.persistence.diffbase_storage
    assert isinstance(progress, kopf.AnnotationsProgressStorage)
    assert isinstance(diffbase, kopf.AnnotationsDiffBaseStorage)
    assert progress.prefix == diffbase.prefix == "operator.disagg.dev"
    assert not names.ANNOTATION_GPU_MODE.startswith(progress.prefix + "/")
    assert settings.posting.reporting_component == names.MANAGER
    # kopf waits longer than its default 5 s for its own patches to come back through a
    # lagging watch (else it runs the handler again on the older version)
    assert settings.persistence.consistency_timeout == handlers.CONSISTENCY_TIMEOUT > 5.0
    # an idle worker (and the last body it processed) goes sooner than kopf's 5 s
    assert settings.queueing.idle_timeout == handlers.WORKER_IDLE_TIMEOUT < 5.0
    selectors = {
        (getattr(k, "group", None), getattr(k, "any_name", None)): v
        for k, v in settings.watching.label_selectors.items()
    }
    ours = "app.kubernetes.io/managed-by=disagg-operator,disagg.dev/pipeline"
    assert selectors.pop(("", "pods")) == "disagg.dev/pipeline,disagg.dev/role"
    # StatefulSets and the gateway Deployments (cached), and the Secrets and NetworkPolicies
    # watched for deletion: only ours
    assert set(selectors) == {
        ("apps", "statefulsets"),
        ("apps", "deployments"),
        ("", "secrets"),
        ("networking.k8s.io", "networkpolicies"),
    }
    assert set(selectors.values()) == {ours}


def test_clearing_progress_matches_kopf_and_leaves_the_essence_alone() -> None:
    ours = handlers.ProgressStorage(prefix=handlers.ANNOTATION_PREFIX)
    kopfs = kopf.AnnotationsProgressStorage(prefix=handlers.ANNOTATION_PREFIX)
    progress = f"{handlers.ANNOTATION_PREFIX}/reconcile"
    essences: list[dict[str, Any]] = [
        {
            "spec": {"roles": [{"name": "a", "env": [{"name": "X", "value": "1"}]}]},
            "metadata": {
                "labels": {"app": "x"},
                "annotations": {progress: "{}", names.ANNOTATION_GPU_MODE: "shared"},
            },
        },
        {"spec": {"roles": []}, "metadata": {"annotations": {progress: "{}"}}},
        {"spec": {}, "metadata": {"labels": {"a": "b"}}},
        {"spec": {}},
    ]
    for essence in essences:
        before = copy.deepcopy(essence)
        cleared = ours.clear(essence=cast(kopf.BodyEssence, essence))
        assert cleared == kopfs.clear(essence=cast(kopf.BodyEssence, copy.deepcopy(essence)))
        assert essence == before  # the caller's essence is not changed
        assert progress not in str(cleared)


def test_an_explicit_connection_is_used_as_is() -> None:
    info = kopf.ConnectionInfo(server="http://127.0.0.1:1")
    assert handlers.login(info) is info


def test_no_finalizer_and_no_delete_handler_are_registered() -> None:
    operator = main.build(main.OperatorConfig())
    registry = operator.registry
    changing = registry._changing.get_all_handlers()  # kopf has no public listing
    reasons = {str(r) for h in changing for r in (h.reason,) if r is not None}
    assert "delete" not in reasons
    assert not any(h.requires_finalizer for h in changing)
    assert registry._spawning.get_all_handlers() == []  # no timers/daemons (they add one)


# ---------------------------------------------------------------------------- command line


def parse(*argv: str) -> argparse.Namespace:
    return cli._build_parser().parse_args(["operator", *argv])


def test_operator_command_line_defaults() -> None:
    config = main.config_from_args(parse())
    assert config.clusterwide and config.namespaces == ()
    assert (config.liveness_port, config.metrics_port) == (8080, 9090)
    assert config.kopf_arguments() == {
        "clusterwide": True,
        "namespaces": (),
        "standalone": None,
        "peering_name": None,
        "priority": 0,
        "liveness_endpoint": "http://0.0.0.0:8080/healthz",
    }


def test_operator_command_line_options() -> None:
    args = parse(
        "--namespace=a",
        "--namespace=team-*",
        "--peering=disagg",
        "--priority=10",
        "--liveness-port=0",
        "--gpu-mode=none",
        "--cluster-domain=example.org",
        "--progress-deadline=30",
    )
    config = main.config_from_args(args)
    assert config.namespaces == ("a", "team-*") and not config.clusterwide
    arguments = config.kopf_arguments()
    assert arguments["peering_name"] == "disagg" and arguments["priority"] == 10
    assert arguments["liveness_endpoint"] is None
    assert config.options == model.PlanOptions(cluster_domain="example.org", gpu_mode="none")
    beta = main.config_from_args(parse("--dra-api-version=resource.k8s.io/v1beta2"))
    assert beta.options.dra_api_version == "resource.k8s.io/v1beta2"
    assert config.progress_deadline == 30
    assert main.config_from_args(parse("--standalone")).kopf_arguments()["standalone"] is True


@pytest.mark.parametrize(
    "argv", [("--namespace=a", "--all-namespaces"), ("--peering=x", "--standalone")]
)
def test_operator_command_line_exclusions(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)


# ---------------------------------------------------------------------------- metrics


@pytest.mark.asyncio
async def test_a_failed_reconcile_is_timed_and_counted() -> None:
    metrics = Metrics()
    reconciler = reconcile.Reconciler(api=kube.Api(), metrics=metrics)
    with pytest.raises(kube.ApiError):
        await reconciler.reconcile("ns", "p")
    errors = {"kind": "spec", "reason": "NotLoggedIn"}
    assert metrics.value("disagg_operator_reconcile_errors_total", errors) == 1
    count = metrics.value("disagg_operator_reconcile_duration_seconds_count", {"kind": "spec"})
    assert count == 1
    assert metrics.value("disagg_operator_pipelines_managed") == 1
    reconciler.forget("ns", "p")
    assert metrics.value("disagg_operator_pipelines_managed") == 0
    await reconciler.close()


@pytest.mark.asyncio
async def test_a_forgotten_or_closed_pipeline_is_not_rechecked() -> None:
    """Forgetting a pipeline cancels every refresh scheduled for it, the rollout step's
    deadline too (it used to fire after `forget`, and the refresh it spawned tracked the
    pipeline again); closing the reconciler cancels those of every pipeline."""
    reconciler = reconcile.Reconciler(api=kube.Api())
    refreshed: list[tuple[str, str]] = []

    async def refresh(key: tuple[str, str]) -> None:
        refreshed.append(key)

    reconciler.scheduler.refresh = refresh
    for name in ("p", "q"):
        timers = reconciler.states.setdefault(("ns", name), tracked.PipelineState()).timers
        reconciler.scheduler.recheck(("ns", name), timers, 0.05)
        reconciler.scheduler.recheck_step(("ns", name), timers, 0.05)
    reconciler.forget("ns", "p")
    await asyncio.sleep(0.01)
    await reconciler.close()
    await asyncio.sleep(0.2)
    assert refreshed == []
    assert ("ns", "p") not in reconciler.states
