"""Buddy allocator tests: exact layouts, errors, free-slot estimates, threads, properties."""

from __future__ import annotations

import random
import sys
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from disagg_runtime.memory.allocator import AllocatorError, AllocatorStats, BuddyAllocator, MiB

GiB = 1 << 30


# -- helpers -------------------------------------------------------------------------------


def brute_free_slots(free_blocks: list[tuple[int, int]], need: int) -> int:
    """Count successive allocations of ``need``-byte blocks by simulating greedy splitting."""
    sizes = [size for _, size in free_blocks]
    count = 0
    while True:
        fitting = [s for s in sizes if s >= need]
        if not fitting:
            return count
        block = min(fitting)
        sizes.remove(block)
        while block > need:
            block //= 2
            sizes.append(block)
        count += 1


def assert_tiles(alloc: BuddyAllocator, live: dict[int, int]) -> None:
    """Free blocks plus live blocks cover [0, capacity) exactly, with no overlap."""
    spans = sorted([*alloc.free_blocks(), *live.items()])
    cursor = 0
    for offset, size in spans:
        assert offset == cursor, f"gap or overlap at {offset} (expected {cursor})"
        assert size > 0 and size & (size - 1) == 0
        assert offset % size == 0  # top-level starts are aligned to their own size
        cursor = offset + size
    assert cursor == alloc.capacity


def take(alloc: BuddyAllocator, size: int) -> int:
    offset = alloc.allocate(size)
    assert offset is not None
    return offset


def drain(alloc: BuddyAllocator, size: int) -> list[int]:
    got: list[int] = []
    while (offset := alloc.allocate(size)) is not None:
        got.append(offset)
    return got


# -- construction --------------------------------------------------------------------------


def test_three_gib_pool_is_not_rounded_up() -> None:
    alloc = BuddyAllocator(3 * GiB, MiB)
    assert alloc.capacity == 3 * GiB
    assert alloc.min_block == MiB
    assert alloc.top_blocks == ((0, 2 * GiB), (2 * GiB, GiB))
    assert alloc.max_allocation == 2 * GiB
    assert alloc.free_blocks() == [(0, 2 * GiB), (2 * GiB, GiB)]
    stats = alloc.stats()
    assert stats.total == stats.free == 3 * GiB
    assert stats.largest_free == 2 * GiB


def test_non_multiple_capacity_rounds_down() -> None:
    alloc = BuddyAllocator(7 * MiB + 12345, MiB)
    assert alloc.capacity == 7 * MiB
    assert alloc.top_blocks == ((0, 4 * MiB), (4 * MiB, 2 * MiB), (6 * MiB, MiB))
    assert alloc.max_allocation == 4 * MiB


def test_default_min_block_is_one_mib() -> None:
    assert BuddyAllocator(4 * MiB).min_block == MiB


def test_large_pool_has_no_per_block_structures() -> None:
    alloc = BuddyAllocator(64 * GiB, MiB)
    assert alloc.free_blocks() == [(0, 64 * GiB)]
    assert alloc.free_slots(MiB) == 65536


@pytest.mark.parametrize("min_block", [0, -1, 3, 6, 1000, 1.0, True])
def test_bad_min_block(min_block: object) -> None:
    with pytest.raises(AllocatorError, match="min_block"):
        BuddyAllocator(64 * MiB, min_block)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [0, -1, MiB - 1, 4.0 * MiB])
def test_bad_capacity(capacity: object) -> None:
    with pytest.raises(AllocatorError, match="capacity"):
        BuddyAllocator(capacity, MiB)  # type: ignore[arg-type]


def test_capacity_equal_to_min_block() -> None:
    alloc = BuddyAllocator(4096, 4096)
    assert alloc.top_blocks == ((0, 4096),)
    assert alloc.allocate(1) == 0
    assert alloc.allocate(1) is None


# -- sizes and offsets ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "block"),
    [(1, MiB), (MiB, MiB), (MiB + 1, 2 * MiB), (3 * MiB, 4 * MiB), (4 * MiB, 4 * MiB)],
)
def test_block_size_for(size: int, block: int) -> None:
    assert BuddyAllocator(8 * MiB).block_size_for(size) == block


@pytest.mark.parametrize("size", [0, -5, 1.5, True])
def test_block_size_for_bad_size(size: object) -> None:
    alloc = BuddyAllocator(8 * MiB)
    with pytest.raises(AllocatorError):
        alloc.block_size_for(size)  # type: ignore[arg-type]
    with pytest.raises(AllocatorError):
        alloc.allocate(size)  # type: ignore[arg-type]
    with pytest.raises(AllocatorError):
        alloc.free_slots(size)  # type: ignore[arg-type]


def test_exact_offsets_and_coalescing() -> None:
    alloc = BuddyAllocator(8 * MiB)
    a = take(alloc, MiB)
    b = take(alloc, 2 * MiB)
    c = take(alloc, 1)
    d = take(alloc, MiB)
    assert (a, b, c, d) == (0, 2 * MiB, MiB, 4 * MiB)
    assert alloc.free_blocks() == [(5 * MiB, MiB), (6 * MiB, 2 * MiB)]
    assert alloc.size_of(b) == 2 * MiB
    # Freeing b cannot merge (its buddy 0..2 MiB is split and in use).
    assert alloc.free(b) == 2 * MiB
    assert alloc.free_blocks() == [(2 * MiB, 2 * MiB), (5 * MiB, MiB), (6 * MiB, 2 * MiB)]
    # Smallest fitting block first, lowest address among equals: 1 MiB goes to 5 MiB.
    assert alloc.allocate(MiB) == 5 * MiB
    assert alloc.free(5 * MiB) == MiB
    assert alloc.free(d) == MiB  # 4..5 + 5..6 -> 4..6, + 6..8 -> 4..8
    assert alloc.free_blocks() == [(2 * MiB, 2 * MiB), (4 * MiB, 4 * MiB)]
    assert alloc.free(a) == MiB
    assert alloc.free(c) == MiB  # 0..1 + 1..2 -> 0..2, + 2..4 -> 0..4, + 4..8 -> 0..8
    assert alloc.free_blocks() == [(0, 8 * MiB)]
    assert alloc.stats().allocations == 0


def test_no_coalescing_across_top_blocks() -> None:
    alloc = BuddyAllocator(3 * MiB)  # tops: (0, 2 MiB), (2 MiB, 1 MiB)
    assert alloc.allocate(MiB) == 2 * MiB  # the smallest fitting block is the 1 MiB top
    assert alloc.allocate(MiB) == 0
    assert alloc.allocate(MiB) == MiB
    assert alloc.allocate(1) is None
    for offset in (MiB, 2 * MiB, 0):
        alloc.free(offset)
    assert alloc.free_blocks() == [(0, 2 * MiB), (2 * MiB, MiB)]


def test_buddy_relative_to_top_block_start() -> None:
    # tops: (0, 4), (4, 2), (6, 1) in units of 1 KiB: buddies in the second top are 4 and 5.
    k = 1024
    alloc = BuddyAllocator(7 * k, k)
    offsets = drain(alloc, k)
    assert sorted(offsets) == [i * k for i in range(7)]
    alloc.free(5 * k)
    alloc.free(4 * k)
    assert (4 * k, 2 * k) in alloc.free_blocks()
    alloc.free(6 * k)
    assert alloc.free_blocks() == [(4 * k, 2 * k), (6 * k, k)]


def test_larger_than_max_allocation_returns_none() -> None:
    alloc = BuddyAllocator(3 * GiB)
    assert alloc.allocate(2 * GiB + 1) is None
    assert alloc.free_slots(2 * GiB + 1) == 0
    assert alloc.allocate(2 * GiB) == 0
    assert alloc.allocate(GiB) == 2 * GiB


def test_exhaust_then_free_allows_again() -> None:
    alloc = BuddyAllocator(8 * MiB)
    offsets = drain(alloc, 2 * MiB)
    assert offsets == [0, 2 * MiB, 4 * MiB, 6 * MiB]
    assert alloc.allocate(1) is None
    stats = alloc.stats()
    assert stats.free == 0 and stats.largest_free == 0 and stats.fragmentation == 0.0
    alloc.free(4 * MiB)
    assert alloc.allocate(MiB) == 4 * MiB
    assert alloc.allocate(MiB) == 5 * MiB
    assert alloc.allocate(MiB) is None


def test_reset_frees_everything() -> None:
    alloc = BuddyAllocator(5 * MiB)
    drain(alloc, MiB)
    alloc.reset()
    assert alloc.free_blocks() == list(alloc.top_blocks)
    stats = alloc.stats()
    assert stats == AllocatorStats(5 * MiB, 0, 5 * MiB, 4 * MiB, stats.fragmentation, 0, 0)
    assert stats.fragmentation == pytest.approx(0.2)
    assert not alloc.is_live(0)
    assert alloc.allocate(4 * MiB) == 0


# -- errors --------------------------------------------------------------------------------


def test_double_free() -> None:
    alloc = BuddyAllocator(8 * MiB)
    offset = alloc.allocate(MiB)
    assert offset is not None
    alloc.free(offset)
    with pytest.raises(AllocatorError, match=f"offset {offset}"):
        alloc.free(offset)


def test_double_free_of_split_block() -> None:
    alloc = BuddyAllocator(8 * MiB)
    alloc.allocate(MiB)
    b = alloc.allocate(MiB)
    assert b == MiB
    alloc.free(b)  # stays a free 1 MiB block (buddy 0 is live)
    with pytest.raises(AllocatorError, match="already free"):
        alloc.free(b)


@pytest.mark.parametrize("offset", [0, 3 * MiB, 100 * MiB, -MiB, 12345])
def test_foreign_offset(offset: int) -> None:
    alloc = BuddyAllocator(8 * MiB)
    alloc.allocate(MiB)  # at 0
    if offset == 0:
        alloc.free(0)
    with pytest.raises(AllocatorError, match=f"offset {offset}"):
        alloc.free(offset)
    with pytest.raises(AllocatorError, match=f"offset {offset}"):
        alloc.size_of(offset)
    assert not alloc.is_live(offset)


def test_offset_inside_live_block() -> None:
    alloc = BuddyAllocator(8 * MiB)
    offset = alloc.allocate(4 * MiB)
    assert offset == 0
    for inside in (MiB, 2 * MiB, 4096):
        with pytest.raises(AllocatorError, match=f"offset {inside}"):
            alloc.free(inside)
    assert alloc.is_live(0)
    assert alloc.free(0) == 4 * MiB


def test_non_integer_offset() -> None:
    alloc = BuddyAllocator(8 * MiB)
    with pytest.raises(AllocatorError):
        alloc.free("0")  # type: ignore[arg-type]
    with pytest.raises(AllocatorError):
        alloc.size_of(0.0)  # type: ignore[arg-type]
    assert not alloc.is_live(None)  # type: ignore[arg-type]


# -- free slots and stats ------------------------------------------------------------------


def test_free_slots_empty_pool() -> None:
    alloc = BuddyAllocator(8 * MiB)
    assert alloc.free_slots(MiB) == 8
    assert alloc.free_slots(1) == 8
    assert alloc.free_slots(3 * MiB) == 2
    assert alloc.free_slots(8 * MiB) == 1
    assert alloc.free_slots(9 * MiB) == 0


@pytest.mark.parametrize("size", [1, MiB, MiB + 1, 3 * MiB, 4 * MiB, 5 * MiB])
def test_free_slots_matches_successive_allocations(size: int) -> None:
    rng = random.Random(size)
    alloc = BuddyAllocator(13 * MiB + 7)
    live = drain(alloc, MiB)
    for offset in rng.sample(live, 7):
        alloc.free(offset)
    expected = alloc.free_slots(size)
    assert expected == brute_free_slots(alloc.free_blocks(), alloc.block_size_for(size))
    assert len(drain(alloc, size)) == expected
    assert alloc.free_slots(size) == 0


def test_stats_add_up() -> None:
    alloc = BuddyAllocator(16 * MiB)
    a = alloc.allocate(100)
    alloc.allocate(3 * MiB)
    alloc.allocate(MiB + 1)
    assert a == 0
    stats = alloc.stats()
    assert stats.total == 16 * MiB
    assert stats.used == MiB + 4 * MiB + 2 * MiB
    assert stats.used + stats.free == stats.total
    assert stats.requested == 100 + 3 * MiB + MiB + 1 <= stats.used
    assert stats.allocations == 3
    assert stats.largest_free == 8 * MiB
    assert stats.fragmentation == pytest.approx(1 - 8 / 9)
    assert 0.0 <= stats.fragmentation <= 1.0
    alloc.free(a)
    assert alloc.stats().requested == 3 * MiB + MiB + 1


# -- concurrency ---------------------------------------------------------------------------


def test_concurrent_allocate_free() -> None:
    alloc = BuddyAllocator(64 * MiB + 3 * 64 * 1024, 64 * 1024)
    n_threads, n_ops = 8, 1500
    kept: list[list[tuple[int, int]]] = [[] for _ in range(n_threads)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def worker(index: int) -> None:
        try:
            rng = random.Random(index)
            mine: list[tuple[int, int]] = []
            barrier.wait()
            for _ in range(n_ops):
                if mine and rng.random() < 0.45:
                    offset, size = mine.pop(rng.randrange(len(mine)))
                    assert alloc.free(offset) == size
                else:
                    request = rng.randint(1, 4 * MiB)
                    got = alloc.allocate(request)
                    if got is not None:
                        mine.append((got, alloc.block_size_for(request)))
            kept[index] = mine
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # force frequent thread switches inside allocator calls
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors

    live = {offset: size for mine in kept for offset, size in mine}
    assert len(live) == sum(len(mine) for mine in kept)  # no offset handed out twice
    assert_tiles(alloc, live)
    stats = alloc.stats()
    assert stats.allocations == len(live)
    assert stats.used == sum(live.values())

    for offset in live:
        alloc.free(offset)
    assert alloc.free_blocks() == list(alloc.top_blocks)
    assert alloc.stats().used == 0


# -- property test -------------------------------------------------------------------------


class BuddyMachine(RuleBasedStateMachine):
    alloc: BuddyAllocator
    live: dict[int, tuple[int, int]]  # offset -> (block size, requested)

    @initialize(
        min_shift=st.integers(0, 12),
        units=st.integers(1, 100),
        extra=st.integers(0, 4095),
    )
    def setup(self, min_shift: int, units: int, extra: int) -> None:
        min_block = 1 << min_shift
        capacity = units * min_block + extra % min_block
        self.alloc = BuddyAllocator(capacity, min_block)
        assert self.alloc.capacity == units * min_block
        assert sum(size for _, size in self.alloc.top_blocks) == self.alloc.capacity
        self.live = {}

    def _size(self, fraction: float) -> int:
        # Sizes from 1 byte up to a bit past max_allocation.
        return max(1, int(fraction * self.alloc.max_allocation * 1.1))

    @rule(fraction=st.floats(0.0, 1.0))
    def allocate(self, fraction: float) -> None:
        size = self._size(fraction)
        block = self.alloc.block_size_for(size)
        fitting_before = [b for b in self.alloc.free_blocks() if b[1] >= block]
        offset = self.alloc.allocate(size)
        if offset is None:
            assert not fitting_before
            return
        assert fitting_before
        smallest = min(s for _, s in fitting_before)
        lowest = min(o for o, s in fitting_before if s == smallest)
        assert offset == lowest  # deterministic: smallest fitting block, lowest address
        assert offset not in self.live
        assert offset >= 0 and offset + block <= self.alloc.capacity
        for other, (other_size, _) in self.live.items():
            assert offset + block <= other or other + other_size <= offset
        self.live[offset] = (block, size)
        assert self.alloc.size_of(offset) == block
        assert self.alloc.is_live(offset)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        block, _ = self.live.pop(offset)
        assert self.alloc.free(offset) == block
        assert not self.alloc.is_live(offset)

    @rule(offset=st.integers(-(1 << 14), 1 << 20))
    def bad_free(self, offset: int) -> None:
        if offset in self.live:
            return
        with pytest.raises(AllocatorError, match=f"offset {offset}"):
            self.alloc.free(offset)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free_inside_block(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        block, _ = self.live[offset]
        if block == 1:
            return
        inside = offset + data.draw(st.integers(1, block - 1))
        with pytest.raises(AllocatorError):
            self.alloc.free(inside)

    @rule(fraction=st.floats(0.0, 1.0))
    def free_slots_brute_force(self, fraction: float) -> None:
        size = self._size(fraction)
        copy = list(self.alloc.free_blocks())
        expected = brute_free_slots(copy, self.alloc.block_size_for(size))
        if size > self.alloc.max_allocation:
            assert expected == 0
        assert self.alloc.free_slots(size) == expected

    @rule(fraction=st.floats(0.0, 1.0))
    def drain_and_restore(self, fraction: float) -> None:
        size = self._size(fraction)
        before = self.alloc.free_blocks()
        expected = self.alloc.free_slots(size)
        got = drain(self.alloc, size)
        assert len(got) == expected
        for offset in got:
            self.alloc.free(offset)
        assert self.alloc.free_blocks() == before  # coalescing restores the canonical state

    @rule()
    def free_all(self) -> None:
        for offset in list(self.live):
            self.alloc.free(offset)
        self.live.clear()
        assert self.alloc.free_blocks() == list(self.alloc.top_blocks)

    @rule()
    def reset(self) -> None:
        self.alloc.reset()
        self.live.clear()
        assert self.alloc.free_blocks() == list(self.alloc.top_blocks)

    @invariant()
    def accounting(self) -> None:
        stats = self.alloc.stats()
        assert stats.total == self.alloc.capacity
        assert stats.used + stats.free == stats.total
        assert stats.used == sum(block for block, _ in self.live.values())
        assert stats.requested == sum(req for _, req in self.live.values())
        assert stats.requested <= stats.used
        assert stats.allocations == len(self.live)
        free_sizes = [size for _, size in self.alloc.free_blocks()]
        assert sum(free_sizes) == stats.free
        assert stats.largest_free == max(free_sizes, default=0)
        assert 0.0 <= stats.fragmentation <= 1.0

    @invariant()
    def tiling(self) -> None:
        assert_tiles(self.alloc, {o: b for o, (b, _) in self.live.items()})

    def teardown(self) -> None:
        if hasattr(self, "alloc"):
            self.free_all()


BuddyMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBuddyMachine = BuddyMachine.TestCase
