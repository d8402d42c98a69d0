"""`disagg bench transport`: relays against their limits and naive baselines, one run.

Every method moves `{"x": uint8 tensor of SIZE, "sent": stamp}` from this process to a
spawned receiver process and waits for a tiny reply. `p50_us`/`p99_us` are the one-way
delay from before `send` to the receiver holding the payload, both read from
CLOCK_MONOTONIC, which all processes on a machine share; `gbps = size / p50` (the hand-off
rate); `median_s` is the median round trip (the reply included). All processes use one
torch thread, so it is like for like. The limits, measured in the same run:

- `memcpy`: one single-threaded torch `copy_` into a pre-faulted tensor, the same
  buffers every time (below the last-level cache size, they stay in it);
- `memcpy_large`: the same copy, walking through buffers several times larger than the
  last-level cache, so every copy reads and writes memory (the limit for medium sizes:
  a payload handed to another process is rarely in the cache);
- `raw_unix`: the message as bytes over one AF_UNIX stream socket to a receiver blocked
  in `recv_into` (no framing, no flow control): the floor for a wake-up between processes;
- `py_unix`: the least Python that hands a tensor to another process: `raw_unix` with a
  16-byte header (stamp, size), the tensor's bytes copied into the message by torch, and
  the receiver making a tensor of what it read (`torch.frombuffer`) in a dict. No
  authentication, flow control, ordering or release: the floor for any Python API that
  delivers tensors, against which the relays' per-message cost can be read.

Every row carries its ratio to each limit (`x memcpy`, `x large`: rate over rate;
`x raw`, `x py`: p50 over raw_unix's and py_unix's p50).

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
import math
import multiprocessing as mp
import os
import re
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import zmq

from disagg_runtime.bench import frames, peer
from disagg_runtime.bench.rss import peak_rss_bytes, reset_peak, rss_bytes
from disagg_runtime.memory.pool import cuda_unavailable_reason
from disagg_runtime.relay import Relay, auth, connect, registry

METHODS = (
    "memcpy",
    "memcpy_large",
    "raw_unix",
    "py_unix",
    "shm",
    "tcp",
    "pickle_zmq",
    "copy_clone_zmq",
)
GPU_METHODS = ("d2d", "cuda_ipc", "shm", "tcp")
OPTIONAL = ("nixl",)  # run when asked for (--methods), if this machine has the package
LIMIT = {"cpu": "memcpy", "cuda": "d2d"}
LIMITS = ("memcpy", "d2d", "memcpy_large", "raw_unix", "py_unix")  # measured first, in this order
LLC_FALLBACK = 32 << 20
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


def pool_size_for(size: int) -> int:
    """Two buddy blocks of the payload (so one transfer can land while one is released)."""
    block = 1 << max(20, (size - 1).bit_length())
    return 2 * block


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100]): a value that was measured."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def llc_bytes() -> int:
    """The size of the largest CPU cache (sysfs), or 32 MiB when it cannot be read."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        return LLC_FALLBACK
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "size")) as f:
                best = max(best, parse_size(f.read().strip().replace("K", "KiB")))
        except (OSError, ValueError):
            continue
    return best or LLC_FALLBACK


def measure_memcpy_large(size: int, repeats: int) -> list[float]:
    """`size` bytes per copy, each at the next place in source and destination buffers of
    at least four times the last-level cache: no copy finds its bytes in the cache."""
    per_span = max(1, -(-4 * llc_bytes() // size))
    src = torch.ones(per_span * size, dtype=torch.uint8)
    dst = torch.zeros(per_span * size, dtype=torch.uint8)
    dst.copy_(src)  # fault every page in first
    times = []
    for i in range(repeats + per_span):
        at = (i % per_span) * size
        t0 = time.perf_counter()
        dst[at : at + size].copy_(src[at : at + size])
        times.append(time.perf_counter() - t0)
    return times[per_span:]


def measure_raw_unix(size: int, repeats: int) -> list[float]:
    """One-way delays of `size` bytes written whole to a unix stream socket whose receiver
    (another process) is blocked in `recv_into`; it answers each with the delay it saw."""
    buf = bytearray(max(size, 8))  # the stamp travels in the message

    def message() -> bytearray:
        struct.pack_into("d", buf, 0, time.perf_counter())
        return buf

    return _unix_delays(peer.serve_raw, len(buf), message, repeats)


def measure_py_unix(size: int, repeats: int) -> list[float]:
    """As `measure_raw_unix`, with the least a Python tensor hand-off does on each side:
    a header (stamp, size) and the tensor's bytes copied by torch into one message here;
    the header parsed, the bytes received into their own buffer and made a tensor there."""
    x = torch.ones(size, dtype=torch.uint8)

    def message() -> bytearray:
        frame = bytearray(peer.PY_HEADER.size + size)
        peer.PY_HEADER.pack_into(frame, 0, time.perf_counter(), size)
        if size:
            torch.frombuffer(frame, dtype=torch.uint8, offset=peer.PY_HEADER.size).copy_(x)
        return frame

    return _unix_delays(peer.serve_py, 0, message, repeats)


def _unix_delays(
    serve: Callable[[str, int], None],
    nbytes: int,
    message: Callable[[], bytearray],
    repeats: int,
) -> list[float]:
    """Run `serve(path, nbytes)` in another process, write it `repeats` + 1 messages (each
    `message()`, which stamps itself) over a unix stream socket, one at a time, and return
    the one-way delays it answers (the first, a warm-up, dropped)."""
    spawn = mp.get_context("spawn")
    delays: list[float] = []
    with tempfile.TemporaryDirectory(prefix="disagg-bench-") as tmp:
        path = os.path.join(tmp, "raw.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(60)
        proc = spawn.Process(target=serve, args=(path, nbytes), daemon=True)
        proc.start()
        try:
            conn, _ = listener.accept()
            conn.settimeout(60)
            with conn:
                for _ in range(repeats + 1):
                    conn.sendall(message())
                    reply = conn.recv(8, socket.MSG_WAITALL)
                    if len(reply) != 8:
                        raise RuntimeError("the unix socket's receiver went away")
                    delays.append(struct.unpack("d", reply)[0])
        finally:
            listener.close()
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return delays[1:]


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
            sock.send_multipart(frames.encode(payload), copy=True)

    return send


def run(
    sizes: list[int], methods: list[str], repeats: int = 0, device: str = "cpu"
) -> list[Result]:
    torch.set_num_threads(1)
    results: list[Result] = []
    for size in sizes:
        n = repeats or default_repeats(size)
        rates: dict[str, float] = {}
        raw_p50: float | None = None
        py_p50: float | None = None
        for method in methods:
            rss: dict[str, int] = {}
            if method == "memcpy":
                times = one_way = measure_memcpy(size, n)
            elif method == "memcpy_large":
                times = one_way = measure_memcpy_large(size, n)
            elif method == "d2d":
                times = one_way = measure_d2d(size, n)
            elif method == "raw_unix":
                times = one_way = measure_raw_unix(size, n)
            elif method == "py_unix":
                times = one_way = measure_py_unix(size, n)
            else:
                times, one_way, rss = measure_remote(method, size, n, device)
            p50 = statistics.median(one_way)
            result = Result(
                method,
                size,
                n,
                statistics.median(times),
                size / p50 / 1e9,
                p50_us=p50 * 1e6,
                p99_us=percentile(one_way, 99) * 1e6,
                **rss,
                device=device,
            )
            if method in LIMITS:
                rates[method] = result.gbps
            if method == "raw_unix":
                raw_p50 = p50
            if method == "py_unix":
                py_p50 = p50
            if LIMIT[device] in rates:
                result.ratio_to_memcpy = result.gbps / rates[LIMIT[device]]
            if "memcpy_large" in rates:
                result.ratio_to_large = result.gbps / rates["memcpy_large"]
            if raw_p50:
                result.p50_over_raw = p50 / raw_p50
            if py_p50:
                result.p50_over_py = p50 / py_p50
            results.append(result)
    return results


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
    # the limits first, so every later row has its ratios
    methods = [m for m in LIMITS if m in methods] + [m for m in methods if m not in LIMITS]
    results = run(sizes, methods, args.repeats, device)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(render_table(results))
    return 0
