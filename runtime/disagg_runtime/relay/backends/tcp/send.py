"""The `tcp` relay's sending side: after the grant the sender streams the slot's bytes as
chunk messages that the receiver `recv_into`s at their place in the slot (land.py).

Payloads up to TCP_INLINE_MAX (1 MiB) go inline, as one lane frame, to a receiver whose
pool is plain host memory (the welcome's `pool_device`: shm or cpu): measured on one
machine, a 1 MiB hand-off took ~0.6 ms against ~1.1 ms reserved and chunked (256 KiB:
~0.25 against ~0.8 ms), the grant's round trip and ZMQ's hand-offs between threads gone
for one more copy on each side. A receiver whose pool is on a GPU or pinned for one
(cuda, cpu-pinned) lands medium payloads where its pool is, so they go reserved there
(inline only up to INLINE_THRESHOLD, as an older ingress that does not say).

A caller that receives a payload's bytes itself (the gateway reading an HTTP body) can
stream them on as they come: `reserve` a slot, then `stream` it: the commit goes at once
and each chunk as the caller has it (`chunk_plan` says which bytes each one carries). A
stream holds its sender until it ends, so it belongs on a connection of its own, never on
one that other requests share. A stream that cannot finish (its source went away or
stalled) is cut: the chunks still owed go empty, which the receiver takes as a failed
transfer (a chunk of the wrong size): it reads them, frees the slot and answers a nack,
so the connection is in step again and the slot free at once. Nothing new on the wire.

Payloads of at least stripe_plan.STREAMS_MIN go over parallel stripe connections where
the receiver offers them (stripe_send.py; `streams` bounds how many a payload uses),
with their commit on the control lane; when a stripe fails, the receiver frees the slot
and nacks, and the payload goes again as chunks over ZMQ (`resent` counts them).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch
import zmq

from disagg_runtime.memory.copies import copy_async
from disagg_runtime.memory.layout import SlotPlan, slot_views
from disagg_runtime.memory.pool import Backing, PoolError, pinned_staging
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.backends.tcp import stripe_plan
from disagg_runtime.relay.backends.tcp.stripe_send import Stripes, StripesBroke, parse_offer
from disagg_runtime.relay.errors import RelayError, RelayTimeout
from disagg_runtime.relay.sender import (
    CHUNK_BYTES,
    ZERO_COPY_MIN,
    Grant,
    Sender,
    Transfer,
)
from disagg_runtime.relay.session import INLINE_THRESHOLD
from disagg_runtime.wire import codec
from disagg_runtime.wire.manifest import Manifest

log = logging.getLogger(__name__)
TCP_INLINE_MAX = 1 << 20
STRIPES_RETRY_S = 1.0  # after stripe connections broke, payloads go over ZMQ this long
STRIPES_UNREACHABLE_S = 30.0  # and after they could not be opened (a filtered port)
HOST_POOLS = ("shm", "cpu")  # pool devices a payload may as well land beside, in the heap


def inline_limit(pool_device: Any) -> int:
    """The largest payload the tcp relay sends inline to a receiver whose pool is on
    `pool_device` (its welcome's word; anything else, or nothing, keeps the default)."""
    return TCP_INLINE_MAX if pool_device in HOST_POOLS else INLINE_THRESHOLD


def chunk_plan(manifest: Manifest, chunk: int) -> list[tuple[int, int, int]]:
    """(tensor index, start in the tensor, length) of every chunk message of a payload, in
    the order they are sent and landed (land.py `chunk_targets`)."""
    return [
        (i, start, min(chunk, meta.nbytes - start))
        for i, meta in enumerate(manifest.tensors)
        for start in range(0, meta.nbytes, chunk)
    ]


class _Resend(RelayError):
    """A striped payload failed and the receiver freed its slot: send it again."""


class _Delivered(RelayError):
    """A striped payload the receiver acked (its verdict is read by `_send_striped`)."""


class _Nacked(RelayError):
    """A striped payload the receiver refused for a reason of its own (not its stripes)."""


class TcpSender(Sender):
    """Streams tensors as zero-copy chunk frames that land in the receiver's pool. With a
    lane, reservations, grants and acknowledgements travel there (one thread wake-up each
    instead of three); the commit and its chunks stay on ZMQ, in order."""

    kind = "tcp"
    control_on_lane = True

    def __init__(
        self,
        endpoint: str,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        streams: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        # the most parallel streams a large payload uses (stripe_plan.py; None: one per core)
        self.max_streams = stripe_plan.default_streams() if streams is None else streams
        stripe_plan.check_streams(self.max_streams)
        self._staging: Backing | None = None
        self._stripes: Stripes | None = None  # the receiver offered stripe connections
        self._striped: tuple[int, int] | None = None  # (xid, streams) of the commit built
        self._stripes_retry_at = 0.0
        self.resent = 0  # payloads sent again over ZMQ after their stripes broke
        super().__init__(endpoint, **kwargs)

    def _commit_fields(self) -> dict[str, Any]:
        return {"chunk": self.chunk_bytes}

    def _on_welcome(self, welcome: dict[str, Any]) -> None:
        offer = parse_offer(welcome)
        if offer is not None and self.endpoint.startswith("tcp://"):
            self._stripes = Stripes(self.endpoint, offer, key=self._key, timeout=self.timeout)

    def _stream_count(self, nbytes: int) -> int:
        """The stripe connections a payload of `nbytes` goes over now (0: over ZMQ). The
        first payload that wants them starts opening them in the background; after a
        failure, payloads go over ZMQ for a while."""
        stripes = self._stripes
        if stripes is None:
            return 0
        most = min(self.max_streams, stripes.max_streams)
        streams = stripe_plan.stream_count(nbytes, most)
        if not streams or stripes.open >= streams:
            return streams
        if time.monotonic() >= self._stripes_retry_at:
            stripes.connect_soon(most, self._stripes_unreachable)
        return 0

    def open_streams(self, wait: float) -> bool:
        """Open the stripe connections now rather than at the first large payload, waiting
        up to `wait` s; whether they are open (False: the receiver offers none, or they
        cannot be reached: large payloads go over ZMQ)."""
        stripes = self._stripes
        if stripes is None:
            return False
        stripes.connect_soon(min(self.max_streams, stripes.max_streams), self._stripes_unreachable)
        deadline = time.monotonic() + wait
        while not stripes.open and time.monotonic() < deadline:
            time.sleep(0.005)
        return stripes.open > 0

    def _stripes_failed(self, exc: BaseException, off_s: float = STRIPES_RETRY_S) -> None:
        self._stripes_retry_at = time.monotonic() + off_s
        log.info("tcp relay to %s: stripes off for %g s: %s", self.endpoint, off_s, exc)

    def _stripes_unreachable(self, exc: BaseException) -> None:
        self._stripes_failed(exc, STRIPES_UNREACHABLE_S)

    def _commit_header(
        self,
        rid: str,
        xid: int,
        offset: int,
        manifest: Manifest,
        placed: SlotPlan,
        meta: Mapping[str, Any] | None,
        ask: dict[str, int] | None,
    ) -> bytes:
        streams = self._stream_count(manifest.nbytes)
        if not streams:
            self._striped = None
            return super()._commit_header(rid, xid, offset, manifest, placed, meta, ask)
        self._striped = (xid, streams)
        return proto.pack(
            "commit",
            rid=rid,
            xid=xid,
            offset=offset,
            manifest=manifest.to_json(),
            meta=meta,
            stripes=streams,
        )

    def _send_staged(
        self,
        rid: str,
        manifest: Manifest,
        placed: SlotPlan,
        tensors: list[torch.Tensor],
        deadline: float,
        meta: Mapping[str, Any] | None,
    ) -> None:
        try:
            super()._send_staged(rid, manifest, placed, tensors, deadline, meta)
        except _Delivered:
            return
        except _Nacked as exc:
            raise RelayError(f"receiver at {self.endpoint} rejected request {rid}: {exc}") from None
        except _Resend as exc:  # the stripes broke, the receiver freed the slot: over ZMQ now
            log.info("tcp relay to %s: request %s sent again over ZMQ: %s", self.endpoint, rid, exc)
            self.resent += 1
            super()._send_staged(rid, manifest, placed, tensors, deadline, meta)

    def inline_limit(self, welcome: dict[str, Any]) -> int:
        return inline_limit(welcome.get("pool_device"))

    def _transfer(self, transfer: Transfer) -> None:
        commit, manifest, tensors = transfer.commit, transfer.manifest, transfer.tensors
        self._check_lease(transfer.xid, transfer.write_by)
        striped, self._striped = self._striped, None
        if striped is not None and striped[0] == transfer.xid and self._stripes is not None:
            self._send_striped(transfer, self._stripes, striped[1])
            return
        chunks: list[memoryview] = []
        for tensor in self._host_tensors(manifest, tensors):
            raw = codec.tensor_bytes(tensor)
            chunks.extend(
                raw[i : i + self.chunk_bytes] for i in range(0, len(raw), self.chunk_bytes)
            )
        self._sock.send(commit)
        for chunk in chunks:  # one message each: libzmq buffers a multipart message whole
            self._sock.send(chunk, copy=len(chunk) < ZERO_COPY_MIN)

    def _send_striped(self, transfer: Transfer, stripes: Stripes, streams: int) -> None:
        """The commit, then the stripes at once over their connections, then the verdict:
        an ack ends the send (`_Delivered`); a nack because stripes failed, on either side
        (the receiver freed the slot), closes them and asks for the payload again over
        ZMQ (`_Resend`); any other nack is the payload's (`_Nacked`)."""
        tensors = self._host_tensors(transfer.manifest, transfer.tensors)
        raws = [codec.tensor_bytes(t) for t in tensors]
        self._control(transfer.commit)  # on the lane where it runs: no chunks follow it
        broke: StripesBroke | None = None
        try:
            stripes.send(transfer.xid, raws, streams)
        except StripesBroke as exc:
            broke = exc
        deadline = time.monotonic() + self.timeout
        reply = self._await(transfer.xid, {"ack", "nack"}, deadline, "acknowledgement")
        if reply["op"] == "ack":  # every byte was in (also when a stripe broke after that)
            raise _Delivered
        reason = str(reply.get("reason"))
        if broke is not None or reason.startswith(stripe_plan.FAILED):
            stripes.close()  # the receiver shut its ends
            self._stripes_failed(broke or RelayError(reason))
            raise _Resend(reason)
        raise _Nacked(reason)

    def _host_tensors(self, manifest: Manifest, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """GPU tensors are copied once, on the copy stream, into a private pinned staging
        buffer (grown to the largest payload, then reused) and sent from there. Reuse is
        safe: the previous transfer was acknowledged, so the receiver has all its chunks."""
        if not any(t.is_cuda for t in tensors):
            return tensors
        if self._staging is None or self._staging.size < manifest.nbytes:
            if self._staging is not None:
                self._staging.close()
                self._staging = None
            try:
                self._staging = pinned_staging(manifest.nbytes)
            except PoolError as exc:
                raise RelayError(f"tcp relay to {self.endpoint}: {exc}") from None
        views = slot_views(self._staging, 0, manifest)
        copy_async([(v, t) for v, t in zip(views, tensors, strict=True) if t.is_cuda]).wait()
        return [v if t.is_cuda else t for v, t in zip(views, tensors, strict=True)]

    def stream(
        self, grant: Grant, *, meta: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> ChunkStream:
        """Commit `grant` now and stream its chunks as the caller has them (`ChunkStream`:
        a context manager; leaving it before `finish` cuts the transfer). The stream holds
        this sender until it ends: use a connection no other request shares."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._lock.acquire()
        try:
            header = self._grant_commit(grant, meta, chunk=self.chunk_bytes)
            try:
                self._sock.send(header)  # on ZMQ, as the chunks after it (never the lane)
            except zmq.Again:
                self._control(proto.pack("cancel", xid=grant.xid))
                raise RelayTimeout(f"receiver at {self.endpoint} is not draining") from None
        except BaseException:
            self._lock.release()
            raise
        lengths = [length for _, _, length in chunk_plan(grant.manifest, self.chunk_bytes)]
        return ChunkStream(self, grant, lengths, deadline)

    def _stream_send(self, data: memoryview | bytes) -> None:
        """One chunk message of a stream (the caller holds the lock)."""
        try:
            self._sock.send(data, copy=len(data) < ZERO_COPY_MIN)
        except zmq.Again:
            raise RelayTimeout(f"receiver at {self.endpoint} is not draining") from None

    def _stream_end(self, xid: int, deadline: float) -> dict[str, Any]:
        return self._await(xid, {"ack", "nack"}, deadline, "acknowledgement")

    def _stream_broken(self) -> None:
        """A stream that could not end in step: this connection is no longer usable."""
        self._lost = self._lost or "a chunk stream on it broke off"

    def _on_close(self) -> None:
        if self._stripes is not None:
            self._stripes.close(final=True)
        if self._staging is not None:
            self._staging.close()
            self._staging = None


class ChunkStream:
    """The chunks of one committed tcp transfer, sent in `chunk_plan` order as the caller
    has them (`send`), then `finish` (the receiver's ack). Leaving the `with` block without
    `finish` cuts the transfer (see the module's docstring); a cut that cannot complete
    (the receiver stopped reading) leaves the sender refusing further use (PeerLost), so
    its owner closes it."""

    def __init__(
        self, sender: TcpSender, grant: Grant, lengths: list[int], deadline: float
    ) -> None:
        self._sender = sender
        self.grant = grant
        self._lengths = lengths
        self.sent = 0
        self._deadline = deadline
        self._ended = False

    def send(self, data: memoryview | bytes) -> None:
        """The next chunk's bytes (its length must be the plan's)."""
        if self._ended or self.sent >= len(self._lengths):
            raise RelayError("chunk stream: every chunk was sent already")
        if len(data) != self._lengths[self.sent]:
            raise RelayError(
                f"chunk stream: chunk {self.sent} is {len(data)} B, "
                f"the plan says {self._lengths[self.sent]} B"
            )
        self._sender._stream_send(data)
        self.sent += 1

    def finish(self) -> None:
        """Every chunk sent: wait for the receiver to hold the payload (RelayError on a
        nack, RelayTimeout past the stream's deadline)."""
        if self.sent != len(self._lengths):
            raise RelayError(f"chunk stream: {self.sent} of {len(self._lengths)} chunks sent")
        self._end()
        try:
            reply = self._sender._stream_end(self.grant.xid, self._deadline)
        except BaseException:
            self._sender._stream_broken()  # out of step: a late ack may still come
            raise
        if reply["op"] == "nack":
            raise RelayError(
                f"receiver at {self._sender.endpoint} rejected request {self.grant.rid}: "
                f"{reply.get('reason')}"
            )

    def cut(self) -> None:
        """Give up: the chunks still owed go empty; returns once the receiver freed the slot
        (its nack). A stream with every chunk sent cannot be cut (abort its request)."""
        if self._ended:
            return
        self._end()
        if self.sent == len(self._lengths):
            raise RelayError("chunk stream: every chunk was sent; abort the request instead")
        try:
            for _ in range(self.sent, len(self._lengths)):
                self._sender._stream_send(b"")
            self._sender._stream_end(self.grant.xid, time.monotonic() + self._sender.timeout)
        except (RelayError, zmq.ZMQError):
            self._sender._stream_broken()
            raise

    def _end(self) -> None:
        self._ended = True

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if not self._ended:
                # on failure the sender refuses further use; the receiver's lease frees the slot
                with contextlib.suppress(RelayError, zmq.ZMQError):
                    self.cut()
        finally:
            self._sender._lock.release()
