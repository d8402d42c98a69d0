"""The receiving end of every relay: the I/O loop (a ZMQ ROUTER and the inline lane) over
the role's receive pool, and the `Ingress` the parts of this package make up.

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
(per peer and in all, relay/ledger.py PendingBounds; each waits at most a lease, and a
peer that left takes its own with it: session.py), inline bytes held at once
(`inline_budget`: a lane whose next frame would overflow it is not read until messages
are released, so its sender stalls, as on a full pool; over ZMQ such a payload is
answered `overloaded` at once), and lanes that stay silent before their hello or stall
mid-frame are closed.

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
from dataclasses import dataclass
from typing import Any

import zmq

from disagg_core.compat import Compat
from disagg_runtime.memory.intake import memory_for
from disagg_runtime.memory.pool import Pool
from disagg_runtime.relay import auth, lane
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.errors import RelayError, RelayTimeout
from disagg_runtime.relay.ingress.lanes import LANE_CHECK_S, LaneConn, Lanes
from disagg_runtime.relay.ingress.ops import Operations
from disagg_runtime.relay.ingress.session import Sessions
from disagg_runtime.relay.landing import Landing
from disagg_runtime.relay.ledger import Message, PendingBounds, SlotLedger
from disagg_runtime.wire import codec
from disagg_runtime.wire.load import Load

log = logging.getLogger(__name__)
HWM = 16
IDLE_S = 1.0  # the longest the I/O thread sleeps, and goes without looking at deadlines
_SCRATCH = bytearray(1 << 20)  # where frames nobody takes are read and dropped
_EVENTS = int(zmq.EVENTS)  # plain ints: enum flag arithmetic costs a few Python calls
_POLLIN = int(zmq.POLLIN)


@dataclass(frozen=True)
class IngressStats:
    pool_total: int
    pool_used: int
    occupancy: float
    queued: int
    pending_reservations: int
    delivered: int
    rejected: int
    overloaded: int = 0  # inline payloads and reservations answered `overloaded`
    lanes: int = 0  # senders connected through an inline lane
    refused: int = 0  # connections and messages refused for want of authentication
    inline_used: int = 0  # bytes of inline payloads held (received, not yet released)
    inline_budget: int = 0  # the most inline bytes held at once
    peers: int = 0  # authenticated senders
    spares_used: int = 0  # payloads committed into a slot granted ahead (no reservation)


class Ingress(Lanes, Sessions, Operations):
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
        # a reply to a sender whose connection went fails (EHOSTUNREACH) instead of being
        # dropped: how a ROUTER learns that a peer left (`_reply`)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
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
        self._lanes: dict[int, LaneConn] = {}  # by file descriptor
        self._by_sender: dict[bytes, LaneConn] = {}  # tied lanes, by their sender's identity
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
            bounds=PendingBounds.for_pool(pool.allocator.capacity),
            capacity=pool.allocator.capacity,
        )
        self.inline_budget = budget
        self._taking: dict[bytes, Landing] = {}  # senders whose next messages a landing takes
        self._landings: dict[str, Landing] = {}  # by relay kind, made at its first hello
        self._kinds: dict[bytes, str] = {}  # each peer's relay kind, from its hello
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._rejected = 0
        self._overloaded = 0
        self._freed = False  # a release on the I/O thread: room for paused lanes, grants
        self._paused: dict[int, LaneConn] = {}  # lanes not polled for want of inline budget, by fd
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
            overloaded=self._overloaded,
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
        for landing in self._landings.values():
            landing_due = landing.due()
            if landing_due is not None:
                due = min(due, landing_due)
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
            taking = self._taking.get(ident)
            if taking is not None:  # e.g. the next chunk of a tcp transfer
                taking.take(ident)
                return
            msg = proto.unpack(self._sock.recv(), proto.OPS_TO_INGRESS)
            if msg["op"] in proto.HANDSHAKE_OPS:  # a new handshake on this connection
                self._forget(ident)
                self._handshake(ident, msg)
                return
            self._operate(ident, msg)
        except (proto.ProtocolError, codec.CodecError) as exc:
            self._rejected += 1
            log.warning("ingress %s rejected a message: %s", self.endpoint, exc)
            self._nack_commit(ident, msg, exc)
        finally:
            self._drain()

    def _drain(self) -> None:
        while self._sock.getsockopt(zmq.RCVMORE):
            self._sock.recv_into(_SCRATCH)

    # ---- Host (relay/landing.py): reading the message a landing was handed -------------
    def expect_frames(self, ident: bytes, landing: Landing | None) -> None:
        if landing is None:
            self._taking.pop(ident, None)
        else:
            self._taking[ident] = landing

    def read_into(self, buffer: Any) -> int:
        got: int = self._sock.recv_into(buffer)
        return got

    def more_frames(self) -> bool:
        return bool(self._sock.getsockopt(zmq.RCVMORE))

    def call(self, fn: Callable[[], None]) -> None:
        self._call(fn)

    def verify(self, given: object, label: str, *parts: str) -> bool:
        return auth.verify(self._key, given, label, *parts)

    def _reply(self, ident: bytes, op: str, **fields: Any) -> bool:
        """Whether the reply went out. Over ZMQ it fails when the sender's connection is
        gone (then the sender is: `_forget`), or its queue is full (dropped, as a ROUTER
        without ROUTER_MANDATORY would)."""
        conn = self._by_sender.get(ident)
        if conn is None or not conn.control:
            return self._send_zmq(ident, proto.pack(op, **fields))
        try:  # a few hundred bytes into the buffer of a sender that reads its replies
            lane.send_frame(conn.reader.sock, proto.pack(op, **fields), b"")
        except OSError as exc:  # gone, or not reading: it times out on its side
            log.warning("ingress %s: lane reply failed: %s", self.endpoint, exc)
            self._close_lane(conn)
            return False
        return True

    def _send_zmq(self, ident: bytes, header: bytes) -> bool:
        try:
            self._sock.send_multipart([ident, header], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH and ident in self._peers:
                log.info("ingress %s: a sender's connection went; forgotten", self.endpoint)
                self._forget(ident)  # its waiting reservations go with it
            return False
        return True

    def _expire(self, now: float) -> None:
        for landing in self._landings.values():
            landing.expire(now)
        expired = self._ledger.expire(now)
        for grant in expired.lapsed:
            if grant.spare:  # its sender had nothing more to send in time (or died)
                log.debug("a credit expired unused; slot freed")
            else:
                log.warning("grant for request %s expired uncommitted; slot freed", grant.rid)
        for denial in expired.denied:
            self._deny(denial)
