"""Request timelines from a span file (`disagg up --trace`): where the slowest ones waited.

Reads the JSON lines tracing/spanfile.py writes. A trace is one request: its root span
(the caller's: `disagg up`'s or the gateway's) and one span per role visit, whose
children say how its time went:

    queued    the `queue` child (received -> a worker took it)
    computing the `handler` child
    moving    the `send ...` children (hand-offs to the next role or the client)

Pure but for `load`; lines that do not parse are skipped (a run killed mid-write).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Visit:
    role: str
    start_ns: int
    total_ms: float
    queued_ms: float = 0.0
    computing_ms: float = 0.0
    moving_ms: float = 0.0
    failed: bool = False


@dataclass(frozen=True)
class Timeline:
    trace_id: str
    name: str
    total_ms: float
    visits: tuple[Visit, ...] = field(default=())
    failed: bool = False


def load(path: str) -> list[dict[str, Any]]:
    spans = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("trace_id") and record.get("span_id"):
                spans.append(record)
    return spans


def _ms(span: dict[str, Any]) -> float:
    return max(0, int(span.get("end_ns", 0)) - int(span.get("start_ns", 0))) / 1e6


def timelines(spans: Iterable[dict[str, Any]]) -> list[Timeline]:
    """One timeline per trace that has a root span, slowest first."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        by_trace[str(span["trace_id"])].append(span)
    out = []
    for trace_id, members in by_trace.items():
        ids = {s["span_id"] for s in members}
        roots = [s for s in members if s.get("parent_id", "") not in ids]
        roots = [s for s in roots if s.get("kind") in ("client", "server")] or roots
        if not roots:
            continue
        root = min(roots, key=lambda s: int(s.get("start_ns", 0)))
        children: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for s in members:
            children[str(s.get("parent_id", ""))].append(s)
        visits = [_visit(s, children[s["span_id"]]) for s in members if s.get("kind") == "consumer"]
        visits.sort(key=lambda v: v.start_ns)
        out.append(
            Timeline(
                trace_id,
                str(root.get("name", "")),
                _ms(root),
                tuple(visits),
                str(root.get("status", "ok")) != "ok" or any(v.failed for v in visits),
            )
        )
    return sorted(out, key=lambda t: -t.total_ms)


def _visit(span: dict[str, Any], children: list[dict[str, Any]]) -> Visit:
    def took(pick: str) -> float:
        return sum(_ms(c) for c in children if str(c.get("name", "")).startswith(pick))

    return Visit(
        role=str(span.get("name", "")),
        start_ns=int(span.get("start_ns", 0)),
        total_ms=_ms(span),
        queued_ms=took("queue"),
        computing_ms=took("handler"),
        moving_ms=took("send "),
        failed=str(span.get("status", "ok")) != "ok",
    )


def render(lines: list[Timeline], *, slowest: int = 3) -> list[str]:
    """The slowest requests, role by role."""
    out = []
    for t in lines[:slowest]:
        mark = " (failed)" if t.failed else ""
        out.append(f"  trace {t.trace_id}: {t.total_ms:.1f} ms{mark}")
        for v in t.visits:
            fail = " failed" if v.failed else ""
            out.append(
                f"    {v.role:<16} queued {v.queued_ms:8.2f} ms  computing {v.computing_ms:8.2f}"
                f" ms  moving {v.moving_ms:8.2f} ms{fail}"
            )
    return out
