"""The receiving side of striped tcp payloads: parallel streams that land in the slot.

A tcp receiver whose pool is host memory offers stripe connections in its welcome
(`stripes {port, id, max}`). A sender opens up to `max` plain TCP connections there, each
authenticated before anything is kept for it:

    ingress                                       sender
    (accept: a 32-char nonce, nothing else)  -->
                                             <--  u32 length + {"op": "stripe", id, index,
                                                  mac: H(K, "stripe", id, index, nonce)}
    one READY byte; a thread now reads it    -->

A connection that says nothing valid in time, says too much, or proves no key is closed
by the acceptor (stripe_accept.py) and gets no thread, no buffer and no slot. The `id`
is the sender's, from its authenticated welcome; the nonce makes each hello good for its
own connection only.

A payload's commit (on the control lane, else over ZMQ) carries `stripes: n`; stripe `i` of its
plan (stripe_plan.py) then comes on connection `i`, as `HEADER` (xid, length) and its
bytes, which that connection's thread `recv_into`s straight at their place in the slot
(`recv_into` releases the GIL: the stripes land at once, one core each). When every
stripe is in, the I/O thread delivers the payload and acks it (`Host.call`).

Failure is whole: a stripe of the wrong length, a connection closed or broken mid-payload
(its sender's or ours), a sender forgotten, or a transfer stalled for a lease fail the
payload; every connection of that sender is shut down, and once no thread writes into
the slot any more it is freed and the commit nacked. A partly written slot is never
delivered; the sender sends the payload again over ZMQ (send.py).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from disagg_runtime.relay import auth, lane
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.backends.tcp import stripe_plan
from disagg_runtime.relay.backends.tcp.stripe_accept import Acceptor
from disagg_runtime.relay.landing import Host
from disagg_runtime.relay.ledger import Reservation
from disagg_runtime.wire.codec import CodecError
from disagg_runtime.wire.manifest import Manifest

log = logging.getLogger(__name__)
STRIPE_HELLO = frozenset({"stripe"})
MAX_CONNECTIONS = 64  # authenticated stripe connections per ingress (one thread each)


@dataclass(eq=False)
class Striped:
    """One striped payload landing: its slot, its plan (pool offset, length per segment),
    which stripes are in, how many threads write into the slot now."""

    ident: bytes
    xid: int
    grant: Reservation
    slot: int
    manifest: Manifest
    meta: dict[str, Any] | None
    targets: list[list[tuple[int, int]]]
    lengths: list[int]
    deadline: float
    done: set[int] = field(default_factory=set)
    claimed: set[int] = field(default_factory=set)
    writing: int = 0
    error: str | None = None
    ending: bool = False  # its end is handed to the I/O thread


@dataclass(eq=False)
class StripeConn:
    sock: socket.socket
    ident: bytes
    index: int


def targets_of(slot: int, manifest: Manifest, streams: int) -> list[list[tuple[int, int]]]:
    """(pool offset, length) of each segment of each stripe of a payload in `slot`."""
    plan = stripe_plan.stripe_plan([t.nbytes for t in manifest.tensors], streams)
    offsets = manifest.offsets
    return [[(slot + offsets[i] + start, n) for i, start, n in stripe] for stripe in plan]


class StripeHub:
    """Stripe connections and the striped payloads landing through them (see the module
    docstring). `offer`, `start`, `expire`, `forget` and `close` run on the I/O thread;
    the acceptor and the connections' threads end payloads through `Host.call`."""

    def __init__(self, host: Host, listener: socket.socket, max_streams: int) -> None:
        self.host = host
        self.max_streams = max_streams
        self.refusals = auth.Refusals(log, f"tcp stripes at {host.endpoint}")
        self._cond = threading.Condition()
        self._tokens: dict[str, bytes] = {}  # offered in welcomes: whose stripes they open
        self._token_of: dict[bytes, str] = {}
        self._conns: dict[bytes, dict[int, StripeConn]] = {}  # by sender, by index
        self._transfers: dict[bytes, Striped] = {}  # one at a time per sender
        self._closed = False
        self.landed = 0  # striped payloads whose every stripe came in
        self.failed = 0  # striped payloads failed (slot freed, commit nacked)
        self._acceptor = Acceptor(listener, self._admit, self.refusals)

    # ---- the I/O thread -------------------------------------------------------------------
    def offer(self, ident: bytes) -> dict[str, Any]:
        """The welcome's `stripes` for sender `ident` (a fresh id; its old connections go)."""
        self.forget(ident)
        token = auth.nonce()
        with self._cond:
            self._tokens[token] = ident
            self._token_of[ident] = token
        return {"port": self._acceptor.port, "id": token, "max": self.max_streams}

    def start(
        self,
        ident: bytes,
        xid: int,
        grant: Reservation,
        slot: int,
        manifest: Manifest,
        meta: dict[str, Any] | None,
        streams: int,
    ) -> None:
        """A striped commit: its stripes may land now. ProtocolError (this sender's
        stripe connections shut, so none waits for it) when it cannot."""
        try:
            if not 1 <= streams <= self.max_streams:
                most = self.max_streams
                raise proto.ProtocolError(
                    f"{stripe_plan.FAILED}: {streams} streams, not within [1, {most}]"
                )
            targets = targets_of(slot, manifest, streams)
            with self._cond:
                conns = self._conns.get(ident, {})
                missing = [i for i in range(len(targets)) if i not in conns]
                if missing:
                    raise proto.ProtocolError(
                        f"{stripe_plan.FAILED}: stripe connection {missing[0]} is not open"
                    )
                if ident in self._transfers:
                    raise proto.ProtocolError(
                        f"{stripe_plan.FAILED}: a payload of this sender is landing"
                    )
                self._transfers[ident] = Striped(
                    ident,
                    xid,
                    grant,
                    slot,
                    manifest,
                    meta,
                    targets,
                    [sum(n for _, n in t) for t in targets],
                    time.monotonic() + self.host.lease_s,
                )
                self._cond.notify_all()
        except BaseException:
            self._shut(ident)
            raise

    def due(self) -> float | None:
        with self._cond:
            return min((t.deadline for t in self._transfers.values() if not t.ending), default=None)

    def expire(self, now: float) -> None:
        with self._cond:
            stalled = [t for t in self._transfers.values() if not t.ending and t.deadline <= now]
            for t in stalled:
                self._fail(t, f"transfer for request {t.grant.rid} stalled; slot freed")
        for t in stalled:
            self._shut(t.ident)

    def forget(self, ident: bytes) -> None:
        """`ident` is no longer a peer: its id, its connections and its payload go."""
        with self._cond:
            token = self._token_of.pop(ident, None)
            if token is not None:
                self._tokens.pop(token, None)
            t = self._transfers.get(ident)
            if t is not None and not t.ending:
                self._fail(t, "the sender went away")
        self._shut(ident)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idents = list(self._conns)
            self._cond.notify_all()
        for ident in idents:
            self._shut(ident)
        self._acceptor.close()

    def connections(self) -> int:
        """Authenticated stripe connections open now."""
        with self._cond:
            return sum(len(c) for c in self._conns.values())

    def writing(self) -> int:
        """Stripes being received into slots now."""
        with self._cond:
            return sum(t.writing for t in self._transfers.values())

    def _end(self, t: Striped) -> None:
        """On the I/O thread, once no thread writes into the slot: deliver or free + nack."""
        with self._cond:
            if self._transfers.get(t.ident) is t:
                del self._transfers[t.ident]
                self._cond.notify_all()  # the sender's next stripes may be waiting
        host = self.host
        if t.error is not None:
            self.failed += 1
            host.ledger.free(t.slot)
            host.reject(t.ident, t.xid, f"{stripe_plan.FAILED}: {t.error}")
            return
        self.landed += 1
        try:
            host.finish(t.ident, t.xid, t.grant.rid, t.slot, t.manifest, t.meta)
        except (proto.ProtocolError, CodecError) as exc:  # its bytes are no payload (slot freed)
            host.reject(t.ident, t.xid, str(exc))

    # ---- under the lock, from any thread --------------------------------------------------
    def _fail(self, t: Striped, reason: str) -> None:
        if t.error is None:
            t.error = reason
        self._settle(t)

    def _settle(self, t: Striped) -> None:
        """Hand the payload's end to the I/O thread once it is decided and nobody writes."""
        if t.ending:
            return
        complete = len(t.done) == len(t.targets)
        if complete or (t.error is not None and t.writing == 0):
            t.ending = True
            self.host.call(lambda: self._end(t))

    def _shut(self, ident: bytes) -> None:
        """Shut every stripe connection of `ident` (their threads end and close them)."""
        with self._cond:
            conns = list(self._conns.get(ident, {}).values())
            self._cond.notify_all()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    # ---- a connection's thread ------------------------------------------------------------
    def _serve(self, conn: StripeConn) -> None:
        reason = f"stripe connection {conn.index} closed mid-payload"
        try:
            head = bytearray(stripe_plan.HEADER.size)
            while _recv_whole(conn.sock, memoryview(head)):
                xid, length = stripe_plan.HEADER.unpack(head)
                t = self._claim(conn, xid, length)
                if t is None:
                    return
                ok = False
                try:
                    memory = self.host.memory
                    for offset, n in t.targets[conn.index]:
                        if not _recv_whole(conn.sock, memory.chunk_buffer(offset, n)):
                            return
                    ok = True
                finally:
                    self._release(t, conn, ok, reason)
        except OSError as exc:
            reason = f"stripe connection {conn.index} failed mid-payload: {exc}"
        finally:
            self._drop(conn, reason)

    def _claim(self, conn: StripeConn, xid: int, length: int) -> Striped | None:
        """The payload stripe `conn.index` of `xid` belongs to, once its commit is in (None:
        it never came within a lease, or the stripe is wrong: the sender's connections are
        shut)."""
        deadline = time.monotonic() + self.host.lease_s
        with self._cond:
            while True:
                if self._closed or self._conns.get(conn.ident, {}).get(conn.index) is not conn:
                    return None
                t = self._transfers.get(conn.ident)
                if t is not None and not t.ending:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    t = None
                    break
                self._cond.wait(remaining)
            if t is None:
                problem = f"stripe for xid {xid} without its commit in time"
            elif t.xid != xid:
                problem = f"stripe {conn.index} is for xid {xid}, not {t.xid}"
            elif conn.index >= len(t.targets) or conn.index in t.claimed:
                problem = f"stripe {conn.index} of xid {xid} is not expected"
            elif length != t.lengths[conn.index]:
                problem = f"stripe {conn.index}: {length} B, expected {t.lengths[conn.index]} B"
            elif t.error is not None:
                problem = t.error
            else:
                t.claimed.add(conn.index)
                t.writing += 1
                return t
            if t is not None:
                self._fail(t, problem)
        log.warning("tcp stripes at %s: %s", self.host.endpoint, problem)
        self._shut(conn.ident)
        return None

    def _release(self, t: Striped, conn: StripeConn, ok: bool, reason: str) -> None:
        with self._cond:
            t.writing -= 1
            if ok:
                t.done.add(conn.index)
            elif t.error is None:
                t.error = reason
            self._settle(t)
        if not ok:
            self._shut(conn.ident)

    def _drop(self, conn: StripeConn, reason: str) -> None:
        """`conn` ended: its sender's payload landing now cannot complete unless its stripe
        was in; every other connection of that sender is shut too."""
        with self._cond:
            conns = self._conns.get(conn.ident)
            if conns is not None and conns.get(conn.index) is conn:
                del conns[conn.index]
                if not conns:
                    del self._conns[conn.ident]
            t = self._transfers.get(conn.ident)
            if t is not None and not t.ending and conn.index not in t.done:
                self._fail(t, reason)
            self._cond.notify_all()
        self._shut(conn.ident)
        conn.sock.close()

    # ---- the acceptor's thread ------------------------------------------------------------
    def _admit(self, sock: socket.socket, nonce: str, header: bytes) -> str | None:
        """A stranger's hello: why it is refused, or None (it is a stripe connection now)."""
        try:
            hello = proto.unpack(header, STRIPE_HELLO)
            token = proto.field(hello, "id", str)
            index = proto.nonneg_int(hello, "index")
        except proto.ProtocolError as exc:
            return str(exc)
        if not self.host.verify(hello.get("mac"), "stripe", token, str(index), nonce):
            return "unknown id or bad mac"
        with self._cond:
            ident = self._tokens.get(token)
            if ident is None:
                return "unknown id or bad mac"
            if index >= self.max_streams:
                return f"index {index} is over the limit of {self.max_streams} streams"
            total = sum(len(c) for c in self._conns.values())
            old = self._conns.get(ident, {}).get(index)
            if self._closed or total - (old is not None) >= MAX_CONNECTIONS:
                return f"{total} stripe connections open"
            try:
                sock.setblocking(True)
                sock.send(lane.READY)
            except OSError as exc:
                return f"hello not answered: {exc}"
            conn = StripeConn(sock, ident, index)
            self._conns.setdefault(ident, {})[index] = conn
        if old is not None:  # the sender replaced it: whatever it carried failed with it
            with contextlib.suppress(OSError):
                old.sock.shutdown(socket.SHUT_RDWR)
        threading.Thread(
            target=self._serve, args=(conn,), name="disagg-tcp-stripe", daemon=True
        ).start()
        return None


def _recv_whole(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `sock`; False at EOF."""
    got, size = 0, view.nbytes
    while got < size:
        n = sock.recv_into(view[got:] if got else view)
        if n == 0:
            return False
        got += n
    return True
