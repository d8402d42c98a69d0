"""The CRD and the spec module agree: every valid document accepted by both, invalid ones
rejected by both where the CRD can express the rule, defaults that do not change meaning, and
the same fields known on both sides. (That crds/ is current is `make verify`'s.)"""

from __future__ import annotations

import copy
import pathlib
import re
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest

from disagg_core import spec
from disagg_core.spec import fields as spec_fields
from disagg_core.spec import limits
from disagg_core.spec.model import API_VERSION, KIND
from disagg_operator import names

Doc = dict[str, Any]
Mutation = Callable[[Doc], None]


@pytest.mark.parametrize("version", ["1.33", kubernetes_validate.utils.latest_version()])
def test_crd_is_a_valid_kubernetes_object(crd_checker: Any, version: str) -> None:
    kubernetes_validate.validate(crd_checker.crd, version, strict=True)


def test_crd_names_and_columns(crd_checker: Any) -> None:
    body = crd_checker.crd
    assert body["metadata"]["name"] == "disaggregatedpipelines.disagg.dev"
    assert f"{body['spec']['group']}/{body['spec']['versions'][0]['name']}" == API_VERSION
    assert f"{names.GROUP}/{names.VERSION}" == names.PIPELINE_API_VERSION
    assert body["spec"]["names"] == {
        "kind": KIND,
        "listKind": KIND + "List",
        "plural": "disaggregatedpipelines",
        "singular": "disaggregatedpipeline",
        "shortNames": ["dpipe"],
        "categories": ["disagg"],
    }
    (version,) = body["spec"]["versions"]
    assert version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == ".status.readyRoles"
    assert columns["Phase"] == ".status.phase"
    assert columns["Age"] == ".metadata.creationTimestamp"


def _nodes(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every property and item schema, with its path (items as `[]`)."""
    found = [(path, schema)]
    for key, sub in schema.get("properties", {}).items():
        found += _nodes(sub, f"{path}.{key}" if path else key)
    if isinstance(schema.get("additionalProperties"), dict):
        found += _nodes(schema["additionalProperties"], f"{path}.*")
    if "items" in schema:
        found += _nodes(schema["items"], f"{path}[]")
    return found


def test_every_field_has_a_description(crd_checker: Any) -> None:
    """...but metadata: the API server lets the schema restrict only its name and generateName,
    and a description is more (it refuses the CRD)."""
    lacking = [path for path, node in _nodes(crd_checker.schema) if not node.get("description")]
    assert lacking == ["metadata"]


def test_schema_is_structural(crd_checker: Any) -> None:
    """Every node has a type (or is int-or-string / preserves unknown fields); list-map keys
    are required scalar properties; rules compile."""
    for path, node in _nodes(crd_checker.schema):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if node.get("x-kubernetes-list-type") == "map":
            item = node["items"]
            for key in node["x-kubernetes-list-map-keys"]:
                assert key in item["required"], (path, key)
                assert item["properties"][key]["type"] in ("string", "integer"), (path, key)
        if node.get("type") == "array" and any(
            r["rule"].count("self.all") for r in node.get("x-kubernetes-validations", [])
        ):
            assert "maxItems" in node, path  # bounded cost
    for _, rule in crd_checker.rules():
        crd_checker.program(rule)


def test_valid_documents_pass_both(
    crd_checker: Any, example_files: list[pathlib.Path], load_yaml: Any, full_doc: Doc
) -> None:
    docs = [load_yaml(path) for path in example_files] + [full_doc]
    assert len(docs) >= 4
    for doc in docs:
        spec.parse_pipeline(doc)
        assert crd_checker.errors(doc) == [], doc["metadata"]["name"]


def test_defaults_do_not_change_meaning(
    crd_checker: Any, example_files: list[pathlib.Path], load_yaml: Any, full_doc: Doc
) -> None:
    """The API server stores the document with the CRD's defaults: it must parse the same."""
    docs = [load_yaml(path) for path in example_files] + [full_doc, _minimal()]
    for doc in docs:
        defaulted = crd_checker.defaulted(doc)
        assert spec.parse_pipeline(defaulted) == spec.parse_pipeline(doc)
    stored = crd_checker.defaulted(_minimal())
    assert stored["spec"]["transport"] == {
        "relay": "auto",
        "poolSize": "256Mi",
        "minBlock": "1Mi",
        "poolDevice": "cpu",
        "requestTimeoutSeconds": 30.0,
        "migrationAttempts": 3,
    }
    assert "replicas" not in stored["spec"]["roles"][0]  # it follows autoscaling: no default


def _minimal() -> Doc:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "mini"},
        "spec": {
            "image": "img:1",
            "roles": [
                {"name": "a", "handler": "m:f", "autoscaling": {"maxReplicas": 3}},
                {"name": "b", "handler": "m:g", "ports": [{"name": "web", "containerPort": 80}]},
            ],
            "edges": [{"from": "a", "to": "b"}],
        },
    }


def _set(path: str, value: Any) -> Mutation:
    """A mutation that sets `a.b[0].c` (value `...` deletes it)."""

    def apply(doc: Doc) -> None:
        *parents, last = _steps(path)
        target: Any = doc
        for step in parents:
            target = target[step]
        if value is ...:
            del target[last]
        else:
            target[last] = copy.deepcopy(value)

    return apply


def _append(path: str, value: Any) -> Mutation:
    def apply(doc: Doc) -> None:
        target: Any = doc
        for step in _steps(path):
            target = target[step]
        target.append(copy.deepcopy(value))

    return apply


def _steps(path: str) -> list[str | int]:
    steps: list[str | int] = []
    for part in path.replace("]", "").replace("[", ".").split("."):
        steps.append(int(part) if part.isdigit() else part)
    return steps


def _ref_to_side_branch(doc: Doc) -> None:
    """A tensor reference to a role that is not downstream of the edge's target."""
    _append("spec.roles", {"name": "side", "handler": "m:f"})(doc)
    _append("spec.edges", {"from": "encoder", "to": "side"})(doc)
    _set("spec.edges[0].tensorRefs[0].to", "side")(doc)


ROLE = "spec.roles[0]"
# (mutation of the full document, the path the validator reports). The CRD rejects all too.
BOTH_REJECT: list[tuple[str, Mutation, str]] = [
    ("pipeline name too long", _set("metadata.name", "p" * 41), "metadata.name"),
    ("pipeline name not DNS-1035", _set("metadata.name", "9lives"), "metadata.name"),
    ("unknown spec field", _set("spec.imag", "x"), "spec.imag"),
    ("image with space", _set("spec.image", "a b"), "spec.image"),
    ("missing roles", _set("spec.roles", ...), "spec.roles"),
    ("no roles", _set("spec.roles", []), "spec.roles"),
    ("bad relay", _set("spec.transport.relay", "udp"), "spec.transport.relay"),
    ("bad pool size", _set("spec.transport.poolSize", "lots"), "spec.transport.poolSize"),
    ("negative pool size", _set("spec.transport.poolSize", "-1Mi"), "spec.transport.poolSize"),
    ("bad pool device", _set("spec.transport.poolDevice", "tpu"), "spec.transport.poolDevice"),
    ("zero timeout", _set("spec.transport.requestTimeoutSeconds", 0), "requestTimeoutSeconds"),
    ("timeout as text", _set("spec.transport.requestTimeoutSeconds", "5"), "requestTimeout"),
    ("negative migration", _set("spec.transport.migrationAttempts", -1), "migrationAttempts"),
    ("migrations past 10", _set("spec.transport.migrationAttempts", 11), "migrationAttempts"),
    ("role without handler", _set(f"{ROLE}.handler", ...), f"{ROLE}.handler"),
    ("handler without function", _set(f"{ROLE}.handler", "pkg.mod"), f"{ROLE}.handler"),
    ("role name uppercase", _set(f"{ROLE}.name", "Encoder"), f"{ROLE}.name"),
    ("role name too long", _set(f"{ROLE}.name", "e" * 50), f"{ROLE}.name"),
    ("duplicate role", _append("spec.roles", {"name": "encoder", "handler": "m:f"}), "name"),
    ("negative replicas", _set(f"{ROLE}.replicas", -1), f"{ROLE}.replicas"),
    ("replicas as text", _set(f"{ROLE}.replicas", "2"), f"{ROLE}.replicas"),
    ("zero concurrency", _set(f"{ROLE}.concurrency", 0), f"{ROLE}.concurrency"),
    ("batch over concurrency", _set(f"{ROLE}.batching.maxBatchSize", 9), f"{ROLE}.batching"),
    ("zero batch", _set(f"{ROLE}.batching.maxBatchSize", 0), f"{ROLE}.batching.maxBatchSize"),
    ("batch without size", _set(f"{ROLE}.batching", {}), f"{ROLE}.batching.maxBatchSize"),
    ("negative batch wait", _set(f"{ROLE}.batching.maxWaitMilliseconds", -1), "maxWaitMilli"),
    ("zero startup", _set(f"{ROLE}.startupSeconds", 0), f"{ROLE}.startupSeconds"),
    ("handler args a list", _set(f"{ROLE}.handlerArgs", [1]), f"{ROLE}.handlerArgs"),
    ("command not a list", _set(f"{ROLE}.command", "python"), f"{ROLE}.command"),
    ("reserved env", _append(f"{ROLE}.env", {"name": "DISAGG_ROLE", "value": "x"}), "env[2]"),
    ("bad env name", _append(f"{ROLE}.env", {"name": "1X", "value": "x"}), "env[2].name"),
    ("duplicate env", _append(f"{ROLE}.env", {"name": "MODEL", "value": "x"}), "env[2].name"),
    (
        "env value and valueFrom",
        _append(f"{ROLE}.env", {"name": "B", "value": "x", "valueFrom": {}}),
        "env[2]",
    ),
    ("env value number", _set(f"{ROLE}.env[0].value", 3), "env[0].value"),
    ("bad quantity", _set(f"{ROLE}.resources.requests.cpu", "lots"), "requests.cpu"),
    ("unknown resources field", _set(f"{ROLE}.resources.claims", []), "resources.claims"),
    ("port out of range", _set(f"{ROLE}.ports[0].containerPort", 70000), "containerPort"),
    ("port name too long", _set(f"{ROLE}.ports[0].name", "a" * 16), "ports[0].name"),
    ("port name digits only", _set(f"{ROLE}.ports[0].name", "8080"), "ports[0].name"),
    ("port name with --", _set(f"{ROLE}.ports[0].name", "a--b"), "ports[0].name"),
    ("bad protocol", _set(f"{ROLE}.ports[0].protocol", "QUIC"), "ports[0].protocol"),
    (
        "duplicate port name",
        _append(f"{ROLE}.ports", {"name": "debug", "containerPort": 1}),
        "ports[2].name",
    ),
    (
        "duplicate port number",
        _append(f"{ROLE}.ports", {"name": "dup", "containerPort": 5678, "protocol": "UDP"}),
        "ports[2].containerPort",
    ),
    ("bad role pool", _set(f"{ROLE}.transport.minBlock", "x"), "transport.minBlock"),
    (
        "min above max",
        _set("spec.roles[1].autoscaling", {"minReplicas": 5, "maxReplicas": 2}),
        "autoscaling.minReplicas",
    ),
    ("autoscaling without max", _set("spec.roles[1].autoscaling", {}), "maxReplicas"),
    (
        "zero target",
        _set("spec.roles[1].autoscaling", {"maxReplicas": 6, "targetPoolOccupancy": 0}),
        "targetPoolOccupancy",
    ),
    (
        "target above one",
        _set("spec.roles[1].autoscaling", {"maxReplicas": 6, "targetPoolOccupancy": 1.5}),
        "targetPoolOccupancy",
    ),
    (
        "tolerance one",
        _set("spec.roles[1].autoscaling", {"maxReplicas": 6, "tolerance": 1}),
        "tolerance",
    ),
    ("pod template a list", _set(f"{ROLE}.podTemplate", []), "podTemplate"),
    ("edge to unknown role", _set("spec.edges[1].to", "decodr"), "spec.edges[1].to"),
    ("edge from unknown role", _set("spec.edges[1].from", "x"), "spec.edges[1].from"),
    ("self-loop", _append("spec.edges", {"from": "decoder", "to": "decoder"}), "spec.edges[2]"),
    (
        "duplicate edge",
        _append("spec.edges", {"from": "denoiser", "to": "decoder"}),
        "spec.edges[2]",
    ),
    ("no entry role", _append("spec.edges", {"from": "decoder", "to": "encoder"}), "spec.edges"),
    ("bad edge relay", _set("spec.edges[0].relay", "pigeon"), "spec.edges[0].relay"),
    (
        "cuda-ipc across pods",
        _set("spec.edges[0].relay", "cuda-ipc"),
        "spec.edges[0].relay",
    ),
    ("bad payload path", _set("spec.edges[0].tensorRefs[0].path", "a..b"), "tensorRefs[0].path"),
    ("ref to unknown role", _set("spec.edges[0].tensorRefs[0].to", "zz"), "tensorRefs[0].to"),
    ("ref to edge target", _set("spec.edges[0].tensorRefs[0].to", "denoiser"), "tensorRefs[0]"),
    ("group of one", _set("spec.colocation[0].roles", ["decoder"]), "colocation[0].roles"),
    ("group unknown role", _append("spec.colocation[0].roles", "nobody"), "roles[2]"),
    (
        "role listed twice in a group",
        _append("spec.colocation[0].roles", "decoder"),
        "colocation[0].roles[2]",
    ),
    (
        "role in two groups",
        _append("spec.colocation", {"roles": ["encoder", "decoder"]}),
        "spec.colocation[1].roles[1]",
    ),
    (
        "group named after another role",
        _set("spec.colocation[0].name", "encoder"),
        "spec.colocation[0].name",
    ),
    ("group name too long", _set("spec.colocation[0].name", "g" * 48), "colocation[0].name"),
    ("group name invalid", _set("spec.colocation[0].name", "G"), "colocation[0].name"),
    ("a billion replicas", _set(f"{ROLE}.replicas", 10**9), f"{ROLE}.replicas"),
    ("huge concurrency", _set(f"{ROLE}.concurrency", 10**6), f"{ROLE}.concurrency"),
    (
        "huge max replicas",
        _set("spec.roles[1].autoscaling", {"maxReplicas": 10**6}),
        "autoscaling.maxReplicas",
    ),
    (
        "week-long timeout",
        _set("spec.transport.requestTimeoutSeconds", 7 * 86400),
        "requestTimeoutSeconds",
    ),
    ("huge ratio share", _set("spec.ratioLocks[0].leaderShare", 10**6), "leaderShare"),
    ("network policy flag as text", _set("spec.networkPolicy.enabled", "no"), "enabled"),
    ("empty network peer", _set("spec.networkPolicy.clients", [{}]), "clients[0]"),
    (
        "unknown network peer field",
        _set("spec.networkPolicy.clients", [{"pods": {}}]),
        "clients[0].pods",
    ),
    (
        "bad selector operator",
        _set(
            "spec.networkPolicy.metricsFrom",
            [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}],
        ),
        "operator",
    ),
]

# Rules only the validator checks (reported in the pipeline's status): the CRD accepts these.
ONLY_VALIDATOR: list[tuple[str, Mutation, str]] = [
    ("cycle", _append("spec.edges", {"from": "decoder", "to": "denoiser"}), "spec.edges[2]"),
    ("pool below block", _set("spec.transport.minBlock", "1Gi"), "spec.transport.poolSize"),
    ("block not a power of two", _set("spec.transport.minBlock", "3Mi"), "minBlock"),
    ("request above limit", _set(f"{ROLE}.resources.requests.memory", "3Gi"), "requests.memory"),
    ("fractional bytes", _set("spec.transport.poolSize", "0.5"), "spec.transport.poolSize"),
    ("handler keyword", _set(f"{ROLE}.handler", "pkg.class:f"), f"{ROLE}.handler"),
    ("group replicas differ", _set("spec.roles[2].replicas", 4), "spec.colocation[0].roles"),
    (
        "overlapping refs",
        _set("spec.edges[0].tensorRefs[1].path", "text_embedding.x"),
        "tensorRefs[1].path",
    ),
    (
        "ref not downstream",
        _ref_to_side_branch,
        "spec.edges[0].tensorRefs[0].to",
    ),
    # a quantity's maximum is beyond what cel-python evaluates (no quantity library)
    ("an exabyte pool", _set("spec.transport.poolSize", "1Ei"), "spec.transport.poolSize"),
    ("a role's petabyte pool", _set(f"{ROLE}.transport.poolSize", "1Pi"), "transport.poolSize"),
    # podTemplate is free-form in the schema: the policy on pods is the validator's
    (
        "privileged pod template",
        _set(f"{ROLE}.podTemplate", {"spec": {"hostPID": True}}),
        "podTemplate.spec.hostPID",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "where"), [c[1:] for c in BOTH_REJECT], ids=[c[0] for c in BOTH_REJECT]
)
def test_invalid_documents_fail_both(
    crd_checker: Any, full_doc: Doc, mutate: Mutation, where: str
) -> None:
    mutate(full_doc)
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_pipeline(full_doc)
    paths = [problem.path for problem in caught.value.problems]
    assert any(where in path for path in paths), paths
    assert crd_checker.errors(full_doc), "the CRD accepted it"


@pytest.mark.parametrize(
    ("mutate", "where"), [c[1:] for c in ONLY_VALIDATOR], ids=[c[0] for c in ONLY_VALIDATOR]
)
def test_rules_only_the_validator_checks(
    crd_checker: Any, full_doc: Doc, mutate: Mutation, where: str
) -> None:
    mutate(full_doc)
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_pipeline(full_doc)
    assert any(where in problem.path for problem in caught.value.problems)
    assert crd_checker.errors(full_doc) == []


def test_size_bounds_are_checked_by_both(crd_checker: Any) -> None:
    """List sizes are bounded in the CRD so that CEL costs are bounded, and the validator
    enforces the same bounds (disagg_core.spec.limits; tests/unit/core/test_spec_limits.py
    walks every one)."""
    doc = _minimal()
    doc["spec"]["roles"] = [
        {"name": f"r{i}", "handler": "m:f"} for i in range(limits.MAX_ROLES + 1)
    ]
    doc["spec"]["edges"] = []
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_pipeline(doc)
    assert caught.value.problems[0].path == "spec.roles"
    assert any("roles" in error for error in crd_checker.errors(doc))


def _record_known_fields(doc: Doc, monkeypatch: pytest.MonkeyPatch) -> dict[str, set[str]]:
    """Parse `doc`, recording the field names the parser accepts at each object path (indexes
    replaced by `[]`)."""
    known: dict[str, set[str]] = {}
    original = spec_fields.fields

    def recording(out: Any, value: Any, path: str, **kwargs: Any) -> Any:
        key = re.sub(r"\[\d+\]", "[]", path)
        known.setdefault(key, set()).update(kwargs.get("known", ()))
        return original(out, value, path, **kwargs)

    monkeypatch.setattr(spec_fields, "fields", recording)
    spec.parse_pipeline(doc)
    return known


def test_parser_and_schema_know_the_same_fields(
    crd_checker: Any, full_doc: Doc, engine_doc: Doc, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = _record_known_fields(full_doc, monkeypatch)
    for path, fields in _record_known_fields(engine_doc, monkeypatch).items():
        parser.setdefault(path, set()).update(fields)
    schema = {
        path: set(node["properties"])
        for path, node in _nodes(crd_checker.schema)
        if "properties" in node and not path.startswith(("status", "metadata"))
    }
    parser.pop("metadata")  # the API server owns metadata's schema
    assert parser.keys() == schema.keys()
    for path, fields in parser.items():
        assert fields == schema[path], path


def test_full_document_uses_every_field(crd_checker: Any, full_doc: Doc, engine_doc: Doc) -> None:
    used: set[str] = set()

    def visit(value: Any, path: str) -> None:
        used.add(path)
        if isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{path}.{key}" if path else key)
        elif isinstance(value, list):
            for item in value:
                visit(item, f"{path}[]")

    visit(full_doc, "")
    visit(engine_doc, "")
    declared = {
        path
        for path, _ in _nodes(crd_checker.schema)
        if path
        and not path.startswith(("status", "metadata."))
        and ".*" not in path
        and ".podTemplate." not in path
        and ".handlerArgs." not in path
        and ".engine.args." not in path
        and ".valueFrom." not in path
    }
    assert declared - used == set()


def test_the_engine_document_is_admitted_and_valid(crd_checker: Any, engine_doc: Doc) -> None:
    assert crd_checker.errors(engine_doc) == []
    pipeline = spec.parse_pipeline(crd_checker.defaulted(engine_doc))
    assert pipeline.kv_role("prefill") == "kv_producer"
    both = copy.deepcopy(engine_doc)
    both["spec"]["roles"][0]["handler"] = "pkg.mod:fn"
    assert any("either a handler or an engine" in e for e in crd_checker.errors(both))
