"""`raw_tcp` and `raw_tcp_n`: the payload's bytes over loopback TCP with nothing else, the
limit of a tcp relay (bench/ratios.py takes the better of the two at each size).

One stream: the sender `sendall`s the whole buffer, the receiver `recv_into`s it whole.
N streams: the buffer is cut into N contiguous parts (`split`), each sent by its own
thread on its own connection and received by its own thread into its place (`sendall` and
`recv_into` release the GIL, so the streams run at once); the receiver answers when every
part is in. The sender's stamp travels in the first 8 bytes, so each answer is the
one-way delay its receiver saw (perf_counter is one clock for every process here).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from disagg_runtime.bench import procs
from disagg_runtime.relay.backends.tcp import stripe_plan

STAMP = struct.Struct("d")


def streams_for(size: int) -> int:
    """N for `raw_tcp_n` at `size`: the streams the tcp relay cuts such a payload over
    (relay/backends/tcp/stripe_plan.py, the one derivation of N), or, where it does not
    cut it, as many as it cuts large payloads over (one per core, bounded)."""
    return stripe_plan.stream_count(size) or stripe_plan.default_streams()


def split(size: int, streams: int) -> list[tuple[int, int]]:
    """[offset, length) of each stream's part: contiguous, in order, covering `size`, the
    first at least the stamp's 8 bytes, the rest as even as whole bytes allow."""
    if streams < 1:
        raise ValueError("streams must be at least 1")
    size = max(size, STAMP.size)
    streams = min(streams, size // STAMP.size)
    base, extra = divmod(size, streams)
    parts, at = [], 0
    for i in range(streams):
        length = base + (1 if i < extra else 0)
        parts.append((at, length))
        at += length
    return parts


def measure(size: int, repeats: int, streams: int) -> list[float]:
    """One-way delays of `repeats` messages of `size` bytes over `streams` connections to a
    receiver process (the first message, a warm-up, dropped)."""
    parts = split(size, streams)
    buf = bytearray(max(size, STAMP.size))
    view = memoryview(buf)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    proc = procs.context().Process(
        target=serve, args=(listener.getsockname()[1], size, len(parts)), daemon=True
    )
    proc.start()
    conns: list[socket.socket] = []
    go = threading.Barrier(len(parts))
    try:
        conns = _accept(listener, len(parts))
        threads = [
            threading.Thread(target=_send_part, args=(go, conns[i], view[at : at + n]), daemon=True)
            for i, (at, n) in enumerate(parts[1:], start=1)
        ]
        for t in threads:
            t.start()
        first = view[parts[0][0] : sum(parts[0])]
        delays = []
        for _ in range(repeats + 1):
            STAMP.pack_into(buf, 0, time.perf_counter())
            if len(parts) > 1:
                go.wait(60)
            conns[0].sendall(first)
            reply = conns[0].recv(STAMP.size, socket.MSG_WAITALL)
            if len(reply) != STAMP.size:
                raise RuntimeError("the tcp receiver went away")
            delays.append(STAMP.unpack(reply)[0])
        return delays[1:]
    finally:
        go.abort()
        for conn in conns:
            conn.close()
        listener.close()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _accept(listener: socket.socket, count: int) -> list[socket.socket]:
    """The receiver's `count` connections, ordered by the index each sends first."""
    conns: list[socket.socket | None] = [None] * count
    for _ in range(count):
        conn, _ = listener.accept()
        conn.settimeout(60)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns[conn.recv(1, socket.MSG_WAITALL)[0]] = conn
    return [c for c in conns if c is not None]


def _send_part(go: threading.Barrier, conn: socket.socket, part: memoryview) -> None:
    try:
        while True:
            go.wait()
            conn.sendall(part)
    except (threading.BrokenBarrierError, OSError):
        return


def serve(port: int, size: int, streams: int) -> None:
    """The receiving process: `streams` connections, each part `recv_into` its place by
    its own thread; answers on the first once all parts are in; until EOF."""
    parts = split(size, streams)
    buf = bytearray(max(size, STAMP.size))
    view = memoryview(buf)
    conns = []
    for i in range(len(parts)):
        conn = socket.create_connection(("127.0.0.1", port), timeout=60)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(bytes([i]))
        conns.append(conn)
    done = threading.Barrier(len(parts))
    for i, (at, n) in enumerate(parts[1:], start=1):
        threading.Thread(
            target=_receive_part, args=(done, conns[i], view[at : at + n]), daemon=True
        ).start()
    first = view[parts[0][0] : sum(parts[0])]
    while _recv_whole(conns[0], first):
        if len(parts) > 1:
            done.wait()
        conns[0].sendall(STAMP.pack(time.perf_counter() - STAMP.unpack_from(buf, 0)[0]))
    done.abort()


def _receive_part(done: threading.Barrier, conn: socket.socket, part: memoryview) -> None:
    try:
        while _recv_whole(conn, part):
            done.wait()
    except (threading.BrokenBarrierError, OSError):
        return


def _recv_whole(conn: socket.socket, part: memoryview) -> bool:
    """Fill `part` from `conn`; False at EOF."""
    got = 0
    while got < len(part):
        n = conn.recv_into(part[got:])
        if n == 0:
            return False
        got += n
    return True
