"""The operator against a real cluster: the scenarios of the emulator tests
(tests/integration/test_operator_reconcile.py), through the real kubectl and API server.

Skipped unless DISAGG_E2E_KUBECONFIG or KUBECONFIG names a cluster (README.md). Without a role
image no pod becomes ready, so these tests assert only what needs no running pod; with
DISAGG_E2E_IMAGE set, one more waits for a pipeline to become Ready.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from disagg_core import contract, spec
from disagg_core.spec.fields import SpecError
from disagg_operator import names
from disagg_operator.plan import model, planner
from disagg_operator.reconcile import events as reconcile_events
from tests.e2e import e2e_support as e
from tests.integration import test_k8s_admission as admission_cases

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(e.KUBECONFIG is None, reason=e.SKIP_REASON),
    pytest.mark.timeout(int(e.TIMEOUT) * 4 + 60),
]
UNITS = ("encoder", "denoiser", "decoder")


class Pipelines:
    """Applies pipelines for one test and deletes them afterwards."""

    def __init__(self, cluster: e.Cluster) -> None:
        self.cluster = cluster
        self.names: list[str] = []

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Apply `doc`; the stored pipeline."""
        name = doc["metadata"]["name"]
        self.names.append(name)
        out = self.cluster.apply(doc)
        assert f"disaggregatedpipeline.disagg.dev/{name}" in out
        stored = self.cluster.pipeline(name)
        assert stored is not None
        return stored

    def reconciled(self, name: str, generation: int = 1) -> dict[str, Any]:
        """Wait until the status describes `generation`; the status."""

        def caught_up() -> dict[str, Any] | None:
            status = self.cluster.status(name)
            return status if status.get("observedGeneration") == generation else None

        return e.wait_for(caught_up, f"the status of {name} (generation {generation}); {e.HINT}")


@pytest.fixture
def pipelines(cluster: e.Cluster) -> Iterator[Pipelines]:
    made = Pipelines(cluster)
    yield made
    for name in made.names:
        cluster.delete_pipeline(name, wait=False)


def planned_children(doc: dict[str, Any], namespace: str) -> dict[str, dict[str, Any]]:
    parsed = spec.parse_pipeline(doc)
    objects = planner.plan(parsed, namespace=namespace, options=options())
    listed = ("ConfigMap", "Service", "StatefulSet")  # the kinds `Cluster.children` lists
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objects if o["kind"] in listed}


def children_if(cluster: e.Cluster, name: str, keys: set[str]) -> dict[str, Any] | None:
    """The children of `name` once they are exactly `keys`."""
    kids = cluster.children(name)
    return kids if set(kids) == keys else None


def options() -> model.PlanOptions:
    return model.PlanOptions(cluster_domain=e.CLUSTER_DOMAIN)


def test_create_makes_the_children_with_the_contract_and_a_status(
    cluster: e.Cluster, pipelines: Pipelines
):
    name = "e2e-create"
    doc = e.example(name)
    stored = pipelines.apply(doc)
    planned = planned_children(doc, cluster.namespace)
    kids = e.wait_for(
        lambda: children_if(cluster, name, set(planned)),
        f"the children {sorted(planned)}; {e.HINT}",
    )
    owner = {
        "apiVersion": names.PIPELINE_API_VERSION,
        "kind": names.PIPELINE_KIND,
        "name": name,
        "uid": stored["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for key, child in kids.items():
        meta = child["metadata"]
        assert meta["ownerReferences"] == [owner], key
        assert meta["labels"] == planned[key]["metadata"]["labels"], key

    pipeline = spec.parse_pipeline(doc)
    topology_text = kids[f"ConfigMap/{name}-topology"]["data"]["topology.json"]
    topology = contract.Topology.from_json(json.loads(topology_text))
    for unit in UNITS:
        sts = kids[f"StatefulSet/{name}-{unit}"]
        wanted = planned[f"StatefulSet/{name}-{unit}"]
        assert sts["spec"]["replicas"] == wanted["spec"]["replicas"]
        assert sts["spec"]["selector"] == wanted["spec"]["selector"]
        assert sts["spec"]["serviceName"] == wanted["spec"]["serviceName"]
        pod = sts["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        assert container["image"] == "ghcr.io/disagg/runtime:0.1.0"
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        env = {v["name"]: v["value"] for v in container["env"] if "value" in v}
        pod_name = f"{name}-{unit}-0"
        env[contract.PREFIX + "POD_NAME"] = pod_name  # the downward API's part
        parsed = contract.parse_env(env, topology)
        config = model.role_config(pipeline, unit, namespace=cluster.namespace, options=options())
        assert parsed == dataclasses.replace(config, replica=0, pod_name=pod_name)
    for key in planned:
        if key.startswith("Service/"):
            assert kids[key]["spec"]["clusterIP"] == "None", key  # headless

    status = pipelines.reconciled(name)
    assert [r["name"] for r in status["roles"]] == list(UNITS)
    assert {r["name"]: r["desired"] for r in status["roles"]} == {
        "encoder": 1,
        "denoiser": 2,
        "decoder": 1,
    }
    # no pod becomes ready without the image (and these requests may not even schedule)
    assert status["phase"] in (names.PHASE_PROGRESSING, names.PHASE_DEGRADED)
    assert e.condition(status, names.CONDITION_READY)["status"] == "False"
    assert status["readyRoles"].endswith("/3")
    e.wait_for(
        lambda: ("Normal", reconcile_events.EVENT_CREATED) in cluster.event_reasons(name),
        "the Created Event",
    )
    table = cluster.kubectl("get", "dpipe", name).stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "PHASE", "AGE"]


def test_editing_one_role_image_changes_only_its_statefulset(
    cluster: e.Cluster, pipelines: Pipelines
):
    name = "e2e-edit"
    pipelines.apply(e.example(name))
    pipelines.reconciled(name)
    keys = set(planned_children(e.example(name), cluster.namespace))
    before = e.wait_for(lambda: children_if(cluster, name, keys), "the children")
    image = "ghcr.io/disagg/runtime:0.2.0"
    cluster.patch_pipeline(name, [{"op": "add", "path": "/spec/roles/1/image", "value": image}])

    def denoiser_image() -> bool:
        sts = cluster.children(name).get(f"StatefulSet/{name}-denoiser") or {}
        return bool(sts["spec"]["template"]["spec"]["containers"][0]["image"] == image)

    e.wait_for(denoiser_image, "the denoiser's new image")
    pipelines.reconciled(name, generation=2)
    after = cluster.children(name)
    old, new = e.versions(before), e.versions(after)
    assert set(old) == set(new)
    assert {key for key in old if old[key] != new[key]} == {f"StatefulSet/{name}-denoiser"}
    for unit in ("encoder", "decoder"):
        sts = after[f"StatefulSet/{name}-{unit}"]
        assert sts["spec"]["template"]["spec"]["containers"][0]["image"] != image
    e.wait_for(
        lambda: ("Normal", reconcile_events.EVENT_UPDATED) in cluster.event_reasons(name),
        "the Updated Event",
    )


def test_an_invalid_pipeline_gets_no_children_and_says_why(
    cluster: e.Cluster, pipelines: Pipelines
):
    name = "e2e-cycle"  # a cycle: the CRD's rules cannot see it, the operator's validator can
    doc = {
        "apiVersion": names.PIPELINE_API_VERSION,
        "kind": names.PIPELINE_KIND,
        "metadata": {"name": name},
        "spec": {
            "image": "ghcr.io/disagg/runtime:0.1.0",
            "roles": [
                {"name": r, "handler": "disagg_runtime.demo:encode_text"} for r in ("a", "b", "c")
            ],
            "edges": [
                {"from": "a", "to": "b"},
                {"from": "b", "to": "c"},
                {"from": "c", "to": "b"},
            ],
        },
    }
    with pytest.raises(SpecError) as invalid:
        spec.parse_pipeline(doc)
    expected = [f"{p.path}: {p.reason}" for p in invalid.value.problems]
    pipelines.apply(doc)
    status = pipelines.reconciled(name)
    assert status["phase"] == names.PHASE_INVALID
    assert status["problems"] == expected
    degraded = e.condition(status, names.CONDITION_DEGRADED)
    assert degraded["status"] == "True"
    assert degraded["reason"] == names.REASON_INVALID_SPEC
    assert all(line in degraded["message"] for line in expected)
    e.wait_for(
        lambda: ("Warning", reconcile_events.EVENT_INVALID) in cluster.event_reasons(name),
        "the InvalidSpec Warning Event",
    )
    (event,) = [
        x for x in cluster.events(name) if x.get("reason") == reconcile_events.EVENT_INVALID
    ]
    assert expected[0] in event["message"]
    assert cluster.children(name) == {}


def test_deleting_the_pipeline_deletes_every_child(cluster: e.Cluster, pipelines: Pipelines):
    name = "e2e-delete"
    pipelines.apply(e.example(name))
    e.wait_for(lambda: len(cluster.children(name)) == 7, f"the children; {e.HINT}")
    cluster.delete_pipeline(name)
    assert cluster.pipeline(name) is None, "no finalizer holds the pipeline"
    e.wait_for(lambda: not cluster.children(name), "garbage collection of every child")


def test_a_pipeline_with_a_real_image_becomes_ready(cluster: e.Cluster, pipelines: Pipelines):
    if e.IMAGE is None:  # here, not a mark: the cluster's own skip reason comes first
        pytest.skip(f"waiting for Ready needs a role image: set {e.IMAGE_ENV}")
    name = "e2e-ready"
    doc = e.example(name)
    doc["spec"]["image"] = e.IMAGE
    for role in doc["spec"]["roles"]:  # small enough for a kind node
        role.pop("resources", None)
        role["replicas"] = 1
    pipelines.apply(doc)
    pipelines.reconciled(name)
    timeout = f"--timeout={int(e.TIMEOUT) * 3}s"
    cluster.kubectl(
        "wait", "--for=condition=Ready", f"dpipe/{name}", timeout, timeout=e.TIMEOUT * 3 + 10
    )
    status = cluster.status(name)
    assert status["phase"] == names.PHASE_READY
    assert status["readyRoles"] == "3/3"
    assert [r["ready"] for r in status["roles"]] == [1, 1, 1]


@pytest.mark.parametrize(
    ("doc", "refusal"),
    [c[1:] for c in admission_cases.INVALID],
    ids=[c[0] for c in admission_cases.INVALID],
)
def test_the_real_server_refuses_the_invalid_pipelines_with_the_emulators_paths(
    cluster: e.Cluster, doc: dict[str, Any], refusal: str
):
    """The ten pipelines of tests/integration/test_k8s_admission.py, applied server-side to a
    real cluster: refused, naming what the emulator names (a difference fails here)."""
    text = yaml.safe_dump(doc)
    result = cluster.kubectl("apply", "--server-side", "-f", "-", input=text, check=False)
    assert result.returncode != 0, result.stdout
    assert refusal in result.stderr, result.stderr
