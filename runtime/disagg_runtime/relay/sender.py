"""The sending end every relay shares (each relay/backends/ sender subclasses it).

All speak `protocol` to an `Ingress`. Payloads up to `inline_max` bytes of tensors go as
one message carrying their slot's bytes (latency-bound, no handshake), on the inline lane
the ingress offers (relay/lane.py) or else over ZMQ; they count against the ingress's
inline budget, so on the lane they too stall a receiver's senders when it is full. Unless
told, a sender with a lane sets `inline_max` from what the welcome says of the receiver
(`inline_limit`: the tcp relay sends medium payloads inline to a receiver whose pool is
plain host memory); without one it stays INLINE_THRESHOLD.
Larger ones reserve a slot in the receiver's pool first, so a slow receiver stalls its
senders (flow control) rather than dropping or over-allocating:

    shm:  reserve -> grant -> copy tensors into the receiver's shared pool -> commit -> ack
          (in a stream of medium payloads the ack grants the next slot ahead, credit:
          then copy -> commit -> ack; nixl likewise, relay/credit.py)
    tcp:  reserve -> grant -> commit, then one message per chunk (zero-copy sends; the
          receiver `recv_into`s each chunk at its place in the slot) -> ack

TCP data is cut into `chunk_bytes` messages, each its own ZMQ message: libzmq buffers a
multipart message whole before delivering it (a 256 MiB payload would sit in fresh
memory first), and messages above ~1 MiB stop being recycled by malloc, costing page
faults (measured here: 64 MiB as one frame 1.2 GB/s, as 1 MiB messages with HWM 16 about 2.3 GB/s).
Both ends set a small high-water mark, so at most HWM chunks are buffered ahead.

The connection under a sender (handshake, lane, replies, a lost session): relay/link.py;
what the welcome agreed: relay/session.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import zmq

from disagg_runtime.memory.layout import SlotPlan
from disagg_runtime.relay import inline_wire, lane
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.credit import CREDIT_MAX
from disagg_runtime.relay.errors import NeverFits, Overloaded, RelayError, RelayTimeout
from disagg_runtime.relay.link import Link
from disagg_runtime.wire.manifest import Manifest

log = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
ZERO_COPY_MIN = 64 * 1024


@dataclass(frozen=True)
class Grant:
    """A slot reserved in the receiver's pool for request `rid`'s `manifest`, to be filled
    (shm: `ShmSender.slot`) or streamed (tcp: `TcpSender.stream`) and committed by
    `write_by` (half its lease)."""

    rid: str
    xid: int
    offset: int
    manifest: Manifest
    write_by: float


@dataclass(frozen=True)
class Transfer:
    """One staged payload on its way into a granted slot: what a backend's `_transfer`
    moves (`tensors` into the slot at `offset`, laid out as `manifest`, written by
    `write_by`) and the `commit` header it sends once they are there."""

    xid: int
    offset: int
    manifest: Manifest
    tensors: list[torch.Tensor]
    write_by: float
    commit: bytes


def _json_inline(rid: str, manifest: Manifest, meta: Mapping[str, Any] | None, **xid: int) -> bytes:
    return proto.pack("inline", rid=rid, meta=meta, manifest=manifest.to_json(), **xid)


def _over_zmq(
    frame: bytearray,
    at: int,
    rid: str,
    manifest: Manifest,
    meta: Mapping[str, Any] | None,
    xid: int | None,
) -> list[memoryview | bytes]:
    """An inline payload's ZMQ message, from the lane frame built for it (`Sender._inline_frame`,
    the slot's bytes from `at` on): the header in JSON, which ZMQ reads only (a binary one
    was built for the lane, which may have closed since), with the `xid` its verdict is
    awaited under (None: not awaited), and the slot's bytes."""
    view = memoryview(frame)
    if xid is None and frame[lane.PREFIX.size] == ord("{"):
        return [view[lane.PREFIX.size : at], view[at:]]
    return [_json_inline(rid, manifest, meta, **({} if xid is None else {"xid": xid})), view[at:]]


class Sender(Link):
    """How payloads go over a `Link`: inline, or reserved, transferred (the backend's
    `_transfer`), committed and acknowledged; and reserve/commit for callers that write
    the slot themselves."""

    binary_commit: ClassVar[bool] = False  # commits carry no backend fields: binary on the lane
    commit_on_lane: ClassVar[bool] = False  # commits go where control does: credit may be used
    credit_below_inline: ClassVar[bool] = False  # inline-sized payloads in a stream use it too

    def send(
        self,
        payload: Any,
        *,
        request_id: str,
        timeout: float | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> int:
        """Deliver `payload` to the receiver; returns once it holds it (large) or has it queued
        (inline), with the number of tensor bytes moved. Raises RelayTimeout when the
        receiver's pool stays full for `timeout` s. `meta` (JSON) travels in the control
        header beside the payload, for the receiver's routing; the relay does not read it."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        # GPU tensors stay on their GPU until copied once; bad input fails here
        tree, tensors, placed = self._planner.plan(payload)
        nbytes = placed.data_bytes
        frame: bytearray | None = None
        self.session.note_send()
        if self._inline(tensors, nbytes):  # the slot's bytes travel with the message
            frame, at = self._inline_frame(request_id, tree, placed, tensors, meta)
        with self._lock:
            self._start_send()
            try:
                if (
                    frame is not None
                    and self.session.lane is not None
                    and self._send_lane(request_id, frame)
                ):
                    return nbytes
                manifest = placed.manifest(tree)
                if (
                    frame is None
                    or nbytes > self.session.inline_max  # the lane may have gone
                    or not self._inline_zmq(frame, at, request_id, manifest, meta, deadline)
                ):  # reserved in the pool, also when the receiver's inline budget was full
                    self._send_staged(request_id, manifest, placed, tensors, deadline, meta)
                return nbytes
            except zmq.Again:
                raise RelayTimeout(
                    f"receiver at {self.endpoint} is not draining; request {request_id} not sent"
                ) from None

    def _inline_zmq(
        self,
        frame: bytearray,
        at: int,
        rid: str,
        manifest: Manifest,
        meta: Mapping[str, Any] | None,
        deadline: float,
    ) -> bool:
        """An inline payload over ZMQ, where nothing stalls this sender when the receiver's
        inline budget is full: where the welcome offered `inline_ack`, it waits for the
        verdict, and False says the receiver answered `overloaded` (nothing of it kept;
        the caller reserves it instead). Unanswered (an older receiver): True once sent."""
        xid = next(self._xids) if self.session.inline_ack else None
        self._sock.send_multipart(_over_zmq(frame, at, rid, manifest, meta, xid))
        if xid is None:
            return True
        verdict = self._await(xid, {"ack", "nack", "overloaded"}, deadline, "inline verdict")
        if verdict["op"] == "nack":
            raise RelayError(
                f"receiver at {self.endpoint} rejected request {rid}: {verdict.get('reason')}"
            )
        if verdict["op"] == "overloaded":
            self.overloaded += 1
            log.debug("%s relay to %s: %s", self.kind, self.endpoint, verdict.get("reason"))
            return False
        return True

    def reserve(
        self, request_id: str, manifest: Manifest, *, timeout: float | None = None
    ) -> Grant:
        """A slot for `manifest` in the receiver's pool, waiting up to `timeout` s for room
        (RelayTimeout when none came); PeerLost as for `send` (nothing was reserved)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        if manifest.nbytes > self.max_allocation:
            raise NeverFits(
                f"payload of {manifest.nbytes} B can never fit the receive pool at "
                f"{self.endpoint} (largest block {self.max_allocation} B)"
            )
        with self._lock:
            self._start_send()
            try:
                xid, offset, write_by = self._reserve(request_id, manifest.nbytes, deadline)
                self._check_reserved(xid, offset, manifest.nbytes)
            except zmq.Again:
                raise RelayTimeout(
                    f"receiver at {self.endpoint} is not draining; request {request_id} not sent"
                ) from None
        return Grant(request_id, xid, offset, manifest, write_by)

    def _check_reserved(self, xid: int, offset: int, nbytes: int) -> None:
        """Backend hook: refuse (cancel) a grant this sender cannot use."""

    def _grant_commit(self, grant: Grant, meta: Mapping[str, Any] | None, **fields: Any) -> bytes:
        """The JSON commit of a reserved slot, once this sender is open and the grant's
        lease has not run out (else the slot is cancelled: RelayTimeout). Under the lock."""
        self._check_open()
        self._check_lease(grant.xid, grant.write_by)
        return proto.pack(
            "commit",
            rid=grant.rid,
            xid=grant.xid,
            offset=grant.offset,
            manifest=grant.manifest.to_json(),
            meta=meta,
            **fields,
        )

    def cancel(self, grant: Grant) -> None:
        """Give a reserved slot back unused (best effort: a receiver that went away holds
        nothing, and one that does not hear this frees it when its lease ends)."""
        with self._lock:
            if self.closed or self._lost is not None:
                return
            try:
                self._control(proto.pack("cancel", xid=grant.xid))
            except (RelayError, zmq.ZMQError) as exc:
                log.info("%s relay to %s: cancel not sent: %s", self.kind, self.endpoint, exc)

    def _inline_frame(
        self,
        rid: str,
        tree: Any,
        placed: SlotPlan,
        tensors: list[torch.Tensor],
        meta: Mapping[str, Any] | None,
    ) -> tuple[bytearray, int]:
        """An inline payload's lane frame in one buffer, the slot's bytes written in place
        from the returned offset on: its header binary where the ingress reads that, with
        the layout part encoded once per placement (relay/inline_wire.py), else JSON. Bad
        input (a tree or meta that is not JSON) fails here, before anything is sent."""
        if self.session.inline_wire and self.session.lane is not None:
            frame, at = inline_wire.frame(rid, placed.layout_json(), tree, meta, placed.nbytes)
        else:
            header = _json_inline(rid, placed.manifest(tree), meta)
            frame, at = lane.frame_buffer(header, placed.nbytes)
        placed.fill(frame, at, tensors)
        return frame, at

    def _inline(self, tensors: list[torch.Tensor], nbytes: int) -> bool:
        """Backend hook: whether a payload goes as one inline message (no pool slot), not
        through credit (session.py `wants_credit`) or a reservation."""
        session = self.session
        if nbytes > session.inline_max:
            return False
        return not (self.credit_below_inline and session.wants_credit(nbytes, self._spare_limit()))

    def _send_staged(
        self,
        rid: str,
        manifest: Manifest,
        placed: SlotPlan,
        tensors: list[torch.Tensor],
        deadline: float,
        meta: Mapping[str, Any] | None,
    ) -> None:
        if manifest.nbytes > self.max_allocation:
            raise NeverFits(
                f"payload of {manifest.nbytes} B can never fit the receive pool at "
                f"{self.endpoint} (largest block {self.max_allocation} B)"
            )
        spare, stale = self.session.take_spare(manifest.nbytes)
        if stale is not None:  # granted with the last ack, but too small or too old now
            self._control(proto.pack("cancel", xid=stale.xid), opens=True)
        if spare is not None:  # granted with the last ack: no reservation round trip
            xid, offset, write_by = spare.xid, spare.offset, spare.use_by
        else:
            xid, offset, write_by = self._reserve(rid, manifest.nbytes, deadline)
        ask = self.session.ask_spare(manifest.nbytes, self._spare_limit(), self._xids)
        commit = self._commit_header(rid, xid, offset, manifest, placed, meta, ask)
        before_commit = time.monotonic()  # any spare in the ack is granted after this
        self._transfer(Transfer(xid, offset, manifest, tensors, write_by, commit))
        reply = self._await(xid, {"ack", "nack"}, deadline, "acknowledgement")
        if reply["op"] == "nack":
            raise RelayError(
                f"receiver at {self.endpoint} rejected request {rid}: {reply.get('reason')}"
            )
        if ask:
            try:
                self.session.keep_spare(reply, ask, before_commit, self.lease_s)
            except proto.ProtocolError as exc:
                raise RelayError(f"bad ack from {self.endpoint}: {exc}") from None

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
        """A commit's header: binary where it goes on the lane and the ingress reads it
        (no backend fields then); else JSON. A commit never leaves the lane it was built
        for: a lane lost before it is sent fails the transfer (`_control`)."""
        if self.binary_commit and self.session.commit_wire and self.session.control:
            layout = placed.layout_json()
            return inline_wire.pack_commit(rid, xid, offset, layout, manifest.tree, meta, ask)
        return proto.pack(
            "commit",
            rid=rid,
            xid=xid,
            offset=offset,
            manifest=manifest.to_json(),
            meta=meta,
            **self._commit_fields(),
            **({"next": ask} if ask else {}),
        )

    def _reserve(self, rid: str, nbytes: int, deadline: float) -> tuple[int, int, float]:
        """reserve -> grant: (xid, offset, the time by which the slot must be written)."""
        xid = next(self._xids)
        wait = max(0.0, deadline - time.monotonic())
        # over ZMQ beside a lane, the ingress grants only once it has the inline frames sent
        # on the lane before this (on the lane itself, the order is the lane's)
        session = self.session
        lanes = {"lane": session.sent} if session.lane and not session.control else {}
        self._control(
            proto.pack("reserve", rid=rid, xid=xid, nbytes=nbytes, wait_s=wait, **lanes),
            opens=True,
        )
        no_room = RelayTimeout(
            f"receiver at {self.endpoint} had no room for {nbytes} B "
            f"within the timeout; request {rid} not sent"
        )
        try:
            grant = self._await(xid, {"grant", "deny"}, deadline, "reservation")
        except RelayTimeout:
            self._control(proto.pack("cancel", xid=xid))
            raise no_room from None
        granted = time.monotonic()
        if grant["op"] == "deny" and grant.get("overloaded") is True:
            self.overloaded += 1
            raise Overloaded(
                f"receiver at {self.endpoint} is overloaded: {grant.get('reason')}; "
                f"request {rid} not sent"
            )
        if grant["op"] == "deny" and grant.get("timeout") is True:
            raise no_room
        if grant["op"] == "deny":
            raise RelayError(
                f"receiver at {self.endpoint} refused request {rid}: {grant.get('reason')}"
            )
        return xid, proto.nonneg_int(grant, "offset"), granted + self.lease_s / 2

    def _spare_limit(self) -> int:
        """The largest payload that asks for credit (0: never; session.py, relay/credit.py).
        Only where commits travel on the control lane (`commit_on_lane`): a reservation
        there is what keeps a staged payload behind the inline ones sent before it, and a
        commit under credit must be ordered too."""
        return CREDIT_MAX if self.commit_on_lane and self.session.control else 0

    def _commit_fields(self) -> dict[str, Any]:
        """Backend hook: extra fields of the commit header."""
        return {}

    def _transfer(self, transfer: Transfer) -> None:
        """Move the tensors into the granted slot and send the commit. The receiver frees a
        grant `lease_s` after granting; finishing writes within half of it from receipt of
        the grant leaves the other half for the grant's own transit."""
        raise NotImplementedError

    def _check_grant(self, xid: int, offset: int, nbytes: int, pool_size: int) -> None:
        """A grant must lie inside the receiver's pool as the welcome described it; one that
        does not is cancelled and nothing is written."""
        if offset + nbytes > pool_size:
            self._control(proto.pack("cancel", xid=xid))
            raise RelayError(f"grant from {self.endpoint} lies outside its pool; not written")

    def _check_lease(self, xid: int, write_by: float) -> None:
        if time.monotonic() > write_by:
            self._control(proto.pack("cancel", xid=xid))
            raise RelayTimeout(f"lease on the slot at {self.endpoint} ran out before commit")
