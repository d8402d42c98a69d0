"""The demo handlers' kit: sizes, the payload conventions (checks, carried keys, failure
and slowness knobs, the scale) and a toy NN kit (seeded weights, attention, blocks).
The package docstring (disagg_runtime.demo) describes the handlers.
"""

from __future__ import annotations

import functools
import math
import os
import zlib
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
