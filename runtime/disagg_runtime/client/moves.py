"""Request migration at the first sender: requests that a role reports lost (it drained
before starting them, or a replica they went to died) or whose entry replica this client
found gone are resent whole, as a new attempt with a fresh id, to a live replica, or failed
saying why (routing/migration.py decides; the old attempt is aborted, so whatever a role
still holds of it lets go). Reports come on the ingress's thread and are acted on by the
client's control thread (resending is network I/O)."""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Any, Protocol

from disagg_runtime.client.errors import RequestFailed, failed
from disagg_runtime.client.pending import Pending
from disagg_runtime.relay import RelayError
from disagg_runtime.routing import migration
from disagg_runtime.routing.inflight import InFlight, Sent
from disagg_runtime.routing.peers import PeerSet
from disagg_runtime.routing.relays import RelayCache
from disagg_runtime.wire.envelope import Meta, Reply

BACKLOG = 4096  # reports waiting for the control thread; more are dropped (logged)
log = logging.getLogger(__name__)


class Owner(Protocol):
    """What moving a request uses of its client (client/submit.py `Client`)."""

    exits: frozenset[str]
    reply: Reply
    relays: RelayCache
    entries: list[PeerSet]
    _pending: dict[str, Pending]
    _lock: threading.Lock

    def _send(self, peers: PeerSet, meta: Meta, payload: Any) -> None: ...

    def _abort(self, rid: str) -> None: ...

    def _finish(
        self, rid: str, *, result: Any = None, exc: BaseException | None = None
    ) -> None: ...


class Moves:
    def __init__(self, owner: Owner, policy: migration.Policy) -> None:
        self.owner = owner
        self.policy = policy
        self.count = 0  # requests moved to a live replica
        self.inflight = InFlight()  # which entry replica each request went to
        self._aliases: dict[str, str] = {}  # the id a caller knows -> its current attempt's
        self._reports: queue.Queue[tuple[str, dict[str, str]]] = queue.Queue(BACKLOG)

    def current(self, rid: str) -> str:
        """The id of the current attempt of the request the caller knows as `rid`."""
        with self.owner._lock:
            return self._aliases.get(rid, rid)

    def sent(self, peers: PeerSet, meta: Meta, endpoint: str) -> None:
        self.inflight.add(Sent(meta, peers.peer.role, peers.kind, endpoint))

    def finished(self, rid: str, pending: Pending) -> None:
        """The request is done (call with the owner's lock held): forget it."""
        self._aliases.pop(pending.first, None)
        for peers in self.owner.entries:
            self.inflight.forget(rid, peers.peer.role)
        pending.payload = None

    def report(self, rid: str, error: dict[str, str]) -> None:
        """A role says the request was lost (any thread; acted on by `run`)."""
        try:
            self._reports.put_nowait((rid, error))
        except queue.Full:
            log.warning("client: move backlog full; request %s is not moved", rid)

    def entry_gone(self, kind: str, endpoint: str) -> None:
        """An entry replica was lost (its relay found gone): it is skipped a while, what
        went there moves."""
        for peers in self.owner.entries:
            if endpoint in peers.endpoints():
                peers.lost(endpoint)
        for sent in self.inflight.lost(kind, endpoint):
            why = f"entry replica {endpoint} of role {sent.target} was lost"
            self.report(
                sent.meta.rid, {"role": sent.target, "reason": migration.LOST, "message": why}
            )

    def run(self) -> None:
        """On the control thread: look at the entry relays requests are in flight on (a
        receiver gone: its requests move), then act on the reports."""
        for kind, endpoint in self.inflight.replicas():
            relay = self.owner.relays.peek(kind, endpoint)
            if relay is not None and relay.gone():
                self.owner.relays.drop(kind, endpoint, relay)
                self.entry_gone(kind, endpoint)
        while not self._reports.empty():
            self._move(*self._reports.get_nowait())

    def _move(self, rid: str, error: dict[str, str]) -> None:
        owner = self.owner
        with owner._lock:
            pending = owner._pending.get(rid)
        if pending is None:  # finished already (said: a report that came too late)
            log.info("client: request %s: reported lost after it finished: %s", rid, error)
            return
        role = error.get("role", "")
        verdict, why = migration.decide(
            self.policy,
            reason=error.get("reason", ""),
            role=role,
            exits=owner.exits,
            seen=pending.seen(),
            moved=pending.moved,
            remaining_s=pending.deadline - time.monotonic(),
            kept=pending.kept,
        )
        log.info(
            "client: request %s (attempt %s): %s (%s)",
            pending.first,
            rid,
            why,
            error.get("message", ""),
        )
        if verdict == "ignore":
            return
        if verdict == "fail":
            message = f"request {pending.first} failed: {why}: {error.get('message', '')}"
            owner._finish(rid, exc=RequestFailed(message, role=role, error=error))
            return
        new = uuid.uuid4().hex
        with owner._lock:
            if owner._pending.get(rid) is not pending:
                return
            del owner._pending[rid]
            owner._pending[new] = pending
            self._aliases[pending.first] = new
            pending.moved += 1
            self.count += 1
        log.info("client: request %s: attempt %s moved on as %s", pending.first, rid, new)
        for peers in owner.entries:
            peers.unpin(rid)
            sent = self.inflight.forget(rid, peers.peer.role)
            if sent is not None and role == peers.peer.role:  # that replica: not again soon
                peers.lost(sent.endpoint)
        owner._abort(rid)  # whatever a role still holds of the old attempt lets go
        remaining = max(0.0, pending.deadline - time.monotonic())
        meta = Meta(new, "data", "client", time.time() + remaining, owner.reply)
        try:
            for peers in owner.entries:
                owner._send(peers, meta, pending.payload)
        except (RelayError, OSError) as exc:
            what = f"request {pending.first} could not be moved ({why}: {error.get('message')})"
            owner._finish(new, exc=failed(what, exc))
