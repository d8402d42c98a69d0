"""CUDA and pinned pools in one process: placement, bit-exact copies of every dtype, copies
ordered after the producer's stream without blocking it, pinned H2D/D2H bandwidth."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from disagg_runtime.memory.copies import new_event, new_stream, to_device
from disagg_runtime.memory.layout import plan, read_payload, write_tensors
from disagg_runtime.memory.pool import MiB, Pool, shm_name
from tests.gpu import gpu_peer as peer

pytestmark = pytest.mark.gpu
MakePool = Callable[..., Pool]
SLEEP_CYCLES = 400_000_000  # torch.cuda._sleep: about 0.2 s at 2 GHz


def report(name: str, **figures: Any) -> None:
    """Print a measurement, and append it to $DISAGG_GPU_REPORT (a JSON-lines file) if set."""
    line = json.dumps({"check": name, **figures})
    print(line)
    path = os.environ.get("DISAGG_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


@pytest.fixture
def make_pool() -> Iterator[MakePool]:
    made: list[Pool] = []

    def make(device: Any, size: int = 64 * MiB, min_block: int = MiB) -> Pool:
        name = shm_name("gputest", "pool") if device in ("shm", "cpu-pinned") else None
        pool = Pool.create(size, device=device, min_block=min_block, name=name)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def inside(t: torch.Tensor, pool: Pool) -> bool:
    base = pool.backing.tensor.data_ptr()
    start = t.data_ptr()
    return base <= start and start + t.numel() * t.element_size() <= base + pool.backing.size


def stage(pool: Pool, payload: Any) -> tuple[int, Any]:
    manifest, tensors = plan(payload)
    slot = pool.allocate(manifest.nbytes)
    assert slot is not None
    write_tensors(pool.backing, slot, manifest, tensors).wait()
    return slot, manifest


@pytest.mark.parametrize("source", ["cuda", "cpu"])
def test_cuda_pool_round_trips_every_dtype_as_views(make_pool: MakePool, source: str) -> None:
    pool = make_pool("cuda")
    assert pool.name is None and pool.backing.tensor.is_cuda
    payload = peer.make_payload(3, source, big=3 * MiB + 5)
    slot, manifest = stage(pool, payload)
    got = read_payload(pool.backing, slot, manifest)
    assert peer.mismatch(got, peer.make_payload(3, "cpu", big=3 * MiB + 5)) == ""
    assert got["big"].is_cuda and inside(got["big"], pool) and inside(got["strided"], pool)
    copied = read_payload(pool.backing, slot, manifest, copy=True)
    assert not inside(copied["big"], pool)
    on_host = read_payload(pool.backing, slot, manifest, device="cpu")
    assert on_host["bf16"].device.type == "cpu"
    assert peer.mismatch(on_host, peer.make_payload(3, "cpu", big=3 * MiB + 5)) == ""


def test_pinned_pool_is_shared_page_locked_and_round_trips(make_pool: MakePool) -> None:
    pool = make_pool("cpu-pinned")
    assert pool.name is not None and pool.name.startswith("disagg-gputest")
    assert os.path.exists(f"/dev/shm/{pool.name}")
    assert pool.backing.pinned and pool.backing.tensor.is_pinned()
    payload = peer.make_payload(4, "cuda", big=MiB)
    slot, manifest = stage(pool, payload)
    views = read_payload(pool.backing, slot, manifest)
    assert views["big"].device.type == "cpu" and inside(views["big"], pool)
    on_gpu = read_payload(pool.backing, slot, manifest, device="cuda")
    assert on_gpu["big"].is_cuda and on_gpu["e4m3"].dtype == torch.float8_e4m3fn
    assert peer.mismatch(on_gpu, peer.make_payload(4, "cpu", big=MiB)) == ""
    name = pool.name
    pool.close()
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("device", ["cuda", "cpu-pinned"])
def test_copies_wait_for_the_producers_stream(make_pool: MakePool, device: str) -> None:
    """The producer's last kernel is still running when write_tensors returns: the copy
    must see its result, and the host must not have waited for it."""
    pool = make_pool(device)
    x = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(7)  # queued behind the sleep on the producer's (current) stream
    manifest, tensors = plan({"x": x})
    slot = pool.allocate(manifest.nbytes)
    assert slot is not None
    started = time.perf_counter()
    fence = write_tensors(pool.backing, slot, manifest, tensors)
    returned_after = time.perf_counter() - started
    assert not fence.done()
    fence.wait()
    got = read_payload(pool.backing, slot, manifest)["x"]
    assert bool((got == 7).all())
    assert returned_after < 0.1, f"write_tensors blocked the host for {returned_after:.3f} s"


def test_copies_never_make_the_producer_wait(make_pool: MakePool) -> None:
    """A copy stuck behind other work on its copy stream does not hold up new work on the
    producer's stream."""
    pool = make_pool("cuda")
    copy = new_stream(torch.device("cuda", torch.cuda.current_device()))
    with torch.cuda.stream(copy):
        torch.cuda._sleep(SLEEP_CYCLES)  # keep the copy stream busy
    x = torch.ones(MiB, dtype=torch.uint8, device="cuda")
    manifest, tensors = plan({"x": x})
    slot = pool.allocate(manifest.nbytes)
    assert slot is not None
    fence = write_tensors(pool.backing, slot, manifest, tensors, stream=copy)
    y = torch.zeros(MiB, dtype=torch.uint8, device="cuda").add_(3)  # the producer goes on
    marker = new_event()
    marker.record()  # on the producer's (current) stream, after its new work
    marker.synchronize()
    assert int(y[0]) == 3
    assert not fence.done(), "the producer's stream waited for the copy"
    fence.wait()


def test_source_memory_is_not_reused_while_the_copy_reads_it(make_pool: MakePool) -> None:
    """The producer drops its tensor right after write_tensors: record_stream keeps the
    caching allocator from handing its memory out before the copy stream read it."""
    pool = make_pool("cuda")
    copy = new_stream(torch.device("cuda", torch.cuda.current_device()))
    with torch.cuda.stream(copy):
        torch.cuda._sleep(SLEEP_CYCLES)
    x = torch.full((4 * MiB,), 5, dtype=torch.uint8, device="cuda")
    manifest, tensors = plan({"x": x})
    slot = pool.allocate(manifest.nbytes)
    assert slot is not None
    fence = write_tensors(pool.backing, slot, manifest, tensors, stream=copy)
    del x, tensors
    y = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")  # same size: would reuse x
    y.fill_(9)
    fence.wait()
    assert bool((read_payload(pool.backing, slot, manifest)["x"] == 5).all())


def test_pinned_host_to_device_and_device_to_host_bandwidth(make_pool: MakePool) -> None:
    size, repeats = 256 * MiB, 7
    pool = make_pool("cpu-pinned", size=512 * MiB)
    x = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    manifest, tensors = plan({"x": x})
    slot = pool.allocate(manifest.nbytes)
    assert slot is not None
    d2h, h2d = [], []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        write_tensors(pool.backing, slot, manifest, tensors).wait()
        d2h.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        back = read_payload(pool.backing, slot, manifest, device="cuda")
        h2d.append(time.perf_counter() - t0)
    assert torch.equal(back["x"], x)
    d2h_gbps = size / sorted(d2h[1:])[repeats // 2] / 1e9
    h2d_gbps = size / sorted(h2d[1:])[repeats // 2] / 1e9
    report("pinned_bandwidth", size=size, d2h_gbps=round(d2h_gbps, 2), h2d_gbps=round(h2d_gbps, 2))
    assert d2h_gbps > 3 and h2d_gbps > 3  # pageable copies reach a few GB/s; DMA far more


def test_to_device_orders_before_the_consumer() -> None:
    host: dict[str, Any] = {
        "a": torch.arange(1 << 20, dtype=torch.int32).pin_memory(),
        "b": [torch.ones(3)],
    }
    moved = to_device(host, "cuda")
    assert moved["a"].is_cuda and moved["b"][0].is_cuda
    assert int(moved["a"].sum().item()) == int(host["a"].sum().item())
    same = {"g": moved["a"]}
    assert to_device(same, "cuda")["g"] is moved["a"]


def test_closing_a_cuda_pool_returns_its_memory() -> None:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    pool = Pool.create(64 * MiB, device="cuda")
    assert torch.cuda.memory_allocated() >= before + 64 * MiB
    pool.close()
    assert torch.cuda.memory_allocated() == before
