"""Engine roles (`roles[].engine`) and `kv` edges: the model, the KV roles derived from the
edges, and every refusal naming its field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from disagg_core import spec


def doc(**spec_extra: Any) -> dict[str, Any]:
    """A prefill/decode pipeline of two vLLM engine roles joined by a kv edge."""
    body: dict[str, Any] = {
        "roles": [
            {
                "name": "prefill",
                "engine": {
                    "kind": "vllm",
                    "model": "/models/tiny",
                    "args": {"maxModelLen": 512, "enforceEager": True, "dtype": "float32"},
                },
            },
            {
                "name": "decode",
                "replicas": 2,
                "ranks": 2,
                "engine": {"kind": "vllm", "model": "/models/tiny", "kvPort": 7700},
            },
        ],
        "edges": [{"from": "prefill", "to": "decode", "kind": "kv", "relay": "tcp"}],
        "gateway": {"api": "openai", "model": "tiny"},
        "image": "registry.example/disagg-vllm:1",
    }
    body.update(spec_extra)
    return {
        "apiVersion": spec.API_VERSION,
        "kind": spec.KIND,
        "metadata": {"name": "pd"},
        "spec": body,
    }


def problems(document: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_pipeline(document)
    return {p.path: p.reason for p in caught.value.problems}


def test_engine_roles_parse_with_kv_roles_from_the_edge() -> None:
    pipeline = spec.parse_pipeline(doc())
    prefill, decode = pipeline.role("prefill"), pipeline.role("decode")
    assert prefill.engine is not None and decode.engine is not None
    assert prefill.handler == "" and prefill.engine.kind == "vllm"
    assert prefill.engine.model == "/models/tiny"
    assert dict(prefill.engine.args) == {
        "maxModelLen": 512,
        "enforceEager": True,
        "dtype": "float32",
    }
    assert (prefill.engine.port, prefill.engine.kv_port) == (8000, 7600)
    assert decode.engine.kv_port == 7700 and decode.ranks == 2 and decode.replicas == 2
    assert pipeline.kv_role("prefill") == "kv_producer"
    assert pipeline.kv_role("decode") == "kv_consumer"
    assert pipeline.kv_targets("prefill") == ("decode",)
    assert pipeline.kv_targets("decode") == ()
    assert pipeline.engine_roles == ("prefill", "decode")
    assert pipeline.edges[0].kind == "kv"


def test_a_lone_engine_has_no_kv_role() -> None:
    document = doc(edges=[])
    del document["spec"]["roles"][1]
    pipeline = spec.parse_pipeline(document)
    assert pipeline.kv_role("prefill") is None


def test_handler_roles_and_edges_keep_their_defaults() -> None:
    document = doc()
    document["spec"] = {
        "roles": [
            {"name": "a", "handler": "pkg.mod:fn"},
            {"name": "b", "handler": "pkg.mod:fn"},
        ],
        "edges": [{"from": "a", "to": "b"}],
        "image": "registry.example/disagg:1",
    }
    pipeline = spec.parse_pipeline(document)
    assert pipeline.role("a").engine is None and pipeline.edges[0].kind == "payload"
    assert pipeline.engine_roles == ()


@pytest.mark.parametrize(
    ("change", "path", "words"),
    [
        (lambda r: r.update(handler="pkg.mod:fn"), "spec.roles[0].handler", "takes no handler"),
        (lambda r: r.update(handlerArgs={"a": 1}), "spec.roles[0].handlerArgs", "takes no"),
        (lambda r: r.update(batching={"maxBatchSize": 2}), "spec.roles[0].batching", "no"),
        (lambda r: r.update(nodes=2), "spec.roles[0].nodes", "more than one pod"),
        (lambda r: r["engine"].update(kind="sglang"), "spec.roles[0].engine.kind", "vllm"),
        (lambda r: r["engine"].pop("model"), "spec.roles[0].engine.model", "required"),
        (lambda r: r["engine"].update(port=70000), "spec.roles[0].engine.port", "1..65535"),
        (lambda r: r["engine"].update(kvPort=8000), "spec.roles[0].engine.kvPort", "differ"),
        (lambda r: r["engine"].update(extra=1), "spec.roles[0].engine.extra", "unknown"),
        (lambda r: r["engine"].update(args=[1]), "spec.roles[0].engine.args", "mapping"),
        (
            lambda r: r["engine"]["args"].update({"max-model-len": 3}),
            "spec.roles[0].engine.args.max-model-len",
            "camelCase",
        ),
        (
            lambda r: r["engine"]["args"].update(tensorParallelSize=2),
            "spec.roles[0].engine.args.tensorParallelSize",
            "roles[].ranks",
        ),
        (
            lambda r: r["engine"]["args"].update(model="/x"),
            "spec.roles[0].engine.args.model",
            "engine.model",
        ),
        (
            lambda r: r["engine"]["args"].update(kvTransferConfig="{}"),
            "spec.roles[0].engine.args.kvTransferConfig",
            "kv edges",
        ),
        (
            lambda r: r["engine"]["args"].update(bad={"nested": 1}),
            "spec.roles[0].engine.args.bad",
            "string, number or true/false",
        ),
        (
            lambda r: r["engine"]["args"].update(long="x" * 5000),
            "spec.roles[0].engine.args.long",
            "at most 4096",
        ),
        (
            lambda r: r["engine"]["args"].update(nan=float("nan")),
            "spec.roles[0].engine.args.nan",
            "finite",
        ),
    ],
)
def test_engine_fields_are_checked(change: Any, path: str, words: str) -> None:
    document = doc()
    change(document["spec"]["roles"][0])
    found = problems(document)
    assert path in found, found
    assert words in found[path]


def test_too_many_engine_args() -> None:
    document = doc()
    document["spec"]["roles"][0]["engine"]["args"] = {f"a{i}": i for i in range(65)}
    assert "at most 64" in problems(document)["spec.roles[0].engine.args"]


def test_a_role_needs_a_handler_or_an_engine() -> None:
    document = doc()
    del document["spec"]["roles"][0]["engine"]
    assert "or set engine" in problems(document)["spec.roles[0].handler"]


def test_a_payload_edge_cannot_touch_an_engine() -> None:
    document = doc()
    del document["spec"]["edges"][0]["kind"]
    assert "only kv edges" in problems(document)["spec.edges[0].kind"]


def test_a_kv_edge_joins_two_engines() -> None:
    document = doc()
    document["spec"]["roles"][1] = {"name": "decode", "handler": "pkg.mod:fn"}
    found = problems(document)
    assert "'decode' runs a handler" in found["spec.edges[0].kind"]
    assert "not supported yet" in found["spec.roles[1].handler"]


def test_kv_edge_relays_and_tensor_refs() -> None:
    document = doc()
    document["spec"]["edges"][0]["relay"] = "nixl"
    assert "shm, tcp" in problems(document)["spec.edges[0].relay"]
    document = doc(transport={"relay": "nixl"})
    del document["spec"]["edges"][0]["relay"]
    assert "shm, tcp" in problems(document)["spec.transport.relay"]
    document = doc()
    document["spec"]["edges"][0]["tensorRefs"] = [{"path": "x", "to": "decode"}]
    assert "not tensor references" in problems(document)["spec.edges[0].tensorRefs"]


def test_an_engine_is_prefill_or_decode_not_both() -> None:
    document = doc()
    third = copy.deepcopy(document["spec"]["roles"][1])
    third["name"] = "third"
    document["spec"]["roles"].append(third)
    document["spec"]["edges"].append({"from": "decode", "to": "third", "kind": "kv"})
    assert "either prefill or decode" in problems(document)["spec.roles[1].engine"]


def test_a_prefill_role_has_one_decode_role() -> None:
    document = doc()
    third = copy.deepcopy(document["spec"]["roles"][1])
    third["name"] = "third"
    document["spec"]["roles"].append(third)
    document["spec"]["edges"].append({"from": "prefill", "to": "third", "kind": "kv"})
    assert "one decode role" in problems(document)["spec.roles[0].engine"]


def test_engines_serve_the_openai_api() -> None:
    found = problems(doc(gateway={}))
    assert "set api: openai" in found["spec.gateway.api"]
    spec.parse_pipeline(doc(gateway={"enabled": False}))


def test_unknown_edge_kind() -> None:
    document = doc()
    document["spec"]["edges"][0]["kind"] = "blocks"
    assert "payload, kv" in problems(document)["spec.edges[0].kind"]
