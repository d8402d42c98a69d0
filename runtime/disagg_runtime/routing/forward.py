"""Sending a role's messages on: to the replica of a downstream role a request goes to, or to
its reply endpoint, with the failover both need written once. `Forwarder.send_to` picks the
replica (peers.PeerSet: pinned per request, chosen by load or by hash, among those that pair
with this role's revision), opens or reuses its relay (relays.RelayCache), and sends with
failover.with_failover: a replica that lost its session (PeerLost: it restarted, or its pod
went away, and nothing of the payload was delivered) is dropped and the send made once more,
to a replica chosen afresh. While choosing, a replica that serves another role now
(WrongRole) or does not answer (Unanswered) is skipped; while none pairs (a rollout's
partner not ready yet) it waits, until shortly before the request's deadline, or until the
role has drained (`leaving`). `send_reply` goes to the request's reply endpoint through the
same cache and failover (`failover.send`: one reconnect on PeerLost).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from disagg_runtime.relay import PeerLost, Relay, RelayError, Unanswered, WrongRole
from disagg_runtime.routing import failover
from disagg_runtime.routing.inflight import InFlight, Sent
from disagg_runtime.routing.peers import NoCompatibleReplica, PeerSet
from disagg_runtime.routing.relays import RelayCache
from disagg_runtime.wire.envelope import Meta

log = logging.getLogger(__name__)
PAIR_WAIT_S = 0.25  # re-resolve this often while no downstream replica pairs with us
PAIR_MARGIN_S = 1.0  # give up this long before the deadline, so the reason reaches the client


class ReplyFailed(RelayError):
    """The reply endpoint of a request could not be reached (so no error report can be)."""


class HandedBack(NoCompatibleReplica):
    """This role is draining and no downstream replica pairs with it: the request goes back
    to its first sender, to be moved to a live replica (not failed)."""


class StreamBroken(PeerLost):
    """The replica a request's stream was going to was lost midway: a stream is not moved
    (its start is gone with that replica), the request fails naming the role."""


def remaining(meta: Meta) -> float:
    """Seconds `meta`'s request has left (at least 50 ms: a last try is not refused)."""
    return max(0.05, meta.deadline - time.time())


class Forwarder:
    """One role's way to its downstream roles and its requests' reply endpoints."""

    def __init__(
        self,
        name: str,
        replica: int,
        peers: Mapping[str, PeerSet],
        relays: RelayCache,
        *,
        leaving: threading.Event,
        edge_sent: Callable[[str, str, int, float], None],
        draining: threading.Event | None = None,
        on_lost: Callable[[list[Sent]], None] | None = None,
    ) -> None:
        self.name = name
        self.replica = replica
        self.peers = peers
        self.relays = relays
        self._leaving = leaving  # set once the role drained: waiting for a partner gives up
        self._edge_sent = edge_sent  # (edge, relay kind, bytes, seconds): the role's metrics
        self._draining = draining or threading.Event()  # a partner not found: handed back
        self._on_lost = on_lost  # requests that went to a replica now lost (inflight.py)
        self.inflight = InFlight()

    def send_to(self, target: str, meta: Meta, payload: Any) -> tuple[str, int]:
        """Send to a replica of `target`; the relay kind that carried it and the bytes."""
        peers = self.peers[target]
        new = meta.kind not in ("end", "abort")  # those follow the request, never choose
        started = time.monotonic()
        route = Paired(self, peers, meta, new)
        try:
            relay, nbytes = failover.with_failover(
                route,
                lambda relay, seconds: relay.send(
                    payload, request_id=meta.rid, timeout=seconds, meta=meta.to_json()
                ),
                timeout=remaining(meta),
            )
        except RelayError as exc:
            if not route.opened:  # choosing failed: its error names the replica already
                raise
            # the same type (a timeout stays a timeout), naming whom it could not reach
            raise type(exc)(f"{target} at {route.endpoint}: {exc}") from exc
        elapsed = time.monotonic() - started
        if not new:  # the request's last message to it
            peers.unpin(meta.rid)
            self.inflight.forget(meta.rid, target)
        elif meta.kind in ("data", "ref") or (meta.kind == "chunk" and meta.seq == 0):
            sent = Sent(meta, target, relay.kind, route.endpoint, relay)
            self.inflight.add(sent)
            if self.relays.peek(relay.kind, route.endpoint) is not relay:
                # the relay it went on was dropped since (the sweep found its receiver
                # gone between this send and the line above, and reported what it knew
                # of then): what went on it may be lost, and nothing would tell
                self.inflight.forget(meta.rid, target)
                self.lost([sent])
        self._edge_sent(f"{self.name}->{target}", relay.kind, nbytes, elapsed)
        return relay.kind, nbytes

    def _paired(self, peers: PeerSet, meta: Meta, new: bool) -> tuple[Relay, str]:
        """A relay to the replica of `peers` the request goes to, among those that pair
        with this role's revision. A replica found incompatible, or that does not answer
        (peers.Unanswered), is skipped and the choice made again; while none pairs (a
        rollout's partner not ready yet) it waits, until shortly before the request's
        deadline, or until this role has drained (it is going: the request fails then,
        naming why, rather than being lost with the process)."""
        while True:
            try:
                endpoint = peers.endpoint_for(meta.rid, self.relays.viewer(peers.kind), new=new)
            except NoCompatibleReplica as exc:
                if self._draining.is_set():
                    raise HandedBack(
                        f"role {self.name} replica {self.replica} is draining and found no "
                        f"partner: {exc}"
                    ) from exc
                if self._leaving.is_set():
                    raise NoCompatibleReplica(
                        f"role {self.name} replica {self.replica} is shutting down and "
                        f"found no partner: {exc}"
                    ) from exc
                if meta.deadline - time.time() <= PAIR_WAIT_S + PAIR_MARGIN_S:
                    raise
                self._leaving.wait(PAIR_WAIT_S)
                peers.endpoints(refresh=True)
                continue
            try:
                relay = self.relays.get(
                    peers.kind, endpoint, timeout=remaining(meta), role=peers.peer.role
                )
            except WrongRole as exc:  # its address is another role's pod now: look again
                if meta.deadline - time.time() <= PAIR_WAIT_S + PAIR_MARGIN_S:
                    raise WrongRole(f"{peers.peer.role} at {endpoint}: {exc}") from exc
                log.info("role %s: %s", self.name, exc)
                peers.unpin(meta.rid)
                time.sleep(PAIR_WAIT_S)
                peers.endpoints(refresh=True)
                continue
            except Unanswered as exc:  # gone, unreachable or starved: another one, if any
                log.info("role %s: %s", self.name, exc)
                peers.unanswered(endpoint)
                peers.unpin(meta.rid)
                peers.endpoints(refresh=True)
                continue
            except RelayError as exc:
                self.relays.drop(peers.kind, endpoint)
                raise type(exc)(f"{peers.peer.role} at {endpoint}: {exc}") from exc
            if peers.admit(endpoint, relay.peer_compat):
                return relay, endpoint
            self.relays.drop(peers.kind, endpoint)  # asked afresh once its verdict expires

    def lost(self, sent: list[Sent]) -> None:
        """Report requests that went to a replica now lost (to `on_lost`)."""
        if sent and self._on_lost is not None:
            self._on_lost(sent)

    def sweep(self) -> None:
        """Look at the relays of replicas something is in flight at, without sending: one
        whose receiver went away or restarted (relay `gone`) is dropped and what went to it
        reported lost. So a request is moved even when nothing else is sent there (the
        last message into a connection that just died had no receipt)."""
        for kind, endpoint, went_on in self.inflight.relays():
            cached = self.relays.peek(kind, endpoint)
            relay = cached if went_on is None else went_on
            if relay is None or not relay.gone():
                continue
            # the relay requests went on, even when dropped (another thread's send found
            # it lost while a transfer held it, so that one did not report) or replaced
            # by a fresh one to the restarted replica's same address
            if cached is relay:
                self.relays.drop(kind, endpoint, relay)
            sent = self.inflight.lost_on(kind, endpoint, went_on)
            for target in {s.target for s in sent}:
                self.peers[target].lost(endpoint)
            self.lost(sent)

    def send_reply(self, meta: Meta, payload: Any) -> tuple[str, int]:
        """To the request's reply endpoint, which must prove the peer key (so it is one of
        the pipeline's clients or gateways); connecting and sending together take no
        longer than the request has left."""
        kind, endpoint = meta.reply.relay, meta.reply.endpoint
        try:
            _, nbytes = failover.send(
                self.relays,
                kind,
                endpoint,
                payload,
                request_id=meta.rid,
                timeout=remaining(meta),
                meta=meta.to_json(),
            )
        except RelayError as exc:
            self.relays.failed()
            raise ReplyFailed(f"reply to {endpoint}: {exc}") from exc
        self.relays.succeeded()
        return kind, nbytes


class Paired:
    """failover.Route to the replica of a downstream role a request goes to (its pin, or
    the one chosen for it; see Forwarder._paired); after a loss, chosen afresh."""

    def __init__(self, forwarder: Forwarder, peers: PeerSet, meta: Meta, new: bool) -> None:
        self._forwarder = forwarder
        self._peers = peers
        self._meta = meta
        self._new = new
        self.endpoint = ""
        self.opened = False  # whether the last open succeeded
        self._gone = False

    def open(self, *, first: bool, seconds: float) -> Relay:
        self.opened = False
        relay, self.endpoint = self._forwarder._paired(self._peers, self._meta, self._new)
        self.opened = True
        return relay

    def discard(self, relay: Relay) -> None:
        self._gone = relay.gone()  # lost with what it held (not a goodbye: that one hands on)
        self._forwarder.relays.drop(self._peers.kind, self.endpoint, relay)

    def keep(self, relay: Relay) -> None:
        pass  # shared: it stays in the cache

    def lost(self, exc: PeerLost) -> None:
        """It restarted, or its pod went away: what else went there is reported lost, the
        pin goes, the replicas are looked up; a stream half sent there is not moved."""
        meta, kind = self._meta, self._peers.kind
        midway = meta.kind == "end" or (meta.kind == "chunk" and meta.seq > 0)
        if self._gone:
            self._peers.lost(self.endpoint)  # dead or restarted: others first, a while
            self._forwarder.lost(self._forwarder.inflight.lost(kind, self.endpoint, but=meta.rid))
        if midway:
            raise StreamBroken(
                f"role {self._peers.peer.role} at {self.endpoint} was lost in the middle of "
                f"request {meta.rid}'s stream from role {self._forwarder.name}: {exc}"
            ) from exc
        self._peers.unpin(self._meta.rid)
        self._peers.endpoints(refresh=True)
