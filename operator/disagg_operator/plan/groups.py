"""Groups of pods per replica (`roles[].nodes: M` > 1): the rules are in `planner`'s
docstring. Pure: names, labels and the contract env of a group member.

A replica of such a role is a group: the leader, pod P-R-g of StatefulSet P-R (node rank 0,
replica g, the only member behind Service P-R, so peers see one address per group), and a
worker of each node rank k in 1..M-1, pod P-R-wk-g of StatefulSet P-R-wk. Every member of a
group has ordinal g, so the StatefulSets scale together (replicas = groups) and a member's
leader is known from its own ordinal: DISAGG_LEADER = P-R-$(DISAGG_GROUP_INDEX).P-R-ranks...,
expanded by the kubelet from the pod-index label (apps.kubernetes.io/pod-index, Kubernetes
1.28+). Service P-R-ranks (headless, not-ready addresses published) gives the members their
DNS names before they are ready: the world forms before rank 0 can be ready."""

from __future__ import annotations

import dataclasses
from typing import Any, Final

from disagg_core import contract
from disagg_core.spec import Pipeline, Role
from disagg_operator import names
from disagg_operator.plan.model import Workload

POD_INDEX_LABEL: Final = "apps.kubernetes.io/pod-index"
GROUP_INDEX_ENV: Final = contract.PREFIX + "GROUP_INDEX"  # the operator's, for DISAGG_LEADER


def grouped(role: Role) -> bool:
    return role.nodes > 1


def ranks_service_name(pipeline: Pipeline, role: str) -> str:
    return f"{pipeline.derived_name(role)}-ranks"


def worker_name(pipeline: Pipeline, role: str, node_rank: int) -> str:
    """The StatefulSet of node rank `node_rank` (>= 1) of every group of `role`."""
    return f"{pipeline.derived_name(role)}-w{node_rank}"


def member_name(pipeline: Pipeline, role: str, node_rank: int) -> str:
    return pipeline.derived_name(role) if node_rank == 0 else worker_name(pipeline, role, node_rank)


def member_names(pipeline: Pipeline, unit: Workload) -> list[str]:
    """The StatefulSets of a unit: its own, plus the workers' of a role of groups."""
    role = unit.roles[0]
    if not grouped(role):
        return [unit.name]
    return [member_name(pipeline, role.name, k) for k in range(role.nodes)]


def longest_name(pipeline: Pipeline, role: Role) -> str:
    """The longest StatefulSet name of `role`'s groups (the planner bounds it)."""
    return member_name(pipeline, role.name, role.nodes - 1)


def leader_host(pipeline: Pipeline, role: str, namespace: str, domain: str) -> str:
    """The leader's stable DNS name as a member's env renders it ($() is the kubelet's)."""
    service = ranks_service_name(pipeline, role)
    leader = pipeline.derived_name(role)
    return f"{leader}-$({GROUP_INDEX_ENV}).{service}.{namespace}.svc.{domain}"


def member_config(
    config: contract.RoleConfig, *, node_rank: int, leader: str
) -> contract.RoleConfig:
    return dataclasses.replace(config, node_rank=node_rank, leader=leader)


def group_index_env() -> dict[str, Any]:
    """DISAGG_GROUP_INDEX: the pod's ordinal, its group (defined before DISAGG_LEADER)."""
    path = f"metadata.labels['{POD_INDEX_LABEL}']"
    return {
        "name": GROUP_INDEX_ENV,
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}},
    }


def as_worker(template: dict[str, Any], role: str) -> dict[str, Any]:
    """A worker's pod template: its role container without the runtime's probes and ports.
    Only global rank 0 (the leader) serves the ingress, lane, /metrics and the probes; a
    worker that fails exits (its container restarts, and the group with it: regroup.py),
    and one that hangs fails the leader's collectives within their timeout. Without the
    ports no PodMonitor endpoint (selected by port name) scrapes a worker."""
    runtime = {"ingress", "lane", "metrics"}
    for container in template["spec"]["containers"]:
        if container.get("name") != role:
            continue
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            container.pop(probe, None)
        ports = [p for p in container.get("ports") or () if p.get("name") not in runtime]
        container["ports"] = ports
        if not ports:
            del container["ports"]
    return template


def member_labels(labels: dict[str, str], node_rank: int) -> dict[str, str]:
    return {**labels, names.LABEL_NODE_RANK: str(node_rank)}


def ranks_service(
    pipeline: Pipeline,
    role: Role,
    labels: dict[str, str],
    selector: dict[str, str],
    namespace: str,
    rank_port: int,
) -> dict[str, Any]:
    """Headless Service P-R-ranks: every member of every group of `role`, ready or not (the
    governing Service of the role's StatefulSets: the members' DNS names)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": ranks_service_name(pipeline, role.name),
            "namespace": namespace,
            "labels": dict(labels),
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": dict(selector),
            "ports": [
                {"name": "ranks", "port": rank_port, "targetPort": rank_port, "protocol": "TCP"}
            ],
        },
    }
