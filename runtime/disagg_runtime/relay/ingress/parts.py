"""What the parts of the ingress share: its state, and the calls one part makes on another.

`Ingress` (loop.py) is one object built from four parts, each a module of one idea: the
loop (thread, poll, the ZMQ ROUTER, replies), the lanes (lanes.py), the per-sender
session (session.py: handshake, welcome, load reports) and the operations (ops.py:
reserve, commit, inline, cancel, abort). They share one I/O thread and its
state, declared here once, so each part is checked (mypy) against the same names; the
methods a part calls on another are declared here too and defined where they belong.

Why parts of one object, not objects holding each other: the four call each other both
ways (a lane frame runs an op; an op replies over the sender's lane; forgetting a peer
closes its lane and drops its reservations), on one thread, over one state (socket,
ledger, lanes, peers). As objects each would hold the others (a cycle of references) or a
shared context that is this class again, and the inline hot path (a few microseconds a
message) would pay an attribute hop per call. Where independence does matter, between
the ingress and each relay kind, the seam is an object with a protocol: a backend's
`Landing` and the ingress as its `Host` (relay/landing.py).
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from disagg_core.compat import Compat
from disagg_runtime.memory.intake import Memory
from disagg_runtime.memory.pool import Pool
from disagg_runtime.relay import auth
from disagg_runtime.relay.landing import Landing
from disagg_runtime.relay.ledger import Denial, Message, Reservation, SlotLedger
from disagg_runtime.wire.load import Load
from disagg_runtime.wire.manifest import Manifest

if TYPE_CHECKING:  # types only: lanes.py defines the connection
    import socket

    from disagg_runtime.relay.ingress.lanes import LaneConn


class IngressParts:
    """The state every part of the ingress reads (set by `Ingress.__init__`)."""

    endpoint: str
    lease_s: float
    inline_budget: int
    memory: Memory
    compat: Compat | None
    role: str
    refusals: auth.Refusals
    last_message_at: float
    _pool: Pool
    _ledger: SlotLedger
    _key: bytes
    _sock: Any  # the ZMQ ROUTER (what pyzmq's Context.socket is typed as)
    _poller: zmq.Poller
    _load: Callable[[], Load]
    _on_message: Callable[[Message], None] | None
    _queue: queue.SimpleQueue[Message]
    _commands: queue.SimpleQueue[Callable[[], None]]
    _stop: threading.Event
    _thread: threading.Thread
    _wake_r: int
    _wake_w: int
    # lanes (lanes.py)
    _lane_listener: socket.socket | None
    _lane_offer: dict[str, Any]
    _lanes: dict[int, LaneConn]  # by file descriptor
    _by_sender: dict[bytes, LaneConn]  # tied lanes, by their sender's identity
    _lane_tokens: dict[str, bytes]  # offered in welcomes, not yet used
    _lane_check: float
    _paused: dict[int, LaneConn]  # lanes not polled for want of inline budget, by fd
    # sessions (session.py)
    _challenges: collections.OrderedDict[bytes, tuple[str, str, dict[str, Any]]]
    _peers: collections.OrderedDict[bytes, None]
    _active_at: dict[bytes, float]  # peers' last message (they get `load`s)
    _load_due: float
    _load_last: tuple[dict[str, Any] | None, float]
    _kinds: dict[bytes, str]  # each peer's relay kind, from its hello
    _landings: dict[str, Landing]  # by relay kind, made at its first hello
    _closing: str | None  # the goodbye's reason, once said
    # operations (ops.py)
    _taking: dict[bytes, Landing]  # senders whose next messages a landing takes (loop.py)
    _rejected: int
    _overloaded: int
    _spares_used: int
    # the loop's bookkeeping (loop.py)
    _freed: bool
    _dirty: bool
    _due: float

    @property
    def pool(self) -> Pool:
        return self._pool

    @property
    def ledger(self) -> SlotLedger:
        return self._ledger

    # ---- calls across parts: each defined in the part named ----------------------------
    def _reply(self, ident: bytes, op: str, **fields: Any) -> bool:  # loop
        raise NotImplementedError

    def _send_zmq(self, ident: bytes, header: bytes) -> bool:  # loop
        raise NotImplementedError

    def _deny(self, denial: Denial) -> None:  # ops
        raise NotImplementedError

    def _drain(self) -> None:  # loop
        raise NotImplementedError

    def _release(self, msg: Message) -> None:  # loop
        raise NotImplementedError

    def _abort_delivered(self, rid: str) -> None:  # loop
        raise NotImplementedError

    def _close_lane(self, conn: LaneConn) -> None:  # lanes
        raise NotImplementedError

    def _lane_token(self, ident: bytes) -> str:  # lanes
        raise NotImplementedError

    def _load_field(self) -> dict[str, Any]:  # session
        raise NotImplementedError

    def _forget(self, ident: bytes) -> None:  # session
        raise NotImplementedError

    def _handshake(self, ident: bytes, msg: dict[str, Any]) -> None:  # session
        raise NotImplementedError

    def _stranger(self, ident: bytes) -> None:  # session
        raise NotImplementedError

    def _operate(self, ident: bytes, msg: dict[str, Any]) -> None:  # ops: the op table
        raise NotImplementedError

    def _nack_commit(self, ident: bytes, msg: dict[str, Any], exc: Exception) -> None:  # ops
        raise NotImplementedError

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
    ) -> None:  # ops
        raise NotImplementedError

    def _hand_over(self, msg: Message) -> None:  # ops
        raise NotImplementedError

    def _inline(
        self, msg: dict[str, Any], manifest: Any, data: memoryview, got: int, charge: int
    ) -> None:  # ops
        raise NotImplementedError

    def _on_cancel(self, ident: bytes, msg: dict[str, Any]) -> None:  # ops
        raise NotImplementedError

    # ---- Host (relay/landing.py): what landings use, in ops.py and loop.py -------------
    def commit(self, ident: bytes, msg: dict[str, Any]) -> None:  # ops
        raise NotImplementedError

    def claim(self, ident: bytes, xid: int, msg: dict[str, Any]) -> tuple[Reservation, int]:
        raise NotImplementedError  # ops

    def finish(
        self,
        ident: bytes,
        xid: int,
        rid: str,
        slot: int,
        manifest: Manifest,
        meta: dict[str, Any] | None,
        ask: Any = None,
    ) -> None:  # ops
        raise NotImplementedError

    def reject(self, ident: bytes, xid: int, reason: str) -> None:  # ops
        raise NotImplementedError

    def expect_frames(self, ident: bytes, landing: Landing | None) -> None:  # loop
        raise NotImplementedError

    def read_into(self, buffer: Any) -> int:  # loop
        raise NotImplementedError

    def more_frames(self) -> bool:  # loop
        raise NotImplementedError

    def call(self, fn: Callable[[], None]) -> None:  # loop
        raise NotImplementedError

    def verify(self, given: object, label: str, *parts: str) -> bool:  # loop
        raise NotImplementedError
