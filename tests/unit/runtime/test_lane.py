"""The inline lane's framing (relay/lane.py) over real socket pairs, and its addressing."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_runtime.relay import lane
from disagg_runtime.relay.protocol import MAX_CONTROL_BYTES, MAX_INLINE_MESSAGE_BYTES


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    writer, reader = socket.socketpair()
    reader.setblocking(False)
    try:
        yield writer, reader
    finally:
        writer.close()
        reader.close()


def wire(frames: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(lane.frame_prefix(h, len(d)) + h + d for h, d in frames)


def drain(reader: lane.LaneReader) -> list[tuple[bytes, bytes]]:
    return [(bytes(f.header), bytes(f.data)) for f in reader.read()]


frames_strategy = st.lists(
    st.tuples(st.binary(max_size=300), st.binary(max_size=3000)), min_size=1, max_size=12
)


@settings(max_examples=60, deadline=None)
@given(frames=frames_strategy, cuts=st.lists(st.integers(1, 4000), max_size=20))
def test_frames_come_out_whole_however_the_stream_is_cut(
    frames: list[tuple[bytes, bytes]], cuts: list[int]
) -> None:
    writer, sock = socket.socketpair()
    sock.setblocking(False)
    try:
        reader = lane.LaneReader(sock)
        stream = wire(frames)
        got: list[tuple[bytes, bytes]] = []
        pos = 0
        for cut in [*cuts, len(stream)]:
            piece = stream[pos : pos + cut]
            pos += len(piece)
            if piece:
                writer.sendall(piece)
            got += drain(reader)
        assert got == frames
    finally:
        writer.close()
        sock.close()


def test_a_frame_larger_than_the_scratch_buffer_lands_in_its_own_buffer(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    writer, sock = pair
    reader = lane.LaneReader(sock)
    big = os.urandom(lane.SCRATCH_BYTES * 3 + 17)
    stream = wire([(b'{"op":"x"}', big), (b"{}", b"tail")])
    got: list[tuple[bytes, bytes]] = []
    for i in range(0, len(stream), 100_000):  # the socket buffer holds only so much at once
        writer.sendall(stream[i : i + 100_000])
        got += drain(reader)
    assert got == [(b'{"op":"x"}', big), (b"{}", b"tail")]


def test_received_data_is_a_writable_view_of_its_own_buffer(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    writer, sock = pair
    writer.sendall(wire([(b"h1", b"abcd"), (b"h2", b"efgh")]))
    first, second = lane.LaneReader(sock).read()
    assert not first.data.readonly
    first.data[0] = ord("z")  # frames do not share memory
    assert bytes(first.data) == b"zbcd" and bytes(second.data) == b"efgh"


@pytest.mark.parametrize(
    "prefix",
    [
        lane.PREFIX.pack(MAX_CONTROL_BYTES + 1, 0),
        lane.PREFIX.pack(2, MAX_INLINE_MESSAGE_BYTES + 1),
        lane.PREFIX.pack(0xFFFFFFFF, 0xFFFFFFFF),
    ],
)
def test_lengths_over_the_limits_break_the_lane(
    pair: tuple[socket.socket, socket.socket], prefix: bytes
) -> None:
    writer, sock = pair
    writer.sendall(prefix)
    with pytest.raises(lane.LaneError, match="over the limits"):
        lane.LaneReader(sock).read()


def test_a_closed_peer_ends_the_lane_and_a_cut_frame_is_never_delivered(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    writer, sock = pair
    reader = lane.LaneReader(sock)
    stream = wire([(b"whole", b"1"), (b"cut", b"22222")])
    writer.sendall(stream[:-2])
    assert drain(reader) == [(b"whole", b"1")]
    writer.close()
    with pytest.raises(lane.LaneError, match="closed"):
        reader.read()


def test_nothing_to_read_returns_no_frames(pair: tuple[socket.socket, socket.socket]) -> None:
    assert lane.LaneReader(pair[1]).read() == []


def test_send_frame_writes_prefix_header_and_data(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    writer, sock = pair
    data = bytearray(os.urandom(200_000))  # more than one write of a socket pair
    got: list[tuple[bytes, bytes]] = []
    reader = lane.LaneReader(sock)
    writer.setblocking(True)
    thread = threading.Thread(target=lane.send_frame, args=(writer, b'{"op":"inline"}', data))
    thread.start()
    while not got:
        got = drain(reader)
    thread.join()
    assert got == [(b'{"op":"inline"}', bytes(data))]


# -- addressing ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("zmq_host", "lane_host"),
    [
        ("0.0.0.0", "::"),
        ("*", "::"),
        ("::", "::"),
        ("127.0.0.1", "127.0.0.1"),
        ("::ffff:127.0.0.1", "127.0.0.1"),  # how dual-stack ZMQ reports an IPv4 bind
        ("::1", "::1"),
        ("my-role.ns.svc", "my-role.ns.svc"),
    ],
)
def test_the_lane_listens_where_the_zmq_socket_is_bound(zmq_host: str, lane_host: str) -> None:
    assert lane._bind_host(zmq_host) == lane_host


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://[::ffff:127.0.0.1]:5555"])
def test_tcp_lane_is_offered_by_port_and_reached_at_the_endpoint_host(endpoint: str) -> None:
    listening = lane.listen(endpoint)
    assert listening is not None
    listener, offer = listening
    try:
        assert set(offer) == {"lane_port"} and offer["lane_port"] > 0
        conn = lane.connect(endpoint, offer, timeout=5)
        assert conn is not None
        conn.close()
    finally:
        listener.close()


def test_a_fixed_lane_port_is_used_as_given() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    listening = lane.listen("tcp://127.0.0.1:5555", port=port)
    assert listening is not None
    try:
        assert listening[1] == {"lane_port": port}
    finally:
        listening[0].close()


def test_ipc_lane_is_a_unix_socket_beside_the_zmq_one() -> None:
    folder = tempfile.mkdtemp(prefix="dgl")
    endpoint = f"ipc://{folder}/in.sock"
    listening = lane.listen(endpoint)
    assert listening is not None
    listener, offer = listening
    try:
        assert offer == {"lane_path": f"{folder}/in.sock.lane"}
        conn = lane.connect(endpoint, offer, timeout=5)
        assert conn is not None
        conn.close()
    finally:
        listener.close()
        os.unlink(offer["lane_path"])
        os.rmdir(folder)


def test_no_lane_without_an_offer_or_for_inproc() -> None:
    assert lane.listen("inproc://x") is None
    assert lane.connect("tcp://127.0.0.1:5555", {}, timeout=1) is None
    assert lane.connect("ipc:///tmp/x", {"lane_port": 5}, timeout=1) is None


def test_an_unreachable_lane_is_an_oserror() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nobody listens there now
    with pytest.raises(OSError):
        lane.connect("tcp://127.0.0.1:5555", {"lane_port": port}, timeout=2)


def test_one_read_takes_a_bounded_share_of_a_busy_lane(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    writer, sock = pair
    frames = [(b"h", bytes([i % 256]) * 1024) for i in range(200)]  # ~3 scratch buffers
    thread = threading.Thread(target=writer.sendall, args=(wire(frames),))
    thread.start()
    reader = lane.LaneReader(sock)
    got = drain(reader)
    while len(got) < len(frames):
        more = drain(reader)
        assert len(more) <= lane.MAX_FRAMES_PER_READ + lane.SCRATCH_BYTES // 1024
        got += more
    thread.join()
    assert got == frames
