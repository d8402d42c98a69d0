"""Planner: a validated pipeline -> the Kubernetes objects that run it. Pure and deterministic.

`plan(pipeline, namespace=NS, owner=OWNER)` returns the desired objects as plain dicts, ready
for server-side apply; the same input always yields equal output (key order included), so
re-applying a plan changes nothing. `disagg render` prints exactly this list.

Naming (P = metadata.name, at most 40 characters; R = a role; G = a colocation group;
`P-R` and `P-G` are at most 52 characters, which the spec checks):

    ConfigMap              P-topology    data `topology.json` = contract.Topology of P
    ResourceClaimTemplate  P-G-gpu       one per colocation group, GPU mode `dra` only
    Service (headless)     P-R           one per role, grouped or not
    StatefulSet            P-U           one per workload unit U: a role outside every
                                         group (U = R), or a colocation group (U = G)
    NetworkPolicy          P-network     unless spec.networkPolicy.enabled is false
    Service, Deployment    P, P-gateway  the HTTP gateway, unless spec.gateway.enabled is
                                         false (see `gateway`)
    PodMonitor             P-metrics     roles' and gateway's metrics, where the cluster
                                         serves PodMonitors and the pipeline wants one
                                         (see `podmonitor`)

and, not planned but ensured by the reconciler (the planner draws no randomness):

    Secret                 P-peer-key    data `key` = 32 random bytes, hex; created when
                                         absent, never overwritten (`peer_key_secret`)

Placement:
- A role outside every group runs as StatefulSet P-R; each pod has one container named R.
- A colocation group runs as StatefulSet P-G; each pod has one container per member role, in
  the group's order, named after the role. The containers share the network namespace
  (peers at 127.0.0.1), /dev/shm (one memory emptyDir), the process namespace
  (`shareProcessNamespace: true`, for CUDA IPC) and one GPU (see GPU modes).
- Replicas of U: `options.replicas[U]` when given (the autoscaler's decision), else the
  role's `replicas` (members of a group have equal replicas; the spec checks it). A unit
  named in the pipeline annotation disagg.dev/external-scaling (comma-separated role or
  group names; a role stands for its unit) gets no `spec.replicas` at all: an HPA or KEDA
  owns the field through the scale subresource, and our apply never touches it.
- The StatefulSet's governing Service (`serviceName`, per-pod DNS) is P-<first role of U>.
- The Service P-R selects the pods of R's unit: {disagg.dev/pipeline: P, disagg.dev/role: U}.
  It is headless (`clusterIP: None`): DNS answers with the ready pods' IPs, so a peer
  connects straight to the container port and sees replicas come and go without restarts.

Ports: the container at index k of a pod (k = 0 for a lone role) listens for relays on
ingress_k, for small payloads on lane_k (relay/lane.py) and serves /metrics /healthz
/readyz on metrics_k, where ingress_0 < ingress_1 < ... are the lowest ports >= 7400,
lane_k the lowest >= 7500 and metrics_k the lowest >= 9400 that no user port of the pod
(nor an earlier kind) uses. Service P-R exposes `ingress`, `lane` and `metrics` (port =
targetPort = R's container ports) and R's own ports. User ports may not be named
`ingress`, `lane` or `metrics`.

Environment: every container gets `contract.render_env(role_config(...))`, minus
DISAGG_REPLICA (the runtime takes the ordinal ending DISAGG_POD_NAME, set from the downward
API `metadata.name`: pod P-U-3 is replica 3), then the role's own env (the spec forbids
DISAGG_* names, and a podTemplate cannot override them). DISAGG_DOWNSTREAM names, for each
target T of R (edge targets, then tensor-reference targets):

    T in R's pod:   127.0.0.1:ingress(T)
    otherwise:      P-T.NS.svc.<cluster domain>:ingress(T)
    relay:          the edge's relay (else spec.transport.relay); `auto` for a target that
                    R reaches only through tensor references

DISAGG_SAME_GPU_PEERS lists the other roles of R's group. The topology file is the ConfigMap,
mounted read-only at /etc/disagg. DISAGG_PEER_KEY_FILE = /etc/disagg-peer-key/key: the
Secret P-peer-key (its `key` only, mode 0440, group 65532 through the pod's fsGroup),
mounted read-only at /etc/disagg-peer-key in every role container; roles authenticate each
other (and clients, gateways) with it (docs/security.md).

Pod template:
- image: the role's image, else spec.image; command: the role's, else ["disagg", "role"];
  args, resources, ports as in the spec;
- probes on metrics_k: readiness GET /readyz, liveness GET /healthz, and a startup probe on
  /healthz (which fails until the handler's setup is done) that allows the role's
  startupSeconds (default 600) for loading models: failureThreshold = ceil(startupSeconds / 5);
- hardened: non-root uid/gid 65532, read-only root filesystem, no privilege escalation, all
  capabilities dropped, seccomp RuntimeDefault, no service-account token, no service links;
- volumes: the topology ConfigMap at /etc/disagg, /dev/shm = memory emptyDir with
  sizeLimit = sum(pool size of every role in the pod) + 64Mi, /tmp = emptyDir (writable
  scratch under a read-only root), the peer key Secret at /etc/disagg-peer-key;
- annotation disagg.dev/spec-hash = sha256 of the unit's roles' own entries of topology.json
  (with the pipeline and namespace)[:16]: the one input the pods read from outside their own
  template, so a graph change rolls only the roles whose entries it changes, and a change to
  one role's image or replicas touches that role's StatefulSet only; and, when the
  reconciler passes the key's hash (`peer_key_digest`), disagg.dev/peer-key-hash =
  sha256(key)[:16], so a rotated key (a recreated Secret) rolls every role pod onto it;
- last, the role's `podTemplate` (a PodTemplateSpec) is deep-merged in (see `merge`; for a
  group, each member's in the group's order); labels, both hashes and DISAGG_* variables
  are put back afterwards, so a podTemplate cannot break the selector or the contract.
  Settings that weaken the pods are refused by the spec's checks unless the pipeline opts
  in (disagg_core.spec.podpolicy); containers a podTemplate adds get no privilege
  escalation and no capabilities unless they ask.

NetworkPolicy P-network (policyTypes Ingress; egress stays open: DNS, model stores):
- selects the role pods: {disagg.dev/pipeline: P, app.kubernetes.io/managed-by:
  disagg-operator} and the label disagg.dev/role present;
- the ingress and lane ports of every role, and the roles' own ports, admit the role pods,
  the pipeline's gateway pods ({app.kubernetes.io/component: gateway, disagg.dev/pipeline:
  P}) and `spec.networkPolicy.clients`, all other sources are dropped;
- the metrics ports admit `spec.networkPolicy.metricsFrom`, else every pod of the
  namespace, plus every pod of `options.metrics_namespaces` (the operator's own namespace,
  whose autoscaler scrapes them; a cluster's Prometheus).
Ports are numbers (containers of a group share port names).

GPU modes (pipeline annotation disagg.dev/gpu-mode, else `options.gpu_mode`), for
colocation groups only; lone roles ask for GPUs in their own `resources`:
- `dra` (default): ResourceClaimTemplate P-G-gpu (resource.k8s.io/v1, exactly one device of
  class gpu.nvidia.com, or annotation disagg.dev/gpu-device-class), claimed once per pod as
  `gpu` and listed in every container's `resources.claims`: all containers see the GPU;
- `device-plugin`: `nvidia.com/gpu: 1` in the first container's limits (unless the role sets
  it). Device plugins give a device to one container only: the other containers of the pod
  do not see the GPU, so CUDA IPC is not available to them; shared memory still is;
- `none`: no GPU (clusters without GPUs, kind; shared memory between the containers).

Rollouts: every StatefulSet has `updateStrategy: RollingUpdate` with `partition` =
`options.partitions[U]` (0 when absent: always written, so that dropping it never lets a
half-done rollout run away), and the annotation disagg.dev/template-hash = sha256 of its pod
template[:16]; the reconciler compares that with the live StatefulSet's to step coordinated
rollouts (rollout.py).

Why StatefulSets: stable ordinals give each pod its replica index (DISAGG_REPLICA from the
pod name) for metrics and shared-memory names, and stable per-pod DNS names under the
governing Service; `podManagementPolicy: Parallel` starts and stops pods at once, so
scaling is as fast as with a Deployment. No volume claims are used.

Labels on every object: app.kubernetes.io/{name: disagg, instance: P, component: U,
managed-by: disagg-operator}, disagg.dev/pipeline: P, disagg.dev/role: U (on a Service: its
role), plus disagg.dev/group: G on everything of a group; the ConfigMap has component
`topology` and no role. With an `owner`, every object carries one ownerReference to it
(controller, blockOwnerDeletion), so deleting the pipeline deletes its children.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from disagg_core import contract, placement
from disagg_core.spec import ColocationGroup, Pipeline, Problem, Role, SpecError, child
from disagg_operator import gateway, names, podmonitor, pods

GpuMode = Literal["dra", "device-plugin", "none"]
GPU_MODES: Final[tuple[GpuMode, ...]] = ("dra", "device-plugin", "none")
DRA_API_VERSIONS: Final = ("resource.k8s.io/v1", "resource.k8s.io/v1beta2")
DEFAULT_GPU_DEVICE_CLASS: Final = "gpu.nvidia.com"
RESERVED_PORT_NAMES: Final = ("ingress", "lane", "metrics")
# the runtime's ports of a pod's k-th container are named <kind>-<k> (pods.runtime_port_name)
_RESERVED_PORT_NAME = re.compile(r"(ingress|lane|metrics)(-[0-9]+)?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


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
    # the rollout's partition per unit (operator/disagg_operator/rollout.py); 0 when absent
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


def topology(pipeline: Pipeline, namespace: str) -> contract.Topology:
    return contract.Topology.from_pipeline(pipeline, namespace=namespace)


def topology_text(pipeline: Pipeline, namespace: str) -> str:
    """The ConfigMap's topology.json, byte for byte."""
    return json.dumps(topology(pipeline, namespace).to_json(), indent=2, sort_keys=True) + "\n"


def spec_hash(pipeline: Pipeline, namespace: str, roles: tuple[str, ...]) -> str:
    """The hash of what the pods of `roles` read from outside their own template: their own
    slices of the topology file (and the pipeline and namespace it names). A graph change
    rolls only the roles whose slice it changes."""
    topo = topology(pipeline, namespace).to_json(only=roles)
    slices = topo["roles"]
    mine = {"pipeline": topo["pipeline"], "namespace": topo["namespace"], "roles": slices}
    text = json.dumps(mine, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def gateway_hash(pipeline: Pipeline, namespace: str) -> str:
    """The hash of what the gateway reads from the topology file: the pipeline and
    namespace, its entry roles (and which of them join inputs: those it sends to by hash),
    its exit roles, and how often it resends a request lost with a replica. A graph edit
    that changes none of these (a role added in the middle, or after an exit role that
    stays one) leaves the gateway's pods, and their streams, alone."""
    topo = topology(pipeline, namespace)
    mine = {
        "pipeline": topo.pipeline,
        "namespace": topo.namespace,
        "entries": {r: topo.roles[r].joins for r in sorted(topo.entry_roles)},
        "exits": sorted(topo.exit_roles),
        "migrationAttempts": topo.migration_attempts,
    }
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


def check(pipeline: Pipeline, options: PlanOptions | None = None) -> list[Problem]:
    """Problems the planner finds beyond the spec's own rules (operator-only settings)."""
    options = options or PlanOptions()
    problems: list[Problem] = []
    annotations = "metadata.annotations"
    mode = pipeline.annotations.get(names.ANNOTATION_GPU_MODE, options.gpu_mode)
    if mode not in GPU_MODES:
        problems.append(
            Problem(
                child(annotations, names.ANNOTATION_GPU_MODE),
                f"must be one of {', '.join(GPU_MODES)}; got {mode!r}",
            )
        )
    device_class = gpu_device_class(pipeline)
    if not _DNS_SUBDOMAIN.fullmatch(device_class) or len(device_class) > 253:
        problems.append(
            Problem(
                child(annotations, names.ANNOTATION_GPU_DEVICE_CLASS),
                f"{device_class!r} is not a device class name (a DNS subdomain)",
            )
        )
    known = {*pipeline.role_names, *(group.name for group in pipeline.colocation)}
    unknown = [name for name in external_scaling_names(pipeline) if name not in known]
    if unknown:
        problems.append(
            Problem(
                child(annotations, names.ANNOTATION_EXTERNAL_SCALING),
                f"names no role or colocation group: {', '.join(unknown)}",
            )
        )
    if options.dra_api_version not in DRA_API_VERSIONS:
        raise ValueError(f"dra_api_version must be one of {DRA_API_VERSIONS}")
    index = {role.name: i for i, role in enumerate(pipeline.roles)}
    for group in pipeline.colocation:
        # one pod: port names must be unique across its containers
        seen: dict[str, str] = {}
        for member in group.roles:
            role = pipeline.roles[index[member]] if member in index else None
            for k, port in enumerate(role.ports if role else ()):
                if port.name in seen and seen[port.name] != member:
                    problems.append(
                        Problem(
                            f"spec.roles[{index[member]}].ports[{k}].name",
                            f"{port.name!r} is also a port of {seen[port.name]!r}, in the same "
                            f"pod (colocation group {group.name!r})",
                        )
                    )
                seen.setdefault(port.name, member)
    for i, role in enumerate(pipeline.roles):
        for k, port in enumerate(role.ports):
            if _RESERVED_PORT_NAME.fullmatch(port.name):
                problems.append(
                    Problem(
                        f"spec.roles[{i}].ports[{k}].name",
                        f"{port.name!r} is reserved for the runtime's own port",
                    )
                )
    return problems


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


def plan(
    pipeline: Pipeline,
    *,
    namespace: str,
    owner: Owner | None = None,
    options: PlanOptions | None = None,
    peer_key_hash: str | None = None,
) -> list[dict[str, Any]]:
    """The desired objects, in apply order: the ConfigMap, ResourceClaimTemplates, Services,
    the NetworkPolicy, StatefulSets (each kind in declaration order), then the gateway's
    Service and Deployment. Raises SpecError for
    `check` problems. `peer_key_hash`: `peer_key_digest` of the Secret's key (None: no
    annotation, as in `disagg render`, which knows no key)."""
    options = options or PlanOptions()
    problems = check(pipeline, options)
    if problems:
        raise SpecError(problems)
    units = workloads(pipeline, options)
    mode = gpu_mode(pipeline, options)
    objects: list[dict[str, Any]] = [_config_map(pipeline, namespace)]
    if mode == "dra":
        objects += [
            _claim_template(pipeline, unit, unit.group, namespace, options)
            for unit in units
            if unit.group is not None
        ]
    for unit in units:
        objects += [_service(pipeline, unit, role, namespace) for role in unit.roles]
    if pipeline.network_policy.enabled:
        objects.append(_network_policy(pipeline, units, namespace, options))
    objects += [
        _stateful_set(pipeline, unit, namespace, options, mode, peer_key_hash) for unit in units
    ]
    if pipeline.gateway.enabled:
        objects += _gateway(pipeline, units, namespace, options)
    if options.pod_monitors and podmonitor.wanted(pipeline, options.pod_monitor_default):
        labels = common_labels(pipeline.name, "metrics")
        sizes = [len(unit.roles) for unit in units]
        objects.append(podmonitor.pod_monitor(pipeline, namespace, sizes, labels))
    if owner is not None:
        for obj in objects:
            obj["metadata"]["ownerReferences"] = [owner.reference()]
    return objects


def topology_config_map_name(pipeline: Pipeline) -> str:
    return pipeline.derived_name("topology")


def network_policy_name(pipeline: Pipeline) -> str:
    return pipeline.derived_name("network")


def peer_key_secret_name(pipeline: str) -> str:
    return f"{pipeline}-peer-key"


def peer_key_digest(key: str) -> str:
    """disagg.dev/peer-key-hash of a peer key (the Secret's `key`, as text)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def peer_key_secret(
    pipeline: str, *, namespace: str, key: str, owner: Owner | None = None
) -> dict[str, Any]:
    """The Secret the role pods mount (see the module docstring); `key` comes from the
    caller (`secrets.token_hex(32)`), so that this stays pure."""
    secret: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(
            peer_key_secret_name(pipeline), namespace, common_labels(pipeline, "peer-key")
        ),
        "type": "Opaque",
        "data": {pods.PEER_KEY_KEY: base64.b64encode(key.encode()).decode()},
    }
    if owner is not None:
        secret["metadata"]["ownerReferences"] = [owner.reference()]
    return secret


def claim_template_name(pipeline: Pipeline, group: str) -> str:
    return f"{pipeline.derived_name(group)}-gpu"


def _meta(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels}


def _config_map(pipeline: Pipeline, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(
            topology_config_map_name(pipeline),
            namespace,
            common_labels(pipeline.name, "topology"),
        ),
        "data": {pods.TOPOLOGY_KEY: topology_text(pipeline, namespace)},
    }


def _claim_template(
    pipeline: Pipeline,
    unit: Workload,
    group: ColocationGroup,
    namespace: str,
    options: PlanOptions,
) -> dict[str, Any]:
    return {
        "apiVersion": options.dra_api_version,
        "kind": "ResourceClaimTemplate",
        "metadata": _meta(
            claim_template_name(pipeline, group.name), namespace, unit.labels(pipeline)
        ),
        "spec": {
            "metadata": {"labels": unit.labels(pipeline)},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": pods.GPU_CLAIM,
                            "exactly": {
                                "deviceClassName": gpu_device_class(pipeline),
                                "allocationMode": "ExactCount",
                                "count": 1,
                            },
                        }
                    ]
                }
            },
        },
    }


def _service(pipeline: Pipeline, unit: Workload, role: Role, namespace: str) -> dict[str, Any]:
    ports = role_ports(unit)[role.name]
    service_ports = [
        {"name": "ingress", "port": ports.ingress, "targetPort": ports.ingress, "protocol": "TCP"},
        {"name": "lane", "port": ports.lane, "targetPort": ports.lane, "protocol": "TCP"},
        {"name": "metrics", "port": ports.metrics, "targetPort": ports.metrics, "protocol": "TCP"},
    ]
    service_ports += [
        {
            "name": port.name,
            "port": port.container_port,
            "targetPort": port.container_port,
            "protocol": port.protocol,
        }
        for port in role.ports
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(
            pipeline.derived_name(role.name), namespace, unit.labels(pipeline, role.name)
        ),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": unit.selector(pipeline),
            "ports": service_ports,
        },
    }


def role_selector(pipeline: str) -> dict[str, Any]:
    """A LabelSelector of every role pod of the pipeline (not its gateway's)."""
    return {
        "matchLabels": {names.LABEL_PIPELINE: pipeline, names.LABEL_MANAGED_BY: names.MANAGER},
        "matchExpressions": [{"key": names.LABEL_ROLE, "operator": "Exists"}],
    }


def gateway_selector(pipeline: str) -> dict[str, Any]:
    return {
        "matchLabels": {
            names.LABEL_COMPONENT: names.COMPONENT_GATEWAY,
            names.LABEL_PIPELINE: pipeline,
        }
    }


def _network_policy(
    pipeline: Pipeline, units: tuple[Workload, ...], namespace: str, options: PlanOptions
) -> dict[str, Any]:
    settings = pipeline.network_policy
    runtime: set[tuple[str, int]] = set()
    metrics: set[tuple[str, int]] = set()
    for unit in units:
        for role in unit.roles:
            ports = role_ports(unit)[role.name]
            runtime |= {("TCP", ports.ingress), ("TCP", ports.lane)}
            runtime |= {(port.protocol, port.container_port) for port in role.ports}
            metrics.add(("TCP", ports.metrics))
    peers: list[dict[str, Any]] = [
        {"podSelector": role_selector(pipeline.name)},
        {"podSelector": gateway_selector(pipeline.name)},
        *(dict(peer) for peer in settings.clients),
    ]
    scrapers: list[dict[str, Any]] = [dict(p) for p in settings.metrics_from] or [
        {"podSelector": {}}
    ]
    scrapers += [
        {
            "namespaceSelector": {"matchLabels": {names.LABEL_NAMESPACE_NAME: other}},
            "podSelector": {},
        }
        for other in options.metrics_namespaces
        if other != namespace or settings.metrics_from
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(
            network_policy_name(pipeline), namespace, common_labels(pipeline.name, "network")
        ),
        "spec": {
            "podSelector": role_selector(pipeline.name),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": copy.deepcopy(peers), "ports": _policy_ports(runtime)},
                {"from": copy.deepcopy(scrapers), "ports": _policy_ports(metrics)},
            ],
        },
    }


def _policy_ports(ports: set[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"protocol": protocol, "port": port} for protocol, port in sorted(ports)]


def _stateful_set(
    pipeline: Pipeline,
    unit: Workload,
    namespace: str,
    options: PlanOptions,
    mode: GpuMode,
    peer_key_hash: str | None,
) -> dict[str, Any]:
    configs = {
        role.name: role_config(pipeline, role.name, namespace=namespace, options=options)
        for role in unit.roles
    }
    template = pods.pod_template(
        pipeline,
        unit.roles,
        configs,
        labels=unit.labels(pipeline),
        spec_hash=spec_hash(pipeline, namespace, tuple(r.name for r in unit.roles)),
        config_map=topology_config_map_name(pipeline),
        peer_key_secret=peer_key_secret_name(pipeline.name),
        peer_key_hash=peer_key_hash,
        shared=unit.group is not None,
        gpu=mode if unit.group is not None else "none",
        claim_template=(
            claim_template_name(pipeline, unit.group.name) if unit.group is not None else None
        ),
    )
    spec: dict[str, Any] = {
        "serviceName": pipeline.derived_name(unit.roles[0].name),
        "replicas": unit.replicas,
        "podManagementPolicy": "Parallel",
        "updateStrategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"partition": options.partitions.get(unit.unit, 0)},
        },
        "selector": {"matchLabels": unit.selector(pipeline)},
        "template": template,
    }
    if unit.unit in external_units(pipeline):
        del spec["replicas"]  # the HPA's (or KEDA's) field
    meta = _meta(unit.name, namespace, unit.labels(pipeline))
    meta["annotations"] = {names.ANNOTATION_TEMPLATE_HASH: template_hash(template)}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta, "spec": spec}


def template_hash(template: Mapping[str, Any]) -> str:
    """A unit's pod template, hashed: the live StatefulSet's copy of it tells the rollout
    whether its pods still have to move to a new revision."""
    text = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _gateway(
    pipeline: Pipeline, units: tuple[Workload, ...], namespace: str, options: PlanOptions
) -> list[dict[str, Any]]:
    ports = {name: p for w in units for name, p in role_ports(w).items()}
    domain = options.cluster_domain
    entries = tuple(
        contract.Peer(
            role,
            (f"{pipeline.derived_name(role)}.{namespace}.svc.{domain}:{ports[role].ingress}",),
        )
        for role in pipeline.entry_roles
    )
    policy = []
    if pipeline.network_policy.enabled:
        clients = [dict(peer) for peer in pipeline.network_policy.clients]
        policy = [
            gateway.network_policy(pipeline, namespace, role_selector(pipeline.name), clients)
        ]
    return [
        gateway.service(pipeline, namespace),
        *policy,
        gateway.deployment(
            pipeline,
            namespace,
            entries,
            config_map=topology_config_map_name(pipeline),
            spec_hash=gateway_hash(pipeline, namespace),
            peer_key_secret=peer_key_secret_name(pipeline.name),
        ),
    ]


def child_kinds(options: PlanOptions | None = None) -> tuple[tuple[str, str], ...]:
    """(apiVersion, kind) of every kind `plan` may return, for listing and pruning children."""
    options_ = options or PlanOptions()
    dra = options_.dra_api_version
    return (
        ("v1", "ConfigMap"),
        (dra, "ResourceClaimTemplate"),
        ("v1", "Service"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("apps/v1", "StatefulSet"),
        ("apps/v1", "Deployment"),
    ) + (((podmonitor.API_VERSION, podmonitor.KIND),) if options_.pod_monitors else ())
