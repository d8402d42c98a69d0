"""Tests for the demo handlers: shapes and dtypes, the three example pipelines run hop by hop
the way the runtime runs them, DISAGG_DEMO_SCALE, the fail / sleep_ms knobs, bad input."""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import yaml

from disagg_runtime import demo
from disagg_runtime.bench import frames as bench_frames
from disagg_runtime.wire import envelope
from tests.support import EXAMPLES

SMALL = "0.05"


@pytest.fixture(autouse=True)
def small_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(demo.SCALE_ENV, SMALL)


class Pool:
    """Stands in for a receive pool: payloads cross a hop through the codec into buffers
    the handler gets views of; `release` scribbles over them, as reuse of the pool would."""

    def __init__(self) -> None:
        self.buffers: list[bytearray] = []

    def hop(self, payload: Any) -> Any:
        frames = [bytearray(f) for f in bench_frames.encode(payload)]
        self.buffers += frames[1:]
        return bench_frames.decode(frames)

    def release(self) -> None:
        for buf in self.buffers:
            memoryview(buf)[:] = b"\xa5" * len(buf)
        self.buffers.clear()


def run_hop(handler: Callable[[Any], Any], payload: Any) -> Any:
    """Call `handler` on a pool view of `payload`; release the pool after it returns. For a
    generator the chunks are collected *after* the release (stricter than the runtime)."""
    pool = Pool()
    result = handler(pool.hop(payload))
    pool.release()
    return list(result) if inspect.isgenerator(result) else result


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def spec(t: Any) -> tuple[tuple[int, ...], torch.dtype]:
    assert isinstance(t, torch.Tensor)
    return tuple(t.shape), t.dtype


# --- text-to-video -------------------------------------------------------------------------


def text_to_video(i: int = 0, **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """encoder -> (text_embedding split off as a tensor ref) -> denoiser -> (re-inserted)
    -> decoder; returns (encoder output, decoder output)."""
    encoded = run_hop(demo.encode_text, {**demo.sample_input("encode_text", i), **extra})
    to_denoiser, text_embedding = envelope.extract(encoded, "text_embedding")
    denoised = run_hop(demo.denoise, to_denoiser)
    frames = run_hop(demo.decode_video, envelope.insert(denoised, "text_embedding", text_embedding))
    return encoded, frames


def test_encode_text_shapes() -> None:
    req = demo.sample_input("encode_text", 3)
    n = len(req["token_ids"])
    assert isinstance(req["prompt"], str) and spec(req["token_ids"]) == ((n,), torch.int64)
    out = demo.encode_text(req)
    assert set(out) == {"text_embedding", "latents", "cond", "steps", "request"}
    assert spec(out["text_embedding"]) == ((n, demo.TEXT_DIM), torch.bfloat16)
    assert spec(out["latents"]) == ((16, 16, 6, 8), torch.bfloat16)
    assert spec(out["cond"]) == ((16,), torch.bfloat16)
    assert out["latents"].is_contiguous() and out["steps"] == demo.DEFAULT_STEPS
    assert out["request"] == 3


def test_text_to_video_chain() -> None:
    encoded, out = text_to_video(1)
    latents = encoded["latents"]
    t, _, h, w = latents.shape
    assert set(out) == {"frames", "fps", "request"}
    assert spec(out["frames"]) == ((t, 3, 2 * h, 2 * w), torch.uint8)
    assert out["fps"] == demo.VIDEO_FPS and out["request"] == 1
    assert out["frames"].float().std() > 1.0  # not a constant image
    assert same(text_to_video(1)[1], out)  # deterministic
    assert not same(text_to_video(2)[1]["frames"], out["frames"])  # depends on the prompt


def test_denoise_steps_and_dtype() -> None:
    encoded = demo.encode_text(demo.sample_input("encode_text", 0))
    payload, _ = envelope.extract(encoded, "text_embedding")
    before = payload["latents"].clone()
    out = demo.denoise(payload)
    assert set(out) == {"latents", "request"}
    assert spec(out["latents"]) == spec(before)
    assert torch.equal(payload["latents"], before)  # the input is never written
    assert not torch.equal(out["latents"], before)
    one = demo.denoise({**payload, "steps": 1})["latents"]
    assert not torch.equal(one, out["latents"])
    as_f32 = demo.denoise({**payload, "latents": before.float()})["latents"]
    assert as_f32.dtype == torch.float32


def test_text_to_video_without_the_tensor_ref() -> None:
    """Without `tensorRefs` the embedding rides through the denoiser, which passes it on."""
    encoded = demo.encode_text(demo.sample_input("encode_text", 1))
    denoised = demo.denoise(encoded)
    assert denoised["text_embedding"] is encoded["text_embedding"]
    assert same(demo.decode_video(denoised), text_to_video(1)[1])


# --- llm-prefill-decode --------------------------------------------------------------------


def test_prefill_shapes() -> None:
    req = demo.sample_input("prefill", 0)
    n = len(req["input_ids"])
    out = demo.prefill(req)
    assert spec(out["kv"]) == ((demo.LLM_LAYERS, 2, demo.LLM_HEADS, n, 64), torch.bfloat16)
    assert 0 <= out["next_token"] < demo.LLM_VOCAB
    assert out["prompt_len"] == n and out["max_new_tokens"] == demo.DEFAULT_NEW_TOKENS
    assert isinstance(out["seed"], int) and out["request"] == 0


def test_prefill_decode_streams_tokens_in_order() -> None:
    prefilled = run_hop(demo.prefill, demo.sample_input("prefill", 4))
    result = demo.decode_tokens(Pool().hop(prefilled))
    assert inspect.isgenerator(result)  # how the runtime tells a stream from one output
    chunks = run_hop(demo.decode_tokens, prefilled)  # collected after the pool is reused
    assert len(chunks) == demo.DEFAULT_NEW_TOKENS == 8
    assert [c["step"] for c in chunks] == list(range(8))
    shape = {"token", "step", "request", "text", "token_ids", "finish_reason"}
    for i, chunk in enumerate(chunks):
        assert set(chunk) == shape | ({"prompt_tokens"} if i == 0 else set())
        assert chunk["request"] == 4
        assert spec(chunk["token"]) == ((1,), torch.int64)
        assert 0 <= int(chunk["token"]) < demo.LLM_VOCAB
        assert chunk["token_ids"] == [int(chunk["token"])]
        assert chunk["text"] == demo.token_text(int(chunk["token"]))
        assert chunk["finish_reason"] == ("length" if i == 7 else None)
    assert chunks[0]["prompt_tokens"] == prefilled["prompt_len"]
    assert int(chunks[0]["token"]) == prefilled["next_token"]
    assert len({int(c["token"]) for c in chunks}) > 1
    assert same(list(result), chunks)  # deterministic, and no view of the input kept


def test_decode_tokens_honours_max_new_tokens() -> None:
    prefilled = demo.prefill({**demo.sample_input("prefill", 0), "max_new_tokens": 3})
    assert [c["step"] for c in demo.decode_tokens(prefilled)] == [0, 1, 2]
    prefilled["max_new_tokens"] = 1
    assert len(list(demo.decode_tokens(prefilled))) == 1


# --- fan-out -------------------------------------------------------------------------------


def fan_out(i: int = 0, **extra: Any) -> dict[str, Any]:
    ingested = run_hop(demo.ingest, {**demo.sample_input("ingest", i), **extra})
    vision = run_hop(demo.embed_image, ingested)
    audio = run_hop(demo.embed_audio, ingested)
    return {"ingest": ingested, "vision": vision, "audio": audio}


def test_fan_out_branches() -> None:
    req = demo.sample_input("ingest", 2)
    side, samples = req["image"].shape[1], len(req["audio"])
    assert spec(req["image"]) == ((3, side, side), torch.uint8)
    assert spec(req["audio"]) == ((samples,), torch.float32)
    out = fan_out(2)
    frames = samples // demo.HOP + 1
    assert spec(out["ingest"]["pixels"]) == ((3, side, side), torch.float32)
    assert spec(out["ingest"]["mel"]) == ((demo.MEL_BINS, frames), torch.float32)
    assert torch.isfinite(out["ingest"]["mel"]).all()
    vision, audio = out["vision"], out["audio"]
    assert set(vision) == {"image_embedding", "patches", "request"}
    assert set(audio) == {"audio_embedding", "frames", "request"}
    assert spec(vision["image_embedding"]) == ((demo.EMBED_DIM,), torch.float32)
    assert spec(audio["audio_embedding"]) == ((demo.EMBED_DIM,), torch.float32)
    assert vision["patches"] == (side // demo.PATCH) ** 2 and audio["frames"] == frames
    assert math.isclose(float(vision["image_embedding"].norm()), 1.0, rel_tol=1e-4)
    assert math.isclose(float(audio["audio_embedding"].norm()), 1.0, rel_tol=1e-4)


def test_fuse_joins_the_upstream_dict() -> None:
    out = fan_out(5)
    fused = run_hop(demo.fuse, {"vision": out["vision"], "audio": out["audio"]})
    assert set(fused) == {"embedding", "probs", "label", "similarity", "request"}
    assert spec(fused["embedding"]) == ((demo.EMBED_DIM,), torch.float32)
    assert spec(fused["probs"]) == ((demo.LABELS,), torch.float32)
    assert math.isclose(float(fused["probs"].sum()), 1.0, rel_tol=1e-5)
    assert fused["label"] == int(fused["probs"].argmax()) and fused["request"] == 5
    assert -1.0 <= fused["similarity"] <= 1.0
    renamed = demo.fuse({"a": out["audio"], "v": out["vision"]})  # found by content
    assert same(renamed, fused)


def test_fuse_rejects_a_bad_join() -> None:
    out = fan_out(0)
    with pytest.raises(ValueError, match="audio_embedding"):
        demo.fuse({"vision": out["vision"]})
    with pytest.raises(ValueError, match="audio_embedding"):
        demo.fuse(out["vision"])  # one branch's output, not a dict of upstreams
    with pytest.raises(ValueError, match="disagree on 'request'"):
        demo.fuse({"vision": out["vision"], "audio": fan_out(1)["audio"]})


# --- conventions ---------------------------------------------------------------------------


@pytest.mark.parametrize("handler", demo.ENTRY_HANDLERS)
def test_sample_input_is_deterministic(handler: str) -> None:
    a, b, other = (demo.sample_input(handler, i) for i in (7, 7, 8))
    assert same(a, b) and not same(a, other)
    assert same(demo.sample_input(f"disagg_runtime.demo:{handler}", 7), a)
    bench_frames.encode(a)  # a valid payload


def test_sample_input_rejects_other_handlers() -> None:
    with pytest.raises(ValueError, match="not an entry handler"):
        demo.sample_input("denoise", 0)
    with pytest.raises(ValueError, match="must be an int"):
        demo.sample_input("prefill", "0")  # type: ignore[arg-type]


def test_examples_reference_demo_handlers() -> None:
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert files
    for path in files:
        doc = yaml.safe_load(path.read_text())
        roles = doc["spec"]["roles"]
        targets = {e["to"] for e in doc["spec"]["edges"]}
        for role in roles:
            if (
                "engine" in role
            ):  # a vLLM engine, not a handler (tests/unit/core/test_spec_engines.py)
                continue
            module, _, attr = role["handler"].partition(":")
            if module.startswith("disagg_runtime.models."):  # real models (tests/integration)
                continue
            assert module == "disagg_runtime.demo", path.name
            assert callable(getattr(demo, attr, None)), f"{path.name}: {attr}"
            assert demo.ROLE_NAMES[attr] == role["name"], path.name
            if role["name"] not in targets:
                assert attr in demo.ENTRY_HANDLERS, f"{path.name}: entry role {attr}"


def test_scale_changes_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    def sizes() -> tuple[int, ...]:
        text = demo.sample_input("encode_text", 0)
        latents = demo.encode_text(text)["latents"]
        ingest = demo.sample_input("ingest", 0)
        return (
            len(text["token_ids"]),
            *latents.shape[2:],
            len(demo.sample_input("prefill", 0)["input_ids"]),
            ingest["image"].shape[1],
            len(ingest["audio"]),
        )

    small = sizes()
    monkeypatch.setenv(demo.SCALE_ENV, "0.1")
    bigger = sizes()
    assert small == (6, 6, 8, 13, 16, 3200)
    assert bigger == (13, 12, 16, 26, 32, 6400)
    monkeypatch.setenv(demo.SCALE_ENV, "  ")
    assert demo.demo_scale() == 1.0


def test_default_scale_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(demo.SCALE_ENV)
    assert demo.demo_scale() == 1.0
    encoded = demo.encode_text(demo.sample_input("encode_text", 0))
    assert spec(encoded["latents"]) == ((16, 16, 128, 160), torch.bfloat16)
    assert encoded["latents"].numel() * 2 == 10 * 2**20
    assert spec(encoded["text_embedding"]) == ((128, 512), torch.bfloat16)
    assert len(demo.sample_input("prefill", 0)["input_ids"]) == 256
    ingest = demo.sample_input("ingest", 0)
    assert spec(ingest["image"]) == ((3, 384, 384), torch.uint8)
    assert spec(ingest["audio"]) == ((64000,), torch.float32)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "big"])
def test_bad_scale(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(demo.SCALE_ENV, value)
    with pytest.raises(ValueError, match=demo.SCALE_ENV):
        demo.sample_input("prefill", 0)


def inputs() -> dict[str, dict[str, Any]]:
    """A valid input for every handler."""
    encoded = demo.encode_text(demo.sample_input("encode_text", 0))
    to_denoiser, _ = envelope.extract(encoded, "text_embedding")
    prefilled = demo.prefill(demo.sample_input("prefill", 0))
    out = fan_out(0)
    return {
        "encode_text": demo.sample_input("encode_text", 0),
        "denoise": to_denoiser,
        "decode_video": {**demo.denoise(to_denoiser), "text_embedding": encoded["text_embedding"]},
        "prefill": demo.sample_input("prefill", 0),
        "decode_tokens": prefilled,
        "ingest": demo.sample_input("ingest", 0),
        "embed_image": out["ingest"],
        "embed_audio": out["ingest"],
        "fuse": {"vision": out["vision"], "audio": out["audio"]},
    }


def with_keys(name: str, payload: dict[str, Any], **keys: Any) -> dict[str, Any]:
    if name == "fuse":  # the knobs ride in the branches' outputs
        return {k: {**v, **keys} for k, v in payload.items()}
    return {**payload, **keys}


def call(name: str, payload: Any) -> list[dict[str, Any]]:
    """The handler's outputs: one, or every chunk of a stream."""
    result = getattr(demo, name)(payload)
    return list(result) if isinstance(result, Iterator) else [result]


def test_every_handler_fails_on_request() -> None:
    for name, payload in inputs().items():
        for target in (name, demo.ROLE_NAMES[name]):
            with pytest.raises(RuntimeError, match=r"^demo failure requested$"):
                getattr(demo, name)(with_keys(name, payload, fail=target))  # raised at the call


def test_fail_and_sleep_ms_are_carried() -> None:
    for name, payload in inputs().items():
        for out in call(name, with_keys(name, payload, fail="elsewhere", sleep_ms=0)):
            assert out["fail"] == "elsewhere" and out["sleep_ms"] == 0, name
            bench_frames.encode(out)  # every output is a valid payload


def test_failure_at_a_chosen_stage() -> None:
    with pytest.raises(RuntimeError, match="demo failure requested"):
        text_to_video(0, fail="decoder")
    with pytest.raises(RuntimeError, match="demo failure requested"):
        text_to_video(0, fail="denoise")
    out = fan_out(0, fail="fuse")
    assert out["vision"]["fail"] == out["audio"]["fail"] == "fuse"
    with pytest.raises(RuntimeError, match="demo failure requested"):
        demo.fuse({"vision": out["vision"], "audio": out["audio"]})
    prefilled = demo.prefill({**demo.sample_input("prefill", 0), "fail": "decode"})
    with pytest.raises(RuntimeError, match="demo failure requested"):
        demo.decode_tokens(prefilled)


def test_sleep_ms_slows_the_denoiser() -> None:
    encoded = demo.encode_text({**demo.sample_input("encode_text", 0), "sleep_ms": 60.0})
    payload, _ = envelope.extract(encoded, "text_embedding")
    started = time.monotonic()
    out = demo.denoise(payload)
    assert time.monotonic() - started >= 0.06
    assert out["sleep_ms"] == 60.0


BAD: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("encode_text", lambda p: [p], "expected a dict payload, got a list"),
    ("encode_text", lambda p: {k: v for k, v in p.items() if k != "token_ids"}, "missing"),
    ("encode_text", lambda p: {**p, "token_ids": p["token_ids"].float()}, "int64 tensor"),
    ("encode_text", lambda p: {**p, "token_ids": p["token_ids"] + 10**6}, "outside"),
    ("encode_text", lambda p: {**p, "steps": 0}, "'steps'"),
    ("encode_text", lambda p: {**p, "prompt": 5}, "'prompt'"),
    ("encode_text", lambda p: {**p, "fail": 1}, "'fail'"),
    ("denoise", lambda p: {**p, "latents": p["latents"][:, :3]}, r"latents.*\(>=1, 16, >=1, >=1\)"),
    ("denoise", lambda p: {**p, "latents": p["latents"][0]}, "'latents'"),
    ("denoise", lambda p: {k: v for k, v in p.items() if k != "cond"}, "'cond'"),
    ("denoise", lambda p: {**p, "sleep_ms": -1}, "'sleep_ms'"),
    ("denoise", lambda p: {**p, "sleep_ms": "10"}, "'sleep_ms'"),
    ("denoise", lambda p: {**p, "sleep_ms": True}, "'sleep_ms'"),
    ("decode_video", lambda p: {k: v for k, v in p.items() if k != "text_embedding"}, "text_"),
    ("decode_video", lambda p: {**p, "text_embedding": p["text_embedding"][:, :8]}, "text_"),
    ("prefill", lambda p: {**p, "input_ids": p["input_ids"][:0]}, "'input_ids'"),
    ("prefill", lambda p: {**p, "input_ids": p["input_ids"].view(1, -1)}, "'input_ids'"),
    ("prefill", lambda p: {**p, "max_new_tokens": 0}, "'max_new_tokens'"),
    ("decode_tokens", lambda p: {**p, "kv": p["kv"][:2]}, "'kv'"),
    ("decode_tokens", lambda p: {**p, "next_token": -1}, "'next_token'"),
    ("decode_tokens", lambda p: {k: v for k, v in p.items() if k != "seed"}, "'seed'"),
    ("ingest", lambda p: {**p, "image": p["image"].float()}, "uint8 tensor"),
    ("ingest", lambda p: {**p, "image": p["image"][:, :4]}, "'image'"),
    ("ingest", lambda p: {**p, "audio": p["audio"][:10]}, "'audio'"),
    ("embed_image", lambda p: {**p, "pixels": p["pixels"][:1]}, "'pixels'"),
    ("embed_audio", lambda p: {**p, "mel": p["mel"].T}, "'mel'"),
    ("fuse", lambda p: {**p, "text": {"x": 1}}, "upstream outputs"),
    ("fuse", lambda p: {**p, "extra": 1}, "upstream outputs"),
]


@pytest.mark.parametrize(("name", "make_bad", "match"), BAD, ids=[f"{b[0]}-{b[2]}" for b in BAD])
def test_bad_input_raises_value_error(
    name: str, make_bad: Callable[[dict[str, Any]], Any], match: str
) -> None:
    bad = make_bad(inputs()[name])
    with pytest.raises(ValueError, match=match):
        getattr(demo, name)(bad)


def test_llm_demo_takes_openai_style_input() -> None:
    """{"prompt" | "messages", sampling params} as the gateway's OpenAI API sends it."""
    out = demo.prefill({"prompt": "hi", "max_tokens": 3, "temperature": 0, "seed": 7})
    assert out["prompt_len"] == 3 and out["max_new_tokens"] == 3 and out["seed"] == 7
    chunks = list(demo.decode_tokens(out))
    assert [c["finish_reason"] for c in chunks] == [None, None, "length"]
    again = list(
        demo.decode_tokens(demo.prefill({"prompt": "hi", "max_tokens": 3, "temperature": 0}))
    )
    assert [c["text"] for c in again] == [c["text"] for c in chunks]  # greedy ignores seed
    chat = demo.prefill({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat["prompt_len"] == len("user: hi\nassistant:") + 1
    stop = chunks[1]["text"].strip()[:2]
    cut = list(demo.decode_tokens({**out, "stop": [stop]}))
    assert cut[-1]["finish_reason"] == "stop" and len(cut) == 2
    assert stop not in "".join(c["text"] for c in cut)
    with pytest.raises(ValueError, match="'top_p'"):
        demo.prefill({"prompt": "hi", "top_p": 0})
    with pytest.raises(ValueError, match="'messages'"):
        demo.prefill({"messages": [{"role": "user"}]})
