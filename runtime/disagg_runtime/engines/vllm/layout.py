"""The KV-cache geometry a transfer carries, and the block arithmetic around it (pure).

vLLM's CPU KV cache is, per attention layer, one tensor

    [num_blocks, num_kv_heads, block_size, 2 * head_size]     (model dtype)

all layers views of one allocation, K stored transposed inside a block for the CPU kernel.
The connector therefore moves whole blocks as opaque bytes: block `i` of a layer is
`cache[i]`, contiguous. A prompt of `n` tokens fills `ceil(n / block_size)` blocks, the
last one partly; the whole block travels (the slots past the prompt are never read: the
decode engine recomputes the prompt's last token, and writes the slots after it).

Both ends must agree on everything in `KvLayout` (dtype, block size, per-block shape,
layer names, attention backend): a decode engine refuses a transfer whose layout differs
from its own (`mismatch`), naming the field, rather than reading garbage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_LAYERS = 4096
MAX_DIMS = 8


class LayoutError(ValueError):
    """A layout field is malformed, or the two ends' layouts differ."""


@dataclass(frozen=True)
class KvLayout:
    """What one engine's KV cache looks like, block by block."""

    dtype: str  # torch dtype name, e.g. "float32"
    block_size: int  # tokens per block
    block_shape: tuple[int, ...]  # one block of one layer: (num_kv_heads, block_size, 2*head)
    layers: tuple[str, ...]  # attention layer names, in the order blocks are sent
    backend: str  # the attention backend, whose kernel decides the in-block layout

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (`dtype` size times `block_shape`)."""
        return math.prod(self.block_shape) * _ITEMSIZE[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "block_size": self.block_size,
            "block_shape": list(self.block_shape),
            "layers": list(self.layers),
            "backend": self.backend,
        }

    @classmethod
    def from_json(cls, doc: Any, where: str = "layout") -> KvLayout:
        """Parse a layout sent by a peer, refusing anything malformed (naming the field)."""
        if not isinstance(doc, Mapping):
            raise LayoutError(f"{where}: expected an object, got {type(doc).__name__}")
        dtype = doc.get("dtype")
        if dtype not in _ITEMSIZE:
            raise LayoutError(f"{where}.dtype: {dtype!r} is not one of {sorted(_ITEMSIZE)}")
        block_size = _positive(doc.get("block_size"), f"{where}.block_size")
        shape = doc.get("block_shape")
        if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_DIMS:
            raise LayoutError(f"{where}.block_shape: expected 1-{MAX_DIMS} sizes, got {shape!r}")
        dims = tuple(_positive(d, f"{where}.block_shape[{i}]") for i, d in enumerate(shape))
        layers = doc.get("layers")
        if (
            not isinstance(layers, list)
            or not 1 <= len(layers) <= MAX_LAYERS
            or not all(isinstance(n, str) and 0 < len(n) <= 256 for n in layers)
        ):
            raise LayoutError(f"{where}.layers: expected 1-{MAX_LAYERS} layer names")
        backend = doc.get("backend")
        if not isinstance(backend, str) or len(backend) > 128:
            raise LayoutError(f"{where}.backend: expected a name, got {backend!r}")
        return cls(dtype, block_size, dims, tuple(layers), backend)


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _positive(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1 << 31:
        raise LayoutError(f"{where}: expected a positive integer, got {value!r}")
    return value


def mismatch(ours: KvLayout, theirs: KvLayout) -> str | None:
    """Why a transfer laid out as `theirs` cannot land in a cache laid out as `ours` (None:
    it can)."""
    for name in ("dtype", "block_size", "block_shape", "backend", "layers"):
        a, b = getattr(ours, name), getattr(theirs, name)
        if a != b:
            shown = (len(a), len(b)) if name == "layers" and len(a) != len(b) else (a, b)
            return (
                f"KV layout differs in {name}: this engine has {shown[0]!r}, the prefill "
                f"engine sent {shown[1]!r} (both engines need the same model, dtype, "
                f"block size and attention backend)"
            )
    return None


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens (the last one possibly partly filled)."""
    return -(-tokens // block_size)


def runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """`ids` as (first, count) runs of consecutive block ids, in order: each run is one
    contiguous slice of a layer's cache, so a request's blocks travel as few tensors."""
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def pair_runs(
    sent: Sequence[int], skip: int, dst: Sequence[tuple[int, int]]
) -> list[tuple[int, int, int, int]]:
    """How sent block runs fill destination runs, without joining them first.

    `sent` is the length of each received run (in order), the first `skip` blocks of them
    are not wanted (cached at the destination already), `dst` the (first, count) runs to
    fill. Returns (sent run, offset in it, destination block, count) copies, in order.
    """
    out: list[tuple[int, int, int, int]] = []
    part, at = 0, skip
    while part < len(sent) and at >= sent[part]:
        at -= sent[part]
        part += 1
    for start, count in dst:
        while count:
            if part >= len(sent):
                raise LayoutError("fewer blocks arrived than the request needs")
            n = min(count, sent[part] - at)
            out.append((part, at, start, n))
            start, count, at = start + n, count - n, at + n
            if at == sent[part]:
                part, at = part + 1, 0
    return out
