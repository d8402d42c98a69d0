"""The receiving end of every relay: the I/O loop (a ZMQ ROUTER and the inline lane) over
the role's receive pool.

Its parts: the slot ledger (relay/ledger.py: reservations, grants, leases, delivered
messages, aborts), the pool's `Memory` and each relay kind's `Landing` (relay/landing.py;
a kind's landing is made when its first sender says hello, see relay/registry.py), and
this loop, which alone touches the sockets.

One I/O thread owns the socket (ZMQ sockets are single-threaded) and the inline lane
(relay/lane.py). It answers reservations from the pool in arrival order, lands committed
payloads (shm: already in the shared pool; tcp: `recv_into` the granted slot), and
queues `Message`s for `recv`, or hands each to `on_message` on the I/O thread itself:
that saves a thread wake-up per message (tens of us on small VMs), so roles use it, and
the callback must only route the message on, never block. Other threads never touch
the socket: releasing a message frees its slot under a lock
and wakes the I/O thread through a pipe so waiting reservations are granted at once.

Every slot has an owner and a deadline: a grant not committed within its lease is
freed; `abort(rid)` frees everything a request holds (pending, granted, delivered).

Nothing is given before identity (relay/auth.py): a connection that has not proven the
peer key gets a challenge, a refusal, or nothing; its frames are read only up to a small
handshake size and dropped. Authenticated peers are bounded too: pending reservations
per peer, inline bytes held at once (`inline_budget`: a lane whose next frame would
overflow it is not read until messages are released, so its sender stalls, as on a full
pool), and lanes that stay silent before their hello or stall mid-frame are closed.

Closing without losing what is on its way: `goodbye()` tells every peer to send nothing
more here (protocol.py), while the ingress goes on serving; its owner closes it once
nothing has come for a moment (`last_message_at`).

The ingress tells its senders how busy its role is (`load`, Load, from the
`load` callback; without one, its own queue and pool): in the welcome, on every grant and
ack, and every `LOAD_EVERY_S` to the senders active in the last `LOAD_ACTIVE_S`, so they
can send new requests to the least busy replica (routing/dispatch.py).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from disagg_core.compat import Compat
from disagg_runtime.memory.intake import memory_for
from disagg_runtime.memory.layout import buffer_tensors, read_payload
from disagg_runtime.memory.pool import Pool, PoolError
from disagg_runtime.relay import auth, inline_wire, lane, registry
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.errors import RelayError, RelayTimeout
from disagg_runtime.relay.landing import Chunked, Landing, chunk_count, chunk_targets
from disagg_runtime.relay.ledger import SPARE_LEASE_S, Denial, Message, Reservation, SlotLedger
from disagg_runtime.wire import codec
from disagg_runtime.wire.codec import unflatten
from disagg_runtime.wire.load import Load
from disagg_runtime.wire.manifest import Manifest

log = logging.getLogger(__name__)
_SCRATCH = bytearray(1 << 20)
HWM = 16
LANE_HELLO = frozenset({"lane"})
JSON_START = ord("{")  # a lane header that does not start so is binary (relay/inline_wire.py)
INLINE_OPS = frozenset({"inline", "abort"})
LANE_OPS = frozenset({"inline", "abort", "reserve", "cancel", "commit"})
MAX_PEERS = 4096  # authenticated senders remembered (least recently active forgotten first)
MAX_UNAUTHENTICATED_LANES = 64  # lanes before their hello; more are refused at once
LANE_HELLO_S = 5.0  # a lane must say its hello this soon after connecting
LANE_CHECK_S = 0.5  # how often lanes are checked for those deadlines
IDLE_S = 1.0  # the longest the I/O thread sleeps, and goes without looking at deadlines
_EVENTS = int(zmq.EVENTS)  # plain ints: enum flag arithmetic costs a few Python calls
_POLLIN = int(zmq.POLLIN)


def _meta(msg: dict[str, Any]) -> dict[str, Any] | None:
    meta = msg.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise proto.ProtocolError("relay message: 'meta' must be an object")
    return meta


@dataclass(eq=False)
class _Lane:
    """One accepted lane connection; `ident` is its sender's ZMQ identity once it said so."""

    reader: lane.LaneReader
    opened_at: float
    ident: bytes | None = None
    control: bool = False  # the sender runs its whole protocol here, replies included
    taken: int = 0  # frames read after the hello: the sender counts the ones it wrote
    paused: bool = False  # its next frame does not fit the inline budget: not polled
    layouts: inline_wire.LayoutCache = field(default_factory=inline_wire.LayoutCache)
    commits: inline_wire.LayoutCache | None = None  # binary commits' layouts (made at the first)


@dataclass(frozen=True)
class IngressStats:
    pool_total: int
    pool_used: int
    occupancy: float
    queued: int
    pending_reservations: int
    delivered: int
    rejected: int
    lanes: int = 0  # senders connected through an inline lane
    refused: int = 0  # connections and messages refused for want of authentication
    inline_used: int = 0  # bytes of inline payloads held (received, not yet released)
    inline_budget: int = 0  # the most inline bytes held at once
    peers: int = 0  # authenticated senders
    spares_used: int = 0  # payloads committed into a slot granted ahead (no reservation)


class Ingress:
    """Bind `endpoint` (tcp://0.0.0.0:7000, ipc:///run/disagg/x.sock) and land into `pool`.

    The pool's memory decides how bytes land (`memory_for`: a CUDA pool through a pinned
    bounce buffer); a sender's relay kind, what its welcome offers and how its commits
    land (`Landing`). `key` is the pipeline's peer key: only senders that prove it are
    served.
    """

    def __init__(
        self,
        endpoint: str,
        pool: Pool,
        *,
        lease_s: float = 30.0,
        context: zmq.Context[Any] | None = None,
        lane_port: int = 0,
        on_message: Callable[[Message], None] | None = None,
        key: bytes,
        inline_budget: int | None = None,
        load: Callable[[], Load] | None = None,
        compat: Compat | None = None,
        role: str = "",
    ) -> None:
        self._pool = pool
        self.memory = memory_for(pool)
        self._load = load or self._own_load
        self.compat = compat  # advertised in every welcome (revision pairing, disagg_core.compat)
        self.role = role  # named in every welcome ("": a client's or gateway's reply ingress)
        self._on_message = on_message
        self.lease_s = lease_s
        self._key = auth.check_key(key)
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IPV6, 1)  # dual-stack: IPv6-only clusters too
        self._sock.setsockopt(zmq.RCVHWM, HWM)  # bounds chunks buffered ahead of recv_into
        self._sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_FRAME_BYTES)  # anyone's frames
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        try:
            listening = lane.listen(self.endpoint, lane_port)
        except OSError as exc:
            self._sock.close(linger=0)
            raise RelayError(
                f"cannot listen for the inline lane on port {lane_port}: {exc}"
            ) from None
        self._lane_listener = listening[0] if listening else None
        self._lane_offer: dict[str, Any] = listening[1] if listening else {}
        self._lanes: dict[int, _Lane] = {}  # by file descriptor
        self._by_sender: dict[bytes, _Lane] = {}  # tied lanes, by their sender's identity
        self._lane_tokens: dict[str, bytes] = {}  # offered in welcomes, not yet used
        self._lane_check = 0.0
        # authentication (relay/auth.py): challenges sent, peers that answered them
        self._challenges: collections.OrderedDict[bytes, tuple[str, str, dict[str, Any]]] = (
            collections.OrderedDict()
        )
        self._peers: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._active_at: dict[bytes, float] = {}  # peers' last message (they get `load`s)
        self._load_due = 0.0
        self._load_last: tuple[dict[str, Any] | None, float] = (None, float("-inf"))
        self.refusals = auth.Refusals(log, f"ingress {self.endpoint}")
        self._poller = zmq.Poller()  # the I/O thread's
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()  # C: fast hand-off
        budget = inline_budget or max(
            2 * proto.MAX_INLINE_MESSAGE_BYTES, pool.allocator.capacity // 4
        )
        self._ledger = SlotLedger(
            pool,
            lease_s=lease_s,
            inline_budget=budget,
            where=f"the receive pool at {self.endpoint}",
        )
        self.inline_budget = budget
        self._chunked: dict[bytes, Chunked] = {}  # tcp transfers landing, by sender
        self._landings: dict[str, Landing] = {}  # by relay kind, made at its first hello
        self._kinds: dict[bytes, str] = {}  # each peer's relay kind, from its hello
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._rejected = 0
        self._freed = False  # a release on the I/O thread: room for paused lanes, grants
        self._paused: dict[int, _Lane] = {}  # lanes not polled for want of inline budget, by fd
        # housekeeping (_housekeep: expiry, grants, lane checks, loads) runs after any step
        # that did more than deliver inline payloads (`_dirty`), and otherwise once `_due`,
        # the earliest deadline it acts on, is reached
        self._dirty = True
        self._due = 0.0
        self._spares_used = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._closing: str | None = None  # the goodbye's reason, once said
        self.last_message_at = time.monotonic()  # when a peer last sent anything
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disagg-ingress", daemon=True)
        self._thread.start()

    # ---- application side -------------------------------------------------------------
    def recv(self, timeout: float | None = None) -> Message:
        """Next payload; RelayTimeout when none arrives in time. Aborted ones are skipped."""
        if self._on_message is not None:
            raise RelayError(f"the ingress at {self.endpoint} delivers to its on_message callback")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                msg = self._queue.get(timeout=remaining)
            except queue.Empty:
                raise RelayTimeout(
                    f"no payload arrived at {self.endpoint} in {timeout} s"
                ) from None
            if not msg.released:
                return msg

    @property
    def pool(self) -> Pool:
        return self._pool

    @property
    def ledger(self) -> SlotLedger:
        return self._ledger

    def abort(self, request_id: str) -> None:
        """Free every slot `request_id` holds here, now and for its late arrivals."""
        self._abort_delivered(request_id)
        self._call(lambda: self._abort_reservations(request_id))

    def stats(self) -> IngressStats:
        s = self.pool.stats()
        return IngressStats(
            pool_total=s.total,
            pool_used=s.used,
            occupancy=s.occupancy,
            queued=self._queue.qsize(),
            pending_reservations=self._ledger.pending_count,
            delivered=self._ledger.delivered,
            rejected=self._rejected,
            lanes=len(self._by_sender),
            refused=self.refusals.count,
            inline_used=self._ledger.inline_used,
            inline_budget=self.inline_budget,
            peers=len(self._peers),
            spares_used=self._spares_used,
        )

    def goodbye(self, reason: str) -> None:
        """Tell every peer, and every sender that completes a handshake from now on, that
        this ingress is closing (protocol.py `goodbye`): they send nothing more here. It
        goes on serving until `close()`, so what they sent before they read it still lands;
        wait until nothing has come for a moment (`last_message_at`) before closing."""
        self._call(lambda: self._say_goodbye(reason))

    def _say_goodbye(self, reason: str) -> None:
        self._closing = reason
        for ident in list(self._peers):
            self._reply(ident, "goodbye", reason=reason)

    def close(self) -> None:
        """Stop the I/O thread and release the socket; the pool is the caller's to close."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        for landing in self._landings.values():
            landing.close()
        self._sock.close(linger=0)
        for conn in self._lanes.values():
            conn.reader.close()
        if self._lane_listener is not None:
            self._lane_listener.close()
            path = self._lane_offer.get("lane_path")
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _call(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wake()

    def _wake(self) -> None:
        # a full pipe means a wake-up is already pending; a closed one, that we are closing
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _release(self, msg: Message) -> None:
        if msg.slot is not None and not msg.released:
            self.memory.before_release()
        if not self._ledger.release(msg):
            return
        if threading.get_ident() == self._thread.ident:
            self._freed = True  # on the I/O thread itself (on_message): seen before it polls
        else:
            self._wake()  # waiting reservations may fit now

    def _abort_delivered(self, rid: str) -> None:
        self._ledger.abort_delivered(rid, time.monotonic())
        self._wake()

    # ---- I/O thread ---------------------------------------------------------------------
    def _run(self) -> None:
        poller = self._poller
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        listener = self._lane_listener.fileno() if self._lane_listener is not None else None
        if listener is not None:
            poller.register(listener, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._step(listener)
            except Exception:  # a bug must not stop every transfer to this role
                log.exception("ingress %s: unexpected error in the I/O loop", self.endpoint)
                time.sleep(0.01)

    def _step(self, listener: int | None) -> None:
        events = dict(self._poller.poll(timeout=self._poll_ms()))
        woken = self._wake_r in events
        if woken:
            os.read(self._wake_r, 4096)
        if not self._commands.empty():
            self._dirty = True
            while not self._commands.empty():
                self._commands.get()()
        # lanes first: an inline frame is taken before a later ZMQ message of its sender
        lanes = self._lanes
        for fd in events:
            if fd in lanes:
                self._read_lane(fd)
        if woken:
            self._freed = True
        if listener in events:
            self._dirty = True
            self._accept_lane()
        if self._sock in events:  # zmq_poll is level-triggered: one left is seen next time
            while self._sock.getsockopt(_EVENTS) & _POLLIN:
                self._dirty = True
                self._handle_one()
        if self._freed:  # a release may have made room for paused lanes
            self._freed = False
            for fd in list(self._paused):
                self._read_lane(fd)
        now = time.monotonic()
        if (
            self._dirty
            or now >= self._due
            or now >= self._lane_check
            or self._ledger.pending_count  # may wait for the lane frames just taken, or room
        ):
            self._housekeep(now)

    def _housekeep(self, now: float) -> None:
        """Expiry, lane deadlines, waiting reservations, load reports; then `_due`, when
        this must run again at the latest. Only delivering inline payloads adds no work
        here (they set no deadline, and a sender's first one marks the step `_dirty`), so
        steps that only did that skip it until `_due`."""
        self._dirty = False
        self._expire(now)
        if now >= self._lane_check:
            self._lane_check = now + LANE_CHECK_S
            self._expire_lanes(now)
        self._grant_pending()
        if now >= self._load_due:
            self._load_due = now + proto.LOAD_EVERY_S
            self._send_loads(now)
        self._due = self._next_due(now)

    def _accept_lane(self) -> None:
        assert self._lane_listener is not None
        while (conn := lane.accept(self._lane_listener)) is not None:
            strangers = sum(1 for c in self._lanes.values() if c.ident is None)
            if len(self._lanes) >= lane.MAX_CONNECTIONS or strangers >= MAX_UNAUTHENTICATED_LANES:
                self.refusals.refuse(f"{len(self._lanes)} lanes ({strangers} without a hello)")
                conn.close()  # its sender goes over ZMQ
                continue
            reader = lane.LaneReader(conn, admit=self._ledger.take_inline, limits=lane.HELLO_LIMITS)
            self._lanes[conn.fileno()] = _Lane(reader, time.monotonic())
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

    def _close_lane(self, conn: _Lane) -> None:
        fd = conn.reader.sock.fileno()
        if self._lanes.pop(fd, None) is None:
            return
        if not conn.paused:
            self._poller.unregister(fd)  # before closing: the number may be reused at once
        self._paused.pop(fd, None)
        self._dirty = True
        if conn.ident is not None and self._by_sender.get(conn.ident) is conn:
            del self._by_sender[conn.ident]
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

    def _on_lane_frame(self, conn: _Lane, frame: lane.Frame) -> None:
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
                getattr(self, f"_on_{msg['op']}")(ident, msg)
                return
        except (proto.ProtocolError, codec.CodecError) as exc:
            self._nack_commit(ident, msg, exc)
            raise
        size = len(frame.data)
        manifest = Manifest.from_json(msg.get("manifest"), slot_size=size)
        charge, frame.charge = frame.charge, 0
        self._inline(msg, manifest, frame.data, size, charge)

    def _lane_hello(self, conn: _Lane, frame: lane.Frame) -> None:
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

    def _on_commit_wire(self, conn: _Lane, ident: bytes, header: memoryview) -> None:
        """A binary commit (relay/inline_wire.py): the plain commit path, with the layout
        validated once per lane and the slot's size checked every time."""
        commit: inline_wire.Commit | None = None
        try:
            if not conn.control:
                raise proto.ProtocolError("a commit on a lane that carries inline messages only")
            commit = inline_wire.unpack_commit(header)
            kind = self._kinds.get(ident)
            if kind is not None and self._landings.get(kind) is not None:
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

    def _poll_ms(self) -> int:
        if self._freed:
            return 0  # released on this thread after the paused lanes were looked at
        ms = int((self._due - time.monotonic()) * 1000) + 1
        return 1 if ms < 1 else min(ms, int(IDLE_S * 1000))

    def _next_due(self, now: float) -> float:
        """The earliest deadline housekeeping acts on: a transfer's, a grant's or a waiting
        reservation's, the next load report's while someone sends; `now` while a landing is
        busy (polled every millisecond); at most IDLE_S away."""
        if any(landing.busy() for landing in self._landings.values()):
            return now
        due = now + IDLE_S
        for chunked in self._chunked.values():
            due = min(due, chunked.deadline)
        ledger = self._ledger.next_deadline()
        if ledger is not None:
            due = min(due, ledger)
        if self._active_at:  # someone is sending: the next `load` is due
            due = min(due, self._load_due)
        return due

    def _handle_one(self) -> None:
        ident = self._sock.recv()
        if not self._sock.getsockopt(zmq.RCVMORE):
            return  # an identity-only message: nothing to do
        msg: dict[str, Any] = {}
        try:
            if ident not in self._peers:
                self._stranger(ident)
                return
            self._peers.move_to_end(ident)  # recently active: forgotten last
            self.last_message_at = time.monotonic()
            self._active_at[ident] = time.monotonic()
            chunked = self._chunked.get(ident)
            if chunked is not None:
                msg = {"op": "commit", "xid": chunked.xid}
                self._on_chunk(ident, chunked)
                return
            msg = proto.unpack(self._sock.recv(), proto.OPS_TO_INGRESS)
            if msg["op"] in proto.HANDSHAKE_OPS:  # a new handshake on this connection
                self._forget(ident)
                self._handshake(ident, msg)
                return
            handler = getattr(self, f"_on_{msg['op']}")
            handler(ident, msg)
        except (proto.ProtocolError, codec.CodecError) as exc:
            self._rejected += 1
            log.warning("ingress %s rejected a message: %s", self.endpoint, exc)
            if ident not in self._chunked:
                self._nack_commit(ident, msg, exc)
        finally:
            self._drain()

    def _stranger(self, ident: bytes) -> None:
        """A message from a connection that has not authenticated: only the handshake is
        read (and only if it is small); anything else is refused unread."""
        frame = self._sock.recv()
        if len(frame) > proto.MAX_HANDSHAKE_BYTES or self._sock.getsockopt(zmq.RCVMORE):
            self.refusals.refuse("a message before the handshake")
            self._reply(ident, "refused", reason="not authenticated: say hello first")
            return
        try:
            msg = proto.unpack(frame, proto.OPS_TO_INGRESS)
        except proto.ProtocolError as exc:
            self.refusals.refuse(str(exc))
            return
        if msg["op"] not in proto.HANDSHAKE_OPS:
            self.refusals.refuse(f"{msg['op']} before the handshake")
            xid = msg.get("xid")
            self._reply(
                ident,
                "refused",
                reason="not authenticated: say hello first",
                **({"xid": xid} if isinstance(xid, int) else {}),
            )
            return
        self._handshake(ident, msg)

    def _handshake(self, ident: bytes, msg: dict[str, Any]) -> None:
        """hello -> challenge; auth (a mac over both nonces) -> the sender is a peer, and
        gets its welcome, itself with a mac over both nonces and its fields."""
        if msg["op"] == "hello":
            theirs = msg.get("nonce")
            if len(ident) != auth.ROUTING_ID_BYTES:
                self.refusals.refuse("hello from a connection without a random identity")
                self._reply(ident, "refused", reason="connect with a random 16-byte routing id")
                return
            if not isinstance(theirs, str) or not 16 <= len(theirs) <= 128:
                self.refusals.refuse("hello without a nonce")
                self._reply(ident, "refused", reason="hello without a nonce")
                return
            ours = auth.nonce()
            self._challenges.pop(ident, None)
            self._challenges[ident] = (theirs, ours, msg)
            while len(self._challenges) > MAX_PEERS:  # hellos never followed up
                self._challenges.popitem(last=False)
            self._reply(ident, "challenge", nonce=ours)
            return
        challenge = self._challenges.pop(ident, None)
        if challenge is None or not auth.verify(
            self._key, msg.get("mac"), "sender", challenge[0], challenge[1]
        ):
            self.refusals.refuse("wrong key (bad mac)" if challenge else "auth without hello")
            self._reply(ident, "refused", reason="authentication failed")
            return
        self._peers[ident] = None
        while len(self._peers) > MAX_PEERS:
            self._forget(next(iter(self._peers)))
        self._welcome(ident, challenge[2], challenge[0], challenge[1])

    def _forget(self, ident: bytes) -> None:
        """`ident` is no longer a peer: drop what it holds that nobody else will free."""
        self._peers.pop(ident, None)
        self._active_at.pop(ident, None)
        self._ledger.forget(ident)
        chunked = self._chunked.pop(ident, None)
        if chunked is not None and chunked.grant.offset is not None:
            self._ledger.free(chunked.grant.offset)
        kind = self._kinds.pop(ident, None)
        landing = self._landings.get(kind) if kind is not None else None
        if landing is not None:
            landing.forget(ident)
        conn = self._by_sender.get(ident)
        if conn is not None:
            self._close_lane(conn)

    def _nack_commit(self, ident: bytes, msg: dict[str, Any], exc: Exception) -> None:
        """A rejected commit is answered, so its sender fails now rather than at its timeout."""
        xid = msg.get("xid")
        if msg.get("op") == "commit" and isinstance(xid, int):
            self._reply(ident, "nack", xid=xid, reason=str(exc))

    def _drain(self) -> None:
        while self._sock.getsockopt(zmq.RCVMORE):
            self._sock.recv_into(_SCRATCH)

    def _reply(self, ident: bytes, op: str, **fields: Any) -> None:
        conn = self._by_sender.get(ident)
        if conn is None or not conn.control:
            self._sock.send_multipart([ident, proto.pack(op, **fields)])
            return
        try:  # a few hundred bytes into the buffer of a sender that reads its replies
            lane.send_frame(conn.reader.sock, proto.pack(op, **fields), b"")
        except OSError as exc:  # gone, or not reading: it times out on its side
            log.warning("ingress %s: lane reply failed: %s", self.endpoint, exc)
            self._close_lane(conn)

    def _welcome(self, ident: bytes, msg: dict[str, Any], theirs: str, ours: str) -> None:
        fields = {
            "pool": self.pool.name,
            "pool_device": self.pool.backing.device,  # where staged payloads land
            "pool_size": self.pool.allocator.capacity,
            "max_allocation": self.pool.allocator.max_allocation,
            "lease_s": self.lease_s,
            **self._lane_offer,
            **({"lane_id": self._lane_token(ident)} if self._lane_offer else {}),
            **({"inline_wire": inline_wire.WIRE_VERSION} if self._lane_offer else {}),
            **({"commit_wire": inline_wire.WIRE_VERSION} if self._lane_offer else {}),
            **self._welcome_extra(ident, msg),
            **self._load_field(),
            **({"compat": self.compat.to_wire()} if self.compat is not None else {}),
            **({"role": self.role} if self.role else {}),
        }
        fields["mac"] = auth.mac(self._key, "welcome", theirs, ours, auth.body(fields))
        self._reply(ident, "welcome", **fields)
        if self._closing is not None:  # it dialled a replica that is going: not here
            self._reply(ident, "goodbye", reason=self._closing)

    def _own_load(self) -> Load:
        """Without a role's account: this ingress's own queue, its pool, one worker."""
        capacity = self.pool.allocator.capacity
        return Load(
            queued=self._queue.qsize(),
            active=0,
            workers=1,
            free_bytes=max(0, capacity - self.pool.allocator.stats().used),
            pool_bytes=capacity,
        )

    def _load_field(self) -> dict[str, Any]:
        """`{"load": ...}` for a reply; empty when the role's account fails (logged: a
        sender without a report treats this replica as unknown, it still works)."""
        try:
            return {"load": self._load().to_json()}
        except Exception:
            log.exception("ingress %s: the load callback failed", self.endpoint)
            return {}

    def _send_loads(self, now: float) -> None:
        """`load` to each sender heard from in the last LOAD_ACTIVE_S, when it changed since
        the last one or the keepalive is due (idle senders are not written to: nobody reads
        their sockets). Always over ZMQ, never a lane: a ROUTER drops what a peer does not
        take, where a lane write could fail, and a failed lane is closed with what it
        still holds unread."""
        for ident, at in list(self._active_at.items()):
            if now - at > proto.LOAD_ACTIVE_S:
                del self._active_at[ident]
        if not self._active_at:
            return
        fields = self._load_field()
        last, sent_at = self._load_last
        if not fields or (fields["load"] == last and now - sent_at < proto.LOAD_KEEPALIVE_S):
            return
        self._load_last = (fields["load"], now)
        header = proto.pack("load", **fields)
        for ident in self._active_at:
            self._sock.send_multipart([ident, header])

    def _lane_token(self, ident: bytes) -> str:
        """A random id under which the sender `ident` may open a lane (once): a lane that
        reaches another ingress (a name that resolved elsewhere) is refused there."""
        token = auth.nonce()
        self._lane_tokens[token] = ident
        while len(self._lane_tokens) > lane.MAX_CONNECTIONS:  # senders that never came
            self._lane_tokens.pop(next(iter(self._lane_tokens)))
        return token

    def _welcome_extra(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        """The sender's relay kind's welcome fields (a CUDA pool exports itself to cuda-ipc)."""
        kind = msg.get("relay")
        if not isinstance(kind, str):
            return {}
        self._kinds[ident] = kind
        landing = self._landing_of(kind)
        return landing.welcome(ident, msg) if landing is not None else {}

    def _landing_of(self, kind: str) -> Landing | None:
        """`kind`'s landing, made (its backend imported) on first use; None: the plain paths."""
        landing = self._landings.get(kind)
        if landing is None:
            backend = registry.find(kind)
            if backend is None or backend.landing is None:
                return None
            landing = self._landings[kind] = backend.landing(self)
        return landing

    def _on_inline(self, ident: bytes, msg: dict[str, Any]) -> None:
        manifest = Manifest.from_json(msg.get("manifest"), slot_size=proto.MAX_INLINE_MESSAGE_BYTES)
        if not self._sock.getsockopt(zmq.RCVMORE):
            raise proto.ProtocolError("inline message has no data frame")
        if not self._ledger.take_inline(manifest.nbytes):  # over ZMQ there is no stalling it
            raise proto.ProtocolError(
                f"inline payload of {manifest.nbytes} B dropped: {self._ledger.inline_used} B "
                f"of the inline budget ({self.inline_budget} B) are held"
            )
        try:
            data = bytearray(manifest.nbytes)  # bounded above; a longer frame is cut short
            got = self._sock.recv_into(data) if data else len(self._sock.recv())
            if self._sock.getsockopt(zmq.RCVMORE):
                raise proto.ProtocolError("inline message carries unexpected frames")
        except BaseException:
            self._ledger.give_inline(manifest.nbytes)
            raise
        self._inline(msg, manifest, memoryview(data), got, manifest.nbytes)

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
        message = Message(rid, payload, manifest.nbytes, None, time.monotonic(), _meta(msg))
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
        timeout = {"timeout": True} if denial.timeout else {}
        self._reply(denial.ident, "deny", xid=denial.xid, reason=denial.reason, **timeout)

    def _grant_pending(self) -> None:
        def ready(head: Any) -> bool:  # inline frames sent before it are all here: keep order
            conn = self._by_sender.get(head.ident)
            return conn is None or conn.taken >= head.lane_sent

        for grant in self._ledger.grant_pending(time.monotonic(), ready):
            self._reply(
                grant.ident,
                "grant",
                xid=grant.xid,
                offset=grant.offset,
                lease_s=self.lease_s,
                **self._load_field(),
            )

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

    # ---- Host (relay/landing.py): what landings use ----------------------------------------
    def commit(self, ident: bytes, msg: dict[str, Any]) -> None:
        """The plain commit: the payload is in its slot (shm), or its chunks follow (tcp)."""
        xid = proto.nonneg_int(msg, "xid")
        grant, slot = self._claim(ident, xid, msg)
        try:
            size = self.pool.allocator.size_of(slot)
            manifest = Manifest.from_json(msg.get("manifest"), slot_size=size)
            meta = _meta(msg)
            if self._sock.getsockopt(zmq.RCVMORE):
                raise proto.ProtocolError("commit carries unexpected frames")
            if msg.get("chunk") is not None:  # tcp: the data follows, one message per chunk
                chunk = proto.nonneg_int(msg, "chunk")
                count = chunk_count(manifest, chunk)
                if count:
                    try:
                        self.memory.prepare_chunks(chunk)
                    except PoolError as exc:
                        raise proto.ProtocolError(str(exc)) from None
                    targets = chunk_targets(slot, manifest, chunk)
                    deadline = time.monotonic() + self.lease_s
                    self._chunked[ident] = Chunked(
                        grant, xid, manifest, meta, targets, count, deadline
                    )
                    return
        except BaseException:
            self._ledger.free(slot)
            raise
        self._finish(ident, xid, grant.rid, slot, manifest, meta, msg.get("next"))

    def _claim(self, ident: bytes, xid: int, msg: dict[str, Any]) -> tuple[Reservation, int]:
        """A commit takes its grant (`rid`, `offset` from `msg`; a spare's request id is the
        commit's): the grant and its slot, now the caller's to deliver or free. ProtocolError
        (the slot freed) when it cannot."""
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

    # ---- landing --------------------------------------------------------------------------------
    def _on_chunk(self, ident: bytes, chunked: Chunked) -> None:
        """Land the next chunk of `ident`'s transfer straight into its slot."""
        offset, length = next(chunked.targets)
        chunked.done += 1
        if chunked.error is None:
            got = self._sock.recv_into(self.memory.chunk_buffer(offset, length))
            if got == 0 < length:  # relay/tcp.py ChunkStream.cut: its source went away
                chunked.error = f"the sender cut the transfer at chunk {chunked.done - 1}"
            elif got != length:
                chunked.error = f"chunk {chunked.done - 1}: {got} B, expected {length} B"
            elif self._sock.getsockopt(zmq.RCVMORE):
                chunked.error = f"chunk {chunked.done - 1}: unexpected extra frames"
            else:
                chunked.error = self.memory.chunk_landed(offset, length)
        else:
            self._sock.recv_into(_SCRATCH)
        self._drain()
        if chunked.done < chunked.remaining:
            return
        del self._chunked[ident]
        slot = chunked.grant.offset
        assert slot is not None  # transfers are made from live grants
        if chunked.error is not None:
            self._ledger.free(slot)
            raise proto.ProtocolError(chunked.error)  # counted and nacked by _handle_one
        self._finish(ident, chunked.xid, chunked.grant.rid, slot, chunked.manifest, chunked.meta)

    def _finish(
        self,
        ident: bytes,
        xid: int,
        rid: str,
        slot: int,
        manifest: Manifest,
        meta: dict[str, Any] | None,
        ask: Any = None,
    ) -> None:
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
        """Deliver a committed payload (its tensors view `slot`), then ack its commit."""
        msg = Message(rid, payload, nbytes, slot, time.monotonic(), meta)
        if not self._admit(msg):
            self._reply(ident, "nack", xid=xid, reason=f"request {rid} was aborted")
            return
        # routed, not handled: then the load in the ack counts it, delivery does not wait
        # for the ack's system call, and a message released at once leaves its room to a spare
        self._hand_over(msg)
        self._reply(ident, "ack", xid=xid, **self._load_field(), **self._spare(ident, ask))

    def _spare(self, ident: bytes, ask: Any) -> dict[str, Any]:
        """The ack's `spare`, when the commit asked for one (`next {xid, nbytes}`) and the
        ledger grants it (relay/ledger.py `grant_spare`)."""
        if not isinstance(ask, dict):
            return {}
        try:
            xid = proto.nonneg_int(ask, "xid")
            nbytes = proto.nonneg_int(ask, "nbytes")
        except proto.ProtocolError:
            return {}  # the payload is delivered; a malformed ask only gets no spare
        grant = self._ledger.grant_spare(ident, xid, nbytes, time.monotonic())
        if grant is None:
            return {}
        lease = min(SPARE_LEASE_S, self.lease_s)
        return {"spare": {"xid": xid, "offset": grant.offset, "lease_s": lease}}

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

    def _expire(self, now: float) -> None:
        for landing in self._landings.values():
            landing.expire(now)
        for ident, chunked in list(self._chunked.items()):
            if chunked.deadline <= now:  # sender vanished mid-transfer
                del self._chunked[ident]
                if chunked.grant.offset is not None:
                    self._ledger.free(chunked.grant.offset)
                self._rejected += 1
                reason = f"transfer for request {chunked.grant.rid} stalled; slot freed"
                log.warning("%s", reason)
                self._reply(ident, "nack", xid=chunked.xid, reason=reason)
        expired = self._ledger.expire(now)
        for grant in expired.lapsed:
            if grant.spare:  # its sender had nothing more to send in time
                log.debug("a spare grant expired unused; slot freed")
            else:
                log.warning("grant for request %s expired uncommitted; slot freed", grant.rid)
        for denial in expired.denied:
            self._deny(denial)
