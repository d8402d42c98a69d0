"""Payload-to-slot layout: where a payload's tensors go in a pool slot, and back.

A slot holds one payload's tensors at the offsets `Manifest.of` gives them;
`write_tensors` copies tensors in (once; GPU copies through copies.py), `read_payload`
returns views (or copies) that stay valid until the slot is freed, and `slot_image`
builds a slot's bytes in fresh memory for payloads small enough to travel inline.

A sender's `Planner` keeps the placements (a manifest less its tree) of the payload shapes
it sent last, keyed by each tensor's dtype and shape in order, which is all a placement
depends on: a payload shaped like a recent one skips laying out its manifest (~4 us, three
times that with the caches cold after a wait), and `SlotPlan.fill` writes its tensors
straight into the frame an inline payload travels in.
"""

from __future__ import annotations

import ctypes
import operator
import threading
from collections.abc import Sequence
from typing import Any

import torch

from disagg_runtime.memory.copies import Fence, copy_async, to_device
from disagg_runtime.memory.pool import Backing
from disagg_runtime.wire.codec import CodecError, tensor_from_buffer
from disagg_runtime.wire.manifest import Manifest
from disagg_runtime.wire.tree import flatten, unflatten


def slot_views(backing: Backing, slot: int, manifest: Manifest) -> list[torch.Tensor]:
    """Typed views of each tensor's place in the slot (on the backing's device)."""
    views: list[torch.Tensor] = []
    for meta, offset in zip(manifest.tensors, manifest.offsets, strict=True):
        start = slot + offset
        raw = backing.tensor[start : start + meta.nbytes]
        if meta.nbytes:
            views.append(raw.view(meta.dtype).view(meta.shape))
        else:
            views.append(torch.empty(meta.shape, dtype=meta.dtype, device=raw.device))
    return views


def write_tensors(
    backing: Backing,
    slot: int,
    manifest: Manifest,
    tensors: Sequence[torch.Tensor],
    *,
    stream: torch.cuda.Stream | None = None,
) -> Fence:
    """Copy each tensor into its place in the slot (one copy; no temporaries). Host to
    host copies are done on return; copies from or into a GPU are queued on a copy stream
    (`stream` for its device, else this thread's) and the returned Fence says when.

    With one torch thread, a contiguous host tensor goes into host memory by one memmove
    (the GIL released, as in `copy_`): the same copy, without ~6 us of torch dispatch
    (slice, reshape, view, copy_) per tensor, a few percent of a 1 MiB hand-off. With more
    threads `copy_` may split a large copy among them, so it is kept."""
    size = backing.tensor.numel()  # 0 once closed
    if slot < 0 or slot + manifest.nbytes > size:
        end = slot + manifest.nbytes
        raise ValueError(f"slot [{slot}, {end}) lies outside the pool's {size} B")
    queued: list[tuple[torch.Tensor, torch.Tensor]] = []
    base = backing.tensor.data_ptr() if _one_copy_thread(backing) else 0
    for meta, offset, src in zip(manifest.tensors, manifest.offsets, tensors, strict=True):
        nbytes = meta.nbytes
        if nbytes == 0:
            continue
        start = slot + offset
        if base and _plain_host(src) and src.nbytes == nbytes:
            ctypes.memmove(base + start, src.data_ptr(), nbytes)
            continue
        dst = backing.tensor[start : start + nbytes]
        if dst.is_cuda or src.is_cuda:
            queued.append((dst.view(meta.dtype).view(meta.shape), src.detach()))
        else:
            dst.copy_(src.reshape(-1).view(torch.uint8))
    return copy_async(queued, stream=stream) if queued else Fence()


def _one_copy_thread(backing: Backing) -> bool:
    """Host pool memory, written from a process that copies on one torch thread."""
    return not backing.tensor.is_cuda and torch.get_num_threads() == 1


def _plain_host(t: torch.Tensor) -> bool:
    """A host tensor whose bytes are its values, in order (no lazy conj/neg bit)."""
    return t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg())


def buffer_tensors(
    buffer: memoryview, manifest: Manifest, *, copy: bool = False
) -> list[torch.Tensor]:
    """The tensors that `manifest` places in `buffer` (a slot's bytes), viewing it."""
    return [
        tensor_from_buffer(buffer[offset : offset + meta.nbytes], meta, copy=copy)
        for meta, offset in zip(manifest.tensors, manifest.offsets, strict=True)
    ]


class SlotReader:
    """`buffer_tensors` for one layout, worked out once: each tensor's offset, element
    count, dtype and shape, so a receiver that sees the same layout again and again (a
    stream of payloads; relay/inline_wire.py caches one per layout) builds its tensors in
    one tight loop. `manifest` must be validated (`Manifest.from_json`)."""

    __slots__ = ("_specs", "nbytes")

    def __init__(self, manifest: Manifest) -> None:
        self.nbytes = manifest.nbytes
        self._specs = tuple(
            (
                offset,
                meta.nbytes // meta.dtype.itemsize,
                meta.dtype,
                None if len(meta.shape) == 1 else meta.shape,  # 1-D: frombuffer's own shape
                meta.dtype is torch.bool,
            )
            for meta, offset in zip(manifest.tensors, manifest.offsets, strict=True)
        )

    def tensors(self, buffer: memoryview) -> list[torch.Tensor]:
        """The tensors viewing `buffer`, a writable byte view of exactly `nbytes` (a slot's
        bytes); CodecError when it is not that size, or a bool tensor holds other bytes."""
        if buffer.nbytes != self.nbytes:
            raise CodecError(f"buffer holds {buffer.nbytes} bytes, the layout {self.nbytes}")
        out: list[torch.Tensor] = []
        for offset, count, dtype, shape, boolean in self._specs:
            if not count:
                out.append(torch.empty(shape if shape is not None else (0,), dtype=dtype))
                continue
            t = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
            if boolean and bool((t.view(torch.uint8) > 1).any()):
                raise CodecError("bool tensor data holds bytes other than 0 and 1")
            out.append(t if shape is None else t.view(shape))
        return out


def read_payload(
    backing: Backing,
    slot: int,
    manifest: Manifest,
    *,
    copy: bool = False,
    device: torch.device | str | None = None,
) -> Any:
    """Rebuild the payload; tensors view the slot unless `copy` (then they are clones), or
    unless `device` differs from the pool's (then they are copies there, see `to_device`)."""
    if backing.has_buffer:
        tensors = buffer_tensors(
            backing.buffer(slot, manifest.nbytes), manifest, copy=copy and device is None
        )
    else:
        tensors = slot_views(backing, slot, manifest)
        if copy and device is None:
            tensors = [t.clone() for t in tensors]
    payload = unflatten(manifest.tree, tensors)
    return payload if device is None else to_device(payload, device)


def plan(payload: Any) -> tuple[Manifest, list[torch.Tensor]]:
    """Flatten a payload and lay its tensors out. CUDA tensors stay on their GPU (returned
    as they are, possibly strided): `write_tensors` copies them once, straight into the
    slot, instead of through fresh host memory first. CPU tensors come back contiguous."""
    tree, tensors = flatten(payload, keep_device=True)
    return Manifest.of(tree, tensors), tensors


def host_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with `t`'s bytes (`t` itself when it already is one)."""
    if _plain_host(t):
        return t
    return t.detach().resolve_conj().resolve_neg().contiguous().cpu()


def slot_image(manifest: Manifest, tensors: Sequence[torch.Tensor]) -> bytearray:
    """A slot's bytes built in fresh host memory: what a small payload carries inline, in
    place of a pool slot (GPU tensors are copied to the host first: small payloads only)."""
    image = bytearray(manifest.nbytes)
    if not image:
        return image
    base = ctypes.addressof(ctypes.c_char.from_buffer(image))
    for meta, offset, t in zip(manifest.tensors, manifest.offsets, tensors, strict=True):
        if meta.nbytes:
            # one memcpy from a contiguous host tensor: cheaper than building torch views
            # (`host` holds the copy a strided or GPU tensor needs until it is read)
            host = host_tensor(t)
            ctypes.memmove(base + offset, host.data_ptr(), meta.nbytes)
    return image


class SlotPlan:
    """Where a payload's tensors go in its slot (a manifest without its tree), which their
    dtypes and shapes alone decide: worked out once per `Planner` signature, with the copies
    that build a slot image and, on first use, its JSON (`layout_json`)."""

    __slots__ = ("_json", "copies", "data_bytes", "nbytes", "offsets", "tensors")

    def __init__(self, manifest: Manifest) -> None:
        self.tensors = manifest.tensors
        self.offsets = manifest.offsets
        self.nbytes = manifest.nbytes  # the slot's, padding included
        self.data_bytes = sum(meta.nbytes for meta in manifest.tensors)  # the tensors' own
        # (tensor index, offset, bytes) of each tensor that has bytes
        self.copies = tuple(
            (i, offset, meta.nbytes)
            for i, (meta, offset) in enumerate(zip(self.tensors, self.offsets, strict=True))
            if meta.nbytes
        )
        self._json: bytes | None = None

    def manifest(self, tree: Any) -> Manifest:
        return Manifest(tree, self.tensors, self.offsets, self.nbytes)

    def layout_json(self) -> bytes:
        """`Manifest.layout_json` of this placement, encoded once."""
        if self._json is None:
            self._json = self.manifest(None).layout_json()
        return self._json

    def fill(self, buffer: bytearray, at: int, tensors: Sequence[torch.Tensor]) -> None:
        """Copy `tensors`, as `plan` returns them (host ones contiguous), to their places in
        the slot image that starts at `buffer[at]`; the padding is left as it is."""
        if not self.copies:
            return
        base = ctypes.addressof(ctypes.c_char.from_buffer(buffer, at))
        for i, offset, nbytes in self.copies:
            t = tensors[i]
            if t.is_cuda:
                t = host_tensor(t)  # held until copied
            ctypes.memmove(base + offset, t.data_ptr(), nbytes)


PLANNED_SIGNATURES = 32  # per planner: the payload shapes a sender's payloads take turns in
MAX_PLANNED_TENSORS = 256  # a payload with more is laid out each time (at most ~4 MiB kept)
_SIGNATURE = operator.attrgetter("dtype", "shape")


class Planner:
    """`plan` for a stream of payloads (one per sender). It keeps the placements of the last
    PLANNED_SIGNATURES signatures, a signature being each tensor's (dtype, shape) in order,
    which is all a placement depends on: a payload shaped like a recent one is not laid out
    again, and its manifest is the one `plan` gives (its tree is its own, flattened each
    time). Thread-safe."""

    def __init__(self) -> None:
        self._known: dict[tuple[tuple[torch.dtype, torch.Size], ...], SlotPlan] = {}
        self._lock = threading.Lock()  # taken only to add one

    def __len__(self) -> int:
        return len(self._known)

    def plan(self, payload: Any) -> tuple[Any, list[torch.Tensor], SlotPlan]:
        """The payload's tree, its tensors as `plan` gives them, and their placement:
        `plan`'s manifest is `placement.manifest(tree)` (built where it is needed)."""
        tree, tensors = flatten(payload, keep_device=True)
        signature = tuple(map(_SIGNATURE, tensors))
        placed = self._known.get(signature)
        if placed is None:
            placed = SlotPlan(Manifest.of(tree, tensors))  # bad input fails here
            if len(tensors) <= MAX_PLANNED_TENSORS:
                with self._lock:
                    if len(self._known) >= PLANNED_SIGNATURES:
                        del self._known[next(iter(self._known))]  # the oldest
                    self._known[signature] = placed
        return tree, tensors, placed
