"""What the planner plans with: a pipeline's workload units (a lone role, or a colocation
group, as one StatefulSet), their ports, labels and selectors, the GPU mode, the units an
external scaler owns, each role's `RoleConfig` (the contract's env) and the spec hash's
inputs. Pure; the rules are stated in `planner`'s docstring."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from disagg_core import contract, placement
from disagg_core.spec import ColocationGroup, Pipeline, Role
from disagg_operator import names

GpuMode = Literal["dra", "device-plugin", "none"]

GPU_MODES: Final[tuple[GpuMode, ...]] = ("dra", "device-plugin", "none")

DRA_API_VERSIONS: Final = ("resource.k8s.io/v1", "resource.k8s.io/v1beta2")

DEFAULT_GPU_DEVICE_CLASS: Final = "gpu.nvidia.com"

RESERVED_PORT_NAMES: Final = ("ingress", "lane", "metrics")


@dataclass(frozen=True, kw_only=True)
class Owner:
    """The object that owns the children (the pipeline): one ownerReference on each."""

    api_version: str = names.PIPELINE_API_VERSION
    kind: str = names.PIPELINE_KIND
    name: str
    uid: str

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Owner:
        """The owner for a pipeline object as the API server returns it."""
        meta = body["metadata"]
        return cls(
            api_version=body["apiVersion"], kind=body["kind"], name=meta["name"], uid=meta["uid"]
        )

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Operator-wide settings. `replicas` overrides a unit's replicas by unit name (a role
    outside every group, or a group): the autoscaler's decisions, so applying a plan does not
    undo them."""

    cluster_domain: str = "cluster.local"
    gpu_mode: GpuMode = "dra"
    dra_api_version: str = DRA_API_VERSIONS[0]
    replicas: Mapping[str, int] = field(default_factory=dict)
    metrics_namespaces: tuple[str, ...] = ()  # whose pods may scrape every role's metrics
    # the rollout's partition per unit (operator/disagg_operator/rollout/steps.py); 0 when absent
    partitions: Mapping[str, int] = field(default_factory=dict)
    pod_monitors: bool = False  # the cluster serves PodMonitors (podmonitor.py)
    pod_monitor_default: bool = False  # for pipelines without spec.monitoring.podMonitor


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One StatefulSet: a role alone, or the roles of a colocation group sharing its pods."""

    unit: str  # the role's or the group's name
    name: str  # the StatefulSet's name, P-unit
    roles: tuple[Role, ...]  # container order
    group: ColocationGroup | None
    replicas: int

    def labels(self, pipeline: Pipeline, role: str | None = None) -> dict[str, str]:
        """Labels of this unit's objects; `role` for a Service of one grouped role."""
        result = common_labels(pipeline.name, self.unit)
        result[names.LABEL_ROLE] = role or self.unit
        if self.group is not None:
            result[names.LABEL_GROUP] = self.group.name
        return result

    def selector(self, pipeline: Pipeline) -> dict[str, str]:
        return {names.LABEL_PIPELINE: pipeline.name, names.LABEL_ROLE: self.unit}


@dataclass(frozen=True)
class RolePorts:
    ingress: int
    lane: int
    metrics: int


def common_labels(pipeline: str, component: str) -> dict[str, str]:
    return {
        names.LABEL_NAME: names.APP_NAME,
        names.LABEL_INSTANCE: pipeline,
        names.LABEL_COMPONENT: component,
        names.LABEL_MANAGED_BY: names.MANAGER,
        names.LABEL_PIPELINE: pipeline,
    }


def child_selector(pipeline: str) -> dict[str, str]:
    """Labels that select every child of pipeline `pipeline` (for listing and pruning)."""
    return {names.LABEL_PIPELINE: pipeline, names.LABEL_MANAGED_BY: names.MANAGER}


def workloads(pipeline: Pipeline, options: PlanOptions | None = None) -> tuple[Workload, ...]:
    """The units in declaration order (a group where its first member is declared); once
    per pipeline and options (asked per role)."""
    options = options or PlanOptions()
    cached = pipeline.derived.get(workloads)
    if cached is None or cached[0] != options:
        cached = pipeline.derived[workloads] = (options, _workloads(pipeline, options))
    return cached[1]


def _workloads(pipeline: Pipeline, options: PlanOptions) -> tuple[Workload, ...]:
    result: list[Workload] = []
    seen: set[str] = set()
    for role in pipeline.roles:
        group = pipeline.colocation_group_of(role.name)
        unit = role.name if group is None else group.name
        if unit in seen:
            continue
        seen.add(unit)
        members = (role,) if group is None else tuple(pipeline.role(n) for n in group.roles)
        replicas = options.replicas.get(unit, members[0].replicas)
        result.append(
            Workload(
                unit=unit,
                name=pipeline.derived_name(unit),
                roles=members,
                group=group,
                replicas=replicas,
            )
        )
    return tuple(result)


def workload_of(pipeline: Pipeline, role: str, options: PlanOptions | None = None) -> Workload:
    return next(w for w in workloads(pipeline, options) if role in (r.name for r in w.roles))


def role_ports(workload: Workload) -> dict[str, RolePorts]:
    """Runtime ports of each container of the unit's pods (see the module docstring)."""
    taken = {port.container_port for role in workload.roles for port in role.ports}
    count = len(workload.roles)
    ingress = _free_ports(contract.DEFAULT_INGRESS_PORT, taken, count)
    lane = _free_ports(contract.DEFAULT_LANE_PORT, taken | set(ingress), count)
    metrics = _free_ports(contract.DEFAULT_METRICS_PORT, taken | set(ingress) | set(lane), count)
    return {
        role.name: RolePorts(ingress=i, lane=n, metrics=m)
        for role, i, n, m in zip(workload.roles, ingress, lane, metrics, strict=True)
    }


def _free_ports(start: int, taken: set[int], count: int) -> list[int]:
    result: list[int] = []
    port = start
    while len(result) < count:
        if port not in taken:
            result.append(port)
        port += 1
    return result


def topology(
    pipeline: Pipeline, namespace: str, engines: contract.EngineTable | None = None
) -> contract.Topology:
    """The pipeline's topology; with `engines` (plan/engines.gateway_table), the gateway's
    engine replicas in it."""
    topo = contract.Topology.from_pipeline(pipeline, namespace=namespace)
    return topo if engines is None else dataclasses.replace(topo, engines=engines)


def topology_text(
    pipeline: Pipeline, namespace: str, engines: contract.EngineTable | None = None
) -> str:
    """The ConfigMap's topology.json, byte for byte."""
    document = topology(pipeline, namespace, engines).to_json()
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def spec_hash(pipeline: Pipeline, namespace: str, roles: tuple[str, ...]) -> str:
    """The hash of what the pods of `roles` read from outside their own template: their own
    slices of the topology file (and the pipeline and namespace it names). A graph change
    rolls only the roles whose slice it changes."""
    topo = topology(pipeline, namespace).to_json(only=roles)
    slices = topo["roles"]
    mine = {"pipeline": topo["pipeline"], "namespace": topo["namespace"], "roles": slices}
    text = json.dumps(mine, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def gateway_hash(
    pipeline: Pipeline, namespace: str, engines: contract.EngineTable | None = None
) -> str:
    """The hash of what the gateway reads from the topology file: the pipeline and
    namespace, its entry roles (and which of them join inputs: those it sends to by hash),
    its exit roles, and how often (and past which roles not idempotent) it resends a request
    lost with a replica, and the engine replicas it routes to (`engines`: bounded by the
    autoscalers' maxima, so scaling inside them leaves it). A graph edit that changes none
    of these (a role added in the
    middle, or after an exit role that stays one) leaves the gateway's pods, and their
    streams, alone."""
    topo = topology(pipeline, namespace)
    mine: dict[str, object] = {
        "pipeline": topo.pipeline,
        "namespace": topo.namespace,
        "entries": {r: topo.roles[r].joins for r in sorted(topo.entry_roles)},
        "exits": sorted(topo.exit_roles),
        "migrationAttempts": topo.migration_attempts,
    }
    if engines is not None:
        mine["engines"] = engines.to_json()
    if topo.not_idempotent:  # which requests it may not resend (absent: the hash stays)
        mine["notIdempotent"] = sorted(topo.not_idempotent)
        mine["unsafeBefore"] = {r: sorted(found) for r, found in topo.resend_unsafe().items()}
    text = json.dumps(mine, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def gpu_mode(pipeline: Pipeline, options: PlanOptions | None = None) -> GpuMode:
    """The pipeline's GPU mode; call `check` first (an unknown value raises ValueError)."""
    value = pipeline.annotations.get(names.ANNOTATION_GPU_MODE, (options or PlanOptions()).gpu_mode)
    for mode in GPU_MODES:
        if value == mode:
            return mode
    raise ValueError(f"unknown GPU mode {value!r}")


def gpu_device_class(pipeline: Pipeline) -> str:
    return pipeline.annotations.get(names.ANNOTATION_GPU_DEVICE_CLASS, DEFAULT_GPU_DEVICE_CLASS)


def external_scaling_names(pipeline: Pipeline) -> list[str]:
    """The names listed in the disagg.dev/external-scaling annotation, in order."""
    value = pipeline.annotations.get(names.ANNOTATION_EXTERNAL_SCALING, "")
    return [name.strip() for name in value.split(",") if name.strip()]


def external_units(pipeline: Pipeline) -> frozenset[str]:
    """Units whose replicas an external scaler owns (see the module docstring)."""
    wanted = set(external_scaling_names(pipeline))
    return frozenset(
        unit.unit
        for unit in workloads(pipeline)
        if unit.unit in wanted or any(role.name in wanted for role in unit.roles)
    )


def _layout(
    pipeline: Pipeline, options: PlanOptions
) -> tuple[tuple[Workload, ...], dict[str, RolePorts], dict[str, Workload]]:
    """The units, every role's ports and each role's unit: computed once per pipeline and
    options (`role_config` runs per role; recomputing them made a plan quadratic)."""
    cached = pipeline.derived.get(_layout)
    if cached is not None and cached[0] == options:
        return cached[1]  # type: ignore[no-any-return]
    units = workloads(pipeline, options)
    ports = {name: p for w in units for name, p in role_ports(w).items()}
    homes = {r.name: w for w in units for r in w.roles}
    pipeline.derived[_layout] = (options, (units, ports, homes))
    return units, ports, homes


def role_config(
    pipeline: Pipeline,
    role: str,
    *,
    namespace: str,
    options: PlanOptions | None = None,
) -> contract.RoleConfig:
    """The contract of one container of `role` (replica 0, no pod name: those come from the
    pod). `render_env` of it, minus DISAGG_REPLICA, is the container's DISAGG_* env."""
    options = options or PlanOptions()
    _, ports, homes = _layout(pipeline, options)
    home = homes[role]
    where = placement.Placement(
        namespace=namespace,
        addresses={
            target: (_address(pipeline, target, ports[target], home, namespace, options),)
            for target in placement.targets(pipeline, role)
        },
        ingress_port=ports[role].ingress,
        lane_port=ports[role].lane,
        metrics_port=ports[role].metrics,
        peer_key_file=contract.DEFAULT_PEER_KEY_FILE,
    )
    return placement.role_config(pipeline, role, where)


def _address(
    pipeline: Pipeline,
    target: str,
    ports: RolePorts,
    home: Workload,
    namespace: str,
    options: PlanOptions,
) -> str:
    if any(r.name == target for r in home.roles):
        return f"127.0.0.1:{ports.ingress}"
    host = f"{pipeline.derived_name(target)}.{namespace}.svc.{options.cluster_domain}"
    return f"{host}:{ports.ingress}"
