"""The text-to-video demo pipeline: `encode_text` -> `denoise` -> `decode_video`."""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
import torch.nn.functional as F

from disagg_runtime.demo.kit import (
    DEFAULT_STEPS,
    DENOISE_MS_ENV,
    LATENT_CHANNELS,
    LATENT_FRAMES,
    LATENT_HEIGHT,
    LATENT_WIDTH,
    MAX_STEPS,
    TEXT_DIM,
    TEXT_HEADS,
    TEXT_VOCAB,
    VIDEO_FPS,
    Payload,
    _as_dict,
    _block,
    _carried,
    _check_ids,
    _conv,
    _describe,
    _embedding,
    _env_ms,
    _generator,
    _int,
    _linear,
    _positions,
    _scaled,
    _seed,
    _slowdown,
    _tensor,
    demo_scale,
)

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
