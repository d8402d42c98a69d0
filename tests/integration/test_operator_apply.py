"""`apply` against the emulator, without kopf: server-side apply is idempotent down to the
resourceVersion, ownership is checked before applying, pruning takes only our own
children, the status is written only when it changes."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from disagg_core import spec
from disagg_operator import names
from disagg_operator.k8s import client as kube
from disagg_operator.plan import manifests, model, planner
from disagg_operator.reconcile import apply, reads
from tests.integration import operator_support as s
from tests.k8s.server import EmulatorThread

pytestmark = pytest.mark.asyncio
NS = s.NS
KINDS = planner.child_kinds()


@pytest_asyncio.fixture
async def api(k8s: EmulatorThread, disagg_crd: Any) -> AsyncIterator[kube.Api]:
    k8s.apply_file(disagg_crd)
    client = kube.Api(k8s.connection_info())
    try:
        yield client
    finally:
        await client.close()


async def make_pipeline(k8s: EmulatorThread, doc: dict[str, Any] | None = None) -> Any:
    stored = await s.call(k8s.create, doc or s.example(), NS)
    pipeline = spec.parse_pipeline(doc or s.example())
    return stored, pipeline, model.Owner.of(stored)


async def test_applying_twice_changes_nothing(k8s: EmulatorThread, api: kube.Api):
    stored, pipeline, owner = await make_pipeline(k8s)
    plan = planner.plan(pipeline, namespace=NS, owner=owner)
    first = await apply.apply_children(api, plan, owner=owner, namespace=NS, kinds=KINDS)
    assert (
        len(first.created) == len(plan) == 11
    )  # 7 + the NetworkPolicies (roles', gateway's) + the gateway's Service and Deployment
    assert not (first.updated or first.unchanged or first.pruned or first.conflicts)
    before = s.versions(s.children(k8s, stored["metadata"]["name"]))
    k8s.clear_calls()

    second = await apply.apply_children(api, plan, owner=owner, namespace=NS, kinds=KINDS)
    assert len(second.unchanged) == 11 and not second.changed
    assert s.versions(s.children(k8s, stored["metadata"]["name"])) == before
    verbs = sorted({(c.verb, c.resource) for c in k8s.calls})
    assert ("patch", "statefulsets") in verbs, "the applies were sent"
    assert not [c for c in k8s.calls if c.verb == "get"], "no GETs: the lists had everything"

    # one role's replicas: only its StatefulSet
    other = planner.plan(
        pipeline,
        namespace=NS,
        owner=owner,
        options=model.PlanOptions(replicas={"denoiser": 4}),
    )
    third = await apply.apply_children(api, other, owner=owner, namespace=NS, kinds=KINDS)
    assert [str(r) for r in third.updated] == ["StatefulSet/text-to-video-denoiser"]
    after = s.versions(s.children(k8s, stored["metadata"]["name"]))
    assert {k for k in before if before[k] != after[k]} == {"StatefulSet/text-to-video-denoiser"}


async def test_another_pipelines_object_is_a_conflict(k8s: EmulatorThread, api: kube.Api):
    _, pipeline, owner = await make_pipeline(k8s)
    plan = planner.plan(pipeline, namespace=NS, owner=owner)
    stranger = model.Owner(name="text-to-video", uid="00000000-0000-0000-0000-000000000000")
    theirs = copy.deepcopy(next(o for o in plan if o["kind"] == "StatefulSet"))
    theirs["metadata"]["ownerReferences"] = [stranger.reference()]
    held = await s.call(k8s.create, theirs, NS)

    result = await apply.apply_children(api, plan, owner=owner, namespace=NS, kinds=KINDS)
    assert [str(c.ref) for c in result.conflicts] == ["StatefulSet/text-to-video-encoder"]
    assert stranger.uid in str(result.conflicts[0])
    assert len(result.created) == 10
    now = k8s.get(s.STS, "text-to-video-encoder", NS)
    assert now is not None
    assert now["metadata"]["resourceVersion"] == held["metadata"]["resourceVersion"]
    assert not result.pruned, "not ours to prune either"


async def test_a_labelled_orphan_is_adopted(k8s: EmulatorThread, api: kube.Api):
    _, pipeline, owner = await make_pipeline(k8s)
    rendered = planner.plan(pipeline, namespace=NS)  # as `disagg render` prints it
    config_map = next(o for o in rendered if o["kind"] == "ConfigMap")
    await s.call(k8s.create, config_map, NS)
    plan = planner.plan(pipeline, namespace=NS, owner=owner)

    result = await apply.apply_children(api, plan, owner=owner, namespace=NS, kinds=KINDS)
    assert [str(r) for r in result.updated] == ["ConfigMap/text-to-video-topology"]
    adopted = k8s.get("v1/configmaps", "text-to-video-topology", NS)
    assert adopted is not None
    assert adopted["metadata"]["ownerReferences"] == [owner.reference()]


async def test_pruning_takes_only_our_children(k8s: EmulatorThread, api: kube.Api):
    doc = s.pipeline_doc("p", [{"name": "a"}, {"name": "b"}], edges=[{"from": "a", "to": "b"}])
    _, pipeline, owner = await make_pipeline(k8s, doc)
    plan = planner.plan(pipeline, namespace=NS, owner=owner)
    await apply.apply_children(api, plan, owner=owner, namespace=NS, kinds=KINDS)
    labelled_not_owned = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "p-extra",
            "namespace": NS,
            "labels": model.child_selector("p"),
        },
    }
    await s.call(k8s.create, labelled_not_owned, NS)

    smaller_doc = s.pipeline_doc("p", [{"name": "a"}])
    smaller = planner.plan(spec.parse_pipeline(smaller_doc), namespace=NS, owner=owner)
    result = await apply.apply_children(api, smaller, owner=owner, namespace=NS, kinds=KINDS)
    assert sorted(str(r) for r in result.pruned) == ["Service/p-b", "StatefulSet/p-b"]
    # the graph changed: a's topology, downstream env and spec hash
    assert [str(r) for r in result.updated] == [
        "ConfigMap/p-topology",
        "StatefulSet/p-a",
        "Deployment/p-gateway",  # the gateway's pods read the topology too
    ]
    assert k8s.get("v1/configmaps", "p-extra", NS) is not None


async def test_status_is_written_only_when_it_changes(k8s: EmulatorThread, api: kube.Api):
    stored, _, _ = await make_pipeline(k8s)
    wanted = {"phase": "Pending", "readyRoles": "0/3"}
    assert await apply.write_status(api, stored, wanted) is True
    fresh = await apply.get_pipeline(api, NS, "text-to-video")
    assert fresh is not None and fresh["status"] == wanted
    k8s.clear_calls()
    assert await apply.write_status(api, fresh, wanted) is False
    assert k8s.calls == []

    # the uid goes along as a precondition (a real API server answers 409 on a mismatch;
    # the emulator does not check it)
    assert await apply.write_status(api, fresh, {"phase": "Ready"}) is True
    (patch,) = [c for c in k8s.calls if c.verb == "patch"]
    assert patch.subresource == "status"


async def test_api_errors_carry_the_status(k8s: EmulatorThread, api: kube.Api):
    ref = kube.ObjectRef("v1", "ConfigMap", NS, "Not_A_Name")
    with pytest.raises(kube.ApiError) as invalid:
        await api.apply(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "Not_A_Name", "namespace": NS},
            }
        )
    assert invalid.value.status == 422 and not invalid.value.retryable
    assert await api.get(ref) is None
    assert await api.delete(ref) is False
    k8s.call(lambda: k8s.emulator["get /api/v1/namespaces/default/configmaps"] << 503)
    with pytest.raises(kube.ApiError) as unavailable:
        await api.list("v1", "ConfigMap", NS, "a=b")
    assert unavailable.value.status == 503 and unavailable.value.retryable

    unauthenticated = kube.Api()
    with pytest.raises(kube.ApiError) as missing:
        await unauthenticated.get(ref)
    assert missing.value.reason == "NotLoggedIn"
    unauthenticated.use(k8s.connection_info())
    assert await unauthenticated.get(ref) is None
    await unauthenticated.close()


async def test_a_kind_the_server_does_not_serve_lists_as_empty(k8s: EmulatorThread, api: kube.Api):
    path = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates"
    k8s.call(lambda: k8s.emulator[f"get {path}"] << 404)
    assert await api.list("resource.k8s.io/v1", "ResourceClaimTemplate", NS, "a=b") == []
    assert kube.PLURALS[names.PIPELINE_KIND] == names.PLURAL


async def test_ensure_created_creates_once_and_never_overwrites(k8s: EmulatorThread, api: kube.Api):
    _, pipeline, owner = await make_pipeline(k8s)
    first = manifests.peer_key_secret(pipeline.name, namespace=NS, key="a" * 64, owner=owner)
    stored, created = await apply.ensure_created(api, first)
    assert created and reads.peer_key_text(stored) == "a" * 64
    second = manifests.peer_key_secret(pipeline.name, namespace=NS, key="b" * 64, owner=owner)
    k8s.clear_calls()
    again, created = await apply.ensure_created(api, second)
    assert not created and reads.peer_key_text(again) == "a" * 64
    assert again["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]
    assert {c.verb for c in k8s.calls if c.resource == "secrets"} == {"get"}  # no writes


async def test_ensure_created_when_likely_absent_creates_first_and_reads_a_taken_name(
    k8s: EmulatorThread, api: kube.Api
):
    _, pipeline, owner = await make_pipeline(k8s)
    first = manifests.peer_key_secret(pipeline.name, namespace=NS, key="a" * 64, owner=owner)
    k8s.clear_calls()
    stored, created = await apply.ensure_created(api, first, likely_absent=True)
    assert created and reads.peer_key_text(stored) == "a" * 64
    assert [c.verb for c in k8s.calls if c.resource == "secrets"] == ["create"]  # no GET
    second = manifests.peer_key_secret(pipeline.name, namespace=NS, key="b" * 64, owner=owner)
    k8s.clear_calls()
    again, created = await apply.ensure_created(api, second, likely_absent=True)
    assert not created and reads.peer_key_text(again) == "a" * 64  # kept, not overwritten
    assert [c.verb for c in k8s.calls if c.resource == "secrets"] == ["create", "get"]
