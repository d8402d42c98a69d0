"""Synthetic requests for the demo pipelines' entry handlers (`disagg up`, `disagg request`)."""

from __future__ import annotations

import math

import torch

from disagg_runtime.demo.kit import (
    _PROMPTS,
    AUDIO_SAMPLES,
    DEFAULT_NEW_TOKENS,
    DEFAULT_STEPS,
    ENTRY_HANDLERS,
    IMAGE_SIZE,
    LLM_PROMPT,
    LLM_VOCAB,
    N_FFT,
    PATCH,
    SAMPLE_RATE,
    TEXT_TOKENS,
    TEXT_VOCAB,
    Payload,
    _generator,
    _scaled,
    _seed,
    demo_scale,
)


def sample_input(handler: str, i: int) -> Payload:
    """Request ``i`` for the entry handler ``handler`` (``"encode_text"``, ``"prefill"`` or
    ``"ingest"``; a ``"disagg_runtime.demo:<name>"`` spec works too). Deterministic in
    ``i``; sizes follow ``DISAGG_DEMO_SCALE``."""
    short = handler.rpartition(":")[2] if handler.startswith("disagg_runtime.demo:") else handler
    if short not in ENTRY_HANDLERS:
        raise ValueError(
            f"sample_input: {handler!r} is not an entry handler; expected one of "
            f"{', '.join(ENTRY_HANDLERS)}"
        )
    if type(i) is not int:
        raise ValueError(f"sample_input: i must be an int; got {i!r}")
    scale = demo_scale()
    gen = _generator(_seed("sample", short, i))
    prompt = f"{_PROMPTS[i % len(_PROMPTS)]} (request {i})"
    if short == "encode_text":
        n = _scaled(TEXT_TOKENS, 4, scale)
        ids = torch.randint(0, TEXT_VOCAB, (n,), generator=gen, dtype=torch.int64)
        return {"prompt": prompt, "token_ids": ids, "steps": DEFAULT_STEPS, "request": i}
    if short == "prefill":
        n = _scaled(LLM_PROMPT, 4, scale)
        ids = torch.randint(0, LLM_VOCAB, (n,), generator=gen, dtype=torch.int64)
        return {
            "prompt": prompt,
            "input_ids": ids,
            "max_new_tokens": DEFAULT_NEW_TOKENS,
            "request": i,
        }
    side = max(PATCH, round(IMAGE_SIZE * scale / PATCH) * PATCH)
    image = torch.randint(0, 256, (3, side, side), generator=gen, dtype=torch.uint8)
    samples = _scaled(AUDIO_SAMPLES, 2 * N_FFT, scale)
    t = torch.arange(samples, dtype=torch.float32) / SAMPLE_RATE
    tone = 220.0 * (1 + i % 7)
    audio = 0.5 * torch.sin(2 * math.pi * tone * t) + 0.05 * torch.randn(samples, generator=gen)
    return {"image": image, "audio": audio, "sample_rate": SAMPLE_RATE, "request": i}
