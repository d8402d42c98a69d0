"""Each sender's session: who it is, what it is told, and how busy this role is.

Nothing is given before identity (relay/auth.py): a connection that has not proven the
peer key gets a challenge, a refusal, or nothing; its frames are read only up to a small
handshake size and dropped. An authenticated peer gets its welcome (the pool, the lane
offer, its relay kind's fields from that kind's `Landing`, the load, compat, role), with
a mac over both nonces and its fields. Peers are remembered up to MAX_PEERS, the least
recently active forgotten first (with what they hold).

Load reports (`load`, wire/load.py): in the welcome, on every grant and ack, and every
`LOAD_EVERY_S` to the senders active in the last `LOAD_ACTIVE_S` or waiting for room. A
ROUTER does not say when a peer's connection goes; a reply to it then fails
(ROUTER_MANDATORY), and the peer is forgotten with what it waits for (loop.py `_send_zmq`):
so a sender that left is found within a keepalive (`LOAD_KEEPALIVE_S`), and a grant for
it is freed at once instead of holding its slot for a lease.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from disagg_runtime.relay import auth, inline_wire, registry
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.ingress.parts import IngressParts
from disagg_runtime.relay.landing import Landing
from disagg_runtime.wire.load import Load

log = logging.getLogger(__name__)
MAX_PEERS = 4096  # authenticated senders remembered (least recently active forgotten first)


class Sessions(IngressParts):
    """Handshakes, welcomes, peers and load reports (see the module docstring)."""

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
        self._taking.pop(ident, None)
        kind = self._kinds.pop(ident, None)
        landing = self._landings.get(kind) if kind is not None else None
        if landing is not None:
            landing.forget(ident)
        conn = self._by_sender.get(ident)
        if conn is not None:
            self._close_lane(conn)

    def _welcome(self, ident: bytes, msg: dict[str, Any], theirs: str, ours: str) -> None:
        fields = {
            "pool": self.pool.name,
            "pool_device": self.pool.backing.device,  # where staged payloads land
            "pool_size": self.pool.allocator.capacity,
            "max_allocation": self.pool.allocator.max_allocation,
            "lease_s": self.lease_s,
            "inline_ack": proto.INLINE_ACK_VERSION,
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
        # and to those whose reservations wait (they read their replies): a sender that
        # left is found so (`_send_zmq`), its reservations dropped before they are granted
        waiting = self._ledger.pending_senders().difference(self._active_at)
        if not self._active_at and not waiting:
            return
        fields = self._load_field()
        last, sent_at = self._load_last
        if fields.get("load") == last and now - sent_at < proto.LOAD_KEEPALIVE_S:
            return
        self._load_last = (fields.get("load"), now)
        header = proto.pack("load", **fields)
        for ident in [*self._active_at, *waiting]:
            self._send_zmq(ident, header)

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

    def _say_goodbye(self, reason: str) -> None:
        self._closing = reason
        for ident in list(self._peers):
            self._reply(ident, "goodbye", reason=reason)
