"""The gateway's pure parts: body codecs, the OpenAI request/answer mapping, status codes,
its contract and `spec.gateway`. The HTTP side is in tests/integration/test_gateway.py."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from disagg_core import contract, spec
from disagg_runtime.client import (
    RequestFailed,
    RequestOverloaded,
    RequestTimeout,
    UploadExpired,
)
from disagg_runtime.gateway import errors, native, openai


# ---- native codec -------------------------------------------------------------------------------
def test_json_tensors_round_trip_every_dtype() -> None:
    for name in ("bool", "uint8", "int64", "bfloat16", "float32", "float8_e4m3fn"):
        t = torch.ones((2, 3), dtype=getattr(torch, name))
        back = native.request_from_json({"inputs": {"t": native.to_json(t)}})["t"]
        assert back.dtype == t.dtype and torch.equal(back.float(), t.float())


def test_json_keeps_other_values_and_maps_non_finite_floats() -> None:
    value = {"a": [1, "x", None], "b": (2.5,), "c": float("nan"), "d": float("-inf")}
    assert native.to_json(value) == {"a": [1, "x", None], "b": [2.5], "c": "NaN", "d": "-Infinity"}


@pytest.mark.parametrize(
    ("inputs", "path"),
    [
        ({"x": {"dtype": "float32", "shape": [2], "data": 3}}, "$.inputs.x.data"),
        ({"x": {"dtype": "float32", "shape": [-1], "data": ""}}, "$.inputs.x.shape"),
        ({"l": [{"dtype": "int4", "shape": [1], "data": ""}]}, "$.inputs.l[0].dtype"),
        ({"bad key": {"dtype": "uint8", "shape": [2], "data": "AA=="}}, '$.inputs["bad key"].data'),
        (
            {"x": {"dtype": "bool", "shape": [1], "data": base64.b64encode(b"\x07").decode()}},
            "$.inputs.x.data",
        ),
    ],
)
def test_json_errors_name_the_path(inputs: dict[str, Any], path: str) -> None:
    with pytest.raises(native.InputError) as info:
        native.request_from_json({"inputs": inputs})
    assert info.value.path == path


def test_json_depth_is_bounded() -> None:
    deep: Any = 1
    for _ in range(native.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(native.InputError, match="deeper"):
        native.request_from_json({"inputs": deep})


def test_safetensors_round_trip_with_nesting_and_metadata() -> None:
    payload: dict[str, Any] = {
        "a": {"b": torch.arange(6, dtype=torch.bfloat16)},
        "n": 3,
        "s": "txt",
    }
    back = native.request_from_safetensors(native.to_safetensors(payload))
    assert torch.equal(back["a"]["b"], payload["a"]["b"]) and (back["n"], back["s"]) == (3, "txt")


@given(
    st.dictionaries(
        st.from_regex(r"[a-z]{1,6}", fullmatch=True),
        st.tuples(
            st.sampled_from(["uint8", "int64", "float16", "bfloat16", "float32", "bool"]),
            st.lists(st.integers(0, 5), max_size=3),
        ),
        max_size=4,
    )
)
def test_safetensors_parse_equals_the_library(specs: dict[str, tuple[str, list[int]]]) -> None:
    """Our in-place reader and the `safetensors` library agree on files the library wrote."""
    from safetensors.torch import load, save

    tensors = {
        name: torch.randint(0, 2, shape, dtype=torch.uint8).to(getattr(torch, dtype))
        for name, (dtype, shape) in specs.items()
    }
    body = bytearray(save(tensors, metadata={"k": "v"}))
    metadata, items = native.parse_safetensors(body)
    expected = load(bytes(body))
    assert metadata == {"k": "v"} and sorted(dict(items)) == sorted(expected)
    for name, tensor in items:
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name])


@given(st.lists(st.integers(1, 9000), min_size=4, max_size=4), st.sampled_from([4096, 8192]))
def test_tcp_chunks_come_from_where_each_tensor_is_in_the_body(
    sizes: list[int], chunk: int
) -> None:
    """`data_starts` + `chunk_sources`: the bytes of each chunk of a tcp transfer, in the
    order sent, are its manifest tensor's, though the body holds the tensors in another
    order (safetensors sorts by dtype size, then name; the payload nests by name)."""
    from safetensors.torch import save

    from disagg_runtime.client import chunk_sources
    from disagg_runtime.wire.tree import flatten

    dtypes = {"z": torch.uint8, "a.b": torch.bfloat16, "a.c": torch.int64, "m.x": torch.float32}
    tensors = {
        name: torch.randint(0, 99, (n,)).to(dtype)
        for (name, dtype), n in zip(dtypes.items(), sizes, strict=True)
    }
    body = memoryview(save(tensors))
    size = native.header_size(body, len(body))
    metadata, spans = native.parse_header(body[8 : 8 + size], len(body) - 8 - size)
    manifest, _ = native.slot_layout(metadata, spans)
    starts = native.data_starts(metadata, spans)
    assert starts != sorted(starts)  # manifest order is not data order here
    _, expected = flatten(native.request_from_safetensors(body))
    data = body[8 + size :]
    sent = b"".join(data[b:e] for b, e in chunk_sources(manifest, chunk, starts))
    assert sent == b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in expected)


def test_safetensors_tensors_view_the_body() -> None:
    """No copy by the parser: the tensor's bytes are the body's."""
    x = torch.arange(1 << 16, dtype=torch.float32)
    body = bytearray(native.to_safetensors({"x": x}))
    back = native.request_from_safetensors(memoryview(body))["x"]
    assert torch.equal(back, x)
    body[-4:] = torch.tensor([7.0]).numpy().tobytes()
    assert back[-1].item() == 7.0


@given(st.binary(max_size=64))
def test_garbage_safetensors_is_a_400_never_a_crash(body: bytes) -> None:
    with pytest.raises(native.InputError):
        native.request_from_safetensors(body)


def _raw(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 8"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "hole"),
        (
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
            "overlap",
        ),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 3, "cover 2"),
        ({"a": {"dtype": "I4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", "not allowed"),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [-1, 0]}}, b"", "begin"),
        ({"a": {"dtype": "U8", "shape": [1]}}, b"\0", "data_offsets"),
        ({"__metadata__": {"n": 1}}, b"", "strings"),
    ],
)
def test_safetensors_layout_errors_are_400s(header: Any, data: bytes, match: str) -> None:
    with pytest.raises(native.InputError, match=match):
        native.request_from_safetensors(_raw(header, data))


def test_safetensors_key_clash_and_short_body() -> None:
    from safetensors.torch import save

    with pytest.raises(native.InputError, match="given twice"):
        native.request_from_safetensors(save({"a": torch.ones(1)}, metadata={"a": "1"}))
    whole = save({"a": torch.ones(4)})
    with pytest.raises(native.InputError, match="cover"):
        native.request_from_safetensors(whole[:-3])
    with pytest.raises(native.InputError, match="does not fit"):
        native.request_from_safetensors(whole[:12])


# ---- OpenAI mapping ----------------------------------------------------------------------------
def test_chat_request_becomes_the_entry_payload() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "stop": "##",
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "ignored",
    }
    payload, sampling = openai.parse_chat(body, "m")
    assert payload == {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "stop": ["##"],
    }
    assert sampling == openai.Sampling(stream=True, include_usage=True, stop=("##",))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": 3}, "$.prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "$.max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": 3}, "$.temperature"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "$.top_p"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "$.stop"),
        ({"model": "m", "prompt": "x", "n": 2}, "$.n"),
        ({"prompt": "x"}, "$.model"),
    ],
)
def test_completion_request_errors(body: dict[str, Any], param: str) -> None:
    with pytest.raises(native.InputError) as info:
        openai.parse_completion(body, "m")
    assert info.value.path == param


def test_another_model_is_not_found() -> None:
    with pytest.raises(openai.ModelNotFound):
        openai.parse_completion({"model": "other", "prompt": "x"}, "m")


def feed_all(done: openai.Completion, pieces: list[str]) -> list[str]:
    out = [done.feed({"text": p, "token_ids": [i]}) for i, p in enumerate(pieces)]
    return [*out, done.finish()]


def test_stop_sequence_across_chunks_is_held_back_then_cut() -> None:
    done = openai.Completion(stop=("END",))
    sent = feed_all(done, ["ab", "cE", "N", "Dxyz"])
    assert sent == ["ab", "c", "", "", ""] and done.text == "abc"
    assert done.finish_reason == "stop" and done.stopped


def test_held_back_text_that_is_not_a_stop_is_released() -> None:
    done = openai.Completion(stop=("END",))
    assert feed_all(done, ["aE", "Nb"]) == ["a", "ENb", ""]
    assert done.text == "aENb" and done.finish_reason == "stop" and not done.stopped


def test_usage_and_finish_reason_come_from_the_chunks() -> None:
    done = openai.Completion()
    done.feed({"text": "a", "token_ids": torch.tensor([1, 2]), "prompt_tokens": 7})
    done.feed({"text": "b", "finish_reason": "length"})  # no ids: counts one
    done.finish()
    assert done.usage() == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert done.finish_reason == "length"
    with pytest.raises(ValueError, match="dict chunks"):
        done.feed([1])


def test_answer_objects() -> None:
    done = openai.Completion()
    done.feed({"text": "hi"})
    done.finish()
    chat = openai.Answer("m", chat=True)
    whole = chat.whole(done)
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    first = chat.delta("h", first=True)["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": "h"}
    assert chat.delta("", finish="stop")["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    text = openai.Answer("m", chat=False).delta("x")
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "x"


# ---- status codes ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (native.InputError("$.x", "bad"), 400, "invalid_input"),
        (RequestTimeout("late"), 504, "timeout"),
        (UploadExpired("cut at the deadline with 5 of 9 bytes in"), 408, "request_timeout"),
        (RequestFailed("no replica"), 503, "unavailable"),
        (RequestFailed("full", error={"reason": "overloaded", "role": "a"}), 429, "overloaded"),
        (RequestOverloaded("busy", role="a", error={"reason": "overloaded"}), 429, "overloaded"),
        (
            RequestFailed(
                "x",
                role="b",
                error={"role": "b", "replica": "1", "type": "KeyError", "reason": "handler"},
            ),
            502,
            "role_failed",
        ),
    ],
)
def test_failures_map_to_status_codes(exc: Exception, status: int, kind: str) -> None:
    answer = errors.from_failure(exc)
    assert (answer.status, answer.body["error"]["type"]) == (status, kind)
    if status in (429, 503):
        assert answer.headers["Retry-After"] == "1"
    if status == 502:
        assert (answer.body["error"]["role"], answer.body["error"]["exception"]) == (
            "b",
            "KeyError",
        )


# ---- contract and spec -------------------------------------------------------------------------
TOPOLOGY = contract.Topology.from_pipeline(
    spec.parse_pipeline(
        {
            "apiVersion": "disagg.dev/v1alpha1",
            "kind": "DisaggregatedPipeline",
            "metadata": {"name": "p"},
            "spec": {
                "image": "i",
                "roles": [{"name": "a", "handler": "m:f"}, {"name": "b", "handler": "m:g"}],
                "edges": [{"from": "a", "to": "b"}],
            },
        }
    )
)


def test_gateway_env_round_trips() -> None:
    config = contract.GatewayConfig(
        pipeline="p",
        namespace="ns",
        topology=TOPOLOGY,
        entries=(contract.Peer("a", ("p-a.ns.svc:7400",)),),
        port=9000,
        api="openai",
        model="m",
        token_file="/t",
        advertise_host="10.0.0.5",
        max_body=1 << 20,
    )
    env = contract.render_gateway_env(config)
    assert contract.parse_gateway_env(env, topology=TOPOLOGY) == config


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DISAGG_GATEWAY_API": "grpc"}, "GATEWAY_API"),
        ({"DISAGG_GATEWAY_API": "openai"}, "GATEWAY_MODEL is required"),
        ({"DISAGG_DOWNSTREAM": "b=h:1"}, "lacks addresses for entry roles"),
        ({"DISAGG_GATEWAY_MAX_BODY": "lots"}, "GATEWAY_MAX_BODY='lots'"),
        ({"DISAGG_GATEWAY_PORT": "x"}, "GATEWAY_PORT"),
    ],
)
def test_gateway_env_errors(env: dict[str, str], message: str) -> None:
    base = {"DISAGG_PIPELINE": "p", "DISAGG_DOWNSTREAM": "a=h:1"}
    with pytest.raises(contract.ContractError, match=message):
        contract.parse_gateway_env({**base, **env}, topology=TOPOLOGY)


def doc(gateway: Any, role: str = "a") -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "p"},
        "spec": {"image": "i", "roles": [{"name": role, "handler": "m:f"}], "gateway": gateway},
    }


def test_spec_gateway_defaults_and_fields() -> None:
    default = spec.parse_pipeline(doc({})).gateway
    assert (default.enabled, default.port, default.api, default.replicas) == (
        True,
        8080,
        "native",
        1,
    )
    full = spec.parse_pipeline(
        doc({"api": "openai", "model": "m", "auth": {"secretRef": {"name": "p-tok"}}, "port": 81})
    ).gateway
    assert full.auth is not None and (full.auth.name, full.auth.key) == ("p-tok", "token")


@pytest.mark.parametrize(
    ("gateway", "role", "path"),
    [
        ({"api": "openai"}, "a", "spec.gateway.model"),
        ({"port": 70000}, "a", "spec.gateway.port"),
        ({"enabled": "yes"}, "a", "spec.gateway.enabled"),
        ({"auth": {"secretRef": {}}}, "a", "spec.gateway.auth.secretRef.name"),
        ({"tls": True}, "a", "spec.gateway.tls"),
        ({}, "gateway", "spec.roles[0].name"),
    ],
)
def test_spec_gateway_problems(gateway: Any, role: str, path: str) -> None:
    with pytest.raises(spec.SpecError) as info:
        spec.parse_pipeline(doc(gateway, role))
    assert path in [p.path for p in info.value.problems]
    if role == "gateway":  # fine once the gateway is off
        spec.parse_pipeline(doc({"enabled": False}, role))


def test_the_models_max_tokens_annotation_reaches_the_gateway_and_is_checked() -> None:
    """disagg.dev/gateway-max-tokens: the gateway's DISAGG_GATEWAY_MAX_TOKENS (rendered by
    the operator), and a max_tokens above it is a 400 naming max_tokens (issue 30, item 17)."""
    from disagg_operator.plan import gateway as gateway_objects

    document = doc({"api": "openai", "model": "m"})
    document["metadata"]["annotations"] = {spec.model.ANNOTATION_GATEWAY_MAX_TOKENS: "64"}
    pipeline = spec.parse_pipeline(document)
    config = gateway_objects.config(pipeline, "ns", ())
    assert contract.render_gateway_env(config)["DISAGG_GATEWAY_MAX_TOKENS"] == "64"
    body = {"model": "m", "prompt": "x", "max_tokens": 65}
    with pytest.raises(native.InputError) as info:
        openai.parse_completion(body, "m", max_tokens=64)
    assert info.value.path == "$.max_tokens"
    assert openai.parse_completion({**body, "max_tokens": 64}, "m", 64)[0]["max_tokens"] == 64
    document["metadata"]["annotations"] = {spec.model.ANNOTATION_GATEWAY_MAX_TOKENS: "lots"}
    with pytest.raises(spec.SpecError) as refused:
        spec.parse_pipeline(document)
    assert "gateway-max-tokens" in refused.value.problems[0].path
    plain = contract.render_gateway_env(
        gateway_objects.config(spec.parse_pipeline(doc({})), "n", ())
    )
    assert "DISAGG_GATEWAY_MAX_TOKENS" not in plain and "DISAGG_GATEWAY_IDLE_TIMEOUT" not in plain
