"""The real operator (kopf, in this event loop) against the emulator with the real CRD:
children, the env contract, status, Events, edits, pruning, deletion, invalid specs,
conflicts, restarts and the progress deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import kmock
import pytest

from disagg_core import contract, spec
from disagg_core.spec.fields import SpecError
from disagg_operator import names
from disagg_operator.app import handlers
from disagg_operator.plan import manifests, model, planner
from disagg_operator.reconcile import events as reconcile_events
from disagg_operator.reconcile import reads
from disagg_operator.reconcile.metrics import Metrics
from disagg_operator.reconcile.status import REASON_CHILD_CONFLICT
from tests.integration import operator_support as s
from tests.k8s.server import EmulatorThread

pytestmark = pytest.mark.asyncio
NAME = "text-to-video"
NS = s.NS
UNITS = ("encoder", "denoiser", "decoder")
ALL_CHILDREN = {
    "ConfigMap/text-to-video-topology",
    *(f"Service/{NAME}-{u}" for u in UNITS),
    *(f"StatefulSet/{NAME}-{u}" for u in UNITS),
    f"Service/{NAME}",  # the gateway's
    f"Deployment/{NAME}-gateway",
}


async def created(k8s: EmulatorThread, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """Create the pipeline and wait for its children and a first status."""
    doc = doc or s.example()
    name = doc["metadata"]["name"]
    obj = await s.call(k8s.create, doc, NS)
    await s.until(k8s, lambda: s.pipeline_status(k8s, name).get("phase"), "a first status")
    return obj


async def test_create_makes_the_planned_children_with_the_contract(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    metrics = Metrics()
    async with s.running_operator(k8s, metrics=metrics):
        pipeline_obj = await created(k8s)
        await s.until(k8s, lambda: set(s.children(k8s, NAME)) == ALL_CHILDREN, "all children")
        kids = s.children(k8s, NAME)
        status = s.pipeline_status(k8s, NAME)

        # the same objects as `disagg render` plans (server-set metadata aside), with the
        # hash of the peer key the operator made
        for policy in s.guards(k8s, NAME, "NetworkPolicy"):  # the roles' and the gateway's
            kids[f"NetworkPolicy/{policy['metadata']['name']}"] = policy
        (secret,) = s.guards(k8s, NAME, "Secret")
        digest = manifests.peer_key_digest(reads.peer_key_text(secret))
        pipeline = spec.parse_pipeline(s.example())
        owner = model.Owner.of(pipeline_obj)
        for planned in planner.plan(pipeline, namespace=NS, owner=owner, peer_key_hash=digest):
            stored = kids[f"{planned['kind']}/{planned['metadata']['name']}"]
            assert {k: v for k, v in stored.items() if k not in ("metadata", "status")} == {
                k: v for k, v in planned.items() if k != "metadata"
            }
            for key in ("labels", "ownerReferences"):
                assert stored["metadata"][key] == planned["metadata"][key]

        for key, child in kids.items():
            meta = child["metadata"]
            assert meta["ownerReferences"] == [
                {
                    "apiVersion": names.PIPELINE_API_VERSION,
                    "kind": names.PIPELINE_KIND,
                    "name": NAME,
                    "uid": pipeline_obj["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ], key
            assert meta["labels"][names.LABEL_PIPELINE] == NAME
            assert meta["labels"][names.LABEL_MANAGED_BY] == names.MANAGER
            if meta["labels"][names.LABEL_COMPONENT] == "gateway":
                assert names.LABEL_ROLE not in meta["labels"]  # not a role: never autoscaled
            elif child["kind"] not in ("ConfigMap", "NetworkPolicy"):
                assert meta["labels"][names.LABEL_ROLE] in UNITS

        topology = contract.Topology.from_json(
            json.loads(kids[f"ConfigMap/{NAME}-topology"]["data"]["topology.json"])
        )
        for unit in UNITS:
            sts = kids[f"StatefulSet/{NAME}-{unit}"]
            template = sts["spec"]["template"]
            pod = template["spec"]
            assert sts["spec"]["selector"]["matchLabels"] == {
                names.LABEL_PIPELINE: NAME,
                names.LABEL_ROLE: unit,
            }
            assert template["metadata"]["labels"][names.LABEL_ROLE] == unit
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["automountServiceAccountToken"] is False
            (container,) = pod["containers"]
            assert container["image"] == "ghcr.io/disagg/runtime:0.1.0"
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"] == {"drop": ["ALL"]}
            metrics_port = next(p for p in container["ports"] if p["name"] == "metrics")
            assert container["readinessProbe"]["httpGet"] == {
                "path": "/readyz",
                "port": metrics_port["containerPort"],
            }
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes[mounts["/etc/disagg"]]["configMap"]["name"] == f"{NAME}-topology"
            for replica in range(sts["spec"]["replicas"]):
                env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
                pod_name = f"{sts['metadata']['name']}-{replica}"
                env[contract.PREFIX + "POD_NAME"] = pod_name  # the downward API's part
                parsed = contract.parse_env(env, topology)
                wanted = model.role_config(pipeline, unit, namespace=NS)
                assert parsed == dataclasses.replace(wanted, replica=replica, pod_name=pod_name)

        # status: observedGeneration, roles, conditions, phase
        assert status["observedGeneration"] == pipeline_obj["metadata"]["generation"]
        assert [r["name"] for r in status["roles"]] == list(UNITS)
        assert {r["name"]: r["desired"] for r in status["roles"]} == {
            "encoder": 1,
            "denoiser": 2,
            "decoder": 1,
        }
        assert status["phase"] == names.PHASE_PROGRESSING
        assert s.condition(status, "Ready")["status"] == "False"
        assert s.condition(status, "Progressing")["status"] == "True"
        assert s.condition(status, "Degraded")["status"] == "False"
        assert status["readyRoles"] == "0/3"

        # the test plays the StatefulSet controller: every replica becomes ready
        await s.call(s.mark_ready, k8s, NAME)
        await s.until(k8s, lambda: s.pipeline_status(k8s, NAME).get("phase") == "Ready", "Ready")
        status = s.pipeline_status(k8s, NAME)
        assert status["readyRoles"] == "3/3"
        assert s.condition(status, "Ready")["reason"] == names.REASON_ALL_ROLES_READY
        assert [r["ready"] for r in status["roles"]] == [1, 2, 1]
        await s.until(
            k8s,
            lambda: ("Normal", reconcile_events.EVENT_READY) in s.event_reasons(k8s, NAME),
            "the PipelineReady Event",
        )
        created_events = [e for e in s.events_of(k8s, NAME) if e["reason"] == "Created"]
        assert len(created_events) == 1
        for kid in ALL_CHILDREN:
            assert kid in created_events[0]["message"]
        assert metrics.value("disagg_operator_pipelines_managed") == 1
        count = metrics.value("disagg_operator_reconcile_duration_seconds_count", {"kind": "spec"})
        assert count is not None and count >= 1
    # no finalizer was ever put on the pipeline
    final = k8s.get(s.PIPELINES, NAME, NS)
    assert final is not None and not final["metadata"].get("finalizers")


async def test_editing_one_role_changes_only_its_statefulset(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    events: list[tuple[str, str, str]] = []
    async with s.running_operator(k8s, events=events):
        await created(k8s)
        await s.call(s.mark_ready, k8s, NAME)
        await s.until(k8s, lambda: s.pipeline_status(k8s, NAME).get("phase") == "Ready", "Ready")
        before = s.versions(s.children(k8s, NAME))

        image = "ghcr.io/disagg/runtime:0.2.0"
        patch = [{"op": "add", "path": "/spec/roles/1/image", "value": image}]
        await s.call(k8s.patch, s.PIPELINES, NAME, patch, NS, patch_type="json")

        def denoiser_image() -> bool:
            sts = k8s.get(s.STS, f"{NAME}-denoiser", NS) or {}
            containers = sts["spec"]["template"]["spec"]["containers"]
            return bool(containers[0]["image"] == image)

        await s.until(k8s, denoiser_image, "the denoiser's new image")
        await s.until(
            k8s,
            lambda: s.pipeline_status(k8s, NAME).get("observedGeneration") == 2,
            "status of generation 2",
        )
        after = s.versions(s.children(k8s, NAME))
        changed = {key for key in before if before[key] != after[key]}
        assert changed == {f"StatefulSet/{NAME}-denoiser"}
        # Events are posted right after the status write that the wait above saw
        updated = ("Normal", "Updated", f"updated StatefulSet/{NAME}-denoiser")
        await s.until(k8s, lambda: updated in events, "the Updated Event")
        # the rollout shows: the StatefulSet's generation moved past its observedGeneration
        status = s.pipeline_status(k8s, NAME)
        assert status["phase"] == names.PHASE_PROGRESSING
        assert "denoiser" in s.condition(status, "Progressing")["message"]

        scale: list[dict[str, Any]] = [
            {"op": "replace", "path": "/spec/roles/2/replicas", "value": 3}
        ]
        await s.call(k8s.patch, s.PIPELINES, NAME, scale, NS, patch_type="json")
        await s.until(
            k8s,
            lambda: (k8s.get(s.STS, f"{NAME}-decoder", NS) or {})["spec"]["replicas"] == 3,
            "three decoders",
        )
        await s.until(
            k8s,
            lambda: s.pipeline_status(k8s, NAME).get("observedGeneration") == 3,
            "status of generation 3",
        )
        final = s.versions(s.children(k8s, NAME))
        changed = {key for key in after if after[key] != final[key]}
        assert changed == {f"StatefulSet/{NAME}-decoder"}
        decoder = next(r for r in s.pipeline_status(k8s, NAME)["roles"] if r["name"] == "decoder")
        assert decoder["desired"] == 3

        await s.call(s.mark_ready, k8s, NAME)
        await s.until(k8s, lambda: s.pipeline_status(k8s, NAME).get("phase") == "Ready", "Ready")


async def test_a_removed_role_is_pruned_and_a_deleted_child_comes_back(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    doc = s.pipeline_doc("two", [{"name": "a"}, {"name": "b"}], edges=[{"from": "a", "to": "b"}])
    async with s.running_operator(k8s):
        await created(k8s, doc)
        await s.until(
            k8s, lambda: len(s.children(k8s, "two")) == 7, "seven children (two with the gateway)"
        )

        await s.call(k8s.delete, s.STS, "two-b", NS)
        await s.until(k8s, lambda: k8s.get(s.STS, "two-b", NS), "two-b re-created")

        patch = [{"op": "replace", "path": "/spec/roles", "value": doc["spec"]["roles"][:1]}]
        patch.append({"op": "replace", "path": "/spec/edges", "value": []})
        await s.call(k8s.patch, s.PIPELINES, "two", patch, NS, patch_type="json")
        await s.until(
            k8s,
            lambda: (
                set(s.children(k8s, "two"))
                == {"ConfigMap/two-topology", "Service/two-a", "StatefulSet/two-a"}
                | {"Service/two", "Deployment/two-gateway"}
            ),
            "b's Service and StatefulSet pruned",
        )
        await s.until(
            k8s,
            lambda: ("Normal", reconcile_events.EVENT_DELETED) in s.event_reasons(k8s, "two"),
            "a Deleted Event",
        )
        await s.until(
            k8s, lambda: [r["name"] for r in s.pipeline_status(k8s, "two")["roles"]] == ["a"], "a"
        )
        assert s.pipeline_status(k8s, "two")["observedGeneration"] == 2


async def test_the_gateway_deployment_is_watched(k8s_crd: EmulatorThread):
    """status.gateway follows the gateway Deployment's own events (no StatefulSet event,
    no recheck: the roles are ready), and a deleted gateway Deployment comes back."""
    k8s = k8s_crd
    deployment = f"{NAME}-gateway"
    async with s.running_operator(k8s):
        await created(k8s)
        await s.until(k8s, lambda: set(s.children(k8s, NAME)) == ALL_CHILDREN, "all children")
        await s.call(s.mark_ready, k8s, NAME)
        await s.until(k8s, lambda: s.pipeline_status(k8s, NAME).get("phase") == "Ready", "Ready")
        assert s.pipeline_status(k8s, NAME)["gateway"]["ready"] == 0
        await s.call(k8s.patch_status, s.DEPLOY, deployment, {"readyReplicas": 1}, NS)
        await s.until(
            k8s, lambda: s.pipeline_status(k8s, NAME)["gateway"]["ready"] == 1, "gateway ready"
        )
        await s.call(k8s.delete, s.DEPLOY, deployment, NS)
        await s.until(k8s, lambda: k8s.get(s.DEPLOY, deployment, NS), "the gateway re-created")
        await s.until(
            k8s, lambda: s.pipeline_status(k8s, NAME)["gateway"]["ready"] == 0, "not ready again"
        )


async def test_deleting_the_pipeline_deletes_every_child(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    async with s.running_operator(k8s) as operator:
        await created(k8s)
        await s.until(k8s, lambda: len(s.children(k8s, NAME)) == len(ALL_CHILDREN), "children")
        assert (NS, NAME) in operator.reconciler.states
        await s.call(k8s.delete, s.PIPELINES, NAME, NS)
        await s.until(k8s, lambda: not s.children(k8s, NAME), "garbage collection")
        assert k8s.get(s.PIPELINES, NAME, NS) is None
        await s.until(k8s, lambda: (NS, NAME) not in operator.reconciler.states, "forgotten")


INVALID_CASES = {
    "cycle": [
        {"from": "a", "to": "b"},
        {"from": "b", "to": "c"},
        {"from": "c", "to": "b"},
    ],
}


async def test_a_pipeline_the_crd_refuses_never_reaches_the_operator(k8s_crd: EmulatorThread):
    """An edge to an unknown role is the CRD's CEL rule's: the API server refuses it (422), so
    the operator's own check of it (test_spec) is for `disagg validate` and local runs."""
    roles = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
    edges = [{"from": "a", "to": "b"}, {"from": "b", "to": "nowhere"}]
    doc = s.pipeline_doc("unknown-target", roles, edges=edges)
    with pytest.raises(SpecError):
        spec.parse_pipeline(doc)
    with pytest.raises(kmock.KubernetesError) as refused:
        await s.call(k8s_crd.create, doc, NS)
    assert refused.value.status == 422
    assert "spec.edges: Invalid value" in str(refused.value.message)
    assert k8s_crd.get(s.PIPELINES, "unknown-target", NS) is None


@pytest.mark.parametrize("case", sorted(INVALID_CASES))
async def test_an_invalid_pipeline_gets_no_children_and_says_why(
    k8s_crd: EmulatorThread, case: str
):
    k8s = k8s_crd
    roles = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
    doc = s.pipeline_doc(case, roles, edges=INVALID_CASES[case])
    with pytest.raises(SpecError) as invalid:
        spec.parse_pipeline(doc)
    expected = [f"{p.path}: {p.reason}" for p in invalid.value.problems]
    async with s.running_operator(k8s):
        await s.call(k8s.create, doc, NS)
        await s.until(
            k8s, lambda: s.pipeline_status(k8s, case).get("phase") == "Invalid", "Invalid"
        )
        status = s.pipeline_status(k8s, case)
        assert status["problems"] == expected
        degraded = s.condition(status, "Degraded")
        assert degraded["status"] == "True"
        assert degraded["reason"] == names.REASON_INVALID_SPEC
        assert all(line in degraded["message"] for line in expected)
        assert s.condition(status, "Ready")["status"] == "False"
        await s.until(
            k8s,
            lambda: ("Warning", reconcile_events.EVENT_INVALID) in s.event_reasons(k8s, case),
            "a Warning Event",
        )
        (event,) = [
            e for e in s.events_of(k8s, case) if e["reason"] == reconcile_events.EVENT_INVALID
        ]
        assert expected[0] in event["message"]
        assert s.children(k8s, case) == {}

        # fixed: the children appear
        fixed = [{"op": "replace", "path": "/spec/edges", "value": [{"from": "a", "to": "b"}]}]
        await s.call(k8s.patch, s.PIPELINES, case, fixed, NS, patch_type="json")
        await s.until(k8s, lambda: len(s.children(k8s, case)) == 9, "children once fixed")
        await s.until(
            k8s, lambda: s.pipeline_status(k8s, case).get("problems") == [], "problems cleared"
        )


async def test_a_foreign_object_is_not_adopted(
    k8s_crd: EmulatorThread, monkeypatch: pytest.MonkeyPatch
):
    k8s = k8s_crd
    monkeypatch.setattr(handlers, "CONFLICT_RETRY", 0.5)
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{NAME}-decoder", "namespace": NS, "labels": {"app": "mine"}},
        "spec": {"ports": [{"port": 80}]},
    }
    stored = k8s.create(foreign, NS)
    async with s.running_operator(k8s):
        await created(k8s)
        await s.until(
            k8s,
            lambda: s.pipeline_status(k8s, NAME).get("phase") == names.PHASE_DEGRADED,
            "Degraded",
        )
        degraded = s.condition(s.pipeline_status(k8s, NAME), "Degraded")
        assert degraded["reason"] == REASON_CHILD_CONFLICT
        assert f"Service/{NAME}-decoder" in degraded["message"]
        assert set(s.children(k8s, NAME)) == ALL_CHILDREN - {f"Service/{NAME}-decoder"}
        await s.until(
            k8s,
            lambda: ("Warning", reconcile_events.EVENT_CONFLICT) in s.event_reasons(k8s, NAME),
            "a ChildConflict Event",
        )
        await asyncio.sleep(1.2)  # a retry or two, which must leave it alone as well
        mine = k8s.get("v1/services", f"{NAME}-decoder", NS)
        assert mine is not None
        assert mine["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]
        conflict_events = [e for e in s.events_of(k8s, NAME) if e["reason"] == "ChildConflict"]
        assert len(conflict_events) == 1, "one Event, not one per retry"

        # the owner of the Service removes it: the retry creates ours
        await s.call(k8s.delete, "v1/services", f"{NAME}-decoder", NS)
        await s.until(k8s, lambda: set(s.children(k8s, NAME)) == ALL_CHILDREN, "all children")
        await s.until(
            k8s,
            lambda: s.pipeline_status(k8s, NAME).get("phase") == names.PHASE_PROGRESSING,
            "no longer Degraded",
        )


async def test_a_restart_resumes_without_duplicates_or_changes(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    async with s.running_operator(k8s):
        await created(k8s)
        await s.call(s.mark_ready, k8s, NAME)
        await s.until(k8s, lambda: s.pipeline_status(k8s, NAME).get("phase") == "Ready", "Ready")
        await asyncio.sleep(0.3)  # let kopf store its diff base
    kids = s.children(k8s, NAME)
    before = s.versions(kids)
    pipeline_before = (k8s.get(s.PIPELINES, NAME, NS) or {})["metadata"]["resourceVersion"]
    k8s.clear_calls()

    async with s.running_operator(k8s) as operator:

        def resumed() -> bool:
            applies = [c for c in k8s.calls if c.verb == "patch" and c.resource == "statefulsets"]
            return len(applies) >= len(UNITS)

        await s.until(k8s, resumed, "the resume's applies")
        await asyncio.sleep(0.5)  # anything that would follow (status writes, events)
        assert (NS, NAME) in operator.reconciler.states
    assert s.versions(s.children(k8s, NAME)) == before, "no child changed"
    assert set(s.children(k8s, NAME)) == set(kids), "no duplicates"
    after = (k8s.get(s.PIPELINES, NAME, NS) or {})["metadata"]["resourceVersion"]
    assert after == pipeline_before, "neither status nor kopf's annotations were rewritten"
    creates = [c for c in k8s.calls if c.verb == "create" and c.resource != "events"]
    assert creates == []
    assert not [c for c in k8s.calls if c.resource == "events"], "no new Events"


async def test_the_progress_deadline_degrades_without_any_event(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    async with s.running_operator(k8s, progress_deadline=1.0):
        await created(k8s)
        await s.until(
            k8s,
            lambda: (
                s.condition(s.pipeline_status(k8s, NAME), "Degraded").get("reason")
                == names.REASON_PROGRESS_DEADLINE
            ),
            "ProgressDeadlineExceeded",
            timeout=6.0,
        )
        assert s.pipeline_status(k8s, NAME)["phase"] == names.PHASE_DEGRADED
        await s.until(
            k8s,
            lambda: ("Warning", reconcile_events.EVENT_DEGRADED) in s.event_reasons(k8s, NAME),
            "a PipelineDegraded Event",
        )
        await s.call(s.mark_ready, k8s, NAME)
        await s.until(k8s, lambda: s.pipeline_status(k8s, NAME).get("phase") == "Ready", "Ready")
