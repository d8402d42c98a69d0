"""Whether a role with revision pairing has a partner in every downstream role, checked
beside the readiness probe, not inside it.

Asking a downstream replica its revision is a relay handshake (its welcome carries the
compat token), up to PROBE_S each and PROBES_PER_CHECK replicas a round: asked inside
/readyz, replicas that did not answer made the probe take 4 s (measured), past the
kubelet's default 1 s probe timeout, so the probe failed by timing out and held a thread
of the health server the while. A thread asks every CHECK_EVERY_S instead and /readyz
reads its last verdict at once; until the first round ends the role is not ready, as a
sender with no known partner."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Final

from disagg_runtime.relay import RelayError
from disagg_runtime.routing.peers import PeerSet
from disagg_runtime.routing.relays import RelayCache

log = logging.getLogger(__name__)
PROBES_PER_CHECK: Final = 4  # downstream replicas asked their revision per round
PROBE_S: Final = 1.0  # how long asking one may take
CHECK_EVERY_S: Final = 1.0  # pause between rounds
NOT_YET: Final = "pairing with downstream replicas not checked yet"


class PairingCheck:
    """The last verdict on pairing (`trouble`: None when every downstream role that pairs
    has a partner), refreshed on its own thread while `start`ed; without pairing peers,
    always None and no thread."""

    def __init__(self, name: str, peers: Mapping[str, PeerSet], relays: RelayCache) -> None:
        self.name = name
        self.peers = [p for p in peers.values() if p.pairing]
        self.relays = relays
        self._trouble: str | None = NOT_YET if self.peers else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def trouble(self) -> str | None:
        return self._trouble

    def start(self) -> None:
        if self.peers and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"disagg-{self.name}-pairing", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PROBE_S * PROBES_PER_CHECK + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._trouble = self.check()
            except Exception as exc:  # the thread must outlive any one round
                log.exception("role %s: pairing check failed", self.name)
                self._trouble = f"pairing check failed: {exc}"
            self._stop.wait(CHECK_EVERY_S)

    def check(self) -> str | None:
        """One round: ask replicas not asked lately which revision they run (a cached
        relay's welcome says it); a downstream role none of whose replicas pairs is the
        trouble, so upstream sends to replicas that have a partner."""
        for peers in self.peers:
            for endpoint in peers.unchecked()[:PROBES_PER_CHECK]:
                if self._stop.is_set():
                    return self._trouble
                try:
                    relay = self.relays.get(
                        peers.kind, endpoint, timeout=PROBE_S, role=peers.peer.role
                    )
                except RelayError:
                    continue
                if not peers.admit(endpoint, relay.peer_compat):
                    self.relays.drop(peers.kind, endpoint)  # a later pod may reuse the address
            trouble = peers.trouble()
            if trouble is not None:
                return trouble
        return None
