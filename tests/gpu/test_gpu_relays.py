"""Relays on a GPU, between this process (sender) and a `gpu_peer.py` process (receiver):
cuda-ipc correctness (every dtype incl. bf16/fp8), ordering after the producer, slot
lifetime, no leak over 1000 transfers, bandwidth against a device-to-device copy; shm and
tcp staging from GPU tensors; fallbacks; peers that die or misbehave."""

from __future__ import annotations

import base64
import logging
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from disagg_runtime.memory.pool import MiB
from disagg_runtime.relay import Relay, RelayError, auth, connect
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.backends.cuda_ipc.send import CudaIpcSender
from disagg_runtime.relay.select import relay_kind
from tests.gpu import gpu_peer as peer
from tests.gpu.test_gpu_pools import SLEEP_CYCLES, report
from tests.relay_rig import KEY, a_to_b_config, handshake, recv_reply
from tests.support import wait_for

pytestmark = pytest.mark.gpu
WAIT = 30.0
BIG = 5 * MiB + 3


@pytest.fixture(scope="module")
def remote() -> Iterator[peer.Peer]:
    p = peer.Peer()
    try:
        yield p
    finally:
        p.close()


def rig(
    remote: peer.Peer,
    pool: str,
    *,
    endpoint: str = "ipc",
    size: int = 256 * MiB,
    lease: float = 30.0,
) -> dict[str, Any]:
    return remote.call(
        "ingress", pool=pool, size=size, endpoint=endpoint, lease=lease, key=KEY.decode()
    )


@pytest.fixture(scope="module")
def cuda_rx(remote: peer.Peer) -> dict[str, Any]:
    rx = rig(remote, "cuda", size=1 << 30)
    assert rx["kind"] == "DeviceMemory"
    return rx


@pytest.fixture
def senders() -> Iterator[list[Relay]]:
    made: list[Relay] = []
    yield made
    for sender in made:
        sender.close()


def open_relay(senders: list[Relay], kind: str, endpoint: str, **options: Any) -> Relay:
    relay = connect(kind, endpoint, timeout=WAIT, key=KEY, **options)
    senders.append(relay)
    return relay


def transfer(
    remote: peer.Peer,
    rx: dict[str, Any],
    relay: Relay,
    payload: Any,
    expect: dict[str, Any],
    *,
    hold: bool = False,
) -> dict[str, Any]:
    """Register the receiver's check first, then send: it never waits for a message that
    was sent before it asked."""
    remote.ask("check", id=rx["id"], expect=expect, timeout=WAIT, hold=hold)
    relay.send(payload, request_id=f"r-{time.monotonic_ns()}")
    return remote.answer(WAIT * 2)


# -- cuda-ipc ------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["cuda", "cpu"])
def test_cuda_ipc_moves_every_dtype_bit_exact_onto_the_gpu(
    remote: peer.Peer, cuda_rx: dict[str, Any], senders: list[Relay], source: str
) -> None:
    relay = open_relay(senders, "cuda-ipc", cuda_rx["endpoint"])
    assert isinstance(relay, CudaIpcSender) and relay.mode == "cuda-ipc"
    big = transfer(
        remote, cuda_rx, relay, peer.make_payload(11, source, BIG), {"seed": 11, "big": BIG}
    )
    assert big["mismatch"] == "" and set(big["devices"]) == {"cuda"}
    small = transfer(remote, cuda_rx, relay, peer.make_payload(12, source), {"seed": 12})
    assert small["mismatch"] == ""
    # small GPU payloads stay on the GPU too; small host payloads go inline, on the host
    assert set(small["devices"]) == ({"cuda"} if source == "cuda" else {"cpu"})


def test_cuda_ipc_copies_after_the_producers_pending_work(
    remote: peer.Peer, cuda_rx: dict[str, Any], senders: list[Relay]
) -> None:
    relay = open_relay(senders, "cuda-ipc", cuda_rx["endpoint"])
    n = 64 * MiB
    x = torch.zeros(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(7)  # still queued behind the sleep when send() starts copying
    out = transfer(remote, cuda_rx, relay, {"x": x}, {"fill": 7, "n": n})
    assert out["mismatch"] == ""


def test_slots_are_held_until_the_receiver_releases(
    remote: peer.Peer, cuda_rx: dict[str, Any], senders: list[Relay]
) -> None:
    relay = open_relay(senders, "cuda-ipc", cuda_rx["endpoint"])
    payload = peer.make_payload(5, "cuda", BIG)
    held = transfer(remote, cuda_rx, relay, payload, {"seed": 5, "big": BIG}, hold=True)
    assert held["mismatch"] == "" and held["pool_used"] >= BIG
    assert remote.call("stats", id=cuda_rx["id"])["pool_used"] >= BIG
    assert remote.call("release")["released"] == 1
    assert remote.call("stats", id=cuda_rx["id"])["pool_used"] == 0


def test_no_gpu_memory_leaks_over_1000_transfers(
    remote: peer.Peer, cuda_rx: dict[str, Any], senders: list[Relay]
) -> None:
    relay = open_relay(senders, "cuda-ipc", cuda_rx["endpoint"])
    payload = {
        "x": torch.randint(0, 256, (256 << 10,), dtype=torch.uint8, device="cuda"),
        "y": torch.randn(1000, device="cuda").bfloat16(),
        "step": 0,
    }

    def burst(n: int) -> float:
        remote.ask("drain", id=cuda_rx["id"], count=n, timeout=WAIT)
        started = time.perf_counter()
        for i in range(n):
            payload["step"] = i
            relay.send(payload, request_id=f"leak-{i}")
        elapsed = time.perf_counter() - started
        remote.answer(WAIT * 4)
        return elapsed

    burst(20)  # streams, events, the mapping and the receiver's caches settle
    torch.cuda.synchronize()
    sender_before = torch.cuda.memory_allocated()
    receiver_before = remote.call("stats", id=cuda_rx["id"])
    elapsed = burst(1000)
    torch.cuda.synchronize()
    receiver_after = remote.call("stats", id=cuda_rx["id"])
    report(
        "leak_check",
        transfers=1000,
        seconds=round(elapsed, 3),
        sender_bytes=[sender_before, torch.cuda.memory_allocated()],
        receiver_bytes=[receiver_before["memory_allocated"], receiver_after["memory_allocated"]],
    )
    assert torch.cuda.memory_allocated() == sender_before
    assert receiver_after["memory_allocated"] == receiver_before["memory_allocated"]
    assert receiver_after["pool_used"] == 0
    assert receiver_after["delivered"] - receiver_before["delivered"] == 1000


def test_cuda_ipc_bandwidth_against_a_device_to_device_copy(
    remote: peer.Peer, cuda_rx: dict[str, Any], senders: list[Relay]
) -> None:
    size, repeats = 256 * MiB, 9
    x = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(x)
    d2d: list[float] = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(x)
        torch.cuda.synchronize()
        d2d.append(time.perf_counter() - t0)
    relay = open_relay(senders, "cuda-ipc", cuda_rx["endpoint"])
    remote.ask("drain", id=cuda_rx["id"], count=repeats + 1, timeout=WAIT)
    ipc: list[float] = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        relay.send({"x": x}, request_id=f"bw-{i}")  # returns once the receiver holds it
        ipc.append(time.perf_counter() - t0)
    remote.answer(WAIT)
    d2d_gbps = size / statistics.median(d2d[1:]) / 1e9
    ipc_gbps = size / statistics.median(ipc[1:]) / 1e9
    report(
        "cuda_ipc_bandwidth",
        size=size,
        d2d_gbps=round(d2d_gbps, 1),
        cuda_ipc_gbps=round(ipc_gbps, 1),
        ratio=round(ipc_gbps / d2d_gbps, 3),
        cuda_ipc_median_ms=round(statistics.median(ipc[1:]) * 1e3, 3),
    )
    assert ipc_gbps > 10, "cuda-ipc is slower than host staging would be"


# -- staging through host memory from GPU tensors ---------------------------------------------


@pytest.mark.parametrize(
    ("kind", "pool", "endpoint", "lands_on"),
    [
        ("shm", "cpu-pinned", "ipc", "cpu"),  # D2H straight into the receiver's pinned pool
        ("shm", "shm", "ipc", "cpu"),  # ... into a plain shared pool (we pin our mapping)
        ("tcp", "cpu", "tcp", "cpu"),  # pinned staging, then chunks
        ("tcp", "cuda", "tcp", "cuda"),  # chunks through the receiver's bounce buffer
    ],
)
def test_host_relays_carry_gpu_tensors_bit_exact(
    remote: peer.Peer, senders: list[Relay], kind: str, pool: str, endpoint: str, lands_on: str
) -> None:
    rx = rig(remote, pool, endpoint=endpoint, size=64 * MiB)
    relay = open_relay(senders, kind, rx["endpoint"])
    for seed in (21, 22):
        out = transfer(
            remote, rx, relay, peer.make_payload(seed, "cuda", BIG), {"seed": seed, "big": BIG}
        )
        assert out["mismatch"] == "" and set(out["devices"]) == {lands_on}
    host = transfer(remote, rx, relay, peer.make_payload(23, "cpu", BIG), {"seed": 23, "big": BIG})
    assert host["mismatch"] == ""


def test_cuda_ipc_to_a_host_pool_falls_back_to_its_shared_memory(
    remote: peer.Peer, senders: list[Relay], caplog: pytest.LogCaptureFixture
) -> None:
    rx = rig(remote, "cpu-pinned", size=64 * MiB)
    with caplog.at_level(logging.WARNING, logger="disagg_runtime.relay.backends.cuda_ipc.send"):
        relay = open_relay(senders, "cuda-ipc", rx["endpoint"])
    assert isinstance(relay, CudaIpcSender) and relay.mode == "shm"
    assert any("cpu-pinned memory" in r.getMessage() for r in caplog.records)
    out = transfer(remote, rx, relay, peer.make_payload(31, "cuda", BIG), {"seed": 31, "big": BIG})
    assert out["mismatch"] == "" and set(out["devices"]) == {"cpu"}


def test_relay_kind_picks_cuda_ipc_for_same_gpu_peers() -> None:
    config = a_to_b_config(same_gpu_peers=frozenset({"b"}))
    assert relay_kind(config, "b", "auto") == "cuda-ipc"
    assert relay_kind(config, "b", "cuda-ipc") == "cuda-ipc"
    assert relay_kind(config, "b", "tcp") == "tcp"


# -- peers that die or misbehave ---------------------------------------------------------------


class Raw:
    """A bare DEALER speaking the relay protocol by hand."""

    def __init__(self, endpoint: str) -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, auth.routing_id())
        self.sock.connect(endpoint)

    def send(self, op: str, **fields: Any) -> None:
        self.sock.send(proto.pack(op, **fields))

    def reply(self) -> dict[str, Any]:
        return recv_reply(self.sock)  # `load` reports skipped

    def close(self) -> None:
        self.sock.close(linger=0)


def test_a_sender_that_never_commits_loses_its_slot_after_the_lease(remote: peer.Peer) -> None:
    rx = rig(remote, "cuda", size=16 * MiB, lease=1.0)
    raw = Raw(rx["endpoint"])
    try:
        assert "cuda" in handshake(raw.sock, relay="cuda-ipc")  # the pool is exported to us
        raw.send("reserve", rid="gone", xid=1, nbytes=4 * MiB, wait_s=5.0)
        assert raw.reply()["op"] == "grant"
        assert remote.call("stats", id=rx["id"])["pool_used"] >= 4 * MiB
        wait_for(lambda: remote.call("stats", id=rx["id"])["pool_used"] == 0, 10)
    finally:
        raw.close()


def test_bad_event_handles_are_nacked_and_their_slots_come_back(
    remote: peer.Peer, senders: list[Relay]
) -> None:
    rx = rig(remote, "cuda", size=16 * MiB, lease=1.0)
    raw = Raw(rx["endpoint"])
    manifest = {
        "v": 1,
        "tree": {"t": 0},
        "nbytes": 16,
        "tensors": [{"dtype": "uint8", "shape": [16], "offset": 0}],
    }
    try:
        handshake(raw.sock, relay="cuda-ipc")
        for xid, event in [
            (1, base64.b64encode(bytes(64)).decode()),  # well-formed, but no such event
            (2, "AAAA"),  # not 64 bytes
            (3, 12345),  # not a string
        ]:
            raw.send("reserve", rid=f"bad-{xid}", xid=xid, nbytes=MiB, wait_s=5.0)
            grant = raw.reply()
            assert grant["op"] == "grant"
            commit = {"rid": f"bad-{xid}", "xid": xid, "offset": grant["offset"]}
            raw.send("commit", **commit, manifest=manifest, event=event)
            nack = raw.reply()
            assert nack["op"] == "nack" and nack["xid"] == xid
        # quarantined for a lease (a copy might still land), then free again
        wait_for(lambda: remote.call("stats", id=rx["id"])["pool_used"] == 0, 10)
        assert remote.call("stats", id=rx["id"])["rejected"] >= 3
    finally:
        raw.close()
    relay = open_relay(senders, "cuda-ipc", rx["endpoint"])  # still serving
    out = transfer(remote, rx, relay, peer.make_payload(41, "cuda", MiB), {"seed": 41, "big": MiB})
    assert out["mismatch"] == ""


def test_a_receiver_that_dies_fails_the_send_in_time() -> None:
    dying = peer.Peer()
    try:
        rx = rig(dying, "cuda", size=64 * MiB)
        relay = connect("cuda-ipc", rx["endpoint"], timeout=3.0, key=KEY)
        try:
            ok = transfer(
                dying, rx, relay, peer.make_payload(51, "cuda", BIG), {"seed": 51, "big": BIG}
            )
            assert ok["mismatch"] == ""
            dying.kill()
            started = time.monotonic()
            with pytest.raises(RelayError):
                relay.send(
                    peer.make_payload(52, "cuda", BIG), request_id="after-death", timeout=3.0
                )
            assert time.monotonic() - started < 10
        finally:
            relay.close()  # unmaps the dead receiver's pool
    finally:
        dying.close()
