"""Which replica each request a sender passed on went to, so that when that replica is
lost (killed, restarted: its connection dropped, or it refused this sender) the requests
it may have held are known, and can be moved to another one (request migration).

A sender cannot know when a receiver is done with a request (it may have handed it on
long ago), so what it reports is "may have been lost there": the request's first sender
(client.py) moves it only if none of its output has come back yet, and drops the copy it
moved away from. Entries go at the request's deadline, at its last message, or when their
replica is reported; at most `limit` are kept (the oldest go first).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from disagg_runtime.wire.envelope import Meta

LIMIT = 1 << 16


@dataclass(frozen=True)
class Sent:
    """A request passed on: to which role, at which replica, over which relay kind, and
    on which relay (that one's loss is what loses it: a cache may have dropped it, or
    opened a fresh one to the restarted replica's same address, since)."""

    meta: Meta
    target: str
    kind: str
    endpoint: str
    relay: Any = field(default=None, compare=False)  # relay.Relay; None: unknown


class InFlight:
    """Requests by the replica they went to (thread-safe)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._sent: collections.OrderedDict[tuple[str, str], Sent] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, sent: Sent) -> None:
        now = time.time()
        with self._lock:
            key = (sent.meta.rid, sent.target)
            self._sent[key] = sent
            self._sent.move_to_end(key)
            while self._sent and (
                len(self._sent) > self.limit or next(iter(self._sent.values())).meta.deadline < now
            ):
                self._sent.popitem(last=False)

    def forget(self, rid: str, target: str) -> Sent | None:
        """Take the request's entry for `target` out (its last message went, or it moved)."""
        with self._lock:
            return self._sent.pop((rid, target), None)

    def replicas(self) -> set[tuple[str, str]]:
        """(relay kind, endpoint) of every replica something is in flight at."""
        now = time.time()
        with self._lock:
            return {(s.kind, s.endpoint) for s in self._sent.values() if s.meta.deadline >= now}

    def relays(self) -> list[tuple[str, str, Any]]:
        """(relay kind, endpoint, relay) of each relay something live went on (once each;
        relay None for entries that did not say)."""
        now = time.time()
        seen: dict[tuple[str, str, int], tuple[str, str, Any]] = {}
        with self._lock:
            for s in self._sent.values():
                if s.meta.deadline >= now:
                    seen.setdefault(
                        (s.kind, s.endpoint, id(s.relay)), (s.kind, s.endpoint, s.relay)
                    )
        return list(seen.values())

    def lost_on(self, kind: str, endpoint: str, relay: Any) -> list[Sent]:
        """Take out what went to `endpoint` on `relay` (that relay's receiver is lost; what
        went to the same address on a later relay went to its successor), live only."""
        now = time.time()
        with self._lock:
            gone = [
                k
                for k, s in self._sent.items()
                if s.endpoint == endpoint and s.kind == kind and s.relay is relay
            ]
            taken = [self._sent.pop(k) for k in gone]
        return [s for s in taken if s.meta.deadline >= now]

    def lost(self, kind: str, endpoint: str, *, but: str = "") -> list[Sent]:
        """Take out what went to the replica at `endpoint` (except request `but`), live
        requests only."""
        now = time.time()
        with self._lock:
            gone = [
                k
                for k, s in self._sent.items()
                if s.endpoint == endpoint and s.kind == kind and k[0] != but
            ]
            taken = [self._sent.pop(k) for k in gone]
        return [s for s in taken if s.meta.deadline >= now]

    def __len__(self) -> int:
        return len(self._sent)
