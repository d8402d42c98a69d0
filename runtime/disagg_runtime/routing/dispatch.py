"""Which replica of a downstream role gets a new request: the policy, apart from any I/O.

Receivers advertise their `Load` (wire/load.py; relay/protocol.py: in the welcome, on
grants and acks, and in a periodic `load` message to senders that are sending to them). A
sender keeps the last one per replica, with its age and the requests it sent there since
(`View`).
`choose` filters the candidates, then picks:

- filters first (`Filter`: endpoints and views in, the endpoints kept out), composed in
  order; `not_draining` drops replicas that said they are draining, unless that would
  drop all. Another filter (e.g. a compatible revision) composes the same way; one that
  leaves nothing makes `choose` return None.
- then power of two choices: two candidates at random, the one with the lower `score`,
  the time a new request would take there: the requests ahead of it and itself, per
  worker, times the replica's recent time per request (so an idle replica five times
  slower loses to a fast one with a request or three ahead). Scores within `TIE` of each
  other are a tie, which goes either way: idle replicas differ in their measured times by
  noise, and where the lower one always won, the winner kept a fresh time and the other's
  stayed frozen, so one replica took nearly every request (prefill -> middle x 2, each
  idle: 1 to 9 of 50 went to the second; a kill of it caught almost nothing).
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

from disagg_runtime.wire.load import Load, LoadError, View

__all__ = ["Load", "LoadError", "View", "choose", "not_draining", "rendezvous", "score"]

MAX_AGE_S = 1.0  # a load report older than this is not used
TIE = 0.25  # scores closer than this share of the larger are a tie (random)


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
    score_a, score_b = known.get(a, neutral), known.get(b, neutral)
    return a if score_a <= score_b or score_a - score_b <= TIE * score_a else b
