"""One pipeline's rollout as the reconciler drives it: the partitions in effect, the current
step and when it began, the units already reported stalled, when the step's deadline
passes, and what the rollout reads of the last plan. The decisions are `state.decide`'s
(pure); this keeps what must outlive one reconcile, so the reconciler holds one per pipeline
and calls `step` before applying, `observe` when building the status.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg_core.spec import Pipeline
from disagg_operator import names
from disagg_operator.rollout import state as rollout_state

PlanKey = tuple[object, ...]  # (parsed pipeline, namespace, owner, options, peer key hash)


@dataclass
class RolloutTracker:
    partitions: dict[str, int] = field(default_factory=dict)  # in effect, by unit
    step_targets: dict[str, int] = field(default_factory=dict)  # the current rollout step
    step_started: float = 0.0  # monotonic seconds
    stalled: tuple[str, ...] = ()  # units whose step missed its deadline (Event once)
    planned: tuple[PlanKey, list[dict[str, Any]]] | None = None  # `remember`: slim

    def remember(self, key: PlanKey, objects: Sequence[Mapping[str, Any]]) -> None:
        """Keep what the rollout reads of a plan (`rollout_view`) for `planned_for`."""
        self.planned = (key, rollout_view(objects))

    def planned_for(self, key: PlanKey, plan: Callable[[], object]) -> list[dict[str, Any]]:
        """The planned StatefulSets as the rollout reads them, from the last plan when its
        inputs are the same (the same parsed pipeline object, see `Reconciler.validated`):
        every status refresh needs them, and planning is the costliest step of a reconcile.
        Else `plan()`, which calls `remember`."""
        memo = self.planned
        if memo is not None and memo[0][0] is key[0] and memo[0][1:] == key[1:]:
            return memo[1]
        plan()
        assert self.planned is not None
        return self.planned[1]

    def step(
        self,
        pipeline: Pipeline,
        planned: Sequence[Mapping[str, Any]],
        live: Sequence[Mapping[str, Any]],
    ) -> rollout_state.RolloutDecision:
        """Decide the rollout's partitions (`rollout.steps`) and keep them."""
        now = time.monotonic()
        decision = rollout_state.decide(pipeline, planned, live, step_age_s=now - self.step_started)
        targets = dict(decision.step.targets)
        if targets != self.step_targets:
            self.step_targets, self.step_started = targets, now
        self.partitions = {unit: p for unit, p in decision.step.partitions.items() if p}
        return decision

    def observe(
        self,
        pipeline: Pipeline,
        planned: Sequence[Mapping[str, Any]],
        statefulsets: Sequence[Mapping[str, Any]],
    ) -> tuple[rollout_state.RolloutDecision, str | None]:
        """Where the rollout stands by the observed StatefulSets, and the message of a step
        newly stalled (None when none is, or it was reported already)."""
        decision = rollout_state.decide(
            pipeline, planned, statefulsets, step_age_s=time.monotonic() - self.step_started
        )
        stalled, message = decision.step.stalled, None
        if stalled and stalled != self.stalled:
            message = (
                f"rollout stopped: {', '.join(stalled)} not ready within "
                f"{pipeline.rollout.step_deadline_seconds}s of the step's start"
            )
        self.stalled = stalled
        return decision, message

    def step_deadline_delay(
        self, decision: rollout_state.RolloutDecision, pipeline: Pipeline
    ) -> float | None:
        """Seconds until the waiting step's deadline has passed, for a refresh then (a stuck
        pod sends no event); None when no step waits or it is stalled already. The timer is
        the pipeline's (`refresh.Timers.step`), so forgetting the pipeline cancels it."""
        if not decision.step.waiting or decision.step.stalled:
            return None
        age = time.monotonic() - self.step_started
        return max(0.0, pipeline.rollout.step_deadline_seconds - age) + 0.1

    def next_step_due(self, decision: rollout_state.RolloutDecision) -> bool:
        """The observed StatefulSets finished the current step: a reconcile applies the next."""
        in_effect = {unit: self.partitions.get(unit, 0) for unit in decision.step.partitions}
        return decision.active and dict(decision.step.partitions) != in_effect


def rollout_view(objects: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The planned StatefulSets with only what `rollout_state.observe` reads (the whole plan
    of a thousand pipelines, kept, would be a third of the operator's memory)."""
    view = []
    for obj in objects:
        if obj.get("kind") != "StatefulSet":
            continue
        meta = obj.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        kept = {k: annotations[k] for k in (names.ANNOTATION_TEMPLATE_HASH,) if k in annotations}
        view.append(
            {
                "kind": "StatefulSet",
                "metadata": {
                    "name": meta.get("name"),
                    "labels": dict(meta.get("labels") or {}),
                    "annotations": kept,
                },
                "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 1)},
            }
        )
    return view
