"""Group restart for roles of groups (roles[].nodes > 1): which pods to delete so that a
group whose member failed or was replaced starts again as a whole. Pure; the reconciler
lists the pods and deletes what this names (`restarts.restart_groups`).

A group is the pods of one role with one ordinal (label apps.kubernetes.io/pod-index), one
per node rank (label disagg.dev/node-rank). Its world (torch.distributed, formed once at
start) survives no member: a worker that restarted in place or was recreated alone would
wait for a rendezvous the others left long ago. So the group's other members are deleted,
and the StatefulSet controllers recreate them, when one member

- is being deleted or is gone (deleted, evicted, rolled by its StatefulSet): the members
  created no later than it (its generation of the group; not those already recreated), or
- restarted in place (a container's restartCount > 0: it failed, or its liveness probe
  failed): the whole group, or
- was recreated alone while the operator was not watching: the members' creation times
  span more than `SPREAD_S`: the whole group.

Groups past the role's desired count are left alone (a scale-down removes them), so is an
incomplete group (its controller recreates the missing pod first); a group younger than
`SETTLE_S` is restarted for a failure only after that, which spaces the restarts of a group
that keeps failing (deleting its pods drops the kubelet's back-off)."""

from __future__ import annotations

import dataclasses
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
class Shape:
    """A role of groups as planned: pods per group, and groups."""

    nodes: int
    groups: int


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
    pods: Iterable[Mapping[str, Any]],
    shapes: Mapping[str, Shape],
    now: datetime.datetime,
    gone: Iterable[Mapping[str, Any]] = (),
) -> Decision:
    """What to delete among `pods` (a pipeline's); `shapes`: each role of groups; `gone`:
    pods whose deletion was just seen (no longer among `pods`)."""
    by_group: dict[tuple[str, int], list[Member]] = {}
    left = [dataclasses.replace(m, deleting=True) for m in members(gone)]
    for member in [*members(pods), *left]:
        shape = shapes.get(member.role)
        if shape is not None and member.group < shape.groups:
            by_group.setdefault((member.role, member.group), []).append(member)
    delete: list[str] = []
    waits: list[float] = []
    for (role, _), group in sorted(by_group.items()):
        leaving = [m for m in group if m.deleting]
        staying = [m for m in group if not m.deleting]
        if leaving:
            generation = max(m.created for m in leaving)
            delete += [m.name for m in staying if m.created <= generation]
            continue
        if len({m.node_rank for m in group}) < shapes[role].nodes:
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
