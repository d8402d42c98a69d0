"""Which replica of a downstream role gets a new request: the policy, apart from any I/O.

Receivers advertise their `Load` (relay/protocol.py: in the welcome, on grants and acks,
and in a periodic `load` message to senders that are sending to them). A sender keeps
the last one per replica, with its age and the requests it sent there since (`View`).
`choose` filters the candidates, then picks:

- filters first (`Filter`: endpoints and views in, the endpoints kept out), composed in
  order; `not_draining` drops replicas that said they are draining, unless that would
  drop all. Another filter (e.g. a compatible revision) composes the same way; one that
  leaves nothing makes `choose` return None.
- then power of two choices: two candidates at random, the one with the lower `score`,
  the time a new request would take there: the requests ahead of it and itself, per
  worker, times the replica's recent time per request (so an idle replica five times
  slower loses to a fast one with a request or three ahead).
  Why not least-loaded: every sender sees loads that are a little old, and all of them
  sending to the replica that looked emptiest pile onto it until the next report (herd
  behaviour, Mitzenmacher 2000, "How useful is old information?"); two random choices
  keep most of the gain and spread such mistakes. Each sender also counts what it sent
  since the report (`View.sent_since`), which corrects its own part of the staleness.
- a view older than `max_age_s` is unknown, and so is a replica never heard from; an
  unknown replica scores as the mean of the known ones (it is tried, not preferred), and
  with nothing known at all the request goes where rendezvous hashing puts it (the
  behaviour before loads existed).

Messages of a request after its first follow it to the replica chosen (peers.PeerSet pins
them); roles whose inputs must meet (fan-in joins, tensor references) are not chosen by
load at all: every sender must agree on the replica without talking, so they hash.
"""

from __future__ import annotations

import hashlib
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_AGE_S = 1.0  # a load report older than this is not used
MAX_COUNT = 1 << 31  # bounds on what a report may say (a malformed one is refused)
MAX_BYTES = 1 << 50
MAX_SERVICE_S = 86400.0


class LoadError(ValueError):
    """A load report is malformed."""


@dataclass(frozen=True)
class Load:
    """What a receiver says of itself: requests waiting for a worker, requests being
    handled, how many it handles at once, its receive pool's free and total bytes, its
    recent seconds per request (0: none handled yet), and whether it is draining (then it
    wants no new requests)."""

    queued: int
    active: int
    workers: int
    free_bytes: int
    pool_bytes: int
    service_s: float = 0.0
    draining: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "queued": self.queued,
            "active": self.active,
            "workers": self.workers,
            "free_bytes": self.free_bytes,
            "pool_bytes": self.pool_bytes,
            "service_s": round(self.service_s, 6),
            "draining": self.draining,
        }

    @classmethod
    def from_json(cls, obj: object) -> Load:
        """Validated: an object of bounded non-negative integers (workers at least 1, free
        bytes at most the pool's) and a boolean; other keys are ignored (later additions)."""
        if not isinstance(obj, dict):
            raise LoadError(f"load must be an object, not {type(obj).__name__}")

        def count(name: str, lo: int, hi: int) -> int:
            value = obj.get(name)
            if type(value) is not int or not lo <= value <= hi:
                raise LoadError(f"load.{name} must be an integer in [{lo}, {hi}], got {value!r}")
            return value

        draining = obj.get("draining", False)
        if type(draining) is not bool:
            raise LoadError(f"load.draining must be a boolean, got {draining!r}")
        service = obj.get("service_s", 0.0)
        if type(service) not in (int, float) or not 0 <= service <= MAX_SERVICE_S:
            raise LoadError(f"load.service_s must be seconds in [0, {MAX_SERVICE_S:g}]")
        pool = count("pool_bytes", 0, MAX_BYTES)
        return cls(
            queued=count("queued", 0, MAX_COUNT),
            active=count("active", 0, MAX_COUNT),
            workers=count("workers", 1, MAX_COUNT),
            free_bytes=count("free_bytes", 0, pool),
            pool_bytes=pool,
            service_s=float(service),
            draining=draining,
        )

    @property
    def occupancy(self) -> float:
        return 1.0 - self.free_bytes / self.pool_bytes if self.pool_bytes else 0.0


@dataclass(frozen=True)
class View:
    """What one sender knows of one replica now: its last `load`, how old that is, and how
    many requests this sender sent it since."""

    load: Load
    age_s: float
    sent_since: int = 0


def score(view: View, service_s: float = 1.0) -> float:
    """Seconds a new request would take there: the requests ahead of it (this sender's own
    since the report counted) and itself, per worker, times the replica's seconds per
    request (`service_s` stands in while it has none), scaled up by its pool's occupancy
    (a tie-break between equal queues; a nearly full pool, whose senders would stall on
    it, counts double)."""
    load = view.load
    ahead = load.queued + load.active + view.sent_since + 1
    return ahead / load.workers * (load.service_s or service_s) * (1.0 + load.occupancy)


Views = Mapping[str, View | None]
Filter = Callable[[Sequence[str], Views], list[str]]


def not_draining(endpoints: Sequence[str], views: Views) -> list[str]:
    """Replicas not known to be draining; all of them when every one is (better one that
    is leaving than none: it still serves until it goes)."""
    kept = [e for e in endpoints if (v := views.get(e)) is None or not v.load.draining]
    return kept or list(endpoints)


DEFAULT_FILTERS: tuple[Filter, ...] = (not_draining,)


def rendezvous(endpoints: Sequence[str], rid: str) -> str:
    """The replica a request hashes to (highest random weight): every sender agrees, and a
    replica joining or leaving moves only the requests that hash to it. The weight is a
    cryptographic hash: CRC32 (used before) is affine, so between endpoints whose names
    differ in a few characters its comparison barely depends on the request, and one of
    three replicas got half of all requests."""
    key = rid.encode() + b"@"
    return max(
        endpoints, key=lambda e: (hashlib.blake2b(key + e.encode(), digest_size=8).digest(), e)
    )


def choose(
    endpoints: Sequence[str],
    views: Views,
    rid: str,
    *,
    rng: random.Random,
    max_age_s: float = MAX_AGE_S,
    filters: Sequence[Filter] = DEFAULT_FILTERS,
) -> str | None:
    """The replica for a new request `rid` (see the module docstring); None when the
    filters leave no candidate."""
    candidates = list(endpoints)
    for keep in filters:
        candidates = keep(candidates, views)
    if not candidates:
        return None
    fresh = {e: v for e in candidates if (v := views.get(e)) is not None and v.age_s <= max_age_s}
    timed = [v.load.service_s for v in fresh.values() if v.load.service_s > 0]
    typical = statistics.fmean(timed) if timed else 1.0  # for replicas without a time yet
    known = {e: score(v, typical) for e, v in fresh.items()}
    if not known:
        return rendezvous(candidates, rid)
    if len(candidates) == 1:
        return candidates[0]
    neutral = statistics.fmean(known.values())
    a, b = rng.sample(candidates, 2)  # in random order: a tie goes either way
    return a if known.get(a, neutral) <= known.get(b, neutral) else b
