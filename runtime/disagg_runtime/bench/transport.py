"""`disagg bench transport`: relays against the memcpy limit and naive baselines, one run.

Every method moves `{"x": uint8 tensor of SIZE, "sent": stamp}` from this process to a
spawned receiver process and waits for a tiny reply; a figure is the median over
repeats. `gbps = size / round_trip` (conservative: it includes the reply); `p50_us`
(sizes <= 64 KiB) is the median one-way delay from before `send` to after the receiver's
`recv`, both read from CLOCK_MONOTONIC, which all processes on a machine share.
`memcpy` is one single-threaded torch `copy_` into a pre-faulted tensor: the limit every
ratio is taken against. All processes use one torch thread, so it is like for like.

`--device cuda`: the payload lives on the GPU and every receiver ends with it on the GPU.
`d2d` (a device-to-device `copy_`, synchronized) is the limit; `cuda_ipc` copies into the
receiver's CUDA pool; `shm` stages through the receiver's pinned shared pool (the receiver
copies to the GPU); `tcp` stages through a pinned buffer and lands through the receiver's
bounce buffer into its CUDA pool.

`nixl` (`--methods nixl`, with the nixl extra installed) writes one-sided into the
receiver's registered pool through NIXL's UCX backend. Between two processes of one machine
UCX moves the bytes with a single cross-memory-attach copy (process_vm_writev); across nodes
it would use RDMA (InfiniBand/RoCE verbs) where the NICs have it: the NIC writes the slot
with no copy by either CPU, which is what this relay is for.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import statistics
import struct
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import zmq

from disagg_runtime import codec
from disagg_runtime.bench import peer
from disagg_runtime.bench.rss import peak_rss_bytes, reset_peak, rss_bytes
from disagg_runtime.pool import cuda_unavailable_reason
from disagg_runtime.relay import Relay, auth, connect, registry

METHODS = ("memcpy", "shm", "tcp", "pickle_zmq", "copy_clone_zmq")
GPU_METHODS = ("d2d", "cuda_ipc", "shm", "tcp")
OPTIONAL = ("nixl",)  # run when asked for (--methods), if this machine has the package
LIMIT = {"cpu": "memcpy", "cuda": "d2d"}
RELAYS = {"shm": "shm", "tcp": "tcp", "cuda_ipc": "cuda-ipc", "nixl": "nixl"}
LATENCY_MAX = 64 * 1024
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "ki": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "mi": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "gi": 2**30,
}


def parse_size(text: str) -> int:
    """'64MiB', '64Mi', '4KiB', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}; use e.g. 4KiB, 64MiB, 1GiB")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def default_repeats(size: int) -> int:
    if size <= LATENCY_MAX:
        return 300
    if size <= 4 << 20:
        return 40
    return 7 if size <= 64 << 20 else 5


@dataclass
class Result:
    method: str
    size_bytes: int
    repeats: int
    median_s: float
    gbps: float
    ratio_to_memcpy: float | None = None
    p50_us: float | None = None
    sender_rss_delta_bytes: int | None = None
    receiver_rss_delta_bytes: int | None = None
    pool_bytes: int | None = None
    device: str = "cpu"


def pool_size_for(size: int) -> int:
    """Two buddy blocks of the payload (so one transfer can land while one is released)."""
    block = 1 << max(20, (size - 1).bit_length())
    return 2 * block


def measure_memcpy(size: int, repeats: int) -> list[float]:
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times[1:]


def measure_d2d(size: int, repeats: int) -> list[float]:
    """One device-to-device `copy_` on the current GPU, timed like the relays (wall clock,
    synchronized before and after)."""
    src = torch.ones(size, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[1:]


def measure_remote(
    method: str, size: int, repeats: int, device: str = "cpu"
) -> tuple[list[float], list[float], dict[str, int]]:
    """Start a receiver process for `method`, time `repeats` round trips, collect RSS."""
    spawn = mp.get_context("spawn")
    parent_conn, child_conn = spawn.Pipe()
    pool_bytes = pool_size_for(size)
    key = auth.new_key()  # the relays authenticate as a pipeline's roles do
    proc = spawn.Process(
        target=peer.serve, args=(method, pool_bytes, child_conn, device, key), daemon=True
    )
    ctx = zmq.Context()
    replies = ctx.socket(zmq.PULL)
    replies.setsockopt(zmq.LINGER, 0)
    replies.bind("tcp://127.0.0.1:0")
    payload: dict[str, Any] = {"x": torch.ones(size, dtype=torch.uint8, device=device)}
    proc.start()
    relay: Relay | None = None
    data: zmq.Socket[Any] | None = None
    try:
        parent_conn.send(replies.getsockopt_string(zmq.LAST_ENDPOINT))
        if not parent_conn.poll(60):
            raise RuntimeError(f"{method} receiver did not start")
        endpoint = parent_conn.recv()
        baseline = rss_bytes()
        reset_peak()
        if method in RELAYS:
            relay = connect(RELAYS[method], endpoint, context=ctx, timeout=60.0, key=key)
            send = _relay_send(relay)
        else:
            data = ctx.socket(zmq.PUSH)
            data.setsockopt(zmq.LINGER, 0)
            data.connect(endpoint)
            send = _baseline_send(method, data)
        times, one_way = [], []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            payload["sent"] = t0
            send(payload, i)
            if not replies.poll(60_000):
                raise RuntimeError(f"{method}: no reply from the receiver within 60 s")
            (delay,) = struct.unpack("d", replies.recv())
            times.append(time.perf_counter() - t0)
            one_way.append(delay)
        sender_delta = peak_rss_bytes() - baseline
    finally:
        if relay is not None:
            relay.close()
        if data is not None:
            data.close(linger=0)
        parent_conn.send("stop")
        report = parent_conn.recv() if parent_conn.poll(30) else {}
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        replies.close(linger=0)
        ctx.term()
    rss = {
        "sender_rss_delta_bytes": sender_delta,
        "receiver_rss_delta_bytes": report.get("rss_peak", 0) - report.get("rss_baseline", 0),
        "pool_bytes": pool_bytes if method in RELAYS else 0,
    }
    return times[1:], one_way[1:], rss


def _relay_send(relay: Relay) -> Any:
    def send(payload: dict[str, Any], i: int) -> None:
        relay.send(payload, request_id=f"bench-{i}")

    return send


def _baseline_send(method: str, sock: zmq.Socket[Any]) -> Any:
    def send(payload: dict[str, Any], i: int) -> None:
        if method == "pickle_zmq":
            sock.send_pyobj(payload)
        else:
            sock.send_multipart(codec.encode(payload), copy=True)

    return send


def run(
    sizes: list[int], methods: list[str], repeats: int = 0, device: str = "cpu"
) -> list[Result]:
    torch.set_num_threads(1)
    results: list[Result] = []
    for size in sizes:
        n = repeats or default_repeats(size)
        limit: float | None = None
        for method in methods:
            rss: dict[str, int] = {}
            one_way: list[float] = []
            if method == "memcpy":
                times = measure_memcpy(size, n)
            elif method == "d2d":
                times = measure_d2d(size, n)
            else:
                times, one_way, rss = measure_remote(method, size, n, device)
            median = statistics.median(times)
            result = Result(method, size, n, median, size / median / 1e9, **rss, device=device)
            if method == LIMIT[device]:
                limit = result.gbps
            if limit:
                result.ratio_to_memcpy = result.gbps / limit
            if size <= LATENCY_MAX and one_way:
                result.p50_us = statistics.median(one_way) * 1e6
            results.append(result)
    return results


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render_table(results: list[Result]) -> str:
    columns = ("size", "GB/s", "x memcpy", "p50 us", "tx MiB", "rx MiB")
    head = f"{'method':<16}" + "".join(f"{c:>9}" for c in columns)
    lines = [head, "-" * len(head)]
    for r in results:
        cells = (
            format_size(r.size_bytes),
            f"{r.gbps:.2f}",
            _cell(r.ratio_to_memcpy, ".2f"),
            _cell(r.p50_us, ".0f"),
            _cell(
                None if r.sender_rss_delta_bytes is None else r.sender_rss_delta_bytes / 2**20,
                ".0f",
            ),
            _cell(
                None if r.receiver_rss_delta_bytes is None else r.receiver_rss_delta_bytes / 2**20,
                ".0f",
            ),
        )
        lines.append(f"{r.method:<16}" + "".join(f"{c:>9}" for c in cells))
    lines.append("tx/rx MiB: peak RSS growth of sender/receiver during the run (pool included).")
    if any(r.device == "cuda" for r in results):
        lines.append(
            "--device cuda: payloads on the GPU; 'x memcpy' is the ratio to d2d, a "
            "device-to-device copy on this GPU in the same run."
        )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    device = getattr(args, "device", "cpu")
    known = GPU_METHODS if device == "cuda" else METHODS
    try:
        if device == "cuda":
            reason = cuda_unavailable_reason()
            if reason is not None:
                raise ValueError(f"--device cuda needs CUDA, and {reason}")
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        methods = [m.strip() for m in (args.methods or ",".join(known)).split(",") if m.strip()]
        unknown = sorted(set(methods) - set(known) - set(OPTIONAL))
        if unknown:
            raise ValueError(
                f"unknown method(s) {', '.join(unknown)} for --device {device}; "
                f"choose from {', '.join((*known, *OPTIONAL))}"
            )
        for method in set(methods) & set(OPTIONAL):
            reason = registry.backend(RELAYS[method]).unavailable()
            if reason is not None:
                raise ValueError(f"{method} cannot run here: {reason}")
    except ValueError as exc:
        print(f"disagg bench transport: {exc}", file=sys.stderr)
        return 2
    limit = LIMIT[device]
    if limit in methods:  # the limit first, so every later row has its ratio
        methods = [limit, *[m for m in methods if m != limit]]
    results = run(sizes, methods, args.repeats, device)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(render_table(results))
    return 0
