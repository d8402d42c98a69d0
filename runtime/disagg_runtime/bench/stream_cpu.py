"""`disagg bench transport --cpu-messages N`: the CPU a stream of small messages costs.

A decode role streams tokens: many small payloads, one after another, none waiting for
the last. What limits it is CPU, not bandwidth, so this mode measures CPU: the sender
sends `{"x": uint8 tensor of SIZE, "i": n}` back to back (each relay's own flow control
paces it), a spawned receiver takes each one into a tensor, and both processes read their
own CPU time from the OS (`getrusage(RUSAGE_SELF)`: user + system, every thread of the
process, ZMQ's I/O threads included) around the same N messages, after a warm-up of
WARMUP messages. `cpu_us_per_message` is both ends' CPU over N; `messages_per_core_s` is
its inverse (messages a fully busy core would carry); `wall_s` is the sender's first send
to the receiver's Nth message.

The references run in the same run: `raw_unix` (the bytes whole over one AF_UNIX stream,
received into one buffer: no framing, no Python per byte) and `py_unix` (a 16-byte header
and the tensor's bytes copied in by torch; the receiver parses the header, receives the
bytes into their own buffer and makes a tensor of them in a dict: the least Python a
tensor hand-off does). Each relay row carries its CPU per message over theirs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

import torch
import zmq

from disagg_runtime.bench.peer import PY_HEADER
from disagg_runtime.bench.sizes import format_size, parse_size
from disagg_runtime.relay import Ingress, Message, auth, connect, registry

WARMUP = 500
REFERENCES = ("raw_unix", "py_unix")
RELAYS = {"shm": "shm", "tcp": "tcp", "nixl": "nixl"}
METHODS = (*REFERENCES, *RELAYS)
TIMEOUT_S = 120.0


@dataclass
class CpuRow:
    """One method's CPU for `messages` streamed messages of `size_bytes` (after warm-up)."""

    method: str
    size_bytes: int
    messages: int
    sender_cpu_s: float
    receiver_cpu_s: float
    wall_s: float
    cpu_us_per_message: float = 0.0
    messages_per_core_s: float = 0.0
    over: dict[str, float] = field(default_factory=dict)  # CPU per message over a reference's


def cpu_s() -> float:
    """This process's CPU time so far (user + system, all threads), from the OS."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def row(
    method: str, size: int, messages: int, sender: float, receiver: float, wall: float
) -> CpuRow:
    total = sender + receiver
    return CpuRow(
        method,
        size,
        messages,
        sender,
        receiver,
        wall,
        cpu_us_per_message=total / messages * 1e6,
        messages_per_core_s=messages / total if total > 0 else 0.0,
    )


def relate(rows: Iterable[CpuRow]) -> list[CpuRow]:
    """Fill each non-reference row's CPU per message over each reference's (same size)."""
    rows = list(rows)
    refs = {(r.size_bytes, r.method): r for r in rows if r.method in REFERENCES}
    for r in rows:
        if r.method in REFERENCES:
            continue
        for name in REFERENCES:
            ref = refs.get((r.size_bytes, name))
            if ref is not None and ref.cpu_us_per_message > 0:
                r.over[name] = r.cpu_us_per_message / ref.cpu_us_per_message
    return rows


def measure(method: str, size: int, messages: int) -> CpuRow:
    """Stream WARMUP + `messages` messages of `size` bytes by `method` to a new receiver."""
    if method in RELAYS:
        return _measure_relay(method, size, messages)
    if method in REFERENCES:
        return _measure_unix(method, size, messages)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def run(sizes: list[int], methods: list[str], messages: int) -> list[CpuRow]:
    torch.set_num_threads(1)
    ordered = [m for m in REFERENCES if m in methods] + [m for m in methods if m not in REFERENCES]
    return relate(measure(m, size, messages) for size in sizes for m in ordered)


# -- the receiving ends ----------------------------------------------------------------------


class _Counter:
    """Counts received messages; stamps CPU and time at the warm-up's end and at the last."""

    def __init__(self, messages: int) -> None:
        self.total = WARMUP + messages
        self.seen = 0
        self.start_cpu = self.start_t = self.end_cpu = self.end_t = 0.0
        self.done = threading.Event()

    def tick(self) -> None:
        self.seen += 1
        if self.seen == WARMUP:
            self.start_cpu, self.start_t = cpu_s(), time.perf_counter()
        elif self.seen == self.total:
            self.end_cpu, self.end_t = cpu_s(), time.perf_counter()
            self.done.set()

    def report(self) -> dict[str, float]:
        return {"cpu_s": self.end_cpu - self.start_cpu, "start": self.start_t, "end": self.end_t}


def _serve_relay(pool_size: int, messages: int, control: Connection, key: bytes) -> None:
    from disagg_runtime.memory.pool import Pool, shm_name

    torch.set_num_threads(1)
    counter = _Counter(messages)

    def on_message(msg: Message) -> None:
        payload = msg.payload
        if payload["x"].numel() < 0:  # touch the tensor as a consumer would
            raise AssertionError
        msg.release()
        counter.tick()

    ctx = zmq.Context()
    pool = Pool.create(pool_size, device="shm", name=shm_name("bench", "cpu"))
    ingress = Ingress("tcp://127.0.0.1:0", pool, context=ctx, on_message=on_message, key=key)
    try:
        control.send(ingress.endpoint)
        counter.done.wait(TIMEOUT_S)
        control.send(counter.report() if counter.done.is_set() else {})
        control.recv()  # "stop"
    finally:
        ingress.close()
        pool.close()
        ctx.term()


def _serve_unix(method: str, path: str, size: int, messages: int, control: Connection) -> None:
    """`raw_unix`: each message's bytes into one buffer; `py_unix`: header parsed, bytes
    into a fresh buffer made a tensor in a dict (as bench/peer.py `serve_py`, unanswered)."""
    counter = _Counter(messages)
    head = bytearray(PY_HEADER.size)
    buf = bytearray(size)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        while counter.seen < counter.total:
            if method == "raw_unix":
                if sock.recv_into(buf, size, socket.MSG_WAITALL) < size:
                    break
            else:
                if sock.recv_into(head, PY_HEADER.size, socket.MSG_WAITALL) < PY_HEADER.size:
                    break
                _, n = PY_HEADER.unpack(head)
                body = bytearray(n)
                if sock.recv_into(body, n, socket.MSG_WAITALL) < n:
                    break
                payload = {"x": torch.frombuffer(body, dtype=torch.uint8), "i": counter.seen}
                del payload
            counter.tick()
    control.send(counter.report() if counter.seen == counter.total else {})


# -- the sending ends ------------------------------------------------------------------------


def _finish(
    method: str, size: int, messages: int, control: Connection, sender_cpu: float, t0: float
) -> CpuRow:
    if not control.poll(TIMEOUT_S):
        raise RuntimeError(f"{method}: the receiver did not report within {TIMEOUT_S:.0f} s")
    report = control.recv()
    if not report:
        raise RuntimeError(f"{method}: the receiver did not get all {messages} messages")
    return row(method, size, messages, sender_cpu, report["cpu_s"], report["end"] - t0)


def _measure_relay(method: str, size: int, messages: int) -> CpuRow:
    from disagg_runtime.bench.transport import pool_size_for

    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    key = auth.new_key()
    proc = spawn.Process(
        target=_serve_relay, args=(pool_size_for(size), messages, child, key), daemon=True
    )
    ctx = zmq.Context()
    proc.start()
    relay = None
    try:
        if not parent.poll(60):
            raise RuntimeError(f"{method} receiver did not start")
        relay = connect(RELAYS[method], parent.recv(), context=ctx, timeout=60.0, key=key)
        x = torch.ones(size, dtype=torch.uint8)
        send = relay.send
        for i in range(WARMUP):
            send({"x": x, "i": i}, request_id=f"w{i}")
        c0, t0 = cpu_s(), time.perf_counter()
        for i in range(messages):
            send({"x": x, "i": i}, request_id=f"m{i}")
        sender_cpu = cpu_s() - c0
        return _finish(method, size, messages, parent, sender_cpu, t0)
    finally:
        if relay is not None:
            relay.close()
        parent.send("stop")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        ctx.term()


def _measure_unix(method: str, size: int, messages: int) -> CpuRow:
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    x = torch.ones(size, dtype=torch.uint8)
    message = _raw_message(size) if method == "raw_unix" else _py_message(x)
    with tempfile.TemporaryDirectory(prefix="disagg-bench-") as tmp:
        path = os.path.join(tmp, "cpu.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(60)
        proc = spawn.Process(
            target=_serve_unix, args=(method, path, size, messages, child), daemon=True
        )
        proc.start()
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(TIMEOUT_S)
                for _ in range(WARMUP):
                    conn.sendall(message())
                c0, t0 = cpu_s(), time.perf_counter()
                for _ in range(messages):
                    conn.sendall(message())
                sender_cpu = cpu_s() - c0
                return _finish(method, size, messages, parent, sender_cpu, t0)
        finally:
            listener.close()
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _raw_message(size: int) -> Callable[[], bytearray]:
    buf = bytearray(size)
    return lambda: buf


def _py_message(x: torch.Tensor) -> Callable[[], bytearray]:
    size = x.numel()

    def message() -> bytearray:
        frame = bytearray(PY_HEADER.size + size)
        PY_HEADER.pack_into(frame, 0, time.perf_counter(), size)
        torch.frombuffer(frame, dtype=torch.uint8, offset=PY_HEADER.size).copy_(x)
        return frame

    return message


def render(rows: list[CpuRow]) -> str:
    head = (
        f"{'method':<10}{'size':>8}{'messages':>10}{'tx cpu s':>10}{'rx cpu s':>10}"
        f"{'us/msg':>9}{'msg/s/core':>12}{'wall s':>8}{'x raw':>8}{'x py':>8}"
    )
    lines = ["CPU per streamed message (both processes, user + sys, from getrusage):", head]
    lines.append("-" * len(head))
    for r in rows:
        over = "".join(
            f"{r.over[name]:>8.2f}" if name in r.over else f"{'-':>8}" for name in REFERENCES
        )
        lines.append(
            f"{r.method:<10}{format_size(r.size_bytes):>8}{r.messages:>10}"
            f"{r.sender_cpu_s:>10.3f}{r.receiver_cpu_s:>10.3f}{r.cpu_us_per_message:>9.1f}"
            f"{r.messages_per_core_s:>12.0f}{r.wall_s:>8.2f}" + over
        )
    lines.append(
        f"us/msg: both ends' CPU per message; x raw, x py: over raw_unix's and py_unix's "
        f"(after {WARMUP} warm-up messages)."
    )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """`disagg bench transport --cpu-messages N [--sizes ...] [--methods ...] [--json]`."""
    nixl_missing = registry.backend("nixl").unavailable()
    try:
        if args.cpu_messages < 1:
            raise ValueError(f"--cpu-messages must be at least 1, got {args.cpu_messages}")
        if getattr(args, "device", "cpu") != "cpu":
            raise ValueError("--cpu-messages measures host payloads: --device cpu only")
        sizes = [parse_size(s) for s in (args.sizes or "4KiB").split(",") if s.strip()]
        methods = [m.strip() for m in (args.methods or "").split(",") if m.strip()]
        unknown = sorted(set(methods) - set(METHODS))
        if unknown:
            raise ValueError(
                f"unknown method(s) {', '.join(unknown)} for --cpu-messages; "
                f"choose from {', '.join(METHODS)}"
            )
        if "nixl" in methods and nixl_missing is not None:
            raise ValueError(f"nixl cannot run here: {nixl_missing}")
    except ValueError as exc:
        print(f"disagg bench transport: {exc}", file=sys.stderr)
        return 2
    if not methods:
        methods = [m for m in METHODS if m != "nixl" or nixl_missing is None]
    rows = run(sizes, methods, args.cpu_messages)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(render(rows))
    return 0
