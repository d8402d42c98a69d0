"""What an authenticated sender can make an ingress hold, and how soon it lets go (issue 30
items 9, 14, 16), against real ingresses, senders and sockets on loopback.

- Reservations do not outlive their senders: their wait is clamped to a lease, what waits
  is bounded in all (count and bytes, beyond each sender's own bound), and a sender that
  leaves (its connection or its lane closes) takes its waiting reservations with it, so
  its grants never hold the pool.
- An inline payload over ZMQ that finds the inline budget full is answered `overloaded`
  at once, and a sender then reserves it instead (nothing lost, counted).
- A welcome naming a pool no pool of ours can have is a refusal (NotAPeer), counted.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import zmq

from disagg_core.contract import Peer
from disagg_runtime.client import Client, RequestOverloaded
from disagg_runtime.memory.pool import MiB
from disagg_runtime.relay import Message, NotAPeer, Overloaded, auth, connect, lane
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.ledger import PENDING_POOLS, PENDING_POOLS_PER_PEER
from disagg_runtime.relay.sender import Sender
from disagg_runtime.routing.peers import RelayCache
from tests.integration.test_relay_lane import inline_frame, raw_sender
from tests.relay_rig import KEY, WAIT, KiB, Rig, filled, handshake, recv_reply
from tests.support import wait_until


def hold_pool(rig: Rig, **options: Any) -> tuple[Any, int]:
    """An ingress whose whole pool is taken (nothing can be granted), and that hold."""
    ingress = rig.ingress("tcp", **options)
    hold = ingress.pool.allocate(ingress.pool.allocator.capacity)
    assert hold is not None
    return ingress, hold


# -- item 9: reservations outlive their senders ----------------------------------------------


def test_a_reservations_wait_is_clamped_to_the_lease(rig: Rig) -> None:
    ingress, _ = hold_pool(rig, lease_s=1.0)
    raw = rig.raw(ingress)
    raw.send(proto.pack("reserve", rid="r", xid=1, nbytes=MiB, wait_s=86_400))
    denial = recv_reply(raw, timeout=5.0)  # a lease (1 s), not the day it asked for
    assert (denial["op"], denial["xid"], denial.get("timeout")) == ("deny", 1, True)
    assert ingress.stats().pending_reservations == 0


def test_what_waits_is_bounded_in_all_and_the_rest_is_told_overloaded(rig: Rig) -> None:
    """Each sender may have PENDING_POOLS_PER_PEER pools' worth waiting; all together
    PENDING_POOLS pools' worth. Beyond that, anyone is told `overloaded` at once (a
    sender raises Overloaded, a RelayTimeout: retry later or elsewhere) and it is counted."""
    ingress, hold = hold_pool(rig)
    capacity = ingress.pool.allocator.capacity
    nbytes = capacity // 4
    per_sender = PENDING_POOLS_PER_PEER * 4
    senders = PENDING_POOLS // PENDING_POOLS_PER_PEER  # just enough to reach the total
    socks = [rig.raw(ingress) for _ in range(senders)]
    for sock in socks:
        for xid in range(per_sender):
            sock.send(proto.pack("reserve", rid="wait", xid=xid, nbytes=nbytes, wait_s=60))
    wait_until(lambda: ingress.stats().pending_reservations == senders * per_sender)
    assert ingress.stats().rejected == 0 and ingress.stats().overloaded == 0
    late = rig.raw(ingress)
    late.send(proto.pack("reserve", rid="late", xid=1, nbytes=nbytes, wait_s=60))
    denial = recv_reply(late, timeout=2.0)  # at once, not after its wait
    assert denial["op"] == "deny" and denial.get("overloaded") is True
    assert "overloaded" in denial["reason"] and ingress.stats().overloaded == 1
    sender = rig.sender("tcp", ingress, inline_max=0, timeout=WAIT)
    assert isinstance(sender, Sender)
    started = time.monotonic()
    with pytest.raises(Overloaded, match="overloaded"):
        sender.send(filled(nbytes), request_id="told")
    assert time.monotonic() - started < WAIT / 2 and sender.overloaded == 1
    socks[0].send(proto.pack("abort", rid="wait"))
    wait_until(lambda: ingress.stats().pending_reservations == 0)
    ingress.pool.free(hold)
    sender.send(filled(nbytes, 3), request_id="room")  # served again
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "room"


def test_a_client_told_overloaded_raises_request_overloaded_at_once(rig: Rig) -> None:
    """Through the client, the entry role's `overloaded` is RequestOverloaded (a gateway's
    429 with Retry-After), not a 503 after the request's whole timeout."""
    ingress, hold = hold_pool(rig)
    capacity = ingress.pool.allocator.capacity
    for _ in range(PENDING_POOLS // PENDING_POOLS_PER_PEER):
        sock = rig.raw(ingress)
        for xid in range(PENDING_POOLS_PER_PEER):
            sock.send(proto.pack("reserve", rid="wait", xid=xid, nbytes=capacity, wait_s=60))
    wait_until(lambda: ingress.stats().pending_reservations == PENDING_POOLS)
    port = ingress.endpoint.rsplit(":", 1)[1]
    client = Client([Peer("r", (f"127.0.0.1:{port}",))], ["r"], key=KEY, timeout=WAIT)
    try:
        started = time.monotonic()
        with pytest.raises(RequestOverloaded) as caught:
            client.submit(filled(2 * MiB))  # reserved: over the tcp inline limit
        assert caught.value.error["reason"] == "overloaded"
        assert time.monotonic() - started < WAIT / 2
    finally:
        client.close()
    ingress.pool.free(hold)


def test_a_sender_that_leaves_takes_its_waiting_reservations_with_it(rig: Rig) -> None:
    """A sender (with the key) reserves a full pool's worth and leaves. Its reservations
    are dropped within a keepalive, not granted later to hold the pool for a lease each,
    and a good sender is served at once when room comes."""
    ingress, hold = hold_pool(rig, lease_s=30.0)
    gone = rig.raw(ingress)
    for xid in range(8):
        gone.send(proto.pack("reserve", rid="gone", xid=xid, nbytes=MiB, wait_s=30))
    wait_until(lambda: ingress.stats().pending_reservations == 8)
    gone.close(linger=0)  # crashed: its connection closes, nothing more is said
    wait_until(lambda: ingress.stats().pending_reservations == 0, timeout=5.0)
    ingress.pool.free(hold)
    good = rig.sender("tcp", ingress, inline_max=0, timeout=5.0)  # far below the lease
    good.send(filled(4 * MiB), request_id="good")
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "good"
    wait_until(lambda: ingress.pool.stats().used == 0)


def test_a_grant_for_a_sender_that_left_is_freed_at_once(rig: Rig) -> None:
    """Room comes before the ingress noticed the sender left: its grant cannot be sent,
    so the slot is freed there and then and the next reservation gets it."""
    ingress = rig.ingress("tcp", lease_s=30.0)
    capacity = ingress.pool.allocator.capacity
    hold = ingress.pool.allocate(capacity)
    assert hold is not None
    gone = rig.raw(ingress)
    gone.send(proto.pack("reserve", rid="gone", xid=1, nbytes=capacity, wait_s=30))
    wait_until(lambda: ingress.stats().pending_reservations == 1)
    good = rig.raw(ingress)
    good.send(proto.pack("reserve", rid="good", xid=1, nbytes=capacity, wait_s=30))
    wait_until(lambda: ingress.stats().pending_reservations == 2)
    gone.close(linger=0)
    time.sleep(0.05)  # libzmq has seen it close; the ingress may not have looked yet
    ingress.pool.free(hold)
    grant = recv_reply(good, timeout=5.0)  # not after the first one's lease (30 s)
    assert (grant["op"], grant["xid"]) == ("grant", 1)
    good.send(proto.pack("cancel", xid=1))
    wait_until(lambda: ingress.pool.stats().used == 0)


def test_a_control_lane_that_closes_takes_its_senders_waiting_reservations(rig: Rig) -> None:
    """The replies of a sender with a control lane come there: once it closes, nothing can
    take a grant, so what it waits for is dropped (its ZMQ connection may stay)."""
    ingress = rig.ingress("shm", lease_s=30.0)
    hold = ingress.pool.allocate(ingress.pool.allocator.capacity)
    assert hold is not None
    dealer, sock = raw_sender(rig, ingress, control=True)
    for xid in range(3):
        lane.send_frame(sock, proto.pack("reserve", rid="r", xid=xid, nbytes=MiB), b"")
    wait_until(lambda: ingress.stats().pending_reservations == 3)
    sock.close()
    wait_until(lambda: ingress.stats().pending_reservations == 0, timeout=5.0)
    denials = [recv_reply(dealer) for _ in range(3)]  # over ZMQ, in case it still reads
    assert {d["op"] for d in denials} == {"deny"} and "lane closed" in denials[0]["reason"]
    ingress.pool.free(hold)


# -- item 14: a full inline budget over ZMQ ---------------------------------------------------


def test_an_inline_payload_over_zmq_finding_the_budget_full_is_answered_overloaded(
    rig: Rig,
) -> None:
    held: list[Message] = []
    ingress = rig.ingress("tcp", on_message=held.append, inline_budget=64 * KiB)
    raw = rig.raw(ingress)
    header, data = inline_frame("first", b"\x01" * (48 * KiB))
    raw.send_multipart([header, data])  # fits: taken and held
    wait_until(lambda: len(held) == 1)
    # with an xid, a verdict either way; without one, only the refusal is answered
    for n, extra in enumerate(({"xid": 7}, {})):
        manifest = proto.unpack(header, proto.OPS_TO_INGRESS)["manifest"]
        full = proto.pack("inline", rid=f"full-{n}", manifest=manifest, **extra)
        raw.send_multipart([full, data])
        answer = recv_reply(raw, timeout=2.0)  # at once: its sender need not wait it out
        assert answer["op"] == "overloaded" and answer["rid"] == f"full-{n}"
        assert answer.get("xid") == extra.get("xid") and "inline budget" in answer["reason"]
    stats = ingress.stats()
    assert stats.overloaded == 2 and stats.rejected == 0 and stats.inline_used == len(data)
    held.pop().release()
    fits = proto.pack("inline", rid="fits", manifest=manifest, xid=8)
    raw.send_multipart([fits, data])
    assert recv_reply(raw)["op"] == "ack"
    wait_until(lambda: [m.request_id for m in held] == ["fits"])
    held.pop().release()
    assert ingress.stats().inline_used == 0 and ingress.pool.stats().used == 0


def test_a_sender_over_zmq_reserves_what_the_full_inline_budget_refused(rig: Rig) -> None:
    """Without a lane nothing stalls a sender of inline payloads: the ones the budget
    refuses are answered `overloaded` and sent again through a reservation, so none is
    lost, and they come in order."""
    got: list[Message] = []
    releasing = threading.Event()

    def on_message(msg: Message) -> None:
        got.append(msg)
        if releasing.is_set():
            msg.release()

    ingress = rig.ingress("tcp", on_message=on_message, inline_budget=512 * KiB, min_block=64 * KiB)
    sender = rig.sender("tcp", ingress, lane=False)
    assert isinstance(sender, Sender)
    payloads = [filled(60 * KiB, i % 250) for i in range(40)]  # 2.4 MiB: 5x the budget
    for i, payload in enumerate(payloads):
        sender.send(payload, request_id=f"m{i}")
    wait_until(lambda: len(got) == len(payloads))
    assert [m.request_id for m in got] == [f"m{i}" for i in range(len(payloads))]
    for msg, payload in zip(got, payloads, strict=True):
        assert torch.equal(msg.payload["x"], payload["x"])
    inline = [m for m in got if m.slot is None]
    assert inline and len(inline) < len(got)  # the budget took some, the pool the rest
    assert sender.overloaded == len(got) - len(inline) == ingress.stats().overloaded
    releasing.set()
    for msg in got:
        msg.release()
    assert ingress.stats().inline_used == 0 and ingress.pool.stats().used == 0


# -- item 16: a welcome's pool name -----------------------------------------------------------


class FakeWelcome:
    """An ingress that proves the key and welcomes with the `pool` a test chooses."""

    def __init__(self, pool: str) -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port: int = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.pool = pool
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        theirs = ""
        ours = auth.nonce()
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = proto.unpack(frame, proto.OPS_TO_INGRESS)
            if msg["op"] == "hello":
                theirs = msg["nonce"]
                self.sock.send_multipart([ident, proto.pack("challenge", nonce=ours)])
            elif msg["op"] == "auth":
                fields: dict[str, Any] = {
                    "pool": self.pool,
                    "pool_size": 16 * MiB,
                    "max_allocation": 16 * MiB,
                    "lease_s": 30.0,
                }
                fields["mac"] = auth.mac(KEY, "welcome", theirs, ours, auth.body(fields))
                self.sock.send_multipart([ident, proto.pack("welcome", **fields)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param("disagg-relaytest-x\x00/../../etc", id="nul"),
        pytest.param("disagg-relaytest-" + "a" * 5000, id="over-long"),
        pytest.param("disagg-relaytest-ü", id="not-a-pool-name"),
    ],
)
def test_a_welcome_naming_a_pool_no_pool_can_have_is_a_counted_refusal(pool: str) -> None:
    fake = FakeWelcome(pool)
    try:
        with pytest.raises(NotAPeer, match="'pool'") as caught:
            connect("shm", fake.endpoint, key=KEY, timeout=5.0)
        assert len(str(caught.value)) < 400  # the name is echoed bounded
        cache = RelayCache(timeout=5.0, key=KEY)
        try:
            with pytest.raises(NotAPeer):
                cache.get("shm", fake.endpoint)
            assert cache.refused == 1  # a transport refusal (disagg_peer_rejected_total)
        finally:
            cache.close()
    finally:
        fake.close()


def test_the_ingress_welcome_offers_the_inline_verdict(rig: Rig) -> None:
    welcome = handshake(rig.raw(rig.ingress("tcp"), authenticate=False), relay="tcp")
    assert welcome["inline_ack"] == proto.INLINE_ACK_VERSION
