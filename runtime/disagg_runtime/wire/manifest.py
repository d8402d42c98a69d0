"""Where a payload's tensors sit inside one pool slot.

A relay that stages through a pool sends only this manifest (JSON) across the control
channel; the tensors themselves are written once into the slot. Layout inside a slot:

    slot offset
    |<- t0 bytes ->|pad|<- t1 bytes ->|pad| ... |
    each tensor starts at a multiple of max(ALIGN, itemsize)

The receiver never trusts offsets: `Manifest.from_json` checks that every tensor lies
inside the slot, is aligned, and does not overlap the previous one before any memory
is touched (DESIGN.md section 7, "control messages carrying raw offsets").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from disagg_runtime.wire.codec import CodecError, TensorMeta, encode_json

ALIGN = 64
MANIFEST_VERSION = 1
_ENTRY_KEYS = frozenset({"dtype", "shape", "offset"})


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def tensor_alignment(meta: TensorMeta) -> int:
    """At least a cache line, and at least the element size (complex128-safe)."""
    return max(ALIGN, meta.dtype.itemsize)


def layout(metas: Sequence[TensorMeta]) -> tuple[tuple[int, ...], int]:
    """Pack tensors back to back at aligned offsets; return (offsets, total bytes)."""
    offsets: list[int] = []
    cursor = 0
    for meta in metas:
        cursor = _align_up(cursor, tensor_alignment(meta))
        offsets.append(cursor)
        cursor += meta.nbytes
    return tuple(offsets), cursor


@dataclass(frozen=True)
class Manifest:
    """A payload's tree plus the placement of each of its tensors, relative to the slot."""

    tree: Any
    tensors: tuple[TensorMeta, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, tree: Any, tensors: Sequence[torch.Tensor]) -> Manifest:
        """The layout of a flattened payload's tensors."""
        metas = tuple(TensorMeta.of(t) for t in tensors)
        offsets, total = layout(metas)
        return cls(tree=tree, tensors=metas, offsets=offsets, nbytes=total)

    def to_json(self) -> dict[str, Any]:
        return {
            "v": MANIFEST_VERSION,
            "tree": self.tree,
            "nbytes": self.nbytes,
            "tensors": [
                {**meta.to_json(), "offset": off}
                for meta, off in zip(self.tensors, self.offsets, strict=True)
            ],
        }

    def layout_json(self) -> bytes:
        """Everything but the tree (version, nbytes, tensors) as compact JSON: the part that
        repeats while the tensors' dtypes and shapes do (relay/inline_wire.py)."""
        doc = self.to_json()
        del doc["tree"]
        return encode_json(doc)

    @classmethod
    def from_json(cls, obj: object, *, slot_size: int) -> Manifest:
        """Parse and bounds-check a manifest against the slot it claims to describe."""
        if not isinstance(obj, dict):
            raise CodecError("manifest: expected an object")
        if type(obj.get("v")) is not int or obj.get("v") != MANIFEST_VERSION:
            raise CodecError(f"manifest: unsupported version {obj.get('v')!r}")
        entries = obj.get("tensors")
        nbytes = obj.get("nbytes")
        if not isinstance(entries, list):
            raise CodecError("manifest.tensors: expected a list")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= slot_size:
            raise CodecError(f"manifest.nbytes: {nbytes!r} does not fit a slot of {slot_size} B")
        metas: list[TensorMeta] = []
        offsets: list[int] = []
        end_of_previous = 0
        for i, entry in enumerate(entries):
            where = f"manifest.tensors[{i}]"
            if not isinstance(entry, dict):
                raise CodecError(f"{where}: expected an object")
            offset = entry.get("offset")
            meta = TensorMeta.from_json(entry, where=where, keys=_ENTRY_KEYS)
            if not isinstance(offset, int) or isinstance(offset, bool):
                raise CodecError(f"{where}.offset: expected an integer")
            if offset < end_of_previous or offset % tensor_alignment(meta):
                raise CodecError(f"{where}.offset: {offset} overlaps or is misaligned")
            if offset + meta.nbytes > nbytes:
                raise CodecError(
                    f"{where}: bytes [{offset}, {offset + meta.nbytes}) exceed {nbytes}"
                )
            metas.append(meta)
            offsets.append(offset)
            end_of_previous = offset + meta.nbytes
        return cls(
            tree=obj.get("tree"), tensors=tuple(metas), offsets=tuple(offsets), nbytes=nbytes
        )
