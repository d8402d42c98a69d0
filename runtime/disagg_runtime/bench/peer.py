"""The receiving process of `disagg bench transport`: one per method, started with spawn.

Each receive is answered on a separate PUSH socket with the one-way delay the receiver
saw (the payload carries the sender's perf_counter stamp), so the parent times round
trips (payload there, tiny reply back) and one-way latency. The naive baselines are written the
way people hand-wire them: `pickle_zmq` is pyzmq's `send_pyobj`/`recv_pyobj` (pickle; a
baseline only, between this benchmark's own two processes), `copy_clone_zmq` copies on
send and clones every tensor on receive.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from disagg_runtime.bench import frames
from disagg_runtime.bench.rss import peak_rss_bytes, reset_peak, rss_bytes
from disagg_runtime.memory.copies import to_device
from disagg_runtime.memory.pool import Device, Pool, shm_name
from disagg_runtime.relay import Ingress, Message

# --device cuda: where each relay's receiver lands payloads (all end on the GPU)
GPU_POOLS: dict[str, Device] = {
    "cuda_ipc": "cuda",
    "shm": "cpu-pinned",
    "tcp": "cuda",
    "nixl": "cuda",
}


def serve(
    method: str, pool_size: int, control: Connection, device: str = "cpu", key: bytes = b""
) -> None:
    """Receive until told to stop; report endpoint first and RSS figures last."""
    torch.set_num_threads(1)
    ctx = zmq.Context()
    reply = ctx.socket(zmq.PUSH)
    reply.setsockopt(zmq.LINGER, 1000)
    reply_endpoint = control.recv()
    reply.connect(reply_endpoint)
    baseline = rss_bytes()
    reset_peak()
    ingress: Ingress | None = None
    pool: Pool | None = None
    sock: zmq.Socket[Any] | None = None
    try:
        if method in ("shm", "tcp", "cuda_ipc", "nixl"):
            pool_device: Device = "shm" if method == "shm" else "cpu"
            if device == "cuda":
                pool_device = GPU_POOLS[method]
            name = shm_name("bench", "receiver") if pool_device in ("shm", "cpu-pinned") else None
            pool = Pool.create(pool_size, device=pool_device, name=name)
            endpoint = "tcp://127.0.0.1:0"  # as roles bind, whatever the relay
            # delivered on the ingress's I/O thread, as roles receive (relay/ingress/)
            ingress = Ingress(
                endpoint,
                pool,
                context=ctx,
                on_message=_relay_reply(reply, device == "cuda"),
                key=key,
            )
            control.send(ingress.endpoint)
            control.recv()  # "stop"
        else:
            sock = ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:0")
            control.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            _baseline_loop(method, sock, reply, control)
    finally:
        if ingress is not None:
            ingress.close()
        if pool is not None:
            pool.close()
        if sock is not None:
            sock.close(linger=0)
        control.send({"rss_baseline": baseline, "rss_peak": peak_rss_bytes()})
        reply.close()
        ctx.term()


def serve_raw(path: str, nbytes: int) -> None:
    """`raw_unix`: receive `nbytes`-byte messages whole on a unix stream socket, answering
    each with the one-way delay its first 8 bytes (the sender's stamp) say; until EOF."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        while True:
            got = 0
            while got < nbytes:
                n = sock.recv_into(view[got:])
                if n == 0:
                    return
                got += n
            delay = time.perf_counter() - struct.unpack_from("d", buf, 0)[0]
            sock.sendall(struct.pack("d", delay))


PY_HEADER = struct.Struct("<dQ")  # `py_unix`: the sender's stamp, the tensor's bytes


def serve_py(path: str, _nbytes: int = 0) -> None:
    """`py_unix`: receive header + tensor messages on a unix stream socket, each into a
    tensor of its own, answering each with the one-way delay once the tensor is made."""
    head = bytearray(PY_HEADER.size)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        while True:
            if sock.recv_into(head, PY_HEADER.size, socket.MSG_WAITALL) < PY_HEADER.size:
                return
            stamp, size = PY_HEADER.unpack(head)
            if size:
                body = bytearray(size)
                if sock.recv_into(body, size, socket.MSG_WAITALL) < size:
                    return
                x = torch.frombuffer(body, dtype=torch.uint8)
            else:
                x = torch.empty(0, dtype=torch.uint8)
            payload = {"x": x, "sent": stamp}
            sock.sendall(struct.pack("d", time.perf_counter() - payload["sent"]))


def _one_way(payload: dict[str, Any]) -> bytes:
    """Seconds since the sender stamped the payload: perf_counter is CLOCK_MONOTONIC on
    Linux, one clock for every process on the machine."""
    return struct.pack("d", time.perf_counter() - payload["sent"])


def _relay_reply(reply: zmq.Socket[Any], to_gpu: bool) -> Callable[[Message], None]:
    def on_message(msg: Message) -> None:
        payload = msg.payload
        if to_gpu:  # the receiving role works on the GPU: host-staged payloads go there
            payload = to_device(payload, "cuda")
        reply.send(_one_way(payload))
        msg.release()

    return on_message


def _baseline_loop(
    method: str, sock: zmq.Socket[Any], reply: zmq.Socket[Any], control: Connection
) -> None:
    while True:
        if control.poll(0) and control.recv() == "stop":
            return
        if not sock.poll(200):
            continue
        if method == "pickle_zmq":
            payload = sock.recv_pyobj()
        else:
            decoded = frames.decode(sock.recv_multipart(copy=True))
            payload = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in decoded.items()
            }
        reply.send(_one_way(payload))
        del payload
