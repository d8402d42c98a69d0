"""What a sender and its receiver agreed in the welcome: one object instead of seven flags.

A `Sender`'s backend says what it would like (class attributes: `control_on_lane`, run
the whole protocol on the lane; `binary_commit`, its commits carry no backend fields);
the receiver's welcome says what it offers (a lane, binary inline and commit headers, a
backend's inline limit). `Session` is the outcome, and what is left of it as the lane
comes and goes:

    lane          the inline lane's socket (relay/lane.py), or None: everything over ZMQ
    control       reservations, commits and their replies travel on the lane too
    inline_max    payloads up to this many tensor bytes go inline (no slot)
    inline_wire   inline headers are binary on the lane (relay/inline_wire.py)
    commit_wire   commits are binary on the lane (only where `binary_commit` and `control`)
    inline_ack    an inline payload over ZMQ waits for the receiver's verdict: `ack`, or
                  `overloaded` (its inline budget is full: the payload is reserved instead)
    spare         a credit: a slot granted ahead with the last ack, while a stream of
                  medium payloads lasts (see "credit" below, and relay/credit.py)

Losing the lane drops `control` and a backend's lane-only `inline_max` (back to
INLINE_THRESHOLD: over ZMQ an inline payload the receiver's budget cannot take is
answered `overloaded` and reserved after all, a round trip more; on the lane it stalls
its sender); the encodings stay agreed but are used
only on a lane. A sender holds one session for its life: a lost connection is a new
sender (PeerLost), a lost lane only a smaller session.

Credit (the wire calls it a spare): a sender of medium payloads in a stream asks, in each
commit, for a slot for its next one (`next {xid, nbytes}`); the ingress grants it in the
ack within its credit bounds (`spare {xid, offset, lease_s}`, a short lease). The next
payload that fits is written there at once and committed: no reservation round trip. A
credit that does not fit, or whose lease is half gone, is cancelled and the payload
reserves as usual. Where commits share the control lane (shm, nixl) credit is used; for
shm (`credit_below_inline`: nixl's per-transfer registration cost more than the lane's
copies at 64 KiB, as measured before nixl cached its registrations) a stream's payloads
from CREDIT_MIN up to the inline limit go through credit too, written once into the
receiver's pool instead of copied through the lane; the first of a stream reserves (and
asks), and after an ack that granted nothing they go inline again for CREDIT_RETRY_S.
"""

from __future__ import annotations

import collections
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from disagg_runtime.relay import auth, inline_wire, lane
from disagg_runtime.relay import protocol as proto

INLINE_THRESHOLD = 64 * 1024  # inline up to this unless a backend's `inline_limit` says more
LANE_CONNECT_S = 2.0  # a filtered port must not stall start-up long
SPARE_STREAM_S = 0.1  # a payload asks for credit when the one before went this recently
CREDIT_MIN = 32 * 1024  # payloads from this size up may go through credit instead of inline
CREDIT_RETRY_S = 1.0  # after an ack that granted no credit, inline-sized ones wait this long


@dataclass(frozen=True)
class Spare:
    """A slot granted ahead, with an ack: usable for `nbytes` until `use_by`."""

    xid: int
    nbytes: int
    offset: int
    use_by: float


class Session:
    """The terms a sender holds with its receiver (see the module docstring)."""

    def __init__(
        self,
        inline_max: int,
        *,
        inline_wire: bool = False,
        commit_wire: bool = False,
        inline_ack: bool = False,
    ):
        self.inline_max = inline_max
        self.inline_wire = inline_wire
        self.commit_wire = commit_wire
        self.inline_ack = inline_ack
        self.lane: socket.socket | None = None
        self.control = False
        self.sent = 0  # frames written on the lane (the ingress counts those it took)
        self.replies: collections.deque[bytes] = collections.deque()  # read from the lane
        self.spare: Spare | None = None
        self._lane_limit = False  # `inline_max` is the backend's, for while the lane is up
        self._reader: lane.LaneReader | None = None
        self._poll = select.poll()
        self._last_send = -SPARE_STREAM_S  # when the last payload was sent (`note_send`)
        self.streaming = False  # the payload being sent follows another closely
        self._refused_at = -CREDIT_RETRY_S  # when an ack last granted no credit asked for

    @classmethod
    def agreed(cls, welcome: dict[str, Any], inline_max: int | None) -> Session:
        """The encodings the welcome offers; `inline_max` the caller's, else the default
        until a lane is up (`open_lane`)."""
        return cls(
            INLINE_THRESHOLD if inline_max is None else inline_max,
            inline_wire=welcome.get("inline_wire") == inline_wire.WIRE_VERSION,
            commit_wire=welcome.get("commit_wire") == inline_wire.WIRE_VERSION,
            inline_ack=welcome.get("inline_ack") == proto.INLINE_ACK_VERSION,
        )

    # ---- the lane -------------------------------------------------------------------------
    def open_lane(
        self,
        endpoint: str,
        welcome: dict[str, Any],
        *,
        key: bytes,
        timeout: float,
        control: bool,
        lane_limit: int | None,
    ) -> None:
        """Take the inline lane the welcome offers; raise OSError when it cannot be reached
        (inline payloads then go over ZMQ). `lane_limit`: the backend's inline limit for
        this receiver, held while the lane is up (None: the caller's)."""
        ident = welcome.get("lane_id")
        if not isinstance(ident, str) or self.inline_max == 0:
            return
        sock = lane.connect(endpoint, welcome, min(timeout, LANE_CONNECT_S))
        if sock is None:
            return
        try:
            mac = auth.mac(key, "lane", ident)
            lane.send_frame(sock, proto.pack("lane", id=ident, control=control, mac=mac), b"")
            if sock.recv(1) != lane.READY:
                raise OSError("the ingress did not take the lane")
            lane.set_send_timeout(sock, timeout)
        except OSError:
            sock.close()
            raise
        self.lane = sock
        self._reader = lane.LaneReader(sock)
        self._poll.register(sock, select.POLLIN)
        self.control = control
        if lane_limit is not None:
            # the backend's limit only on a lane, where a full inline budget stalls this
            # sender (over ZMQ one the budget cannot take costs a verdict and a reservation)
            self.inline_max = lane_limit
            self._lane_limit = True

    def close_lane(self) -> None:
        if self.lane is None:
            return
        self._poll.unregister(self.lane)
        self.lane.close()
        self.lane = None
        self._reader = None
        self.control = False
        self.replies.clear()
        if self._lane_limit:  # over ZMQ now: the default again
            self.inline_max = INLINE_THRESHOLD
            self._lane_limit = False

    def write(self, frame: bytearray) -> OSError | None:
        """One whole frame on the lane, counted; the error when it failed (the caller
        closes the lane and decides: time out, fail, or go over ZMQ)."""
        assert self.lane is not None
        try:
            lane.send_whole(self.lane, frame)
        except OSError as exc:
            return exc
        self.sent += 1
        return None

    def write_frame(self, header: bytes, data: bytes | bytearray = b"") -> OSError | None:
        """A header (and data) as one lane frame, as `write`."""
        assert self.lane is not None
        try:
            lane.send_frame(self.lane, header, data)
        except OSError as exc:
            return exc
        self.sent += 1
        return None

    def readable(self, timeout_ms: int) -> bool:
        """Whether the control lane has bytes to read within `timeout_ms`."""
        return bool(self._poll.poll(timeout_ms))

    def read_replies(self) -> None:
        """Read what the lane holds into `replies`; lane.LaneError when it broke."""
        assert self._reader is not None
        self.replies.extend(bytes(f.header) for f in self._reader.read())

    # ---- spare grants ---------------------------------------------------------------------
    def note_send(self) -> None:
        """A payload is on its way: note whether it follows the one before closely."""
        now = time.monotonic()
        self.streaming = now - self._last_send < SPARE_STREAM_S
        self._last_send = now

    def wants_credit(self, nbytes: int, limit: int) -> bool:
        """Whether a payload the inline limit admits goes through credit instead: from
        CREDIT_MIN up to `limit` (0: never), into a credit held that fits, or, in a
        stream, to be granted one (unless an ack granted none moments ago)."""
        if not CREDIT_MIN <= nbytes <= limit:
            return False
        now = time.monotonic()
        spare = self.spare
        if spare is not None:
            return nbytes <= spare.nbytes and now < spare.use_by
        return self.streaming and now - self._refused_at >= CREDIT_RETRY_S

    def ask_spare(self, nbytes: int, limit: int, xids: Iterator[int]) -> dict[str, int] | None:
        """The `next` a commit carries: only in a stream (the previous payload went moments
        ago; a lone payload leaves no slot held behind it) and up to `limit`."""
        if not self.streaming or not 0 < nbytes <= limit:
            return None
        return {"xid": next(xids), "nbytes": nbytes}

    def keep_spare(
        self, ack: dict[str, Any], ask: dict[str, int], before: float, lease_s: float
    ) -> None:
        """Hold the spare an ack carries. Its lease is counted from `before` (just before
        the commit went), not from when the ack was read: the ingress granted it after it
        had the commit, so however late the ack is read, writing into the spare by half
        its lease from `before` is always within the lease. ProtocolError if malformed."""
        spare = ack.get("spare")
        if not isinstance(spare, dict):
            self._refused_at = time.monotonic()
            return
        xid = proto.nonneg_int(spare, "xid")
        offset = proto.nonneg_int(spare, "offset")
        lease = float(proto.field(spare, "lease_s", (int, float)))
        if xid != ask["xid"]:
            raise proto.ProtocolError("a spare for another xid")
        self.spare = Spare(xid, ask["nbytes"], offset, before + min(lease, lease_s) / 2)

    def take_spare(self, nbytes: int) -> tuple[Spare | None, Spare | None]:
        """(the spare to use for `nbytes`, or None; the spare to give back, or None)."""
        spare, self.spare = self.spare, None
        if spare is None:
            return None, None
        if nbytes <= spare.nbytes and time.monotonic() < spare.use_by:
            return spare, None
        return None, spare
