"""hf_llm's pure parts: request parameters, stop strings and streaming text, the KV cache as
tensors (zero-copy rebuild); the model-level proof is tests/integration/test_models.py."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from disagg_runtime.models import hf_llm, tiny


@pytest.fixture(scope="module")
def tok() -> Any:
    return tiny.tokenizer()


def test_params_defaults_and_checks() -> None:
    assert hf_llm.parse_params({}) == hf_llm.Params()
    p = hf_llm.parse_params({"max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 1})
    assert (p.max_tokens, p.greedy, p.top_p, p.seed) == (3, False, 0.9, 1)
    assert hf_llm.parse_params({"stop": "x"}).stop == ("x",)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": -2}, "seed"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop": ["a"] * 5}, "stop"),
    ]
    for bad, field in cases:
        with pytest.raises(hf_llm.RequestError, match=field):
            hf_llm.parse_params(bad)


def test_prompt_from_text_messages_or_ids(tok: Any) -> None:
    assert hf_llm.prompt_ids(tok, {"prompt": "hello"}) == tok("hello").input_ids
    chat = hf_llm.prompt_ids(tok, {"messages": [{"role": "user", "content": "hi"}]})
    assert chat == tok("user: hi\nassistant:").input_ids  # no chat template: a transcript
    assert hf_llm.prompt_ids(tok, {"input_ids": torch.tensor([[5, 6]])}) == [5, 6]
    for bad in ({}, {"prompt": 3}, {"messages": "hi"}, {"input_ids": ["a"]}):
        with pytest.raises(hf_llm.RequestError):
            hf_llm.prompt_ids(tok, bad)


def _stream(tok: Any, text: str, stop: tuple[str, ...], limit: int = 100) -> list[dict[str, Any]]:
    out = hf_llm._Text(tok, stop)
    chunks = []
    for n, token in enumerate(tok(text).input_ids, 1):
        out.add(token)
        if out.stopped:
            chunks.append(out.finish("stop"))
            return chunks
        if n >= limit:
            chunks.append(out.finish("length"))
            return chunks
        chunk = out.release()
        if chunk is not None:
            chunks.append(chunk)
    chunks.append(out.finish("stop", eos=tok.eos_token_id))
    return chunks


def test_streamed_text_adds_up_and_stops_before_the_stop_string(tok: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    chunks = _stream(tok, text, ())
    assert "".join(c["text"] for c in chunks) == text
    ids = [t for c in chunks for t in c["token_ids"]]
    assert ids == [*tok(text).input_ids, tok.eos_token_id]
    stopped = _stream(tok, text, ("lazy", "jumps"))
    assert "".join(c["text"] for c in stopped) == "The quick brown fox "
    assert stopped[-1]["finish_reason"] == "stop"
    assert all(c["finish_reason"] is None for c in stopped[:-1])
    short = _stream(tok, text, (), limit=2)
    assert short[-1]["finish_reason"] == "length"
    assert [t for c in short for t in c["token_ids"]] == tok(text).input_ids[:2]


def test_cache_round_trip_is_zero_copy_on_the_decode_side(tmp_path: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.llm(tmp_path / "m")).eval()
    ids = torch.tensor([[5, 9, 17, 3, 40], [0, 0, 7, 8, 9]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    cache = hf_llm._cache_of(out)
    flat = hf_llm.flatten_cache(cache, 1, 2, torch.bfloat16)  # row 1 without its padding
    assert [k.shape[2] for k in flat["keys"]] == [3] * model.config.num_hidden_layers
    assert flat["keys"][0].dtype == torch.bfloat16
    rebuilt = hf_llm.rebuild_cache(model.config, flat["keys"], flat["values"], torch.bfloat16)
    assert rebuilt.get_seq_length() == 3
    for layer, key in zip(rebuilt.layers, flat["keys"], strict=True):
        assert layer.keys.data_ptr() == key.data_ptr()  # adopted, not copied
    with pytest.raises(hf_llm.RequestError, match="layers"):
        hf_llm.rebuild_cache(model.config, flat["keys"][:1], flat["values"][:1], torch.float32)


def test_decode_reports_the_prompt_length_once(tmp_path: pathlib.Path, tok: Any) -> None:
    """The first chunk carries `prompt_tokens` (the gateway's `usage.prompt_tokens`)."""
    import logging

    from disagg_runtime.role.handler import SetupContext

    model = str(tiny.llm(tmp_path / "m"))
    prefill, decode = hf_llm.Prefill(), hf_llm.Decode()
    for role, handler in (("prefill", prefill), ("decode", decode)):
        handler.setup(SetupContext(role, 0, "cpu", {"model": model}, logging.getLogger(role)))
    prompt = "hello there, general"
    chunks = list(decode(prefill({"prompt": prompt, "max_tokens": 4})))
    assert chunks[0]["prompt_tokens"] == len(tok(prompt).input_ids) > 1
    assert all("prompt_tokens" not in c for c in chunks[1:])
