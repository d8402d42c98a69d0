"""Sending a role's messages on: to the replica of a downstream role a request goes to, or
to its reply endpoint, with the failover both need written once.

`Forwarder.send_to` picks the replica (peers.PeerSet: pinned per request, chosen by load
or by hash, among those that pair with this role's revision), opens or reuses its relay
(peers.RelayCache), and sends; a replica that lost its session (PeerLost: it restarted,
or its pod went away, and nothing of the payload was delivered) is dropped and the send
made once more, to a replica chosen afresh. While choosing, a replica that serves another
role now (WrongRole) or does not answer (Unanswered) is skipped; while none pairs (a
rollout's partner not ready yet) it waits, until shortly before the request's deadline,
or until the role has drained (`leaving`). `send_reply` goes to the request's reply
endpoint through the same cache (`RelayCache.send`: one reconnect on PeerLost).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from disagg_runtime.relay import PeerLost, Relay, RelayError, Unanswered, WrongRole
from disagg_runtime.routing.peers import NoCompatibleReplica, PeerSet, RelayCache
from disagg_runtime.wire.envelope import Meta

log = logging.getLogger(__name__)
PAIR_WAIT_S = 0.25  # re-resolve this often while no downstream replica pairs with us
PAIR_MARGIN_S = 1.0  # give up this long before the deadline, so the reason reaches the client


class ReplyFailed(RelayError):
    """The reply endpoint of a request could not be reached (so no error report can be)."""


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
    ) -> None:
        self.name = name
        self.replica = replica
        self.peers = peers
        self.relays = relays
        self._leaving = leaving  # set once the role drained: waiting for a partner gives up
        self._edge_sent = edge_sent  # (edge, relay kind, bytes, seconds): the role's metrics

    def send_to(self, target: str, meta: Meta, payload: Any) -> tuple[str, int]:
        """Send to a replica of `target`; the relay kind that carried it and the bytes."""
        peers = self.peers[target]
        new = meta.kind not in ("end", "abort")  # those follow the request, never choose
        started = time.monotonic()
        relay, endpoint = self._paired(peers, meta, new)
        try:
            try:
                nbytes = relay.send(
                    payload, request_id=meta.rid, timeout=remaining(meta), meta=meta.to_json()
                )
            except PeerLost:  # it restarted, or its pod went away: once more, chosen afresh
                self.relays.drop(peers.kind, endpoint, relay)
                peers.unpin(meta.rid)
                peers.endpoints(refresh=True)
                relay, endpoint = self._paired(peers, meta, new)
                nbytes = relay.send(
                    payload, request_id=meta.rid, timeout=remaining(meta), meta=meta.to_json()
                )
        except RelayError as exc:
            self.relays.drop(peers.kind, endpoint, relay)
            # the same type (a timeout stays a timeout), naming whom it could not reach
            raise type(exc)(f"{target} at {endpoint}: {exc}") from exc
        elapsed = time.monotonic() - started
        if not new:  # the request's last message to it
            peers.unpin(meta.rid)
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
            except Unanswered as exc:  # gone, or unreachable: another replica, if any
                log.info("role %s: %s", self.name, exc)
                peers.lost(endpoint)
                peers.unpin(meta.rid)
                peers.endpoints(refresh=True)
                continue
            except RelayError as exc:
                self.relays.drop(peers.kind, endpoint)
                raise type(exc)(f"{peers.peer.role} at {endpoint}: {exc}") from exc
            if peers.admit(endpoint, relay.peer_compat):
                return relay, endpoint
            self.relays.drop(peers.kind, endpoint)  # asked afresh once its verdict expires

    def send_reply(self, meta: Meta, payload: Any) -> tuple[str, int]:
        """To the request's reply endpoint, which must prove the peer key (so it is one of
        the pipeline's clients or gateways); connecting and sending together take no
        longer than the request has left."""
        kind, endpoint = meta.reply.relay, meta.reply.endpoint
        try:
            _, nbytes = self.relays.send(
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
