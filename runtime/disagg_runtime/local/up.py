"""`disagg up FILE`: start the pipeline locally, drive synthetic requests, summarize, stop.

Requests come from the entry role's handler module: `sample_input(handler_name, i)` if it
defines one (the demo handlers do), else a small default payload. At most `concurrency`
requests are in flight. The summary is the same with or without `--json`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from disagg_core import contract
from disagg_core.spec import ROOT, SpecError, load_pipeline_file
from disagg_runtime.client import Client
from disagg_runtime.local.autoscaler import LocalAutoscaler
from disagg_runtime.local.supervisor import LocalPipeline, RoleProcess, dump_json
from disagg_runtime.local.trace import RunTrace
from disagg_runtime.role.handler import input_factory
from disagg_runtime.wire import codec


@dataclass
class Tally:
    """Outcomes of the driven requests (callbacks run on the client's thread)."""

    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    submitted: int = 0
    input_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = field(default_factory=time.monotonic)
    completed_at: list[float] = field(default_factory=list)  # s since started (--report)

    @property
    def done(self) -> int:
        return len(self.latencies) + self.failed

    def record(self, started: float, future: Future[Any]) -> None:
        with self.lock:
            exc = future.exception()
            if exc is None:
                now = time.monotonic()
                self.latencies.append(now - started)
                self.completed_at.append(now - self.started)
            else:
                self.failed += 1
                if len(self.errors) < 5:
                    self.errors.append(str(exc))


def _recorder(tally: Tally, slots: threading.Semaphore, t0: float) -> Callable[[Future[Any]], None]:
    def done(future: Future[Any]) -> None:
        tally.record(t0, future)
        slots.release()

    return done


def drive(
    client: Client,
    make: Callable[[int], Any],
    *,
    requests: int,
    concurrency: int,
    duration: float | None,
    stop: threading.Event,
    progress: Callable[[Tally, float], None],
    trace: RunTrace | None = None,
) -> tuple[Tally, float]:
    tally = Tally()
    slots = threading.Semaphore(concurrency)
    started = time.monotonic()
    i = 0
    while not stop.is_set():
        if duration is not None and time.monotonic() - started >= duration:
            break
        if duration is None and i >= requests:
            break
        if not slots.acquire(timeout=0.1):
            progress(tally, time.monotonic() - started)
            continue
        if stop.is_set():  # a role died while we waited for a slot: send nothing more
            slots.release()
            break
        payload = make(i)
        tally.input_bytes += codec.payload_nbytes(payload)
        t0 = time.monotonic()
        span = trace.request(i) if trace is not None else None
        future = client.submit_async(payload, trace=span.traceparent if span else "")
        tally.submitted += 1
        if span is not None:
            future.add_done_callback(RunTrace.ender(span))
        future.add_done_callback(_recorder(tally, slots, t0))
        i += 1
        progress(tally, time.monotonic() - started)
    while tally.done < tally.submitted:
        time.sleep(0.05)
        progress(tally, time.monotonic() - started)
    return tally, time.monotonic() - started


def _bar(total: int | None) -> Callable[[Tally, float], None]:
    last = [0.0]

    def show(tally: Tally, elapsed: float) -> None:
        now = time.monotonic()
        if not sys.stderr.isatty() or now - last[0] < 0.1:
            return
        last[0] = now
        width = 30
        frac = tally.done / total if total else min(1.0, elapsed / 1e9)
        filled = int(width * frac)
        rate = tally.done / elapsed if elapsed else 0.0
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {tally.done}/{total or '?'} "
            f"ok={len(tally.latencies)} failed={tally.failed} {rate:.1f} req/s"
        )
        sys.stderr.flush()

    return show


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


_EDGE_KEY = re.compile(r"^disagg_edge_(messages|bytes)_total\{(.*)\}$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def edges(samples: Mapping[str, Mapping[str, float]]) -> list[dict[str, Any]]:
    """One entry per edge from every replica's counters: `{"from", "to", "relay", "messages",
    "bytes"}`, where `relay` is what actually carried its messages (comma-joined if several
    did) and `bytes` what was sent on it."""
    found: dict[str, dict[str, Any]] = {}
    for sample in samples.values():
        for key, value in sample.items():
            match = _EDGE_KEY.match(key)
            if not match:
                continue
            labels = dict(_LABEL.findall(match.group(2)))
            if match.group(1) == "bytes" and labels.get("direction") != "out":
                continue
            source, _, target = labels.get("edge", "").partition("->")
            entry = found.setdefault(
                labels.get("edge", ""),
                {"from": source, "to": target, "relays": set(), "messages": 0, "bytes": 0},
            )
            if match.group(1) == "messages":
                entry["messages"] += int(value)
                if value:
                    entry["relays"].add(labels.get("relay", ""))
            else:
                entry["bytes"] += int(value)
    return [
        {
            "from": e["from"],
            "to": e["to"],
            "relay": ",".join(sorted(e["relays"])),
            "messages": e["messages"],
            "bytes": e["bytes"],
        }
        for _, e in sorted(found.items())
    ]


def summarize(local: LocalPipeline, tally: Tally, elapsed: float, ready_s: float) -> dict[str, Any]:
    samples = local.metrics()
    roles: dict[str, dict[str, Any]] = {}
    moved = tally.input_bytes
    for rp in local.processes:
        stats = roles.setdefault(
            rp.config.role,
            {
                "replicas": 0,
                "completed": 0,
                "failed": 0,
                "_sum": 0.0,
                "_count": 0.0,
                "by_replica": {},
            },
        )
        stats["replicas"] += 1
        s = samples.get(rp.label, {})
        done = int(s.get('disagg_requests_total{outcome="done"}', 0))
        stats["completed"] += done
        stats["by_replica"][str(rp.config.replica)] = done  # each one's share of the work
        stats["failed"] += int(s.get('disagg_requests_total{outcome="failed"}', 0))
        stats["_sum"] += s.get("disagg_request_seconds_sum", 0.0)
        stats["_count"] += s.get("disagg_request_seconds_count", 0.0)
        moved += int(
            sum(
                v
                for k, v in s.items()
                if k.startswith("disagg_edge_bytes_total") and 'direction="out"' in k
            )
        )
    for stats in roles.values():
        total, count = stats.pop("_sum"), stats.pop("_count")
        stats["mean_ms"] = round(1000 * total / count, 3) if count else 0.0
    lat = tally.latencies
    return {
        "pipeline": local.pipeline.name,
        "requests": tally.submitted,
        "completed": len(lat),
        "failed": tally.failed,
        "p50_ms": round(1000 * statistics.median(lat), 3) if lat else 0.0,
        "p99_ms": round(1000 * _percentile(lat, 0.99), 3),
        "throughput_rps": round(len(lat) / elapsed, 3) if elapsed else 0.0,
        "bytes_moved": moved,
        "elapsed_s": round(elapsed, 3),
        "ready_s": round(ready_s, 3),
        "roles": roles,
        "edges": edges(samples),
        "died": list(local.deaths),
        "restarts": local.restarts.counts(),
        "restart_events": list(local.restarts.events),
        "logs": local.workdir if local.deaths else None,
        "errors": list(tally.errors),
    }


def render(summary: dict[str, Any]) -> str:
    lines = [
        f"pipeline {summary['pipeline']}: {summary['completed']}/{summary['requests']} completed, "
        f"{summary['failed']} failed in {summary['elapsed_s']:.1f} s "
        f"({summary['throughput_rps']:.1f} req/s; ready in {summary['ready_s']:.1f} s)",
        f"latency p50 {summary['p50_ms']:.1f} ms, p99 {summary['p99_ms']:.1f} ms; "
        f"{summary['bytes_moved'] / 2**20:.1f} MiB moved",
        f"{'role':<20}{'replicas':>9}{'completed':>11}{'failed':>8}{'mean ms':>10}",
    ]
    for name, r in summary["roles"].items():
        lines.append(
            f"{name:<20}{r['replicas']:>9}{r['completed']:>11}{r['failed']:>8}{r['mean_ms']:>10.1f}"
        )
    lines += [
        f"edge {e['from']} -> {e['to']} over {e['relay'] or '-'}: {e['messages']} messages, "
        f"{e['bytes'] / 2**20:.1f} MiB"
        for e in summary.get("edges", [])
    ]
    lines += [
        f"scaled {e['role']} {e['from']} -> {e['to']} at {e['time_s']:.1f} s: {e['reason']}"
        for e in summary.get("scale_events", [])
    ]
    lines += [f"died: {d}" for d in summary["died"]]
    lines += [f"restarted: {e}" for e in summary.get("restart_events", [])]
    if summary.get("logs"):
        lines.append(f"role logs kept in {summary['logs']}")
    lines += [f"error: {e}" for e in summary["errors"]]
    if summary.get("trace"):
        t = summary["trace"]
        lines.append(f"trace: {t['spans']} spans of {t['requests']} requests in {t['file']}")
        lines += ["slowest requests:", *t["slowest"]] if t["slowest"] else []
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    try:
        pipeline = load_pipeline_file(args.file, environ=os.environ)
    except SpecError as exc:
        for p in exc.problems:
            print(f"{args.file}: {p.path or ROOT}: {p.reason}", file=sys.stderr)
        return 1
    if pipeline.engine_roles:  # vLLM engines, not role processes (local/engine_up.py)
        from disagg_runtime.local import engine_up

        return engine_up.run(pipeline, args)
    stop = threading.Event()
    serving = getattr(args, "serve", False)
    restart = not getattr(args, "fail_fast", False) if serving else getattr(args, "restart", False)
    local = LocalPipeline(pipeline, grace_s=args.grace, dispatch=args.dispatch, restart=restart)
    client: Client | None = None
    summary: dict[str, Any] | None = None
    interrupted = False

    def died(rp: RoleProcess, code: int) -> None:
        if local.restart:
            return  # started again (restarts.py); what it held moves (migration.py)
        stop.set()  # submit nothing more; fail what is in flight with the reason
        if client is not None:
            client.fail_all(f"role {rp.label} died (exit code {code})", role=rp.config.role)

    local.on_death = died
    trace: RunTrace | None = None
    if getattr(args, "trace", None):
        try:
            trace = RunTrace(args.trace, pipeline.name)
        except (RuntimeError, OSError) as exc:  # TracingUnavailable: what to install
            print(f"disagg up: --trace: {exc}", file=sys.stderr)
            return 2
    for name, value in contract.tracing_env(pipeline).items():  # spec.monitoring.tracing
        os.environ.setdefault(name, value)  # the roles inherit it; the shell's own wins
    if serving:
        try:
            return _serve(local, args)
        finally:
            if trace is not None:
                trace.close()
                print(f"spans written to {trace.path}", file=sys.stderr)
    scaler: LocalAutoscaler | None = None
    try:
        local.start()
        ready_s = local.wait_ready(timeout=args.ready_timeout)
        client = local.client(timeout=args.timeout)
        if args.autoscale:
            scaler = LocalAutoscaler(local, interval_s=args.autoscale_interval)
            scaler.start()
        make = input_factory(pipeline)
        tally, elapsed = drive(
            client,
            make,
            requests=args.requests,
            concurrency=args.concurrency,
            duration=args.duration,
            stop=stop,
            progress=_bar(None if args.duration else args.requests),
            trace=trace,
        )
        if sys.stderr.isatty():
            sys.stderr.write("\n")
        if scaler is not None:
            stop.wait(max(0.0, args.cooldown))  # idle: let the autoscaler scale down
            scaler.stop()
        summary = summarize(local, tally, elapsed, ready_s)
        if scaler is not None:
            for role, report in scaler.report().items():
                summary["roles"][role].update(report)
            summary["scale_events"] = scaler.events
        if getattr(args, "report", None):
            _report(args.report, local, summary, tally)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping every role", file=sys.stderr)
    except (RuntimeError, TimeoutError) as exc:
        print(f"disagg up: {exc}", file=sys.stderr)
        return 1
    finally:
        if scaler is not None:
            scaler.stop()
        if client is not None:
            client.close()
        local.stop()
        if trace is not None:
            trace.close()
    if interrupted or summary is None:
        return 130
    if trace is not None:  # the roles flushed their spans as they stopped
        summary["trace"] = trace.summary()
    if args.json:
        dump_json(summary, sys.stdout)
    else:
        print(render(summary))
    return 0 if summary["failed"] == 0 and not summary["died"] else 1


def _report(path: str, local: LocalPipeline, summary: dict[str, Any], tally: Tally) -> None:
    """`--report FILE`: the run's charts (disagg_runtime/observe/report.py, matplotlib)."""
    from disagg_runtime.observe import report

    samples = local.metrics()
    by_role: dict[str, list[dict[str, float]]] = {}
    for rp in local.processes:
        by_role.setdefault(rp.config.role, []).append(samples.get(rp.label, {}))
    data = report.ReportData.of(
        summary,
        latencies_s=tally.latencies,
        completed_at_s=tally.completed_at,
        role_samples=by_role,
    )
    report.write(path, data)
    print(f"report written to {path}", file=sys.stderr)


def _serve(local: LocalPipeline, args: argparse.Namespace) -> int:
    """`--serve`: start, wait until ready, serve HTTP until Ctrl-C/SIGTERM, stop."""
    from disagg_runtime.local.serve import serve

    try:
        local.start()
        local.wait_ready(timeout=args.ready_timeout)
        return serve(
            local,
            host=args.host,
            port=args.port,
            token=args.token or "",
            timeout=args.timeout,
            unix=args.unix,
        )
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"disagg up: {exc}", file=sys.stderr)
        return 1
    finally:
        local.stop()
