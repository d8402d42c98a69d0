"""The DisaggregatedPipeline model: frozen dataclasses plus the graph queries everyone needs.

The operator (planner, status, autoscaler), the contract, the local launcher and the role
process all read the same parsed pipeline, so the questions they ask of it (who is downstream,
which pool settings apply to a role, which group shares a pod) are answered here once instead
of being re-derived from raw dictionaries in each place. Instances come from
`disagg_core.spec.parse_pipeline`, which guarantees the invariants the queries rely on
(unique role names, edges between known roles, no cycles); this module only holds data.

YAML keys are camelCase (Kubernetes convention); attributes are their snake_case forms, except
that an edge's `from`/`to` are `source`/`target` (`from` is a Python keyword).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, get_args

from disagg_core.relays import RELAYS as RELAYS
from disagg_core.relays import RelayKind as RelayKind
from disagg_core.spec.engines import EdgeKind, Engine, KvRole
from disagg_core.spec.paths import PathStep as PathStep
from disagg_core.spec.paths import parse_payload_path as parse_payload_path
from disagg_core.spec.sections import ALL_PODS as ALL_PODS
from disagg_core.spec.sections import (
    DEFAULT_ROLLOUT_STEP_DEADLINE_SECONDS as DEFAULT_ROLLOUT_STEP_DEADLINE_SECONDS,
)
from disagg_core.spec.sections import DEFAULT_TRACE_SAMPLE_RATIO as DEFAULT_TRACE_SAMPLE_RATIO
from disagg_core.spec.sections import NO_PODS as NO_PODS
from disagg_core.spec.sections import ONE_POD as ONE_POD
from disagg_core.spec.sections import IntOrPercent as IntOrPercent
from disagg_core.spec.sections import Monitoring as Monitoring
from disagg_core.spec.sections import NetworkPolicy as NetworkPolicy
from disagg_core.spec.sections import Rollout as Rollout
from disagg_core.spec.sections import Tracing as Tracing

API_VERSION = "disagg.dev/v1alpha1"
KIND = "DisaggregatedPipeline"

PoolDevice = Literal["cpu", "cpu-pinned", "cuda"]
PortProtocol = Literal["TCP", "UDP", "SCTP"]
GatewayApi = Literal["native", "openai"]
POOL_DEVICES: tuple[PoolDevice, ...] = get_args(PoolDevice)
PORT_PROTOCOLS: tuple[PortProtocol, ...] = get_args(PortProtocol)
GATEWAY_APIS: tuple[GatewayApi, ...] = get_args(GatewayApi)

# Names. The operator derives `<pipeline>-<role>` (workload, headless Service) and
# `<pipeline>-<group>` (the workload of a colocation group). A StatefulSet labels each pod with
# `controller-revision-hash: <statefulset>-<hash of up to 10 characters>`, and label values are
# at most 63 characters, so a derived workload name may have at most 63 - 11 = 52 characters.
# The pipeline name is capped lower so that every role keeps room for a readable name.
MAX_LABEL_LENGTH = 63
MAX_DERIVED_NAME_LENGTH = 52
MAX_PIPELINE_NAME_LENGTH = 40

# Defaults applied when a field is omitted.
DEFAULT_RELAY: RelayKind = "auto"
DEFAULT_POOL_SIZE = 256 * 2**20
DEFAULT_MIN_BLOCK = 2**20
DEFAULT_POOL_DEVICE: PoolDevice = "cpu"
DEFAULT_REQUEST_TIMEOUT_SECONDS = 30.0
DEFAULT_REPLICAS = 1
DEFAULT_RANKS = 1  # processes per pod of a replica (tensor/sequence parallel)
DEFAULT_NODES = 1  # pods per replica (a multi-node group)
DEFAULT_CONCURRENCY = 4
DEFAULT_TARGET_POOL_OCCUPANCY = 0.7
DEFAULT_SCALE_UP_STABILIZATION_SECONDS = 0  # the HorizontalPodAutoscaler defaults
DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS = 300
DEFAULT_TOLERANCE = 0.1
DEFAULT_MAX_BATCH_WAIT_MILLISECONDS = 5.0
DEFAULT_MIGRATION_ATTEMPTS = 3  # request migration: resends of a request lost with a replica
DEFAULT_STARTUP_SECONDS = 600  # model loading may be slow; the startup probe allows this long

# Maxima: far above any real pipeline, low enough that a typo (or a hostile spec) cannot ask
# the cluster for a billion pods or an exabyte of shared memory. The CRD carries the same.
MAX_REPLICAS = 1000
MAX_CONCURRENCY = 1024
MAX_POOL_SIZE = 2**40  # 1 TiB per role replica
MAX_REQUEST_TIMEOUT_SECONDS = 86400.0
MAX_MIGRATION_ATTEMPTS = 10
MAX_STABILIZATION_SECONDS = 86400
MAX_RATIO_SHARE = 1000

# The pipeline annotation that lets role podTemplates weaken the pods' isolation (privileged,
# host namespaces, hostPath, root, added capabilities; see `podpolicy`). Only "true" opts in.
ANNOTATION_ALLOW_PRIVILEGED = "disagg.dev/allow-privileged"
# The largest `max_tokens` the model behind an OpenAI gateway accepts: the gateway answers
# 400 naming `max_tokens` above it, instead of a role's 502 naming its own parameter.
ANNOTATION_GATEWAY_MAX_TOKENS = "disagg.dev/gateway-max-tokens"
MAX_GATEWAY_TOKENS = 2**31 - 1
DEFAULT_GATEWAY_PORT = 8080
DEFAULT_GATEWAY_REPLICAS = 1
DEFAULT_TOKEN_KEY = "token"
GATEWAY_NAME = "gateway"  # the gateway's Deployment is P-gateway: no role or group may be


@dataclass(frozen=True, kw_only=True)
class PoolSettings:
    """The staging pool a role receives into: size and minimum block in bytes, and device."""

    size: int = DEFAULT_POOL_SIZE
    min_block: int = DEFAULT_MIN_BLOCK
    device: PoolDevice = DEFAULT_POOL_DEVICE


@dataclass(frozen=True, kw_only=True)
class PoolOverride:
    """A role's `transport`: pool settings that replace the pipeline's; None keeps them."""

    pool_size: int | None = None
    min_block: int | None = None
    pool_device: PoolDevice | None = None


@dataclass(frozen=True, kw_only=True)
class Transport:
    """`spec.transport`: the default relay per edge, the default pool, the request timeout,
    and how often a request lost with a replica before any output of it came back is
    resent to a live one (`migration_attempts`; 0: never; a role whose handler is not
    idempotent says so with `Role.idempotent`, and requests that may have run there are
    then not resent)."""

    relay: RelayKind = DEFAULT_RELAY
    pool_size: int = DEFAULT_POOL_SIZE
    min_block: int = DEFAULT_MIN_BLOCK
    pool_device: PoolDevice = DEFAULT_POOL_DEVICE
    request_timeout_seconds: float = DEFAULT_REQUEST_TIMEOUT_SECONDS
    migration_attempts: int = DEFAULT_MIGRATION_ATTEMPTS

    @property
    def pool(self) -> PoolSettings:
        return PoolSettings(size=self.pool_size, min_block=self.min_block, device=self.pool_device)


@dataclass(frozen=True, kw_only=True)
class EnvSetting:
    """One container environment variable, as in Kubernetes (`value` or `valueFrom`)."""

    name: str
    value: str = ""
    value_from: Mapping[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class Port:
    """An extra container port a role exposes (the runtime's own ports come from the contract)."""

    name: str
    container_port: int
    protocol: PortProtocol = "TCP"


@dataclass(frozen=True, kw_only=True)
class Resources:
    """Container resource requests and limits, quantities kept as written (e.g. `"16Gi"`)."""

    requests: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Autoscaling:
    """Backlog-driven scaling: the autoscaler keeps the role's mean pool occupancy near
    `target_pool_occupancy` and, when set, its mean queue depth per replica near
    `target_queue_per_replica` (the larger ratio wins), ignores deviations within `tolerance`
    (relative), and clamps to [`min_replicas`, `max_replicas`]. A role's `replicas` outside
    that range is allowed: it is the starting point, and the autoscaler clamps it."""

    min_replicas: int = 1
    max_replicas: int
    target_pool_occupancy: float = DEFAULT_TARGET_POOL_OCCUPANCY
    scale_up_stabilization_seconds: int = DEFAULT_SCALE_UP_STABILIZATION_SECONDS
    scale_down_stabilization_seconds: int = DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS
    tolerance: float = DEFAULT_TOLERANCE
    target_queue_per_replica: float | None = None  # None: occupancy is the only signal


@dataclass(frozen=True, kw_only=True)
class Batching:
    """Gather up to `max_batch_size` waiting requests into one `batch()` call of the handler,
    waiting at most `max_wait_milliseconds` after the first for the batch to fill."""

    max_batch_size: int
    max_wait_milliseconds: float = DEFAULT_MAX_BATCH_WAIT_MILLISECONDS


@dataclass(frozen=True, kw_only=True)
class Role:
    """One stage: `replicas` processes running `handler` (`module.path:function` or a class
    with setup/batch/close), `handler_args` (free-form JSON) handed to its `setup`. A replica
    is `nodes` pods (a group: leader and workers) of `ranks` processes each, one
    torch.distributed world of `world_size` ranks; rank 0 owns the transport. A role with
    an `engine` runs that engine instead (its `handler` is ""; spec/engines.py)."""

    name: str
    handler: str
    replicas: int = DEFAULT_REPLICAS
    image: str | None = None
    command: tuple[str, ...] | None = None
    args: tuple[str, ...] | None = None
    env: tuple[EnvSetting, ...] = ()
    resources: Resources = field(default_factory=Resources)
    ports: tuple[Port, ...] = ()
    transport: PoolOverride = field(default_factory=PoolOverride)
    concurrency: int = DEFAULT_CONCURRENCY
    autoscaling: Autoscaling | None = None
    pod_template: dict[str, Any] | None = None  # free-form; the operator merges it
    handler_args: Mapping[str, Any] = field(default_factory=dict)  # JSON, given to setup()
    batching: Batching | None = None
    startup_seconds: int = DEFAULT_STARTUP_SECONDS
    compat: str | None = None  # payload-contract token (disagg_core.compat); None: auto
    compatible_with: tuple[str, ...] = ()  # further tokens this revision interoperates with
    ranks: int = DEFAULT_RANKS
    nodes: int = DEFAULT_NODES
    # running a request twice is harmless (every built-in handler): a request lost with a
    # replica may be resent whole (transport.migrationAttempts) even after this role ran it
    idempotent: bool = True
    engine: Engine | None = None

    @property
    def world_size(self) -> int:
        """Ranks of one replica: `ranks` per pod times `nodes` pods."""
        return self.ranks * self.nodes

    @property
    def handler_module(self) -> str:
        return self.handler.partition(":")[0]

    @property
    def handler_attr(self) -> str:
        return self.handler.partition(":")[2]


@dataclass(frozen=True, kw_only=True)
class TensorRef:
    """A tensor at `path` in the payload that goes straight to the later role `to`."""

    path: str
    to: str

    @property
    def steps(self) -> tuple[PathStep, ...]:
        return parse_payload_path(self.path)


@dataclass(frozen=True, kw_only=True)
class Edge:
    """`source` hands its result to `target`; `relay` None means the pipeline default. A
    `kv` edge joins two engine roles: the source's KV blocks go to the target (prefill ->
    decode; spec/engines.py), where a `payload` edge carries a handler's result."""

    source: str
    target: str
    relay: RelayKind | None = None
    tensor_refs: tuple[TensorRef, ...] = ()
    kind: EdgeKind = "payload"


@dataclass(frozen=True, kw_only=True)
class ColocationGroup:
    """Roles that share one GPU and one pod; `name` defaults to the first role's name."""

    name: str
    roles: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class RatioLockSpec:
    """Hold `follower` replicas at `follower_share / leader_share` of `leader`'s: when the
    leader scales, the follower follows (unless within `tolerance`, relative)."""

    leader: str
    follower: str
    leader_share: int = 1
    follower_share: int = 1
    tolerance: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SecretKeyRef:
    """A key of a Secret in the pipeline's namespace."""

    name: str
    key: str = DEFAULT_TOKEN_KEY


@dataclass(frozen=True, kw_only=True)
class Gateway:
    """`spec.gateway`: the HTTP front door (on unless `enabled: false`). `api: openai` adds
    the OpenAI-compatible routes for `model`; `auth` names the Secret key holding the bearer
    token clients must send."""

    enabled: bool = True
    replicas: int = DEFAULT_GATEWAY_REPLICAS
    port: int = DEFAULT_GATEWAY_PORT
    api: GatewayApi = "native"
    model: str | None = None
    auth: SecretKeyRef | None = None
    resources: Resources = field(default_factory=Resources)
    pod_template: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """A validated DisaggregatedPipeline. Queries take and return role names; an unknown name
    raises KeyError."""

    name: str
    namespace: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    image: str | None = None
    transport: Transport = field(default_factory=Transport)
    roles: tuple[Role, ...] = ()
    edges: tuple[Edge, ...] = ()
    colocation: tuple[ColocationGroup, ...] = ()
    ratio_locks: tuple[RatioLockSpec, ...] = ()
    network_policy: NetworkPolicy = field(default_factory=NetworkPolicy)
    rollout: Rollout = field(default_factory=Rollout)
    gateway: Gateway = field(default_factory=Gateway)
    monitoring: Monitoring = field(default_factory=Monitoring)

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(role.name for role in self.roles)

    # Indexes of the graph, built once per (immutable) pipeline: the planner asks these
    # questions for every role, so a scan per question made rendering cubic in the roles.
    @cached_property
    def _by_name(self) -> dict[str, Role]:
        return {role.name: role for role in self.roles}

    @cached_property
    def _edges_by(self) -> tuple[dict[str, tuple[Edge, ...]], dict[str, tuple[Edge, ...]]]:
        sources: dict[str, list[Edge]] = {}
        targets: dict[str, list[Edge]] = {}
        for edge in self.edges:
            sources.setdefault(edge.source, []).append(edge)
            targets.setdefault(edge.target, []).append(edge)
        return (
            {k: tuple(v) for k, v in sources.items()},
            {k: tuple(v) for k, v in targets.items()},
        )

    @cached_property
    def derived(self) -> dict[Any, Any]:
        """A cache for values derived from this pipeline (the contract's topology)."""
        return {}

    @property
    def gateway_max_tokens(self) -> int:
        """ANNOTATION_GATEWAY_MAX_TOKENS as a number; 0 when absent (or invalid: `checks`)."""
        raw = self.annotations.get(ANNOTATION_GATEWAY_MAX_TOKENS, "")
        return int(raw) if raw.isdigit() and 0 < int(raw) <= MAX_GATEWAY_TOKENS else 0

    def role(self, name: str) -> Role:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"pipeline {self.name!r} has no role {name!r}") from None

    def derived_name(self, part: str) -> str:
        """The object name the operator derives for a role or colocation group."""
        return f"{self.name}-{part}"

    def edges_from(self, name: str) -> tuple[Edge, ...]:
        self.role(name)
        return self._edges_by[0].get(name, ())

    def edges_to(self, name: str) -> tuple[Edge, ...]:
        self.role(name)
        return self._edges_by[1].get(name, ())

    def downstream(self, name: str) -> tuple[str, ...]:
        """Roles `name` sends to directly, in edge order."""
        return tuple(edge.target for edge in self.edges_from(name))

    def upstream(self, name: str) -> tuple[str, ...]:
        """Roles that send to `name` directly, in edge order."""
        return tuple(edge.source for edge in self.edges_to(name))

    def reachable_from(self, name: str) -> frozenset[str]:
        """Roles reachable from `name` over one or more edges."""
        seen: set[str] = set()
        frontier = list(self.downstream(name))
        while frontier:
            current = frontier.pop()
            if current not in seen:
                seen.add(current)
                frontier.extend(self.downstream(current))
        return frozenset(seen)

    @property
    def entry_roles(self) -> tuple[str, ...]:
        """Roles without incoming edges: where clients submit requests."""
        targets = {edge.target for edge in self.edges}
        return tuple(name for name in self.role_names if name not in targets)

    @property
    def exit_roles(self) -> tuple[str, ...]:
        """Roles without outgoing edges: where results come back from."""
        sources = {edge.source for edge in self.edges}
        return tuple(name for name in self.role_names if name not in sources)

    @cached_property
    def topological_order(self) -> tuple[str, ...]:
        """Every role after all of its upstreams; ties keep declaration order."""
        indegree = {name: len(self.upstream(name)) for name in self.role_names}
        order: list[str] = []
        ready = collections.deque(name for name in self.role_names if indegree[name] == 0)
        while ready:
            current = ready.popleft()
            order.append(current)
            for target in self.downstream(current):
                indegree[target] -= 1
                if indegree[target] == 0:
                    ready.append(target)
        if len(order) != len(self.roles):
            raise ValueError(f"pipeline {self.name!r} has a cycle")
        return tuple(order)

    def colocation_group_of(self, name: str) -> ColocationGroup | None:
        self.role(name)
        return next((group for group in self.colocation if name in group.roles), None)

    def pool_for(self, name: str) -> PoolSettings:
        """The effective pool of a role: its own `transport` fields, else the pipeline's."""
        override = self.role(name).transport
        default = self.transport
        return PoolSettings(
            size=default.pool_size if override.pool_size is None else override.pool_size,
            min_block=default.min_block if override.min_block is None else override.min_block,
            device=default.pool_device if override.pool_device is None else override.pool_device,
        )

    def relay_for(self, edge: Edge) -> RelayKind:
        """The relay an edge uses as written (`auto` is resolved at run time)."""
        return self.transport.relay if edge.relay is None else edge.relay

    def image_for(self, name: str) -> str | None:
        role = self.role(name)
        return self.image if role.image is None else role.image

    @property
    def engine_roles(self) -> tuple[str, ...]:
        """Roles that run an engine instead of a handler."""
        return tuple(role.name for role in self.roles if role.engine is not None)

    def kv_role(self, name: str) -> KvRole | None:
        """An engine role's part in KV transfer, from its `kv` edges: the producer (prefill)
        sends, the consumer (decode) receives; None for an engine without kv edges."""
        if any(edge.kind == "kv" for edge in self.edges_from(name)):
            return "kv_producer"
        if any(edge.kind == "kv" for edge in self.edges_to(name)):
            return "kv_consumer"
        return None

    def kv_targets(self, name: str) -> tuple[str, ...]:
        """The decode roles a prefill role's KV blocks go to, in edge order."""
        return tuple(edge.target for edge in self.edges_from(name) if edge.kind == "kv")

    def tensor_refs_to(self, name: str) -> tuple[tuple[Edge, TensorRef], ...]:
        """The tensor references that `name` consumes, with the edge each is declared on."""
        self.role(name)
        return tuple(
            (edge, ref) for edge in self.edges for ref in edge.tensor_refs if ref.to == name
        )
