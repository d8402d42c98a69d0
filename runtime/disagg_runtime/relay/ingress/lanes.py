"""The inline lane's server side: accepting lanes, their hello, reading frames.

A lane (relay/lane.py) is a plain socket beside the ZMQ one, offered in the welcome under
a one-time id; its hello proves the peer key. Inline frames are delivered here, on the
I/O thread, in one call each (the hot path, relay/inline_wire.py); a binary commit is
the plain commit with its layout cached per lane; any other op goes to the op table
(ops.py). A lane whose next frame does not fit the inline budget is not polled until
messages are released (its sender stalls, as on a full pool); lanes silent before their
hello, or stalled mid-frame, are closed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from disagg_runtime.memory.layout import read_payload
from disagg_runtime.relay import auth, inline_wire, lane
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.ingress.parts import IngressParts
from disagg_runtime.relay.ledger import Message
from disagg_runtime.wire import codec
from disagg_runtime.wire.manifest import Manifest
from disagg_runtime.wire.tree import unflatten

log = logging.getLogger(__name__)
LANE_HELLO = frozenset({"lane"})
JSON_START = ord("{")  # a lane header that does not start so is binary (relay/inline_wire.py)
INLINE_OPS = frozenset({"inline", "abort"})
LANE_OPS = frozenset({"inline", "abort", "reserve", "cancel", "commit"})
MAX_UNAUTHENTICATED_LANES = 64  # lanes before their hello; more are refused at once
LANE_HELLO_S = 5.0  # a lane must say its hello this soon after connecting
LANE_CHECK_S = 0.5  # how often lanes are checked for those deadlines


@dataclass(eq=False)
class LaneConn:
    """One accepted lane connection; `ident` is its sender's ZMQ identity once it said so."""

    reader: lane.LaneReader
    opened_at: float
    ident: bytes | None = None
    control: bool = False  # the sender runs its whole protocol here, replies included
    taken: int = 0  # frames read after the hello: the sender counts the ones it wrote
    paused: bool = False  # its next frame does not fit the inline budget: not polled
    layouts: inline_wire.LayoutCache = field(default_factory=inline_wire.LayoutCache)
    commits: inline_wire.LayoutCache | None = None  # binary commits' layouts (made at the first)


class Lanes(IngressParts):
    """The lane server (see the module docstring)."""

    def _accept_lane(self) -> None:
        assert self._lane_listener is not None
        while (conn := lane.accept(self._lane_listener)) is not None:
            strangers = sum(1 for c in self._lanes.values() if c.ident is None)
            if len(self._lanes) >= lane.MAX_CONNECTIONS or strangers >= MAX_UNAUTHENTICATED_LANES:
                self.refusals.refuse(f"{len(self._lanes)} lanes ({strangers} without a hello)")
                conn.close()  # its sender goes over ZMQ
                continue
            reader = lane.LaneReader(conn, admit=self._ledger.take_inline, limits=lane.HELLO_LIMITS)
            self._lanes[conn.fileno()] = LaneConn(reader, time.monotonic())
            self._poller.register(conn.fileno(), zmq.POLLIN)
            self._read_lane(conn.fileno())  # its hello may be there already

    def _read_lane(self, fd: int) -> None:
        conn = self._lanes.get(fd)
        if conn is None:
            return
        closed: lane.LaneError | None = None
        try:
            frames = conn.reader.read()
        except lane.LaneError as exc:
            frames, closed = [], exc
            if conn.ident is None:  # a stranger's bytes broke the framing, or it left
                self.refusals.refuse(f"lane: {exc}")
        for i, frame in enumerate(frames):
            try:
                self._on_lane_frame(conn, frame)
            except lane.LaneError as exc:
                closed = exc
                self._ledger.give_inline(sum(f.charge for f in frames[i:]))
                break
            except (proto.ProtocolError, codec.CodecError) as exc:
                self._dirty = True
                if conn.ident is None:  # no hello: not a lane of ours
                    self.refusals.refuse(f"lane: {exc}")
                    closed = lane.LaneError(str(exc))
                    self._ledger.give_inline(sum(f.charge for f in frames[i:]))
                    break
                self._rejected += 1
                log.warning("ingress %s rejected a lane message: %s", self.endpoint, exc)
            if frame.charge:  # what no message took over
                self._ledger.give_inline(frame.charge)
                frame.charge = 0
        if closed is not None:
            log.debug("ingress %s: %s", self.endpoint, closed)
            self._close_lane(conn)
            return
        if conn.reader.blocked != conn.paused:  # level-triggered poll: do not spin on it
            conn.paused = conn.reader.blocked
            if conn.paused:
                self._poller.unregister(fd)
                self._paused[fd] = conn
            else:
                self._poller.register(fd, zmq.POLLIN)
                del self._paused[fd]

    def _close_lane(self, conn: LaneConn) -> None:
        fd = conn.reader.sock.fileno()
        if self._lanes.pop(fd, None) is None:
            return
        if not conn.paused:
            self._poller.unregister(fd)  # before closing: the number may be reused at once
        self._paused.pop(fd, None)
        self._dirty = True
        if conn.ident is not None and self._by_sender.get(conn.ident) is conn:
            del self._by_sender[conn.ident]
            # its sender's waiting reservations go with it: one whose replies came here
            # cannot read a grant now, and a sender that left closed its lane first
            for denial in self._ledger.drop_pending(conn.ident, "the sender's lane closed"):
                self._deny(denial)
        self._ledger.give_inline(conn.reader.abandon())  # a frame cut short holds no budget
        conn.reader.close()

    def _expire_lanes(self, now: float) -> None:
        """Close lanes that said no hello in time, and lanes stalled mid-frame for a lease."""
        for conn in list(self._lanes.values()):
            if conn.ident is None and now - conn.opened_at > LANE_HELLO_S:
                self.refusals.refuse("lane: no hello in time")
                self._close_lane(conn)
            elif (
                conn.reader.partial
                and not conn.paused
                and now - conn.reader.started_at > self.lease_s
            ):
                log.warning("ingress %s: a lane stalled mid-frame; closed", self.endpoint)
                self._close_lane(conn)

    def _on_lane_frame(self, conn: LaneConn, frame: lane.Frame) -> None:
        ident = conn.ident
        if ident is None:
            self._dirty = True
            self._lane_hello(conn, frame)
            return
        conn.taken += 1  # every frame counts: the sender counted it too
        if ident not in self._active_at:
            self._dirty = True  # a sender becomes active: its `load`s fall due
        self._active_at[ident] = self.last_message_at = now = time.monotonic()
        header = frame.header
        first = header[0] if header.nbytes else JSON_START
        if first == inline_wire.KIND_INLINE:  # relay/inline_wire.py: the hot path, one call
            # per part: a function call costs a few microseconds with cold caches
            head = inline_wire.unpack(header)
            known = conn.layouts.layout(head.layout)
            data = frame.data  # the tensors view it; the message takes the frame's charge
            if data.nbytes != known.nbytes:
                raise proto.ProtocolError(
                    f"inline data holds {data.nbytes} B, its manifest says {known.nbytes} B"
                )
            payload = unflatten(head.tree, known.reader.tensors(data))
            message = Message(head.rid, payload, known.nbytes, None, now, head.meta, frame.charge)
            frame.charge = 0  # the message's now (on a refusal, the caller gives it back)
            if self._ledger.admit(message, self._release):
                self._hand_over(message)
            return
        self._dirty = True
        if first == inline_wire.KIND_COMMIT:
            self._on_commit_wire(conn, ident, header)
            return
        if first != JSON_START:  # another binary kind: refused, naming it
            inline_wire.unpack(header)
        msg: dict[str, Any] = {}
        try:
            msg = proto.unpack(header, LANE_OPS if conn.control else INLINE_OPS)
            if msg["op"] != "inline":
                if msg["op"] == "commit" and msg.get("chunk") is not None:
                    self._on_cancel(ident, msg)  # its slot is free again
                    raise proto.ProtocolError("a tcp commit cannot travel on the lane")
                self._operate(ident, msg)
                return
        except (proto.ProtocolError, codec.CodecError) as exc:
            self._nack_commit(ident, msg, exc)
            raise
        size = len(frame.data)
        manifest = Manifest.from_json(msg.get("manifest"), slot_size=size)
        charge, frame.charge = frame.charge, 0
        self._inline(msg, manifest, frame.data, size, charge)

    def _lane_hello(self, conn: LaneConn, frame: lane.Frame) -> None:
        hello = proto.unpack(frame.header, LANE_HELLO)
        token = proto.field(hello, "id", str)
        ident = self._lane_tokens.get(token)
        # the id was given in an authenticated welcome, once; the mac shows the key too
        if ident is None or not auth.verify(self._key, hello.get("mac"), "lane", token):
            raise proto.ProtocolError("lane hello: unknown id or bad mac")
        del self._lane_tokens[token]
        if ident not in self._peers:
            raise proto.ProtocolError("lane hello: its sender is no longer a peer")
        conn.ident = ident
        conn.control = hello.get("control") is True
        conn.reader.limits = lane.FRAME_LIMITS
        try:
            conn.reader.sock.send(lane.READY)  # one byte into an empty buffer
        except OSError as exc:  # the sender is gone already
            raise lane.LaneError(f"lane hello not answered: {exc}") from None
        old = self._by_sender.get(ident)
        if old is not None:
            self._close_lane(old)
        self._by_sender[ident] = conn

    def _on_commit_wire(self, conn: LaneConn, ident: bytes, header: memoryview) -> None:
        """A binary commit (relay/inline_wire.py): the plain commit path, with the layout
        validated once per lane and the slot's size checked every time."""
        commit: inline_wire.Commit | None = None
        try:
            if not conn.control:
                raise proto.ProtocolError("a commit on a lane that carries inline messages only")
            commit = inline_wire.unpack_commit(header)
            kind = self._kinds.get(ident)
            landing = self._landings.get(kind) if kind is not None else None
            if landing is not None and not landing.binary_commits:
                raise proto.ProtocolError(f"a {kind} commit cannot be binary")
            head = commit.head
            grant, slot = self._claim(ident, commit.xid, {"rid": head.rid, "offset": commit.offset})
            try:
                if conn.commits is None:
                    conn.commits = inline_wire.LayoutCache(self.pool.allocator.capacity)
                known = conn.commits.layout(head.layout)
                size = self.pool.allocator.size_of(slot)
                if known.nbytes > size:
                    raise proto.ProtocolError(
                        f"manifest.nbytes: {known.nbytes} does not fit a slot of {size} B"
                    )
                backing = self.pool.backing
                if backing.has_buffer:  # the layout's tensors, worked out once
                    tensors = known.reader.tensors(backing.buffer(slot, known.nbytes))
                    payload = unflatten(head.tree, tensors)
                else:
                    payload = read_payload(backing, slot, known.with_tree(head.tree))
            except BaseException:
                self._ledger.free(slot)
                raise
            self._land(
                ident, commit.xid, grant.rid, slot, payload, known.nbytes, head.meta, commit.ask
            )
        except (proto.ProtocolError, codec.CodecError) as exc:
            if commit is not None:  # answered, so its sender fails now
                self._reply(ident, "nack", xid=commit.xid, reason=str(exc))
            raise

    def _lane_token(self, ident: bytes) -> str:
        """A random id under which the sender `ident` may open a lane (once): a lane that
        reaches another ingress (a name that resolved elsewhere) is refused there."""
        token = auth.nonce()
        self._lane_tokens[token] = ident
        while len(self._lane_tokens) > lane.MAX_CONNECTIONS:  # senders that never came
            self._lane_tokens.pop(next(iter(self._lane_tokens)))
        return token
