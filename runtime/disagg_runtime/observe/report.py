"""`disagg up --report FILE.html|FILE.png`: four charts of one run, drawn with matplotlib
(the `report` extra; imported only when a report is asked for).

    latency histogram        client-side request latencies, ms
    throughput over time     completed requests per second, 1 s bins
    replicas over time       per role, from the start and each autoscaler decision
    time split per role      per request, mean seconds inside the handler ("computing")
                             and the rest of the role's receive-to-done time ("queued and
                             moving"), from the roles' own histograms

`ReportData.of` gathers the numbers (pure); `html` and `png` draw them. The HTML is one
self-contained file: each chart an inline PNG (`<img id=...>`), no scripts, no network.
"""

from __future__ import annotations

import base64
import html as html_text
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

CHARTS: Final = (
    ("latency", "Latency histogram"),
    ("throughput", "Throughput over time"),
    ("replicas", "Replicas over time"),
    ("split", "Time split per role"),
)


@dataclass(frozen=True)
class ReportData:
    pipeline: str
    latencies_s: Sequence[float]
    completed_at_s: Sequence[float]  # since the first request
    replicas: Mapping[str, Sequence[tuple[float, int]]]  # role -> steps (time s, replicas)
    split_s: Mapping[str, tuple[float, float]]  # role -> (computing, queued and moving)
    elapsed_s: float
    summary: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(
        summary: Mapping[str, Any],
        *,
        latencies_s: Sequence[float],
        completed_at_s: Sequence[float],
        role_samples: Mapping[str, Iterable[Mapping[str, float]]],
    ) -> ReportData:
        """From `disagg up`'s summary (replicas, scale events), the client's timings and each
        role's scraped samples (`metrics.scrape` of every replica)."""
        elapsed = float(summary.get("elapsed_s", 0.0))
        replicas: dict[str, list[tuple[float, int]]] = {}
        for role, stats in summary.get("roles", {}).items():
            first = int(stats.get("replicas", 0))
            events = [e for e in summary.get("scale_events", []) if e.get("role") == role]
            if events:
                first = int(events[0]["from"])
            steps = [(0.0, first)] + [(float(e["time_s"]), int(e["to"])) for e in events]
            replicas[role] = [*steps, (max(elapsed, steps[-1][0]), steps[-1][1])]
        return ReportData(
            pipeline=str(summary.get("pipeline", "")),
            latencies_s=list(latencies_s),
            completed_at_s=list(completed_at_s),
            replicas=replicas,
            split_s={role: split(samples) for role, samples in role_samples.items()},
            elapsed_s=elapsed,
            summary=dict(summary),
        )


def split(samples: Iterable[Mapping[str, float]]) -> tuple[float, float]:
    """(mean handler seconds, mean other seconds) per completed request over replicas."""
    handler = requests = count = 0.0
    for s in samples:
        handler += s.get("disagg_handler_seconds_sum", 0.0)
        requests += s.get("disagg_request_seconds_sum", 0.0)
        count += s.get("disagg_request_seconds_count", 0.0)
    if count <= 0:
        return 0.0, 0.0
    computing = min(handler, requests) / count
    return computing, max(0.0, requests / count - computing)


def throughput(completed_at_s: Sequence[float], elapsed_s: float) -> tuple[list[float], list[int]]:
    """Completions per 1 s bin: (bin starts, counts)."""
    bins = max(1, math.ceil(max([elapsed_s, *completed_at_s], default=0.0)))
    counts = [0] * bins
    for t in completed_at_s:
        counts[min(bins - 1, max(0, int(t)))] += 1
    return [float(i) for i in range(bins)], counts


def _draw(ax: Any, key: str, title: str, data: ReportData) -> None:
    ax.set_title(title)
    if key == "latency":
        ax.hist([1000 * x for x in data.latencies_s], bins=30, color="tab:blue")
        ax.set_xlabel("ms")
        ax.set_ylabel("requests")
    elif key == "throughput":
        starts, counts = throughput(data.completed_at_s, data.elapsed_s)
        ax.step(starts, counts, where="post", color="tab:green")
        ax.set_xlabel("s since the first request")
        ax.set_ylabel("requests/s")
        ax.set_ylim(bottom=0)
    elif key == "replicas":
        for role, steps in data.replicas.items():
            ax.step([t for t, _ in steps], [n for _, n in steps], where="post", label=role)
        ax.set_xlabel("s since the first request")
        ax.set_ylabel("replicas")
        ax.set_ylim(bottom=0)
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.legend(loc="best", fontsize="small")
    else:
        roles = list(data.split_s)
        computing = [1000 * data.split_s[r][0] for r in roles]
        other = [1000 * data.split_s[r][1] for r in roles]
        ax.barh(roles, computing, label="computing", color="tab:orange")
        ax.barh(roles, other, left=computing, label="queued and moving", color="tab:gray")
        ax.set_xlabel("ms per request (mean)")
        ax.legend(loc="best", fontsize="small")


def _figure(size: tuple[float, float]) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    return Figure(figsize=size, dpi=100, layout="constrained")


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def html(data: ReportData) -> str:
    """A self-contained HTML page with the four charts and the run's headline numbers."""
    s = data.summary
    head = (
        f"{s.get('completed', 0)}/{s.get('requests', 0)} completed, {s.get('failed', 0)} failed "
        f"in {s.get('elapsed_s', 0)} s; {s.get('throughput_rps', 0)} req/s; "
        f"p50 {s.get('p50_ms', 0)} ms, p99 {s.get('p99_ms', 0)} ms"
    )
    figures = []
    for key, title in CHARTS:
        fig = _figure((6.4, 3.6))
        _draw(fig.add_subplot(), key, title, data)
        image = base64.b64encode(_png(fig)).decode()
        figures.append(
            f'<figure><img id="{key}" alt="{title}" src="data:image/png;base64,{image}">'
            f"<figcaption>{title}</figcaption></figure>"
        )
    images = "\n".join(figures)
    name = html_text.escape(data.pipeline)
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>disagg up: {name}'
        f"</title></head>\n<body><h1>disagg up: {name}</h1>\n<p>{html_text.escape(head)}</p>\n"
        f"{images}\n</body></html>\n"
    )


def png(data: ReportData) -> bytes:
    """The four charts in one 2 x 2 PNG."""
    fig = _figure((12.8, 7.2))
    fig.suptitle(f"disagg up: {data.pipeline}")
    for ax, (key, title) in zip(fig.subplots(2, 2).flat, CHARTS, strict=True):
        _draw(ax, key, title, data)
    return _png(fig)


def write(path: str, data: ReportData) -> None:
    """HTML unless `path` ends in .png."""
    if path.lower().endswith(".png"):
        with open(path, "wb") as f:
            f.write(png(data))
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(html(data))
