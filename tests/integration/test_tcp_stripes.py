"""Striped tcp payloads (relay/backends/tcp/stripe_*.py) between real processes: a sender
process streams large payloads over parallel connections into this process's ingress.

What must hold: odd-sized payloads land bit-exact; a stripe connection killed mid-payload
fails it whole (the slot freed, nothing partial delivered) and the sender sends it again;
a sender killed mid-payload leaves no slot held; a connection that proves no key gets
nothing (no thread, no slot); the stream count is bounded at both ends."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from disagg_runtime.memory.pool import MiB, Pool
from disagg_runtime.relay import Ingress, auth
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.backends.tcp import TcpLanding, TcpSender, stripe_accept, stripe_plan
from disagg_runtime.relay.backends.tcp.stripe_accept import HELLO_PREFIX, NONCE_CHARS
from disagg_runtime.relay.backends.tcp.stripe_land import StripeHub
from disagg_runtime.relay.ledger import Message
from tests.payload_checks import assert_bit_exact
from tests.relay_rig import KEY, WAIT
from tests.support import wait_for

ODD = [8 * MiB + 13, 21 * MiB + 4097, 33 * MiB + 1]  # none a multiple of a stripe or a page


def payload(nbytes: int, seed: int) -> dict[str, Any]:
    """A payload of several tensors (one empty) whose bytes depend on `seed`."""
    g = torch.Generator().manual_seed(seed)
    head = nbytes // 3
    return {
        "a": torch.randint(0, 256, (head,), dtype=torch.uint8, generator=g),
        "empty": torch.zeros(0, dtype=torch.float32),
        "b": torch.randint(0, 256, (nbytes - head - 4 * 5,), dtype=torch.uint8, generator=g),
        "c": torch.randn(5, generator=g),
    }


def send_process(
    endpoint: str, sizes: list[int], streams: int, key: bytes, out: Connection
) -> None:
    """The sender: each payload in turn, then what it saw (resent count, errors)."""
    sender = TcpSender(endpoint, key=key, streams=streams, timeout=WAIT)
    try:
        if max(sizes) >= stripe_plan.STREAMS_MIN:  # else: never opened
            assert sender.open_streams(WAIT)
        for i, size in enumerate(sizes):
            sender.send(payload(size, i), request_id=f"r{i}")
        out.send({"resent": sender.resent, "open": sender._stripes.open if sender._stripes else 0})
    except Exception as exc:  # reported to the test
        out.send({"error": repr(exc)})
    finally:
        sender.close()


class Receiver:
    """This process's ingress over a cpu pool, keeping what it delivers."""

    def __init__(self, pool_bytes: int) -> None:
        self.pool = Pool.create(pool_bytes, device="cpu", min_block=MiB)
        self.got: list[Message] = []
        self.ingress = Ingress(
            "tcp://127.0.0.1:0", self.pool, key=KEY, on_message=self.got.append, lease_s=10.0
        )

    @property
    def hub(self) -> StripeHub:
        landing = wait_for(lambda: self.ingress._landings.get("tcp"))  # at the first hello
        assert isinstance(landing, TcpLanding)
        hub = landing.stripes
        assert isinstance(hub, StripeHub)
        return hub

    def close(self) -> None:
        for msg in self.got:
            msg.release()
        self.ingress.close()
        self.pool.close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(256 * MiB)
    yield r
    r.close()


def start_sender(endpoint: str, sizes: list[int], streams: int = 2) -> tuple[Any, Connection]:
    ours, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=send_process, args=(endpoint, sizes, streams, KEY, theirs), daemon=True
    )
    proc.start()
    return proc, ours


def finish(proc: Any, conn: Connection) -> dict[str, Any]:
    assert conn.poll(60), "the sender process reported nothing"
    report: dict[str, Any] = conn.recv()
    proc.join(30)
    return report


def test_odd_sizes_land_bit_exact_over_parallel_streams(receiver: Receiver) -> None:
    proc, conn = start_sender(receiver.ingress.endpoint, ODD, streams=3)
    report = finish(proc, conn)
    assert report == {"resent": 0, "open": 3}
    assert [m.request_id for m in receiver.got] == ["r0", "r1", "r2"]
    for i, (msg, size) in enumerate(zip(receiver.got, ODD, strict=True)):
        assert_bit_exact(msg.payload, payload(size, i))
    assert receiver.hub.landed == 3 and receiver.hub.failed == 0


def test_small_payloads_stay_on_one_stream(receiver: Receiver) -> None:
    """Under STREAMS_MIN nothing opens a stripe connection (inline or ZMQ chunks, as before)."""
    proc, conn = start_sender(receiver.ingress.endpoint, [4096, MiB, 2 * MiB + 5])
    assert finish(proc, conn) == {"resent": 0, "open": 0}
    assert receiver.hub.connections() == 0 and receiver.hub.landed == 0
    for i, (msg, size) in enumerate(zip(receiver.got, [4096, MiB, 2 * MiB + 5], strict=True)):
        assert_bit_exact(msg.payload, payload(size, i))


def _shut_one_mid_payload(hub: StripeHub, index: int) -> None:
    """Shut (our end of) stripe connection `index` once a stripe is being received."""
    wait_for(lambda: hub.writing() == 2, timeout=30, interval=0.001)
    with hub._cond:
        conns = [c for by in hub._conns.values() for c in by.values() if c.index == index]
    assert conns
    conns[0].sock.shutdown(socket.SHUT_RDWR)


def test_a_stripe_connection_killed_mid_payload_fails_it_whole_and_it_is_sent_again(
    receiver: Receiver,
) -> None:
    size = 120 * MiB + 7
    proc, conn = start_sender(receiver.ingress.endpoint, [size])
    _shut_one_mid_payload(receiver.hub, 1)
    report = finish(proc, conn)
    assert report["resent"] == 1, report  # over ZMQ, after the receiver freed the slot
    assert receiver.hub.failed == 1 and receiver.hub.landed == 0
    assert [m.request_id for m in receiver.got] == ["r0"]  # once, whole
    assert_bit_exact(receiver.got[0].payload, payload(size, 0))
    receiver.got.pop().release()
    wait_for(lambda: receiver.pool.stats().used == 0)  # no slot leaked


def test_a_sender_killed_mid_payload_leaves_no_slot_held(receiver: Receiver) -> None:
    proc, _conn = start_sender(receiver.ingress.endpoint, [120 * MiB + 7])
    wait_for(lambda: receiver.hub.writing() > 0, timeout=30)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    wait_for(lambda: receiver.hub.failed == 1)
    wait_for(lambda: receiver.pool.stats().used == 0)
    assert receiver.got == []  # nothing partial delivered
    wait_for(lambda: receiver.hub.connections() == 0)


def _stripe_conn(port: int) -> tuple[socket.socket, str]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    nonce = b""
    while len(nonce) < NONCE_CHARS:
        got = sock.recv(NONCE_CHARS - len(nonce))
        assert got, "closed before the nonce"
        nonce += got
    return sock, nonce.decode()


def _hello(token: str, index: int, mac: str) -> bytes:
    hello = proto.pack("stripe", id=token, index=index, mac=mac)
    return HELLO_PREFIX.pack(len(hello)) + hello


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _welcome(receiver: Receiver) -> tuple[TcpSender, int, str]:
    sender = TcpSender(receiver.ingress.endpoint, key=KEY, timeout=WAIT)
    assert sender._stripes is not None
    return sender, sender._stripes._port, sender._stripes._token


def stripe_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "disagg-tcp-stripe")


def test_connections_that_prove_no_key_get_nothing(receiver: Receiver) -> None:
    sender, port, token = _welcome(receiver)
    try:
        threads = stripe_threads()
        refused = receiver.hub.refusals.count
        other = auth.new_key()
        tries: list[bytes] = []
        sock, nonce = _stripe_conn(port)  # a valid hello replayed on another connection
        replayed = _hello(token, 0, auth.mac(KEY, "stripe", token, "0", nonce))
        sock.close()
        tries.append(replayed)
        tries.append(b"\xff\xff\xff\xff garbage")  # a length over the limit
        tries.append(_hello(token, 0, "00" * 32))  # bad mac
        tries.append(_hello("not-a-token", 0, "00"))
        for hello in tries:
            sock, nonce = _stripe_conn(port)
            with sock:
                sock.sendall(hello)
                assert _closed_by_peer(sock)
        sock, nonce = _stripe_conn(port)  # the right form under another key
        with sock:
            sock.sendall(_hello(token, 0, auth.mac(other, "stripe", token, "0", nonce)))
            assert _closed_by_peer(sock)
        wait_for(lambda: receiver.hub.refusals.count >= refused + 5)
        assert receiver.hub.connections() == 0
        assert stripe_threads() == threads
        assert receiver.pool.stats().used == 0
    finally:
        sender.close()


def test_silent_strangers_are_bounded_and_timed_out(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stripe_accept, "STRANGER_S", 0.5)
    sender, port, _ = _welcome(receiver)
    silent = [_stripe_conn(port)[0] for _ in range(stripe_accept.MAX_STRANGERS)]
    try:
        extra = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        with extra:  # over the bound: closed at once, no nonce
            assert _closed_by_peer(extra)
        for sock in silent:  # then each closed for saying nothing in time
            assert _closed_by_peer(sock)
        assert receiver.hub.connections() == 0
    finally:
        for sock in silent:
            sock.close()
        sender.close()


def test_stream_bounds(receiver: Receiver) -> None:
    for bad in (0, stripe_plan.MAX_STREAMS + 1):
        with pytest.raises(ValueError, match="streams"):
            TcpSender(receiver.ingress.endpoint, key=KEY, streams=bad)
    sender, port, token = _welcome(receiver)
    try:
        most = receiver.hub.max_streams
        sock, nonce = _stripe_conn(port)  # an index past the receiver's bound
        with sock:
            mac = auth.mac(KEY, "stripe", token, str(most), nonce)
            sock.sendall(_hello(token, most, mac))
            assert _closed_by_peer(sock)
        assert receiver.hub.connections() == 0
        # the most streams a sender may use: every one of them carries a stripe
        proc, conn = start_sender(receiver.ingress.endpoint, [40 * MiB + 3], streams=most)
        assert finish(proc, conn) == {"resent": 0, "open": most}
        assert_bit_exact(receiver.got[0].payload, payload(40 * MiB + 3, 0))
        assert stripe_plan.stream_count(40 * MiB + 3, most) == most
    finally:
        sender.close()


def test_a_commit_for_more_streams_than_open_is_refused_and_sent_again(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender = TcpSender(receiver.ingress.endpoint, key=KEY, streams=2, timeout=WAIT)
    try:
        assert sender.open_streams(WAIT)
        sender.send(payload(16 * MiB, 0), request_id="first")
        assert receiver.hub.landed == 1
        once = iter([3])  # one commit for 3 stripes over the 2 connections open
        monkeypatch.setattr(sender, "_stream_count", lambda nbytes: next(once, 0))
        sender.send(payload(16 * MiB, 1), request_id="second")
        assert sender.resent == 1  # refused ("stripe connection 2 is not open"), then ZMQ
        assert receiver.ingress.stats().rejected == 1 and receiver.hub.landed == 1
        assert [m.request_id for m in receiver.got] == ["first", "second"]
        assert_bit_exact(receiver.got[1].payload, payload(16 * MiB, 1))
        wait_for(lambda: receiver.hub.connections() == 0)  # the receiver shut them
        while receiver.got:
            receiver.got.pop().release()
        wait_for(lambda: receiver.pool.stats().used == 0)  # the refused commit's slot too
    finally:
        sender.close()


def test_the_first_large_payload_does_not_wait_for_the_streams(receiver: Receiver) -> None:
    """Stripe connections open in the background: the payload that asked goes over ZMQ,
    the next ones striped once they are up."""
    sender = TcpSender(receiver.ingress.endpoint, key=KEY, streams=2, timeout=WAIT)
    try:
        sender.send(payload(16 * MiB, 0), request_id="first")
        wait_for(lambda: receiver.hub.connections() == 2)
        wait_for(lambda: sender._stripes is not None and sender._stripes.open == 2)
        sender.send(payload(16 * MiB, 1), request_id="second")
        assert receiver.hub.landed == 1  # the second one
        for i, msg in enumerate(receiver.got):
            assert_bit_exact(msg.payload, payload(16 * MiB, i))
    finally:
        sender.close()


def test_an_unreachable_stripe_port_leaves_payloads_on_zmq(receiver: Receiver) -> None:
    """A port the network filters (here: closed) costs no payload a stall or a failure."""
    sender, _port, _ = _welcome(receiver)
    try:
        assert sender._stripes is not None
        sender._stripes._port = _closed_port()
        assert not sender.open_streams(1.0)
        for i in range(3):
            sender.send(payload(16 * MiB, i), request_id=f"r{i}")
        assert [m.request_id for m in receiver.got] == ["r0", "r1", "r2"]
        assert receiver.hub.landed == 0 and sender._stripes.open == 0
    finally:
        sender.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
