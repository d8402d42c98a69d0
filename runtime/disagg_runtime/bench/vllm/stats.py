"""What `disagg bench vllm` computes from what it recorded: pure, no I/O
(tests/unit/runtime/test_bench_vllm.py).

A request's record is its send time and the arrival time of every streamed chunk that
carried a choice (one chunk per token for vLLM's server, the proxy and the gateway). TTFT
is the first arrival minus the send; ITLs are the gaps between successive arrivals, pooled
over a level's requests (as vLLM's own benchmark does). Percentiles interpolate linearly
between closest ranks (numpy's default), so p50 of [1, 2, 3, 4] is 2.5.

KV hand-off times come from the engines' Prometheus histograms (the only per-request
record both connectors export): the difference of two scrapes around a level gives that
level's count and sum (so an exact mean) and its bucket counts, from which p50/p99 are
estimated as Prometheus' `histogram_quantile` does (linear inside the bucket); an
estimate is never finer than the buckets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LE = re.compile(r'le="([^"]+)"')


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) of `values`, linear between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class Timing:
    """One streamed request: when it was sent and when each chunk with a choice came."""

    prompt: int  # index into the bench's prompts
    sent: float
    arrivals: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int = 0  # completion_tokens from the stream's usage (0: none was sent)
    done: float = 0.0

    @property
    def ttft(self) -> float:
        if not self.arrivals:
            raise ValueError(f"request for prompt {self.prompt} streamed no token")
        return self.arrivals[0] - self.sent

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def level_summary(timings: Sequence[Timing], concurrency: int, wall_s: float) -> dict[str, Any]:
    """TTFT/ITL p50/p99 (ms) and total output throughput of one concurrency level."""
    ttfts = [t.ttft for t in timings]
    itls = [gap for t in timings for gap in t.itls]
    tokens = sum(t.tokens or len(t.arrivals) for t in timings)
    out: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(timings),
        "tokens": tokens,
        "chunks": sum(len(t.arrivals) for t in timings),
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
        "ttft_p50_ms": round(1e3 * percentile(ttfts, 50), 2),
        "ttft_p99_ms": round(1e3 * percentile(ttfts, 99), 2),
    }
    out["itl_p50_ms"] = round(1e3 * percentile(itls, 50), 2) if itls else None
    out["itl_p99_ms"] = round(1e3 * percentile(itls, 99), 2) if itls else None
    return out


@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram summed over its label sets: cumulative bucket counts by
    upper bound (+Inf last), count and sum."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float

    def minus(self, before: Histogram) -> Histogram:
        """What was observed between scrape `before` and this one."""
        prior = dict(before.buckets)
        return Histogram(
            tuple((le, n - prior.get(le, 0.0)) for le, n in self.buckets),
            self.count - before.count,
            self.total - before.total,
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile (q in 0..1); None without observations."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):  # beyond the last finite bound: that bound is the answer
                    return lower
                inside = cumulative - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = le, cumulative
        return lower

    def report(self, scale: float = 1e3) -> dict[str, Any]:
        """count, mean and p50/p99 (estimates from the buckets), times `scale` (ms)."""
        p50, p99 = self.quantile(0.5), self.quantile(0.99)
        return {
            "count": int(self.count),
            "mean": round(scale * self.total / self.count, 3) if self.count else None,
            "p50_est": round(scale * p50, 3) if p50 is not None else None,
            "p99_est": round(scale * p99, 3) if p99 is not None else None,
        }


EMPTY = Histogram((), 0.0, 0.0)


def histograms(text: str, names: Iterable[str]) -> dict[str, Histogram]:
    """The named histograms of a Prometheus text page, each summed over its label sets
    (engines, models); a name absent from the page is EMPTY."""
    wanted = set(names)
    buckets: dict[str, dict[float, float]] = {n: {} for n in wanted}
    counts: dict[str, float] = dict.fromkeys(wanted, 0.0)
    sums: dict[str, float] = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        metric, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        for suffix, into in (("_count", counts), ("_sum", sums)):
            base = metric.removesuffix(suffix)
            if base != metric and base in wanted:
                into[base] += value
        base = metric.removesuffix("_bucket")
        if base != metric and base in wanted:
            le = _LE.search(labels)
            if le is not None:
                bound = float(le.group(1))  # "+Inf" parses as inf
                buckets[base][bound] = buckets[base].get(bound, 0.0) + value
    return {
        n: Histogram(tuple(sorted(buckets[n].items())), counts[n], sums[n]) if counts[n] else EMPTY
        for n in wanted
    }


def mismatches(
    reference: Mapping[int, str], timings: Iterable[Timing], prompts: Sequence[str]
) -> list[str]:
    """Each request whose text differs from the reference's for its prompt, described."""
    out = []
    for t in timings:
        want = reference[t.prompt]
        if t.text != want:
            out.append(
                f"prompt {t.prompt} ({prompts[t.prompt][:30]!r}...): got {t.text[:60]!r}, "
                f"one engine gave {want[:60]!r}"
            )
    return out


COLUMNS = (
    ("setup", "setup", "<"),
    ("concurrency", "conc", ">"),
    ("requests", "reqs", ">"),
    ("ttft_p50_ms", "TTFT p50 ms", ">"),
    ("ttft_p99_ms", "TTFT p99 ms", ">"),
    ("itl_p50_ms", "ITL p50 ms", ">"),
    ("itl_p99_ms", "ITL p99 ms", ">"),
    ("tokens_per_s", "tok/s", ">"),
    ("vs_single", "tok/s vs single", ">"),
    ("handoff_mean_ms", "hand-off mean ms", ">"),
    ("handoff_p50_ms", "p50~ ms", ">"),
    ("handoff_p99_ms", "p99~ ms", ">"),
)


def with_ratios(rows: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Every row with its throughput over the baseline setup's at the same concurrency."""
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["setup"] == baseline}
    out = []
    for r in rows:
        ref = base.get(r["concurrency"])
        out.append({**r, "vs_single": round(r["tokens_per_s"] / ref, 2) if ref else None})
    return out


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as an aligned text table ('-' for what a setup has not)."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.2f}" if value < 100 else f"{value:.1f}"
        return str(value)

    cells = [[cell(r.get(key)) for key, _, _ in COLUMNS] for r in rows]
    widths = [
        max(len(title), *(len(c[i]) for c in cells)) if cells else len(title)
        for i, (_, title, _) in enumerate(COLUMNS)
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            f"{v:{align}{w}}" for v, w, (_, _, align) in zip(values, widths, COLUMNS, strict=True)
        ]
        return "  ".join(parts).rstrip()

    head = line([title for _, title, _ in COLUMNS])
    return "\n".join([head, "-" * len(head), *(line(c) for c in cells)])
