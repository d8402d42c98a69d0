"""Planner: a validated pipeline -> the Kubernetes objects that run it. Pure and deterministic.

`plan(pipeline, namespace=NS, owner=OWNER)` returns the desired objects as plain dicts, ready
for server-side apply; the same input always yields equal output (key order included), so
re-applying a plan changes nothing. `disagg render` prints exactly this list.

Naming (P = metadata.name, at most 40 characters; R = a role; G = a colocation group;
`P-R` and `P-G` are at most 52 characters, which the spec checks):

    ConfigMap              P-topology    data `topology.json` = contract.Topology of P
    Service, NetworkPolicy P-R-ranks     a role of groups (`nodes` > 1): its members
    StatefulSet            P-R-wk        a role of groups: its workers of node rank k
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

A role of `ranks: N` > 1 (role/ranks.py in the runtime) is still one container per pod: its
process is rank 0 and starts the other N - 1, so the container is told DISAGG_RANKS=N,
DISAGG_LEADER=127.0.0.1 and DISAGG_RANK_PORT=29500 (torch.distributed's rendezvous, inside
the pod; `check` refuses a role port of 29500/TCP on such a role), and its `resources` are
one rank's: every request and limit is N times the role's (`nvidia.com/gpu: 1` per rank asks
for N GPUs, one per local rank).

A role of `nodes: M` > 1 (`groups`) is a group of M pods per replica: StatefulSet P-R holds
the leaders (node rank 0), StatefulSet P-R-wk the workers of node rank k (1..M-1), all with
the replicas (groups) and partition of the role, so ordinal g of each is group g. Their pods
carry disagg.dev/node-rank; Service P-R selects only node rank 0 (peers see one address per
group), the headless Service P-R-ranks (not-ready addresses published; the StatefulSets'
governing Service) every member, and NetworkPolicy P-R-ranks admits the members to each
other on every port. Each member is told DISAGG_NODES=M, its DISAGG_NODE_RANK and
DISAGG_LEADER = P-R-$(DISAGG_GROUP_INDEX).P-R-ranks.NS.svc.<domain>, the group index coming
from the pod-index label through the downward API. `check` refuses names past 52
characters and external scaling of such a role; the reconciler restarts groups
(reconcile/regroup.py).
DISAGG_SAME_GPU_PEERS lists the other roles of R's group. The topology file is the ConfigMap,
mounted read-only at /etc/disagg. DISAGG_PEER_KEY_FILE = /etc/disagg-peer-key/key: the
Secret P-peer-key (its `key` only, mode 0440, group 65532 through the pod's fsGroup),
mounted read-only at /etc/disagg-peer-key in every role container; roles authenticate each
other (and clients, gateways) with it (docs/security.md).

Engine roles (`roles[].engine`, vLLM) run the engine's server instead of `disagg role`: its
command line and KV connector wiring from the kv edges, ports `engine` and `kv`, /health
probes, no DISAGG_* contract and their own NetworkPolicy rules (`engines`); the rest of
what follows holds for them too.

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

import re
from typing import Any

from disagg_core import contract
from disagg_core.spec import Pipeline, Problem, Role, SpecError, child
from disagg_operator import names
from disagg_operator.plan import engines, groups, manifests, model, podmonitor

MAX_STATEFULSET_NAME = 52

# the runtime's ports of a pod's k-th container are named <kind>-<k> (pods.runtime_port_name)
_RESERVED_PORT_NAME = re.compile(r"(ingress|lane|metrics)(-[0-9]+)?")

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def check(pipeline: Pipeline, options: model.PlanOptions | None = None) -> list[Problem]:
    """Problems the planner finds beyond the spec's own rules (operator-only settings)."""
    options = options or model.PlanOptions()
    problems: list[Problem] = []
    annotations = "metadata.annotations"
    mode = pipeline.annotations.get(names.ANNOTATION_GPU_MODE, options.gpu_mode)
    if mode not in model.GPU_MODES:
        problems.append(
            Problem(
                child(annotations, names.ANNOTATION_GPU_MODE),
                f"must be one of {', '.join(model.GPU_MODES)}; got {mode!r}",
            )
        )
    device_class = model.gpu_device_class(pipeline)
    if not _DNS_SUBDOMAIN.fullmatch(device_class) or len(device_class) > 253:
        problems.append(
            Problem(
                child(annotations, names.ANNOTATION_GPU_DEVICE_CLASS),
                f"{device_class!r} is not a device class name (a DNS subdomain)",
            )
        )
    known = {*pipeline.role_names, *(group.name for group in pipeline.colocation)}
    unknown = [name for name in model.external_scaling_names(pipeline) if name not in known]
    if unknown:
        problems.append(
            Problem(
                child(annotations, names.ANNOTATION_EXTERNAL_SCALING),
                f"names no role or colocation group: {', '.join(unknown)}",
            )
        )
    if options.dra_api_version not in model.DRA_API_VERSIONS:
        raise ValueError(f"dra_api_version must be one of {model.DRA_API_VERSIONS}")
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
        problems += _group_problems(pipeline, role, i)
        problems += _rank_port_problems(role, i)
        problems += _engine_problems(pipeline, role, i)
        for k, port in enumerate(role.ports):
            if _RESERVED_PORT_NAME.fullmatch(port.name):
                problems.append(
                    Problem(
                        f"spec.roles[{i}].ports[{k}].name",
                        f"{port.name!r} is reserved for the runtime's own port",
                    )
                )
    return problems


def _rank_port_problems(role: Role, index: int) -> list[Problem]:
    """A role of several ranks: rank 0 listens on DISAGG_RANK_PORT (torch.distributed's
    rendezvous, MASTER_PORT) in its container, so none of the role's own ports may be it."""
    if role.world_size == 1:
        return []
    return [
        Problem(
            f"spec.roles[{index}].ports[{k}].containerPort",
            f"{port.container_port} is the rendezvous port of the role's ranks "
            f"({contract.PREFIX}RANK_PORT, MASTER_PORT; ranks {role.ranks}, nodes "
            f"{role.nodes}): rank 0 listens on it, so use another port",
        )
        for k, port in enumerate(role.ports)
        if port.container_port == contract.DEFAULT_RANK_PORT and port.protocol == "TCP"
    ]


def _engine_problems(pipeline: Pipeline, role: Role, index: int) -> list[Problem]:
    """An engine role runs in one pod per replica (a multi-node engine is not rendered),
    and its HTTP and KV ports are its own in the pod (a colocation group's engines each
    need their own `port` and `kvPort`)."""
    if role.engine is None:
        return []
    path = f"spec.roles[{index}]"
    problems = []
    if role.nodes > 1:
        problems.append(
            Problem(f"{path}.nodes", "an engine role runs in one pod per replica: nodes must be 1")
        )
    unit = model.workload_of(pipeline, role.name)
    mine = dict(engines.ports(pipeline, role))
    for other in unit.roles:
        if other.name == role.name:
            break  # each clash is reported once, on the later role
        theirs = {p.container_port for p in other.ports}
        if other.engine is not None:
            theirs |= {port for _, port in engines.ports(pipeline, other)}
        for kind, port in mine.items():
            if port in theirs:
                field = "port" if kind == engines.ENGINE_PORT_NAME else "kvPort"
                problems.append(
                    Problem(
                        f"{path}.engine.{field}",
                        f"{port} is also a port of {other.name!r}, in the same pod "
                        f"(colocation group {unit.unit!r})",
                    )
                )
    own = set(mine.values())
    for k, user in enumerate(role.ports):
        if user.name in engines.RESERVED_PORT_NAMES:
            problems.append(
                Problem(f"{path}.ports[{k}].name", f"{user.name!r} is the engine's own port")
            )
        if user.container_port in own:
            problems.append(
                Problem(
                    f"{path}.ports[{k}].containerPort",
                    f"{user.container_port} is the engine's own port",
                )
            )
    return problems


def _group_problems(pipeline: Pipeline, role: Role, index: int) -> list[Problem]:
    """A role of groups: its worker StatefulSets' names fit (a StatefulSet's name is at most
    52 characters: its pods' controller-revision-hash label), and its replicas are the
    operator's to scale (an HPA scaling the leaders alone would split groups)."""
    if not groups.grouped(role):
        return []
    problems = []
    longest = groups.longest_name(pipeline, role)
    if len(longest) > MAX_STATEFULSET_NAME:
        problems.append(
            Problem(
                f"spec.roles[{index}].name",
                f"{longest!r}, the StatefulSet of node rank {role.nodes - 1} of {role.name!r}'s "
                f"groups, is longer than {MAX_STATEFULSET_NAME} characters: shorten the "
                "pipeline's or the role's name",
            )
        )
    if role.name in model.external_units(pipeline):
        problems.append(
            Problem(
                child("metadata.annotations", names.ANNOTATION_EXTERNAL_SCALING),
                f"names {role.name!r}, a role of groups (nodes {role.nodes}): an external "
                "scaler would scale its leaders without their workers",
            )
        )
    return problems


def plan(
    pipeline: Pipeline,
    *,
    namespace: str,
    owner: model.Owner | None = None,
    options: model.PlanOptions | None = None,
    peer_key_hash: str | None = None,
) -> list[dict[str, Any]]:
    """The desired objects, in apply order: the ConfigMap, ResourceClaimTemplates, Services,
    the NetworkPolicy, StatefulSets (each kind in declaration order), then the gateway's
    Service and Deployment. Raises SpecError for
    `check` problems. `peer_key_hash`: `peer_key_digest` of the Secret's key (None: no
    annotation, as in `disagg render`, which knows no key)."""
    options = options or model.PlanOptions()
    problems = check(pipeline, options)
    if problems:
        raise SpecError(problems)
    units = model.workloads(pipeline, options)
    mode = model.gpu_mode(pipeline, options)
    objects: list[dict[str, Any]] = [manifests.config_map(pipeline, namespace, options)]
    if mode == "dra":
        objects += [
            manifests.claim_template(pipeline, unit, unit.group, namespace, options)
            for unit in units
            if unit.group is not None
        ]
    for unit in units:
        objects += [manifests.service(pipeline, unit, role, namespace) for role in unit.roles]
        objects += manifests.ranks_services(pipeline, unit, namespace)
    if pipeline.network_policy.enabled:
        objects.append(manifests.network_policy(pipeline, units, namespace, options))
        for unit in units:
            objects += manifests.ranks_network_policy(pipeline, unit, namespace)
    for unit in units:
        objects += manifests.stateful_sets(pipeline, unit, namespace, options, mode, peer_key_hash)
    if pipeline.gateway.enabled:
        objects += manifests.gateway_objects(pipeline, units, namespace, options)
    if options.pod_monitors and podmonitor.wanted(pipeline, options.pod_monitor_default):
        labels = model.common_labels(pipeline.name, "metrics")
        sizes = [len(unit.roles) for unit in units]
        objects.append(podmonitor.pod_monitor(pipeline, namespace, sizes, labels))
    if owner is not None:
        for obj in objects:
            obj["metadata"]["ownerReferences"] = [owner.reference()]
    return objects


def child_kinds(options: model.PlanOptions | None = None) -> tuple[tuple[str, str], ...]:
    """(apiVersion, kind) of every kind `plan` may return, for listing and pruning children."""
    options_ = options or model.PlanOptions()
    dra = options_.dra_api_version
    return (
        ("v1", "ConfigMap"),
        (dra, "ResourceClaimTemplate"),
        ("v1", "Service"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("apps/v1", "StatefulSet"),
        ("apps/v1", "Deployment"),
    ) + (((podmonitor.API_VERSION, podmonitor.KIND),) if options_.pod_monitors else ())
