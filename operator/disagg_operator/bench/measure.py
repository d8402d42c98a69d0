"""Measuring: percentiles, the operator's API cost (its request counters), and CPU shares of
the operator and the API server over a phase.

API cost comes from the operator's own counters (`disagg_operator_api_requests_total`, by
client, verb, resource and outcome), read before and after a phase. The API server's CPU
comes from its /metrics (`emulator_cpu_seconds_total` from the project's emulator: its
serving thread; else `process_cpu_seconds_total`, which a real API server exports to those
allowed to read /metrics); either may be missing, and then it is not reported.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

from disagg_operator.bench.workload import Json
from disagg_operator.k8s import client as kube

API_REQUESTS: Final = "disagg_operator_api_requests"
SERVER_CPU: Final = ("emulator_cpu_seconds_total", "process_cpu_seconds_total")
TOP: Final = 40  # request kinds listed per phase (the operator sends about 25)

Counts = dict[tuple[str, str, str, str], float]  # (client, verb, resource, outcome) -> count


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def api_counts(text: str | None) -> Counts | None:
    """The operator's request counters from its /metrics text (None: no text)."""
    if text is None:
        return None
    counts: Counts = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == API_REQUESTS + "_total":
                labels = sample.labels
                key = (labels["client"], labels["verb"], labels["resource"], labels["outcome"])
                counts[key] = float(sample.value)
    return counts


def cost(before: Counts | None, after: Counts | None, *, pipelines: int, seconds: float) -> Json:
    """What a phase cost: requests in all, per pipeline and per minute, the failed ones (no
    answer, 429, 5xx), and the most frequent kinds ("client verb resource")."""
    if before is None or after is None:
        return {}
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}
    total = sum(delta.values())
    by_request: dict[str, float] = {}
    for (client, verb, resource, _), n in delta.items():
        name = f"{client} {verb} {resource}"
        by_request[name] = by_request.get(name, 0.0) + n
    top = dict(sorted(by_request.items(), key=lambda kv: -kv[1])[:TOP])
    failed = sum(n for (_, _, _, outcome), n in delta.items() if _failed(outcome))
    return {
        "requests": total,
        "failed": failed,
        "seconds": seconds,
        "per_pipeline": total / pipelines if pipelines else None,
        "per_minute": total * 60.0 / seconds if seconds > 0 else None,
        "by_request": top,
    }


def _failed(outcome: str) -> bool:
    """No answer, throttled or a server error (a 404 or 409 is an answer)."""
    return not outcome.isdigit() or outcome == "429" or outcome.startswith("5")


def server_cpu(text: str | None) -> float | None:
    """The API server's CPU seconds so far, from its /metrics (see the module docstring)."""
    if not text:
        return None
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SERVER_CPU:
                found[sample.name] = float(sample.value)
    return next((found[name] for name in SERVER_CPU if name in found), None)


async def read_server_metrics(api: kube.Api) -> str | None:
    """The API server's /metrics text (None: not served or not allowed)."""
    try:
        return await api.text("/metrics")
    except kube.ApiError:
        return None


@dataclass
class CpuMark:
    """CPU counters at one moment, to compare with a later one."""

    at: float
    operator: float | None
    server: float | None

    @classmethod
    def now(cls, operator: float | None, server: float | None) -> CpuMark:
        return cls(time.monotonic(), operator, server)

    def since(self, start: CpuMark) -> Json:
        """CPU seconds and share of one core between `start` and this mark."""
        wall = self.at - start.at
        result: Json = {"wall_s": wall}
        for name in ("operator", "server"):
            a, b = getattr(start, name), getattr(self, name)
            if a is None or b is None or wall <= 0:
                continue
            result[f"{name}_s"] = b - a
            result[f"{name}_share"] = (b - a) / wall
        return result


__all__ = [
    "Counts",
    "CpuMark",
    "api_counts",
    "cost",
    "percentile",
    "read_server_metrics",
    "server_cpu",
]
