"""`disagg bench ranks`: what a replica of several ranks costs per request (issue 33).

Two measurements, in one run, at each size (default 4 KiB, 16 MiB, 64 MiB):

- feed: rank 0 hands one request's input (a tensor in its shared pool) to rank 1 through
  the rank feed (role/rankfeed.py), until rank 1 holds it and says so (a one-element
  all-reduce, the same in every row): `notice` sends no tensor (the floor: the notice and
  the acknowledgement), `shm` the pool offset (rank 1 reads rank 0's pool through its
  read-only mapping; nothing is copied), `private` the same for a handler that writes its
  inputs (`writes_inputs`: rank 1 copies the tensor out and a barrier holds rank 0 until it
  has), `broadcast` the bytes (gloo over loopback TCP, what ranks in other pods get). Beside
  them `memmove`: one copy of the size, the copy limit measured here.
- role: requests through real `disagg role` processes (one role, the bench's `summarize`
  handler, which answers a byte count) at ranks 1 and 2 (the shm feed), median latency of
  each and the difference: the per-request cost of ranks > 1 against ranks = 1.

The modes (and the two pipelines) run side by side and take turns request by request, so
that the machine's load weighs on every column alike.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from disagg_runtime.bench.limits import measure_memcpy_large
from disagg_runtime.bench.sizes import format_size, parse_size

FEED_MODES = ("notice", "shm", "private", "broadcast")
DEFAULT_SIZES = "4KiB,16MiB,64MiB"


@dataclass
class FeedRow:
    size: int
    mode: str
    median_us: float
    p90_us: float


@dataclass
class RoleRow:
    size: int
    ranks: int
    median_ms: float


def _feed_rank(rank: int, port: int, sizes: list[int], repeats: int, out: Any) -> None:
    import torch.distributed as dist

    from disagg_runtime.memory.pool import Pool, shm_name
    from disagg_runtime.role import rankfeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    ack = torch.zeros(1)
    pool = None
    if rank == 0:
        pool = Pool.create(2 * max(sizes) + 2**20, device="shm", name=shm_name("bench", "ranks"))
    try:
        for size in sizes:
            feeds = {
                mode: rankfeed.Feed(dist.group.WORLD, rank=rank, private=mode == "private")
                for mode in FEED_MODES
            }
            times: dict[str, list[float]] = {mode: [] for mode in FEED_MODES}
            if rank == 0:
                assert pool is not None
                x = pool.backing.tensor[:size]
                x.fill_(1)
            for mode, feed in feeds.items():  # the hellos, in the same order on both ranks
                if rank == 0:
                    if mode in ("shm", "private"):
                        assert pool is not None
                        feed.use_pool(pool)
                    feed.hello()
                else:
                    feed.receive()
            for _ in range(repeats + 2):  # the modes take turns
                for mode, feed in feeds.items():
                    if rank == 0:
                        payload = None if mode == "notice" else {"x": x}
                        kind = rankfeed.KEEPALIVE if mode == "notice" else rankfeed.CALL
                        t0 = time.perf_counter()
                        feed.send(kind, payload)
                        dist.all_reduce(ack)
                        times[mode].append(time.perf_counter() - t0)
                    else:
                        feed.receive()
                        dist.all_reduce(ack)
            for mode, feed in feeds.items():
                if rank == 0:
                    out.put((size, mode, times[mode][2:]))
                else:
                    feed.close()
    finally:
        if pool is not None:
            pool.close()
        dist.destroy_process_group()


def measure_feed(sizes: list[int], repeats: int) -> list[FeedRow]:
    from disagg_runtime.local.ports import free_ports

    port = next(free_ports())
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_feed_rank, args=(r, port, sizes, repeats, out)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    rows = []
    for _ in range(len(sizes) * len(FEED_MODES)):
        size, mode, times = out.get(timeout=600)
        times.sort()
        rows.append(
            FeedRow(size, mode, statistics.median(times) * 1e6, times[int(0.9 * len(times))] * 1e6)
        )
    for proc in procs:
        proc.join(60)
    return rows


def _role_doc(sizes: list[int], ranks: int) -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": f"bench-ranks-{ranks}"},
        "spec": {
            "image": "local",
            "transport": {"poolSize": f"{4 * max(sizes) // 2**20 + 16}Mi", "minBlock": "64Ki"},
            "roles": [
                {"name": "r", "handler": "disagg_runtime.bench.handlers:summarize", "ranks": ranks}
            ],
        },
    }


def measure_roles(sizes: list[int], repeats: int, ranks: tuple[int, ...] = (1, 2)) -> list[RoleRow]:
    """One pipeline per rank count, all running; their requests take turns."""
    from disagg_core import spec
    from disagg_runtime.local.supervisor import LocalPipeline

    rows = []
    with contextlib.ExitStack() as stack:
        clients = {}
        for n in ranks:
            local = stack.enter_context(
                LocalPipeline(spec.parse_pipeline(_role_doc(sizes, n)), grace_s=5.0)
            )
            local.wait_ready(timeout=120)
            clients[n] = local.client(timeout=60)
            stack.callback(clients[n].close)
        for size in sizes:
            x = torch.ones(size, dtype=torch.uint8)
            times: dict[int, list[float]] = {n: [] for n in ranks}
            for _ in range(repeats + 2):
                for n, client in clients.items():
                    t0 = time.perf_counter()
                    client.submit({"x": x})
                    times[n].append(time.perf_counter() - t0)
            rows += [RoleRow(size, n, statistics.median(times[n][2:]) * 1e3) for n in ranks]
    return rows


def render(feed: list[FeedRow], memmove: dict[int, float], roles: list[RoleRow]) -> str:
    lines = ["rank feed: rank 0 -> rank 1 until rank 1 holds the input (median, p90; us)"]
    lines.append(f"{'size':>8}" + "".join(f" {m:>14}" for m in FEED_MODES) + f" {'memmove':>9}")
    for size in sorted({r.size for r in feed}):
        cells = {r.mode: f"{r.median_us:7.0f} {r.p90_us:6.0f}" for r in feed if r.size == size}
        row = "".join(f" {cells[m]:>14}" for m in FEED_MODES)
        lines.append(f"{format_size(size):>8}{row} {memmove[size]:9.0f}")
    if roles:
        lines.append("")
        lines.append("one role, requests through disagg role processes (median ms)")
        lines.append(f"{'size':>8} {'ranks=1':>9} {'ranks=2':>9} {'cost':>8}")
        for size in sorted({r.size for r in roles}):
            by = {r.ranks: r.median_ms for r in roles if r.size == size}
            lines.append(f"{format_size(size):>8} {by[1]:9.2f} {by[2]:9.2f} {by[2] - by[1]:+8.2f}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        print(f"disagg bench ranks: {exc}", file=sys.stderr)
        return 2
    feed = measure_feed(sizes, args.repeats)
    memmove = {s: statistics.median(measure_memcpy_large(s, args.repeats)) * 1e6 for s in sizes}
    roles: list[RoleRow] = []
    if not args.skip_role:
        roles = measure_roles(sizes, args.repeats)
    if args.json:
        print(
            json.dumps(
                {
                    "feed": [asdict(r) for r in feed],
                    "memmove_us": memmove,
                    "role": [asdict(r) for r in roles],
                },
                indent=2,
            )
        )
    else:
        print(render(feed, memmove, roles))
    return 0
