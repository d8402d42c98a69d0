"""The limits of `disagg bench transport`, measured in the same run as the relays
(which of them is the limit at each size: bench/ratios.py).

- the copies: one single-threaded copy into a pre-faulted buffer, the same buffers every
  time (below the last-level cache size, they stay in it), by torch `copy_`, glibc
  `memmove` (ctypes: what the relay's own copies use) and numpy `copyto`;
- `memcpy_large`: `memmove` walking through buffers several times larger than the
  last-level cache, so every copy reads and writes memory (the limit for medium sizes:
  a payload handed to another process is rarely in the cache);
- `raw_unix`: the message as bytes over one AF_UNIX stream socket to a receiver blocked
  in `recv_into` (no framing, no flow control): the floor for a wake-up between processes;
- `py_unix`: the least Python that hands a tensor to another process: `raw_unix` with a
  16-byte header (stamp, size), the tensor's bytes copied into the message by torch, and
  the receiver making a tensor of what it read (`torch.frombuffer`) in a dict;
- `raw_tcp`, `raw_tcp_n`: the bytes over one loopback TCP stream, and cut over N streams
  each sent and received by its own thread (bench/raw_tcp.py).
"""

from __future__ import annotations

import ctypes
import os
import socket
import statistics
import struct
import tempfile
import time
from collections.abc import Callable

import torch

from disagg_runtime.bench import peer, procs
from disagg_runtime.bench.ratios import COPIES
from disagg_runtime.bench.sizes import parse_size

LLC_FALLBACK = 32 << 20


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
    src_at, dst_at = src.data_ptr(), dst.data_ptr()
    times = []
    for i in range(repeats + per_span):
        at = (i % per_span) * size
        t0 = time.perf_counter()
        ctypes.memmove(dst_at + at, src_at + at, size)
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
    mp_ctx = procs.context()
    delays: list[float] = []
    with tempfile.TemporaryDirectory(prefix="disagg-bench-") as tmp:
        path = os.path.join(tmp, "raw.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(60)
        proc = mp_ctx.Process(target=serve, args=(path, nbytes), daemon=True)
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


def measure_copy(way: str, size: int, repeats: int) -> list[float]:
    """`repeats` copies of `size` bytes between the same two pre-faulted buffers, by `way`:
    copy_torch, copy_memmove or copy_numpy."""
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)
    copy = _copier(way, src, dst)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t0)
    return times[1:]


def measure_best_copy(size: int, repeats: int) -> list[float]:
    """The times of whichever copy (torch, memmove, numpy) is fastest here at `size`."""
    runs = [measure_copy(way, size, repeats) for way in COPIES]
    return min(runs, key=statistics.median)


def _copier(way: str, src: torch.Tensor, dst: torch.Tensor) -> Callable[[], object]:
    if way == "copy_torch":
        return lambda: dst.copy_(src)
    if way == "copy_memmove":
        to, frm, n = dst.data_ptr(), src.data_ptr(), src.numel()
        return lambda: ctypes.memmove(to, frm, n)
    if way == "copy_numpy":
        import numpy as np  # torch's own dependency

        a, b = src.numpy(), dst.numpy()
        return lambda: np.copyto(b, a)
    raise ValueError(f"unknown copy {way!r}")


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
