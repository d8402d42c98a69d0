"""The fan-out demo pipeline: `ingest` -> {`embed_image`, `embed_audio`} -> `fuse`."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from disagg_runtime.demo.kit import (
    _IMAGE_MEAN,
    _IMAGE_STD,
    EMBED_DIM,
    EMBED_HEADS,
    HOP,
    LABELS,
    MEL_BINS,
    N_FFT,
    PATCH,
    SAMPLE_RATE,
    Payload,
    _as_dict,
    _attention_pool,
    _block,
    _carried,
    _conv,
    _int,
    _linear,
    _positions,
    _tensor,
)


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
