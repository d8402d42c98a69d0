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

import functools
import itertools
import math
import os
import time
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

Payload = dict[str, Any]

SCALE_ENV = "DISAGG_DEMO_SCALE"
CARRIED_KEYS: tuple[str, ...] = ("fail", "sleep_ms", "request")
FAILURE_MESSAGE = "demo failure requested"
MAX_SLEEP_MS = 600_000
ENTRY_HANDLERS: tuple[str, ...] = ("encode_text", "prefill", "ingest")
# handler -> the role that runs it in examples/*.yaml (either name works for "fail")
ROLE_NAMES: dict[str, str] = {
    "encode_text": "encoder",
    "denoise": "denoiser",
    "decode_video": "decoder",
    "prefill": "prefill",
    "decode_tokens": "decode",
    "ingest": "ingest",
    "embed_image": "vision",
    "embed_audio": "audio",
    "fuse": "fuse",
}

# text-to-video
TEXT_VOCAB = 4096
TEXT_DIM = 512
TEXT_HEADS = 8
TEXT_TOKENS = 128
LATENT_FRAMES = 16
LATENT_CHANNELS = 16
LATENT_HEIGHT = 128
LATENT_WIDTH = 160
DEFAULT_STEPS = 4
MAX_STEPS = 50
VIDEO_FPS = 8
# llm-prefill-decode
LLM_VOCAB = 2048
LLM_DIM = 256
LLM_HEADS = 4
LLM_HEAD_DIM = LLM_DIM // LLM_HEADS
LLM_LAYERS = 4
LLM_PROMPT = 256
LLM_MAX_PROMPT = 8192
DEFAULT_NEW_TOKENS = 8
MAX_NEW_TOKENS = 1024
# fan-out
IMAGE_SIZE = 384
PATCH = 16
AUDIO_SAMPLES = 64000
SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
MEL_BINS = 80
EMBED_DIM = 256
EMBED_HEADS = 4
LABELS = 10
_IMAGE_MEAN = (0.485, 0.456, 0.406)
_IMAGE_STD = (0.229, 0.224, 0.225)
_PROMPTS = (
    "a red fox running through fresh snow",
    "waves breaking on a rocky shore at dusk",
    "a paper boat drifting down a rainy street",
    "time-lapse of clouds over a mountain ridge",
    "a hummingbird hovering at a purple flower",
)


# --- validation and conventions ------------------------------------------------------------


DENOISE_MS_ENV = "DEMO_DENOISE_MS"
SLOW_REPLICA_ENV = "DEMO_SLOW_REPLICA"  # a test knob: this replica's denoiser sleeps longer
SLOW_FACTOR_ENV = "DEMO_SLOW_FACTOR"  # by this factor (default 5)


def _env_ms(name: str) -> float:
    """Extra milliseconds from the environment (a role's `env` in the pipeline): stands in
    for accelerator time, so a stage can be slow without using this machine's CPUs."""
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of milliseconds") from None
    if not math.isfinite(value) or not 0 <= value <= MAX_SLEEP_MS:
        raise ValueError(f"{name} must be in [0, {MAX_SLEEP_MS}] ms, got {raw!r}")
    return value


def _slowdown() -> float:
    """How much slower this replica's sleep is: DEMO_SLOW_FACTOR (default 5) when its
    DISAGG_REPLICA is DEMO_SLOW_REPLICA, else 1 (one slow replica among fast ones, to
    see dispatch by load route around it)."""
    slow = os.environ.get(SLOW_REPLICA_ENV, "").strip()
    if not slow or slow != os.environ.get("DISAGG_REPLICA", "").strip():
        return 1.0
    raw = os.environ.get(SLOW_FACTOR_ENV, "").strip() or "5"
    try:
        factor = float(raw)
    except ValueError:
        raise ValueError(f"{SLOW_FACTOR_ENV}={raw!r} is not a number") from None
    if not math.isfinite(factor) or not 1 <= factor <= 1000:
        raise ValueError(f"{SLOW_FACTOR_ENV} must be in [1, 1000], got {raw!r}")
    return factor


def demo_scale() -> float:
    """``DISAGG_DEMO_SCALE`` as a float (default 1.0), read now."""
    raw = os.environ.get(SCALE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"{SCALE_ENV}={raw!r} is not a number") from None
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{SCALE_ENV}={raw!r} must be a finite number > 0")
    return scale


def _scaled(base: int, minimum: int, scale: float) -> int:
    return max(minimum, round(base * scale))


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _as_dict(payload: object, handler: str) -> Payload:
    if not isinstance(payload, dict):
        raise ValueError(f"{handler}: expected a dict payload, got {_describe(payload)}")
    return payload


def _tensor(
    payload: Payload,
    key: str,
    handler: str,
    *,
    ndim: int,
    kind: str,
    shape: dict[int, int] | None = None,
    min_size: dict[int, int] | None = None,
) -> torch.Tensor:
    """``payload[key]`` checked to be an ``ndim``-D tensor of ``kind`` ("float", "int64",
    "uint8"), with fixed sizes ``shape`` and lower bounds ``min_size`` per dimension."""
    value = payload.get(key)
    ok = isinstance(value, torch.Tensor) and value.dim() == ndim
    if ok and isinstance(value, torch.Tensor):
        ok = value.is_floating_point() if kind == "float" else str(value.dtype) == f"torch.{kind}"
        ok = ok and all(value.shape[d] == n for d, n in (shape or {}).items())
        ok = ok and all(value.shape[d] >= n for d, n in (min_size or {}).items())
    if not ok or not isinstance(value, torch.Tensor):
        dims = ["?"] * ndim
        for d, n in (min_size or {}).items():
            dims[d] = f">={n}"
        for d, n in (shape or {}).items():
            dims[d] = str(n)
        want = f"a {kind} tensor of shape ({', '.join(dims)}{',' if ndim == 1 else ''})"
        got = "missing" if key not in payload else f"got {_describe(value)}"
        raise ValueError(f"{handler}: payload[{key!r}] must be {want}; {got}")
    return value


def _int(payload: Payload, key: str, handler: str, *, default: int | None, lo: int, hi: int) -> int:
    value = payload.get(key, default)
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(
            f"{handler}: payload[{key!r}] must be an int in [{lo}, {hi}]; got {value!r}"
        )
    return value


def _check_ids(ids: torch.Tensor, key: str, handler: str, vocab: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{handler}: payload[{key!r}] holds token ids outside [0, {vocab})")


def _carried(handler: str, *payloads: Payload) -> Payload:
    """Check and collect the carried keys; raise the requested failure if it is ours."""
    out: Payload = {}
    for p in payloads:
        for key in CARRIED_KEYS:
            if key not in p:
                continue
            value = p[key]
            if key in out and out[key] != value:
                raise ValueError(
                    f"{handler}: inputs disagree on {key!r}: {out[key]!r} != {value!r}"
                )
            out[key] = value
    fail = out.get("fail")
    if fail is not None and not isinstance(fail, str):
        raise ValueError(f"{handler}: payload['fail'] must be a role name; got {fail!r}")
    sleep_ms = out.get("sleep_ms")
    if sleep_ms is not None and (
        isinstance(sleep_ms, bool)
        or not isinstance(sleep_ms, (int, float))
        or not math.isfinite(sleep_ms)
        or not 0 <= sleep_ms <= MAX_SLEEP_MS
    ):
        raise ValueError(
            f"{handler}: payload['sleep_ms'] must be a number in [0, {MAX_SLEEP_MS}]; "
            f"got {sleep_ms!r}"
        )
    if fail in (handler, ROLE_NAMES[handler]):
        raise RuntimeError(FAILURE_MESSAGE)
    return out


def _seed(*parts: object) -> int:
    """A stable 31-bit seed from tensors (by content) and scalars (by repr)."""
    crc = 0
    for part in parts:
        if isinstance(part, torch.Tensor):
            data = part.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        else:
            data = repr(part).encode()
        crc = zlib.crc32(data, crc)
    return crc & 0x7FFFFFFF


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@functools.cache
def _weight(name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """Fixed float32 weights drawn from N(0, std); the same in every process."""
    return torch.randn(shape, generator=_generator(_seed(name))) * std


def _linear(name: str, d_in: int, d_out: int) -> torch.Tensor:
    """(d_in, d_out) weights for ``x @ w``."""
    return _weight(name, (d_in, d_out), 1.0 / math.sqrt(d_in))


def _conv(name: str, *shape: int) -> torch.Tensor:
    """(out, in, *kernel) weights for convolutions and ``w @ x``."""
    return _weight(name, shape, 1.0 / math.sqrt(math.prod(shape[1:])))


def _embedding(name: str, vocab: int, dim: int) -> torch.Tensor:
    return _weight(name, (vocab, dim), 1.0)


def _positions(length: int, dim: int, start: int = 0) -> torch.Tensor:
    """Sinusoidal position encodings, (length, dim) float32."""
    pos = torch.arange(start, start + length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    enc = torch.zeros(length, dim)
    enc[:, 0::2] = torch.sin(pos * freq)
    enc[:, 1::2] = torch.cos(pos * freq)
    return enc


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Softmax attention over (heads, L, d); causal aligns the last query with the last key."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        lq, lk = q.shape[-2], k.shape[-2]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    length, dim = x.shape
    return x.view(length, heads, dim // heads).transpose(0, 1)


def _block(
    x: torch.Tensor,
    name: str,
    heads: int,
    *,
    causal: bool,
    past: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pre-norm transformer block on (L, D) float32, attending over ``past`` keys and
    values too; returns (x, k, v) with k, v as (heads, past + L, D / heads)."""
    dim = x.shape[1]
    h = F.layer_norm(x, (dim,))
    q, k, v = (h @ _linear(f"{name}.qkv", dim, 3 * dim)).chunk(3, dim=1)
    q, k, v = (_split_heads(t, heads) for t in (q, k, v))
    if past is not None:
        k = torch.cat((past[0], k), dim=1)
        v = torch.cat((past[1], v), dim=1)
    a = _attend(q, k, v, causal=causal).transpose(0, 1).reshape(x.shape)
    x = x + a @ _linear(f"{name}.out", dim, dim)
    h = F.layer_norm(x, (dim,))
    up, down = _linear(f"{name}.up", dim, 2 * dim), _linear(f"{name}.down", 2 * dim, dim)
    x = x + F.gelu(h @ up) @ down
    return x, k, v


def _attention_pool(x: torch.Tensor, name: str) -> torch.Tensor:
    """(L, D) -> (D,) by softmax attention against a fixed query."""
    scores = x @ _conv(f"{name}.query", 1, x.shape[1])[0]
    return torch.softmax(scores, dim=0) @ x


# --- text-to-video -------------------------------------------------------------------------

_LATENT_DIMS: dict[str, dict[int, int]] = {
    "shape": {1: LATENT_CHANNELS},
    "min_size": {0: 1, 2: 1, 3: 1},
}
_TEXT_DIMS: dict[str, Any] = {
    "ndim": 2,
    "kind": "float",
    "shape": {1: TEXT_DIM},
    "min_size": {0: 1},
}


def encode_text(payload: object) -> Payload:
    """Text encoder: token ids -> text embedding, initial latents (seeded noise) and a
    conditioning vector for the denoiser."""
    name = "encode_text"
    p = _as_dict(payload, name)
    out = _carried(name, p)
    ids = _tensor(p, "token_ids", name, ndim=1, kind="int64", min_size={0: 1})
    _check_ids(ids, "token_ids", name, TEXT_VOCAB)
    if "prompt" in p and not isinstance(p["prompt"], str):
        raise ValueError(f"{name}: payload['prompt'] must be a str; got {_describe(p['prompt'])}")
    steps = _int(p, "steps", name, default=DEFAULT_STEPS, lo=1, hi=MAX_STEPS)
    scale = demo_scale()

    x = _embedding("text.embed", TEXT_VOCAB, TEXT_DIM)[ids] + _positions(len(ids), TEXT_DIM)
    x, _, _ = _block(x, "text.block0", TEXT_HEADS, causal=False)
    x = F.layer_norm(x, (TEXT_DIM,))
    pooled = F.layer_norm(x.mean(dim=0), (TEXT_DIM,))
    cond = torch.tanh(pooled @ _linear("text.cond", TEXT_DIM, LATENT_CHANNELS))

    # Noise at half resolution, upsampled: seeded by the prompt, cheap at 10 MiB.
    half_h = _scaled(LATENT_HEIGHT // 2, 1, scale)
    half_w = _scaled(LATENT_WIDTH // 2, 1, scale)
    noise = torch.randn(
        (LATENT_FRAMES, LATENT_CHANNELS, half_h, half_w),
        generator=_generator(_seed("latents", ids)),
        dtype=torch.bfloat16,
    )
    latents = F.interpolate(noise, scale_factor=2.0, mode="nearest")
    out.update(
        text_embedding=x.to(torch.bfloat16),
        latents=latents.contiguous(),
        cond=cond.to(torch.bfloat16),
        steps=steps,
    )
    return out


def denoise(payload: object) -> Payload:
    """Denoiser: ``steps`` Euler steps. Each step mixes channels per frame with weights
    gated by a softmax over the frame's pooled channels, plus the text conditioning."""
    name = "denoise"
    p = _as_dict(payload, name)
    out = _carried(name, p)
    latents = _tensor(p, "latents", name, ndim=4, kind="float", **_LATENT_DIMS)
    if "text_embedding" in p:  # a pipeline without the tensor reference: pass it on as is
        out["text_embedding"] = _tensor(p, "text_embedding", name, **_TEXT_DIMS)
    cond = _tensor(p, "cond", name, ndim=1, kind="float", shape={0: LATENT_CHANNELS})
    steps = _int(p, "steps", name, default=DEFAULT_STEPS, lo=1, hi=MAX_STEPS)
    sleep_ms = (float(out.get("sleep_ms") or 0.0) + _env_ms(DENOISE_MS_ENV)) * _slowdown()
    if sleep_ms:
        time.sleep(sleep_ms / 1000.0)

    frames, channels, height, width = latents.shape
    dtype = latents.dtype
    x = latents.reshape(frames, channels, height * width)  # read only: each step is new
    # eps(x) = gate * (I + W / 2) x + cond: mostly "x is noise", so each step shrinks x.
    # One Euler step x - dt * eps(x) is a single batched matmul: (I - dt * gate * M) x - dt * c.
    eye = torch.eye(channels)
    mix = eye + 0.5 * _conv("video.mix", channels, channels)
    gate_w = _linear("video.gate", channels, channels) * 4.0
    cond_col = cond.float().view(1, channels, 1).expand(frames, channels, 1)
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    for sigma, sigma_next in itertools.pairwise(sigmas):
        dt = sigma - sigma_next
        pooled = x.mean(dim=2, dtype=torch.float32)  # (frames, channels)
        gate = torch.softmax(pooled @ gate_w, dim=1) * channels
        step = (eye - dt * gate.unsqueeze(2) * mix).to(dtype)
        x = torch.baddbmm((-dt * cond_col).to(dtype), step, x)
    out["latents"] = x.view(frames, channels, height, width)
    return out


def decode_video(payload: object) -> Payload:
    """Video decoder: latents -> uint8 RGB frames at twice the latent resolution, with a
    colour shift from the text embedding."""
    name = "decode_video"
    p = _as_dict(payload, name)
    out = _carried(name, p)
    latents = _tensor(p, "latents", name, ndim=4, kind="float", **_LATENT_DIMS)
    text = _tensor(p, "text_embedding", name, **_TEXT_DIMS)

    frames, channels, height, width = latents.shape
    dtype = latents.dtype
    shift = text.float().mean(dim=0) @ _linear("video.shift", TEXT_DIM, 12)
    proj = _conv("video.decode", 12, channels).to(dtype)
    bias = shift.to(dtype).view(1, 12, 1).expand(frames, 12, 1)
    y = torch.baddbmm(
        bias, proj.expand(frames, 12, channels), latents.reshape(frames, channels, -1)
    )
    y = F.pixel_shuffle(y.view(frames, 12, height, width), 2)
    rgb = y.mul_(64.0).add_(128.0).clamp_(0.0, 255.0).to(torch.uint8)
    out.update(frames=rgb, fps=VIDEO_FPS)
    return out


# --- llm-prefill-decode --------------------------------------------------------------------


def _lm_logits(h: torch.Tensor) -> torch.Tensor:
    h = F.layer_norm(h, (LLM_DIM,))
    return h @ _linear("lm.head", LLM_DIM, LLM_VOCAB) * 2.0


def _sample(
    logits: torch.Tensor, gen: torch.Generator, temperature: float = 1.0, top_p: float = 1.0
) -> int:
    """Temperature 0 is greedy; top_p < 1 keeps the smallest set of likeliest tokens whose
    probability reaches top_p (nucleus sampling)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        ordered, index = torch.sort(probs, descending=True)
        keep = torch.cumsum(ordered, dim=0) - ordered < top_p
        probs = torch.zeros_like(probs).scatter_(0, index[keep], ordered[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


_ONSETS = ("", "b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS = ("", "n", "s", "r", "l", "th", "m", "x", "ng", "st", "ck", "rd", "sh", "ft", "mp", "nt")
BOS_ID = 1
MAX_STOP = 4


def token_text(token: int) -> str:
    """The demo's trivial vocabulary: token id -> " " + a syllable (16 x 8 x 16 = 2048)."""
    onset, rest = _ONSETS[token % 16], token // 16
    return f" {onset}{_VOWELS[rest % 8]}{_CODAS[(rest // 8) % 16]}"


def _prompt_ids(p: Payload, name: str) -> torch.Tensor:
    """A text prompt's ids: BOS, then its UTF-8 bytes (the demo needs no tokenizer)."""
    if "messages" in p:
        messages = p["messages"]
        ok = (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
        )
        if not ok:
            raise ValueError(
                f"{name}: payload['messages'] must be a non-empty list of "
                "{'role': str, 'content': str}"
            )
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    else:
        prompt = p.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"{name}: payload needs 'input_ids', 'prompt' (str) or 'messages'")
        text = prompt
    raw = text.encode()[: LLM_MAX_PROMPT - 1]
    return torch.tensor([BOS_ID, *raw], dtype=torch.int64)


def _sampling(p: Payload, name: str) -> Payload:
    """temperature, top_p and stop, checked (defaults: 1.0, 1.0, none)."""
    out: Payload = {}
    for key, low, high, default in (("temperature", 0.0, 2.0, 1.0), ("top_p", 0.0, 1.0, 1.0)):
        value = p.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not low <= value <= high
            or (key == "top_p" and value == 0)
        ):
            raise ValueError(f"{name}: payload[{key!r}] must be a number in [{low}, {high}]")
        out[key] = float(value)
    stop = p.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise ValueError(f"{name}: payload['stop'] must be up to {MAX_STOP} non-empty strings")
    out["stop"] = list(stop)
    return out


def prefill(payload: object) -> Payload:
    """Prefill: run the prompt through a small causal transformer once; hand the KV cache,
    the first sampled token and the sampling seed to decode."""
    name = "prefill"
    p = _as_dict(payload, name)
    out = _carried(name, p)
    if "input_ids" in p:
        ids = _tensor(p, "input_ids", name, ndim=1, kind="int64", min_size={0: 1})
    else:
        ids = _prompt_ids(p, name)
    if len(ids) > LLM_MAX_PROMPT:
        raise ValueError(f"{name}: payload['input_ids'] is longer than {LLM_MAX_PROMPT} tokens")
    _check_ids(ids, "input_ids", name, LLM_VOCAB)
    if "prompt" in p and not isinstance(p["prompt"], str):
        raise ValueError(f"{name}: payload['prompt'] must be a str; got {_describe(p['prompt'])}")
    if "max_tokens" in p and "max_new_tokens" not in p:
        p = {**p, "max_new_tokens": p["max_tokens"]}
    new_tokens = _int(
        p, "max_new_tokens", name, default=DEFAULT_NEW_TOKENS, lo=1, hi=MAX_NEW_TOKENS
    )
    sampling = _sampling(p, name)
    given_seed = p.get("seed")
    if given_seed is not None and type(given_seed) is not int:
        raise ValueError(f"{name}: payload['seed'] must be an int; got {given_seed!r}")

    x = _embedding("lm.embed", LLM_VOCAB, LLM_DIM)[ids] + _positions(len(ids), LLM_DIM)
    cache = []
    for layer in range(LLM_LAYERS):
        x, k, v = _block(x, f"lm.layer{layer}", LLM_HEADS, causal=True)
        cache.append(torch.stack((k, v)))
    seed = _seed("lm", ids) if given_seed is None else given_seed & 0x7FFFFFFF
    logits = _lm_logits(x[-1])
    first = _sample(logits, _generator(seed), sampling["temperature"], sampling["top_p"])
    out.update(
        kv=torch.stack(cache).to(torch.bfloat16),
        next_token=first,
        seed=seed,
        prompt_len=len(ids),
        max_new_tokens=new_tokens,
        **sampling,
    )
    return out


def decode_tokens(payload: object) -> Iterator[Payload]:
    """Decode: stream ``max_new_tokens`` chunks ``{"token": int64 (1,), "step": k}``, each
    token sampled from the model attending over the KV cache. The payload is checked and
    the cache copied before the generator is returned, so errors raise at the call and
    the stream holds no view of the input."""
    name = "decode_tokens"
    p = _as_dict(payload, name)
    carried = _carried(name, p)
    kv = _tensor(
        p,
        "kv",
        name,
        ndim=5,
        kind="float",
        shape={0: LLM_LAYERS, 1: 2, 2: LLM_HEADS, 4: LLM_HEAD_DIM},
        min_size={3: 1},
    )
    first = _int(p, "next_token", name, default=None, lo=0, hi=LLM_VOCAB - 1)
    seed = _int(p, "seed", name, default=None, lo=0, hi=2**31 - 1)
    new_tokens = _int(
        p, "max_new_tokens", name, default=DEFAULT_NEW_TOKENS, lo=1, hi=MAX_NEW_TOKENS
    )
    sampling = _sampling(p, name)
    prompt_len = _int(p, "prompt_len", name, default=kv.shape[3], lo=1, hi=LLM_MAX_PROMPT)
    # Copies: the stream outlives this call and must not hold views of the receive pool.
    keys = [kv[layer, 0].to(torch.float32, copy=True) for layer in range(LLM_LAYERS)]
    values = [kv[layer, 1].to(torch.float32, copy=True) for layer in range(LLM_LAYERS)]
    return _stream(
        keys, values, first, seed, new_tokens, carried, sampling=sampling, prompt_len=prompt_len
    )


def _stream(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    token: int,
    seed: int,
    new_tokens: int,
    carried: Payload,
    *,
    sampling: Payload,
    prompt_len: int,
) -> Iterator[Payload]:
    gen = _generator(seed + 1)
    position = keys[0].shape[1]
    stops: list[str] = sampling["stop"]
    text = ""
    for step in range(new_tokens):
        piece = token_text(token)
        finish = "length" if step == new_tokens - 1 else None
        cut = min((i for i in ((text + piece).find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            piece, finish = (text + piece)[len(text) : cut] if cut > len(text) else "", "stop"
        text += piece
        chunk = {
            "token": torch.tensor([token], dtype=torch.int64),
            "step": step,
            "text": piece,
            "token_ids": [token],
            "finish_reason": finish,
            **carried,
        }
        if step == 0:
            chunk["prompt_tokens"] = prompt_len
        yield chunk
        if finish is not None:
            return
        x = _embedding("lm.embed", LLM_VOCAB, LLM_DIM)[token].unsqueeze(0)
        x = x + _positions(1, LLM_DIM, start=position)
        for layer in range(LLM_LAYERS):
            past = (keys[layer], values[layer])
            x, keys[layer], values[layer] = _block(
                x, f"lm.layer{layer}", LLM_HEADS, causal=True, past=past
            )
        token = _sample(_lm_logits(x[0]), gen, sampling["temperature"], sampling["top_p"])
        position += 1


# --- fan-out -------------------------------------------------------------------------------


@functools.cache
def _mel_filters(sample_rate: int) -> torch.Tensor:
    """Triangular mel filter bank, (MEL_BINS, N_FFT // 2 + 1) float32."""

    def to_mel(f: torch.Tensor) -> torch.Tensor:
        return 2595.0 * torch.log10(1.0 + f / 700.0)

    def from_mel(m: torch.Tensor) -> torch.Tensor:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    freqs = torch.linspace(0.0, sample_rate / 2, N_FFT // 2 + 1)
    top = to_mel(torch.tensor(sample_rate / 2))
    edges = from_mel(torch.linspace(0.0, float(top), MEL_BINS + 2))
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (freqs - lower) / (center - lower)
    falling = (upper - freqs) / (upper - center)
    return torch.clamp(torch.minimum(rising, falling), min=0.0)


def ingest(payload: object) -> Payload:
    """Ingest: normalise the image; turn the waveform into a log-mel spectrogram."""
    name = "ingest"
    p = _as_dict(payload, name)
    out = _carried(name, p)
    image = _tensor(
        p, "image", name, ndim=3, kind="uint8", shape={0: 3}, min_size={1: PATCH, 2: PATCH}
    )
    audio = _tensor(p, "audio", name, ndim=1, kind="float", min_size={0: N_FFT})
    rate = _int(p, "sample_rate", name, default=SAMPLE_RATE, lo=1000, hi=384000)

    mean = torch.tensor(_IMAGE_MEAN).view(3, 1, 1)
    std = torch.tensor(_IMAGE_STD).view(3, 1, 1)
    pixels = (image.float() / 255.0 - mean) / std
    spec = torch.stft(
        audio.float(),
        n_fft=N_FFT,
        hop_length=HOP,
        window=torch.hann_window(N_FFT),
        return_complex=True,
    )
    mel = torch.log(_mel_filters(rate) @ spec.abs().square() + 1e-6)
    out.update(pixels=pixels, mel=mel)
    return out


def embed_image(payload: object) -> Payload:
    """Vision branch: 16x16 patches -> one self-attention layer -> pooled, unit-norm embedding."""
    name = "embed_image"
    p = _as_dict(payload, name)
    out = _carried(name, p)
    pixels = _tensor(
        p, "pixels", name, ndim=3, kind="float", shape={0: 3}, min_size={1: PATCH, 2: PATCH}
    )
    patches = F.conv2d(
        pixels.float().unsqueeze(0),
        _conv("vision.patch", EMBED_DIM, 3, PATCH, PATCH),
        stride=PATCH,
    )
    tokens = patches.flatten(2)[0].T  # (h * w, EMBED_DIM)
    tokens = tokens + _positions(tokens.shape[0], EMBED_DIM)
    tokens, _, _ = _block(tokens, "vision.block", EMBED_HEADS, causal=False)
    pooled = _attention_pool(F.layer_norm(tokens, (EMBED_DIM,)), "vision.pool")
    out.update(image_embedding=F.normalize(pooled, dim=0), patches=tokens.shape[0])
    return out


def embed_audio(payload: object) -> Payload:
    """Audio branch: 1-D convolution over mel frames -> one self-attention layer -> pooled,
    unit-norm embedding."""
    name = "embed_audio"
    p = _as_dict(payload, name)
    out = _carried(name, p)
    mel = _tensor(p, "mel", name, ndim=2, kind="float", shape={0: MEL_BINS}, min_size={1: 1})
    feats = F.conv1d(
        mel.float().unsqueeze(0), _conv("audio.conv", EMBED_DIM, MEL_BINS, 3), padding=1
    )
    tokens = F.gelu(feats[0].T)  # (frames, EMBED_DIM)
    tokens = tokens + _positions(tokens.shape[0], EMBED_DIM)
    tokens, _, _ = _block(tokens, "audio.block", EMBED_HEADS, causal=False)
    pooled = _attention_pool(F.layer_norm(tokens, (EMBED_DIM,)), "audio.pool")
    out.update(audio_embedding=F.normalize(pooled, dim=0), frames=tokens.shape[0])
    return out


def fuse(payload: object) -> Payload:
    """Fan-in: join the two branch embeddings -> fused embedding, class probabilities and
    the image/audio cosine similarity."""
    name = "fuse"
    p = _as_dict(payload, name)
    branches = [v for v in p.values() if isinstance(v, dict)]
    vision = [b for b in branches if "image_embedding" in b]
    audio = [b for b in branches if "audio_embedding" in b]
    if len(p) != 2 or len(vision) != 1 or len(audio) != 1:
        raise ValueError(
            f"{name}: expected a dict of upstream outputs, one with 'image_embedding' and "
            f"one with 'audio_embedding' (e.g. {{'vision': ..., 'audio': ...}}); "
            f"got keys {sorted(map(str, p))}"
        )
    out = _carried(name, *branches)
    img = _tensor(vision[0], "image_embedding", name, ndim=1, kind="float", shape={0: EMBED_DIM})
    aud = _tensor(audio[0], "audio_embedding", name, ndim=1, kind="float", shape={0: EMBED_DIM})

    x = F.layer_norm(torch.cat((img.float(), aud.float())), (2 * EMBED_DIM,))
    x = F.gelu(x @ _linear("fuse.up", 2 * EMBED_DIM, 2 * EMBED_DIM))
    emb = F.normalize(x @ _linear("fuse.down", 2 * EMBED_DIM, EMBED_DIM), dim=0)
    probs = torch.softmax(
        emb @ _linear("fuse.classes", EMBED_DIM, LABELS) * math.sqrt(EMBED_DIM), dim=0
    )
    out.update(
        embedding=emb,
        probs=probs,
        label=int(probs.argmax()),
        similarity=float(F.cosine_similarity(img.float(), aud.float(), dim=0)),
    )
    return out


# --- synthetic requests --------------------------------------------------------------------


def sample_input(handler: str, i: int) -> Payload:
    """Request ``i`` for the entry handler ``handler`` (``"encode_text"``, ``"prefill"`` or
    ``"ingest"``; a ``"disagg_runtime.demo:<name>"`` spec works too). Deterministic in
    ``i``; sizes follow ``DISAGG_DEMO_SCALE``."""
    short = handler.rpartition(":")[2] if handler.startswith(f"{__name__}:") else handler
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
