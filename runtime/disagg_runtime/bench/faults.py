"""`disagg bench faults`: requests lost per 1,000 while a pipeline changes under steady load.

One local pipeline, `front` -> `middle` (2 replicas, each request held `hold_s`) ->
`sink`, real `disagg role` processes restarted when they die (`disagg up --serve`'s
supervision). `load` threads submit back to back for the whole run; the run goes through
phases, and each request counts in the phase it ended in (a change hits what is in flight
when it comes: counted by when they started, the kill's losses fell in `steady`):

    steady      nothing changes (the baseline: what is lost with no change at all)
    kill        kill -9 of middle/1; it is restarted and taken back once ready
    scale-down  middle 2 -> 1 (the replica stops taking work, drains, goes), then 1 -> 2
    rollout     each middle replica replaced in turn: a new one started and ready, then
                the old one retired

`--without-migration` runs the same with `migrationAttempts: 0` (the baseline: what the
same changes lose when nothing is resent). A request is lost when it fails (none of these
stream, so every failure is one that streamed nothing and should have moved to a live
replica). Each phase reports requests, failures, lost per 1,000 and its slowest request.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg_core.spec import Pipeline, parse_pipeline
from disagg_runtime.client import Client, RequestFailed
from disagg_runtime.local.supervisor import LocalPipeline

PHASES = ("steady", "kill", "scale-down", "rollout")


def pipeline(timeout_s: float = 30.0, migration_attempts: int = 3) -> Pipeline:
    roles = [
        {"name": "front", "handler": "disagg_runtime.bench.handlers:identity"},
        {
            "name": "middle",
            "handler": "disagg_runtime.bench.handlers:hold",
            "replicas": 2,
            "concurrency": 4,
        },
        {"name": "sink", "handler": "disagg_runtime.bench.handlers:summarize"},
    ]
    return parse_pipeline(
        {
            "apiVersion": "disagg.dev/v1alpha1",
            "kind": "DisaggregatedPipeline",
            "metadata": {"name": "bench-faults"},
            "spec": {
                "image": "local",
                "transport": {
                    "poolSize": "16Mi",
                    "requestTimeoutSeconds": timeout_s,
                    "migrationAttempts": migration_attempts,
                },
                "roles": roles,
                "edges": [{"from": "front", "to": "middle"}, {"from": "middle", "to": "sink"}],
            },
        }
    )


@dataclass
class Phase:
    name: str
    ok: int = 0
    failed: int = 0
    slowest_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def count(self, seconds: float, error: str | None) -> None:
        self.slowest_s = max(self.slowest_s, seconds)
        if error is None:
            self.ok += 1
            return
        self.failed += 1
        if len(self.errors) < 3:
            self.errors.append(error)

    def report(self) -> dict[str, Any]:
        total = self.ok + self.failed
        return {
            "phase": self.name,
            "requests": total,
            "failed": self.failed,
            "lost_per_1000": round(1000 * self.failed / total, 2) if total else 0.0,
            "slowest_s": round(self.slowest_s, 3),
            "errors": self.errors,
        }


class Load:
    """`threads` senders, each request counted in the phase current when it ended."""

    def __init__(self, client: Client, threads: int, hold_s: float) -> None:
        self.client = client
        self.hold_s = hold_s
        self.phase = Phase("steady")
        self.phases = [self.phase]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._send, args=(i,), daemon=True) for i in range(threads)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def enter(self, name: str) -> None:
        with self._lock:
            self.phase = Phase(name)
            self.phases.append(self.phase)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.client.timeout + 10)

    def _send(self, seed: int) -> None:
        x = torch.full((4096,), float(seed))
        while not self._stop.is_set():
            began = time.monotonic()
            error = None
            try:
                self.client.submit({"x": x, "hold": self.hold_s})
            except RequestFailed as exc:
                error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.phase.count(time.monotonic() - began, error)


def _wait(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench faults: {what} not within {timeout_s:g} s")
        time.sleep(0.1)


def run(
    *, phase_s: float = 3.0, threads: int = 8, hold_s: float = 0.05, migration_attempts: int = 3
) -> dict[str, Any]:
    local = LocalPipeline(pipeline(migration_attempts=migration_attempts), restart=True)
    with local:
        local.wait_ready()
        client = local.client()
        load = Load(client, threads, hold_s)
        try:
            load.start()
            time.sleep(phase_s)
            load.enter("kill")
            victim = next(rp for rp in local.live("middle") if rp.config.replica == 1)
            victim.proc.kill()
            _wait(
                lambda: (
                    any(rp.ready and rp.proc is not victim.proc for rp in local.live("middle"))
                    and len([rp for rp in local.live("middle") if rp.ready]) == 2
                ),
                60,
                "middle/1 restarted",
            )
            time.sleep(phase_s)
            load.enter("scale-down")
            local.scale("middle", 1)
            time.sleep(phase_s / 2)
            local.scale("middle", 2)
            time.sleep(phase_s / 2)
            load.enter("rollout")
            for old in sorted(local.live("middle"), key=lambda rp: rp.config.replica):
                local.scale("middle", len(local.live("middle")) + 1)  # the new one, ready
                local.retire([old])
            time.sleep(phase_s / 2)
        finally:
            load.stop()
            migrations = client.migrations
            client.close()
        restarts = local.restarts.counts()
    return {
        "migration_attempts": migration_attempts,
        "phases": [p.report() for p in load.phases],
        "moved": migrations,
        "restarts": restarts,
    }


def run_cli(args: argparse.Namespace) -> int:
    attempts = 0 if args.without_migration else 3
    result = run(phase_s=args.phase_seconds, threads=args.concurrency, migration_attempts=attempts)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for p in result["phases"]:
            print(
                f"{p['phase']:<11} {p['requests']:>6} requests, {p['failed']:>4} failed: "
                f"{p['lost_per_1000']:>7.2f} lost per 1,000 (slowest {p['slowest_s']:.2f} s)"
            )
            for error in p["errors"]:
                print(f"    {error}", file=sys.stderr)
        print(f"moved to a live replica: {result['moved']}; restarted: {result['restarts']}")
    return 0 if all(p["failed"] == 0 for p in result["phases"]) else 1
