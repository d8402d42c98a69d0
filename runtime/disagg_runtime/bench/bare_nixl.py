"""`nixl_cma`, `nixl_tcp`: bare NIXL, the peer a user would wire by hand. Two processes of
their own (UCX reads its transport settings when each agent starts): the receiver
registers a buffer and hands its metadata over; the sender registers its tensor once and
per message makes one WRITE of it with a notification carrying its stamp, and polls it to
DONE; the receiver polls for notifications (as NIXL's users do) and answers each with the
one-way delay it saw; the sender progresses its worker until then (else a notification
waits for UCX's next progress, ~8 ms). UCX is pinned to loopback: `cma` (cross-memory
attach for the data, tcp for UCX's own messages: its shared-memory ones lack the peer
failure handling NIXL asks for) or `tcp` alone.
"""

from __future__ import annotations

import importlib
import os
import struct
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from disagg_runtime.bench import procs

UCX = {
    "nixl_cma": {"UCX_TLS": "cma,tcp", "UCX_NET_DEVICES": "lo"},
    "nixl_tcp": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"},
}
STAMP = struct.Struct("d")
STOP = b"stop"
WAIT_S = 60.0


def measure(method: str, size: int, repeats: int) -> list[float]:
    """One-way delays of `repeats` WRITEs (+ notification) of `size` bytes (warm-up dropped)."""
    mp_ctx = procs.context()
    rx_control, rx_end = mp_ctx.Pipe()
    tx_control, tx_end = mp_ctx.Pipe()
    answers, asks = mp_ctx.Pipe()
    rx = mp_ctx.Process(target=_receive, args=(UCX[method], size, rx_end, answers), daemon=True)
    tx = mp_ctx.Process(target=_send, args=(UCX[method], size, repeats, tx_end, asks), daemon=True)
    rx.start()
    try:
        offer = _answer(rx_control, f"{method} receiver")
        tx.start()
        tx_control.send(offer)
        delays = _answer(tx_control, f"{method} sender")
        assert isinstance(delays, list)
        return delays
    finally:
        for proc in (tx, rx):
            if proc.pid is not None:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()


def _answer(conn: Connection, who: str) -> Any:
    if not conn.poll(WAIT_S):
        raise RuntimeError(f"{who} did not answer within {WAIT_S:.0f} s")
    got = conn.recv()
    if isinstance(got, str):
        raise RuntimeError(f"{who}: {got}")
    return got


def _agent(env: dict[str, str], name: str) -> Any:
    os.environ.update(env)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from disagg_runtime.relay.backends import nixl_libs

    nixl_libs.isolate_system_libnl()
    api: Any = importlib.import_module("nixl._api")

    config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    return api.nixl_agent(name, config)


def _receive(env: dict[str, str], size: int, control: Connection, answers: Connection) -> None:
    torch.set_num_threads(1)
    try:
        agent = _agent(env, "bench-rx")
        dst = torch.zeros(max(size, 1), dtype=torch.uint8)
        agent.register_memory(dst)
        control.send({"agent": bytes(agent.get_agent_metadata()), "addr": dst.data_ptr()})
    except Exception as exc:
        control.send(f"{type(exc).__name__}: {exc}")
        return
    deadline = time.monotonic() + 10 * WAIT_S
    while time.monotonic() < deadline:
        os.sched_yield()
        for messages in agent.get_new_notifs().values():
            for msg in messages:
                if msg == STOP:
                    return
                now = time.perf_counter()
                answers.send_bytes(STAMP.pack(now - STAMP.unpack(msg)[0]))


def _send(
    env: dict[str, str], size: int, repeats: int, control: Connection, asks: Connection
) -> None:
    torch.set_num_threads(1)
    try:
        agent = _agent(env, "bench-tx")
        src = torch.ones(max(size, 1), dtype=torch.uint8)
        agent.register_memory(src)
        offer = control.recv()
        remote = agent.add_remote_agent(offer["agent"])
        remote = remote.decode() if isinstance(remote, bytes) else str(remote)
        local = agent.get_xfer_descs([(src.data_ptr(), size, 0)], "DRAM")
        far = agent.get_xfer_descs([(offer["addr"], size, 0)], "DRAM")
        delays = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            handle = agent.initialize_xfer("WRITE", local, far, remote, STAMP.pack(t0))
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"transfer state {state}")
            waited = time.monotonic() + WAIT_S
            while not asks.poll(0):  # progressing the worker sends the notification
                agent.get_new_notifs()
                os.sched_yield()  # a busy poll, yielding to whatever else must run here
                if time.monotonic() > waited:
                    raise RuntimeError("the receiver saw no notification")
            delays.append(STAMP.unpack(asks.recv_bytes())[0])
        agent.send_notif(remote, STOP)
        control.send(delays[1:])
    except Exception as exc:
        control.send(f"{type(exc).__name__}: {exc}")
