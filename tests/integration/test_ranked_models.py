"""The model roles over the ranks of a replica (issue 33), CPU, gloo, fp32.

- The Hugging Face LLM roles tensor-parallel (transformers' own `tp_plan="auto"`): TP=2
  gives exactly the tokens of one process's `generate()`, and the cache crosses whole, so
  prefill and decode may differ.
- The Wan denoiser of 2 ranks splitting classifier-free guidance (models/cfg_split.py):
  frames equal, bit for bit, to the one-process pipeline's."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from disagg_runtime.models import diffusers_t2v
from tests.integration.test_models import (  # the one-process reference and the harness
    _burst,
    _llm_doc,
    _requests,
    _run,
    _wan_doc,
    models,
    reference,
)

__all__ = ["models", "reference"]  # module-scoped fixtures, shared with test_models


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("prefill_ranks", "decode_ranks"), [(2, 2), (2, 1)])
def test_tensor_parallel_tokens_equal_one_process(
    models: dict[str, pathlib.Path],
    reference: list[list[int]],
    prefill_ranks: int,
    decode_ranks: int,
) -> None:
    doc: dict[str, Any] = _llm_doc(
        f"itest-tp-{prefill_ranks}-{decode_ranks}", models["llm"], "shm", 8
    )
    prefill, decode = doc["spec"]["roles"]
    prefill["ranks"], decode["ranks"] = prefill_ranks, decode_ranks
    with _run(doc) as (local, client):
        results = _burst(client)
        # greedy and seeded samples alike: the all-reduced logits pick the same tokens
        for request, expected, (ids, _, _) in zip(_requests(), reference, results, strict=True):
            assert ids == expected, request
        log = pathlib.Path(local.workdir, "prefill-0.log").read_text()
        assert "tensor parallel over 2 ranks (rank 1)" in log  # the child rank's setup


@pytest.mark.timeout(900)
def test_a_denoiser_of_two_ranks_equals_one_process(models: dict[str, pathlib.Path]) -> None:
    model = str(models["t2v"])
    doc = _wan_doc("itest-wan-ranks", model)
    doc["spec"]["roles"][1]["ranks"] = 2
    requests = [
        {"prompt": "a fox jumps over a dog", "seed": 3, "num_frames": 5},  # guided: split
        {"prompt": "tensors", "seed": 4, "num_frames": 9, "guidance_scale": 1.0, "steps": 3},
    ]
    with _run(doc) as (local, client):
        frames = [client.submit(r, timeout=120) for r in requests]
        log = pathlib.Path(local.workdir, "denoiser-0.log").read_text()
        assert "guidance split over 2 ranks: this is rank 1" in log
    for request, got in zip(requests, frames, strict=True):
        expected = diffusers_t2v.monolithic(model, request)
        assert torch.equal(got, expected), request  # each branch as in one process
