"""Coordinated rollouts, end to end against the emulator: the real operator (kopf, in this
event loop) steps StatefulSet partitions while a StatefulSet controller, played here one pod
per tick the way the real one moves pods (highest ordinal first, only at or above the
partition), updates the pods. What the controller observes is the ground truth."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from disagg_operator import names
from disagg_operator.reconcile.metrics import ROLLOUT_PHASES, Metrics
from tests.integration import operator_support as s
from tests.k8s.server import EmulatorThread

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]
NS = s.NS
NAME = "paired"
UNITS = ("prefill", "decode")


def doc(image: str, **rollout: Any) -> dict[str, Any]:
    d = s.pipeline_doc(
        NAME,
        [{"name": "prefill", "replicas": 4, "image": image}, {"name": "decode", "replicas": 4}],
        [{"from": "prefill", "to": "decode"}],
    )
    d["spec"]["roles"][1]["image"] = image
    d["spec"]["rollout"] = {"maxSkew": "25%", "groups": [["prefill", "decode"]], **rollout}
    return d


class Controller:
    """Plays the StatefulSet controller for the pipeline's StatefulSets: per tick, at most
    one pod per StatefulSet moves to the update revision (the template-hash annotation);
    `stuck` units never get their new pods ready. `seen`: per tick, each unit's fraction of
    pods off its `baseline` revision (once set), i.e. at the new revision."""

    def __init__(self, k8s: EmulatorThread, stuck: frozenset[str] = frozenset()) -> None:
        self.k8s = k8s
        self.stuck = stuck
        self.pods: dict[str, list[str]] = {}
        self.revisions: dict[str, str] = {}  # the update revision of each StatefulSet
        self.baseline: dict[str, str] = {}  # revisions before the change under test
        self.seen: list[dict[str, float]] = []  # updated fraction per unit, every tick

    def tick(self) -> None:
        fractions = {}
        for sts in self.k8s.list(s.STS, NS, f"{names.LABEL_PIPELINE}={NAME}"):
            name = sts["metadata"]["name"]
            unit = name.removeprefix(f"{NAME}-")
            revision = sts["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH]
            n = sts["spec"].get("replicas", 1)  # absent (an HPA's to set): Kubernetes' default
            partition = sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"]
            pods = self.pods.setdefault(name, [revision] * n)
            self.resize(sts, pods)  # from this listing: a later one may say other replicas
            self.revisions[name] = revision
            moving = next(
                (i for i in reversed(range(n)) if i >= partition and pods[i] != revision), None
            )
            if moving is not None:
                pods[moving] = revision
            updated = sum(p == revision for p in pods)
            not_ready = 1 if moving is not None or (unit in self.stuck and updated) else 0
            current = pods[0] if updated < n else revision
            self.k8s.patch_status(
                s.STS,
                name,
                {
                    "observedGeneration": sts["metadata"]["generation"],
                    "replicas": n,
                    "readyReplicas": n - not_ready,
                    "updatedReplicas": updated,
                    "currentReplicas": n - updated,
                    "currentRevision": current,
                    "updateRevision": revision,
                },
                NS,
            )
            old = self.baseline.get(name)
            fractions[unit] = sum(p != old for p in pods) / n if old else updated / n
        if fractions:
            self.seen.append(fractions)

    def resize(self, sts: dict[str, Any], pods: list[str]) -> None:
        """Follow a change of spec.replicas (this one does not: a subclass does)."""

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Controller]:
        async def loop() -> None:
            while True:
                await asyncio.to_thread(self.tick)
                await asyncio.sleep(0.05)

        task = asyncio.create_task(loop())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def settled(k8s: EmulatorThread, controller: Controller) -> None:
    await s.until(k8s, lambda: len(controller.revisions) == 2, "both StatefulSets")
    await s.until(k8s, lambda: rollout_phase(k8s) == "Complete", "a settled status")


async def moved(k8s: EmulatorThread, controller: Controller, old: dict[str, str]) -> None:
    await s.until(
        k8s,
        lambda: all(controller.revisions[n] != r for n, r in old.items()),
        "the new revision",
        30,
    )


def phase_metric(metrics: Metrics) -> str:
    """The phase whose disagg_operator_rollout_phase series is 1 ("" if none)."""
    for phase in ROLLOUT_PHASES:
        labels = {"pipeline_namespace": NS, "pipeline": NAME, "phase": phase}
        if metrics.value("disagg_operator_rollout_phase", labels) == 1:
            return phase
    return ""


def rollout_phase(k8s: EmulatorThread) -> str:
    return str((s.pipeline_status(k8s, NAME).get("rollout") or {}).get("phase", ""))


def all_at_new_revision(controller: Controller, old: dict[str, str]) -> bool:
    """Every StatefulSet has a new update revision and every pod runs it."""
    moved = all(controller.revisions[name] != rev for name, rev in old.items())
    pods = controller.pods.values()
    return (
        moved
        and all(p == controller.revisions[n] for n, ps in controller.pods.items() for p in ps)
        and bool(pods)
    )


async def test_coupled_roles_roll_within_max_skew_and_complete(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    controller = Controller(k8s)
    async with s.running_operator(k8s), controller.running():
        await s.call(k8s.create, doc("ghcr.io/disagg/runtime:0.1.0"), NS)
        await settled(k8s, controller)
        start, old = len(controller.seen), dict(controller.revisions)
        controller.baseline = old
        new = doc("ghcr.io/disagg/runtime:0.2.0")
        await s.call(k8s.patch, s.PIPELINES, NAME, {"spec": new["spec"]}, NS)
        await s.until(k8s, lambda: all_at_new_revision(controller, old), "every pod updated", 120)
        await s.until(k8s, lambda: rollout_phase(k8s) == "Complete", "Complete", 30)
    during = controller.seen[start:]
    skews = [max(f.values()) - min(f.values()) for f in during]
    print(f"rollout: {len(during)} observations, max skew {max(skews):.2f} (maxSkew 0.25)")
    assert max(skews) <= 0.25 + 1e-9
    assert any(0 < f["prefill"] < 1 for f in during)  # it went in steps, not at once


async def test_a_step_that_never_gets_ready_stalls_with_an_event(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    controller = Controller(k8s)
    events: list[tuple[str, str, str]] = []
    metrics = Metrics()
    async with s.running_operator(k8s, events=events, metrics=metrics), controller.running():
        await s.call(k8s.create, doc("ghcr.io/disagg/runtime:0.1.0", stepDeadlineSeconds=2), NS)
        await settled(k8s, controller)
        assert phase_metric(metrics) == "Complete"
        controller.stuck = frozenset({"decode"})
        old = controller.baseline = dict(controller.revisions)
        new = doc("ghcr.io/disagg/runtime:0.2.0", stepDeadlineSeconds=2)
        await s.call(k8s.patch, s.PIPELINES, NAME, {"spec": new["spec"]}, NS)
        await s.until(k8s, lambda: rollout_phase(k8s) == "Stalled", "Stalled", 60)
        await moved(k8s, controller, old)
        assert any(reason == "RolloutStalled" for _, reason, _ in events)
        await s.until(k8s, lambda: phase_metric(metrics) == "Stalled", "the phase metric", 10)
        replicas = {
            state: metrics.value(
                "disagg_operator_role_replicas",
                {"pipeline_namespace": NS, "pipeline": NAME, "role": "decode", "state": state},
            )
            for state in ("desired", "ready", "updated")
        }
        desired = replicas["desired"] or 0
        assert desired > 0 and (replicas["ready"] or 0) < desired, replicas  # stuck pods
        held = dict(controller.seen[-1])
        await asyncio.sleep(1.0)
        assert controller.seen[-1] == held  # nothing advances while stalled
        # paused holds too; the fix (pods get ready) lets it finish
        controller.stuck = frozenset()
        await s.until(k8s, lambda: all_at_new_revision(controller, old), "every pod updated", 120)


async def test_paused_holds_the_rollout(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    controller = Controller(k8s)
    async with s.running_operator(k8s), controller.running():
        await s.call(k8s.create, doc("ghcr.io/disagg/runtime:0.1.0"), NS)
        await settled(k8s, controller)
        old = controller.baseline = dict(controller.revisions)
        paused = doc("ghcr.io/disagg/runtime:0.2.0", paused=True)
        await s.call(k8s.patch, s.PIPELINES, NAME, {"spec": paused["spec"]}, NS)
        await s.until(k8s, lambda: rollout_phase(k8s) == "Paused", "Paused", 30)
        await moved(k8s, controller, old)
        await asyncio.sleep(1.0)
        assert controller.seen[-1] == {"prefill": 0.0, "decode": 0.0}
        resumed = doc("ghcr.io/disagg/runtime:0.2.0", paused=False)
        await s.call(k8s.patch, s.PIPELINES, NAME, {"spec": resumed["spec"]}, NS)
        await s.until(k8s, lambda: all_at_new_revision(controller, old), "every pod updated", 120)
