"""The bench's verdicts (targets met or missed) and its human-readable table."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from disagg_operator.bench.config import TARGET_BURST_S, TARGET_P50_S, target_rss_mib


def targets_met(result: Mapping[str, Any]) -> dict[str, bool | None]:
    """Each target: met, missed, or None when not measured."""
    p50 = (result.get("latency") or {}).get("p50_s")
    burst = result.get("burst") or {}
    rss = (result.get("operator") or {}).get("rss_peak_mib")
    reconciled = burst.get("reconciled_s") if burst.get("complete") else None
    return {
        "latency_p50": None if p50 is None else p50 <= TARGET_P50_S,
        "burst_reconciled": (
            None if not burst.get("pipelines") else (reconciled or math.inf) <= TARGET_BURST_S
        ),
        "rss_peak": None if rss is None else rss < target_rss_mib(burst.get("pipelines") or 0),
    }


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} MiB"


def _num(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.1f}{unit}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} % of one core"


def format_table(result: Mapping[str, Any]) -> str:
    """The human-readable report (what was measured, also when a phase failed)."""
    latency = result.get("latency") or {}
    burst = result.get("burst") or {}
    operator = result.get("operator") or {}
    met = result.get("met") or {}
    cleanup = result.get("cleanup") or {}
    api = result.get("api") or {}
    cpu = burst.get("cpu") or {}

    def verdict(key: str) -> str:
        return {True: "ok", False: "MISSED", None: ""}[met.get(key)]

    n = burst.get("pipelines", 0)
    rows = [
        ("metric", "value", "target", ""),
        (
            f"one pipeline, children present p50 (n={latency.get('samples', 0)})",
            _secs(latency.get("p50_s")),
            f"<= {TARGET_P50_S:g} s",
            verdict("latency_p50"),
        ),
        ("one pipeline, children present p90", _secs(latency.get("p90_s")), "", ""),
        ("one pipeline, children present max", _secs(latency.get("max_s")), "", ""),
        (f"{n} pipelines at once, all children present", _secs(burst.get("children_s")), "", ""),
        (
            f"{n} pipelines at once, all reconciled",
            _secs(burst.get("reconciled_s")),
            f"<= {TARGET_BURST_S:g} s",
            verdict("burst_reconciled"),
        ),
        ("operator RSS after start-up", _mib(operator.get("rss_idle_mib")), "", ""),
        ("operator RSS after the burst", _mib(operator.get("rss_after_burst_mib")), "", ""),
        (
            "operator peak RSS (VmHWM)",
            _mib(operator.get("rss_peak_mib")),
            f"< {target_rss_mib(n):g} MiB",
            verdict("rss_peak"),
        ),
        ("operator ERROR lines logged", str(operator.get("errors_logged", "-")), "", ""),
        ("burst: operator CPU", _share(cpu.get("operator_share")), "", ""),
        ("burst: API server CPU", _share(cpu.get("server_share")), "", ""),
        (
            "burst: API requests per pipeline (operator)",
            _num((api.get("burst") or {}).get("per_pipeline")),
            "",
            "",
        ),
        (
            "steady state: API requests per minute",
            _num((api.get("steady") or {}).get("per_minute")),
            "",
            "",
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        f"disagg bench operator: {result.get('server')} (Kubernetes "
        f"{result.get('kubernetes_version')}), namespace {result.get('namespace')}",
        f"pipeline: {result.get('roles')} roles, {result.get('children_per_pipeline')} children"
        + ("" if operator.get("managed") else "; operator: external (not measured)"),
        "",
    ]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    top = (api.get("burst") or {}).get("by_request") or {}
    if top:
        lines.append("burst requests: " + ", ".join(f"{k} {v:g}" for k, v in list(top.items())[:8]))
    if burst.get("pipelines") and not burst.get("complete"):
        lines.append(f"burst incomplete: {burst.get('reconciled')}/{n} reconciled in time")
    if result.get("error"):
        lines.append(f"FAILED in {result.get('failed_phase')}: {result['error']}")
    lines.append(
        "cleanup: "
        + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in cleanup.items() if v is not None)
    )
    return "\n".join(lines)
