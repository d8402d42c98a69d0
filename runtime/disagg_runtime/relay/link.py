"""A sender's connection to one ingress: handshake, replies, the lane, a lost session.

A sender is thread-safe: one transfer at a time holds the socket; each waits for replies
with its own operation id (`xid`), so a late reply to an abandoned operation is never
taken for the current one.

Authentication holds for the ZMQ connection the handshake ran on: libzmq reconnects by
itself when a receiver restarts, but the new process knows nothing of this sender and
refuses what it sends. So a sender watches its socket for a lost connection (a ZMQ socket
monitor) and for refusals, and from then on refuses to send with `PeerLost`, which tells
the caller to reconnect (a fresh handshake) and send again: nothing of that payload was
delivered.

A sender first proves the pipeline's peer key and checks the ingress's proof
(relay/auth.py): a welcome without a valid mac fails the connection before anything in
it (a pool to map, a lane) is used. An shm sender also maps only pools whose name starts
with `pools` (its pipeline's namespace), and writes only inside the pool it mapped.

A receiver that is closing (a role at the end of its drain) says `goodbye` and keeps
serving a moment longer: what crossed the goodbye still lands, and the sender raises
PeerLost for anything after it (inline payloads have no receipt, so only the goodbye tells
a sender whose view of the replicas lags that this one is going).

A sender keeps the receiver's latest load report (welcome, grants, acks, `load`
messages) and counts what it sent since; `view()` says what it knows now, reading
pending reports without waiting, for senders choosing a replica (routing/dispatch.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from typing import Any, ClassVar

import zmq

from disagg_core.compat import Compat
from disagg_runtime.memory.layout import Planner
from disagg_runtime.relay import auth, lane
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.errors import NotAPeer, PeerLost, RelayError, RelayTimeout
from disagg_runtime.relay.session import INLINE_THRESHOLD, Session
from disagg_runtime.wire.load import Load, LoadError, View

log = logging.getLogger(__name__)
HWM = 16
LOST_CONNECTION = "the connection was lost (the receiver restarted or went away)"
LOST_GRACE_S = 0.2  # after a lane broke: how long libzmq may take to report its connection lost
WATCH_GAP_S = 0.0005  # a stream of sends asks for replies and monitor events this often
_POLLIN = int(zmq.POLLIN)  # a plain int: `x & zmq.POLLIN` goes through enum.Flag


def _goodbye(msg: dict[str, Any]) -> str:
    """Why a session ended with the receiver's `goodbye` (protocol.py)."""
    return f"the receiver is closing ({msg.get('reason')})"


def _full(exc: OSError) -> bool:
    """A lane send failed because the receiver stopped reading (not because it is gone)."""
    return isinstance(exc, (BlockingIOError, TimeoutError))


class Link:
    """One authenticated connection to an ingress, and the session its welcome agreed:
    what every sender shares apart from how payloads go (relay/sender.py)."""

    kind: ClassVar[str] = ""
    control_on_lane: ClassVar[bool] = False  # run the whole protocol on the lane

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float = 30.0,
        inline_max: int | None = None,
        lane: bool = True,
        context: zmq.Context[Any] | None = None,
        key: bytes,
        handshake_timeout: float | None = None,
        pools: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._key = auth.check_key(key)
        self.pools = pools  # shm pools must be named with this prefix (None: any disagg pool)
        if inline_max is not None and not 0 <= inline_max <= proto.MAX_INLINE_MESSAGE_BYTES:
            raise ValueError(
                f"inline_max must be within [0, {proto.MAX_INLINE_MESSAGE_BYTES}] bytes"
            )
        # until the welcome: what it agrees replaces it (the backend's limit, on a lane)
        self.session = Session(INLINE_THRESHOLD if inline_max is None else inline_max)
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IPV6, 1)  # dual-stack: IPv6-only clusters too
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
        self._sock.setsockopt(zmq.ROUTING_ID, auth.routing_id())  # unguessable, never reused
        self._sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_FRAME_BYTES)
        # reports the connection lost (the receiver restarted or went away): _check_session
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self._lock = threading.Lock()
        self._xids = itertools.count(1)
        self.closed = False
        self._watch: list[tuple[Any, int]] = []  # what _start_send asks about (_watch_replies)
        self._watch_replies()
        self._load: tuple[Load, float] | None = None  # the last report, when
        self._sent_since = 0  # requests sent after that report
        self._sent_at = float("-inf")
        self._watched_at = float("-inf")  # the last zmq_poll of `_watch` (_start_send)
        self._lost: str | None = None  # a refusal read between transfers, a lost connection
        self._bye = False  # _lost is the receiver's goodbye (it serves what it has)
        self.overloaded = 0  # payloads the receiver answered `overloaded` (sender.py)
        self._planner = Planner()  # payloads shaped like recent ones are not laid out again
        try:
            welcome = self._handshake(timeout if handshake_timeout is None else handshake_timeout)
            try:
                self.max_allocation: int = proto.nonneg_int(welcome, "max_allocation")
                self.lease_s = float(proto.field(welcome, "lease_s", (int, float)))
                # the receiver's revision: whom a request may go to (disagg_core.compat)
                self.peer_compat: Compat | None = proto.compat(welcome)
                self.peer_role: str | None = proto.role(welcome)  # whom it serves, if a role
            except proto.ProtocolError as exc:
                raise RelayError(f"bad welcome from {endpoint}: {exc}") from None
            self._on_welcome(welcome)
            self.session = Session.agreed(welcome, inline_max)
            if lane:  # False: inline payloads over ZMQ even where a lane is offered
                self._open_lane(welcome, None if inline_max is not None else welcome)
        except BaseException:
            self._close_sockets()
            raise

    @property
    def inline_max(self) -> int:
        """Payloads up to this many tensor bytes go inline (the session's, as agreed)."""
        return self.session.inline_max

    def _drain_monitor(self) -> bool:
        """Read the monitor's pending events; whether there were any (connection lost)."""
        seen = False
        # EVENTS, not poll(0): the same answer for ~1 us less, on every send
        while self._monitor.getsockopt(zmq.EVENTS) & _POLLIN:
            self._monitor.recv_multipart()
            seen = True
        return seen

    def _start_send(self) -> None:
        """Under the lock, before anything of a payload leaves: refuse on a closed relay or a
        lost session, and count the send for the idle and liveness checks. Most sends find
        nothing waiting (no reply, no monitor event): one zmq_poll asks the ZMQ socket, its
        monitor and a control lane at once (~3.5 us, where a getsockopt(EVENTS) each and a
        poll of the lane took ~7.5), and only what is there is read (`_check_session`). In a
        stream of sends (a token stream: tens of thousands a second) it asks at most every
        WATCH_GAP_S: the poll was a sixth of a streamed 4 KiB send's CPU, and a refusal or
        a lost connection is seen at most that much later (a broken lane fails its write)."""
        if self.closed:
            self._check_open()  # raises
        now = time.monotonic()
        if (
            self._lost is not None
            or self.session.replies
            or (now - self._watched_at >= WATCH_GAP_S and self._watched(now))
        ):
            self._check_session()
        self._sent_since += 1
        self._sent_at = now

    def _watched(self, now: float) -> bool:
        """Whether anything `_start_send` watches has something to read."""
        self._watched_at = now
        return bool(zmq.zmq_poll(self._watch, 0))

    def _check_session(self, grace: float = 0.0) -> None:
        """Raise PeerLost once the receiver refused this sender, or the connection it
        authenticated on was lost (waiting up to `grace` s for libzmq to report it). Any
        loss counts, even one during the handshake: a needless reconnect costs one round
        trip, a stale session loses every message."""
        if self._lost is None:
            self._read_pending()  # a refusal of an inline send waits here (none waits for it)
        if self._lost is None and (
            self._drain_monitor()
            or (grace and self._monitor.poll(int(grace * 1000)) and self._drain_monitor())
        ):
            self._lost = LOST_CONNECTION
        if self._lost is not None:
            self._close_lane()
            raise PeerLost(f"{self.kind} relay to {self.endpoint}: {self._lost}; reconnect")

    def _close_sockets(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def _handshake(self, timeout: float) -> dict[str, Any]:
        """hello, challenge, auth, welcome (relay/auth.py); the welcome is trusted only if
        its mac, over both nonces and its fields, shows the peer key."""
        deadline = time.monotonic() + timeout
        ours = auth.nonce()
        self._sock.send(proto.pack("hello", relay=self.kind, nonce=ours))
        challenge = self._await(None, {"challenge"}, deadline, "handshake")
        theirs = challenge.get("nonce")
        if not isinstance(theirs, str):
            raise RelayError(f"bad challenge from {self.endpoint}: no nonce")
        self._sock.send(proto.pack("auth", mac=auth.mac(self._key, "sender", ours, theirs)))
        welcome = self._await(None, {"welcome"}, deadline, "handshake")
        body = auth.body({k: v for k, v in welcome.items() if k not in ("v", "pv", "op")})
        if not auth.verify(self._key, welcome.get("mac"), "welcome", ours, theirs, body):
            raise NotAPeer(
                f"{self.endpoint} did not prove the pipeline's peer key; not a peer of ours"
            )
        try:
            self._note_load(welcome, time.monotonic())
        except proto.ProtocolError as exc:
            raise RelayError(f"bad welcome from {self.endpoint}: {exc}") from None
        return welcome

    def _note_load(self, msg: dict[str, Any], at: float) -> None:
        """Keep the load report a reply carries (as of `at`); ProtocolError if malformed."""
        if "load" not in msg:
            return
        try:
            load = Load.from_json(msg["load"])
        except LoadError as exc:
            raise proto.ProtocolError(f"relay {msg.get('op')}: {exc}") from None
        self._load = (load, at)
        self._sent_since = 0

    def view(self) -> View | None:
        """What this sender knows of its receiver's load now (None: nothing yet). Reports
        that arrived since the last transfer are read first, unless a transfer holds the
        socket (it reads them itself)."""
        if self._lock.acquire(blocking=False):
            try:
                if not self.closed:
                    self._read_pending()
            except (RelayError, zmq.ZMQError) as exc:  # cancelling a late grant failed
                log.info("%s relay to %s: %s", self.kind, self.endpoint, exc)  # next send says
            finally:
                self._lock.release()
        seen = self._load
        if seen is None:
            return None
        load, at = seen
        return View(load, max(0.0, time.monotonic() - at), self._sent_since)

    def _read_pending(self) -> None:
        """Read the replies waiting now, without blocking (call with the lock held): load
        reports are kept; a late grant (or a late ack's spare) is cancelled; a refusal fails
        the next send."""
        now = time.monotonic()
        # the ingress writes `load`s only while this sender is active: none is newer than that
        at = min(now, self._sent_at + proto.LOAD_ACTIVE_S)
        while (header := self._pending_reply()) is not None:
            try:
                msg = proto.unpack(header, proto.OPS_TO_SENDER)
                self._note_load(msg, now if msg["op"] != "load" else at)
            except proto.ProtocolError as exc:
                log.warning("%s relay to %s: bad reply dropped: %s", self.kind, self.endpoint, exc)
                self._load = None  # do not go on trusting what this receiver says
                continue
            spare = msg.get("spare") if msg["op"] == "ack" else None
            if msg["op"] == "refused":
                self._lost = str(msg.get("reason"))
            elif msg["op"] == "goodbye":
                self._lost, self._bye = _goodbye(msg), True
            elif msg["op"] == "grant" and isinstance(msg.get("xid"), int):
                self._control(proto.pack("cancel", xid=msg["xid"]))
            elif isinstance(spare, dict) and isinstance(spare.get("xid"), int):
                self._control(proto.pack("cancel", xid=spare["xid"]))  # a late ack's spare

    def _pending_reply(self) -> bytes | None:
        """The next reply header already here, else None (never waits): replies on the
        control lane, if this sender has one, then ZMQ (`load`s always come that way)."""
        session = self.session
        if session.control and not session.replies and session.readable(0):
            try:
                session.read_replies()
            except lane.LaneError:
                self._close_lane()  # the next transfer goes over ZMQ, or fails
        if session.replies:
            return session.replies.popleft()
        if not self._sock.getsockopt(zmq.EVENTS) & _POLLIN:  # cheaper than recv's zmq.Again
            return None
        try:
            return bytes(self._sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None

    def _on_welcome(self, welcome: dict[str, Any]) -> None:
        """Backend hook: e.g. attach the receiver's shared pool."""

    def inline_limit(self, welcome: dict[str, Any]) -> int:
        """Backend hook: the largest payload sent inline on the lane to the receiver that
        sent `welcome`, when the caller set no `inline_max`."""
        return INLINE_THRESHOLD

    def _open_lane(self, welcome: dict[str, Any], limit_from: dict[str, Any] | None) -> None:
        """Take the inline lane the ingress offers (relay/lane.py); without one, or when it
        cannot be reached, inline payloads go over ZMQ. `limit_from`: the welcome whose
        backend limit (`inline_limit`) holds on the lane, when the caller set none."""
        limit = self.inline_limit(limit_from) if limit_from is not None else None
        try:
            self.session.open_lane(
                self.endpoint,
                welcome,
                key=self._key,
                timeout=self.timeout,
                control=self.control_on_lane,
                lane_limit=limit,
            )
        except OSError as exc:
            log.info("%s relay to %s sends inline over ZMQ: %s", self.kind, self.endpoint, exc)
            return
        self._watch_replies()

    def _watch_replies(self) -> None:
        """What `_start_send` polls: the ZMQ socket and its monitor (level-triggered: zmq_poll
        asks each for its EVENTS), and the lane where replies come on it."""
        self._watch = [(self._sock, _POLLIN), (self._monitor, _POLLIN)]
        lane_sock = self.session.lane
        if lane_sock is not None and self.session.control:
            self._watch.append((lane_sock.fileno(), _POLLIN))

    def _send_lane(self, rid: str, frame: bytearray) -> bool:
        """One frame on the lane, written by one call, waiting at most the sender's `timeout`
        for room (the kernel's send timeout: cheaper than a deadline per call); False when
        the lane broke. A failure cuts the stream mid-frame, which the ingress drops whole,
        and closes the lane. A broken connection took every earlier frame with it, so the
        caller sends this payload over ZMQ, as later ones go (ZMQ queues for a peer that
        comes back), or reserves it when it is over the limit without a lane; a full one
        (the receiver stopped reading) still holds earlier frames this one must not
        overtake: RelayTimeout."""
        exc = self.session.write(frame)
        if exc is None:
            return True
        self._close_lane()
        if _full(exc):
            raise RelayTimeout(
                f"receiver at {self.endpoint} is not draining; request {rid} not sent"
            ) from None
        self._check_session(LOST_GRACE_S)  # the receiver went away: reconnect, not ZMQ
        log.info("%s relay to %s: lane lost (%s); over ZMQ now", self.kind, self.endpoint, exc)
        return False

    def _lane_frame(self, header: bytes, data: bytes | bytearray = b"") -> OSError | None:
        """Write one frame on the lane and count it; on failure close the lane and return
        the error (the caller decides: time out, fail, or go over ZMQ)."""
        exc = self.session.write_frame(header, data)
        if exc is not None:
            self._close_lane()
        return exc

    def _close_lane(self) -> None:
        if self.session.lane is not None:
            self.session.close_lane()
            self._watch_replies()

    def _control(self, header: bytes, *, opens: bool = False) -> None:
        """Send a control message where this sender's replies come from. When the lane is
        broken, a message that `opens` an operation (nothing of it sent yet) goes over
        ZMQ, as everything after it; one in the middle of an operation fails it."""
        if not self.session.control:
            self._sock.send(header)
            return
        exc = self._lane_frame(header)
        if exc is None:
            return
        if _full(exc):
            raise RelayTimeout(f"receiver at {self.endpoint} is not draining") from None
        if not opens:
            raise RelayError(
                f"lost the connection to {self.endpoint} mid-transfer (receiver gone?): {exc}"
            ) from None
        self._check_session(LOST_GRACE_S)  # the receiver went away: reconnect, not ZMQ
        log.info("%s relay to %s: lane lost (%s); over ZMQ now", self.kind, self.endpoint, exc)
        self._sock.send(header)

    def _next_reply(self, timeout: float) -> bytes | None:
        """The next reply header, or None when none came within `timeout` s."""
        session = self.session
        deadline = time.monotonic() + timeout
        if not session.control:
            # the monitor too: a receiver killed before it replied sends nothing, and
            # waiting for the reply alone would hold the request (and this relay, so the
            # sweep cannot see it gone) until its deadline
            watch = [(self._sock, zmq.POLLIN), (self._monitor, zmq.POLLIN)]
            while True:
                remaining = deadline - time.monotonic()
                ready = zmq.zmq_poll(watch, max(0, int(remaining * 1000)) + 1)
                if any(sock is self._sock for sock, _ in ready):
                    return bytes(self._sock.recv())
                if ready and self._drain_monitor():
                    self._lost = LOST_CONNECTION
                    raise PeerLost(f"{self.kind} relay to {self.endpoint}: {self._lost}")
                if remaining <= 0:
                    return None
        while not session.replies:
            remaining = deadline - time.monotonic()  # a partial frame must not extend it
            if remaining <= 0 or not session.readable(int(remaining * 1000) + 1):
                return None
            try:
                session.read_replies()
            except lane.LaneError as exc:
                self._close_lane()
                self._check_session(LOST_GRACE_S)  # the receiver went away: PeerLost
                raise RelayError(
                    f"lost the connection to {self.endpoint} mid-transfer (receiver gone?): {exc}"
                ) from None
        return session.replies.popleft()

    def abort(self, request_id: str) -> None:
        """Tell the receiver to free whatever `request_id` holds there."""
        header = proto.pack("abort", rid=request_id)
        with self._lock:
            # on the lane, behind the inline payloads it sent before; else over ZMQ (late
            # arrivals of an aborted request are dropped whichever way they come)
            if self.session.lane is not None and self._lane_frame(header) is None:
                return
            if not self.closed and self._lost is None:  # a receiver that restarted holds nothing
                self._sock.send(header)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._close_sockets()
            self._close_lane()
            self._on_close()

    def _on_close(self) -> None:
        """Backend hook: release attached memory."""

    def gone(self) -> bool:
        """Whether the receiver went away or restarted (the connection was lost, or it
        refused this sender): what it held of this sender's requests is lost with it. Not
        after a goodbye (that receiver hands on what it cannot finish). Reads what is
        waiting, never blocks: False while a transfer holds the relay (it will find out).
        A relay closed after its loss was found stays gone (what went on it is lost)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self.closed:
                return self._lost is not None and not self._bye
            if self._lost is None:
                with contextlib.suppress(PeerLost):
                    self._check_session()
            return self._lost is not None and not self._bye
        finally:
            self._lock.release()

    @property
    def usable(self) -> bool:
        """Open, and its session not known to be lost (a later send may still find it is)."""
        return not self.closed and self._lost is None

    def _check_open(self) -> None:
        """A relay closed under its user (another thread's send found the peer lost and
        dropped it, or the cache evicted it) sent nothing: PeerLost, so the caller sends
        again on a fresh one, as that other thread did."""
        if self.closed:
            raise PeerLost(f"{self.kind} relay to {self.endpoint} is closed; reconnect")

    def _await(self, xid: int | None, ops: set[str], deadline: float, what: str) -> dict[str, Any]:
        """Wait for the reply to operation `xid`; replies to abandoned operations are dropped
        (a late grant is cancelled so the receiver frees its slot)."""
        while True:
            remaining = deadline - time.monotonic()
            header = self._next_reply(remaining) if remaining > 0 else None
            if header is None:
                raise RelayTimeout(f"{what} from {self.endpoint} timed out")
            try:
                msg = proto.unpack(header, proto.OPS_TO_SENDER)
                if msg["op"] != "welcome":  # whose load counts once its mac is checked
                    self._note_load(msg, time.monotonic())
            except proto.ProtocolError as exc:
                raise RelayError(f"bad reply from {self.endpoint}: {exc}") from None
            if msg["op"] == "refused" and what == "handshake":
                raise NotAPeer(f"{self.endpoint} refused this sender: {msg.get('reason')}")
            if msg["op"] == "refused":  # no longer a peer there (e.g. it restarted): reconnect
                self._lost = str(msg.get("reason"))
                raise PeerLost(f"{self.endpoint} refused this sender: {self._lost}")
            if msg["op"] == "goodbye":  # it still serves what it has; nothing new goes there
                self._lost, self._bye = _goodbye(msg), True
                if what == "reservation":  # nothing of the payload sent yet: elsewhere
                    self._control(proto.pack("cancel", xid=xid))
                    raise PeerLost(f"{self.endpoint}: {self._lost}; reconnect")
                continue
            if msg["op"] in ops and msg.get("xid") == xid:
                return msg
            if msg["op"] == "grant" and isinstance(msg.get("xid"), int):
                self._control(proto.pack("cancel", xid=msg["xid"]))
            spare = msg.get("spare")  # a late ack's spare: give its slot back at once
            if msg["op"] == "ack" and isinstance(spare, dict) and isinstance(spare.get("xid"), int):
                self._control(proto.pack("cancel", xid=spare["xid"]))
