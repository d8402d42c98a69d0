"""`disagg bench transport`: relays against their limits and naive baselines, one run.

Every method moves `{"x": uint8 tensor of SIZE, "sent": stamp}` from this process to a
spawned receiver process and waits for a tiny reply. `p50_us`/`p99_us` are the one-way
delay from before `send` to the receiver holding the payload, both read from
CLOCK_MONOTONIC, which all processes on a machine share; `gbps = size / p50` (the hand-off
rate); `median_s` is the median round trip (the reply included). All processes use one
torch thread, so it is like for like.

The limits (bench/limits.py, bench/raw_tcp.py) and the peers (bench/bare_nixl.py,
bench/peer.py) are measured in the same run; bench/ratios.py says which is the limit at
each size (`memcpy`: the fastest of torch `copy_`, glibc `memmove` and numpy `copyto`;
`tcp_limit`: the faster of one raw loopback TCP stream and N) and gives every relay row
its rate over each limit's and peer's, printed as a second table (`peers` in the JSON).
Every row carries its ratio to the copy limits (`x memcpy`, `x large`: rate over rate)
and to the wake-up floors (`x raw`, `x py`: p50 over raw_unix's and py_unix's p50).

`--device cuda`: the payload lives on the GPU and every receiver ends with it on the GPU.
`d2d` (a device-to-device `copy_`, synchronized) is the limit; `cuda_ipc` copies into the
receiver's CUDA pool; `shm` stages through the receiver's pinned shared pool (the receiver
copies to the GPU); `tcp` stages through a pinned buffer and lands through the receiver's
bounce buffer into its CUDA pool.

`nixl` (in every run where the nixl extra works, beside bare NIXL) writes one-sided into the
receiver's registered pool through NIXL's UCX backend. Between two processes of one machine
UCX moves the bytes with a single cross-memory-attach copy (process_vm_writev); across nodes
it would use RDMA (InfiniBand/RoCE verbs) where the NICs have it: the NIC writes the slot
with no copy by either CPU, which is what this relay is for.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import struct
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import zmq

from disagg_runtime.bench import bare_nixl, frames, limits, peer, ratios, raw_tcp, stream_cpu
from disagg_runtime.bench.rss import peak_rss_bytes, reset_peak, rss_bytes
from disagg_runtime.bench.sizes import format_size, parse_size
from disagg_runtime.memory.pool import cuda_unavailable_reason
from disagg_runtime.relay import Relay, auth, connect, registry

METHODS = (
    *ratios.COPIES,
    "memcpy",
    "memcpy_large",
    "raw_unix",
    "py_unix",
    *ratios.TCP_RAW,
    "tcp_limit",
    "shm",
    "tcp",
    *ratios.STYLES,
)
GPU_METHODS = ("d2d", "cuda_ipc", "shm", "tcp")
NIXL_METHODS = ("nixl", *ratios.NIXL_PEERS)  # in every run where the nixl package works
LIMIT = {"cpu": "memcpy", "cuda": "d2d"}
RELAYS = {"shm": "shm", "tcp": "tcp", "cuda_ipc": "cuda-ipc", "nixl": "nixl"}
LATENCY_MAX = 64 * 1024
DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB,64MiB,256MiB"


def default_repeats(size: int) -> int:
    if size <= LATENCY_MAX:
        return 300
    if size <= 1 << 20:
        return 200
    if size <= 16 << 20:
        return 40
    return 7 if size <= 64 << 20 else 5


@dataclass
class Result:
    method: str
    size_bytes: int
    repeats: int
    median_s: float  # round trip (reply included); for the copies, one copy
    gbps: float  # size / p50: the one-way hand-off rate
    ratio_to_memcpy: float | None = None
    p50_us: float | None = None
    p99_us: float | None = None
    ratio_to_large: float | None = None  # gbps / memcpy_large gbps (same size, same run)
    p50_over_raw: float | None = None  # p50 / raw_unix p50 (same size, same run)
    p50_over_py: float | None = None  # p50 / py_unix p50 (same size, same run)
    sender_rss_delta_bytes: int | None = None
    receiver_rss_delta_bytes: int | None = None
    pool_bytes: int | None = None
    device: str = "cpu"
    best_of: str | None = None  # a derived limit: the row it is (bench/ratios.py)
    peers: dict[str, float] = field(default_factory=dict)  # a relay's rate over each reference's


def pool_size_for(size: int) -> int:
    """Two buddy blocks of the payload (so one transfer can land while one is released)."""
    block = 1 << max(20, (size - 1).bit_length())
    return 2 * block


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100]): a value that was measured."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


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
        elif method == "fresh_shm":
            sock.send(peer.fresh_segment(payload))
        else:
            sock.send_multipart(frames.encode(payload), copy=True)

    return send


def measure(
    method: str, size: int, n: int, device: str
) -> tuple[list[float], list[float], dict[str, int]]:
    """(round trips, one-way delays, RSS figures) of `n` moves of `size` bytes by `method`."""
    if method in ratios.COPIES:
        times = limits.measure_copy(method, size, n)
    elif method == "memcpy_large":
        times = limits.measure_memcpy_large(size, n)
    elif method == "d2d":
        times = limits.measure_d2d(size, n)
    elif method == "raw_unix":
        times = limits.measure_raw_unix(size, n)
    elif method == "py_unix":
        times = limits.measure_py_unix(size, n)
    elif method in ratios.TCP_RAW:
        times = raw_tcp.measure(size, n, 1 if method == "raw_tcp" else raw_tcp.streams_for(size))
    elif method in ratios.NIXL_PEERS:
        times = bare_nixl.measure(method, size, n)
    else:
        return measure_remote(method, size, n, device)
    return times, times, {}


def run(
    sizes: list[int], methods: list[str], repeats: int = 0, device: str = "cpu"
) -> list[Result]:
    torch.set_num_threads(1)
    results: list[Result] = []
    for size in sizes:
        n = repeats or default_repeats(size)
        rows: dict[str, Result] = {}
        for method in methods:
            if ratios.is_derived(method):
                best = ratios.best_of(method, {m: r.gbps for m, r in rows.items()})
                if best is None:
                    continue
                result = replace(rows[best], method=method, best_of=best, peers={})
            else:
                times, one_way, rss = measure(method, size, n, device)
                p50 = statistics.median(one_way)
                result = Result(
                    method,
                    size,
                    n,
                    statistics.median(times),
                    size / p50 / 1e9,
                    p50_us=p50 * 1e6,
                    p99_us=percentile(one_way, 99) * 1e6,
                    **rss,  # type: ignore[arg-type]
                    device=device,
                )
            rows[method] = result
            results.append(result)
        for result in rows.values():  # every limit and peer of the size is in now
            _relate(result, rows, LIMIT[device])
    return results


def _relate(result: Result, rows: dict[str, Result], limit: str) -> None:
    """Fill `result`'s ratios to the limits and peers measured at its size."""
    p50 = result.p50_us or 0.0
    if limit in rows:
        result.ratio_to_memcpy = result.gbps / rows[limit].gbps
    if "memcpy_large" in rows:
        result.ratio_to_large = result.gbps / rows["memcpy_large"].gbps
    if "raw_unix" in rows and rows["raw_unix"].p50_us:
        result.p50_over_raw = p50 / (rows["raw_unix"].p50_us or 1.0)
    if "py_unix" in rows and rows["py_unix"].p50_us:
        result.p50_over_py = p50 / (rows["py_unix"].p50_us or 1.0)
    result.peers = ratios.ratios(result.method, result.gbps, {m: r.gbps for m, r in rows.items()})


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render_table(results: list[Result]) -> str:
    columns = ["size", "GB/s", "x memcpy", "x large", "p50 us", "p99 us", "x raw", "x py"]
    columns += ["tx MiB", "rx MiB"]
    head = f"{'method':<16}" + "".join(f"{c:>9}" for c in columns)
    lines = [head, "-" * len(head)]
    for r in results:
        cells = (
            format_size(r.size_bytes),
            f"{r.gbps:.2f}",
            _cell(r.ratio_to_memcpy, ".2f"),
            _cell(r.ratio_to_large, ".2f"),
            _cell(r.p50_us, ".0f"),
            _cell(r.p99_us, ".0f"),
            _cell(r.p50_over_raw, ".2f"),
            _cell(r.p50_over_py, ".2f"),
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
    lines.append(
        "GB/s: size / p50 one-way. x memcpy, x large: GB/s over memcpy's and memcpy_large's "
        "(buffers beyond the LLC); x raw, x py: p50 over raw_unix's and py_unix's p50."
    )
    lines.append("tx/rx MiB: peak RSS growth of sender/receiver during the run (pool included).")
    lines += _peer_table(results)
    if any(r.device == "cuda" for r in results):
        lines.append(
            "--device cuda: payloads on the GPU; 'x memcpy' is the ratio to d2d, a "
            "device-to-device copy on this GPU in the same run."
        )
    return "\n".join(lines)


def _peer_table(results: list[Result]) -> list[str]:
    """Each relay row's rate over every limit's and peer's at its size (above 1: faster)."""
    rows = [r for r in results if r.peers]
    refs = [ref for ref in ratios.REFERENCES if any(ref in r.peers for r in rows)]
    if not rows:
        return []
    limits_of = {r.size_bytes: r.best_of for r in results if r.method == "memcpy"}
    head = f"{'relay':<8}{'size':>8}" + "".join(f"{ref:>15}" for ref in refs)
    lines = ["", "disagg over each limit and peer (GB/s over GB/s, same size, same run):", head]
    for r in rows:
        cells = "".join(f"{_cell(r.peers.get(ref), '.2f'):>15}" for ref in refs)
        lines.append(f"{r.method:<8}{format_size(r.size_bytes):>8}" + cells)
    used = ", ".join(f"{format_size(s)} {w}" for s, w in limits_of.items() if w)
    if used:
        lines.append(f"memcpy is the fastest copy at each size: {used}")
    return lines


def run_cli(args: argparse.Namespace) -> int:
    if getattr(args, "cpu_messages", 0):
        return stream_cpu.run_cli(args)
    device = getattr(args, "device", "cpu")
    known = GPU_METHODS if device == "cuda" else METHODS
    try:
        if device == "cuda":
            reason = cuda_unavailable_reason()
            if reason is not None:
                raise ValueError(f"--device cuda needs CUDA, and {reason}")
        sizes = [parse_size(s) for s in (args.sizes or DEFAULT_SIZES).split(",") if s.strip()]
        methods = [m.strip() for m in (args.methods or "").split(",") if m.strip()]
        unknown = sorted(set(methods) - set(known) - set(NIXL_METHODS))
        if unknown:
            raise ValueError(
                f"unknown method(s) {', '.join(unknown)} for --device {device}; "
                f"choose from {', '.join((*known, *NIXL_METHODS))}"
            )
        nixl_missing = registry.backend("nixl").unavailable() if device == "cpu" else "cpu only"
        if nixl_missing is not None and set(methods) & set(NIXL_METHODS):
            raise ValueError(f"nixl cannot run here: {nixl_missing}")
    except ValueError as exc:
        print(f"disagg bench transport: {exc}", file=sys.stderr)
        return 2
    if not methods:  # everything this machine can run
        methods = [*known, *(NIXL_METHODS if nixl_missing is None else ())]
        if nixl_missing is not None and device == "cpu":
            print(f"disagg bench transport: no nixl rows: {nixl_missing}", file=sys.stderr)
    methods = ratios.plan(methods)  # the limits first, so every later row has its ratios
    results = run(sizes, methods, args.repeats, device)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(render_table(results))
    return 0
