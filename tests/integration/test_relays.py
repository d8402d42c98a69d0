"""Relay integration tests: real ZMQ sockets (ipc and tcp loopback) and real shared memory.

Every test runs against both relays where it makes sense: `shm` (ShmSender into an ingress
with a shared-memory pool, over an ipc socket) and `tcp` (TcpSender into an ingress with a
private cpu pool, over tcp loopback). Waits all have timeouts; nothing asserts durations.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq

from disagg_runtime.memory.layout import plan
from disagg_runtime.memory.pool import SHM_DIR, SHM_PREFIX, MiB
from disagg_runtime.relay import (
    Message,
    PeerLost,
    RelayError,
    RelayTimeout,
    ShmSender,
    TcpSender,
    WrongRole,
    connect,
)
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.backends.tcp import TCP_INLINE_MAX
from disagg_runtime.relay.backends.tcp import inline_limit as tcp_inline_limit
from disagg_runtime.relay.sender import Sender, Transfer
from disagg_runtime.relay.session import INLINE_THRESHOLD
from disagg_runtime.routing.peers import RelayCache
from disagg_runtime.wire.codec import encode_header
from tests.payload_checks import assert_bit_exact, tensors_of
from tests.relay_rig import (
    KEY,
    KINDS,
    NIXL,
    RELAY_KINDS,
    WAIT,
    KiB,
    Rig,
    assert_still_serves,
    call_in_thread,
    filled,
    handshake,
    in_pool,
    large_payload,
    recv_reply,
    small_payload,
)
from tests.support import wait_for

# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_large_payload_round_trips_into_the_pool(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind)
    sender = rig.sender(kind, ingress)
    assert sender.kind == kind
    payload = large_payload()
    moved = sender.send(payload, request_id="r1")
    assert moved == sum(t.numel() * t.element_size() for t in tensors_of(payload))
    msg = ingress.recv(timeout=WAIT)
    assert msg.request_id == "r1"
    assert msg.slot is not None
    assert_bit_exact(msg.payload, payload)
    # Zero-copy on the receive side: every tensor views the receiver's pool.
    for t in tensors_of(msg.payload):
        if t.numel():
            assert in_pool(t, ingress.pool)
    assert ingress.pool.stats().used == 4 * MiB  # 3 MiB + extras in one 4 MiB block
    assert ingress.stats().delivered == 1
    msg.release()
    assert msg.released
    assert ingress.pool.stats().used == 0
    msg.release()  # idempotent
    assert ingress.pool.stats().used == 0


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_small_payload_goes_inline(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind)
    sender = rig.sender(kind, ingress)
    payload = small_payload(3)
    sender.send(payload, request_id="s1")
    msg = ingress.recv(timeout=WAIT)
    assert msg.request_id == "s1"
    assert msg.slot is None  # no pool slot for inline payloads
    assert ingress.pool.stats().used == 0
    assert_bit_exact(msg.payload, payload)
    msg.release()
    assert msg.released


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_inline_threshold_is_configurable(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind)
    sender = rig.sender(kind, ingress, inline_max=0)
    payload = small_payload(4)
    sender.send(payload, request_id="staged-small")
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.slot is not None  # even a small payload was staged through the pool
        assert_bit_exact(msg.payload, payload)
    assert ingress.pool.stats().used == 0


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_context_manager_releases_the_slot(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind)
    sender = rig.sender(kind, ingress)
    sender.send(large_payload(1), request_id="cm")
    with ingress.recv(timeout=WAIT) as msg:
        assert isinstance(msg, Message)
        assert ingress.pool.stats().used > 0
    assert msg.released
    assert ingress.pool.stats().used == 0


def test_tcp_chunking_reassembles_exactly(rig: Rig) -> None:
    ingress = rig.ingress("tcp")
    sender = rig.sender("tcp", ingress, chunk_bytes=100_000)  # not a divisor of anything
    payload = large_payload(2)
    sender.send(payload, request_id="chunky")
    with ingress.recv(timeout=WAIT) as msg:
        assert_bit_exact(msg.payload, payload)


def test_tcp_sends_medium_payloads_inline_to_a_host_pool_and_reserves_beyond(rig: Rig) -> None:
    """Up to TCP_INLINE_MAX, a tcp payload to a receiver whose pool is plain host memory
    goes as one lane frame (held in the inline budget, no pool slot); above it, without a
    lane, or with `inline_max` set lower, it is reserved and chunked into the pool."""
    ingress = rig.ingress("tcp")  # a cpu pool: its welcome says so
    assert handshake(rig.raw(ingress, authenticate=False), relay="tcp")["pool_device"] == "cpu"
    sender = rig.sender("tcp", ingress)
    assert isinstance(sender, TcpSender) and sender.inline_max == TCP_INLINE_MAX
    # without a lane, where the budget cannot stall it (an inline payload over ZMQ that
    # does not fit is dropped), the default stays
    laneless = rig.sender("tcp", ingress, lane=False)
    assert isinstance(laneless, TcpSender) and laneless.inline_max == INLINE_THRESHOLD
    medium, big = filled(512 * KiB, 3), filled(TCP_INLINE_MAX + 1, 4)
    told = rig.sender("tcp", ingress, inline_max=64 * KiB)
    for via, payload, rid in ((sender, medium, "m"), (sender, big, "b"), (told, medium, "t")):
        via.send(payload, request_id=rid)
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == rid
            assert_bit_exact(msg.payload, payload)
            if rid == "m":  # inline: in the ingress's budget, not in a pool slot
                assert msg.slot is None and msg.charge >= msg.nbytes
                assert ingress.pool.stats().used == 0
                assert ingress.stats().inline_used >= msg.nbytes
            else:
                assert msg.slot is not None and ingress.pool.stats().used >= msg.nbytes
    assert ingress.stats().inline_used == 0 and ingress.pool.stats().used == 0


def test_a_medium_tcp_payload_whose_lane_went_before_it_is_reserved_not_sent_over_zmq(
    rig: Rig,
) -> None:
    """A lane lost between a payload's inline decision and its send (another thread's send
    found it broken) takes the medium limit with it: over ZMQ, where the inline budget
    cannot stall its sender, that payload could be dropped, so it is reserved instead."""

    class LosesItsLane(TcpSender):
        def _start_send(self) -> None:
            self._close_lane()  # as a failed send on another thread does, under the lock
            super()._start_send()

    ingress = rig.ingress("tcp")
    sender = LosesItsLane(ingress.endpoint, key=KEY, timeout=WAIT)
    try:
        assert sender.inline_max == TCP_INLINE_MAX  # the lane was up at the decision
        payload = filled(512 * KiB, 5)
        sender.send(payload, request_id="after-the-lane")
        assert sender.inline_max == INLINE_THRESHOLD
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.slot is not None  # reserved in the pool, not inline over ZMQ
            assert_bit_exact(msg.payload, payload)
    finally:
        sender.close()


@pytest.mark.parametrize(
    ("device", "limit"),
    [
        ("shm", TCP_INLINE_MAX),
        ("cpu", TCP_INLINE_MAX),
        ("cpu-pinned", INLINE_THRESHOLD),
        ("cuda", INLINE_THRESHOLD),
        (None, INLINE_THRESHOLD),
        (7, INLINE_THRESHOLD),
    ],
)
def test_tcp_inline_limit_follows_where_the_receiver_lands_payloads(
    device: Any, limit: int
) -> None:
    """A pool on a GPU, or pinned for one, keeps medium payloads reserved there (they land
    where the role computes); so does a welcome that says nothing (an older ingress)."""
    assert tcp_inline_limit(device) == limit


def test_recv_times_out_when_nothing_arrives(rig: Rig) -> None:
    ingress = rig.ingress("tcp")
    with pytest.raises(RelayTimeout):
        ingress.recv(timeout=0.05)


# -- many senders, many threads ------------------------------------------------------------


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_several_senders_into_one_ingress(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind)
    senders = [rig.sender(kind, ingress) for _ in range(3)]
    expected: dict[str, Any] = {}
    for i in range(len(senders)):
        expected[f"s{i}-large"] = large_payload(10 + i)
        expected[f"s{i}-small"] = small_payload(10 + i)

    def work(i: int) -> Callable[[], None]:
        def go() -> None:
            senders[i].send(expected[f"s{i}-large"], request_id=f"s{i}-large")
            senders[i].send(expected[f"s{i}-small"], request_id=f"s{i}-small")

        return go

    runs = [call_in_thread(work(i)) for i in range(len(senders))]
    seen = []
    for _ in expected:
        with ingress.recv(timeout=WAIT) as msg:
            assert_bit_exact(msg.payload, expected[msg.request_id])
            seen.append(msg.request_id)
    for thread, result in runs:
        thread.join(WAIT)
        assert result == {"ok": True}
    assert sorted(seen) == sorted(expected)
    assert ingress.pool.stats().used == 0


def test_shm_and_tcp_senders_share_one_ingress(rig: Rig) -> None:
    ingress = rig.ingress("shm")  # a shared pool serves both relays
    shm, tcp = rig.sender("shm", ingress), rig.sender("tcp", ingress)
    assert isinstance(shm, ShmSender)
    assert isinstance(tcp, TcpSender)
    for sender, rid in ((shm, "via-shm"), (tcp, "via-tcp")):
        payload = large_payload(len(rid))
        sender.send(payload, request_id=rid)
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == rid
            assert_bit_exact(msg.payload, payload)
            assert all(in_pool(t, ingress.pool) for t in tensors_of(msg.payload) if t.numel())


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_threads_share_one_sender(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind, size=8 * MiB, min_block=256 * KiB)
    sender = rig.sender(kind, ingress, inline_max=INLINE_THRESHOLD)  # tcp too: 300 KiB staged
    threads, per_thread = 4, 4
    expected: dict[str, Any] = {}
    for t in range(threads):
        for i in range(per_thread):
            size = 300 * KiB if i % 2 else 8 * KiB  # alternate staged and inline
            expected[f"t{t}-{i}"] = {
                "data": torch.full((size,), t * per_thread + i, dtype=torch.uint8),
                "tag": [t, i],
            }

    def work(t: int) -> Callable[[], None]:
        def go() -> None:
            for i in range(per_thread):
                sender.send(expected[f"t{t}-{i}"], request_id=f"t{t}-{i}")

        return go

    runs = [call_in_thread(work(t)) for t in range(threads)]
    seen: list[str] = []
    for _ in expected:
        with ingress.recv(timeout=WAIT) as msg:
            assert_bit_exact(msg.payload, expected[msg.request_id])
            seen.append(msg.request_id)
    for thread, result in runs:
        thread.join(WAIT)
        assert result == {"ok": True}
    assert sorted(seen) == sorted(expected)
    # Each thread's own messages arrive in the order it sent them.
    for t in range(threads):
        mine = [rid for rid in seen if rid.startswith(f"t{t}-")]
        assert mine == [f"t{t}-{i}" for i in range(per_thread)]
    # a sender in a stream may hold one spare slot, freed when its short lease ends
    wait_for(lambda: ingress.pool.stats().used == 0, message="the pool empty")


# -- flow control --------------------------------------------------------------------------


def test_a_stream_of_staged_payloads_is_granted_each_slot_ahead(rig: Rig) -> None:
    """shm: an ack may grant the sender's next slot ahead (a spare), so the next payload
    needs no reservation; payloads sent into spares arrive whole and in order, one that
    does not fit its spare reserves as usual, an aborted request's is refused, and the
    spare left behind when the stream ends is freed by its short lease."""
    ingress = rig.ingress("shm", size=16 * MiB, min_block=256 * KiB)
    sender = rig.sender("shm", ingress)
    for i in range(6):
        sender.send(filled(300 * KiB, i), request_id=f"s{i}")
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == f"s{i}"
            assert_bit_exact(msg.payload, filled(300 * KiB, i))
    assert ingress.stats().spares_used >= 1
    used = ingress.stats().spares_used
    sender.send(filled(2 * MiB, 7), request_id="big")  # over its spare: a reservation
    with ingress.recv(timeout=WAIT) as msg:
        assert_bit_exact(msg.payload, filled(2 * MiB, 7))
    assert ingress.stats().spares_used == used
    sender.send(filled(2 * MiB, 8), request_id="big2")
    ingress.recv(timeout=WAIT).release()
    ingress.abort("doomed")
    with pytest.raises(RelayError, match="aborted"):
        sender.send(filled(MiB, 9), request_id="doomed")
    wait_for(lambda: ingress.pool.stats().used == 0, message="the spare freed")
    assert ingress.stats().pending_reservations == 0


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_full_pool_times_out_the_sender(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind, size=4 * MiB, min_block=MiB)
    sender = rig.sender(kind, ingress, timeout=60.0)
    sender.send(filled(3 * MiB, 1), request_id="first")
    first = ingress.recv(timeout=WAIT)
    assert ingress.pool.stats().used == 4 * MiB

    started = time.monotonic()
    with pytest.raises(RelayTimeout) as info:
        sender.send(filled(3 * MiB, 2), request_id="second", timeout=0.3)
    # The per-call timeout governs, not the sender's 60 s default.
    assert time.monotonic() - started < 30
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, RelayError)

    first.release()
    # The abandoned reservation is cancelled, not granted behind our back.
    wait_for(lambda: ingress.stats().pending_reservations == 0)
    wait_for(lambda: ingress.pool.stats().used == 0)
    with pytest.raises(RelayTimeout):
        ingress.recv(timeout=0.1)  # "second" never arrived
    # The sender is still usable.
    sender.send(filled(3 * MiB, 3), request_id="third")
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "third"
        assert_bit_exact(msg.payload, filled(3 * MiB, 3))
    assert ingress.pool.stats().used == 0


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_blocked_sender_completes_once_room_is_released(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind, size=4 * MiB, min_block=MiB)
    sender = rig.sender(kind, ingress)
    sender.send(filled(3 * MiB, 1), request_id="first")
    first = ingress.recv(timeout=WAIT)

    second = filled(3 * MiB, 2)
    thread, result = call_in_thread(lambda: sender.send(second, request_id="second", timeout=WAIT))
    wait_for(lambda: ingress.stats().pending_reservations == 1)
    assert thread.is_alive()
    assert result == {}
    first.release()
    thread.join(WAIT)
    assert result == {"ok": True}
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "second"
        assert_bit_exact(msg.payload, second)
    assert ingress.pool.stats().used == 0


@pytest.mark.parametrize("kind", ["tcp"])
def test_blocked_sender_survives_a_wait_longer_than_half_the_lease(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind, size=4 * MiB, min_block=MiB, lease_s=1.0)
    sender = rig.sender(kind, ingress)
    sender.send(filled(3 * MiB, 1), request_id="first")
    first = ingress.recv(timeout=WAIT)
    thread, result = call_in_thread(
        lambda: sender.send(filled(3 * MiB, 2), request_id="second", timeout=4.0)
    )
    wait_for(lambda: ingress.stats().pending_reservations == 1)
    time.sleep(0.7)  # > lease/2, < lease: the reservation is still pending at the ingress
    first.release()
    thread.join(WAIT)
    assert result == {"ok": True}


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_payload_larger_than_any_block_fails_at_once(rig: Rig, kind: str) -> None:
    # 6 MiB pool = 4 MiB + 2 MiB top blocks: 6 MiB total, yet no 5 MiB slot can ever exist.
    ingress = rig.ingress(kind, size=6 * MiB, min_block=MiB)
    sender = rig.sender(kind, ingress, timeout=60.0)
    with pytest.raises(RelayError, match="never fit") as info:
        sender.send(filled(5 * MiB), request_id="huge")
    assert not isinstance(info.value, TimeoutError)
    assert ingress.stats().pending_reservations == 0
    assert ingress.pool.stats().used == 0
    # The ingress refuses such a reservation too, for senders that do not check first.
    raw = rig.raw(ingress)
    raw.send(proto.pack("reserve", rid="huge", xid=1, nbytes=5 * MiB))
    reply = recv_reply(raw)
    assert (reply["op"], reply["xid"]) == ("deny", 1)
    assert ingress.pool.stats().used == 0
    # A 4 MiB payload does fit.
    sender.send(filled(4 * MiB), request_id="fits")
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "fits"


# -- abort ---------------------------------------------------------------------------------


@pytest.mark.parametrize("who", ["sender", "ingress"])
@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_abort_frees_delivered_but_unreleased_messages(rig: Rig, kind: str, who: str) -> None:
    ingress = rig.ingress(kind)
    sender = rig.sender(kind, ingress)
    for i, rid in enumerate(["doomed", "doomed", "kept"]):
        sender.send(large_payload(i), request_id=rid)
    sender.send(small_payload(), request_id="doomed")
    msgs = [ingress.recv(timeout=WAIT) for _ in range(4)]
    kept = next(m for m in msgs if m.request_id == "kept")
    doomed = [m for m in msgs if m.request_id == "doomed"]
    assert ingress.pool.stats().used == 3 * 4 * MiB

    if who == "sender":
        sender.abort("doomed")
    else:
        ingress.abort("doomed")
    wait_for(lambda: ingress.pool.stats().used == 4 * MiB)  # only "kept" remains
    assert all(m.released for m in doomed)
    assert not kept.released

    for m in doomed:  # a later release of an aborted message is a no-op
        m.release()
    assert ingress.pool.stats().used == 4 * MiB
    assert_bit_exact(kept.payload, large_payload(2))
    kept.release()
    assert ingress.pool.stats().used == 0


@pytest.mark.parametrize("who", ["sender", "ingress"])
@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_late_messages_of_an_aborted_request_are_dropped(rig: Rig, kind: str, who: str) -> None:
    ingress = rig.ingress(kind)
    sender = rig.sender(kind, ingress)
    if who == "sender":
        sender.abort("gone")
    else:
        ingress.abort("gone")
    sender.send(small_payload(), request_id="gone")  # inline: accepted on the wire, dropped
    with pytest.raises(RelayError) as info:  # staged: refused, and the sender is told
        sender.send(large_payload(), request_id="gone")
    assert not isinstance(info.value, TimeoutError)
    sender.send(small_payload(1), request_id="alive")
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "alive"  # same socket, in order: "gone" was dropped before
    with pytest.raises(RelayTimeout):
        ingress.recv(timeout=0.1)
    assert ingress.stats().delivered == 1
    assert ingress.pool.stats().used == 0


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_abort_fails_a_blocked_sender_promptly(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind, size=4 * MiB, min_block=MiB)
    sender = rig.sender(kind, ingress, timeout=60.0)
    sender.send(filled(3 * MiB), request_id="hog")
    hog = ingress.recv(timeout=WAIT)
    thread, result = call_in_thread(
        lambda: sender.send(filled(3 * MiB), request_id="waiting", timeout=60.0)
    )
    wait_for(lambda: ingress.stats().pending_reservations == 1)
    ingress.abort("waiting")
    thread.join(WAIT)
    assert not thread.is_alive()
    error = result.get("error")
    assert isinstance(error, RelayError)
    assert not isinstance(error, TimeoutError)
    assert ingress.stats().pending_reservations == 0
    hog.release()
    assert ingress.pool.stats().used == 0


# -- hostile or broken peers ---------------------------------------------------------------

_MANIFEST = {
    "v": 1,
    "tree": {"t": 0},
    "nbytes": 4096,
    "tensors": [{"dtype": "uint8", "shape": [4096], "offset": 0}],
}
CHUNK = 4096  # the smallest chunk an ingress accepts
_MANIFEST_4_CHUNKS = {
    **_MANIFEST,
    "nbytes": 4 * CHUNK,
    "tensors": [{"dtype": "uint8", "shape": [4 * CHUNK], "offset": 0}],
}


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([b"\xff\x00garbage"], id="garbage"),
        pytest.param([b""], id="empty-frame"),
        pytest.param([b"[1, 2, 3]"], id="json-array"),
        pytest.param([b'"hello"'], id="json-string"),
        pytest.param([b'{"v": 1, "pv": 1, "op": "hello"'], id="truncated-json"),
        pytest.param([proto.pack("explode")], id="unknown-op"),
        pytest.param([proto.pack("welcome")], id="op-for-the-other-side"),
        pytest.param([encode_header({"v": 1, "pv": 99, "op": "hello"})], id="protocol-version"),
        pytest.param([encode_header({"v": 7, "pv": 1, "op": "hello"})], id="format-version"),
        pytest.param([proto.pack("reserve", rid="r", xid="1", nbytes=10)], id="xid-str"),
        pytest.param([proto.pack("reserve", rid="r", xid=True, nbytes=10)], id="xid-bool"),
        pytest.param([proto.pack("reserve", rid=5, xid=1, nbytes=10)], id="rid-int"),
        pytest.param([proto.pack("reserve", rid="r", xid=1, nbytes=-1)], id="nbytes-neg"),
        pytest.param([proto.pack("cancel", xid=-3)], id="cancel-neg"),
        pytest.param([proto.pack("abort")], id="abort-no-rid"),
        pytest.param([proto.pack("inline", rid="r"), b"{not json"], id="inline-bad-codec"),
        pytest.param(
            [proto.pack("inline", rid="r"), b'{"v":1,"tree":{"t":0},"tensors":[]}'],
            id="inline-dangling-tensor",
        ),
        pytest.param(
            [
                proto.pack("inline", rid="r"),
                b'{"v":1,"tree":{"t":0},"tensors":[{"dtype":"float32","shape":[4]}]}',
                b"\0" * 15,
            ],
            id="inline-short-frame",
        ),
        pytest.param(
            [proto.pack("commit", rid="r", xid=42, offset=0, manifest=_MANIFEST)],
            id="commit-without-grant",
        ),
    ],
)
@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_malformed_control_messages_are_rejected(rig: Rig, kind: str, frames: list[bytes]) -> None:
    ingress = rig.ingress(kind)
    raw = rig.raw(ingress)
    before = ingress.stats().rejected
    raw.send_multipart(frames)
    wait_for(lambda: ingress.stats().rejected == before + 1)
    if frames[0].startswith(b'{"v":1,"pv":1,"op":"commit"'):
        reply = recv_reply(raw)  # the sender of a bad commit is told, not left waiting
        assert (reply["op"], reply["xid"]) == ("nack", 42)
    assert ingress.stats().delivered == 0
    assert ingress.pool.stats().used == 0
    assert_still_serves(rig, ingress, kind)


def test_inline_without_frames_is_rejected(rig: Rig) -> None:
    ingress = rig.ingress("tcp")
    raw = rig.raw(ingress)
    raw.send(proto.pack("inline", rid="r"))
    try:
        wait_for(lambda: ingress.stats().rejected == 1, timeout=1.0)
        assert_still_serves(rig, ingress, "tcp")
    finally:
        # With the bug, the I/O thread sits in a blocking recv(); closing the socket under
        # it aborts the interpreter. Feed it one message so it gets out before teardown.
        rig.raw(ingress).send(b"unblock")
        wait_for(lambda: ingress.stats().rejected >= 1)


def _reserve(raw: zmq.Socket[Any], nbytes: int, xid: int = 1, rid: str = "r") -> int:
    raw.send(proto.pack("reserve", rid=rid, xid=xid, nbytes=nbytes))
    grant = recv_reply(raw)
    assert (grant["op"], grant["xid"]) == ("grant", xid)
    offset: int = grant["offset"]
    return offset


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param([4000, 4096, 4096, 4096], id="short-first"),
        pytest.param([4096, 4096, 8192, 4096], id="long-third"),
        pytest.param([4096, 4096, 4096, 4095], id="short-last"),
    ],
)
def test_tcp_commit_with_wrong_chunk_sizes_is_nacked(rig: Rig, sizes: list[int]) -> None:
    ingress = rig.ingress("tcp")
    raw = rig.raw(ingress, relay="tcp")
    offset = _reserve(raw, 4 * CHUNK)
    assert ingress.pool.stats().used == MiB
    raw.send(
        proto.pack(
            "commit", rid="r", xid=1, offset=offset, manifest=_MANIFEST_4_CHUNKS, chunk=CHUNK
        )
    )
    for size in sizes:  # the four chunks the manifest implies, with the wrong lengths
        raw.send(b"\x07" * size)
    reply = recv_reply(raw)
    assert (reply["op"], reply["xid"]) == ("nack", 1)
    assert ingress.stats().rejected == 1
    assert ingress.stats().delivered == 0
    wait_for(lambda: ingress.pool.stats().used == 0)
    assert_still_serves(rig, ingress, "tcp")


def test_tcp_commit_by_hand_is_delivered(rig: Rig) -> None:
    """The raw-socket protocol used by the hostile tests is the real one."""
    ingress = rig.ingress("tcp")
    raw = rig.raw(ingress, relay="tcp")
    offset = _reserve(raw, 4 * CHUNK)
    raw.send(
        proto.pack(
            "commit", rid="r", xid=1, offset=offset, manifest=_MANIFEST_4_CHUNKS, chunk=CHUNK
        )
    )
    for i in range(4):
        raw.send(bytes([i]) * CHUNK)
    reply = recv_reply(raw)
    assert (reply["op"], reply["xid"]) == ("ack", 1)
    with ingress.recv(timeout=WAIT) as msg:
        want = torch.arange(4, dtype=torch.uint8).repeat_interleave(CHUNK)
        assert torch.equal(msg.payload, want)
    assert ingress.pool.stats().used == 0


def test_tcp_commit_with_tiny_chunks_is_nacked(rig: Rig) -> None:
    ingress = rig.ingress("tcp")
    raw = rig.raw(ingress, relay="tcp")
    offset = _reserve(raw, 4096)
    raw.send(proto.pack("commit", rid="r", xid=1, offset=offset, manifest=_MANIFEST, chunk=1))
    reply = recv_reply(raw)
    assert (reply["op"], reply["xid"]) == ("nack", 1)
    assert "below the minimum" in reply["reason"]
    wait_for(lambda: ingress.pool.stats().used == 0)
    assert_still_serves(rig, ingress, "tcp")


def test_only_a_tcp_sender_may_commit_in_chunks(rig: Rig) -> None:
    """Chunks land through the tcp backend's landing (relay/backends/tcp/land.py): a
    sender of another kind that sends them is refused, its slot freed."""
    ingress = rig.ingress("tcp")
    raw = rig.raw(ingress, relay="shm")
    offset = _reserve(raw, 4096)
    raw.send(proto.pack("commit", rid="r", xid=1, offset=offset, manifest=_MANIFEST, chunk=4096))
    reply = recv_reply(raw)
    assert (reply["op"], reply["xid"]) == ("nack", 1) and "cannot carry chunks" in reply["reason"]
    wait_for(lambda: ingress.pool.stats().used == 0)
    assert_still_serves(rig, ingress, "tcp")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize(
    ("tree", "data"),
    [
        pytest.param({"t": 7}, b"\0" * 4096, id="bad-tree"),
        pytest.param({"t": 0}, b"\2" * 4096, id="bool-bytes"),
    ],
)
def test_tcp_commit_with_bad_payload_is_nacked(rig: Rig, tree: Any, data: bytes) -> None:
    ingress = rig.ingress("tcp")
    raw = rig.raw(ingress, relay="tcp")
    offset = _reserve(raw, 4096)
    manifest = {**_MANIFEST, "tree": tree}
    manifest["tensors"] = [{"dtype": "bool", "shape": [4096], "offset": 0}]
    raw.send(proto.pack("commit", rid="r", xid=1, offset=offset, manifest=manifest, chunk=4096))
    raw.send(data)
    reply = recv_reply(raw, timeout=1.0)
    assert (reply["op"], reply["xid"]) == ("nack", 1)
    assert ingress.pool.stats().used == 0
    assert_still_serves(rig, ingress, "tcp")


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_shm_commit_with_bad_payload_is_nacked(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind)
    raw = rig.raw(ingress)
    offset = _reserve(raw, 4096)
    manifest = {**_MANIFEST, "tree": {"t": 7}}  # no chunk: data "already in the pool"
    raw.send(proto.pack("commit", rid="r", xid=1, offset=offset, manifest=manifest))
    reply = recv_reply(raw)
    assert (reply["op"], reply["xid"]) == ("nack", 1)
    assert ingress.stats().rejected == 1
    assert ingress.pool.stats().used == 0
    assert_still_serves(rig, ingress, kind)


def test_commit_with_a_foreign_offset_is_nacked(rig: Rig) -> None:
    ingress = rig.ingress("shm")
    raw = rig.raw(ingress)
    offset = _reserve(raw, 4096)
    raw.send(proto.pack("commit", rid="r", xid=1, offset=offset + MiB, manifest=_MANIFEST))
    reply = recv_reply(raw)
    assert (reply["op"], reply["xid"]) == ("nack", 1)
    assert ingress.pool.stats().used == 0


def test_commit_whose_manifest_exceeds_the_slot_is_nacked(rig: Rig) -> None:
    ingress = rig.ingress("shm")
    raw = rig.raw(ingress)
    offset = _reserve(raw, 4096)  # a 1 MiB slot
    manifest = {
        "v": 1,
        "tree": {"t": 0},
        "nbytes": 2 * MiB,
        "tensors": [{"dtype": "uint8", "shape": [2 * MiB], "offset": 0}],
    }
    raw.send(proto.pack("commit", rid="r", xid=1, offset=offset, manifest=manifest))
    reply = recv_reply(raw)
    assert (reply["op"], reply["xid"]) == ("nack", 1)
    assert ingress.pool.stats().used == 0


# -- leases --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_uncommitted_grant_is_freed_after_the_lease(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind, lease_s=0.5)
    raw = rig.raw(ingress, authenticate=False)
    welcome = handshake(raw)
    assert welcome["op"] == "welcome"
    assert welcome["lease_s"] == 0.5
    offset = _reserve(raw, 2 * MiB)
    assert ingress.pool.stats().used == 2 * MiB
    wait_for(lambda: ingress.pool.stats().used == 0)
    # A commit after the lease is refused, not written over a slot someone else may own.
    raw.send(proto.pack("commit", rid="r", xid=1, offset=offset, manifest=_MANIFEST))
    reply = recv_reply(raw)
    assert (reply["op"], reply["xid"]) == ("nack", 1)
    assert_still_serves(rig, ingress, kind)


def test_stalled_tcp_transfer_is_freed_after_the_lease(rig: Rig) -> None:
    ingress = rig.ingress("tcp", lease_s=0.5)
    raw = rig.raw(ingress, relay="tcp")
    offset = _reserve(raw, 4 * CHUNK)
    raw.send(
        proto.pack(
            "commit", rid="r", xid=1, offset=offset, manifest=_MANIFEST_4_CHUNKS, chunk=CHUNK
        )
    )
    raw.send(b"\0" * CHUNK)  # one chunk of four, then silence
    wait_for(lambda: ingress.pool.stats().used == 0)
    assert ingress.stats().delivered == 0
    assert_still_serves(rig, ingress, "tcp")


def test_cancel_frees_a_grant(rig: Rig) -> None:
    ingress = rig.ingress("shm")
    raw = rig.raw(ingress)
    _reserve(raw, 2 * MiB, xid=5)
    assert ingress.pool.stats().used == 2 * MiB
    raw.send(proto.pack("cancel", xid=5))
    wait_for(lambda: ingress.pool.stats().used == 0)


def test_reused_xid_does_not_leak_a_slot(rig: Rig) -> None:
    ingress = rig.ingress("tcp", lease_s=0.3)
    raw = rig.raw(ingress)
    raw.send(proto.pack("reserve", rid="r", xid=1, nbytes=MiB))
    raw.send(proto.pack("reserve", rid="r", xid=1, nbytes=MiB))
    replies = [recv_reply(raw), recv_reply(raw)]
    assert sorted(r["op"] for r in replies) == ["deny", "grant"]
    assert [r["xid"] for r in replies] == [1, 1]
    wait_for(lambda: ingress.pool.stats().used == 0, timeout=1.5)


# -- connecting ----------------------------------------------------------------------------


def test_shm_sender_needs_a_shared_pool(rig: Rig) -> None:
    ingress = rig.ingress("shm", device="cpu")
    with pytest.raises(RelayError, match="no shared-memory pool"):
        connect("shm", ingress.endpoint, timeout=WAIT, key=KEY)
    # The tcp relay works against the same ingress.
    assert_still_serves(rig, ingress, "tcp")


def test_unknown_relay_kind() -> None:
    with pytest.raises(RelayError, match="unknown relay"):
        connect("carrier-pigeon", "tcp://127.0.0.1:1")


def test_connect_to_nobody_times_out(rig: Rig) -> None:
    endpoint = f"ipc://{rig.dir}/nobody.sock"
    with pytest.raises(RelayTimeout):
        connect("tcp", endpoint, timeout=0.2, key=KEY)


@pytest.mark.parametrize("kind", RELAY_KINDS)
def test_closed_sender_refuses_to_send(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind)
    sender = rig.sender(kind, ingress)
    sender.close()
    sender.close()  # idempotent
    with pytest.raises(RelayError, match="closed"):
        sender.send(small_payload(), request_id="late")
    sender.abort("late")  # harmless


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("payload", [small_payload, large_payload], ids=["inline", "staged"])
def test_a_closing_receivers_goodbye_turns_its_senders_away_and_what_crossed_it_lands(
    rig: Rig, kind: str, payload: Callable[[int], dict[str, Any]]
) -> None:
    """A role at the end of its drain says goodbye and serves on a moment: every send that
    went through before its sender read the goodbye is delivered, the next one is PeerLost
    (nothing sent: the caller picks another replica), and a sender that dials it after the
    goodbye is turned away the same way."""
    ingress = rig.ingress(kind, size=64 * MiB)
    sender = rig.sender(kind, ingress)
    sender.send(payload(0), request_id="r0", timeout=WAIT)
    sent = ["r0"]
    ingress.goodbye("closing for the test")
    for i in range(1, 10_000):
        try:
            sender.send(payload(i), request_id=f"r{i}", timeout=WAIT)
        except PeerLost as exc:
            assert "closing for the test" in str(exc)
            break
        sent.append(f"r{i}")
    else:
        raise AssertionError("the sender never read the goodbye")
    for rid in sent:  # none of what it took before the goodbye was dropped
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == rid
    late = rig.sender(kind, ingress)
    time.sleep(0.2)  # its goodbye follows the welcome on the same connection
    with pytest.raises(PeerLost, match="closing for the test"):
        late.send(payload(0), request_id="late", timeout=WAIT)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("payload", [small_payload, large_payload], ids=["inline", "staged"])
def test_a_receiver_restarted_in_place_gets_a_new_handshake_not_refused_messages(
    rig: Rig, kind: str, payload: Callable[[int], dict[str, Any]]
) -> None:
    """A role's container restarted (kill -9): libzmq reconnects by itself to the new process,
    which knows nothing of the old session. The sender says PeerLost (nothing delivered);
    `RelayCache.send` reconnects with a fresh handshake and the payload arrives."""
    first = rig.ingress(kind)
    relays = RelayCache(timeout=WAIT, key=KEY)
    try:
        relay, _ = relays.send(kind, first.endpoint, payload(0), request_id="before", timeout=WAIT)
        with first.recv(timeout=WAIT) as msg:
            assert msg.request_id == "before"
        first.close()  # the process died: its sockets closed, its sessions forgotten
        second = rig.ingress(kind, endpoint=first.endpoint)  # the restart, at the same address
        time.sleep(0.5)  # what a restart takes at least: libzmq has seen the connection go
        with pytest.raises(PeerLost, match="reconnect"):
            relay.send(payload(1), request_id="stale", timeout=WAIT)
        for i in range(3):
            relays.send(kind, first.endpoint, payload(i), request_id=f"after-{i}", timeout=WAIT)
            with second.recv(timeout=WAIT) as msg:
                assert msg.request_id == f"after-{i}"
                assert_bit_exact(msg.payload, payload(i))
        assert second.refusals.count == 0, "nothing was sent to it unauthenticated"
    finally:
        relays.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_receiver_gone_for_good_is_replaced_by_the_replica_picked_afresh(
    rig: Rig, kind: str
) -> None:
    """A replica scaled away: its sender's connection is lost; the payload goes to the
    replica a fresh look at the peers picks (`repick`), not into the void."""
    gone, other = rig.ingress(kind), rig.ingress(kind)
    relays = RelayCache(timeout=WAIT, key=KEY)
    try:
        relays.send(kind, gone.endpoint, small_payload(), request_id="before", timeout=WAIT)
        with gone.recv(timeout=WAIT) as msg:
            assert msg.request_id == "before"
        gone.close()
        time.sleep(0.5)  # libzmq has seen the connection go
        relay, _ = relays.send(
            kind,
            gone.endpoint,
            small_payload(1),
            request_id="after",
            timeout=WAIT,
            repick=lambda: other.endpoint,
        )
        assert relay.endpoint == other.endpoint
        with other.recv(timeout=WAIT) as msg:
            assert msg.request_id == "after"
    finally:
        relays.close()


@pytest.mark.parametrize("kind", KINDS)
def test_an_address_another_role_took_over_is_refused_and_the_role_looked_up_again(
    rig: Rig, kind: str
) -> None:
    """Pod IPs are reused: until its DNS lookup catches up, a sender may dial an address
    that is now another role's pod of the same pipeline (same peer key). The welcome names
    the role it serves, so nothing goes there; the payload goes where `repick` looks."""
    other_role = rig.ingress(kind, role="audio")
    right = rig.ingress(kind, role="vision")
    anonymous = rig.ingress(kind)  # a client's reply ingress names no role
    relays = RelayCache(timeout=WAIT, key=KEY)
    try:
        with pytest.raises(WrongRole, match="serves role 'audio', not 'vision'"):
            relays.get(kind, other_role.endpoint, role="vision")
        assert len(relays) == 0  # not kept for the next send either
        assert relays.get(kind, right.endpoint, role="vision").peer_role == "vision"
        assert relays.get(kind, anonymous.endpoint, role="vision").peer_role is None
        relay, _ = relays.send(
            kind,
            other_role.endpoint,
            small_payload(1),
            request_id="misdialled",
            timeout=WAIT,
            repick=lambda: right.endpoint,
            role="vision",
        )
        assert relay.endpoint == right.endpoint
        with right.recv(timeout=WAIT) as msg:
            assert msg.request_id == "misdialled"
        assert other_role.stats().queued == 0
    finally:
        relays.close()


def test_nothing_is_left_in_dev_shm_after_closing() -> None:
    def ours() -> set[str]:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}

    before = ours()
    r = Rig()
    try:
        ingress = r.ingress("shm")
        pool_name = ingress.pool.name
        assert pool_name in ours()
        for kind in KINDS:
            sender = r.sender(kind, ingress)
            sender.send(large_payload(), request_id=kind)
            sender.send(small_payload(), request_id=kind)
        kept = [ingress.recv(timeout=WAIT) for _ in range(4)]  # still holding views
        assert ingress.pool.stats().used > 0
    finally:
        r.close()
    assert ours() == before
    assert pool_name not in ours()
    assert_bit_exact(kept[0].payload, large_payload())  # views outlive the unlinked name


@pytest.mark.parametrize("kind", ["shm", NIXL])
def test_a_grant_outside_the_pool_is_cancelled_and_nothing_is_written(rig: Rig, kind: str) -> None:
    """Sender._check_grant in each backend's transfer: a grant that does not lie inside the
    pool the welcome described (here one starting at its end) is refused before any write,
    and the reservation it answered is cancelled; the sender goes on working."""
    ingress = rig.ingress(kind, size=4 * MiB)
    sender = rig.sender(kind, ingress)
    assert isinstance(sender, Sender)
    manifest, tensors = plan({"x": torch.full((MiB,), 7, dtype=torch.uint8)})
    end = ingress.pool.backing.size
    with sender._lock:
        xid, offset, write_by = sender._reserve("r", manifest.nbytes, time.monotonic() + WAIT)
        assert ingress.stats().pool_used > 0
        with pytest.raises(RelayError, match="outside its pool; not written"):
            sender._transfer(Transfer(xid, end, manifest, tensors, write_by, b""))
    wait_for(lambda: ingress.stats().pool_used == 0)  # the grant was cancelled
    assert not ingress.pool.backing.tensor[offset : offset + MiB].any()  # nor written there
    payload = small_payload(1) | {"big": torch.ones(MiB, dtype=torch.uint8)}
    sender.send(payload, request_id="after")
    with ingress.recv(timeout=WAIT) as msg:
        assert_bit_exact(msg.payload, payload)
