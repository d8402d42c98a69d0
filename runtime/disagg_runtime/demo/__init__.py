"""Demo handlers for the example pipelines in ``examples/*.yaml``: small, real torch work.

Every handler is ``fn(payload) -> payload``, except ``decode_tokens``, which returns a
generator of payloads (a stream of chunks). A payload is a dict of torch tensors and JSON
scalars. Weights are fixed pseudo-random tensors (seeded by name) and every random draw is
seeded from the input's content, so a handler's output depends only on its input. Inputs may
be read-only views of a receive pool that is released after the handler returns: handlers
never write into them and never keep them past returning (``decode_tokens`` copies what its
stream needs before it returns the generator).

text-to-video (``encoder -> denoiser -> decoder``; bf16, tens of MiB per hop)
    ``encode_text``  ``{"prompt": str, "token_ids": int64 (L,)}`` -> ``{"text_embedding":
    bf16 (L, 512), "latents": bf16 (16, 16, H, W), "cond": bf16 (16,), "steps": int}``.
    One transformer block over the tokens; the latents are seeded noise whose size comes
    from ``DISAGG_DEMO_SCALE`` (H, W = 128, 160 at scale 1: 10 MiB).
    ``denoise``  gets the encoder's output *without* ``text_embedding`` (a tensor reference
    the runtime sends straight to the decoder) -> ``{"latents": bf16 (16, 16, H, W)}``:
    ``steps`` Euler steps of a per-frame gated (softmax) channel-mixing model. (Run without
    the tensor reference, it gets ``text_embedding`` too and passes it on unchanged.)
    ``decode_video``  gets the denoiser's output plus ``text_embedding`` re-inserted ->
    ``{"frames": uint8 (16, 3, 2H, 2W), "fps": int}`` (12 MiB at scale 1): a 1x1
    projection conditioned on the text, then a 2x pixel shuffle.

llm-prefill-decode (``prefill -> decode``)
    ``prefill``  ``{"prompt": str, "input_ids": int64 (L,), "max_new_tokens": int}`` ->
    ``{"kv": bf16 (4, 2, 4, L, 64), "next_token": int, "seed": int, "prompt_len": int,
    "max_new_tokens": int, "temperature": float, "top_p": float, "stop": [str]}``: a
    4-layer causal transformer; the KV cache is the payload. It also takes what the
    gateway's OpenAI API sends: ``{"prompt": str}`` or ``{"messages": [{"role", "content"}]}``
    without ``input_ids`` (the text's UTF-8 bytes after a BOS id are the token ids), with
    ``max_tokens`` (= ``max_new_tokens``), ``temperature`` (0 = greedy), ``top_p``, ``seed``
    and ``stop``.
    ``decode_tokens``  streams up to ``max_new_tokens`` chunks ``{"token": int64 (1,),
    "step": int, "text": str, "token_ids": [int], "finish_reason": None | "length" |
    "stop"}`` in order (the first also ``"prompt_tokens"``), sampling each token from the
    cached model (L = 256 at scale 1). ``text`` comes from a trivial vocabulary
    (``token_text``: a syllable per id); the stream ends early, with ``"stop"``, once the
    text holds a stop sequence (the chunk's text is cut before it).

fan-out (``ingest -> {vision, audio} -> fuse``)
    ``ingest``  ``{"image": uint8 (3, S, S), "audio": float32 (N,), "sample_rate": int}`` ->
    ``{"pixels": float32 (3, S, S), "mel": float32 (80, F)}``: normalisation and a log-mel
    spectrogram (STFT). S = 384, N = 64000 (4 s at 16 kHz), F = N // 160 + 1 at scale 1.
    Both branches get this same payload.
    ``embed_image``  -> ``{"image_embedding": float32 (256,), "patches": int}``: 16x16
    patch convolution, one self-attention layer, attention pooling.
    ``embed_audio``  -> ``{"audio_embedding": float32 (256,), "frames": int}``: a 1-D
    convolution over the mel frames, one self-attention layer, attention pooling.
    ``fuse``  gets ``{"vision": <embed_image output>, "audio": <embed_audio output>}`` (a
    dict keyed by upstream role name; the branches are found by content, so renamed roles
    work) -> ``{"embedding": float32 (256,), "probs": float32 (10,), "label": int,
    "similarity": float}``.

Conventions
    ``sample_input(handler, i)`` builds request ``i`` for an entry handler (``encode_text``,
    ``prefill``, ``ingest``); it is deterministic in ``i``.
    ``DISAGG_DEMO_SCALE`` (float > 0, default 1.0) is read on every call of
    ``sample_input`` and ``encode_text``: it multiplies spatial sizes and sequence lengths
    (0.05 makes every tensor tiny). Downstream handlers take their sizes from their input.
    A payload that does not have the expected shape raises ``ValueError`` naming the
    handler and the key.
    ``"fail"``: a payload with ``"fail": <name>``, where name is a handler's name or the
    role name it has in the examples (``"denoise"`` or ``"denoiser"``), makes that handler
    raise ``RuntimeError("demo failure requested")``. ``"sleep_ms"`` (0 to 600000) makes
    ``denoise`` sleep that long first (a slow stage); so does ``DEMO_DENOISE_MS`` in the
    denoiser's environment (examples/slow-denoiser.yaml); ``DEMO_SLOW_REPLICA=<n>`` makes
    replica n's sleep ``DEMO_SLOW_FACTOR`` (default 5) times longer. ``"request"`` (a JSON
    scalar, set by ``sample_input``) tags a request. All three are carried from every
    handler's input to its output (and into every streamed chunk), so later stages see them.
"""

from __future__ import annotations

from disagg_runtime.demo.fanout import embed_audio, embed_image, fuse, ingest
from disagg_runtime.demo.kit import (
    AUDIO_SAMPLES,
    CARRIED_KEYS,
    DEFAULT_NEW_TOKENS,
    DEFAULT_STEPS,
    DENOISE_MS_ENV,
    EMBED_DIM,
    EMBED_HEADS,
    ENTRY_HANDLERS,
    FAILURE_MESSAGE,
    HOP,
    IMAGE_SIZE,
    LABELS,
    LATENT_CHANNELS,
    LATENT_FRAMES,
    LATENT_HEIGHT,
    LATENT_WIDTH,
    LLM_DIM,
    LLM_HEAD_DIM,
    LLM_HEADS,
    LLM_LAYERS,
    LLM_MAX_PROMPT,
    LLM_PROMPT,
    LLM_VOCAB,
    MAX_NEW_TOKENS,
    MAX_SLEEP_MS,
    MAX_STEPS,
    MEL_BINS,
    N_FFT,
    PATCH,
    ROLE_NAMES,
    SAMPLE_RATE,
    SCALE_ENV,
    SLOW_FACTOR_ENV,
    SLOW_REPLICA_ENV,
    TEXT_DIM,
    TEXT_HEADS,
    TEXT_TOKENS,
    TEXT_VOCAB,
    VIDEO_FPS,
    Payload,
    demo_scale,
)
from disagg_runtime.demo.llm import decode_tokens, prefill, token_text
from disagg_runtime.demo.samples import sample_input
from disagg_runtime.demo.t2v import decode_video, denoise, encode_text

__all__ = [
    "AUDIO_SAMPLES",
    "CARRIED_KEYS",
    "DEFAULT_NEW_TOKENS",
    "DEFAULT_STEPS",
    "DENOISE_MS_ENV",
    "EMBED_DIM",
    "EMBED_HEADS",
    "ENTRY_HANDLERS",
    "FAILURE_MESSAGE",
    "HOP",
    "IMAGE_SIZE",
    "LABELS",
    "LATENT_CHANNELS",
    "LATENT_FRAMES",
    "LATENT_HEIGHT",
    "LATENT_WIDTH",
    "LLM_DIM",
    "LLM_HEADS",
    "LLM_HEAD_DIM",
    "LLM_LAYERS",
    "LLM_MAX_PROMPT",
    "LLM_PROMPT",
    "LLM_VOCAB",
    "MAX_NEW_TOKENS",
    "MAX_SLEEP_MS",
    "MAX_STEPS",
    "MEL_BINS",
    "N_FFT",
    "PATCH",
    "ROLE_NAMES",
    "SAMPLE_RATE",
    "SCALE_ENV",
    "SLOW_FACTOR_ENV",
    "SLOW_REPLICA_ENV",
    "TEXT_DIM",
    "TEXT_HEADS",
    "TEXT_TOKENS",
    "TEXT_VOCAB",
    "VIDEO_FPS",
    "Payload",
    "decode_tokens",
    "decode_video",
    "demo_scale",
    "denoise",
    "embed_audio",
    "embed_image",
    "encode_text",
    "fuse",
    "ingest",
    "prefill",
    "sample_input",
    "token_text",
]
