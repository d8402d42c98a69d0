"""DisaggregatedPipeline parsing and validation: the model, every rule, the CLI output."""

from __future__ import annotations

import copy
import io
import os
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_core import spec
from disagg_core.spec import (
    Autoscaling,
    ColocationGroup,
    Edge,
    EnvSetting,
    Pipeline,
    PoolOverride,
    PoolSettings,
    Port,
    Problem,
    Resources,
    SpecError,
    TensorRef,
    Transport,
    parse_payload_path,
    parse_pipeline,
)
from tests.support import REPO

EXAMPLES = REPO / "examples"
Doc = dict[str, Any]

FULL_YAML = """
apiVersion: disagg.dev/v1alpha1
kind: DisaggregatedPipeline
metadata:
  name: t2v
  namespace: media
  labels: {team: video}
  annotations: {note: demo}
spec:
  image: registry.example/disagg:1
  transport:
    relay: shm
    poolSize: 1Gi
    minBlock: 2Mi
    poolDevice: cpu-pinned
    requestTimeoutSeconds: 45
  roles:
    - name: encoder
      handler: pkg.demo:encode
      replicas: 2
      image: registry.example/encoder:2
      command: [python, -m, disagg_runtime.cli]
      args: [role, --verbose, ""]
      env:
        - {name: MODEL, value: t5}
        - name: TOKEN
          valueFrom: {secretKeyRef: {name: t2v-s, key: k}}
      resources:
        requests: {cpu: 500m, memory: 1Gi}
        limits: {memory: 2Gi, nvidia.com/gpu: 1}
      ports:
        - {name: debug, containerPort: 5678}
        - {name: probe, containerPort: 5678, protocol: UDP}
      transport: {poolSize: 64Mi, poolDevice: cuda}
      concurrency: 8
      podTemplate:
        spec: {nodeSelector: {gpu: "true"}}
    - name: denoiser
      handler: pkg.demo:denoise
      autoscaling: &scaling
        minReplicas: 2
        maxReplicas: 6
        targetPoolOccupancy: 0.5
        scaleUpStabilizationSeconds: 10
        scaleDownStabilizationSeconds: 60
        tolerance: 0.2
    - name: decoder
      handler: pkg.demo:decode
      autoscaling: *scaling  # colocated roles share pods: one policy
  edges:
    - from: encoder
      to: denoiser
      relay: tcp
      tensorRefs:
        - {path: text_embedding, to: decoder}
        - {path: "extras.masks[0]", to: decoder}
    - {from: denoiser, to: decoder}
  colocation:
    - roles: [denoiser, decoder]
"""


def minimal() -> Doc:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "demo"},
        "spec": {
            "image": "img:1",
            "roles": [
                {"name": "a", "handler": "m:f"},
                {"name": "b", "handler": "m:g"},
                {"name": "c", "handler": "m:h"},
            ],
            "edges": [{"from": "a", "to": "b"}, {"from": "b", "to": "c"}],
        },
    }


def full() -> Doc:
    doc = yaml.safe_load(FULL_YAML)
    assert isinstance(doc, dict)
    return doc


def problems(doc: object) -> list[Problem]:
    with pytest.raises(SpecError) as caught:
        parse_pipeline(doc)
    return list(caught.value.problems)


def reasons_at(doc: object, path: str) -> list[str]:
    found = problems(doc)
    at = [problem.reason for problem in found if problem.path == path]
    assert at, f"no problem at {path!r}; got {[str(p) for p in found]}"
    return at


def assert_problem(doc: object, path: str, reason: str) -> None:
    at = reasons_at(doc, path)
    assert any(reason in text for text in at), f"{reason!r} not in {at}"


# ---------------------------------------------------------------------------- the model


def test_full_document_parses_into_the_model() -> None:
    p = parse_pipeline(full())
    assert (p.name, p.namespace) == ("t2v", "media")
    assert dict(p.labels) == {"team": "video"} and dict(p.annotations) == {"note": "demo"}
    assert p.image == "registry.example/disagg:1"
    assert p.transport == Transport(
        relay="shm",
        pool_size=2**30,
        min_block=2 * 2**20,
        pool_device="cpu-pinned",
        request_timeout_seconds=45.0,
    )
    encoder = p.role("encoder")
    assert encoder.replicas == 2 and encoder.concurrency == 8
    assert encoder.image == "registry.example/encoder:2"
    assert encoder.command == ("python", "-m", "disagg_runtime.cli")
    assert encoder.args == ("role", "--verbose", "")
    assert encoder.env == (
        EnvSetting(name="MODEL", value="t5"),
        EnvSetting(name="TOKEN", value_from={"secretKeyRef": {"name": "t2v-s", "key": "k"}}),
    )
    assert encoder.resources == Resources(
        requests={"cpu": "500m", "memory": "1Gi"}, limits={"memory": "2Gi", "nvidia.com/gpu": "1"}
    )
    assert encoder.ports == (
        Port(name="debug", container_port=5678),
        Port(name="probe", container_port=5678, protocol="UDP"),
    )
    assert encoder.transport == PoolOverride(pool_size=64 * 2**20, pool_device="cuda")
    assert encoder.pod_template == {"spec": {"nodeSelector": {"gpu": "true"}}}
    assert (encoder.handler_module, encoder.handler_attr) == ("pkg.demo", "encode")
    denoiser = p.role("denoiser")
    assert denoiser.handler_attr == "denoise"
    assert denoiser.autoscaling == Autoscaling(
        min_replicas=2,
        max_replicas=6,
        target_pool_occupancy=0.5,
        scale_up_stabilization_seconds=10,
        scale_down_stabilization_seconds=60,
        tolerance=0.2,
    )
    assert denoiser.replicas == 2  # defaults to minReplicas when autoscaling is set
    assert p.edges[0] == Edge(
        source="encoder",
        target="denoiser",
        relay="tcp",
        tensor_refs=(
            TensorRef(path="text_embedding", to="decoder"),
            TensorRef(path="extras.masks[0]", to="decoder"),
        ),
    )
    assert p.colocation == (ColocationGroup(name="denoiser", roles=("denoiser", "decoder")),)


def test_defaults_are_applied() -> None:
    p = parse_pipeline(minimal())
    assert p.namespace is None and dict(p.labels) == {}
    assert p.transport == Transport()
    assert p.transport.relay == "auto"
    assert p.transport.pool_size == 256 * 2**20
    assert p.transport.min_block == 2**20
    assert p.transport.pool_device == "cpu"
    assert p.transport.request_timeout_seconds == 30.0
    role = p.role("a")
    assert role.replicas == 1 and role.concurrency == 4
    assert role.image is None and role.command is None and role.args is None
    assert role.env == () and role.ports == () and role.resources == Resources()
    assert role.transport == PoolOverride() and role.autoscaling is None
    assert role.pod_template is None
    assert p.edges[0].relay is None and p.edges[0].tensor_refs == ()
    assert p.colocation == ()


def test_autoscaling_defaults() -> None:
    doc = minimal()
    doc["spec"]["roles"][1]["autoscaling"] = {"maxReplicas": 3}
    doc["spec"]["roles"][1]["replicas"] = 7  # outside [min, max] is allowed: the autoscaler clamps
    role = parse_pipeline(doc).role("b")
    assert role.replicas == 7
    assert role.autoscaling == Autoscaling(max_replicas=3)
    assert role.autoscaling.min_replicas == 1
    assert role.autoscaling.target_pool_occupancy == 0.7
    assert role.autoscaling.scale_up_stabilization_seconds == 0
    assert role.autoscaling.scale_down_stabilization_seconds == 300
    assert role.autoscaling.tolerance == 0.1


def test_live_objects_from_the_api_server_parse() -> None:
    doc = minimal()
    doc["metadata"].update(
        uid="1234",
        resourceVersion="9",
        generation=3,
        creationTimestamp="2024-01-01T00:00:00Z",
        finalizers=["kopf.zalando.org/KopfFinalizerMarker"],
        managedFields=[{"manager": "kubectl"}],
    )
    doc["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
    assert parse_pipeline(doc).name == "demo"


def test_pipeline_is_frozen() -> None:
    p = parse_pipeline(minimal())
    with pytest.raises(AttributeError):
        p.name = "other"  # type: ignore[misc]


def test_pod_template_is_a_copy() -> None:
    doc = full()
    p = parse_pipeline(doc)
    doc["spec"]["roles"][0]["podTemplate"]["spec"]["nodeSelector"]["gpu"] = "false"
    assert p.role("encoder").pod_template == {"spec": {"nodeSelector": {"gpu": "true"}}}


# ------------------------------------------------------------------------ graph queries


def diamond() -> Pipeline:
    doc = minimal()
    doc["spec"]["roles"] = [
        {"name": n, "handler": "m:f"} for n in ("fuse", "ingest", "vision", "audio")
    ]
    doc["spec"]["edges"] = [
        {"from": "ingest", "to": "vision", "tensorRefs": [{"path": "raw", "to": "fuse"}]},
        {"from": "ingest", "to": "audio", "relay": "tcp"},
        {"from": "vision", "to": "fuse"},
        {"from": "audio", "to": "fuse"},
    ]
    doc["spec"]["colocation"] = [{"name": "encoders", "roles": ["vision", "audio"]}]
    doc["spec"]["transport"] = {"relay": "shm"}
    doc["spec"]["roles"][2]["transport"] = {"minBlock": "4Ki", "poolDevice": "cuda"}
    doc["spec"]["roles"][3]["image"] = "audio:2"
    return parse_pipeline(doc)


def test_graph_queries() -> None:
    p = diamond()
    assert p.role_names == ("fuse", "ingest", "vision", "audio")
    assert p.entry_roles == ("ingest",)
    assert p.exit_roles == ("fuse",)
    assert p.downstream("ingest") == ("vision", "audio")
    assert p.upstream("fuse") == ("vision", "audio")
    assert p.upstream("ingest") == ()
    assert p.reachable_from("ingest") == {"vision", "audio", "fuse"}
    assert p.reachable_from("fuse") == frozenset()
    assert p.topological_order == ("ingest", "vision", "audio", "fuse")
    assert [e.target for e in p.edges_from("ingest")] == ["vision", "audio"]
    assert [e.source for e in p.edges_to("fuse")] == ["vision", "audio"]


def test_colocation_pool_relay_and_image_queries() -> None:
    p = diamond()
    group = p.colocation_group_of("audio")
    assert group is not None and group.name == "encoders"
    assert p.colocation_group_of("ingest") is None
    assert p.pool_for("vision") == PoolSettings(size=256 * 2**20, min_block=4096, device="cuda")
    assert p.pool_for("fuse") == p.transport.pool == PoolSettings()
    assert [p.relay_for(e) for e in p.edges] == ["shm", "tcp", "shm", "shm"]
    assert p.image_for("audio") == "audio:2" and p.image_for("fuse") == "img:1"
    assert p.derived_name("vision") == "demo-vision"
    [(edge, ref)] = p.tensor_refs_to("fuse")
    assert (edge.source, edge.target, ref.path) == ("ingest", "vision", "raw")
    assert p.tensor_refs_to("vision") == ()


def test_unknown_role_raises_key_error() -> None:
    p = diamond()
    for query in (p.role, p.downstream, p.upstream, p.pool_for, p.colocation_group_of):
        with pytest.raises(KeyError, match="nope"):
            query("nope")


def test_topological_order_refuses_cycles_in_hand_built_pipelines() -> None:
    p = Pipeline(
        name="x",
        roles=(spec.Role(name="a", handler="m:f"), spec.Role(name="b", handler="m:f")),
        edges=(Edge(source="a", target="b"), Edge(source="b", target="a")),
    )
    with pytest.raises(ValueError, match="cycle"):
        _ = p.topological_order


@pytest.mark.parametrize(
    ("path", "steps"),
    [
        ("latents", ("latents",)),
        ("a.b[0]", ("a", "b", 0)),
        ("kv[12].keys", ("kv", 12, "keys")),
        ("[1].x", (1, "x")),
        ("text-embedding", ("text-embedding",)),
        ("a[0][1]", ("a", 0, 1)),
    ],
)
def test_payload_paths(path: str, steps: tuple[object, ...]) -> None:
    assert parse_payload_path(path) == steps
    assert TensorRef(path=path, to="x").steps == steps


@pytest.mark.parametrize(
    "path", ["", ".a", "a.", "a..b", "a[", "a[x]", "a[-1]", "a[01]", "1a", "a b"]
)
def test_malformed_payload_paths(path: str) -> None:
    with pytest.raises(ValueError):
        parse_payload_path(path)


# ------------------------------------------------------------------------------- rules
# Each table row breaks one rule in an otherwise valid four-role chain a -> b -> c -> d and
# names the path and a substring of the reason that must be reported.

Mutation = Callable[[Doc], object]


def chain() -> Doc:
    doc = minimal()
    doc["spec"]["roles"].append({"name": "d", "handler": "m:f"})
    doc["spec"]["edges"].append({"from": "c", "to": "d"})
    return doc


def _set(*keys: str | int, value: object) -> Mutation:
    def mutate(doc: Doc) -> None:
        target: Any = doc
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return mutate


def _delete(*keys: str | int) -> Mutation:
    def mutate(doc: Doc) -> None:
        target: Any = doc
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]

    return mutate


def _ids(rows: list[tuple[Any, ...]]) -> list[str]:
    return [f"{row[-2]}: {row[-1]}" for row in rows]


DOCUMENT_RULES: list[tuple[Mutation, str, str]] = [
    (_set("apiVersion", value="disagg.dev/v1"), "apiVersion", "disagg.dev/v1alpha1"),
    (_set("kind", value="Pipeline"), "kind", "DisaggregatedPipeline"),
    (_delete("kind"), "kind", "required field missing"),
    (_delete("metadata"), "metadata", "required field missing"),
    (_delete("spec"), "spec", "required field missing"),
    (_set("extra", value=1), "extra", "unknown field"),
    (_delete("metadata", "name"), "metadata.name", "required field missing"),
    (_set("metadata", "name", value=7), "metadata.name", "expected a string, got an integer"),
    (_set("metadata", "name", value="My_Pipe"), "metadata.name", "DNS-1035"),
    (_set("metadata", "name", value="1pipe"), "metadata.name", "DNS-1035"),
    (_set("metadata", "name", value="p" * 41), "metadata.name", "at most 40"),
    (_set("metadata", "namespace", value="Prod"), "metadata.namespace", "DNS-1123"),
    (_set("metadata", "namesapce", value="x"), "metadata.namesapce", "did you mean 'namespace'"),
    (_set("metadata", "labels", value={"a": 1}), "metadata.labels", "string keys and values"),
    (_set("spec", value=[1]), "spec", "expected a mapping, got a list"),
    (_set("spec", "role", value=[]), "spec.role", "did you mean 'roles'"),
    (_set("spec", "image", value="img 1"), "spec.image", "whitespace"),
    (_delete("spec", "image"), "spec.image", "required unless every role sets image"),
    (_set("spec", "roles", value={"a": 1}), "spec.roles", "expected a list, got a mapping"),
    (_delete("spec", "roles"), "spec.roles", "required field missing"),
    (_set("spec", "roles", 1, value="b"), "spec.roles[1]", "expected a mapping, got a string"),
    (_set("spec", "edges", value={"from": "a"}), "spec.edges", "expected a list"),
    (_set("spec", "colocation", value={"roles": ["a"]}), "spec.colocation", "expected a list"),
]


@pytest.mark.parametrize(("mutation", "path", "reason"), DOCUMENT_RULES, ids=_ids(DOCUMENT_RULES))
def test_document_rule(mutation: Mutation, path: str, reason: str) -> None:
    doc = chain()
    mutation(doc)
    assert_problem(doc, path, reason)


def test_a_pipeline_needs_a_role() -> None:
    doc = chain()
    doc["spec"].update(roles=[], edges=[])
    assert_problem(doc, "spec.roles", "at least one role")


TRANSPORT_RULES: list[tuple[dict[str, object], str, str]] = [
    ({"relay": "rdma"}, "relay", "must be one of auto, shm, tcp, cuda-ipc"),
    ({"poolDevice": "gpu"}, "poolDevice", "must be one of cpu, cpu-pinned, cuda"),
    ({"poolSize": "lots"}, "poolSize", "expected a quantity"),
    ({"poolSize": "100m"}, "poolSize", "whole number of bytes"),
    ({"poolSize": "-1Gi"}, "poolSize", "negative"),
    ({"poolSize": True}, "poolSize", "boolean"),
    ({"minBlock": "3Mi"}, "minBlock", "power of two, got 3Mi"),
    ({"minBlock": 0}, "minBlock", "power of two"),
    ({"poolSize": "512Ki"}, "poolSize", "(512Ki) is smaller than its minimum block (1Mi)"),
    ({"poolSize": "4Mi", "minBlock": "8Mi"}, "poolSize", "smaller than its minimum block"),
    ({"requestTimeoutSeconds": 0}, "requestTimeoutSeconds", "must be positive"),
    ({"requestTimeoutSeconds": "30s"}, "requestTimeoutSeconds", "expected a number"),
    ({"requestTimeoutSeconds": float("inf")}, "requestTimeoutSeconds", "finite"),
    ({"migrationAttempts": -1}, "migrationAttempts", "must be at least 0"),
    ({"migrationAttempts": 11}, "migrationAttempts", "at most 10"),
    ({"migrationAttempts": True}, "migrationAttempts", "expected an integer"),
    ({"pool": "1Gi"}, "pool", "unknown field (did you mean 'poolSize'?)"),
]


@pytest.mark.parametrize(("transport", "key", "reason"), TRANSPORT_RULES, ids=_ids(TRANSPORT_RULES))
def test_transport_rule(transport: dict[str, object], key: str, reason: str) -> None:
    doc = chain()
    doc["spec"]["transport"] = transport
    assert_problem(doc, f"spec.transport.{key}", reason)


def _ports(*ports: tuple[str, int]) -> dict[str, object]:
    return {"ports": [{"name": name, "containerPort": number} for name, number in ports]}


ROLE_RULES: list[tuple[dict[str, object], str, str]] = [
    ({"handler": None}, ".handler", "expected a string, got null"),
    ({"replica": 2}, ".replica", "unknown field (did you mean 'replicas'?)"),
    ({"replicas": "2"}, ".replicas", "expected an integer, got a string"),
    ({"replicas": True}, ".replicas", "expected an integer, got a boolean"),
    ({"replicas": 1.5}, ".replicas", "expected an integer, got a number"),
    ({"replicas": -1}, ".replicas", "must be at least 0, got -1"),
    ({"concurrency": 0}, ".concurrency", "must be at least 1"),
    ({"idempotent": "no"}, ".idempotent", "expected true or false, got a string"),
    ({"name": "Bee"}, ".name", "DNS-1035"),
    ({"name": "b_b"}, ".name", "DNS-1035"),
    ({"name": "b-"}, ".name", "DNS-1035"),
    ({"name": "9b"}, ".name", "DNS-1035"),
    ({"name": "b" * 64}, ".name", "at most 63"),
    ({"name": "b" * 48}, ".name", "the derived name 'demo-bbb"),
    ({"name": False}, ".name", "expected a string, got a boolean"),
    ({"name": "c"}, ".name", "duplicate role 'c' (also spec.roles[2])"),
    ({"handler": "module.fn"}, ".handler", "expected 'package.module:function'"),
    ({"handler": "module:"}, ".handler", "expected 'package.module:function'"),
    ({"handler": ":fn"}, ".handler", "expected 'package.module:function'"),
    ({"handler": "my-mod:fn"}, ".handler", "expected 'package.module:function'"),
    ({"handler": "pkg.class:fn"}, ".handler", "expected 'package.module:function'"),
    ({"handler": "a:b:c"}, ".handler", "expected 'package.module:function'"),
    ({"handler": "a:b()"}, ".handler", "expected 'package.module:function'"),
    ({"handler": "a:Model.run"}, ".handler", "one function name"),
    ({"image": ""}, ".image", "must not be empty"),
    ({"command": "python"}, ".command", "expected a list, got a string"),
    ({"args": ["a", 1]}, ".args[1]", "expected a string, got an integer"),
    ({"env": {"A": "1"}}, ".env", "expected a list"),
    ({"env": [{"name": "A-B"}]}, ".env[0].name", "not a valid variable name"),
    ({"env": [{"name": "DISAGG_ROLE"}]}, ".env[0].name", "DISAGG_ prefix is reserved"),
    ({"env": [{"name": "A"}, {"name": "A"}]}, ".env[1].name", "duplicate variable 'A'"),
    ({"env": [{"name": "A", "value": 1}]}, ".env[0].value", "quote it"),
    ({"env": [{"name": "A", "value": "1", "valueFrom": {}}]}, ".env[0]", "not both"),
    ({"env": [{"value": "1"}]}, ".env[0].name", "required field missing"),
    ({"env": ["A=1"]}, ".env[0]", "expected a mapping, got a string"),
    ({"resources": {"request": {}}}, ".resources.request", "did you mean 'requests'"),
    ({"resources": {"limits": []}}, ".resources.limits", "expected a mapping, got a list"),
    ({"resources": {"limits": {"memory": "2GB"}}}, ".resources.limits.memory", "quantity"),
    (
        {"resources": {"limits": {"nvidia.com/gpu": "x"}}},
        '.resources.limits["nvidia.com/gpu"]',
        "expected a quantity",
    ),
    ({"resources": {"requests": {"cpu": "-1"}}}, ".resources.requests.cpu", "negative"),
    (
        {"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}},
        ".resources.requests.memory",
        "request 2Gi exceeds the limit 1Gi",
    ),
    ({"ports": {"name": "x"}}, ".ports", "expected a list"),
    (_ports(("x", 70000)), ".ports[0].containerPort", "must be in 1..65535, got 70000"),
    (_ports(("x", 0)), ".ports[0].containerPort", "must be in 1..65535"),
    (_ports(("HTTP", 80)), ".ports[0].name", "not a valid port name"),
    (_ports(("p" * 16, 80)), ".ports[0].name", "at most 15"),
    (_ports(("80", 80)), ".ports[0].name", "at least one letter"),
    (_ports(("a--b", 80)), ".ports[0].name", "single '-'"),
    (_ports(("x", 80), ("x", 81)), ".ports[1].name", "duplicate port name 'x'"),
    (_ports(("x", 80), ("y", 80)), ".ports[1].containerPort", "duplicate port 80/TCP"),
    (
        {"ports": [{"name": "x", "containerPort": 1, "protocol": "tcp"}]},
        ".ports[0].protocol",
        "TCP",
    ),
    ({"ports": [{"name": "x"}]}, ".ports[0].containerPort", "required field missing"),
    ({"transport": {"poolSize": "1Gb"}}, ".transport.poolSize", "expected a quantity"),
    ({"transport": {"relay": "tcp"}}, ".transport.relay", "unknown field"),
    ({"transport": {"minBlock": 1000}}, ".transport.minBlock", "power of two"),
    ({"transport": {"poolSize": "64Ki"}}, ".transport.poolSize", "smaller than its minimum block"),
    (
        {"transport": {"minBlock": "512Mi"}},
        ".transport.minBlock",
        "the pool (256Mi) is smaller than its minimum block (512Mi)",
    ),
    ({"autoscaling": 3}, ".autoscaling", "expected a mapping, got an integer"),
    ({"podTemplate": ["x"]}, ".podTemplate", "expected a mapping"),
]


@pytest.mark.parametrize(("fields", "suffix", "reason"), ROLE_RULES, ids=_ids(ROLE_RULES))
def test_role_rule(fields: dict[str, object], suffix: str, reason: str) -> None:
    doc = chain()
    doc["spec"]["roles"][3].update(fields)
    assert_problem(doc, f"spec.roles[3]{suffix}", reason)


AUTOSCALING_RULES: list[tuple[dict[str, object], str, str]] = [
    ({"minReplicas": 1}, "maxReplicas", "required field missing"),
    (
        {"minReplicas": 5, "maxReplicas": 3},
        "minReplicas",
        "minReplicas 5 is greater than maxReplicas 3",
    ),
    ({"minReplicas": 0, "maxReplicas": 3}, "minReplicas", "at least 1"),
    ({"maxReplicas": 0}, "maxReplicas", "at least 1"),
    ({"maxReplicas": 3, "targetPoolOccupancy": 0}, "targetPoolOccupancy", "must be in (0, 1]"),
    ({"maxReplicas": 3, "targetPoolOccupancy": 1.5}, "targetPoolOccupancy", "must be in (0, 1]"),
    ({"maxReplicas": 3, "targetPoolOccupancy": -0.1}, "targetPoolOccupancy", "must be in (0, 1]"),
    ({"maxReplicas": 3, "targetPoolOccupancy": "70%"}, "targetPoolOccupancy", "expected a number"),
    ({"maxReplicas": 3, "scaleUpStabilizationSeconds": -1}, "scaleUpStabilizationSeconds", "0"),
    (
        {"maxReplicas": 3, "scaleDownStabilizationSeconds": 1.5},
        "scaleDownStabilizationSeconds",
        "expected an integer, got a number",
    ),
    ({"maxReplicas": 3, "tolerance": 1}, "tolerance", "must be in [0, 1)"),
    ({"maxReplicas": 3, "tolerance": -0.5}, "tolerance", "must be in [0, 1)"),
    ({"maxReplicas": 3, "target": 0.5}, "target", "unknown field"),
]


@pytest.mark.parametrize(
    ("policy", "key", "reason"), AUTOSCALING_RULES, ids=_ids(AUTOSCALING_RULES)
)
def test_autoscaling_rule(policy: dict[str, object], key: str, reason: str) -> None:
    doc = chain()
    doc["spec"]["roles"][1]["autoscaling"] = policy
    assert_problem(doc, f"spec.roles[1].autoscaling.{key}", reason)


def test_occupancy_of_exactly_one_is_allowed() -> None:
    doc = chain()
    doc["spec"]["roles"][1]["autoscaling"] = {"maxReplicas": 2, "targetPoolOccupancy": 1}
    autoscaling = parse_pipeline(doc).role("b").autoscaling
    assert autoscaling is not None and autoscaling.target_pool_occupancy == 1.0


def _edge(spec_: str, **fields: object) -> dict[str, object]:
    source, target = spec_.split(">")
    return {"from": source, "to": target, **fields}


def _ref(path: str, to: str) -> dict[str, str]:
    return {"path": path, "to": to}


def _chain_with(*extra: dict[str, object], refs: object = None) -> list[Any]:
    """The chain's edges a>b, b>c, c>d (a>b carrying `refs`), then `extra`."""
    first = _edge("a>b") if refs is None else _edge("a>b", tensorRefs=refs)
    return [first, _edge("b>c"), _edge("c>d"), *extra]


EDGE_RULES: list[tuple[list[Any], str, str]] = [
    ([{"from": "a"}], "[0].to", "required field missing"),
    ([_edge("a>b", relays="tcp")], "[0].relays", "did you mean 'relay'"),
    ([_edge("a>b", relay="nccl")], "[0].relay", "must be one of auto, shm, tcp, cuda-ipc"),
    (_chain_with(_edge("a>bb")), "[3].to", "unknown role 'bb' (did you mean 'b'?)"),
    (_chain_with(_edge("x>b")), "[3].from", "unknown role 'x'"),
    ([_edge("a>b", to=7)], "[0].to", "expected a string, got an integer"),
    (_chain_with(_edge("c>c")), "[3]", "an edge from 'c' to itself"),
    (_chain_with(_edge("a>b")), "[3]", "duplicate edge a -> b (also spec.edges[0])"),
    (_chain_with(_edge("c>b")), "[3]", "closes a cycle: b -> c -> b"),
    (_chain_with(_edge("d>a")), "[3]", "closes a cycle: a -> b -> c -> d -> a"),
    (_chain_with(_edge("d>a")), "", "no entry role"),
    (_chain_with(refs="x"), "[0].tensorRefs", "expected a list"),
    (_chain_with(refs=[{"path": "x"}]), "[0].tensorRefs[0].to", "required field missing"),
    (_chain_with(refs=[_ref("a..b", "c")]), "[0].tensorRefs[0].path", "malformed payload path"),
    (_chain_with(refs=[_ref("", "c")]), "[0].tensorRefs[0].path", "must not be empty"),
    (_chain_with(refs=[_ref("x", "c"), _ref("x.y", "d")]), "[0].tensorRefs[1].path", "overlaps"),
    (_chain_with(refs=[_ref("x", "c"), _ref("x", "d")]), "[0].tensorRefs[1].path", "overlaps"),
    (_chain_with(refs=[_ref("x", "zz")]), "[0].tensorRefs[0].to", "unknown role 'zz'"),
    (_chain_with(refs=[_ref("x", "b")]), "[0].tensorRefs[0].to", "this edge's target"),
    (_chain_with(refs=[_ref("x", "a")]), "[0].tensorRefs[0].to", "not downstream of 'b'"),
    (
        [_edge("a>b"), _edge("b>c"), _edge("c>d", tensorRefs=[_ref("x", "a")])],
        "[2].tensorRefs[0].to",
        "role 'a' is not downstream of 'd'",
    ),
    ([_edge("a>b", relay="cuda-ipc"), *_chain_with()[1:]], "[0].relay", "one colocation group"),
]


@pytest.mark.parametrize(("edges", "suffix", "reason"), EDGE_RULES, ids=_ids(EDGE_RULES))
def test_edge_rule(edges: list[Any], suffix: str, reason: str) -> None:
    doc = chain()
    doc["spec"]["edges"] = edges
    assert_problem(doc, f"spec.edges{suffix}", reason)


def test_default_cuda_ipc_relay_needs_colocation() -> None:
    doc = chain()
    doc["spec"]["transport"] = {"relay": "cuda-ipc"}
    doc["spec"]["colocation"] = [{"roles": ["a", "b"]}]
    assert_problem(doc, "spec.edges[1]", "relay cuda-ipc (the default from spec.transport.relay)")
    assert "spec.edges[0]" not in [p.path for p in problems(doc)]  # a and b share a GPU


COLOCATION_RULES: list[tuple[list[Any], str, str]] = [
    ([{"roles": ["a", "zz"]}], "[0].roles[1]", "unknown role 'zz'"),
    ([{"roles": ["a"]}], "[0].roles", "needs at least 2 roles, got 1"),
    ([{"name": "g"}], "[0].roles", "required field missing"),
    ([{"roles": "a,b"}], "[0].roles", "expected a list"),
    ([{"roles": ["a", "b"]}, {"roles": ["c", "b"]}], "[1].roles[1]", "already in colocation group"),
    ([{"roles": ["a", "b"]}, {"roles": ["c", "b"]}], "[1].roles[1]", "'a' (spec.colocation[0])"),
    ([{"roles": ["a", "b", "a"]}], "[0].roles[2]", "listed twice in this group"),
    ([{"name": "G", "roles": ["a", "b"]}], "[0].name", "DNS-1035"),
    ([{"name": "g", "roles": ["a", "b"]}, {"name": "g", "roles": ["c", "d"]}], "[1].name", "dupl"),
    ([{"name": "c", "roles": ["a", "b"]}], "[0].name", "would collide"),
    ([{"name": "g" * 48, "roles": ["a", "b"]}], "[0].name", "the derived name 'demo-ggg"),
    ([{"roles": ["a", "b"], "gpu": 0}], "[0].gpu", "unknown field"),
]


@pytest.mark.parametrize(
    ("groups", "suffix", "reason"), COLOCATION_RULES, ids=_ids(COLOCATION_RULES)
)
def test_colocation_rule(groups: list[Any], suffix: str, reason: str) -> None:
    doc = chain()
    doc["spec"]["colocation"] = groups
    assert_problem(doc, f"spec.colocation{suffix}", reason)


def test_colocated_roles_share_replicas_autoscaling_and_ports() -> None:
    doc = chain()
    roles = doc["spec"]["roles"]
    roles[0].update(replicas=2, **_ports(("x", 80), ("y", 81)))
    roles[1].update(autoscaling={"maxReplicas": 2}, **_ports(("z", 80), ("y", 82)))
    doc["spec"]["colocation"] = [{"roles": ["a", "b"]}]
    assert_problem(doc, "spec.colocation[0].roles", "replicas must match: a=2, b=1")
    assert_problem(doc, "spec.colocation[0].roles", "autoscaling must match")
    assert_problem(doc, "spec.roles[1].ports[0].containerPort", "also used by role 'a'")
    assert_problem(doc, "spec.roles[1].ports[1].name", "which shares the pod")


def test_colocated_roles_may_use_the_same_port_on_other_protocols() -> None:
    doc = chain()
    doc["spec"]["roles"][0]["ports"] = [{"name": "x", "containerPort": 80}]
    doc["spec"]["roles"][1]["ports"] = [{"name": "y", "containerPort": 80, "protocol": "UDP"}]
    doc["spec"]["colocation"] = [{"name": "pair", "roles": ["a", "b"]}]
    group = parse_pipeline(doc).colocation_group_of("b")
    assert group == ColocationGroup(name="pair", roles=("a", "b"))


def test_document_that_is_not_a_mapping() -> None:
    assert_problem(["a"], "", "expected a mapping, got a list")
    assert_problem(None, "", "expected a mapping, got null")


def test_all_problems_are_reported_at_once() -> None:
    doc = minimal()
    doc["metadata"]["name"] = "Bad"
    doc["spec"]["roles"][0]["replicas"] = -1
    doc["spec"]["roles"][1]["handler"] = "nope"
    doc["spec"]["edges"].append({"from": "c", "to": "zz"})
    paths = [p.path for p in problems(doc)]
    assert paths == [
        "metadata.name",
        "spec.roles[0].replicas",
        "spec.roles[1].handler",
        "spec.edges[2].to",
    ]


def test_one_mistake_is_reported_once() -> None:
    doc = minimal()
    doc["spec"]["roles"][1]["name"] = "B"  # malformed, but edges naming it still resolve
    doc["spec"]["edges"] = [{"from": "a", "to": "B"}, {"from": "B", "to": "c"}]
    assert [p.path for p in problems(doc)] == ["spec.roles[1].name"]
    doc = minimal()
    doc["spec"]["transport"] = {"poolSize": "nonsense"}  # no second "pool < block" line
    assert [p.path for p in problems(doc)] == ["spec.transport.poolSize"]
    doc = minimal()
    doc["spec"]["roles"][0] = "a"  # no role is named 'a' now, so the edge naming it is wrong too
    paths = [p.path for p in problems(doc)]
    assert paths == ["spec.roles[0]", "spec.edges[0].from"]


def test_pipeline_and_role_names_at_the_length_limit() -> None:
    doc = minimal()
    doc["metadata"]["name"] = "p" * spec.MAX_PIPELINE_NAME_LENGTH
    room = spec.MAX_DERIVED_NAME_LENGTH - spec.MAX_PIPELINE_NAME_LENGTH - 1
    doc["spec"]["roles"][0]["name"] = "a" * room
    doc["spec"]["edges"][0]["from"] = "a" * room
    assert len(parse_pipeline(doc).derived_name("a" * room)) == spec.MAX_DERIVED_NAME_LENGTH
    doc["spec"]["roles"][0]["name"] = doc["spec"]["edges"][0]["from"] = "a" * (room + 1)
    assert_problem(doc, "spec.roles[0].name", f"has {spec.MAX_DERIVED_NAME_LENGTH + 1} characters")


def test_cycles_are_reported_once_per_loop() -> None:
    doc = minimal()
    doc["spec"]["roles"] += [{"name": n, "handler": "m:f"} for n in ("d", "e")]
    doc["spec"]["edges"] = [
        {"from": "a", "to": "b"},
        {"from": "b", "to": "c"},
        {"from": "c", "to": "b"},
        {"from": "c", "to": "d"},
        {"from": "d", "to": "e"},
        {"from": "e", "to": "d"},
        {"from": "b", "to": "b"},
    ]
    cycles = [p for p in problems(doc) if "cycle" in p.reason]
    assert [(p.path, p.reason) for p in cycles] == [
        ("spec.edges[2]", "closes a cycle: b -> c -> b"),
        ("spec.edges[5]", "closes a cycle: d -> e -> d"),
    ]


def test_tensor_ref_may_skip_several_hops() -> None:
    doc = minimal()
    doc["spec"]["roles"].append({"name": "d", "handler": "m:f"})
    doc["spec"]["edges"].append({"from": "c", "to": "d"})
    doc["spec"]["edges"][0]["tensorRefs"] = [
        {"path": "kv[0]", "to": "d"},
        {"path": "kv[1]", "to": "c"},
    ]
    p = parse_pipeline(doc)
    assert [ref.to for ref in p.edges[0].tensor_refs] == ["d", "c"]


def test_spec_error_lists_problems() -> None:
    doc = minimal()
    doc["spec"]["roles"][0]["replicas"] = -1
    with pytest.raises(SpecError) as caught:
        parse_pipeline(doc)
    assert isinstance(caught.value, ValueError)
    assert caught.value.problems == (
        Problem("spec.roles[0].replicas", "must be at least 0, got -1"),
    )
    assert "spec.roles[0].replicas: must be at least 0" in str(caught.value)
    assert str(Problem("", "empty")) == "<document>: empty"


# ----------------------------------------------------------------------------- loading

VALID_YAML = yaml.safe_dump(minimal())


def test_load_pipeline_text() -> None:
    assert spec.load_pipeline_text(VALID_YAML).role_names == ("a", "b", "c")
    with pytest.raises(SpecError, match=r"in mine\.yaml"):
        spec.load_pipeline_text("kind: x\n", "mine.yaml")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "the file is empty"),
        ("# only a comment\n", "the file is empty"),
        (VALID_YAML + "---\n" + VALID_YAML, "holds 2 YAML documents"),
        ("a: [1\n", "YAML syntax error at line 2, column 1"),
        ("a: 1\na: 2\n", "duplicate key 'a'"),
        ("- 1\n- 2\n", "expected a mapping, got a list"),
        ("just text\n", "expected a mapping, got a string"),
    ],
)
def test_load_pipeline_text_rejects(text: str, reason: str) -> None:
    with pytest.raises(SpecError) as caught:
        spec.load_pipeline_text(text, "f.yaml")
    [problem] = caught.value.problems
    assert problem.path == "" and reason in problem.reason
    assert caught.value.source == "f.yaml"


def test_trailing_document_separator_is_fine() -> None:
    assert spec.load_pipeline_text(VALID_YAML + "---\n").name == "demo"


def test_yaml_merge_keys_may_override() -> None:
    merged = "base: &b {handler: 'm:f', replicas: 1}\nrole: {<<: *b, replicas: 2}\n"
    assert yaml.load(merged, Loader=spec._StrictLoader)["role"]["replicas"] == 2


def test_load_pipeline_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(VALID_YAML)
    assert spec.load_pipeline_file(path).name == "demo"
    assert spec.load_pipeline_file(str(path)).name == "demo"
    with pytest.raises(SpecError, match="cannot read the file"):
        spec.load_pipeline_file(tmp_path / "missing.yaml")
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(SpecError, match="not UTF-8"):
        spec.load_pipeline_file(path)


# --------------------------------------------------------------------------------- CLI


def run_cli(*files: str | os.PathLike[str]) -> tuple[int, list[str]]:
    out = io.StringIO()
    status = spec.validate_cli([os.fspath(f) for f in files], out=out)
    return status, out.getvalue().splitlines()


def test_validate_cli_valid_files(tmp_path: pathlib.Path) -> None:
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(VALID_YAML)
    second.write_text(VALID_YAML)
    assert run_cli(first, second) == (0, [f"{first}: ok", f"{second}: ok"])


def test_validate_cli_reports_one_line_per_problem(tmp_path: pathlib.Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(VALID_YAML)
    doc = minimal()
    doc["spec"]["roles"][1]["replicas"] = -2
    doc["spec"]["edges"][1]["to"] = "nowhere"
    bad.write_text(yaml.safe_dump(doc))
    status, lines = run_cli(bad, good)
    assert status == 1
    assert lines == [
        f"{bad}: spec.roles[1].replicas: must be at least 0, got -2",
        f"{bad}: spec.edges[1].to: unknown role 'nowhere'",
        f"{good}: ok",
    ]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (VALID_YAML + "---\n" + VALID_YAML, "holds 2 YAML documents"),
        ("- a\n- b\n", "expected a mapping, got a list"),
        ("spec: {roles: [\n", "YAML syntax error at line"),
        ("", "the file is empty"),
    ],
)
def test_validate_cli_file_level_problems(
    tmp_path: pathlib.Path, content: str, reason: str
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(content)
    status, lines = run_cli(path)
    assert status == 1
    [line] = lines
    assert line.startswith(f"{path}: <document>: ") and reason in line


def test_validate_cli_missing_and_unreadable(tmp_path: pathlib.Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(VALID_YAML)
    status, lines = run_cli(tmp_path / "missing.yaml", tmp_path, good)
    assert status == 1
    assert lines == [
        f"{tmp_path / 'missing.yaml'}: <document>: cannot read the file: No such file or directory",
        f"{tmp_path}: <document>: cannot read the file: Is a directory",
        f"{good}: ok",
    ]


def test_cli_entry_point_validates(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from disagg_runtime import cli

    path = tmp_path / "p.yaml"
    path.write_text(VALID_YAML)
    assert cli.main(["validate", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: ok\n"


# ---------------------------------------------------------------- examples and imports


def test_examples_exist_and_validate() -> None:
    files = sorted(EXAMPLES.glob("*.yaml"))
    names = {f.name for f in files}
    assert {"text-to-video.yaml", "llm-prefill-decode.yaml", "fan-out.yaml"} <= names
    status, lines = run_cli(*files)
    assert (status, lines) == (0, [f"{f}: ok" for f in files])


def test_text_to_video_example_shape() -> None:
    p = spec.load_pipeline_file(EXAMPLES / "text-to-video.yaml")
    assert p.topological_order == ("encoder", "denoiser", "decoder")
    assert [r.handler for r in p.roles] == [
        "disagg_runtime.demo:encode_text",
        "disagg_runtime.demo:denoise",
        "disagg_runtime.demo:decode_video",
    ]
    [(edge, ref)] = p.tensor_refs_to("decoder")
    assert (edge.source, ref.path) == ("encoder", "text_embedding")


def test_fan_out_example_shape() -> None:
    p = spec.load_pipeline_file(EXAMPLES / "fan-out.yaml")
    [entry] = p.entry_roles
    [exit_] = p.exit_roles
    assert len(p.downstream(entry)) == 2 and len(p.upstream(exit_)) == 2


# ------------------------------------------------------------------------------ fuzzing

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


LIKELY_VALUES = ["encoder", "denoiser", "decoder", "", "1Mi", "cuda-ipc", -1, 0, 1, [], {}]


def _paths(value: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


@settings(max_examples=300, deadline=None)
@given(data=st.data(), replacement=json_values | st.sampled_from(LIKELY_VALUES))
def test_any_corruption_of_a_valid_document_is_a_spec_error(
    data: st.DataObject, replacement: object
) -> None:
    doc = full()
    path = data.draw(st.sampled_from(_paths(doc)[1:]))
    target: Any = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = copy.deepcopy(replacement)
    try:
        parse_pipeline(doc)
    except SpecError as error:
        assert error.problems
        assert all(isinstance(p.path, str) and p.reason for p in error.problems)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_arbitrary_documents_never_crash(doc: object) -> None:
    with pytest.raises(SpecError):
        parse_pipeline(doc)


def test_ratio_locks_parse_with_defaults() -> None:
    doc = chain()
    doc["spec"]["ratioLocks"] = [
        {"leader": "b", "follower": "c", "leaderShare": 4, "followerShare": 1, "tolerance": 0.5},
        {"leader": "c", "follower": "d"},
    ]
    locks = parse_pipeline(doc).ratio_locks
    assert [
        (x.leader, x.follower, x.leader_share, x.follower_share, x.tolerance) for x in locks
    ] == [
        ("b", "c", 4, 1, 0.5),
        ("c", "d", 1, 1, 0.0),
    ]


@pytest.mark.parametrize(
    ("locks", "path", "reason"),
    [
        ([{"leader": "b", "follower": "zz"}], "spec.ratioLocks[0].follower", "unknown role 'zz'"),
        ([{"leader": "b", "follower": "b"}], "spec.ratioLocks[0].follower", "locked to itself"),
        ([{"leader": "b"}], "spec.ratioLocks[0].follower", "required field missing"),
        (
            [{"leader": "b", "follower": "c", "leaderShare": 0}],
            "spec.ratioLocks[0].leaderShare",
            "at least 1",
        ),
        (
            [{"leader": "b", "follower": "c", "tolerance": 1}],
            "spec.ratioLocks[0].tolerance",
            "[0, 1)",
        ),
        (
            [{"leader": "b", "follower": "c"}, {"leader": "d", "follower": "c"}],
            "spec.ratioLocks[1].follower",
            "already follows a leader (spec.ratioLocks[0])",
        ),
        (
            [{"leader": "b", "follower": "c"}, {"leader": "c", "follower": "b"}],
            "spec.ratioLocks[0]",
            "form a cycle",
        ),
    ],
)
def test_ratio_lock_rules(locks: list[Any], path: str, reason: str) -> None:
    doc = chain()
    doc["spec"]["ratioLocks"] = locks
    assert_problem(doc, path, reason)


def test_ratio_lock_inside_a_colocation_group_must_be_one_to_one() -> None:
    doc = chain()
    doc["spec"]["colocation"] = [{"roles": ["b", "c"]}]
    doc["spec"]["ratioLocks"] = [{"leader": "b", "follower": "c", "leaderShare": 2}]
    assert_problem(doc, "spec.ratioLocks[0]", "always equal")
    doc["spec"]["ratioLocks"] = [{"leader": "b", "follower": "c"}]
    parse_pipeline(doc)


# ---------------------------------------------------------------- handler lifecycle fields


def _llm_doc() -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / "hf-llm.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def test_handler_args_batching_and_startup_parse() -> None:
    prefill, decode = spec.parse_pipeline(_llm_doc()).roles
    model = "${DISAGG_TINY_LLM:-/tmp/disagg-tiny-llm}"  # expanded by the file loaders only
    assert prefill.handler_args == {"model": model, "dtype": "float32"}
    assert prefill.batching == spec.model.Batching(max_batch_size=8, max_wait_milliseconds=5.0)
    assert prefill.startup_seconds == 900
    assert decode.batching is None and decode.startup_seconds == 900
    doc = _llm_doc()
    doc["spec"]["roles"][1].pop("startupSeconds")
    doc["spec"]["roles"][1].pop("handlerArgs")
    bare = spec.parse_pipeline(doc).roles[1]
    assert (bare.handler_args, bare.batching) == ({}, None)
    assert bare.startup_seconds == spec.model.DEFAULT_STARTUP_SECONDS


@pytest.mark.parametrize(
    ("role", "where", "reason"),
    [
        ({"handlerArgs": "m"}, "handlerArgs", "expected a mapping"),
        ({"handlerArgs": {"x": float("inf")}}, "handlerArgs", "plain JSON"),
        ({"batching": {"maxBatchSize": 32}}, "batching.maxBatchSize", "exceeds concurrency 16"),
        ({"batching": {}}, "batching.maxBatchSize", "required"),
        ({"batching": {"maxBatchSize": 2, "wait": 1}}, "batching.wait", "unknown field"),
        (
            {"batching": {"maxBatchSize": 2, "maxWaitMilliseconds": -1}},
            "batching.maxWaitMilliseconds",
            "[0, 60000]",
        ),
        ({"startupSeconds": 0}, "startupSeconds", "at least 1"),
    ],
)
def test_handler_field_problems_are_named(role: dict[str, Any], where: str, reason: str) -> None:
    doc = _llm_doc()
    doc["spec"]["roles"][0].update(role)
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_pipeline(doc)
    [problem] = caught.value.problems
    assert problem.path == f"spec.roles[0].{where}" and reason in problem.reason


# -- spec.rollout --------------------------------------------------------------------------


def _with_rollout(rollout: object) -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "p"},
        "spec": {
            "image": "img",
            "roles": [{"name": "a", "handler": "m:f"}, {"name": "b", "handler": "m:f"}],
            "edges": [{"from": "a", "to": "b"}],
            "rollout": rollout,
        },
    }


def test_rollout_defaults_and_values():
    assert spec.parse_pipeline(_with_rollout({})).rollout == spec.model.Rollout()
    parsed = spec.parse_pipeline(
        _with_rollout(
            {"maxSkew": "25%", "maxUnavailable": 2, "paused": True, "groups": [["a", "b"]]}
        )
    ).rollout
    percent, count = spec.model.IntOrPercent(25, percent=True), spec.model.IntOrPercent(2)
    assert (parsed.max_skew, parsed.max_unavailable, parsed.paused) == (percent, count, True)
    assert parsed.groups == (("a", "b"),)
    shares = spec.parse_pipeline(
        _with_rollout({"maxSkew": 1, "maxUnavailable": "50%", "partition": "10%"})
    ).rollout
    assert (str(shares.max_skew), str(shares.max_unavailable), str(shares.partition)) == (
        "1",
        "50%",
        "10%",
    )


def test_rollout_fractions_are_refused_with_the_int_or_percent_form():
    with pytest.raises(spec.SpecError) as info:
        spec.parse_pipeline(_with_rollout({"maxSkew": 0.25}))
    problems = info.value.problems
    assert any(
        p.path == "spec.rollout.maxSkew" and 'an integer or a percentage ("25%")' in p.reason
        for p in problems
    ), problems


@pytest.mark.parametrize(
    ("rollout", "where"),
    [
        ({"maxSkew": 0}, "spec.rollout.maxSkew"),
        ({"maxSkew": "150%"}, "spec.rollout.maxSkew"),
        ({"maxSkew": "a lot"}, "spec.rollout.maxSkew"),
        ({"maxUnavailable": "0%"}, "spec.rollout.maxUnavailable"),
        ({"maxUnavailable": 0}, "spec.rollout.maxUnavailable"),
        ({"partition": -1}, "spec.rollout.partition"),
        ({"paused": "yes"}, "spec.rollout.paused"),
        ({"stepDeadlineSeconds": 10**9}, "spec.rollout.stepDeadlineSeconds"),
        ({"groups": [["a"]]}, "spec.rollout.groups[0]"),
        ({"groups": [["a", "nope"]]}, "spec.rollout.groups[0]"),
        ({"speed": 3}, "spec.rollout.speed"),
    ],
)
def test_bad_rollouts_name_the_field(rollout, where):
    with pytest.raises(spec.SpecError) as info:
        spec.parse_pipeline(_with_rollout(rollout))
    assert where in {p.path for p in info.value.problems}, info.value.problems
