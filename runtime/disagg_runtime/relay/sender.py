"""The sending end every relay shares (relay/shm.py, relay/tcp.py, relay/cuda_ipc.py subclass it).

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
          (in a stream of medium payloads the ack grants the next slot ahead, a spare:
          then copy -> commit -> ack)
    tcp:  reserve -> grant -> commit, then one message per chunk (zero-copy sends; the
          receiver `recv_into`s each chunk at its place in the slot) -> ack

TCP data is cut into `chunk_bytes` messages, each its own ZMQ message: libzmq buffers a
multipart message whole before delivering it (a 256 MiB payload would sit in fresh
memory first), and messages above ~1 MiB stop being recycled by malloc, costing page
faults (measured here: 64 MiB as one frame 1.2 GB/s, as 1 MiB messages with HWM 16 about 2.3 GB/s).
Both ends set a small high-water mark, so at most HWM chunks are buffered ahead.

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

import collections
import itertools
import logging
import select
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import zmq

from disagg_core.compat import Compat
from disagg_runtime.memory.layout import Placement, Planner
from disagg_runtime.relay import auth, inline_wire, lane
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.errors import NotAPeer, PeerLost, RelayError, RelayTimeout
from disagg_runtime.wire.load import Load, LoadError, View
from disagg_runtime.wire.manifest import Manifest

log = logging.getLogger(__name__)
INLINE_THRESHOLD = 64 * 1024  # inline up to this unless a backend's `inline_limit` says more
CHUNK_BYTES = 1 << 20
ZERO_COPY_MIN = 64 * 1024
HWM = 16
LANE_CONNECT_S = 2.0  # a filtered port must not stall start-up long
LOST_GRACE_S = 0.2  # after a lane broke: how long libzmq may take to report its connection lost
SPARE_MAX = 16 << 20  # the largest payload that asks for its successor's slot ahead
SPARE_STREAM_S = 0.1  # ... when the one before it was sent less than this earlier
_POLLIN = int(zmq.POLLIN)  # a plain int: `x & zmq.POLLIN` goes through enum.Flag


@dataclass(frozen=True)
class _Spare:
    """A slot granted ahead, with an ack: usable for `nbytes` until `use_by`."""

    xid: int
    nbytes: int
    offset: int
    use_by: float


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


def _json_inline(rid: str, manifest: Manifest, meta: Mapping[str, Any] | None) -> bytes:
    return proto.pack("inline", rid=rid, meta=meta, manifest=manifest.to_json())


def _over_zmq(
    frame: bytearray, at: int, rid: str, manifest: Manifest, meta: Mapping[str, Any] | None
) -> list[memoryview | bytes]:
    """An inline payload's ZMQ message, from the lane frame built for it (`Sender._inline_frame`,
    the slot's bytes from `at` on): the header in JSON, which ZMQ reads only (a binary one
    was built for the lane, which may have closed since), and the slot's bytes."""
    view = memoryview(frame)
    if frame[lane.PREFIX.size] == ord("{"):
        return [view[lane.PREFIX.size : at], view[at:]]
    return [_json_inline(rid, manifest, meta), view[at:]]


def _goodbye(msg: dict[str, Any]) -> str:
    """Why a session ended with the receiver's `goodbye` (protocol.py)."""
    return f"the receiver is closing ({msg.get('reason')})"


def _full(exc: OSError) -> bool:
    """A lane send failed because the receiver stopped reading (not because it is gone)."""
    return isinstance(exc, (BlockingIOError, TimeoutError))


class Sender:
    """Common handshake, inline path, reservation and acknowledgement logic."""

    kind: ClassVar[str] = ""
    control_on_lane: ClassVar[bool] = False  # run the whole protocol on the lane
    binary_commit: ClassVar[bool] = False  # commits carry no backend fields: binary on the lane

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
        # None: the backend's choice for this receiver, once its welcome says what it is
        self.inline_max = INLINE_THRESHOLD if inline_max is None else inline_max
        self.use_lane = lane  # False: inline payloads over ZMQ even where a lane is offered
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
        self._lane: socket.socket | None = None
        self._lane_sent = 0
        self._lane_control = False  # reservations, commits and their replies on the lane too
        self._watch: list[tuple[Any, int]] = []  # what _start_send asks about (_watch_replies)
        self._watch_replies()
        self._lane_replies: collections.deque[bytes] = collections.deque()
        self._load: tuple[Load, float] | None = None  # the last report, when
        self._sent_since = 0  # requests sent after that report
        self._sent_at = float("-inf")
        self._lost: str | None = None  # a refusal read between transfers, a lost connection
        self._spare: _Spare | None = None
        self._inline_wire = False  # the ingress reads binary inline headers on the lane
        self._commit_wire = False  # ... and binary commit headers (relay/inline_wire.py)
        self._planner = Planner()  # payloads shaped like recent ones are not laid out again
        self._limit_on_lane = False  # `inline_max` is the backend's, for while the lane is up
        self._last_staged = -SPARE_STREAM_S  # when the last staged payload was sent
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
            self._inline_wire = welcome.get("inline_wire") == inline_wire.WIRE_VERSION
            self._commit_wire = welcome.get("commit_wire") == inline_wire.WIRE_VERSION
            self._open_lane(welcome)
            if inline_max is None and self._lane is not None:
                # the backend's limit only on a lane, where a full inline budget stalls this
                # sender (over ZMQ an inline payload the budget cannot take is dropped)
                self.inline_max = self.inline_limit(welcome)
                self._limit_on_lane = True
        except BaseException:
            self._close_sockets()
            raise

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
        poll of the lane took ~7.5), and only what is there is read (`_check_session`)."""
        if self.closed:
            self._check_open()  # raises
        if self._lost is not None or self._lane_replies or zmq.zmq_poll(self._watch, 0):
            self._check_session()
        self._sent_since += 1
        self._sent_at = time.monotonic()

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
            self._lost = "the connection was lost (the receiver restarted or went away)"
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
                self._lost = _goodbye(msg)
            elif msg["op"] == "grant" and isinstance(msg.get("xid"), int):
                self._control(proto.pack("cancel", xid=msg["xid"]))
            elif isinstance(spare, dict) and isinstance(spare.get("xid"), int):
                self._control(proto.pack("cancel", xid=spare["xid"]))  # a late ack's spare

    def _pending_reply(self) -> bytes | None:
        """The next reply header already here, else None (never waits): replies on the
        control lane, if this sender has one, then ZMQ (`load`s always come that way)."""
        if self._lane_control and not self._lane_replies and self._lane_poll.poll(0):
            try:
                frames = self._lane_reader.read()
            except lane.LaneError:
                self._close_lane()  # the next transfer goes over ZMQ, or fails
            else:
                self._lane_replies.extend(bytes(f.header) for f in frames)
        if self._lane_replies:
            return self._lane_replies.popleft()
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

    def _open_lane(self, welcome: dict[str, Any]) -> None:
        """Take the inline lane the ingress offers (relay/lane.py); without one, or when it
        cannot be reached, inline payloads go over ZMQ."""
        ident = welcome.get("lane_id")
        if not isinstance(ident, str) or self.inline_max == 0 or not self.use_lane:
            return
        sock = None
        try:
            sock = lane.connect(self.endpoint, welcome, min(self.timeout, LANE_CONNECT_S))
            if sock is None:
                return
            mac = auth.mac(self._key, "lane", ident)
            hello = proto.pack("lane", id=ident, control=self.control_on_lane, mac=mac)
            lane.send_frame(sock, hello, b"")
            if sock.recv(1) != lane.READY:
                raise OSError("the ingress did not take the lane")
            lane.set_send_timeout(sock, self.timeout)
        except OSError as exc:
            log.info("%s relay to %s sends inline over ZMQ: %s", self.kind, self.endpoint, exc)
            if sock is not None:
                sock.close()
            return
        self._lane = sock
        self._lane_reader = lane.LaneReader(sock)
        self._lane_poll = select.poll()
        self._lane_poll.register(sock, select.POLLIN)
        self._lane_control = self.control_on_lane
        self._watch_replies()

    def _watch_replies(self) -> None:
        """What `_start_send` polls: the ZMQ socket and its monitor (level-triggered: zmq_poll
        asks each for its EVENTS), and the lane where replies come on it."""
        self._watch = [(self._sock, _POLLIN), (self._monitor, _POLLIN)]
        if self._lane is not None and self._lane_control:
            self._watch.append((self._lane.fileno(), _POLLIN))

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
        if self._inline(tensors, nbytes):  # the slot's bytes travel with the message
            frame, at = self._inline_frame(request_id, tree, placed, tensors, meta)
        with self._lock:
            self._start_send()
            try:
                if (
                    frame is not None
                    and self._lane is not None
                    and self._send_lane(request_id, frame)
                ):
                    return nbytes
                if frame is not None and nbytes <= self.inline_max:  # the lane may have gone
                    manifest = placed.manifest(tree)
                    self._sock.send_multipart(_over_zmq(frame, at, request_id, manifest, meta))
                else:
                    manifest = placed.manifest(tree)
                    self._send_staged(request_id, manifest, placed, tensors, deadline, meta)
                return nbytes
            except zmq.Again:
                raise RelayTimeout(
                    f"receiver at {self.endpoint} is not draining; request {request_id} not sent"
                ) from None

    # ---- reserve, then fill or stream, then commit: for callers that produce the bytes -------
    def reserve(
        self, request_id: str, manifest: Manifest, *, timeout: float | None = None
    ) -> Grant:
        """A slot for `manifest` in the receiver's pool, waiting up to `timeout` s for room
        (RelayTimeout when none came); PeerLost as for `send` (nothing was reserved)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        if manifest.nbytes > self.max_allocation:
            raise RelayError(
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
        placed: Placement,
        tensors: list[torch.Tensor],
        meta: Mapping[str, Any] | None,
    ) -> tuple[bytearray, int]:
        """An inline payload's lane frame in one buffer, the slot's bytes written in place
        from the returned offset on: its header binary where the ingress reads that, with
        the layout part encoded once per placement (relay/inline_wire.py), else JSON. Bad
        input (a tree or meta that is not JSON) fails here, before anything is sent."""
        if self._inline_wire and self._lane is not None:
            frame, at = inline_wire.frame(rid, placed.layout_json(), tree, meta, placed.nbytes)
        else:
            header = _json_inline(rid, placed.manifest(tree), meta)
            frame, at = lane.frame_buffer(header, placed.nbytes)
        placed.fill(frame, at, tensors)
        return frame, at

    def _send_lane(self, rid: str, frame: bytearray) -> bool:
        """One frame on the lane, written by one call, waiting at most the sender's `timeout`
        for room (the kernel's send timeout: cheaper than a deadline per call); False when
        the lane broke. A failure cuts the stream mid-frame, which the ingress drops whole,
        and closes the lane. A broken connection took every earlier frame with it, so the
        caller sends this payload over ZMQ, as later ones go (ZMQ queues for a peer that
        comes back), or reserves it when it is over the limit without a lane; a full one
        (the receiver stopped reading) still holds earlier frames this one must not
        overtake: RelayTimeout."""
        assert self._lane is not None
        try:
            lane.send_whole(self._lane, frame)
        except OSError as exc:
            self._close_lane()
            if _full(exc):
                raise RelayTimeout(
                    f"receiver at {self.endpoint} is not draining; request {rid} not sent"
                ) from None
            self._check_session(LOST_GRACE_S)  # the receiver went away: reconnect, not ZMQ
            log.info("%s relay to %s: lane lost (%s); over ZMQ now", self.kind, self.endpoint, exc)
            return False
        self._lane_sent += 1
        return True

    def _lane_frame(self, header: bytes, data: bytes | bytearray = b"") -> OSError | None:
        """Write one frame on the lane and count it; on failure close the lane and return
        the error (the caller decides: time out, fail, or go over ZMQ)."""
        assert self._lane is not None
        try:
            lane.send_frame(self._lane, header, data)
        except OSError as exc:
            self._close_lane()
            return exc
        self._lane_sent += 1
        return None

    def _close_lane(self) -> None:
        if self._lane is not None:
            self._lane.close()
            self._lane = None
            self._lane_control = False
            self._lane_replies.clear()
            self._watch_replies()
            if self._limit_on_lane:  # over ZMQ now: the default again
                self.inline_max = INLINE_THRESHOLD

    def _control(self, header: bytes, *, opens: bool = False) -> None:
        """Send a control message where this sender's replies come from. When the lane is
        broken, a message that `opens` an operation (nothing of it sent yet) goes over
        ZMQ, as everything after it; one in the middle of an operation fails it."""
        if not self._lane_control:
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
        if not self._lane_control:
            if not self._sock.poll(int(timeout * 1000) + 1, zmq.POLLIN):
                return None
            return bytes(self._sock.recv())
        deadline = time.monotonic() + timeout
        while not self._lane_replies:
            remaining = deadline - time.monotonic()  # a partial frame must not extend it
            if remaining <= 0 or not self._lane_poll.poll(int(remaining * 1000) + 1):
                return None
            try:
                frames = self._lane_reader.read()
            except lane.LaneError as exc:
                self._close_lane()
                raise RelayError(
                    f"lost the connection to {self.endpoint} mid-transfer (receiver gone?): {exc}"
                ) from None
            self._lane_replies.extend(bytes(f.header) for f in frames)
        return self._lane_replies.popleft()

    def _inline(self, tensors: list[torch.Tensor], nbytes: int) -> bool:
        """Backend hook: whether a payload goes as one inline message (no pool slot)."""
        return nbytes <= self.inline_max

    def abort(self, request_id: str) -> None:
        """Tell the receiver to free whatever `request_id` holds there."""
        header = proto.pack("abort", rid=request_id)
        with self._lock:
            # on the lane, behind the inline payloads it sent before; else over ZMQ (late
            # arrivals of an aborted request are dropped whichever way they come)
            if self._lane is not None and self._lane_frame(header) is None:
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

    def _send_staged(
        self,
        rid: str,
        manifest: Manifest,
        placed: Placement,
        tensors: list[torch.Tensor],
        deadline: float,
        meta: Mapping[str, Any] | None,
    ) -> None:
        if manifest.nbytes > self.max_allocation:
            raise RelayError(
                f"payload of {manifest.nbytes} B can never fit the receive pool at "
                f"{self.endpoint} (largest block {self.max_allocation} B)"
            )
        spare = self._use_spare(manifest.nbytes)
        if spare is not None:  # granted with the last ack: no reservation round trip
            xid, offset, write_by = spare.xid, spare.offset, spare.use_by
        else:
            xid, offset, write_by = self._reserve(rid, manifest.nbytes, deadline)
        ask = self._ask_spare(manifest.nbytes)
        commit = self._commit_header(rid, xid, offset, manifest, placed, meta, ask)
        before_commit = time.monotonic()  # any spare in the ack is granted after this
        self._transfer(commit, xid, offset, manifest, tensors, write_by)
        reply = self._await(xid, {"ack", "nack"}, deadline, "acknowledgement")
        if reply["op"] == "nack":
            raise RelayError(
                f"receiver at {self.endpoint} rejected request {rid}: {reply.get('reason')}"
            )
        if ask:
            self._keep_spare(reply, ask, before_commit)

    def _commit_header(
        self,
        rid: str,
        xid: int,
        offset: int,
        manifest: Manifest,
        placed: Placement,
        meta: Mapping[str, Any] | None,
        ask: dict[str, int] | None,
    ) -> bytes:
        """A commit's header: binary where it goes on the lane and the ingress reads it
        (no backend fields then); else JSON. A commit never leaves the lane it was built
        for: a lane lost before it is sent fails the transfer (`_control`)."""
        if self.binary_commit and self._commit_wire and self._lane_control:
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
        lanes = {"lane": self._lane_sent} if self._lane and not self._lane_control else {}
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
        if grant["op"] == "deny" and grant.get("timeout") is True:
            raise no_room
        if grant["op"] == "deny":
            raise RelayError(
                f"receiver at {self.endpoint} refused request {rid}: {grant.get('reason')}"
            )
        return xid, proto.nonneg_int(grant, "offset"), granted + self.lease_s / 2

    # ---- spare grants: the next slot, granted with an ack ---------------------------------
    # A sender of medium payloads asks, in each commit, for a slot for its next one
    # (`next {xid, nbytes}`); the ingress grants it in the ack when its pool has room and
    # nobody waits (`spare {xid, offset, lease_s}`, a short lease). The next payload that
    # fits is written there at once and committed: one round trip instead of two. A spare
    # that does not fit, or whose lease is half gone, is cancelled, and the payload
    # reserves as usual; the ingress frees spares nobody committed when their lease ends.

    def _spare_limit(self) -> int:
        """Backend hook: the largest payload that asks for a spare (0: never). Only where
        commits travel on the lane: a reservation there is what keeps a staged payload
        behind the inline ones sent before it, and a spare commit must be ordered too."""
        return 0

    def _ask_spare(self, nbytes: int) -> dict[str, int] | None:
        """Ask only in a stream: when the previous staged payload went moments ago (a
        lone payload leaves no slot held behind it)."""
        now = time.monotonic()
        streaming = now - self._last_staged < SPARE_STREAM_S
        self._last_staged = now
        if not streaming or not 0 < nbytes <= self._spare_limit():
            return None
        return {"xid": next(self._xids), "nbytes": nbytes}

    def _keep_spare(self, ack: dict[str, Any], ask: dict[str, int], before: float) -> None:
        """Hold the spare an ack carries. Its lease is counted from `before` (just before
        the commit went), not from when the ack was read: the ingress granted it after it
        had the commit, so however late this sender reads the ack, writing into the spare
        by half its lease from `before` is always within the lease."""
        spare = ack.get("spare")
        if not isinstance(spare, dict):
            return
        try:
            xid = proto.nonneg_int(spare, "xid")
            offset = proto.nonneg_int(spare, "offset")
            lease = float(proto.field(spare, "lease_s", (int, float)))
        except proto.ProtocolError as exc:
            raise RelayError(f"bad ack from {self.endpoint}: {exc}") from None
        if xid != ask["xid"]:
            raise RelayError(f"bad ack from {self.endpoint}: a spare for another xid")
        self._spare = _Spare(xid, ask["nbytes"], offset, before + min(lease, self.lease_s) / 2)

    def _use_spare(self, nbytes: int) -> _Spare | None:
        """The spare, when it fits `nbytes` and has time left; otherwise it is given back."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        if nbytes <= spare.nbytes and time.monotonic() < spare.use_by:
            return spare
        self._control(proto.pack("cancel", xid=spare.xid), opens=True)
        return None

    def _commit_fields(self) -> dict[str, Any]:
        """Backend hook: extra fields of the commit header."""
        return {}

    def _transfer(
        self,
        commit: bytes,
        xid: int,
        offset: int,
        manifest: Manifest,
        tensors: list[torch.Tensor],
        write_by: float,
    ) -> None:
        """Move the tensors into the granted slot and send `commit`. The receiver frees a grant
        `lease_s` after granting; finishing writes within half of it from receipt of the
        grant leaves the other half for the grant's own transit."""
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
                self._lost = _goodbye(msg)
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
