"""The Hugging Face LLM roles tensor-parallel over the ranks of a replica (issue 33):
transformers' own `tp_plan="auto"` on gloo, CPU, fp32. TP=2 gives exactly the tokens of one
process's `generate()`, and the cache crosses whole, so prefill and decode may differ."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tests.integration.test_models import (  # the one-process reference and the harness
    _burst,
    _llm_doc,
    _requests,
    _run,
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
