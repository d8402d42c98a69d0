"""Scope and high availability: an operator given namespaces leaves the others alone, and
with kopf peering only the highest-priority replica works; when it stops, the next takes
over.

The standby starts first here. Started while the leader is already up, a kopf 1.45.2
standby pauses its watch streams while their first requests are still in flight; kopf's
`request_cancel_callback` (kopf/_cogs/clients/api.py) then fails on
`asyncio.current_task()` being None in a done-callback, and in our runs that standby never
saw new objects after taking over. See the operator notes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from disagg_operator.reconcile.metrics import Metrics
from tests.integration import operator_support as s
from tests.k8s.server import EmulatorThread

PEERING_LOGGER = "kopf._core.engines.peering"

pytestmark = pytest.mark.asyncio
RECONCILES = "disagg_operator_reconcile_duration_seconds_count"


def namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def in_namespace(doc: dict[str, Any], ns: str, name: str) -> dict[str, Any]:
    doc["metadata"] = {"name": name, "namespace": ns}
    return doc


def reconciles(metrics: Metrics) -> float:
    return metrics.value(RECONCILES, {"kind": "spec"}) or 0.0


async def test_a_namespaced_operator_leaves_other_namespaces_alone(
    k8s: EmulatorThread, disagg_crd: Any
):
    k8s.apply_file(disagg_crd)
    k8s.create(namespace("team-a"))
    async with s.running_operator(k8s, namespaces=("team-a",)):
        await s.call(k8s.create, in_namespace(s.example(), s.NS, "outside"))
        await s.call(k8s.create, in_namespace(s.example(), "team-a", "inside"))
        await s.until(k8s, lambda: len(s.children(k8s, "inside", "team-a")) == 9, "inside")
        await asyncio.sleep(0.3)
        assert s.children(k8s, "outside") == {}
        assert s.pipeline_status(k8s, "outside") == {}


class PauseWatch(logging.Handler):
    """kopf's peering log: its "Pausing operations in favour of ..." line is written by the
    lower-priority operator as it turns its pause on (kopf/_core/engines/peering.py). A
    fixed sleep for it was too short on a loaded machine (the low one reconciled first)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.logger = logging.getLogger(PEERING_LOGGER)
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)  # the line is INFO; the root's default drops it
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Pausing operations in favour of"):
            self.loop.call_soon_threadsafe(self.seen.set)

    async def wait_for_pause(self, timeout: float = 60.0) -> None:
        try:
            await asyncio.wait_for(self.seen.wait(), timeout)
        finally:
            self.logger.removeHandler(self)
            self.logger.setLevel(self.level)
        await asyncio.sleep(0.2)  # the pause reaches the watch streams


async def test_with_peering_one_replica_works_and_the_next_takes_over(
    k8s: EmulatorThread, disagg_crd: Any
):
    k8s.apply_file(disagg_crd)
    k8s.apply(s.PEERING_CRD)
    k8s.create(s.peering("disagg"))
    low, high = Metrics(), Metrics()
    paused = PauseWatch()
    async with s.running_operator(k8s, peering="disagg", priority=10, metrics=low):
        await asyncio.sleep(1.0)  # the low one is up and watching
        async with s.running_operator(k8s, peering="disagg", priority=20, metrics=high):
            await paused.wait_for_pause()  # the lower one has seen the higher one
            await s.call(k8s.create, in_namespace(s.example(), s.NS, "first"))
            await s.until(k8s, lambda: len(s.children(k8s, "first")) == 9, "first")
            # counted when the reconcile returns, after its last child and status write
            await s.until(k8s, lambda: reconciles(high) >= 1, "the high one's reconcile")
            assert reconciles(low) == 0
        await s.call(k8s.create, in_namespace(s.example(), s.NS, "second"))
        await s.until(k8s, lambda: len(s.children(k8s, "second")) == 9, "taken over", 20)
        await s.until(k8s, lambda: reconciles(low) >= 1, "the low one's reconcile")
