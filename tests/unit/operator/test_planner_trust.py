"""The planner's part of trust between roles: the peer key Secret and its mount, the key hash
that rolls the pods, the NetworkPolicy (who reaches which port), what a podTemplate cannot
undo, and the reconciler's pure Event and key helpers."""

from __future__ import annotations

import base64
import pathlib
from typing import Any

import kubernetes_validate
import pytest

from disagg_core import contract, spec
from disagg_core.spec import podpolicy
from disagg_core.spec.model import ANNOTATION_ALLOW_PRIVILEGED, Pipeline
from disagg_operator import names
from disagg_operator.plan import manifests, planner, pods
from disagg_operator.plan import model as plan_model
from disagg_operator.reconcile import events as reconcile_events
from disagg_operator.reconcile import reads

NS = "ml"
NEWEST = kubernetes_validate.utils.latest_version()
Obj = dict[str, Any]


def _of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def _policy(pipeline: Pipeline, **options: Any) -> Obj:
    objects = planner.plan(pipeline, namespace=NS, options=plan_model.PlanOptions(**options))
    (policy,) = [
        p for p in _of_kind(objects, "NetworkPolicy") if "gateway" not in p["metadata"]["name"]
    ]
    return policy


@pytest.fixture
def examples(example_files: list[pathlib.Path], load_yaml: Any) -> dict[str, Pipeline]:
    return {path.stem: spec.parse_pipeline(load_yaml(path)) for path in example_files}


def test_every_role_container_mounts_the_peer_key(examples: dict[str, Pipeline]) -> None:
    # engine roles: the operator does not render them yet (issue 32's operator part)
    for pipeline in (p for p in examples.values() if not p.engine_roles):
        for sts in _of_kind(planner.plan(pipeline, namespace=NS), "StatefulSet"):
            pod = sts["spec"]["template"]["spec"]
            volume = next(v for v in pod["volumes"] if v["name"] == pods.PEER_KEY_VOLUME)
            assert volume["secret"] == {
                "secretName": f"{pipeline.name}-peer-key",
                "defaultMode": 0o440,
                "items": [{"key": "key", "path": "key"}],
            }
            assert pod["securityContext"]["fsGroup"] == pods.NONROOT_ID  # group-readable
            for container in pod["containers"]:
                mount = next(m for m in container["volumeMounts"] if m["name"] == "peer-key")
                assert mount == {
                    "name": "peer-key",
                    "mountPath": "/etc/disagg-peer-key",
                    "readOnly": True,
                }
                env = {e["name"]: e.get("value") for e in container["env"]}
                assert env["DISAGG_PEER_KEY_FILE"] == contract.DEFAULT_PEER_KEY_FILE
                parsed = contract.parse_env(
                    {k: v for k, v in env.items() if v is not None},
                    plan_model.topology(pipeline, NS),
                )
                assert parsed.peer_key_file == "/etc/disagg-peer-key/key"


def test_the_key_hash_rolls_the_pods_and_a_pod_template_cannot_change_it(
    full_doc: Obj,
) -> None:
    full_doc["spec"]["roles"][0]["podTemplate"]["metadata"] = {
        "annotations": {names.ANNOTATION_PEER_KEY_HASH: "mine"}
    }
    pipeline = spec.parse_pipeline(full_doc)
    unkeyed = planner.plan(pipeline, namespace=NS)
    first = planner.plan(pipeline, namespace=NS, peer_key_hash=manifests.peer_key_digest("a" * 64))
    second = planner.plan(pipeline, namespace=NS, peer_key_hash=manifests.peer_key_digest("b" * 64))
    for sts in _of_kind(unkeyed, "StatefulSet"):
        annotations = sts["spec"]["template"]["metadata"]["annotations"]
        assert annotations.get(names.ANNOTATION_PEER_KEY_HASH) in (None, "mine")
    hashes = []
    for plan in (first, second):
        found = {
            sts["spec"]["template"]["metadata"]["annotations"][names.ANNOTATION_PEER_KEY_HASH]
            for sts in _of_kind(plan, "StatefulSet")
        }
        assert len(found) == 1 and "mine" not in found
        hashes.append(found.pop())
    assert hashes[0] != hashes[1]
    # nothing but the pod templates differ
    assert [o for o in first if o["kind"] != "StatefulSet"] == [
        o for o in second if o["kind"] != "StatefulSet"
    ]


def test_the_peer_key_secret() -> None:
    owner = plan_model.Owner(name="p", uid="0b1e6f1c-0000-4000-8000-000000000000")
    key = "ab" * 32
    secret = manifests.peer_key_secret("p", namespace=NS, key=key, owner=owner)
    kubernetes_validate.validate(secret, NEWEST, strict=True)
    assert secret["metadata"]["name"] == "p-peer-key"
    assert secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"]["key"]).decode() == key
    assert secret["metadata"]["ownerReferences"] == [owner.reference()]
    assert plan_model.child_selector("p").items() <= secret["metadata"]["labels"].items()
    assert reads.peer_key_text(secret) == key
    assert reads.peer_key_text({"data": {"key": "not base64!"}}) == ""
    assert reads.peer_key_text({}) == ""
    assert len(manifests.peer_key_digest(key)) == 16
    # the Secret is never planned (so never pruned, never overwritten by an apply)
    kinds = {kind for _, kind in planner.child_kinds()}
    assert "Secret" not in kinds and "NetworkPolicy" in kinds


def test_the_network_policy_admits_the_pipeline_its_gateway_and_the_namespace(
    examples: dict[str, Pipeline],
) -> None:
    policy = _policy(examples["fan-out"])
    kubernetes_validate.validate(policy, NEWEST, strict=True)
    assert policy["metadata"]["name"] == "fan-out-network"
    spec_ = policy["spec"]
    assert spec_["policyTypes"] == ["Ingress"]  # egress (DNS, model stores) stays open
    assert spec_["podSelector"] == {
        "matchLabels": {
            "disagg.dev/pipeline": "fan-out",
            "app.kubernetes.io/managed-by": names.MANAGER,
        },
        "matchExpressions": [{"key": "disagg.dev/role", "operator": "Exists"}],
    }
    runtime, metrics = spec_["ingress"]
    assert runtime["from"] == [
        {"podSelector": spec_["podSelector"]},
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/component": "gateway",
                    "disagg.dev/pipeline": "fan-out",
                }
            }
        },
    ]
    # every container's ingress and lane port (the group's second container: 7401, 7501)
    expected = set()
    for unit in plan_model.workloads(examples["fan-out"]):
        for ports in plan_model.role_ports(unit).values():
            expected |= {ports.ingress, ports.lane}
    assert {p["port"] for p in runtime["ports"]} == expected == {7400, 7401, 7500, 7501}
    assert metrics == {
        "from": [{"podSelector": {}}],  # the namespace
        "ports": [{"protocol": "TCP", "port": 9400}, {"protocol": "TCP", "port": 9401}],
    }


def test_network_policy_options(full_doc: Obj) -> None:
    pipeline = spec.parse_pipeline(full_doc)
    policy = _policy(pipeline, metrics_namespaces=("disagg-system",))
    kubernetes_validate.validate(policy, NEWEST, strict=True)
    runtime, metrics = policy["spec"]["ingress"]
    settings = pipeline.network_policy
    assert runtime["from"][2:] == list(settings.clients)
    assert metrics["from"] == [
        *settings.metrics_from,  # instead of the namespace
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "disagg-system"}},
            "podSelector": {},
        },
    ]
    # the roles' own ports are as closed as the runtime's
    own = {(p.protocol, p.container_port) for r in pipeline.roles for p in r.ports}
    assert own and own <= {(p["protocol"], p["port"]) for p in runtime["ports"]}


def test_the_operators_namespace_is_not_repeated_for_its_own_pipelines(
    examples: dict[str, Pipeline],
) -> None:
    metrics = _policy(examples["fan-out"], metrics_namespaces=(NS, "mon"))["spec"]["ingress"][1]
    assert metrics["from"] == [
        {"podSelector": {}},
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}},
            "podSelector": {},
        },
    ]


def test_no_network_policy_when_turned_off(full_doc: Obj) -> None:
    full_doc["spec"]["networkPolicy"] = {"enabled": False}
    objects = planner.plan(spec.parse_pipeline(full_doc), namespace=NS)
    assert _of_kind(objects, "NetworkPolicy") == []  # the gateway's too


def test_added_containers_get_no_privileges_unless_opted_in(full_doc: Obj) -> None:
    sidecar: Obj = {"name": "proxy", "image": "envoy:1"}
    init = {"name": "warm", "image": "busybox", "securityContext": {"runAsUser": 1000}}
    role = full_doc["spec"]["roles"][0]
    role["podTemplate"] = {"spec": {"containers": [sidecar], "initContainers": [init]}}
    objects = planner.plan(spec.parse_pipeline(full_doc), namespace=NS)
    sts = next(
        o for o in _of_kind(objects, "StatefulSet") if o["metadata"]["name"] == "full-encoder"
    )
    pod = sts["spec"]["template"]["spec"]
    proxy = next(c for c in pod["containers"] if c["name"] == "proxy")
    assert proxy["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    (warm,) = pod["initContainers"]
    assert warm["securityContext"]["runAsUser"] == 1000  # theirs kept
    assert warm["securityContext"]["allowPrivilegeEscalation"] is False

    # with the opt-in, an explicit request wins (and is warned about)
    full_doc["metadata"]["annotations"] = {ANNOTATION_ALLOW_PRIVILEGED: "true"}
    sidecar["securityContext"] = {"privileged": True, "allowPrivilegeEscalation": True}
    pipeline = spec.parse_pipeline(full_doc)
    objects = planner.plan(pipeline, namespace=NS)
    sts = next(
        o for o in _of_kind(objects, "StatefulSet") if o["metadata"]["name"] == "full-encoder"
    )
    proxy = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "proxy")
    assert proxy["securityContext"]["privileged"] is True
    assert proxy["securityContext"]["allowPrivilegeEscalation"] is True
    (event,) = reconcile_events.privileged_events(pipeline, ())
    assert event[:2] == ("Warning", reconcile_events.EVENT_PRIVILEGED)
    assert "spec.roles[0].podTemplate.spec.containers[0].securityContext.privileged" in event[2]
    warned = [str(p) for p in podpolicy.findings(pipeline)]
    assert reconcile_events.privileged_events(pipeline, warned) == []  # once per change


def test_an_opted_in_privileged_pod_renders_as_written(full_doc: Obj) -> None:
    full_doc["metadata"]["annotations"] = {ANNOTATION_ALLOW_PRIVILEGED: "true"}
    full_doc["spec"]["roles"][0]["podTemplate"] = {
        "spec": {
            "hostPID": True,
            "volumes": [{"name": "host", "hostPath": {"path": "/sys"}}],
            "containers": [
                {"name": "encoder", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}
            ],
        }
    }
    objects = planner.plan(spec.parse_pipeline(full_doc), namespace=NS)
    sts = next(
        o for o in _of_kind(objects, "StatefulSet") if o["metadata"]["name"] == "full-encoder"
    )
    pod = sts["spec"]["template"]["spec"]
    kubernetes_validate.validate(sts, NEWEST, strict=True)
    assert pod["hostPID"] is True
    assert {"name": "host", "hostPath": {"path": "/sys"}} in pod["volumes"]
    encoder = next(c for c in pod["containers"] if c["name"] == "encoder")
    assert encoder["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    # the contract stays: the peer key mount and variable are still there
    assert any(m["name"] == "peer-key" for m in encoder["volumeMounts"])


def test_the_gateway_has_a_network_policy_of_its_own() -> None:
    """The pipeline's NetworkPolicy selects role pods only (issue 30, item 15): the gateway's
    HTTP port admits its namespace and spec.networkPolicy.clients, its reply port only the
    pipeline's role pods."""
    clients = [{"namespaceSelector": {"matchLabels": {"team": "web"}}}]
    pipeline = spec.parse_pipeline(
        {
            "apiVersion": "disagg.dev/v1alpha1",
            "kind": "DisaggregatedPipeline",
            "metadata": {"name": "p"},
            "spec": {
                "image": "i:1",
                "roles": [{"name": "a", "handler": "m:f"}],
                "networkPolicy": {"clients": clients},
            },
        }
    )
    objects = planner.plan(pipeline, namespace=NS)
    (policy,) = [
        p
        for p in _of_kind(objects, "NetworkPolicy")
        if p["metadata"]["name"] == "p-gateway-network"
    ]
    (deployment,) = _of_kind(objects, "Deployment")
    selected = policy["spec"]["podSelector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selected.items() <= pod_labels.items()
    http, reply = policy["spec"]["ingress"]
    assert http["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert http["from"] == [{"podSelector": {}}, *clients]
    assert reply["ports"] == [{"protocol": "TCP", "port": 7400}]
    assert reply["from"] == [{"podSelector": manifests.role_selector("p")}]
