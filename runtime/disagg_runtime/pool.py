"""Staging pools: a buddy allocator over one block of memory that is allocated once.

Why: fresh memory per message costs page faults, not copies (DESIGN.md section 3), so a
pool maps its memory once, faults every page in at creation (MAP_POPULATE), and hands
out reusable slots. Backings:

    cpu         anonymous private memory; for tcp receives (recv_into a slot)
    shm         POSIX shared memory /dev/shm/disagg-<pipeline>-<role>-<pid>-<n>; other
                processes on the node attach by name; the owner unlinks it on close
    cpu-pinned  page-locked host memory (needs CUDA)
    cuda        device memory (needs CUDA)

A slot holds one payload's tensors laid out by `manifest.layout`; `write` copies tensors
in, `read` returns views (or copies) that stay valid until the slot is freed.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from disagg_runtime.allocator import AllocatorError, BuddyAllocator
from disagg_runtime.codec import tensor_from_buffer, unflatten
from disagg_runtime.manifest import Manifest

SHM_DIR = "/dev/shm"
SHM_PREFIX = "disagg-"
MiB = 1 << 20
Device = Literal["cpu", "shm", "cpu-pinned", "cuda"]
DEVICES: tuple[Device, ...] = ("cpu", "shm", "cpu-pinned", "cuda")
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_counter = itertools.count()


class PoolError(RuntimeError):
    """A pool could not be created, attached or used as asked."""


def shm_name(pipeline: str, role: str) -> str:
    """A /dev/shm name unique to this process, namespaced by pipeline and role."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{pipeline}-{role}")[:160]
    return f"{SHM_PREFIX}{safe}-{os.getpid()}-{next(_counter)}"


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)


class Backing:
    """Memory behind a pool, exposed as one flat uint8 tensor (`tensor`)."""

    def __init__(
        self,
        device: Device,
        tensor: torch.Tensor,
        *,
        name: str | None = None,
        mapping: mmap.mmap | None = None,
        owner: bool = True,
    ) -> None:
        self.device = device
        self.tensor = tensor
        self.name = name
        self.size = tensor.numel()
        self._mapping = mapping
        self._owner = owner
        self.closed = False

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """Writable byte view of host memory (for recv_into); not for device memory."""
        if self._mapping is None:
            raise PoolError(f"{self.device} pool memory has no host buffer")
        return memoryview(self._mapping)[offset : offset + nbytes]

    def close(self) -> None:
        """Unlink (owner) and unmap. Views still alive keep the pages until they die."""
        if self.closed:
            return
        self.closed = True
        if self.name is not None and self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._mapping is not None:
            # with views still exported the mapping goes away with the last of them
            with contextlib.suppress(BufferError):
                self._mapping.close()


def create_backing(device: Device, size: int, *, name: str | None = None) -> Backing:
    """Allocate `size` bytes once and fault every page in."""
    if device in ("cpu-pinned", "cuda") and not torch.cuda.is_available():
        raise PoolError(f"pool device {device!r} needs CUDA, and no CUDA device is available")
    if device == "cpu-pinned":
        return Backing(device, torch.empty(size, dtype=torch.uint8, pin_memory=True))
    if device == "cuda":
        return Backing(device, torch.empty(size, dtype=torch.uint8, device="cuda"))
    if device == "cpu":
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)
        return Backing(device, torch.frombuffer(mapping, dtype=torch.uint8), mapping=mapping)
    if device != "shm":
        raise PoolError(f"unknown pool device {device!r}; expected one of {', '.join(DEVICES)}")
    name = name or shm_name("anon", "pool")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mapping = _map(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return Backing(device, torch.frombuffer(mapping, dtype=torch.uint8), name=name, mapping=mapping)


def attach_backing(name: str) -> Backing:
    """Map another process's shared pool by name (not owned: closing does not unlink)."""
    if not name.startswith(SHM_PREFIX) or "/" in name:
        raise PoolError(f"refusing to attach {name!r}: not a disagg shared-memory name")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except FileNotFoundError:
        raise PoolError(f"shared-memory pool {name!r} does not exist (peer gone?)") from None
    try:
        size = os.fstat(fd).st_size
        mapping = _map(fd, size)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    return Backing("shm", tensor, name=name, mapping=mapping, owner=False)


@dataclass(frozen=True)
class PoolStats:
    total: int
    used: int
    largest_free: int
    occupancy: float


class Pool:
    """A buddy allocator over a backing; slots are offsets into `backing.tensor`."""

    def __init__(self, backing: Backing, *, min_block: int = MiB) -> None:
        self.backing = backing
        self.allocator = BuddyAllocator(backing.size, min_block)

    @classmethod
    def create(
        cls, size: int, *, device: Device = "cpu", min_block: int = MiB, name: str | None = None
    ) -> Pool:
        if size < min_block:
            raise PoolError(f"pool size {size} B is smaller than the minimum block {min_block} B")
        try:
            BuddyAllocator(size, min_block)  # check the geometry before touching memory
        except AllocatorError as exc:
            raise PoolError(f"bad pool geometry: {exc}") from None
        return cls(create_backing(device, size, name=name), min_block=min_block)

    @property
    def name(self) -> str | None:
        return self.backing.name

    def stats(self) -> PoolStats:
        s = self.allocator.stats()
        occupancy = s.used / s.total if s.total else 0.0
        return PoolStats(
            total=s.total, used=s.used, largest_free=s.largest_free, occupancy=occupancy
        )

    def allocate(self, nbytes: int) -> int | None:
        return self.allocator.allocate(max(nbytes, 1))

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def close(self) -> None:
        self.allocator.reset()
        self.backing.close()


def write_tensors(
    backing: Backing, slot: int, manifest: Manifest, tensors: Sequence[torch.Tensor]
) -> None:
    """Copy each tensor into its place in the slot (one copy; no temporaries)."""
    for meta, offset, src in zip(manifest.tensors, manifest.offsets, tensors, strict=True):
        if meta.nbytes == 0:
            continue
        start = slot + offset
        dst = backing.tensor[start : start + meta.nbytes]
        dst.copy_(src.reshape(-1).view(torch.uint8))


def read_payload(backing: Backing, slot: int, manifest: Manifest, *, copy: bool = False) -> Any:
    """Rebuild the payload; tensors view the slot unless `copy`."""
    tensors: list[torch.Tensor] = []
    for meta, offset in zip(manifest.tensors, manifest.offsets, strict=True):
        start = slot + offset
        if backing.device in ("shm", "cpu"):
            tensors.append(tensor_from_buffer(backing.buffer(start, meta.nbytes), meta, copy=copy))
        else:
            raw = backing.tensor[start : start + meta.nbytes]
            view = (
                raw.view(meta.dtype).reshape(meta.shape)
                if meta.nbytes
                else torch.empty(meta.shape, dtype=meta.dtype, device=raw.device)
            )
            tensors.append(view.clone() if copy else view)
    return unflatten(manifest.tree, tensors)
