"""Reconciling pipelines: planner + apply + status builder, serialized per pipeline.

`Reconciler` is what the kopf handlers call; everything it decides comes from pure functions
(`planner.plan`, `status.build_status`, `status.with_conflicts`, `status.recheck_delay`,
`events.decision_events`), all I/O goes through `apply`, and Events through `post_event`
(`events.kopf_event`, kopf's event poster, by default).

A reconcile (`reconcile`), for the pipeline as it is now (read fresh, so a retry or a late
handler never acts on an old spec):

1. parse and plan. An invalid spec (the validator's problems, or the planner's `check`)
   creates no children and touches none that exist (an invalid edit of a running pipeline
   keeps the last valid workloads running, as a Deployment does with a bad rollout);
   a podTemplate that weakens the pods is invalid unless the pipeline opted in
   (disagg_core.spec.podpolicy), and then a Warning Event lists what it weakens;
2. make sure the peer key Secret exists (`manifests.peer_key_secret`, with 32 bytes from
   `secrets`; created when absent, never overwritten) and plan with its key's hash, so
   that a new key rolls the role pods; a deleted Secret (watched, like the StatefulSets)
   triggers a reconcile, which makes a new key: that is how a key is rotated;
3. apply every planned child, prune the ones the plan dropped (see `apply`);
4. build the status from the StatefulSets as stored, write it if it differs;
5. post Events for what changed (see `decision_events`).

A status refresh (`refresh`, on any event of an owned StatefulSet) does steps 1 (no plan) and
4. A deleted StatefulSet, NetworkPolicy or peer key Secret triggers a full reconcile, so a
child removed by hand comes back.
Reconciles and refreshes in flight are counted in `progress` (`liveness`: work that waits
for minutes without any of it ending fails the liveness probe).
Each pipeline has an `asyncio.Lock`: reconciles and refreshes of one pipeline never overlap
(the operator is one process; kopf peering keeps other replicas passive), so a status
computed from older reads never overwrites a newer one. Refreshes requested while one is
waiting for the lock are merged into it.

Reads come from the watch cache (`cache`: the workloads, the peer key Secret, and the
pipeline for a refresh) when kopf has bound it, else from the API (`reads`: what each costs).
What is kept per pipeline between reconciles (`tracked.PipelineState`: the autoscaler's
replicas, the rollout, the parsed spec and what the rollout reads of the plan, the status
last written) and what is derived from it without I/O are `tracked`'s: a refresh neither
parses nor plans again, and a cache that has not caught up with our own write does not make
us write the status again. When a refresh happens without an event of its own (coalesced
child events, retries with backoff, the progress and rollout step deadlines' rechecks) and
the next rollout step's reconcile are `refresh.Scheduler`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from disagg_core.spec import Pipeline, SpecError, pod_policy_findings
from disagg_operator.autoscaling import scaling as autoscaling
from disagg_operator.k8s import client as kube
from disagg_operator.plan import manifests, model, planner, podmonitor
from disagg_operator.reconcile import apply, cache, reads, status
from disagg_operator.reconcile.events import (
    EVENT_FAILED,
    EVENT_ROLLOUT_STALLED,
    MAX_EVENT_MESSAGE,
    Event,
    PostEvent,
    decision_events,
    kopf_event,
    privileged_events,
)
from disagg_operator.reconcile.metrics import Metrics
from disagg_operator.reconcile.progress import Progress
from disagg_operator.reconcile.refresh import COALESCE, Scheduler, Timers
from disagg_operator.reconcile.tracked import PipelineState
from disagg_operator.rollout import state as rollout_state

PARALLEL: Final = 32  # reconciles and refreshes in flight at once (the rest queue)

log = logging.getLogger(__name__)

Key = cache.Key  # namespace, name
Clock = Callable[[], datetime.datetime]


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class Outcome:
    """What one reconcile or refresh did."""

    phase: str
    result: apply.ApplyResult | None = None  # None: no apply (invalid spec, refresh)
    problems: tuple[str, ...] = ()
    status_written: bool = False
    events: tuple[Event, ...] = ()

    @property
    def conflicts(self) -> tuple[apply.Conflict, ...]:
        return self.result.conflicts if self.result else ()


@dataclass
class Reconciler:
    api: kube.Api
    options: model.PlanOptions = field(default_factory=model.PlanOptions)
    metrics: Metrics = field(default_factory=Metrics)
    post_event: PostEvent = kopf_event
    clock: Clock = utc_now
    progress_deadline: float = status.DEFAULT_PROGRESS_DEADLINE
    cache: cache.Cache = field(default_factory=cache.Cache)
    coalesce: float = COALESCE
    parallel: int = PARALLEL
    progress: Progress = field(default_factory=Progress)  # for the probe
    states: dict[Key, PipelineState] = field(default_factory=dict, init=False)
    scheduler: Scheduler = field(init=False, repr=False)  # refreshes and steps, later
    _slots: asyncio.Semaphore | None = field(default=None, init=False, repr=False)
    _pod_monitors_detected: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics.count_pipelines(lambda: len(self.states))
        self.scheduler = Scheduler(
            refresh=lambda key: self.refresh(*key),
            reconcile=lambda key: self.reconcile(*key),
            timers=self._timers,
            coalesce=self.coalesce,
        )

    # ------------------------------------------------------------------ entry points

    async def reconcile(self, namespace: str, name: str) -> Outcome | None:
        """Bring the children and the status in line with the spec; None if the pipeline is
        gone or being deleted. Raises kube.ApiError on API failures (after an Event)."""
        state = self.states.setdefault((namespace, name), PipelineState())
        with self.progress.working():
            return await self._reconcile_locked(namespace, name, state)

    async def _reconcile_locked(
        self, namespace: str, name: str, state: PipelineState
    ) -> Outcome | None:
        async with state.lock, self._slot(), self._measured("spec"):
            body = await apply.get_pipeline(self.api, namespace, name)
            if body is None:
                self.forget(namespace, name)
                return None
            if body["metadata"].get("deletionTimestamp"):
                return None
            state.generation = max(state.generation, int(body["metadata"].get("generation") or 0))
            state.replicas = autoscaling.resumed_replicas(body, state.replicas)
            try:
                return await self._reconcile(body, state)
            except Exception as error:
                message = f"reconcile failed: {type(error).__name__}: {error}"
                self.post_event(body, "Warning", EVENT_FAILED, message[:MAX_EVENT_MESSAGE])
                raise

    async def refresh(self, namespace: str, name: str) -> Outcome | None:
        """Recompute and write the status from the observed StatefulSets."""
        state = self.states.setdefault((namespace, name), PipelineState())
        if state.refresh_waiting:
            return None  # the waiting refresh reads after this request: nothing is missed
        state.refresh_waiting = True
        with self.progress.working():
            try:
                await state.lock.acquire()
            finally:
                state.refresh_waiting = False  # also when cancelled while waiting
            try:
                async with self._slot(), self._measured("status"):
                    body = await reads.current_pipeline(
                        self.api, self.cache, (namespace, name), state.generation
                    )
                    if body is None:
                        self.forget(namespace, name)
                        return None
                    return await self._refresh(body, state)
            finally:
                state.lock.release()

    def request_refresh(self, namespace: str, name: str) -> None:
        """A child of the pipeline changed: refresh its status `coalesce` seconds from now,
        once for all the changes that come in meanwhile (a rollout gives dozens of
        StatefulSet events; they cost one status computation and at most one write)."""
        state = self.states.setdefault((namespace, name), PipelineState())
        self.scheduler.request((namespace, name), state.timers)

    async def child_deleted(self, namespace: str, name: str) -> Outcome | None:
        """A StatefulSet of the pipeline was deleted: put it back (a full reconcile)."""
        state = self.states.get((namespace, name))
        if state is not None:
            state.applied = {}
        return await self.reconcile(namespace, name)

    def forget(self, namespace: str, name: str) -> None:
        """The pipeline is gone: drop its state (no finalizer needed: children are
        garbage-collected through their ownerReferences)."""
        state = self.states.pop((namespace, name), None)
        self.metrics.forget(namespace, name)
        if state is not None:
            state.timers.cancel()

    async def close(self) -> None:
        for state in self.states.values():
            state.timers.cancel()
        await self.scheduler.close()
        await self.api.close()

    def _timers(self, key: Key) -> Timers | None:
        state = self.states.get(key)
        return state.timers if state is not None else None

    # ------------------------------------------------------------------ steps

    async def _detect_pod_monitors(self, body: Mapping[str, Any]) -> None:
        """Once per run, when a pipeline may want a PodMonitor (the default, or its spec):
        does the cluster serve them? (`podmonitor`)"""
        if self._pod_monitors_detected:
            return
        asked = ((body.get("spec") or {}).get("monitoring") or {}).get("podMonitor")
        if not (self.options.pod_monitor_default or asked is True):
            return
        self._pod_monitors_detected = True
        found = await self.api.serves(podmonitor.API_VERSION, podmonitor.PLURAL)
        log.info("PodMonitors %s", "served: rendering them" if found else "not served: none")
        self.options = dataclasses.replace(self.options, pod_monitors=found)

    async def _reconcile(self, body: Mapping[str, Any], state: PipelineState) -> Outcome:
        namespace = body["metadata"]["namespace"]
        owner = model.Owner.of(body)
        await self._detect_pod_monitors(body)
        options = state.options(self.options)
        pipeline = state.validated(body, options)
        if isinstance(pipeline, SpecError):
            state.conflicts = ()
            return await self._finish(body, state, pipeline, None)
        extra = privileged_events(pipeline, state.privileged)
        state.privileged = tuple(str(p) for p in pod_policy_findings(pipeline))
        kinds = planner.child_kinds(options)
        others = [k for k in kinds if k not in reads.WORKLOAD_KINDS]
        # the reads, all at once (one round trip: a slow API server costs one wait, not three)
        secret = asyncio.ensure_future(
            reads.peer_key(self.api, self.cache, pipeline, namespace, owner)
        )
        # fresh, not cached: a rollout must not act on a lagging cache; also what the apply
        # compares these kinds against (no second list of them)
        listed = asyncio.ensure_future(
            apply.list_children(
                self.api, reads.WORKLOAD_KINDS, namespace=namespace, pipeline=owner.name
            )
        )
        children = asyncio.ensure_future(
            reads.existing_children(self.api, self.cache, others, (namespace, owner.name))
        )
        await apply.all_of([secret, listed, children])
        (key, created), workloads, existing = secret.result(), listed.result(), children.result()
        digest = manifests.peer_key_digest(reads.peer_key_text(key))
        objects = state.plan(pipeline, namespace, owner, options, digest)
        state.peer_key_hash = digest
        live = [
            o for o in workloads.values() if (apply.controller_of(o) or {}).get("uid") == owner.uid
        ]
        state.rollout.step(pipeline, objects, live)
        if state.options(self.options) != options:  # the rollout moved a partition
            options = state.options(self.options)
            objects = state.plan(pipeline, namespace, owner, options, digest)
        result = await apply.apply_children(
            self.api,
            objects,
            owner=owner,
            namespace=namespace,
            kinds=kinds,
            existing={**workloads, **existing},
        )
        if created:  # reported with the children
            made = (kube.ObjectRef.of(key), *result.created)
            result = dataclasses.replace(result, created=made)
        known, state.conflicts = state.conflicts, result.conflicts
        if result.conflicts:
            self.metrics.errors.labels(kind="spec", reason="Conflict").inc()
        return await self._finish(
            body, state, pipeline, result, known_conflicts=known, extra_events=extra
        )

    async def _refresh(self, body: Mapping[str, Any], state: PipelineState) -> Outcome:
        parsed = state.validated(body, state.options(self.options))
        return await self._finish(body, state, parsed, None)

    async def _finish(
        self,
        body: Mapping[str, Any],
        state: PipelineState,
        parsed: Pipeline | SpecError,
        result: apply.ApplyResult | None,
        *,
        known_conflicts: Sequence[apply.Conflict] = (),
        extra_events: Sequence[Event] = (),
    ) -> Outcome:
        now = self.clock()
        # what we wrote last counts even where the (cached) body does not show it yet
        before = {**(body.get("status") or {}), **state.written}
        if result is not None:
            statefulsets = result.statefulsets()
            state.applied = {
                o["metadata"]["name"]: cache.slim(o, "apps/v1", o["kind"]) for o in statefulsets
            }
        else:
            statefulsets = await reads.workloads(self.api, self.cache, body, state.applied)
        after = status.build_status(
            parsed,
            statefulsets,
            generation=body["metadata"].get("generation"),
            now=now,
            previous_conditions=before.get("conditions") or (),
            progress_deadline=self.progress_deadline,
            options=state.options(self.options),
        )
        if not isinstance(parsed, SpecError):
            after = status.with_conflicts(after, state.conflicts, now=now, previous=before)
            after = self._rollout_status(body, parsed, statefulsets, state, after)
            phase = (after.get("rollout") or {}).get("phase", "Complete")
            self.metrics.observed(body["metadata"]["namespace"], parsed.name, after["roles"], phase)
        written = await apply.write_status(self.api, {**body, "status": before}, after)
        if written:
            state.written = dict(after)
        events = [*extra_events]
        events += decision_events(
            result=result, before=before, after=after, known_conflicts=known_conflicts
        )
        for type_, reason, message in events:
            self.post_event(body, type_, reason, message[:MAX_EVENT_MESSAGE])
        meta = body["metadata"]
        delay = status.recheck_delay(after, now=now, deadline=self.progress_deadline)
        self.scheduler.recheck((meta["namespace"], meta["name"]), state.timers, delay)
        return Outcome(
            phase=str(after.get("phase")),
            result=result,
            problems=tuple(after.get("problems") or ()),
            status_written=written,
            events=tuple(events),
        )

    # ------------------------------------------------------------------ rollouts

    def _rollout_status(
        self,
        body: Mapping[str, Any],
        pipeline: Pipeline,
        statefulsets: Sequence[Mapping[str, Any]],
        state: PipelineState,
        built: Mapping[str, Any],
    ) -> dict[str, Any]:
        """`built` with `rollout`; an Event when a step stalls; a reconcile scheduled when the
        observed StatefulSets finished the current step (the next one lowers partitions)."""
        if state.peer_key_hash is None:  # no reconcile since start: the plan is not known yet
            return dict(built)
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        owner, options = model.Owner.of(body), state.options(self.options)
        planned = state.planned_for_rollout(
            pipeline, meta["namespace"], owner, options, state.peer_key_hash
        )
        decision, stalled = state.rollout.observe(pipeline, planned, statefulsets)
        if stalled is not None:
            self.post_event(body, "Warning", EVENT_ROLLOUT_STALLED, stalled)
        delay = state.rollout.step_deadline_delay(decision, pipeline)
        self.scheduler.recheck_step(key, state.timers, delay)
        if state.rollout.next_step_due(decision):
            self.scheduler.spawn_reconcile(key)
        return {**built, "rollout": rollout_state.status(decision, pipeline.rollout.paused)}

    def _slot(self) -> asyncio.Semaphore:
        """At most `parallel` reconciles and refreshes at once: a thousand pipelines created
        together queue here, not in the HTTP connection pool, where the wait would eat
        their requests' timeouts and turn into retries (a work queue, as controller-runtime
        has)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(max(1, self.parallel))
        return self._slots

    def _measured(self, kind: str) -> _Measured:
        return _Measured(self.metrics, kind)


class _Measured:
    """Times a block into the duration histogram; counts exceptions into the errors."""

    def __init__(self, metrics: Metrics, kind: str) -> None:
        self.metrics = metrics
        self.kind = kind
        self.started = 0.0

    async def __aenter__(self) -> None:
        self.started = time.perf_counter()

    async def __aexit__(self, kind: type[BaseException] | None, error: object, tb: object) -> None:
        self.metrics.duration.labels(kind=self.kind).observe(time.perf_counter() - self.started)
        if kind is not None and not issubclass(kind, asyncio.CancelledError):
            reason = error.reason if isinstance(error, kube.ApiError) else kind.__name__
            self.metrics.errors.labels(kind=self.kind, reason=reason).inc()
