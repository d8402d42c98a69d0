"""What an authenticated sender asks of the ingress, by op: the op table (`OPS`).

    inline   a payload with its slot's bytes: delivered (no slot; it holds inline budget)
    reserve  a slot for `nbytes`: granted from the pool in arrival order, or denied
    commit   the slot is written: delivered, then acked; a relay kind's `Landing` may
             take it over (cuda-ipc: its copy still runs; tcp: its chunks follow)
    cancel   a grant given back unused
    abort    everything a request holds here is freed, now and for its late arrivals

Over ZMQ the loop (loop.py) reads the op and calls `OPS[op]`; on a lane, inline frames
and binary commits take their own fast paths (lanes.py) and other ops come here the same
way. The `Host` calls of relay/landing.py (`commit`, `claim`, `finish`, `reject`) are
here too; the loop (loop.py) has those that read a message (`read_into`, `more_frames`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from disagg_runtime.memory.layout import buffer_tensors, read_payload
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.ingress.parts import IngressParts
from disagg_runtime.relay.ledger import Denial, Message, Reservation
from disagg_runtime.wire.manifest import Manifest
from disagg_runtime.wire.tree import unflatten

log = logging.getLogger(__name__)


class Operations(IngressParts):
    """The ops of authenticated peers (see the module docstring)."""

    def _operate(self, ident: bytes, msg: dict[str, Any]) -> None:
        """Run an authenticated peer's operation: `OPS[op]` (below the class)."""
        OPS[msg["op"]](self, ident, msg)

    def _on_inline(self, ident: bytes, msg: dict[str, Any]) -> None:
        """An inline payload over ZMQ. There is no stalling its sender here: one that does
        not fit the inline budget is answered `overloaded` at once (its data unread), and
        one with an `xid` gets its verdict either way (`ack`), so its sender knows to
        reserve it instead (relay/sender.py)."""
        manifest = Manifest.from_json(msg.get("manifest"), slot_size=proto.MAX_INLINE_MESSAGE_BYTES)
        rid = proto.field(msg, "rid", str)
        xid = {"xid": proto.nonneg_int(msg, "xid")} if "xid" in msg else {}
        if not self._sock.getsockopt(zmq.RCVMORE):
            raise proto.ProtocolError("inline message has no data frame")
        if not self._ledger.take_inline(manifest.nbytes):
            self._overloaded += 1
            reason = (
                f"overloaded: {self._ledger.inline_used} B of the inline budget "
                f"({self.inline_budget} B) are held; the payload of {manifest.nbytes} B was "
                "not taken"
            )
            self._reply(ident, "overloaded", rid=rid, reason=reason, **xid)
            return
        try:
            data = bytearray(manifest.nbytes)  # bounded above; a longer frame is cut short
            got = self._sock.recv_into(data) if data else len(self._sock.recv())
            if self._sock.getsockopt(zmq.RCVMORE):
                raise proto.ProtocolError("inline message carries unexpected frames")
        except BaseException:
            self._ledger.give_inline(manifest.nbytes)
            raise
        self._inline(msg, manifest, memoryview(data), got, manifest.nbytes)
        if xid:
            self._reply(ident, "ack", **xid)

    def _inline(
        self, msg: dict[str, Any], manifest: Manifest, data: memoryview, got: int, charge: int
    ) -> None:
        """Deliver an inline payload whose slot bytes are `data` (its tensors view them);
        the message holds `charge` bytes of the inline budget until released."""
        try:
            rid = proto.field(msg, "rid", str)
            if got != manifest.nbytes:
                raise proto.ProtocolError(
                    f"inline data holds {got} B, its manifest says {manifest.nbytes} B"
                )
            payload = unflatten(manifest.tree, buffer_tensors(data, manifest))
        except BaseException:
            self._ledger.give_inline(charge)
            raise
        message = Message(rid, payload, manifest.nbytes, None, time.monotonic(), proto.meta(msg))
        message.charge = charge
        self._deliver(message)

    def _on_reserve(self, ident: bytes, msg: dict[str, Any]) -> None:
        xid = proto.nonneg_int(msg, "xid")
        rid = proto.field(msg, "rid", str)
        nbytes = proto.nonneg_int(msg, "nbytes")
        wait = msg.get("wait_s", self.lease_s)
        if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not wait >= 0:
            raise proto.ProtocolError("reserve: wait_s must be a non-negative number")
        denial = self._ledger.reserve(
            ident,
            xid,
            rid,
            nbytes,
            max_allocation=self.pool.allocator.max_allocation,
            wait_s=float(wait),
            now=time.monotonic(),
            lane_sent=proto.nonneg_int(msg, "lane") if "lane" in msg else 0,
        )
        if denial is not None:
            self._deny(denial)

    def _deny(self, denial: Denial) -> None:
        self._rejected += denial.counted
        self._overloaded += denial.overloaded
        flags = {"timeout": True} if denial.timeout else {}
        if denial.overloaded:
            flags["overloaded"] = True
        self._reply(denial.ident, "deny", xid=denial.xid, reason=denial.reason, **flags)

    def _grant_pending(self) -> None:
        def ready(head: Any) -> bool:  # inline frames sent before it are all here: keep order
            conn = self._by_sender.get(head.ident)
            return conn is None or conn.taken >= head.lane_sent

        for grant in self._ledger.grant_pending(time.monotonic(), ready):
            if not self._reply(
                grant.ident,
                "grant",
                xid=grant.xid,
                offset=grant.offset,
                lease_s=self.lease_s,
                **self._load_field(),
            ):  # its sender never heard of the slot (gone, or not reading): free at once
                self._ledger.cancel(grant.ident, grant.xid)

    def _on_cancel(self, ident: bytes, msg: dict[str, Any]) -> None:
        self._ledger.cancel(ident, proto.nonneg_int(msg, "xid"))

    def _on_abort(self, ident: bytes, msg: dict[str, Any]) -> None:
        rid = proto.field(msg, "rid", str)
        self._abort_delivered(rid)
        self._abort_reservations(rid)

    def _abort_reservations(self, rid: str) -> None:
        for denial in self._ledger.abort_reservations(rid):
            self._deny(denial)

    def _on_commit(self, ident: bytes, msg: dict[str, Any]) -> None:
        kind = self._kinds.get(ident)
        landing = self._landings.get(kind) if kind is not None else None
        if landing is not None and landing.commit(ident, msg):
            return
        self.commit(ident, msg)

    def commit(self, ident: bytes, msg: dict[str, Any]) -> None:
        """The plain commit: the payload is in its slot (shm). Bytes that follow the commit
        are a landing's to take (tcp: relay/backends/tcp/land.py); here they are refused."""
        xid = proto.nonneg_int(msg, "xid")
        grant, slot = self.claim(ident, xid, msg)
        try:
            size = self.pool.allocator.size_of(slot)
            manifest = Manifest.from_json(msg.get("manifest"), slot_size=size)
            meta = proto.meta(msg)
            if self._sock.getsockopt(zmq.RCVMORE):
                raise proto.ProtocolError("commit carries unexpected frames")
            if msg.get("chunk") is not None:
                kind = self._kinds.get(ident, "this")
                raise proto.ProtocolError(f"a {kind} sender's commit cannot carry chunks")
        except BaseException:
            self._ledger.free(slot)
            raise
        self.finish(ident, xid, grant.rid, slot, manifest, meta, msg.get("next"))

    def claim(self, ident: bytes, xid: int, msg: dict[str, Any]) -> tuple[Reservation, int]:
        """A commit takes its grant (`rid`, `offset` from `msg`; a spare's request id is the
        commit's): the grant and its slot, now the caller's to deliver or free. ProtocolError
        (the slot freed) when it cannot. A Host call too (relay/landing.py)."""
        grant = self._ledger.take_grant(ident, xid)
        if grant is None or grant.offset is None:
            raise proto.ProtocolError(f"commit for xid {xid} without a live grant (lease expired?)")
        slot = grant.offset
        try:
            if grant.spare:  # granted before its request was known
                grant.rid = proto.field(msg, "rid", str)
                self._spares_used += 1
            if proto.nonneg_int(msg, "offset") != slot:
                raise proto.ProtocolError(f"commit offset differs from the grant ({slot})")
        except BaseException:
            self._ledger.free(slot)
            raise
        return grant, slot

    def reject(self, ident: bytes, xid: int, reason: str) -> None:
        self._rejected += 1
        log.warning("ingress %s rejected a commit: %s", self.endpoint, reason)
        self._reply(ident, "nack", xid=xid, reason=reason)

    def finish(
        self,
        ident: bytes,
        xid: int,
        rid: str,
        slot: int,
        manifest: Manifest,
        meta: dict[str, Any] | None,
        ask: Any = None,
    ) -> None:
        """The payload is in `slot`: deliver it and ack its commit (a Host call too); `ask`,
        the commit's request for a spare."""
        try:
            payload = read_payload(self.pool.backing, slot, manifest)
        except BaseException:
            self._ledger.free(slot)
            raise
        self._land(ident, xid, rid, slot, payload, manifest.nbytes, meta, ask)

    def _land(
        self,
        ident: bytes,
        xid: int,
        rid: str,
        slot: int,
        payload: Any,
        nbytes: int,
        meta: dict[str, Any] | None,
        ask: Any = None,
    ) -> None:
        """Deliver a committed payload (its tensors view `slot`), then ack its commit. A
        malformed credit ask (`next`) refuses the commit (ProtocolError, the slot freed)."""
        try:
            wanted = credit_ask(ask)
        except proto.ProtocolError:
            self._ledger.free(slot)
            raise
        msg = Message(rid, payload, nbytes, slot, time.monotonic(), meta)
        if not self._admit(msg):
            self._reply(ident, "nack", xid=xid, reason=f"request {rid} was aborted")
            return
        # routed, not handled: then the load in the ack counts it, delivery does not wait
        # for the ack's system call, and a message released at once leaves its room to a credit
        self._hand_over(msg)
        self._reply(ident, "ack", xid=xid, **self._load_field(), **self._credit(ident, wanted))

    def _credit(self, ident: bytes, wanted: tuple[int, int] | None) -> dict[str, Any]:
        """The ack's `spare` (a credit), when the commit asked for one (`next {xid,
        nbytes}`) and the ledger grants it (relay/credit.py)."""
        if wanted is None:
            return {}
        xid, nbytes = wanted
        credit = self._ledger.grant_spare(ident, xid, nbytes, time.monotonic())
        if credit is None:
            return {}
        lease = self._ledger.credits.bounds.lease_s
        return {"spare": {"xid": xid, "offset": credit.offset, "lease_s": lease}}

    def _deliver(self, msg: Message) -> bool:
        """Queue a landed payload unless its request was aborted (then free its slot)."""
        if not self._admit(msg):
            return False
        self._hand_over(msg)
        return True

    def _admit(self, msg: Message) -> bool:
        """Make `msg` one of its request's live messages; False (slot freed) if aborted."""
        return self._ledger.admit(msg, self._release)  # via the memory: CUDA synchronizes

    def _hand_over(self, msg: Message) -> None:
        """To `recv` through the queue, or to `on_message` right here on the I/O thread."""
        if self._on_message is None:
            self._queue.put(msg)
            return
        try:
            self._on_message(msg)
        except Exception:  # the I/O thread must outlive a failing callback
            log.exception("ingress %s: on_message failed; message released", self.endpoint)
            msg.release()

    def _nack_commit(self, ident: bytes, msg: dict[str, Any], exc: Exception) -> None:
        """A rejected commit is answered, so its sender fails now rather than at its timeout."""
        xid = msg.get("xid")
        if msg.get("op") in ("commit", "inline") and isinstance(xid, int):
            self._reply(ident, "nack", xid=xid, reason=str(exc))


def credit_ask(ask: Any) -> tuple[int, int] | None:
    """A commit's `next {xid, nbytes}` (the credit it asks for), checked; None: no ask."""
    if ask is None:
        return None
    if not isinstance(ask, dict):
        raise proto.ProtocolError("commit: 'next' must be an object {xid, nbytes}")
    xid, nbytes = proto.nonneg_int(ask, "xid"), proto.nonneg_int(ask, "nbytes")
    if not nbytes:
        raise proto.ProtocolError("commit: 'next' asks for 0 B")
    return xid, nbytes


Op = Callable[[Operations, bytes, dict[str, Any]], None]
OPS: Mapping[str, Op] = {
    "inline": Operations._on_inline,
    "reserve": Operations._on_reserve,
    "commit": Operations._on_commit,
    "cancel": Operations._on_cancel,
    "abort": Operations._on_abort,
}
