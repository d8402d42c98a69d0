"""What the reconciler keeps of one pipeline between reconciles (`PipelineState`), and what it
derives from that without I/O, each remembered until its inputs change: the plan options in
effect (`options`: the autoscaler's replicas and the rollout's partitions over the
operator's), the parsed spec (`validated`), and what the rollout reads of the plan (`plan`,
`planned_for_rollout`).

`replicas` are the autoscaler's decisions per workload unit, passed to the planner so that a
reconcile does not undo them; before each reconcile `autoscaling.resumed_replicas` completes
them from the status (`autoscaledReplicas`), so a restarted operator resumes from its last
decisions instead of snapping back to spec.roles[].replicas, and drops units that are no
longer autoscaled. `scaling` is the autoscaler's history (see `scaling_loop`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg_core import spec
from disagg_core.spec import Pipeline, SpecError
from disagg_operator.autoscaling import scaling as autoscaling
from disagg_operator.plan import model, planner
from disagg_operator.reconcile import apply, cache
from disagg_operator.reconcile.refresh import Timers
from disagg_operator.rollout.tracker import PlanKey, RolloutTracker


@dataclass
class PipelineState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    replicas: dict[str, int] = field(default_factory=dict)  # autoscaler decisions, by unit
    scaling: autoscaling.ScalingState | None = None  # the autoscaler's windows
    conflicts: tuple[apply.Conflict, ...] = ()
    privileged: tuple[str, ...] = ()  # the weakening settings last warned about
    refresh_waiting: bool = False
    timers: Timers = field(default_factory=Timers)  # scheduled refreshes (`refresh`)
    rollout: RolloutTracker = field(default_factory=RolloutTracker)  # partitions, step
    peer_key_hash: str | None = None  # of the key last reconciled: templates carry it
    generation: int = 0  # the newest generation read from the API
    written: dict[str, Any] = field(default_factory=dict)  # the status we last wrote
    applied: dict[str, dict[str, Any]] = field(default_factory=dict)  # StatefulSets, by name
    parsed: tuple[tuple[str, str], Pipeline | SpecError] | None = None  # see `validated`

    def options(self, base: model.PlanOptions) -> model.PlanOptions:
        """The operator's plan options with this pipeline's replicas and partitions."""
        if not self.replicas and not self.rollout.partitions:
            return base
        return dataclasses.replace(
            base,
            replicas={**base.replicas, **self.replicas},
            partitions=dict(self.rollout.partitions),
        )

    def validated(
        self, body: Mapping[str, Any], options: model.PlanOptions
    ) -> Pipeline | SpecError:
        """`validate`, remembered for the body's content (`cache.digest`: all but status and
        server-kept metadata) and the options: the status refreshes that child events
        cause, and the autoscaler's rounds, parse a pipeline once per edit, not once per
        event (at a thousand pipelines, parsing was a tenth of the CPU). Of the options,
        `planner.check` reads the GPU mode and the DRA version (not the replicas and
        partitions, which change often)."""
        key = (cache.digest(body), f"{options.gpu_mode} {options.dra_api_version}")
        if self.parsed is not None and self.parsed[0] == key:
            return self.parsed[1]
        parsed = validate(body, options)
        self.parsed = (key, parsed)
        return parsed

    def plan(
        self,
        pipeline: Pipeline,
        namespace: str,
        owner: model.Owner,
        options: model.PlanOptions,
        peer_key_hash: str,
    ) -> list[dict[str, Any]]:
        """`planner.plan`; what the rollout reads of it is kept (`RolloutTracker.remember`)."""
        objects = planner.plan(
            pipeline,
            namespace=namespace,
            owner=owner,
            options=options,
            peer_key_hash=peer_key_hash,
        )
        key = _plan_key(pipeline, namespace, owner, options, peer_key_hash)
        self.rollout.remember(key, objects)
        return objects

    def planned_for_rollout(
        self,
        pipeline: Pipeline,
        namespace: str,
        owner: model.Owner,
        options: model.PlanOptions,
        peer_key_hash: str,
    ) -> list[dict[str, Any]]:
        """The planned StatefulSets as the rollout reads them (`RolloutTracker.planned_for`)."""
        key = _plan_key(pipeline, namespace, owner, options, peer_key_hash)
        return self.rollout.planned_for(
            key, lambda: self.plan(pipeline, namespace, owner, options, peer_key_hash)
        )


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """The pipeline document as plain dicts (kopf hands out read-only mappings)."""
    return {key: value for key, value in body.items()}


def validate(body: Mapping[str, Any], options: model.PlanOptions) -> Pipeline | SpecError:
    """The validated pipeline, or every problem of the spec and of the planner's `check`."""
    try:
        pipeline = spec.parse_pipeline(_plain(body))
    except SpecError as error:
        return error
    problems = planner.check(pipeline, options)
    return SpecError(problems) if problems else pipeline


def _plan_key(
    pipeline: Pipeline,
    namespace: str,
    owner: model.Owner,
    options: model.PlanOptions,
    peer_key_hash: str,
) -> PlanKey:
    """What a plan is made of: the key under which the rollout keeps what it read of one."""
    return (pipeline, namespace, owner, repr(options), peer_key_hash)
