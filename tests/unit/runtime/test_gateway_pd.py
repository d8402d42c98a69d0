"""P/D routing over engine roles, the pure half (gateway/pd.py) and the local plan of the
engine replicas (local/engines.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg_core import spec
from disagg_runtime.gateway import pd
from disagg_runtime.gateway.errors import HttpError
from disagg_runtime.local.engines import engine_python, plan_engines
from tests.unit.core.test_spec_engines import doc


def pipeline(**extra: Any) -> spec.Pipeline:
    return spec.parse_pipeline(doc(**extra))


def test_route_of_a_prefill_decode_pair() -> None:
    assert pd.route_of(pipeline(), node_local=True) == pd.EngineRoute("prefill", "decode", "tcp")
    auto = doc()
    del auto["spec"]["edges"][0]["relay"]
    assert pd.route_of(spec.parse_pipeline(auto), node_local=True).relay == "shm"
    assert pd.route_of(spec.parse_pipeline(auto), node_local=False).relay == "tcp"


def test_route_of_a_lone_engine() -> None:
    lone = doc(edges=[])
    del lone["spec"]["roles"][1]
    assert pd.route_of(spec.parse_pipeline(lone), node_local=True) == pd.EngineRoute("prefill")


def test_bodies() -> None:
    payload = {"prompt": "hi", "max_tokens": 5, "temperature": 0.0, "stop": ["x"], "seed": 1}
    body = pd.engine_body(payload, "tiny")
    assert body == {
        "model": "tiny",
        "prompt": "hi",
        "max_tokens": 5,
        "temperature": 0.0,
        "stop": ["x"],
        "seed": 1,
    }
    first = pd.prefill_body(body, transfer="t1", decode="tcp://h:1", relay="shm")
    assert first["max_tokens"] == 1 and first["stream"] is False
    assert first["kv_transfer_params"] == {
        "do_remote_decode": True,
        "transfer": "t1",
        "decode": "tcp://h:1",
        "relay": "shm",
    }
    second = pd.decode_body(body, {"do_remote_prefill": True, "transfer": "t1", "tokens": 3})
    assert second["max_tokens"] == 5 and second["stream"] is True
    assert second["return_token_ids"] is True
    assert second["kv_transfer_params"]["transfer"] == "t1"
    assert "kv_transfer_params" not in pd.decode_body(body, None)
    chat = pd.engine_body({"messages": [{"role": "user", "content": "x"}]}, "tiny")
    assert pd.is_chat({"messages": []}) and chat["messages"][0]["content"] == "x"


def test_handed_off_needs_the_params() -> None:
    assert pd.handed_off({"kv_transfer_params": {"a": 1}}, "prefill") == {"a": 1}
    with pytest.raises(HttpError) as caught:
        pd.handed_off({"choices": []}, "prefill")
    assert caught.value.status == 502 and "kv_transfer_params" in str(caught.value)


def test_a_refused_hand_off_is_not_decoded() -> None:
    refused = {"kv_transfer_params": {"do_remote_prefill": False, "error": "decode not allowed"}}
    with pytest.raises(HttpError) as caught:
        pd.handed_off(refused, "prefill")
    assert caught.value.status == 502 and "decode not allowed" in str(caught.value)


def test_chunks_of_completions_and_chat() -> None:
    event = {"choices": [{"text": "ab", "token_ids": [1, 2], "finish_reason": None}]}
    assert pd.chunk_of(json.dumps(event), "decode") == {"text": "ab", "token_ids": [1, 2]}
    chat = {"choices": [{"delta": {"content": "c"}, "token_ids": [3], "finish_reason": "stop"}]}
    assert pd.chunk_of(json.dumps(chat), "decode") == {
        "text": "c",
        "token_ids": [3],
        "finish_reason": "stop",
    }
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
    assert pd.chunk_of(json.dumps(usage), "decode") == {
        "text": "",
        "token_ids": [],
        "prompt_tokens": 9,
    }
    assert pd.chunk_of(" [DONE]", "decode") is None


def test_a_streamed_error_or_garbage_is_the_clients_error() -> None:
    with pytest.raises(HttpError) as caught:
        pd.chunk_of(json.dumps({"error": {"message": "bad", "code": 400}}), "decode")
    assert caught.value.status == 400
    with pytest.raises(HttpError) as caught:
        pd.chunk_of("{not json", "decode")
    assert caught.value.status == 502


def test_engine_errors_keep_4xx_and_turn_the_rest_into_502() -> None:
    body = {"error": {"message": "too long", "type": "BadRequestError", "param": "input_tokens"}}
    error = pd.engine_error("prefill", 400, body)
    assert error.status == 400
    assert error.body["error"]["message"] == "too long"
    assert error.body["error"]["param"] == "input_tokens"
    assert error.body["error"]["role"] == "prefill"
    flat = pd.engine_error("prefill", 404, {"object": "error", "message": "no model"})
    assert flat.status == 404 and flat.body["error"]["message"] == "no model"
    assert pd.engine_error("decode", 500, "boom").status == 502
    assert pd.engine_error("decode", 429, {}).headers["Retry-After"]
    assert pd.parse_error_body(b"\xffnot json") == "\ufffdnot json"


def test_plan_engines_hands_the_decode_endpoints_to_prefill() -> None:
    document = doc()
    document["spec"]["roles"][0]["replicas"] = 2
    plan = plan_engines(spec.parse_pipeline(document), iter(range(20000, 20100)), "/k")
    by = {(role, index): launch for role, index, launch, _ in plan}
    routed = {(role, index): endpoint for role, index, _, endpoint in plan}
    assert routed["decode", 1].kv_endpoint == by["decode", 1].kv_listen
    assert routed["prefill", 0].url == f"http://127.0.0.1:{by['prefill', 0].port}"
    assert routed["decode", 1].key == "decode/1" and routed["prefill", 0].kv_endpoint == ""
    assert sorted(by) == [("decode", 0), ("decode", 1), ("prefill", 0), ("prefill", 1)]
    decodes = (by["decode", 0].kv_listen, by["decode", 1].kv_listen)
    assert all(d.startswith("tcp://127.0.0.1:") for d in decodes) and len(set(decodes)) == 2
    assert by["prefill", 0].decodes == decodes == by["prefill", 1].decodes
    assert by["prefill", 0].kv_listen == "" and by["decode", 0].decodes == ()
    ports = [launch.port for launch in by.values()] + [int(d.rsplit(":", 1)[1]) for d in decodes]
    assert len(set(ports)) == len(ports)
    assert {launch.name for launch in by.values()} == {
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
    }


def test_engine_python_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("DISAGG_VLLM_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match="make venv-vllm"):
        engine_python()
    assert engine_python("/bin/sh") == "/bin/sh"
