"""Pool tests: backings, bit-exact write/read, aliasing, cross-process shm, cleanup, errors."""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from disagg_runtime.memory.layout import plan as pool_plan
from disagg_runtime.memory.layout import read_payload, write_tensors
from disagg_runtime.memory.pool import (
    SHM_DIR,
    SHM_PREFIX,
    MiB,
    Pool,
    PoolError,
    attach_backing,
    reclaim_stale,
    shm_name,
    shm_prefix,
)
from disagg_runtime.wire.manifest import Manifest
from tests.payload_checks import assert_bit_exact, raw_bytes, tensors_of

KiB = 1 << 10
MakePool = Callable[..., Pool]


# -- helpers -------------------------------------------------------------------------------


@pytest.fixture
def make_pool() -> Iterator[MakePool]:
    """Pools made through this are closed (and shm ones unlinked) when the test ends."""
    made: list[Pool] = []

    def make(device: Any = "cpu", size: int = 4 * MiB, min_block: int = 64 * KiB) -> Pool:
        name = shm_name("pooltest", "rx") if device == "shm" else None
        pool = Pool.create(size, device=device, min_block=min_block, name=name)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def test_stats_count_payload_bytes_apart_from_the_rounding(make_pool: MakePool) -> None:
    """The scaling signal is what payloads hold, not the power-of-two blocks around them."""
    pool = make_pool("cpu", size=4 * MiB, min_block=64 * KiB)
    offset = pool.allocate(MiB + 1)
    assert offset is not None
    stats = pool.stats()
    assert (stats.requested, stats.used) == (MiB + 1, 2 * MiB)
    pool.free(offset)
    assert (pool.stats().requested, pool.stats().used) == (0, 0)


def mixed_payload() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(64, 33, generator=gen)
    return {
        "bf16": wide.to(torch.bfloat16),
        "f8": (wide * 4).to(torch.float8_e4m3fn),
        "deep": {
            "mask": torch.rand(100, generator=gen) > 0.5,
            "ids": [torch.randint(-(2**62), 2**62, (17,), generator=gen), 3, "text"],
            "z": (torch.randn(5, 3, generator=gen, dtype=torch.complex64), None, 1.5),
        },
        "scalar": torch.tensor(-2.5, dtype=torch.float64),  # 0-dim
        "empty": torch.empty(0, 4, dtype=torch.int32),  # zero-size
        "transposed": torch.arange(12, dtype=torch.int16).reshape(3, 4).t(),  # not contiguous
        "half": torch.tensor([float("nan"), float("-inf"), -0.0], dtype=torch.float16),
    }


def stage(pool: Pool, payload: Any) -> tuple[int, Manifest]:
    manifest, tensors = pool_plan(payload)
    slot = pool.allocate(manifest.nbytes)
    assert slot is not None
    write_tensors(pool.backing, slot, manifest, tensors)
    return slot, manifest


def inside(t: torch.Tensor, pool: Pool) -> bool:
    base = pool.backing.tensor.data_ptr()
    start = t.data_ptr()
    return base <= start and start + t.untyped_storage().nbytes() <= base + pool.backing.size


def shm_path(name: str | None) -> str:
    assert name is not None
    return os.path.join(SHM_DIR, name)


# -- write / read --------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "shm"])
def test_write_read_round_trip_is_bit_exact(make_pool: MakePool, device: str) -> None:
    pool = make_pool(device)
    assert pool.backing.device == device
    assert pool.stats().total == 4 * MiB
    payload = mixed_payload()
    slot, manifest = stage(pool, payload)
    assert pool.stats().used == pool.allocator.block_size_for(manifest.nbytes)
    for copy in (False, True):
        assert_bit_exact(read_payload(pool.backing, slot, manifest, copy=copy), payload)
    pool.free(slot)
    assert pool.stats().used == 0


@pytest.mark.parametrize("device", ["cpu", "shm"])
def test_several_slots_do_not_disturb_each_other(make_pool: MakePool, device: str) -> None:
    pool = make_pool(device)
    payloads = [{"x": torch.full((1000 + i,), i, dtype=torch.int64)} for i in range(5)]
    staged = [stage(pool, p) for p in payloads]
    assert len({slot for slot, _ in staged}) == 5
    for (slot, manifest), payload in zip(staged, payloads, strict=True):
        assert_bit_exact(read_payload(pool.backing, slot, manifest), payload)


@pytest.mark.parametrize("device", ["cpu", "shm"])
def test_payload_without_tensors(make_pool: MakePool, device: str) -> None:
    pool = make_pool(device)
    payload = {"a": [1, "b", None], "c": (True, 2.5)}
    slot, manifest = stage(pool, payload)
    assert manifest.nbytes == 0
    assert read_payload(pool.backing, slot, manifest) == payload


@pytest.mark.parametrize("device", ["cpu", "shm"])
def test_read_views_alias_the_pool(make_pool: MakePool, device: str) -> None:
    pool = make_pool(device)
    slot, manifest = stage(pool, mixed_payload())
    view = read_payload(pool.backing, slot, manifest)
    for t in tensors_of(view):
        if t.numel():
            assert inside(t, pool)
            assert t.data_ptr() % 64 == 0  # slot and layout alignment survive into memory

    # Write through the pool's own tensor; the view sees it (same memory, no copy).
    ids = view["deep"]["ids"][0]
    index = manifest.tensors.index(next(m for m in manifest.tensors if m.dtype == torch.int64))
    start = slot + manifest.offsets[index]
    pool.backing.tensor[start : start + 8].copy_(raw_bytes(torch.tensor([123456789])))
    assert int(ids[0]) == 123456789
    # And the other way round.
    view["bf16"][0, 0] = 42.0
    bf16_at = slot + manifest.offsets[0]
    assert torch.equal(
        pool.backing.tensor[bf16_at : bf16_at + 2], raw_bytes(torch.tensor([42.0]).bfloat16())
    )


@pytest.mark.parametrize("device", ["cpu", "shm"])
def test_copy_does_not_alias(make_pool: MakePool, device: str) -> None:
    pool = make_pool(device)
    payload = mixed_payload()
    slot, manifest = stage(pool, payload)
    copied = read_payload(pool.backing, slot, manifest, copy=True)
    for t in tensors_of(copied):
        if t.numel():
            assert not inside(t, pool)
    pool.backing.tensor[slot : slot + manifest.nbytes].fill_(0xAB)
    assert_bit_exact(copied, payload)


# -- shared memory -------------------------------------------------------------------------


def test_shm_name_is_namespaced() -> None:
    name = shm_name("my pipe/v1", "role:a")
    assert name.startswith(SHM_PREFIX)
    assert "/" not in name
    assert "my_pipe_v1-role_a" in name
    assert f"-{os.getpid()}-" in name
    assert shm_name("p", "r") != shm_name("p", "r")


def test_shm_pool_lives_in_dev_shm_until_closed(make_pool: MakePool) -> None:
    pool = make_pool("shm", size=2 * MiB)
    assert pool.name is not None
    assert pool.name.startswith(f"{SHM_PREFIX}pooltest-rx-{os.getpid()}-")
    path = shm_path(pool.name)
    assert os.path.exists(path)
    assert os.stat(path).st_size == 2 * MiB
    pool.close()
    assert not os.path.exists(path)
    pool.close()  # idempotent


def test_anonymous_shm_pool_is_prefixed_and_unlinked() -> None:
    pool = Pool.create(MiB, device="shm")
    try:
        assert pool.name is not None
        assert pool.name.startswith(SHM_PREFIX)
        assert os.path.exists(shm_path(pool.name))
    finally:
        pool.close()
    assert not os.path.exists(shm_path(pool.name))


def test_close_with_live_views_does_not_raise_and_unlinks(make_pool: MakePool) -> None:
    pool = make_pool("shm")
    payload = mixed_payload()
    slot, manifest = stage(pool, payload)
    view = read_payload(pool.backing, slot, manifest)
    raw = pool.backing.buffer(slot, 16)
    pool.close()
    assert not os.path.exists(shm_path(pool.name))
    assert pool.backing.closed
    # The views keep their pages: still readable, still the same bytes.
    assert_bit_exact(view, payload)
    assert len(raw) == 16


def test_cpu_pool_has_no_name_and_no_shm_file(make_pool: MakePool) -> None:
    before = {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    pool = make_pool("cpu")
    assert pool.name is None
    after = {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    assert after == before


def test_attach_in_process_shares_memory_and_does_not_unlink(make_pool: MakePool) -> None:
    pool = make_pool("shm", size=MiB)
    assert pool.name is not None
    peer = attach_backing(pool.name)
    try:
        assert peer.size == MiB
        assert peer.device == "shm"
        pool.backing.tensor[100:104].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
        assert peer.tensor[100:104].tolist() == [1, 2, 3, 4]
        peer.tensor[200] = 77
        assert int(pool.backing.tensor[200]) == 77
    finally:
        peer.close()
    assert os.path.exists(shm_path(pool.name))  # only the owner unlinks


def _child_attach(name: str, offset: int, length: int, conn: Connection) -> None:
    """Runs in a spawned process: read what the parent wrote, write an answer back."""
    try:
        from disagg_runtime.memory.pool import attach_backing as attach

        backing = attach(name)
        seen = bytes(backing.buffer(offset, length))
        answer = torch.arange(length, dtype=torch.uint8).flip(0)
        backing.tensor[offset + length : offset + 2 * length].copy_(answer)
        conn.send(("ok", seen, backing.size))
        backing.close()
    except BaseException as exc:  # report anything to the parent instead of hanging it
        conn.send(("error", repr(exc), 0))
    finally:
        conn.close()


def test_shm_pool_is_attachable_from_another_process(make_pool: MakePool) -> None:
    pool = make_pool("shm", size=2 * MiB)
    assert pool.name is not None
    offset, length = MiB + 4096, 4096
    pattern = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator())
    pool.backing.tensor[offset : offset + length].copy_(pattern)

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_attach, args=(pool.name, offset, length, child))
    proc.start()
    child.close()
    try:
        assert parent.poll(120), "child did not answer"
        status, seen, size = parent.recv()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    assert status == "ok", seen
    assert size == 2 * MiB
    assert seen == bytes(pattern.tolist())
    back = pool.backing.tensor[offset + length : offset + 2 * length]
    assert torch.equal(back, torch.arange(length, dtype=torch.uint8).flip(0))
    assert proc.exitcode == 0
    assert os.path.exists(shm_path(pool.name))  # the child's close did not unlink


@pytest.mark.parametrize(
    "name",
    [
        "disagg-does-not-exist-0-0",
        "not-ours",
        "psm_12345",
        "disagg-../etc/passwd",
        "disagg-a/b",
        "",
    ],
)
def test_attach_refuses_missing_or_foreign_names(name: str) -> None:
    with pytest.raises(PoolError):
        attach_backing(name)


# -- ownership: a dead owner's segment is reclaimed, a live owner's is not -------------------

# A real process that owns a pool under a given name until it is killed.
_OWNER = """
import sys, time
from disagg_runtime.memory.pool import MiB, Pool
pool = Pool.create(MiB, device="shm", name=sys.argv[1])
pool.backing.tensor[:4].fill_(0xEE)
print("ready", flush=True)
time.sleep(600)
"""
_names = itertools.count()


def our_name(tag: str) -> str:
    """A segment name ending in this process's pid (the suite's leak check judges it)."""
    return f"{shm_prefix('pooltest', tag)}{os.getpid()}-{next(_names)}"


@pytest.fixture
def owner() -> Iterator[Callable[[str], subprocess.Popen[str]]]:
    """Start owner processes of named pools; every one is killed and its pool unlinked."""
    started: list[tuple[subprocess.Popen[str], str]] = []

    def start(name: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _OWNER, name], stdout=subprocess.PIPE, text=True
        )
        started.append((proc, name))
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", f"owner of {name} did not start"
        return proc

    yield start
    for proc, name in started:
        proc.kill()
        proc.wait(timeout=30)
        if os.path.exists(shm_path(name)):
            reclaim_stale(name.rpartition("-")[0] + "-", why=None)


def test_dead_owners_segment_with_the_same_name_is_reclaimed(
    owner: Callable[[str], subprocess.Popen[str]], caplog: pytest.LogCaptureFixture
) -> None:
    """What a role restarted as PID 1 meets: its own name, left by its killed incarnation."""
    name = our_name("stale")
    proc = owner(name)
    stale = os.stat(shm_path(name)).st_ino
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert os.path.exists(shm_path(name))  # SIGKILL leaves it behind
    with caplog.at_level(logging.WARNING, logger="disagg_runtime.memory.pool"):
        pool = Pool.create(MiB, device="shm", name=name)
    try:
        assert os.stat(shm_path(name)).st_ino != stale  # a fresh segment, not the old pages
        assert pool.backing.tensor[:4].tolist() == [0, 0, 0, 0]
        assert f"reclaimed shared-memory pool {name}" in caplog.text
    finally:
        pool.close()
    assert not os.path.exists(shm_path(name))


def test_live_owners_segment_is_refused_naming_the_owner(
    owner: Callable[[str], subprocess.Popen[str]],
) -> None:
    name = our_name("live")
    proc = owner(name)
    inode = os.stat(shm_path(name)).st_ino
    with pytest.raises(PoolError, match=rf"{name}.*owner is alive: pid {proc.pid} \(.*python"):
        Pool.create(MiB, device="shm", name=name)
    assert os.stat(shm_path(name)).st_ino == inode  # untouched
    assert reclaim_stale(shm_prefix("pooltest", "live")) == {}  # a sweep leaves it too
    peer = attach_backing(name)  # and the owner's memory is as it wrote it
    try:
        assert peer.tensor[:4].tolist() == [0xEE] * 4
    finally:
        peer.close()


def test_reclaim_stale_takes_only_dead_owners_segments_of_the_prefix(
    owner: Callable[[str], subprocess.Popen[str]],
) -> None:
    prefix = shm_prefix("pooltest", f"sweep{os.getpid()}")
    dead_name, live_name = f"{prefix}111-0", f"{prefix}222-0"
    dead = owner(dead_name)
    owner(live_name)
    other = our_name(f"sweep{os.getpid()}-x")  # same start, not this prefix + digits
    dead.kill()
    dead.wait(timeout=30)
    keep = Pool.create(MiB, device="shm", name=other)
    try:
        removed = reclaim_stale(prefix, why=None)
        assert removed == {dead_name: MiB}
        assert not os.path.exists(shm_path(dead_name))
        assert os.path.exists(shm_path(live_name))
        assert os.path.exists(shm_path(other))
    finally:
        keep.close()
    with pytest.raises(PoolError, match="not a disagg shared-memory prefix"):
        reclaim_stale("../etc/")


def test_closing_a_pool_unlinks_before_releasing_ownership(make_pool: MakePool) -> None:
    pool = make_pool("shm", size=MiB)
    assert pool.name is not None
    with pytest.raises(PoolError, match="owner is alive"):  # this very process owns it
        Pool.create(MiB, device="shm", name=pool.name)
    pool.close()
    again = Pool.create(MiB, device="shm", name=pool.name)  # free now, no reclaim needed
    again.close()
    assert not os.path.exists(shm_path(pool.name))


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu-pinned", "cuda"])
def test_cuda_devices_need_cuda(device: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(PoolError, match="CUDA"):
        Pool.create(MiB, device=device)


@pytest.mark.parametrize("device", ["cpu", "shm"])
def test_size_below_min_block_is_refused(device: Any) -> None:
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(PoolError, match="minimum block"):
        Pool.create(MiB - 1, device=device, min_block=MiB)
    assert set(os.listdir(SHM_DIR)) <= before  # nothing created on the way


@pytest.mark.parametrize("device", ["gpu", "CPU", "", None, 3])
def test_unknown_device_is_refused(device: Any) -> None:
    with pytest.raises(PoolError, match="unknown pool device"):
        Pool.create(MiB, device=device)


def test_bad_min_block_is_a_pool_error_and_leaks_nothing() -> None:
    name = shm_name("pooltest", "badblock")
    path = shm_path(name)
    try:
        with pytest.raises(PoolError):
            Pool.create(4 * MiB, device="shm", min_block=3000, name=name)
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):  # keep the suite's leak guard meaningful for other tests
            os.unlink(path)


def test_allocate_zero_bytes_still_gets_a_slot(make_pool: MakePool) -> None:
    pool = make_pool("cpu", size=MiB, min_block=64 * KiB)
    slot = pool.allocate(0)
    assert slot is not None
    assert pool.stats().used == 64 * KiB
    pool.free(slot)
    assert pool.stats().used == 0


def test_stats_track_occupancy(make_pool: MakePool) -> None:
    pool = make_pool("cpu", size=4 * MiB, min_block=MiB)
    first = pool.allocate(3 * MiB)  # a 4 MiB block: the whole pool
    assert first is not None
    s = pool.stats()
    assert (s.total, s.used, s.largest_free, s.occupancy) == (4 * MiB, 4 * MiB, 0, 1.0)
    assert pool.allocate(1) is None
    pool.free(first)
    assert pool.stats().occupancy == 0.0
    assert pool.stats().largest_free == 4 * MiB
