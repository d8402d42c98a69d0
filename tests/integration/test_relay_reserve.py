"""Reserve, fill, commit over the shm relay (relay/backends/shm.py): a caller writes a payload's
bytes straight into the receiver's pool, as the gateway does with a safetensors body
(gateway/native.py `slot_layout`), between a real sender and a real ingress. Over tcp
(relay/backends/tcp/send.py): reserve, then stream the chunks as the caller has them, or cut the
stream, which frees the slot at once and leaves the connection usable."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch
from safetensors.torch import save as st_save

from disagg_core.contract import Peer
from disagg_runtime.client import Client, UploadExpired, chunk_sources
from disagg_runtime.gateway import native
from disagg_runtime.relay import Ingress, RelayError, RelayTimeout, ShmSender, TcpSender
from disagg_runtime.relay.backends.tcp import chunk_targets
from disagg_runtime.routing import relays
from disagg_runtime.routing.relays import Dedicated
from tests.relay_rig import KEY, WAIT, Rig


def mixed_body() -> bytes:
    """Tensors whose safetensors offsets are not 64-aligned, in names that nest out of
    data order, with scalars in the metadata."""
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "z": torch.randint(0, 255, (1001,), dtype=torch.uint8, generator=gen),
        "a.b": torch.randn(3, 517, generator=gen).to(torch.bfloat16),
        "a.c": torch.randint(-9, 9, (77,), dtype=torch.int64, generator=gen),
        "m.x": torch.randn(4096, generator=gen),
        "empty": torch.zeros(0, dtype=torch.float16),
    }
    return st_save(tensors, metadata={"a.steps": "4", "m.name": "fox", "n": "[1, 2]"})


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def fill(slot: memoryview, body: bytes) -> None:
    """What the gateway's reader does: the data section, span by span, to its place."""
    view = memoryview(body)
    size = native.header_size(view, len(body))
    metadata, spans = native.parse_header(view[8 : 8 + size], len(body) - 8 - size)
    _, places = native.slot_layout(metadata, spans)
    data = view[8 + size :]
    for span, at in zip(spans, places, strict=True):
        slot[at : at + span.meta.nbytes] = data[span.begin : span.end]


def parsed(body: bytes) -> tuple[Any, memoryview, list[int]]:
    """The body's manifest, its data section, and where each manifest tensor starts in it."""
    view = memoryview(body)
    size = native.header_size(view, len(body))
    metadata, spans = native.parse_header(view[8 : 8 + size], len(body) - 8 - size)
    manifest = native.slot_layout(metadata, spans)[0]
    return manifest, view[8 + size :], native.data_starts(metadata, spans)


def manifest_of(body: bytes) -> Any:
    return parsed(body)[0]


def tcp_client(*addresses: str) -> Client:
    """A Client whose entry role `front` is at `addresses` (host:port), over tcp."""
    return Client(
        [Peer("front", addresses)],
        ["front"],
        entry_relay="tcp",
        reply_relay="tcp",
        timeout=WAIT,
        key=KEY,
    )


def wait_used(ingress: Any, used: int) -> None:
    deadline = time.monotonic() + WAIT
    while ingress.pool.allocator.stats().used != used:
        assert time.monotonic() < deadline, f"pool use {ingress.pool.allocator.stats().used}"
        time.sleep(0.02)


def test_a_body_written_into_a_reserved_slot_arrives_as_its_payload(rig: Rig) -> None:
    ingress = rig.ingress("shm")
    sender = rig.sender("shm", ingress)
    assert isinstance(sender, ShmSender)
    body = mixed_body()
    grant = sender.reserve("r1", manifest_of(body), timeout=WAIT)
    assert ingress.pool.allocator.stats().used > 0  # held while the caller fills it
    fill(sender.slot(grant), body)
    sender.commit(grant, meta={"k": 1}, timeout=WAIT)
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "r1" and msg.meta == {"k": 1}
        assert same(msg.payload, native.request_from_safetensors(body))
    wait_used(ingress, 0)


def test_a_cancelled_reservation_frees_its_slot(rig: Rig) -> None:
    ingress = rig.ingress("shm")
    sender = rig.sender("shm", ingress)
    assert isinstance(sender, ShmSender)
    grant = sender.reserve("r2", manifest_of(mixed_body()), timeout=WAIT)
    assert ingress.pool.allocator.stats().used > 0
    sender.cancel(grant)
    wait_used(ingress, 0)
    sender.send({"x": torch.ones(1 << 18)}, request_id="r3")  # the sender goes on working
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "r3"


def test_a_slot_filled_too_late_is_not_committed(rig: Rig) -> None:
    ingress = rig.ingress("shm", lease_s=0.4)
    sender = rig.sender("shm", ingress)
    assert isinstance(sender, ShmSender)
    grant = sender.reserve("r4", manifest_of(mixed_body()), timeout=WAIT)
    time.sleep(0.3)  # past half the lease: the sender no longer trusts the grant
    with pytest.raises(RelayTimeout, match="lease"):
        sender.commit(grant, timeout=WAIT)
    wait_used(ingress, 0)


def chunked_tcp(
    rig: Rig,
) -> tuple[Ingress, TcpSender, bytes, Any, memoryview, list[tuple[int, int]]]:
    """A tcp ingress and a sender of 4 KiB chunks (nothing inline), a mixed body, its
    manifest and data section, and where each chunk comes from in that section."""
    ingress = rig.ingress("tcp")
    sender = rig.sender("tcp", ingress, chunk_bytes=4096, inline_max=0)
    assert isinstance(sender, TcpSender)
    body = mixed_body()
    manifest, data, starts = parsed(body)
    return ingress, sender, body, manifest, data, chunk_sources(manifest, 4096, starts)


def test_a_body_streamed_in_chunks_arrives_as_its_payload(rig: Rig) -> None:
    """Chunks of 4 KiB (several per tensor, tensors nesting out of data order) sent from
    the body's data section land where the manifest puts them; each chunk is taken by the
    receiver as it comes (the sender waits for nothing but the final ack)."""
    ingress, sender, body, manifest, data, sources = chunked_tcp(rig)
    assert [n for _, n in chunk_targets(0, manifest, 4096)] == [e - b for b, e in sources]
    grant = sender.reserve("t1", manifest, timeout=WAIT)
    assert ingress.pool.allocator.stats().used > 0
    with sender.stream(grant, meta={"k": 2}, timeout=WAIT) as out:
        for begin, end in sources:
            out.send(data[begin:end])
        out.finish()
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "t1" and msg.meta == {"k": 2}
        assert same(msg.payload, native.request_from_safetensors(body))
    wait_used(ingress, 0)


def test_a_cut_stream_frees_its_slot_and_the_connection_goes_on(rig: Rig) -> None:
    """Leaving the stream half way (the source went away): the receiver frees the slot at
    once, nothing is delivered, and the same connection carries the next transfer."""
    ingress, sender, _, manifest, data, sources = chunked_tcp(rig)
    grant = sender.reserve("t2", manifest, timeout=WAIT)
    with pytest.raises(ConnectionError), sender.stream(grant, timeout=WAIT) as out:
        for begin, end in sources[: len(sources) // 2]:
            out.send(data[begin:end])
        raise ConnectionError("the HTTP client went away")
    assert sender.usable
    wait_used(ingress, 0)
    with (
        pytest.raises(RelayError, match="the plan says"),
        sender.stream(sender.reserve("t3", manifest, timeout=WAIT), timeout=WAIT) as out,
    ):
        out.send(data[:100])  # not the plan's length: refused before it is sent
    assert sender.usable
    sender.send({"x": torch.ones(1 << 18)}, request_id="t4")
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "t4"  # neither t2 nor t3 was delivered
    wait_used(ingress, 0)


def test_dedicated_connections_are_reused_only_in_good_order(rig: Rig) -> None:
    """relays.Dedicated: a connection handed back after a transfer that ended in step is
    the next upload's; one whose stream broke off is closed, and a fresh one (with its own
    handshake) takes its place."""
    ingress = rig.ingress("tcp")
    dedicated = Dedicated(timeout=WAIT, key=KEY)
    try:
        first = dedicated.take(ingress.endpoint, timeout=WAIT)
        dedicated.give(first)
        assert dedicated.take(ingress.endpoint, timeout=WAIT) is first
        first._stream_broken()  # as after a cut the receiver did not answer
        dedicated.give(first)
        assert first.closed
        fresh = dedicated.take(ingress.endpoint, timeout=WAIT)
        assert fresh is not first and fresh.usable
        fresh.send({"x": torch.ones(1 << 18)}, request_id="d1")
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == "d1"
        dedicated.give(fresh)
    finally:
        dedicated.close()
    assert fresh.closed


def test_an_upload_reconnects_when_its_kept_connection_lost_its_receiver(rig: Rig) -> None:
    """Client.upload over tcp against a real ingress: the chunks land as the caller's
    buffer fills. The entry role then restarts in place: the next upload's kept connection
    finds its session lost (PeerLost, nothing sent) and a fresh one, with its own
    handshake, carries the payload."""
    first = rig.ingress("tcp")
    endpoint = first.endpoint
    client = tcp_client(endpoint.removeprefix("tcp://"))
    body = mixed_body()
    manifest, data, starts = parsed(body)
    try:
        for i, ingress in enumerate([first, None]):
            if ingress is None:
                first.close()
                ingress = rig.ingress("tcp", endpoint=endpoint)
            done = threading.Event()
            buffer = bytearray(len(data))
            upload = client.upload(
                manifest, memoryview(buffer), starts, timeout=WAIT, on_done=done.set
            )
            assert upload is not None
            upload.granted.result(WAIT)
            buffer[:] = data
            upload.advance(len(buffer))
            rid, future = upload.start()
            with ingress.recv(timeout=WAIT) as msg:
                assert msg.request_id == rid
                assert same(msg.payload, native.request_from_safetensors(body)), i
            assert done.wait(WAIT) and not future.done()  # delivered; no answer yet
            client.cancel(rid)
            # its abort goes out on the client's control thread: taken here, so that a late
            # one cannot reach the restarted ingress in place of the next upload
            with ingress.recv(timeout=WAIT) as msg:
                assert msg.meta is not None and (msg.request_id, msg.meta["kind"]) == (rid, "abort")
            (kept,) = [r for idle in client.uploads._idle.values() for r, _ in idle]
            if i == 0:
                before = kept
        assert before.closed and kept is not before  # the lost one was replaced
    finally:
        client.close()


def test_an_upload_goes_elsewhere_when_a_replica_does_not_answer_its_handshake(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One entry replica accepts TCP but never answers the relay handshake (its pod is
    gone while a stale lookup lists it; the kernel's backlog still takes connections).
    An upload that picks it gives up on it after CONNECT_S (Unanswered), skips it from
    then on, and reserves on the replica that answers: every upload arrives whole."""
    monkeypatch.setattr(relays, "CONNECT_S", 0.5)  # (the client's timeout, WAIT, is longer)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # never accepted, never answered
    mute = f"127.0.0.1:{silent.getsockname()[1]}"
    ingress = rig.ingress("tcp")
    client = tcp_client(mute, ingress.endpoint.removeprefix("tcp://"))
    body = mixed_body()
    manifest, data, starts = parsed(body)
    entry = client.entries[0]
    try:
        assert len(entry.endpoints(refresh=True)) == 2
        for _ in range(40):  # each upload picks either replica until the mute one is skipped
            done = threading.Event()
            buffer = bytearray(data)
            upload = client.upload(
                manifest, memoryview(buffer), starts, timeout=WAIT, on_done=done.set
            )
            assert upload is not None
            upload.granted.result(WAIT + 2)
            upload.advance(len(buffer))
            rid, _ = upload.start()
            with ingress.recv(timeout=WAIT) as msg:
                assert msg.request_id == rid
                assert same(msg.payload, native.request_from_safetensors(body))
            assert done.wait(WAIT)  # (no cancel: its abort would reach the ingress too)
            if f"tcp://{mute}" in entry._lost:
                break
        else:
            pytest.fail("no upload picked the replica that does not answer")
        # skipped from now on: the next upload reserves on the answering replica at once
        assert entry.endpoint_for("any", client.relays.viewer(entry.kind)) != f"tcp://{mute}"
    finally:
        client.close()
        silent.close()


@pytest.mark.parametrize("arrived", ["none", "all"])
def test_an_upload_cut_by_its_own_deadline_fails_as_expired(rig: Rig, arrived: str) -> None:
    """The upload thread's safety net (`write_by` + a quarter lease) cuts an upload whose
    bytes are short, or whose request has not started (its last chunk waits for `start`):
    the entry role's slot is freed, `on_done` runs, and a late `start` fails with
    UploadExpired (a gateway's 408) naming the bytes that were in; not the 503 of an
    upload that was released."""
    ingress = rig.ingress("tcp", lease_s=1.0)  # the net fires about 0.75 s after the grant
    client = tcp_client(ingress.endpoint.removeprefix("tcp://"))
    body = mixed_body()
    manifest, data, starts = parsed(body)
    try:
        done = threading.Event()
        buffer = bytearray(data)
        upload = client.upload(manifest, memoryview(buffer), starts, timeout=WAIT, on_done=done.set)
        assert upload is not None
        upload.granted.result(WAIT)
        filled = len(buffer) if arrived == "all" else 0
        upload.advance(filled)  # all in (the body completed) but not started, or nothing
        assert done.wait(WAIT)  # the thread cut it by itself and let go of the buffer
        wait_used(ingress, 0)  # the entry role's slot is free again
        upload.advance(len(buffer))  # the body completes now, just after the net fired
        with pytest.raises(UploadExpired, match=f"with {filled} of {len(buffer)} bytes"):
            upload.start()
        released = client.upload(
            manifest, memoryview(buffer), starts, timeout=WAIT, on_done=done.set
        )
        assert released is not None
        released.granted.result(WAIT)
        released.release()
        with pytest.raises(Exception) as cut:
            released.start()
        assert not isinstance(cut.value, UploadExpired)  # released: not a timeout
    finally:
        client.close()


def test_dedicated_connections_idle_too_long_are_closed_whatever_their_endpoint(
    rig: Rig,
) -> None:
    """relays.Dedicated keeps no connection past `idle_s`, also to an endpoint never asked
    for again (a replica that went away): the next take or give, to any endpoint, closes
    it, and nothing is left kept for that endpoint."""
    one, two = rig.ingress("tcp"), rig.ingress("tcp")
    dedicated = Dedicated(timeout=WAIT, key=KEY, idle_s=0.2)
    try:
        old = dedicated.take(one.endpoint, timeout=WAIT)
        dedicated.give(old)
        time.sleep(0.3)
        other = dedicated.take(two.endpoint, timeout=WAIT)
        assert old.closed and not other.closed
        dedicated.give(other)
        again = dedicated.take(one.endpoint, timeout=WAIT)
        assert again is not old and again.usable
        dedicated.give(again)
    finally:
        dedicated.close()
    assert other.closed and again.closed
