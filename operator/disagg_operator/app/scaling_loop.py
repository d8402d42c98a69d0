"""The autoscaling loop: one asyncio task for the whole operator that runs a step for every
pipeline the reconciler tracks, every `interval` seconds.

Why one operator-wide task and not a kopf timer or daemon per pipeline: kopf puts its
finalizer on every object that has a timer or daemon, so a pipeline could not be deleted
while the operator is down (nothing else needs a finalizer: the children go with their
ownerReferences). A timer would also be one more kopf handler of the pipeline, with its own
bookkeeping and log lines every few seconds, and it would need a `when=` filter kept in step
with the spec. The task starts with the first pipeline handler, so it runs in kopf's context
(Events go through kopf's poster, as the handlers' do), and stops at cleanup.

A step, for a pipeline with autoscaled units (`autoscaling` has the rules):
1. read the pipeline (from the watch cache, `cache`; else with a GET); skip it when gone,
   being deleted or invalid;
2. its pods (from the cache; else one list), scrape every ready pod's role containers (at
   most `podmetrics.CONCURRENCY` scrapes in flight operator-wide, each with its own
   timeout), one `autoscale.Sample` per pod;
3. the pipeline's `autoscale.Autoscaler`, kept in its `PipelineState` (so stabilization
   windows span steps and reconciles), decides from the units' current replicas: the
   operator's intent (the last decision, else the spec). A fresh one does not scale down
   during its first down window;
4. changed units: `PipelineState.replicas` is set and the pipeline reconciled, so the
   planner puts the count into the StatefulSet and the operator's forced server-side apply
   writes it (over anyone else's value of spec.replicas);
5. the decisions are appended to status.scaleDecisions (the last ten), the counts recorded
   in status.autoscaledReplicas (what a restarted operator resumes from), and each decision
   posted as a Normal Event ScaledUp or ScaledDown on the pipeline.
A failing step is logged and tried again at the next interval; the other pipelines go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from disagg_core.autoscale import STALE_AFTER_S, Decision, Sample
from disagg_core.spec import SpecError
from disagg_operator.autoscaling import podmetrics
from disagg_operator.autoscaling import scaling as autoscaling
from disagg_operator.reconcile import apply, events, reconcile

DEFAULT_INTERVAL: Final = 15.0  # seconds, the HorizontalPodAutoscaler's sync period
PARALLEL_PIPELINES: Final = 16  # steps in flight at once

log = logging.getLogger(__name__)


@dataclass
class ScalingLoop:
    reconciler: reconcile.Reconciler
    interval: float = DEFAULT_INTERVAL  # <= 0: no autoscaling
    scrape_timeout: float = podmetrics.DEFAULT_TIMEOUT
    stale_after: float = STALE_AFTER_S
    monotonic: Callable[[], float] = time.monotonic
    _task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _scraper: podmetrics.Scraper | None = field(default=None, init=False, repr=False)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def ensure_started(self) -> None:
        """Start the loop unless it runs (call from a kopf handler: see the docstring)."""
        if self.interval > 0 and not self.running:
            self._task = asyncio.create_task(self._run(), name="disagg-autoscaler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._scraper is not None:
            await self._scraper.close()
            self._scraper = None

    async def _run(self) -> None:
        await asyncio.sleep(self.interval)  # the first step one interval after the start
        while True:
            started = self.monotonic()
            await self.tick()
            await asyncio.sleep(max(0.0, self.interval - (self.monotonic() - started)))

    async def tick(self) -> dict[reconcile.Key, list[Decision]]:
        """One step for every tracked pipeline; what each changed."""
        limit = asyncio.Semaphore(PARALLEL_PIPELINES)

        async def guarded(key: reconcile.Key) -> list[Decision]:
            async with limit:
                try:
                    return await self.step(*key)
                except Exception:
                    log.exception("autoscaling %s/%s failed; trying again next time", *key)
                    return []

        keys = list(self.reconciler.states)
        results = await asyncio.gather(*(guarded(key) for key in keys))
        return dict(zip(keys, results, strict=True))

    async def step(self, namespace: str, name: str) -> list[Decision]:
        """Scale one pipeline's units (see the module docstring); the changed decisions."""
        state = self.reconciler.states.get((namespace, name))
        if state is None:
            return []
        body = self.reconciler.cache.pipeline((namespace, name))
        if body is None:
            body = await apply.get_pipeline(self.reconciler.api, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return []
        parsed = state.validated(body, self.reconciler.options)
        if isinstance(parsed, SpecError):
            return []
        plan = autoscaling.scaling_plan(parsed)
        if not plan.policies:
            state.scaling = None
            await self._write_status(body, [], {})  # forget counts of a past autoscaling
            return []
        scaling = autoscaling.scaling_state(state.scaling, plan, stale_after_s=self.stale_after)
        state.scaling = scaling
        samples, now = await self._samples(namespace, name, plan)
        current = plan.current(state.replicas)
        decided = scaling.autoscaler.decide(now, current, samples)
        changed = autoscaling.to_apply(decided.values())
        if not changed:
            return []
        previous = dict(state.replicas)
        state.replicas = {**state.replicas, **{d.role: d.desired for d in changed}}
        try:
            outcome = await self.reconciler.reconcile(namespace, name)
        except BaseException:
            state.replicas = previous  # not applied: decide again next time
            raise
        if outcome is None:
            return []  # deleted meanwhile
        await self._report(namespace, name, plan, state.replicas, changed, samples, now)
        return changed

    async def _samples(
        self, namespace: str, name: str, plan: autoscaling.ScalingPlan
    ) -> tuple[dict[str, list[Sample]], float]:
        pods = self.reconciler.cache.pods((namespace, name))
        if pods is None:
            pods = await apply.pipeline_pods(self.reconciler.api, namespace, name)
        views = autoscaling.pod_views(pods, plan)
        urls = [url for unit in plan.policies for view in views.get(unit, ()) for url in view.urls]
        readings = await self._scraper_now().read_all(urls)
        now = self.monotonic()
        samples = {
            unit: [autoscaling.pod_sample(view, readings, now) for view in views.get(unit, ())]
            for unit in plan.policies
        }
        return samples, now

    def _scraper_now(self) -> podmetrics.Scraper:
        if self._scraper is None:
            self._scraper = podmetrics.Scraper(self.scrape_timeout)
        return self._scraper

    async def _report(
        self,
        namespace: str,
        name: str,
        plan: autoscaling.ScalingPlan,
        replicas: Mapping[str, int],
        changed: Sequence[Decision],
        samples: Mapping[str, Sequence[Sample]],
        now: float,
    ) -> None:
        body = await apply.get_pipeline(self.reconciler.api, namespace, name)
        if body is None:
            return
        at = self.reconciler.clock()
        records = [
            autoscaling.decision_record(
                d, at, autoscaling.observed(samples.get(d.role, ()), now, self.stale_after)
            )
            for d in changed
        ]
        managed = {unit: n for unit, n in replicas.items() if unit in plan.managed}
        await self._write_status(body, records, managed)
        for decision in changed:
            self.reconciler.metrics.scaled(
                namespace, name, decision.role, decision.current, decision.desired, decision.signal
            )
            type_, reason, message = autoscaling.decision_event(decision)
            log.info("%s/%s: %s", namespace, name, message)
            self.reconciler.post_event(body, type_, reason, message[: events.MAX_EVENT_MESSAGE])

    async def _write_status(
        self,
        body: Mapping[str, Any],
        records: Sequence[Mapping[str, Any]],
        replicas: Mapping[str, int],
    ) -> None:
        patch = autoscaling.status_patch(body.get("status"), records, replicas)
        if not patch:
            return
        meta = body["metadata"]
        ref = apply.pipeline_ref(meta["namespace"], meta["name"])
        await self.reconciler.api.patch_status(ref, patch, uid=meta["uid"])
