"""Real models in roles, proven equal to one-process runs (real processes, real relays).

- LLM: tiny random Llama split into prefill and decode. Greedy tokens and seeded samples
  from the disaggregated run equal `model.generate` in this process, over an shm edge (with
  prefill batching, maxBatchSize 8) and over a tcp edge (no batching); the batched run
  makes fewer prefill calls than requests.
- Text-to-video: tiny random Wan split into text encoder, denoiser and VAE decoder: the
  uint8 frames are bit-identical to the one-process WanPipeline's with the same seed.

The models are built once per module into temporary directories (no download).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from disagg_core import spec
from disagg_runtime.client import Client
from disagg_runtime.local.supervisor import LocalPipeline
from disagg_runtime.models import diffusers_t2v, tiny

READY_S = 240.0  # role processes import transformers/diffusers: slow on a busy machine
PROMPTS = [
    "Hello world",
    "The quick brown fox jumps",
    "A disaggregated pipeline splits a model",
    "x",
    "prefill and decode",
    "Tensors move through shared memory",
    "0123",
    "roles: the encoder embeds text",
]
MAX_TOKENS = 12


def _requests() -> list[dict[str, Any]]:
    greedy = [{"prompt": p, "max_tokens": MAX_TOKENS} for p in PROMPTS]
    sampled = [
        {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.9, "seed": 11 + i}
        for i, p in enumerate(PROMPTS)
    ]
    return greedy + sampled


def _llm_doc(name: str, model: pathlib.Path, relay: str, batch: int) -> dict[str, Any]:
    prefill: dict[str, Any] = {
        "name": "prefill",
        "handler": "disagg_runtime.models.hf_llm:Prefill",
        "handlerArgs": {"model": str(model)},
        "concurrency": 16,
    }
    if batch > 1:
        prefill["batching"] = {"maxBatchSize": batch, "maxWaitMilliseconds": 50}
    decode = {
        "name": "decode",
        "handler": "disagg_runtime.models.hf_llm:Decode",
        "handlerArgs": {"model": str(model)},
        "concurrency": 16,
    }
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": name},
        "spec": {
            "image": "local",
            "transport": {"poolSize": "32Mi", "minBlock": "64Ki", "requestTimeoutSeconds": 120},
            "roles": [prefill, decode],
            "edges": [{"from": "prefill", "to": "decode", "relay": relay}],
        },
    }


def _wan_doc(name: str, model: str) -> dict[str, Any]:
    """The three Wan roles (text encoder -> denoiser -> VAE decoder) of `model`."""
    roles = [
        ("text-encoder", "TextEncoder"),
        ("denoiser", "Denoiser"),
        ("vae-decoder", "VaeDecoder"),
    ]
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": name},
        "spec": {
            "image": "local",
            "transport": {"poolSize": "32Mi", "minBlock": "64Ki", "requestTimeoutSeconds": 120},
            "roles": [
                {
                    "name": role,
                    "handler": f"disagg_runtime.models.diffusers_t2v:{cls}",
                    "handlerArgs": {"model": model},
                }
                for role, cls in roles
            ],
            "edges": [
                {"from": "text-encoder", "to": "denoiser", "relay": "shm"},
                {"from": "denoiser", "to": "vae-decoder", "relay": "tcp"},
            ],
        },
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("models")
    return {"llm": tiny.llm(root / "llm"), "t2v": tiny.t2v(root / "t2v")}


@pytest.fixture(scope="module")
def reference(models: dict[str, pathlib.Path]) -> list[list[int]]:
    """Each request through `model.generate` in this process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["llm"])
    model = AutoModelForCausalLM.from_pretrained(models["llm"]).eval()
    out = []
    for request in _requests():
        enc = tok(request["prompt"], return_tensors="pt")
        kwargs: dict[str, Any] = {"max_new_tokens": MAX_TOKENS, "do_sample": False}
        if "temperature" in request:
            torch.manual_seed(request["seed"])
            kwargs.update(do_sample=True, temperature=0.8, top_p=0.9, top_k=0)
        generated = model.generate(**enc, **kwargs)
        out.append(generated[0, enc.input_ids.shape[1] :].tolist())
    return out


@contextlib.contextmanager
def _run(doc: dict[str, Any]) -> Iterator[tuple[LocalPipeline, Client]]:
    local = LocalPipeline(spec.parse_pipeline(doc), grace_s=5.0)
    client: Client | None = None
    try:
        local.start()
        local.wait_ready(timeout=READY_S)
        client = local.client(timeout=120)
        yield local, client
    finally:
        if client is not None:
            client.close()
        local.stop()
        shutil.rmtree(local.workdir, ignore_errors=True)


def _generate(client: Client, request: dict[str, Any]) -> tuple[list[int], str, str]:
    chunks = list(client.stream(request, timeout=120))
    ids = [int(t) for c in chunks for t in c["token_ids"]]
    return ids, "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]


def _burst(client: Client) -> list[tuple[list[int], str, str]]:
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda r: _generate(client, r), _requests()))


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("relay", "batch"), [("shm", 8), ("tcp", 1)])
def test_llm_prefill_decode_equals_generate(
    models: dict[str, pathlib.Path], reference: list[list[int]], relay: str, batch: int
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["llm"])
    doc = _llm_doc(f"itest-llm-{relay}", models["llm"], relay, batch)
    with _run(doc) as (local, client):
        results = _burst(client)
        for request, expected, (ids, text, reason) in zip(
            _requests(), reference, results, strict=True
        ):
            assert ids == expected, request
            assert text == tok.decode(expected, skip_special_tokens=True)
            assert reason == ("stop" if expected[-1] == tok.eos_token_id else "length")
        stopped = client.stream({"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "stop": "o"})
        chunks = list(stopped)
        assert chunks[-1]["finish_reason"] in ("stop", "length")
        assert "o" not in "".join(c["text"] for c in chunks)
        metrics = local.metrics()
        prefill = metrics["prefill/0"]
        calls = prefill["disagg_handler_calls_total"]
        handled = prefill['disagg_requests_total{outcome="done"}']
        assert handled == len(_requests()) + 1
        if batch > 1:
            assert calls < len(_requests()), f"{calls} prefill calls for {handled} requests"
        else:
            assert calls == handled
        assert prefill["disagg_role_setup_seconds"] > 0


@pytest.mark.timeout(900)
def test_wan_three_roles_equal_the_one_process_pipeline(
    models: dict[str, pathlib.Path],
) -> None:
    model = str(models["t2v"])
    doc = _wan_doc("itest-wan", model)
    requests = [
        {"prompt": "a fox jumps over a dog", "seed": 3, "num_frames": 5},
        {"prompt": "tensors", "seed": 4, "num_frames": 9, "guidance_scale": 1.0, "steps": 3},
    ]
    with _run(doc) as (_, client):
        frames = [client.submit(r, timeout=120) for r in requests]
    for request, got in zip(requests, frames, strict=True):
        expected = diffusers_t2v.monolithic(model, request)
        assert got.dtype == torch.uint8 and got.shape == expected.shape
        assert torch.equal(got, expected), request  # same ops, same order, fp32 on CPU


def test_bad_model_directory_fails_start_up_naming_it(tmp_path: pathlib.Path) -> None:
    doc = _llm_doc("itest-llm-bad", tmp_path / "missing", "shm", 1)
    local = LocalPipeline(spec.parse_pipeline(doc), grace_s=1.0)
    try:
        local.start()
        with pytest.raises(RuntimeError, match=r"handlerArgs.model.*is not a model directory"):
            local.wait_ready(timeout=READY_S)
    finally:
        local.stop()
        shutil.rmtree(local.workdir, ignore_errors=True)
    assert not any(n.startswith("disagg-itest-llm-bad") for n in os.listdir("/dev/shm"))
