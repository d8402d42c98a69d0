"""The inline lane (relay/lane.py) and delivery on the ingress's I/O thread, with real
sockets: ordering against the ZMQ path, fallbacks, and malformed lane traffic."""

from __future__ import annotations

import select
import socket
import threading
from typing import Any

import pytest
import torch

from disagg_runtime.memory.layout import PLANNED_SIGNATURES
from disagg_runtime.memory.pool import MiB
from disagg_runtime.relay import Ingress, Message, RelayError, RelayTimeout, inline_wire, lane
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.sender import Sender
from disagg_runtime.relay.session import CREDIT_MIN
from tests.payload_checks import assert_bit_exact
from tests.relay_rig import (
    KINDS,
    WAIT,
    KiB,
    Rig,
    assert_still_serves,
    filled,
    handshake,
    lane_hello,
    large_payload,
    recv_reply,
    small_payload,
)
from tests.support import wait_for


def open_lane(ingress: Ingress, welcome: dict[str, Any]) -> socket.socket:
    sock = lane.connect(ingress.endpoint, welcome, timeout=WAIT)
    assert sock is not None, f"no lane offered in {welcome}"
    return sock


def raw_sender(
    rig: Rig, ingress: Ingress, *, control: bool = False, relay: str | None = None
) -> tuple[Any, socket.socket]:
    """A bare DEALER plus its lane, introduced the way a Sender does it (as `relay`; by
    default shm with a control lane, else tcp)."""
    dealer = rig.raw(ingress, authenticate=False)
    welcome = handshake(dealer, relay=relay or ("shm" if control else "tcp"))
    sock = open_lane(ingress, welcome)
    lane.send_frame(sock, lane_hello(welcome, control=control), b"")
    assert sock.recv(1) == lane.READY
    return dealer, sock


def lane_reply(sock: socket.socket) -> dict[str, Any]:
    """The next reply the ingress wrote on a control lane (its `load` reports skipped)."""
    reader = lane.LaneReader(sock)
    sock.settimeout(WAIT)
    replies: list[dict[str, Any]] = []
    while not replies:
        assert select.select([sock], [], [], WAIT)[0], "no reply on the lane"
        msgs = [proto.unpack(f.header, proto.OPS_TO_SENDER) for f in reader.read()]
        replies = [m for m in msgs if m["op"] != "load"]
    assert len(replies) == 1
    return replies[0]


def inline_frame(rid: str, data: bytes = b"\x07" * 16) -> tuple[bytes, bytes]:
    manifest = {
        "v": 1,
        "tree": {"t": 0},
        "nbytes": len(data),
        "tensors": [{"dtype": "uint8", "shape": [len(data)], "offset": 0}],
    }
    return proto.pack("inline", rid=rid, manifest=manifest), data


def binary_frame(rid: str, data: bytes = b"\x07" * 16, **fixed: int) -> tuple[bytes, bytes]:
    """inline_frame's message with a binary header (relay/inline_wire.py); `fixed` overrides
    fields of its fixed part (kind, version)."""
    layout = b'{"v":1,"nbytes":16,"tensors":[{"dtype":"uint8","shape":[16],"offset":0}]}'
    header = inline_wire.pack(rid, layout, {"t": 0}, None)
    kind, version, *lengths = inline_wire.FIXED.unpack_from(header)
    fields = (fixed.get("kind", kind), fixed.get("version", version), *lengths)
    return inline_wire.FIXED.pack(*fields) + header[inline_wire.FIXED.size :], data


@pytest.mark.parametrize("kind", KINDS)
def test_inline_and_staged_payloads_arrive_in_send_order(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind)
    sender = rig.sender(kind, ingress)
    wait_for(lambda: ingress.stats().lanes == 1)  # inline payloads take the lane
    sent = []
    for i in range(9):  # three large ones (4 MiB blocks) stay held: the pool has 16 MiB
        payload = large_payload(i) if i % 3 == 2 else small_payload(i)
        sender.send(payload, request_id=f"r{i}")
        sent.append(payload)
    for i, payload in enumerate(sent):
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == f"r{i}"
            assert_bit_exact(msg.payload, payload)
    assert ingress.stats().rejected == 0


@pytest.mark.parametrize("kind", KINDS)
def test_inline_payloads_go_over_zmq_without_a_lane(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind)
    sender = rig.sender(kind, ingress, lane=False)
    for i in range(3):
        sender.send(small_payload(i), request_id=f"z{i}")
    for i in range(3):
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == f"z{i}"
            assert_bit_exact(msg.payload, small_payload(i))
    assert ingress.stats().lanes == 0


def test_an_unreachable_lane_falls_back_to_zmq(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refused(*args: Any, **kwargs: Any) -> socket.socket:
        raise ConnectionRefusedError("lane port filtered")

    monkeypatch.setattr(lane, "connect", refused)
    ingress = rig.ingress("tcp")
    with caplog.at_level("INFO"):
        sender = rig.sender("tcp", ingress)
    assert "sends inline over ZMQ" in caplog.text
    sender.send(small_payload(), request_id="fallback")
    with ingress.recv(timeout=WAIT) as msg:
        assert_bit_exact(msg.payload, small_payload())


def test_lanes_beyond_the_limit_are_refused_and_their_senders_use_zmq(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lane, "MAX_CONNECTIONS", 1)
    ingress = rig.ingress("tcp")
    first, second = rig.sender("tcp", ingress), rig.sender("tcp", ingress)
    for sender, rid in ((first, "via-lane"), (second, "via-zmq")):
        sender.send(small_payload(), request_id=rid)
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == rid
    assert ingress.stats().lanes == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_broken_lane_is_dropped_and_zmq_carries_that_payload_and_the_next(
    rig: Rig, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ingress = rig.ingress(kind)
    sender = rig.sender(kind, ingress)
    real_send, real_whole = lane.send_frame, lane.send_whole

    def broken(*args: Any) -> None:
        raise ConnectionResetError("peer reset")

    monkeypatch.setattr(lane, "send_frame", broken)
    monkeypatch.setattr(lane, "send_whole", broken)  # how an inline frame goes
    sender.send(small_payload(), request_id="when-it-broke")
    monkeypatch.setattr(lane, "send_frame", real_send)
    monkeypatch.setattr(lane, "send_whole", real_whole)
    sender.send(small_payload(1), request_id="after")
    sender.send(large_payload(), request_id="staged")  # the handshake over ZMQ too
    for rid in ("when-it-broke", "after", "staged"):
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == rid
    wait_for(lambda: ingress.stats().lanes == 0)


def test_a_medium_tcp_payload_whose_lane_breaks_under_it_is_reserved(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inline on the lane, a medium tcp payload whose write finds the lane broken goes
    reserved, as later ones do: over ZMQ a full inline budget would drop it."""
    ingress = rig.ingress("tcp")
    sender = rig.sender("tcp", ingress)
    medium = filled(256 * KiB, 9)
    assert isinstance(sender, Sender) and sender.inline_max >= medium["x"].numel()

    def broken(*args: Any) -> None:
        raise ConnectionResetError("peer reset")

    monkeypatch.setattr(lane, "send_whole", broken)
    sender.send(medium, request_id="when-it-broke")
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "when-it-broke" and msg.slot is not None
        assert_bit_exact(msg.payload, medium)


@pytest.mark.parametrize("kind", KINDS)
def test_a_receiver_that_stops_reading_times_out_the_lane_and_loses_nothing_sent(
    rig: Rig, kind: str
) -> None:
    unblock = threading.Event()
    got: list[str] = []

    def on_message(msg: Message) -> None:
        unblock.wait(WAIT)  # the I/O thread stops reading: socket buffers fill up
        got.append(msg.request_id)
        msg.release()

    ingress = rig.ingress(kind, on_message=on_message)
    sender = rig.sender(kind, ingress, timeout=0.5)
    # inline: under CREDIT_MIN (a stream's larger ones go through credit, not the lane)
    payload = {"x": torch.zeros(CREDIT_MIN - 2 * 1024, dtype=torch.uint8)}
    sent = 0
    with pytest.raises(RelayTimeout, match="not draining"):
        for _ in range(5000):  # ~300 MiB: far more than any socket buffer
            sender.send(payload, request_id=f"m{sent}")
            sent += 1
    unblock.set()
    wait_for(lambda: len(got) == sent)  # everything send() accepted arrives, in order
    assert got == [f"m{i}" for i in range(sent)]
    sender.send(payload, request_id="after")  # over ZMQ now: the cut lane was closed
    wait_for(lambda: got[-1:] == ["after"])
    assert ingress.stats().lanes == 0


def test_a_reservation_waits_for_the_lane_frames_sent_before_it(rig: Rig) -> None:
    ingress = rig.ingress("tcp")
    dealer, sock = raw_sender(rig, ingress)
    try:
        dealer.send(proto.pack("reserve", rid="big", xid=1, nbytes=MiB, wait_s=WAIT, lane=1))
        with pytest.raises(AssertionError, match="no reply"):  # `load` reports aside
            recv_reply(dealer, timeout=0.3)  # no grant before the inline frame ahead of it
        lane.send_frame(sock, *inline_frame("first"))
        grant = recv_reply(dealer)
        assert grant["op"] == "grant" and grant["xid"] == 1
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == "first"
        dealer.send(proto.pack("cancel", xid=1))
        wait_for(lambda: ingress.pool.stats().used == 0)
    finally:
        sock.close()


def test_a_control_lane_carries_the_whole_handshake_and_its_replies(rig: Rig) -> None:
    ingress = rig.ingress("shm")
    dealer, sock = raw_sender(rig, ingress, control=True)
    try:
        lane.send_frame(sock, proto.pack("reserve", rid="r", xid=1, nbytes=MiB, wait_s=WAIT), b"")
        grant = lane_reply(sock)
        assert (grant["op"], grant["xid"]) == ("grant", 1)
        bad = {"v": 1, "tree": {"t": 0}, "nbytes": 1, "tensors": []}  # tree names no tensor
        lane.send_frame(
            sock, proto.pack("commit", rid="r", xid=1, offset=grant["offset"], manifest=bad), b""
        )
        nack = lane_reply(sock)  # answered at once, on the lane
        assert (nack["op"], nack["xid"]) == ("nack", 1)
        lane.send_frame(sock, proto.pack("reserve", rid="r", xid=2, nbytes=MiB), b"")
        grant = lane_reply(sock)
        manifest = {
            "v": 1,
            "tree": {"t": 0},
            "nbytes": 4,
            "tensors": [{"dtype": "uint8", "shape": [4], "offset": 0}],
        }
        ingress.pool.backing.buffer(grant["offset"], 4)[:] = b"\x01\x02\x03\x04"
        commit = proto.pack("commit", rid="r", xid=2, offset=grant["offset"], manifest=manifest)
        lane.send_frame(sock, commit, b"")
        ack = lane_reply(sock)
        assert (ack["op"], ack["xid"], ack["load"]["queued"]) == ("ack", 2, 1)  # counts it
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.payload.tolist() == [1, 2, 3, 4]
        with pytest.raises(AssertionError, match="no reply"):  # only `load`s go over ZMQ
            recv_reply(dealer, timeout=0.1)
        assert ingress.stats().rejected == 1
    finally:
        sock.close()


def binary_commit(rid: str, xid: int, offset: int, nbytes: int = 4, **kw: Any) -> bytes:
    """A binary commit (relay/inline_wire.py) of one uint8 tensor of `nbytes` at the slot's
    start; `kw`: meta, ask."""
    layout = b'{"v":1,"nbytes":%d,"tensors":[{"dtype":"uint8","shape":[%d],"offset":0}]}' % (
        nbytes,
        nbytes,
    )
    return inline_wire.pack_commit(
        rid, xid, offset, layout, {"t": 0}, kw.get("meta"), kw.get("ask")
    )


def test_a_binary_commit_lands_and_a_bad_one_is_nacked_with_its_slot_freed(rig: Rig) -> None:
    ingress = rig.ingress("shm", size=4 * MiB)
    _, sock = raw_sender(rig, ingress, control=True)
    try:
        lane.send_frame(sock, proto.pack("reserve", rid="r", xid=1, nbytes=MiB), b"")
        grant = lane_reply(sock)
        too_big = binary_commit("r", 1, grant["offset"], nbytes=MiB + 1)  # over its 1 MiB slot
        lane.send_frame(sock, too_big, b"")
        nack = lane_reply(sock)
        assert (nack["op"], nack["xid"]) == ("nack", 1)
        assert "does not fit a slot of 1048576 B" in nack["reason"]
        assert ingress.pool.stats().used == 0  # the grant was let go
        lane.send_frame(sock, binary_commit("r", 1, grant["offset"]), b"")  # no grant now
        assert lane_reply(sock)["op"] == "nack"
        lane.send_frame(sock, proto.pack("reserve", rid="r", xid=2, nbytes=MiB), b"")
        grant = lane_reply(sock)
        lane.send_frame(sock, binary_commit("r", 2, grant["offset"] + MiB), b"")  # wrong slot
        assert "differs from the grant" in lane_reply(sock)["reason"]
        lane.send_frame(sock, proto.pack("reserve", rid="r", xid=3, nbytes=MiB), b"")
        grant = lane_reply(sock)
        ingress.pool.backing.buffer(grant["offset"], 4)[:] = b"\x01\x02\x03\x04"
        lane.send_frame(sock, binary_commit("r", 3, grant["offset"], meta={"m": 1}), b"")
        ack = lane_reply(sock)
        assert (ack["op"], ack["xid"]) == ("ack", 3)
        with ingress.recv(timeout=WAIT) as msg:
            assert (msg.request_id, msg.meta, msg.payload.tolist()) == ("r", {"m": 1}, [1, 2, 3, 4])
        assert ingress.stats().rejected == 3
        assert ingress.stats().lanes == 1
    finally:
        sock.close()


def test_a_tcp_senders_binary_commit_is_the_plain_one(rig: Rig) -> None:
    """The tcp landing takes only chunked commits: a binary commit of a tcp sender (its
    bytes in the slot already) lands as any plain one."""
    ingress = rig.ingress("tcp")
    _, sock = raw_sender(rig, ingress, control=True, relay="tcp")
    try:
        lane.send_frame(sock, proto.pack("reserve", rid="r", xid=1, nbytes=MiB), b"")
        grant = lane_reply(sock)
        ingress.pool.backing.buffer(grant["offset"], 4)[:] = b"\x01\x02\x03\x04"
        lane.send_frame(sock, binary_commit("r", 1, grant["offset"]), b"")
        assert lane_reply(sock)["op"] == "ack"
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.payload.tolist() == [1, 2, 3, 4]
    finally:
        sock.close()


def test_a_binary_commit_on_a_lane_for_inline_messages_only_is_rejected(rig: Rig) -> None:
    ingress = rig.ingress("tcp")
    _, sock = raw_sender(rig, ingress)  # not a control lane
    try:
        lane.send_frame(sock, binary_commit("r", 1, 0), b"")
        lane.send_frame(sock, *inline_frame("good"))
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == "good"
        assert ingress.stats().rejected == 1
    finally:
        sock.close()


@pytest.mark.parametrize("binary", [True, False])
def test_shm_senders_commit_in_binary_where_offered_and_in_json_otherwise(
    rig: Rig, binary: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[int] = []
    unpack_commit = inline_wire.unpack_commit

    def counting(header: memoryview) -> inline_wire.Commit:
        parsed.append(1)
        return unpack_commit(header)

    monkeypatch.setattr(inline_wire, "unpack_commit", counting)
    ingress = rig.ingress("shm", size=32 * MiB)
    sender = rig.sender("shm", ingress)
    assert isinstance(sender, Sender)
    wait_for(lambda: ingress.stats().lanes == 1)
    assert sender.session.commit_wire  # the welcome offered it
    sender.session.commit_wire = binary  # False: as a sender from before commit_wire
    payloads = [large_payload(i) if i % 2 else filled(MiB + i) for i in range(6)]
    for i, payload in enumerate(payloads):  # back to back: spares are asked for and used
        sender.send(payload, request_id=f"c{i}", meta={"i": i})
        with ingress.recv(timeout=WAIT) as msg:
            assert (msg.request_id, msg.meta) == (f"c{i}", {"i": i})
            assert_bit_exact(msg.payload, payload)
    assert len(parsed) == (6 if binary else 0)
    assert ingress.stats().rejected == 0
    assert ingress.stats().spares_used > 0


def test_a_tcp_commit_cannot_travel_on_the_lane(rig: Rig) -> None:
    ingress = rig.ingress("tcp")
    _, sock = raw_sender(rig, ingress, control=True)
    try:
        lane.send_frame(sock, proto.pack("reserve", rid="r", xid=1, nbytes=MiB), b"")
        grant = lane_reply(sock)
        manifest: dict[str, Any] = {"v": 1, "tree": None, "nbytes": 0, "tensors": []}
        commit = proto.pack(
            "commit", rid="r", xid=1, offset=grant["offset"], manifest=manifest, chunk=4096
        )
        lane.send_frame(sock, commit, b"")
        assert lane_reply(sock)["op"] == "nack"
        assert ingress.pool.stats().used == 0  # the grant was let go before the nack
    finally:
        sock.close()


def test_a_connection_that_does_not_introduce_itself_is_closed(rig: Rig) -> None:
    ingress = rig.ingress("tcp")
    dealer = rig.raw(ingress, authenticate=False)
    sock = open_lane(ingress, handshake(dealer, relay="tcp"))
    try:
        lane.send_frame(sock, *inline_frame("no-hello"))  # not a hello: not a lane of ours
        sock.settimeout(WAIT)
        assert sock.recv(1) == b""  # closed by the ingress
        wait_for(lambda: ingress.stats().refused == 1)
        assert ingress.stats().delivered == 0
    finally:
        sock.close()
    assert_still_serves(rig, ingress, "tcp")


@pytest.mark.parametrize("case", ["unknown", "reused"])
def test_a_lane_hello_with_an_id_this_ingress_did_not_give_is_refused(rig: Rig, case: str) -> None:
    ingress = rig.ingress("tcp")
    dealer = rig.raw(ingress, authenticate=False)
    welcome = handshake(dealer, relay="tcp")
    first = open_lane(ingress, welcome)
    lane.send_frame(first, lane_hello(welcome), b"")
    assert first.recv(1) == lane.READY  # the id is spent now
    token = welcome["lane_id"] if case == "reused" else "ab" * 16
    sock = open_lane(ingress, welcome)
    try:
        lane.send_frame(sock, lane_hello({"lane_id": token}), b"")
        sock.settimeout(WAIT)
        assert sock.recv(1) == b""  # closed: a lane is never tied to a sender twice or blindly
        assert ingress.stats().lanes == 1
    finally:
        sock.close()
        first.close()


def test_an_oversized_lane_frame_closes_the_lane(rig: Rig) -> None:
    ingress = rig.ingress("tcp")
    _, sock = raw_sender(rig, ingress)
    try:
        sock.sendall(lane.PREFIX.pack(proto.MAX_CONTROL_BYTES + 1, 0))
        sock.settimeout(WAIT)
        assert sock.recv(1) == b""
        wait_for(lambda: ingress.stats().lanes == 0)
    finally:
        sock.close()
    assert_still_serves(rig, ingress, "tcp")


@pytest.mark.parametrize(
    ("header", "data"),
    [
        (b"not json", b""),
        (proto.pack("reserve", rid="r", xid=1, nbytes=10), b""),  # not an op of the lane
        (inline_frame("short")[0], b"\x07" * 15),  # data shorter than the manifest says
        (inline_frame("long")[0], b"\x07" * 17),
        (binary_frame("short")[0], b"\x07" * 15),  # the same with binary headers
        (binary_frame("long")[0], b"\x07" * 17),
        (binary_frame("cut")[0][:-1], b"\x07" * 16),  # truncated
        (binary_frame("cut")[0][:10], b"\x07" * 16),
        (binary_frame("extra")[0] + b"}", b"\x07" * 16),  # longer than its parts
        binary_frame("kind", kind=9),  # unknown kind
        binary_frame("version", version=7),
    ],
)
def test_malformed_lane_messages_are_rejected_and_the_lane_keeps_serving(
    rig: Rig, header: bytes, data: bytes
) -> None:
    ingress = rig.ingress("tcp")
    _, sock = raw_sender(rig, ingress)
    try:
        lane.send_frame(sock, header, data)
        lane.send_frame(sock, *inline_frame("good"))
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == "good"
        assert ingress.stats().rejected == 1
        assert ingress.stats().lanes == 1
    finally:
        sock.close()


def test_senders_write_binary_inline_headers_and_every_layout_and_meta_arrives(rig: Rig) -> None:
    ingress = rig.ingress("shm")
    sender = rig.sender("shm", ingress)
    assert isinstance(sender, Sender)
    wait_for(lambda: ingress.stats().lanes == 1)
    assert sender.session.inline_wire  # the welcome offered it
    # more layouts than either end keeps, then the first ones again
    sizes = [*range(1, max(inline_wire.LAYOUT_CACHE_ENTRIES, PLANNED_SIGNATURES) + 6), 1, 2, 3]
    for i, n in enumerate(sizes):
        payload = {"x": torch.arange(n, dtype=torch.int16), "i": i, "t": (small_payload(i), None)}
        sender.send(payload, request_id=f"b{i}", meta={"seq": i} if i % 2 else None)
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == f"b{i}"
            assert msg.meta == ({"seq": i} if i % 2 else None)
            assert_bit_exact(msg.payload, payload)
    assert ingress.stats().rejected == 0
    assert len(sender._planner) == PLANNED_SIGNATURES  # bounded


def test_the_lane_listens_on_the_declared_port(rig: Rig) -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    ingress = rig.ingress("tcp", lane_port=port)
    dealer = rig.raw(ingress, authenticate=False)
    assert handshake(dealer, relay="tcp")["lane_port"] == port
    with pytest.raises(RelayError, match=f"cannot listen for the inline lane on port {port}"):
        rig.ingress("tcp", lane_port=port)  # taken: a declared port must be ours


# -- delivery on the I/O thread ------------------------------------------------------------


def test_on_message_runs_on_the_io_thread_and_recv_is_refused(rig: Rig) -> None:
    got: list[tuple[str, str]] = []
    done = threading.Event()

    def on_message(msg: Message) -> None:
        got.append((msg.request_id, threading.current_thread().name))
        msg.release()
        if len(got) == 2:
            done.set()

    ingress = rig.ingress("tcp", on_message=on_message)
    sender = rig.sender("tcp", ingress)
    sender.send(small_payload(), request_id="small")
    sender.send(large_payload(), request_id="large")
    assert done.wait(WAIT)
    assert got == [("small", "disagg-ingress"), ("large", "disagg-ingress")]
    assert ingress.pool.stats().used == 0
    with pytest.raises(RelayError, match="on_message"):
        ingress.recv(timeout=0.1)


def test_a_failing_on_message_releases_the_message_and_delivery_goes_on(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    kept: list[Message] = []

    def on_message(msg: Message) -> None:
        if msg.request_id == "boom":
            raise RuntimeError("handler bug")
        kept.append(msg)

    ingress = rig.ingress("shm", on_message=on_message)
    sender = rig.sender("shm", ingress)
    with caplog.at_level("ERROR"):
        sender.send(large_payload(), request_id="boom")  # a pool slot: it must come back
        sender.send(large_payload(1), request_id="fine")
        wait_for(lambda: len(kept) == 1)
    assert "on_message failed" in caplog.text
    assert kept[0].request_id == "fine" and kept[0].slot is not None
    # (waits: a spare slot the ack of "fine" granted ahead is freed by its short lease)
    held = ingress.pool.allocator.size_of(kept[0].slot)
    wait_for(lambda: ingress.pool.stats().used == held, message="only 'fine' held")
    kept[0].release()
    wait_for(lambda: ingress.pool.stats().used == 0, message="the pool empty")


def test_the_io_loop_outlives_an_unexpected_error(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ingress = rig.ingress("tcp")
    real = Ingress._grant_pending
    failures = [RuntimeError("bug")]

    def flaky(self: Ingress) -> None:
        if failures:
            raise failures.pop()
        real(self)

    with caplog.at_level("ERROR"):
        monkeypatch.setattr(Ingress, "_grant_pending", flaky)
        ingress._wake()  # one turn of the loop: it fails once
        wait_for(lambda: "unexpected error in the I/O loop" in caplog.text)
    assert_still_serves(rig, ingress, "tcp")


def test_a_grant_lapses_on_time_while_only_inline_frames_arrive(rig: Rig) -> None:
    """Steps that only deliver inline frames skip the ingress's housekeeping until its next
    deadline: a grant nobody commits is still freed at the end of its lease, mid-stream."""
    delivered: list[str] = []

    def on_message(msg: Message) -> None:
        delivered.append(msg.request_id)
        msg.release()

    ingress = rig.ingress("tcp", lease_s=0.5, on_message=on_message)
    holder = rig.raw(ingress)
    holder.send(proto.pack("reserve", rid="held", xid=1, nbytes=2 * MiB))
    assert recv_reply(holder)["op"] == "grant"
    assert ingress.pool.stats().used == 2 * MiB
    _, sock = raw_sender(rig, ingress)
    stop = threading.Event()

    def stream() -> None:
        i = 0
        while not stop.is_set():
            lane.send_frame(sock, *binary_frame(f"s{i}"))
            i += 1

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(delivered) > 0)
        wait_for(lambda: ingress.pool.stats().used == 0)  # lapsed while frames kept coming
        count = len(delivered)
        wait_for(lambda: len(delivered) > count)
    finally:
        stop.set()
        thread.join(timeout=WAIT)
    assert ingress.stats().rejected == 0


def test_a_stream_of_sends_polls_for_replies_at_most_every_watch_gap(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    import zmq

    from disagg_runtime.relay import link

    ingress = rig.ingress("shm")
    sender = rig.sender("shm", ingress)
    wait_for(lambda: ingress.stats().lanes == 1)
    polls: list[float] = []
    real = zmq.zmq_poll

    def counted(*args: Any) -> Any:
        polls.append(time.monotonic())
        return real(*args)

    monkeypatch.setattr(zmq, "zmq_poll", counted)
    monkeypatch.setattr(link, "WATCH_GAP_S", 10.0)  # one poll for the whole burst
    sender._watched_at = float("-inf")  # type: ignore[attr-defined]  # the next send asks
    for i in range(50):
        sender.send(small_payload(i), request_id=f"s{i}")
    assert len(polls) == 1
    monkeypatch.setattr(link, "WATCH_GAP_S", 0.0)  # every send asks again
    for i in range(5):
        sender.send(small_payload(i), request_id=f"t{i}")
    assert len(polls) == 6
    for _ in range(55):
        ingress.recv(timeout=WAIT).release()
