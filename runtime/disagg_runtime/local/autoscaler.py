"""`disagg up --autoscale`: the operator's occupancy autoscaler, over local processes.

Every `interval` seconds: scrape each serving replica's pool occupancy and queue depth,
let `autoscale.Autoscaler` decide, and scale through `LocalPipeline.scale` (new replicas
join once ready; leaving ones are taken out of the peers file, then drained).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from disagg_core.autoscale import (
    Autoscaler,
    Decision,
    Policy,
    RatioLock,
    Sample,
    policy_of,
    signals,
)
from disagg_core.spec import Pipeline
from disagg_runtime.local.ports import HOST
from disagg_runtime.local.supervisor import LocalPipeline
from disagg_runtime.role.health import fetch, scrape

log = logging.getLogger(__name__)


def policies_of(pipeline: Pipeline) -> dict[str, Policy]:
    return {
        role.name: policy_of(role.autoscaling)
        for role in pipeline.roles
        if role.autoscaling is not None
    }


def locks_of(pipeline: Pipeline) -> list[RatioLock]:
    return [
        RatioLock(
            lock.leader, lock.follower, lock.leader_share, lock.follower_share, lock.tolerance
        )
        for lock in pipeline.ratio_locks
    ]


@dataclass
class LocalAutoscaler:
    local: LocalPipeline
    interval_s: float = 1.0
    events: list[dict[str, Any]] = field(default_factory=list)
    peak: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        pipeline = self.local.pipeline
        self.scaler = Autoscaler(policies_of(pipeline), locks_of(pipeline))
        self.initial = {r.name: len(self.local.live(r.name)) for r in pipeline.roles}
        self.peak = dict(self.initial)
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="disagg-up-autoscale", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception:  # the run goes on at the current size
                log.exception("autoscaling step failed")

    def samples(self, now: float) -> tuple[dict[str, int], dict[str, list[Sample]]]:
        current: dict[str, int] = {}
        samples: dict[str, list[Sample]] = {}
        for role in self.scaler.policies:
            replicas = self.local.live(role)
            current[role] = len(replicas)
            samples[role] = [
                self._sample(rp.label, rp.config.metrics_port, rp.ready, now) for rp in replicas
            ]
        return current, samples

    @staticmethod
    def _sample(label: str, port: int, ready: bool, now: float) -> Sample:
        occupancy: float | None = None
        queued = 0
        with contextlib.suppress(OSError, ValueError):
            status, body = fetch(f"http://{HOST}:{port}/metrics", 1.0)
            if status == 200:
                occupancy, queued = signals(scrape(body))
        return Sample(label, occupancy, queue_depth=queued, ready=ready, at=now)

    def step(self) -> list[Decision]:
        now = time.monotonic()
        current, samples = self.samples(now)
        decisions = [d for d in self.scaler.decide(now, current, samples).values() if d.changed]
        for decision in decisions:
            self.events.append(
                {
                    "time_s": round(now - self._started, 3),
                    "role": decision.role,
                    "from": decision.current,
                    "to": decision.desired,
                    "signal": decision.signal,
                    "reason": decision.reason,
                }
            )
            log.info(
                "scale %s %d -> %d: %s",
                decision.role,
                decision.current,
                decision.desired,
                decision.reason,
            )
            self.local.scale(decision.role, decision.desired)
            # when the new replicas joined the peers file (ready), or the leaving ones left
            self.events[-1]["done_s"] = round(time.monotonic() - self._started, 3)
            self.peak[decision.role] = max(self.peak.get(decision.role, 0), decision.desired)
        return decisions

    def report(self) -> dict[str, dict[str, int]]:
        return {
            role: {
                "replicas_initial": self.initial.get(role, 0),
                "replicas_max": self.peak.get(role, 0),
                "replicas_final": len(self.local.live(role)),
            }
            for role in self.initial
        }
