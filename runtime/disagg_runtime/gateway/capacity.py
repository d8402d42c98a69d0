"""Which engine replica takes the next request: the one with the most free capacity (pure).

Each engine reports its own load on /metrics (vLLM: `vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`); the gateway scrapes them every
`SCRAPE_S` and counts the requests it has in flight at each replica itself. A scrape older
than `stale_s` is not trusted (the engine may be stuck, or the scraper behind): the choice
then rests on the gateway's own count alone. The busiest signal wins (other gateways send
to the same engines, so the engine's count may exceed ours; ours is fresher), waiting
requests count twice (the engine is saturated), and a KV cache near full (preemption, or a
prefill that waits for blocks) weighs as `KV_WEIGHT` requests. Ties go round-robin.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
SCRAPE_S = 0.5
STALE_S = 2.0
KV_WEIGHT = 4.0
KV_FULL = 0.95  # at or above: the replica is avoided unless all are as full
FULL_PENALTY = 1000.0
MAX_METRICS_BYTES = 4 * 2**20  # a scrape larger than this is refused (bounded memory)


@dataclass(frozen=True)
class Load:
    """One replica's load as its engine last reported it, and when (monotonic seconds)."""

    waiting: float
    running: float
    kv_usage: float
    at: float


def parse_load(text: str, at: float) -> Load:
    """The load in an engine's /metrics text (sums over its series: one per model/engine);
    ValueError when the text is malformed or names none of the three."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (WAITING, RUNNING, KV_USAGE) and math.isfinite(sample.value):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    if not found:
        raise ValueError(f"no {WAITING}, {RUNNING} or {KV_USAGE} in the metrics")
    return Load(
        waiting=max(0.0, found.get(WAITING, 0.0)),
        running=max(0.0, found.get(RUNNING, 0.0)),
        kv_usage=min(1.0, max(0.0, found.get(KV_USAGE, 0.0))),
        at=at,
    )


def score(load: Load | None, inflight: int, *, now: float, stale_s: float = STALE_S) -> float:
    """How busy a replica is (lower: more free capacity)."""
    if load is None or now - load.at > stale_s:
        return float(inflight)
    busy = max(load.waiting + load.running, float(inflight)) + load.waiting
    busy += KV_WEIGHT * load.kv_usage
    return busy + (FULL_PENALTY if load.kv_usage >= KV_FULL else 0.0)


def choose(
    replicas: Sequence[str],
    loads: Mapping[str, Load],
    inflight: Mapping[str, int],
    *,
    now: float,
    turn: int = 0,
    stale_s: float = STALE_S,
) -> str:
    """The replica (by key) with the lowest `score`; among equals, the one `turn` picks
    (the caller advances it per request: round-robin). ValueError when there is none."""
    if not replicas:
        raise ValueError("no replica to choose from")
    scores = [score(loads.get(r), inflight.get(r, 0), now=now, stale_s=stale_s) for r in replicas]
    best = min(scores)
    tied = [r for r, s in zip(replicas, scores, strict=True) if s - best < 1e-9]
    return tied[turn % len(tied)]
