"""Buddy allocator over byte offsets (pure: no I/O, no torch; thread-safe).

A staging pool (``pool``) is allocated once and every page is touched at start-up, because
fresh memory per message is dominated by page faults, not copies (DESIGN.md section 3).
This module hands out *slots* of that pre-faulted region and takes them back, so the same
pages are reused message after message. It only deals in offsets; the pool owns the memory.

Layout
------
``capacity`` is rounded *down* to a multiple of ``min_block`` and then covered by several
top-level power-of-two blocks, the binary decomposition of ``capacity // min_block``, largest
first at offset 0. A 3 GiB pool with 1 MiB minimum blocks::

    offset 0                                2 GiB               3 GiB
    |---------------- top block 0 ----------|--- top block 1 ---|
    |               2 GiB (order 11)        |  1 GiB (order 10) |

Each top-level block is an ordinary binary buddy tree. A block of ``size`` bytes at absolute
offset ``off`` inside the top-level block starting at ``top`` has its buddy at::

    top + ((off - top) ^ size)

e.g. splitting top block 1 (at 2 GiB) once gives two 512 MiB halves at 2 GiB and 2.5 GiB,
which are each other's buddies. Freed blocks merge with their buddy recursively, up to the
size of their own top-level block and never across top-level blocks.

Why several top-level blocks instead of one rounded up to a power of two: rounding a pool up
pins up to 2x the memory asked for (DESIGN.md section 7, "Rounding a pool up to a power of
two"). Here a 3 GiB pool gives exactly 3 GiB usable; the price is that no single allocation
can exceed the largest top-level block (``max_allocation``).

Allocation picks the smallest free block that fits, lowest address first (deterministic),
splitting it down to ``block_size_for(size)``. Errors (double free, unknown or interior
offsets, bad arguments) raise :class:`AllocatorError`; running out of room returns ``None`` so
the caller can fail the request explicitly rather than wait (DESIGN.md section 7).
"""

from __future__ import annotations

import bisect
import heapq
import threading
from dataclasses import dataclass

__all__ = ["AllocatorError", "AllocatorStats", "BuddyAllocator", "MiB"]

MiB = 1 << 20


class AllocatorError(ValueError):
    """Misuse of the allocator: double free, foreign/unknown offset, bad arguments."""


@dataclass(frozen=True)
class AllocatorStats:
    """A consistent snapshot of an allocator's state (all sizes in bytes)."""

    total: int  # usable bytes (capacity)
    used: int  # bytes in live blocks (block sizes, i.e. after rounding up)
    free: int  # total - used
    largest_free: int  # largest free block
    fragmentation: float  # 1 - largest_free / free  (0.0 when free == 0)
    allocations: int  # live allocation count
    requested: int  # sum of the sizes callers asked for (<= used)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _FreeList:
    """Offsets of free blocks of one order: a set for membership plus a lazy min-heap.

    The set is authoritative; heap entries not in the set (removed by coalescing) are
    skipped and discarded when they reach the top, and the heap is rebuilt when stale
    entries dominate, so every operation stays O(log n) amortised.
    """

    __slots__ = ("_heap", "_members")

    def __init__(self) -> None:
        self._members: set[int] = set()
        self._heap: list[int] = []

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, offset: int) -> bool:
        return offset in self._members

    def add(self, offset: int) -> None:
        self._members.add(offset)
        heapq.heappush(self._heap, offset)

    def remove(self, offset: int) -> None:
        self._members.remove(offset)
        if len(self._heap) > 2 * len(self._members) + 32:
            self._heap = sorted(self._members)  # a sorted list is a valid heap

    def pop_lowest(self) -> int:
        heap = self._heap
        while True:
            offset = heapq.heappop(heap)
            if offset in self._members:
                self._members.remove(offset)
                return offset

    def offsets(self) -> set[int]:
        return self._members

    def clear(self) -> None:
        self._members.clear()
        self._heap.clear()


class BuddyAllocator:
    """Thread-safe buddy allocator over ``[0, capacity)``; see the module docstring."""

    def __init__(self, capacity: int, min_block: int = MiB) -> None:
        if not _is_int(min_block) or min_block < 1 or min_block & (min_block - 1):
            raise AllocatorError(f"min_block must be a power of two >= 1, got {min_block!r}")
        if not _is_int(capacity) or capacity < min_block:
            raise AllocatorError(
                f"capacity must be an integer >= min_block ({min_block}), got {capacity!r}"
            )
        self._min_block = min_block
        self._min_shift = min_block.bit_length() - 1
        units = capacity // min_block
        self._capacity = units * min_block

        tops: list[tuple[int, int]] = []  # (offset, order)
        offset = 0
        for order in range(units.bit_length() - 1, -1, -1):
            if units >> order & 1:
                tops.append((offset, order))
                offset += min_block << order
        self._tops = tuple(tops)
        self._top_starts = [off for off, _ in tops]
        self._top_blocks = tuple((off, min_block << order) for off, order in tops)
        self._max_order = tops[0][1]

        self._free: dict[int, _FreeList] = {k: _FreeList() for k in range(self._max_order + 1)}
        self._live: dict[int, tuple[int, int]] = {}  # offset -> (order, requested)
        self._used = 0
        self._requested = 0
        self._lock = threading.Lock()
        self._reset_locked()

    # -- properties (immutable after construction) -------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def min_block(self) -> int:
        return self._min_block

    @property
    def top_blocks(self) -> tuple[tuple[int, int], ...]:
        """``(offset, size)`` of each top-level block, largest first."""
        return self._top_blocks

    @property
    def max_allocation(self) -> int:
        """The largest block that could ever be allocated (the largest top-level block)."""
        return self._min_block << self._max_order

    # -- helpers (callers hold the lock where state is touched) ------------------------------

    def _order_for(self, size: int) -> int:
        if not _is_int(size) or size <= 0:
            raise AllocatorError(f"allocation size must be a positive integer, got {size!r}")
        units = -(-size // self._min_block)
        return (units - 1).bit_length()

    def _top_of(self, offset: int) -> tuple[int, int]:
        """The ``(offset, order)`` of the top-level block containing ``offset``."""
        return self._tops[bisect.bisect_right(self._top_starts, offset) - 1]

    def _reset_locked(self) -> None:
        for free_list in self._free.values():
            free_list.clear()
        for off, order in self._tops:
            self._free[order].add(off)
        self._live.clear()
        self._used = 0
        self._requested = 0

    def _not_live_error(self, offset: object) -> AllocatorError:
        if not isinstance(offset, int) or isinstance(offset, bool):
            return AllocatorError(f"offset must be an integer, got {offset!r}")
        if not 0 <= offset < self._capacity:
            why = f"outside the pool [0, {self._capacity})"
        elif any(offset in fl for fl in self._free.values()):
            why = "already free (double free?)"
        elif offset % self._min_block:
            why = f"not aligned to min_block {self._min_block} (inside a block?)"
        else:
            why = "not the start of a live allocation (never allocated, or inside a block?)"
        return AllocatorError(f"offset {offset} is {why}")

    # -- public API ------------------------------------------------------------------------

    def block_size_for(self, size: int) -> int:
        """The block (power of two >= min_block) a request of ``size`` bytes would occupy."""
        return self._min_block << self._order_for(size)

    def allocate(self, size: int) -> int | None:
        """Offset of a block of ``block_size_for(size)`` bytes, or ``None`` if nothing fits.

        ``None`` also when ``size > max_allocation``; check ``max_allocation`` to fail fast.
        """
        want = self._order_for(size)
        if want > self._max_order:
            return None
        with self._lock:
            for order in range(want, self._max_order + 1):
                if self._free[order]:
                    break
            else:
                return None
            offset = self._free[order].pop_lowest()
            # Split down; the upper half of each split is the buddy and stays free. Top-level
            # block starts are aligned to the block's own size, so absolute offsets work here.
            while order > want:
                order -= 1
                self._free[order].add(offset + (self._min_block << order))
            self._live[offset] = (want, size)
            self._used += self._min_block << want
            self._requested += size
            return offset

    def free(self, offset: int) -> int:
        """Free the live allocation at ``offset``; return its block size. Coalesces fully."""
        with self._lock:
            entry = self._live.pop(offset, None) if _is_int(offset) else None
            if entry is None:
                raise self._not_live_error(offset)
            order, requested = entry
            size = self._min_block << order
            self._used -= size
            self._requested -= requested
            top_start, top_order = self._top_of(offset)
            while order < top_order:
                half = self._min_block << order
                buddy = top_start + ((offset - top_start) ^ half)
                free_list = self._free[order]
                if buddy not in free_list:
                    break
                free_list.remove(buddy)
                offset = min(offset, buddy)
                order += 1
            self._free[order].add(offset)
            return size

    def size_of(self, offset: int) -> int:
        """Block size of the live allocation at ``offset``."""
        with self._lock:
            entry = self._live.get(offset) if _is_int(offset) else None
            if entry is None:
                raise self._not_live_error(offset)
            return self._min_block << entry[0]

    def is_live(self, offset: int) -> bool:
        with self._lock:
            return _is_int(offset) and offset in self._live

    def stats(self) -> AllocatorStats:
        with self._lock:
            free = self._capacity - self._used
            largest = 0
            for order in range(self._max_order, -1, -1):
                if self._free[order]:
                    largest = self._min_block << order
                    break
            return AllocatorStats(
                total=self._capacity,
                used=self._used,
                free=free,
                largest_free=largest,
                fragmentation=(1.0 - largest / free) if free else 0.0,
                allocations=len(self._live),
                requested=self._requested,
            )

    def free_slots(self, size: int) -> int:
        """How many more requests of ``size`` bytes could succeed right now, one after another.

        Exact for a buddy allocator: each free block of order ``j >= k`` (``k`` the request's
        order) splits into ``2 ** (j - k)`` slots and blocks never merge while allocating.
        """
        want = self._order_for(size)
        if want > self._max_order:
            return 0
        with self._lock:
            return sum(
                len(self._free[order]) << (order - want)
                for order in range(want, self._max_order + 1)
            )

    def free_blocks(self) -> list[tuple[int, int]]:
        """Sorted ``(offset, size)`` of every free block (tests and diagnostics)."""
        with self._lock:
            return sorted(
                (offset, self._min_block << order)
                for order, free_list in self._free.items()
                for offset in free_list.offsets()
            )

    def reset(self) -> None:
        """Free everything (used when a pool is torn down)."""
        with self._lock:
            self._reset_locked()

    def __repr__(self) -> str:
        return (
            f"BuddyAllocator(capacity={self._capacity}, min_block={self._min_block}, "
            f"live={len(self._live)}, used={self._used})"
        )
