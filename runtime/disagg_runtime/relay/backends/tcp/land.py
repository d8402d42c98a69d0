"""The `tcp` relay's receiving side: a commit with `chunk` says the slot's bytes follow as
chunk messages, which land straight in the slot (`recv_into`, through the pool's `Memory`:
a CUDA pool's go through a pinned bounce buffer).

    commit {rid, xid, offset, manifest, chunk}  -> the grant is claimed; a `Chunked` says
                                                   where each next message of that sender goes
    chunk messages, in the order of `chunk_targets` (each tensor cut in `chunk`-B pieces)
    the last one                                -> delivered and acked, or nacked

The ingress hands this landing every message of a sender it expects frames from (Host
`expect_frames`). A chunk of the wrong size, one with extra frames, or an empty one (the
sender cut the transfer: send.py `ChunkStream.cut`) fails the transfer, but its remaining
chunks are still read (and dropped), so the connection stays in step; the slot is freed
and the commit nacked at the end. A transfer whose chunks stop coming for a lease is
nacked and its slot freed (`expire`).

A commit with `stripes` instead says its bytes come over parallel stripe connections,
into a pool of host memory: stripe_land.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from disagg_runtime.memory.pool import PoolError
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.backends.tcp import stripe_plan
from disagg_runtime.relay.backends.tcp.stripe_accept import listener_for
from disagg_runtime.relay.backends.tcp.stripe_land import StripeHub
from disagg_runtime.relay.landing import Host, Landing
from disagg_runtime.relay.ledger import Reservation
from disagg_runtime.wire.codec import CodecError
from disagg_runtime.wire.manifest import Manifest

log = logging.getLogger(__name__)
MIN_CHUNK = 4096  # smaller chunks only cost per-message overhead
_SCRATCH = bytearray(1 << 20)  # where the chunks of a failed transfer are read and dropped


@dataclass
class Chunked:
    """A tcp transfer in progress: where each of the sender's next chunk messages goes."""

    grant: Reservation
    xid: int
    manifest: Manifest
    meta: dict[str, Any] | None
    targets: Iterator[tuple[int, int]]
    remaining: int
    deadline: float
    done: int = 0
    error: str | None = None


def chunk_count(manifest: Manifest, chunk: int) -> int:
    if chunk < MIN_CHUNK:
        raise proto.ProtocolError(f"chunk size {chunk} is below the minimum {MIN_CHUNK}")
    if chunk > proto.MAX_FRAME_BYTES:
        raise proto.ProtocolError(f"chunk size {chunk} is over {proto.MAX_FRAME_BYTES} B")
    return sum(-(-meta.nbytes // chunk) for meta in manifest.tensors)


def chunk_targets(slot: int, manifest: Manifest, chunk: int) -> Iterator[tuple[int, int]]:
    """(pool offset, length) of every chunk, in the order the sender sends them (lazily:
    a large slot in small chunks must not build a huge list on the I/O thread)."""
    for meta, offset in zip(manifest.tensors, manifest.offsets, strict=True):
        for start in range(0, meta.nbytes, chunk):
            yield slot + offset + start, min(chunk, meta.nbytes - start)


class TcpLanding(Landing):
    """Chunked commits of tcp senders (see the module docstring)."""

    kind = "tcp"
    binary_commits = True  # a commit without `chunk` is the plain one

    def __init__(self, host: Host) -> None:
        self.host = host
        self._chunked: dict[bytes, Chunked] = {}  # transfers landing, by sender
        self.stripes: StripeHub | None = None  # parallel streams, into host memory only
        listener = listener_for(host.endpoint) if host.memory.kind == "host" else None
        if listener is not None:
            self.stripes = StripeHub(host, listener, stripe_plan.MAX_STREAMS)

    def welcome(self, ident: bytes, hello: dict[str, Any]) -> dict[str, Any]:
        return {"stripes": self.stripes.offer(ident)} if self.stripes is not None else {}

    def commit(self, ident: bytes, msg: dict[str, Any]) -> bool:
        if msg.get("stripes") is not None:
            self._striped(ident, msg)
            return True
        if msg.get("chunk") is None:
            return False  # its bytes are in the slot already: the plain commit
        host = self.host
        xid = proto.nonneg_int(msg, "xid")
        grant, slot = host.claim(ident, xid, msg)
        try:
            manifest = Manifest.from_json(
                msg.get("manifest"), slot_size=host.pool.allocator.size_of(slot)
            )
            meta = proto.meta(msg)
            if host.more_frames():
                raise proto.ProtocolError("commit carries unexpected frames")
            chunk = proto.nonneg_int(msg, "chunk")
            count = chunk_count(manifest, chunk)
            if count:
                try:
                    host.memory.prepare_chunks(chunk)
                except PoolError as exc:
                    raise proto.ProtocolError(str(exc)) from None
        except BaseException:
            host.ledger.free(slot)
            raise
        if not count:  # no bytes to wait for
            host.finish(ident, xid, grant.rid, slot, manifest, meta)
            return True
        targets = chunk_targets(slot, manifest, chunk)
        deadline = time.monotonic() + host.lease_s
        self._chunked[ident] = Chunked(grant, xid, manifest, meta, targets, count, deadline)
        host.expect_frames(ident, self)
        return True

    def _striped(self, ident: bytes, msg: dict[str, Any]) -> None:
        """A commit whose stripes come on the stripe connections (stripe_land.py)."""
        host = self.host
        xid = proto.nonneg_int(msg, "xid")
        grant, slot = host.claim(ident, xid, msg)
        try:
            if self.stripes is None:
                raise proto.ProtocolError("this ingress offered no stripe connections")
            manifest = Manifest.from_json(
                msg.get("manifest"), slot_size=host.pool.allocator.size_of(slot)
            )
            meta = proto.meta(msg)
            if host.more_frames():
                raise proto.ProtocolError("commit carries unexpected frames")
            streams = proto.nonneg_int(msg, "stripes")
            self.stripes.start(ident, xid, grant, slot, manifest, meta, streams)
        except BaseException:
            host.ledger.free(slot)
            raise

    def take(self, ident: bytes) -> None:
        """Land the next chunk of `ident`'s transfer straight into its slot."""
        chunked = self._chunked[ident]
        host = self.host
        offset, length = next(chunked.targets)
        chunked.done += 1
        if chunked.error is None:
            memory = host.memory
            got = host.read_into(memory.chunk_buffer(offset, length))
            if got == 0 < length:  # send.py ChunkStream.cut: its source went away
                chunked.error = f"the sender cut the transfer at chunk {chunked.done - 1}"
            elif got != length:
                chunked.error = f"chunk {chunked.done - 1}: {got} B, expected {length} B"
            elif host.more_frames():
                chunked.error = f"chunk {chunked.done - 1}: unexpected extra frames"
            else:
                chunked.error = memory.chunk_landed(offset, length)
        else:
            host.read_into(_SCRATCH)
        if chunked.done < chunked.remaining:
            return
        self._end(ident)
        slot = chunked.grant.offset
        assert slot is not None  # transfers are made from live grants
        if chunked.error is not None:
            host.ledger.free(slot)
            host.reject(ident, chunked.xid, chunked.error)
            return
        try:
            host.finish(ident, chunked.xid, chunked.grant.rid, slot, chunked.manifest, chunked.meta)
        except (proto.ProtocolError, CodecError) as exc:  # its bytes are no payload (slot freed)
            host.reject(ident, chunked.xid, str(exc))

    def _end(self, ident: bytes) -> Chunked | None:
        self.host.expect_frames(ident, None)
        return self._chunked.pop(ident, None)

    def due(self) -> float | None:
        due = min((c.deadline for c in self._chunked.values()), default=None)
        striped = self.stripes.due() if self.stripes is not None else None
        return striped if due is None else due if striped is None else min(due, striped)

    def expire(self, now: float) -> None:
        if self.stripes is not None:
            self.stripes.expire(now)
        for ident, chunked in list(self._chunked.items()):
            if chunked.deadline <= now:  # sender vanished mid-transfer
                self._end(ident)
                if chunked.grant.offset is not None:
                    self.host.ledger.free(chunked.grant.offset)
                reason = f"transfer for request {chunked.grant.rid} stalled; slot freed"
                self.host.reject(ident, chunked.xid, reason)

    def forget(self, ident: bytes) -> None:
        chunked = self._end(ident)
        if chunked is not None and chunked.grant.offset is not None:
            self.host.ledger.free(chunked.grant.offset)
        if self.stripes is not None:
            self.stripes.forget(ident)

    def close(self) -> None:
        if self.stripes is not None:
            self.stripes.close()
