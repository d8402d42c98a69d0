"""Credit between real processes and sockets: slots a receiver grants a sender ahead
(relay/credit.py), so a stream of medium payloads needs no reservation round trip.

Waits all have timeouts; nothing asserts durations.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import pytest
import zmq

from disagg_runtime.memory.pool import MiB
from disagg_runtime.relay import connect
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.credit import CREDIT_LEASE_S
from disagg_runtime.relay.ingress import Ingress
from disagg_runtime.relay.session import CREDIT_MIN
from tests.payload_checks import assert_bit_exact
from tests.relay_rig import NIXL, WAIT, KiB, Rig, assert_still_serves, filled, recv_reply
from tests.support import wait_for

CREDIT_KINDS = ["shm", NIXL]  # where commits share the control lane


def _stream(sender: Any, ingress: Ingress, sizes: list[int], prefix: str = "s") -> None:
    """Send payloads back to back (a stream), each checked whole as it lands."""
    for i, size in enumerate(sizes):
        sender.send(filled(size, i % 250 + 1), request_id=f"{prefix}{i}")
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == f"{prefix}{i}" and msg.slot is not None
            assert_bit_exact(msg.payload, filled(size, i % 250 + 1))


@pytest.mark.parametrize("kind", CREDIT_KINDS)
def test_a_stream_of_medium_payloads_lands_through_credit(rig: Rig, kind: str) -> None:
    """From the third payload of a stream on (the first is no stream yet, the second asks),
    each is written into the slot granted with the ack before it: contents whole, in
    order, no reservation (a gap over SPARE_STREAM_S on a loaded machine costs one)."""
    ingress = rig.ingress(kind, size=16 * MiB, min_block=64 * KiB)
    sender = rig.sender(kind, ingress)
    _stream(sender, ingress, [300 * KiB] * 8)
    credits = ingress.ledger.credits
    assert ingress.stats().spares_used == credits.spent
    assert 4 <= credits.spent <= 6
    if kind == "shm":  # inline-sized payloads of a stream go through credit too
        before = credits.spent
        _stream(sender, ingress, [CREDIT_MIN + 1000] * 6, prefix="m")
        assert credits.spent >= before + 3
    wait_for(lambda: ingress.pool.stats().used == 0, message="the last credit lapses")
    assert len(credits) == 0


def test_credit_runs_out_and_the_handshake_takes_over(rig: Rig) -> None:
    """Credit held by all senders together is at most half the pool: of five senders
    streaming ~4 MiB payloads into a 32 MiB pool (room for more), four hold credit at a
    time and the fifth reserves; every payload lands whole."""
    ingress = rig.ingress("shm", size=32 * MiB, min_block=256 * KiB)
    credits = ingress.ledger.credits
    assert credits.budget == 16 * MiB
    senders = [rig.sender("shm", ingress) for _ in range(5)]
    size = 4 * MiB - 64 * KiB
    most = 0
    for i in range(3):  # round robin, a burst each: each ends its burst streaming
        for n, sender in enumerate(senders):
            _stream(sender, ingress, [size] * 3, prefix=f"{n}-{i}-")
            assert credits.held_bytes <= credits.budget
            most = max(most, len(credits))
    assert most == 4
    assert ingress.stats().spares_used == credits.spent >= 4
    wait_for(lambda: ingress.pool.stats().used == 0, message="credit lapses")


def _hold_credit(endpoint: str, key: bytes, conn: Connection) -> None:
    """A sender process that streams until it holds credit, says so, and waits to be killed."""
    sender = connect("shm", endpoint, key=key, timeout=WAIT)
    for i in range(3):
        sender.send(filled(300 * KiB, i + 1), request_id=f"k{i}")
    conn.send("holding")
    conn.recv()  # never comes: SIGKILL


def test_a_sender_killed_holding_credit_leaves_the_pool_whole(rig: Rig) -> None:
    ingress = rig.ingress("shm", size=4 * MiB, min_block=256 * KiB, lease_s=WAIT)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    from tests.relay_rig import KEY

    proc = ctx.Process(target=_hold_credit, args=(ingress.endpoint, KEY, child), daemon=True)
    proc.start()
    try:
        for _ in range(3):
            ingress.recv(timeout=WAIT).release()
        assert parent.poll(WAIT) and parent.recv() == "holding"
        assert len(ingress.ledger.credits) == 1 and ingress.pool.stats().used > 0
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(WAIT)
    finally:
        if proc.is_alive():
            proc.kill()
    # its credit lapses with its short lease: the pool whole again, for anyone
    wait_for(lambda: ingress.pool.stats().used == 0, timeout=CREDIT_LEASE_S + WAIT)
    assert len(ingress.ledger.credits) == 0 and ingress.ledger.credits.expired == 1
    whole = filled(ingress.pool.allocator.max_allocation - 64, 5)
    rig.sender("shm", ingress).send(whole, request_id="whole")
    with ingress.recv(timeout=WAIT) as msg:
        assert_bit_exact(msg.payload, whole)


_MANIFEST = {
    "v": 1,
    "tree": {"t": 0},
    "nbytes": 4096,
    "tensors": [{"dtype": "uint8", "shape": [4096], "offset": 0}],
}


def _reserve(raw: zmq.Socket[Any], xid: int) -> int:
    raw.send(proto.pack("reserve", rid="r", xid=xid, nbytes=4096))
    grant = recv_reply(raw)
    assert (grant["op"], grant["xid"]) == ("grant", xid)
    offset: int = grant["offset"]
    return offset


def test_an_unauthenticated_peer_gets_no_credit(rig: Rig) -> None:
    ingress = rig.ingress("shm")
    raw = rig.raw(ingress, authenticate=False)
    ask = {"xid": 2, "nbytes": MiB}
    raw.send(proto.pack("reserve", rid="r", xid=1, nbytes=4096))
    raw.send(proto.pack("commit", rid="r", xid=1, offset=0, manifest=_MANIFEST, next=ask))
    reply = recv_reply(raw)
    assert reply["op"] == "refused"
    assert ingress.ledger.credits.granted == 0 and ingress.pool.stats().used == 0
    assert_still_serves(rig, ingress, "shm")


@pytest.mark.parametrize(
    ("ask", "reason"),
    [
        pytest.param({"xid": "2", "nbytes": MiB}, "'xid'", id="xid-not-int"),
        pytest.param({"xid": 2, "nbytes": 0}, "0 B", id="zero-bytes"),
        pytest.param({"xid": 2, "nbytes": -1}, "negative", id="negative"),
        pytest.param([2, MiB], "must be an object", id="not-an-object"),
    ],
)
def test_a_malformed_credit_ask_refuses_its_commit(rig: Rig, ask: Any, reason: str) -> None:
    ingress = rig.ingress("shm")
    raw = rig.raw(ingress)
    offset = _reserve(raw, 1)
    raw.send(proto.pack("commit", rid="r", xid=1, offset=offset, manifest=_MANIFEST, next=ask))
    reply = recv_reply(raw)
    assert (reply["op"], reply["xid"]) == ("nack", 1) and reason in reply["reason"]
    wait_for(lambda: ingress.pool.stats().used == 0, message="the slot freed")
    assert ingress.ledger.credits.granted == 0 and ingress.stats().delivered == 0
    assert_still_serves(rig, ingress, "shm")


def test_a_commit_under_credit_never_granted_is_refused(rig: Rig) -> None:
    """A commit that spends a credit it was never granted (or another sender's) is
    refused; an ask past the credit bounds only gets an ack without credit."""
    ingress = rig.ingress("shm")
    raw, other = rig.raw(ingress), rig.raw(ingress)
    offset = _reserve(raw, 1)
    raw.send(
        proto.pack(
            "commit",
            rid="r",
            xid=1,
            offset=offset,
            manifest=_MANIFEST,
            next={"xid": 2, "nbytes": 4096},
        )
    )
    ack = recv_reply(raw)
    assert ack["op"] == "ack" and ack["spare"]["xid"] == 2
    ingress.recv(timeout=WAIT).release()
    spare = ack["spare"]["offset"]
    other.send(proto.pack("commit", rid="o", xid=2, offset=spare, manifest=_MANIFEST))
    reply = recv_reply(other)
    assert (reply["op"], reply["xid"]) == ("nack", 2) and "without a live grant" in reply["reason"]
    raw.send(proto.pack("commit", rid="r2", xid=7, offset=spare, manifest=_MANIFEST))
    reply = recv_reply(raw)
    assert (reply["op"], reply["xid"]) == ("nack", 7)
    # its own credit is still good once
    too_big = {"xid": 3, "nbytes": 64 * MiB}
    raw.send(proto.pack("commit", rid="r3", xid=2, offset=spare, manifest=_MANIFEST, next=too_big))
    ack = recv_reply(raw)
    assert ack["op"] == "ack" and "spare" not in ack
    ingress.recv(timeout=WAIT).release()
    assert ingress.pool.stats().used == 0 and len(ingress.ledger.credits) == 0
