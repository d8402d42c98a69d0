"""The memory a payload lands in, as the receiving side of every relay writes it.

- `Memory` (host pools: cpu, shm, cpu-pinned): tcp chunks are received in place.
- `DeviceMemory` (any relay into a `cuda` pool):
  - tcp chunks: `recv_into` a pinned bounce buffer, then one synchronous host-to-device
    copy on the ingress's own stream (device memory has no host buffer to receive into).
  - release: the releasing thread's current stream is synchronized before the slot is
    freed, so kernels still reading it finish before another sender may write it.
    Handlers that read payloads on side streams synchronize those before returning (the
    usual rule for handing tensors back).

`memory_for` picks one for a pool. Here, not in a relay backend: every relay lands in a
device pool the same way (tcp chunks, shm, nixl); the memory is the pool's, a relay only
moves bytes into it. Failures are PoolError; the ingress tells the sender.
"""

from __future__ import annotations

import torch

from disagg_runtime.memory.copies import new_stream
from disagg_runtime.memory.pool import Pool, PoolError

MAX_BOUNCE = 64 << 20  # the largest tcp chunk landed through the bounce buffer


class Memory:
    """Host memory (cpu, shm, cpu-pinned pools): tcp chunks are received in place."""

    kind = "host"

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def prepare_chunks(self, chunk: int) -> None:
        """A transfer in chunks of `chunk` B is about to land; PoolError if it cannot."""

    def chunk_buffer(self, offset: int, length: int) -> memoryview:
        """Where the next tcp chunk for pool bytes [offset, +length) is received."""
        return self.pool.backing.buffer(offset, length)

    def chunk_landed(self, offset: int, length: int) -> str | None:
        """A chunk arrived in `chunk_buffer`; an error message, or None."""
        return None

    def before_release(self) -> None:
        """The application released a message in its slot: anything still reading the
        slot ends first."""


def pinned_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class DeviceMemory(Memory):
    """A `cuda` pool's memory (see the module docstring)."""

    kind = "cuda"

    def __init__(self, pool: Pool) -> None:
        if pool.backing.device != "cuda":
            raise PoolError(f"DeviceMemory needs a cuda pool, not {pool.backing.device}")
        super().__init__(pool)
        self.gpu = pool.backing.tensor.device
        self._stream = new_stream(self.gpu)
        self._bounce: torch.Tensor | None = None
        self._bounce_view: memoryview | None = None

    def prepare_chunks(self, chunk: int) -> None:
        if chunk > MAX_BOUNCE:
            raise PoolError(f"chunk size {chunk} over {MAX_BOUNCE} for a CUDA pool")
        if self._bounce is not None and self._bounce.numel() >= chunk:
            return
        try:
            bounce = pinned_buffer(max(chunk, 1 << 20))
        except RuntimeError as exc:
            raise PoolError(f"no pinned memory for a {chunk} B chunk: {exc}") from None
        self._bounce, self._bounce_view = bounce, bounce.numpy().data

    def chunk_buffer(self, offset: int, length: int) -> memoryview:
        assert self._bounce_view is not None  # made when the commit announced its chunks
        return self._bounce_view[:length]

    def chunk_landed(self, offset: int, length: int) -> str | None:
        assert self._bounce is not None
        dst = self.pool.backing.tensor[offset : offset + length]
        try:
            with torch.cuda.stream(self._stream):
                dst.copy_(self._bounce[:length], non_blocking=True)
            self._stream.synchronize()  # the bounce buffer takes the next chunk
        except RuntimeError as exc:
            return f"copy to the GPU failed: {exc}"
        return None

    def before_release(self) -> None:
        torch.cuda.current_stream(self.gpu).synchronize()  # work reading the slot ends


def memory_for(pool: Pool) -> Memory:
    if pool.backing.device == "cuda":
        return DeviceMemory(pool)
    return Memory(pool)
