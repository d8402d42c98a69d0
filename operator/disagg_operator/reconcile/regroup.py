"""Group restart for roles of groups (roles[].nodes > 1): which pods to delete so that a
group whose member failed or was replaced starts again as a whole. Pure; the reconciler
lists the pods and deletes what this names (`Reconciler.restart_groups`).

A group is the pods of one role with one ordinal (label apps.kubernetes.io/pod-index), one
per node rank (label disagg.dev/node-rank). Its world (torch.distributed, formed once at
start) survives no member: a worker that restarted in place or was recreated alone would
wait for a rendezvous the others left long ago. So the whole group is deleted, and the
StatefulSet controllers recreate every member at once, when:

- a member's container restarted (restartCount > 0: it failed, or its liveness probe did), or
- its members' creation times span more than `SPREAD_S` (one was deleted, evicted or rolled
  by its StatefulSet and recreated alone).

Deleting every member (not only the stale ones) is what converges: they come back together
whatever the operator's delay. A group with a member being deleted is left alone (a restart
or a scale-down in progress), so is one that is incomplete (its controller recreates the
missing pod first); a group younger than `SETTLE_S` is left until then, which spaces the
restarts of a group that keeps failing (deleting its pods drops the kubelet's back-off)."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from disagg_operator import names
from disagg_operator.k8s import times
from disagg_operator.plan import groups

SPREAD_S: Final = 30.0  # members of one group are created within this of each other
SETTLE_S: Final = 10.0  # at least this between two restarts of one group


@dataclass(frozen=True)
class Member:
    name: str
    role: str
    group: int
    node_rank: int
    created: datetime.datetime
    restarts: int
    deleting: bool


@dataclass(frozen=True)
class Decision:
    delete: tuple[str, ...]  # pod names, sorted
    recheck_s: float | None  # a group must settle first: decide again after this


def members(pods: Iterable[Mapping[str, Any]]) -> list[Member]:
    """The pods that are members of a group (both labels and a creation time)."""
    found = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        created = times.parse_time(meta.get("creationTimestamp"))
        rank, index = labels.get(names.LABEL_NODE_RANK), labels.get(groups.POD_INDEX_LABEL)
        if rank is None or index is None or created is None:
            continue
        if not (str(rank).isdigit() and str(index).isdigit()):
            continue
        statuses = (pod.get("status") or {}).get("containerStatuses") or ()
        found.append(
            Member(
                name=str(meta.get("name")),
                role=str(labels.get(names.LABEL_ROLE, "")),
                group=int(index),
                node_rank=int(rank),
                created=created,
                restarts=sum(int(s.get("restartCount") or 0) for s in statuses),
                deleting=meta.get("deletionTimestamp") is not None,
            )
        )
    return found


def decide(
    pods: Iterable[Mapping[str, Any]], nodes: Mapping[str, int], now: datetime.datetime
) -> Decision:
    """What to delete among `pods` (a pipeline's); `nodes`: each role of groups' nodes."""
    by_group: dict[tuple[str, int], list[Member]] = {}
    for member in members(pods):
        if member.role in nodes:
            by_group.setdefault((member.role, member.group), []).append(member)
    delete: list[str] = []
    waits: list[float] = []
    for (role, _), group in sorted(by_group.items()):
        if any(m.deleting for m in group) or len({m.node_rank for m in group}) < nodes[role]:
            continue
        oldest = min(m.created for m in group)
        newest = max(m.created for m in group)
        failed = any(m.restarts > 0 for m in group)
        split = (newest - oldest).total_seconds() > SPREAD_S
        if not (failed or split):
            continue
        age = (now - newest).total_seconds()
        if age < SETTLE_S:
            waits.append(SETTLE_S - age)
            continue
        delete += [m.name for m in group]
    return Decision(tuple(sorted(delete)), min(waits) if waits else None)
