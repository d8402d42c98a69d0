"""The operator <-> runtime contract: what a role container is told, and nothing else.

Two parts, both rendered by the operator (and by `disagg up` for local processes) and
parsed here into a `RoleConfig`. Torch-free: the operator imports it.

- The environment: the `ENV` table below is the one list of variables (name, default,
  meaning). `render_env` and `parse_env` are driven by it, and docs/contract.md prints it.
- The topology file (JSON, mounted from a ConfigMap): the pipeline's graph as the runtime
  needs it: per role whether it is an entry or exit, its upstream roles (fan-in joins wait
  for all), its tensor references in and out. See `Topology`.

Which values a role gets is decided by `disagg_core.placement.role_config`, the one
derivation shared by the operator's planner and `disagg up`.

The gateway (`disagg gateway`, the pipeline's HTTP front door) is configured the same way:
`GATEWAY_ENV` is its table (the role variables it shares keep their meaning: DISAGG_DOWNSTREAM
names the entry roles, DISAGG_INGRESS_PORT is where exit roles send replies,
DISAGG_POOL_SIZE sizes its reply pool), parsed by `parse_gateway_env` into a
`GatewayConfig`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from disagg_core import compat
from disagg_core.quantity import format_bytes, parse_bytes
from disagg_core.spec.model import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MIN_BLOCK,
    DEFAULT_POOL_DEVICE,
    DEFAULT_POOL_SIZE,
    DEFAULT_REQUEST_TIMEOUT_SECONDS,
    POOL_DEVICES,
    RELAYS,
    Pipeline,
    PoolDevice,
    PoolSettings,
)

PREFIX = "DISAGG_"
DEFAULT_INGRESS_PORT = 7400
DEFAULT_LANE_PORT = 7500
DEFAULT_METRICS_PORT = 9400
DEFAULT_TOPOLOGY_FILE = "/etc/disagg/topology.json"
DEFAULT_PEER_KEY_FILE = "/etc/disagg-peer-key/key"
TOPOLOGY_VERSION = 1


class ContractError(ValueError):
    """The environment or topology file given to a role is missing or malformed."""


@dataclass(frozen=True)
class RefSpec:
    """A tensor reference: `path` of `source`'s output goes straight to `target`."""

    source: str
    path: str
    target: str


@dataclass(frozen=True)
class RoleTopology:
    name: str
    upstream: tuple[str, ...]
    downstream: tuple[str, ...]
    refs_out: tuple[RefSpec, ...] = ()
    refs_in: tuple[RefSpec, ...] = ()

    @property
    def entry(self) -> bool:
        return not self.upstream

    @property
    def exit(self) -> bool:
        return not self.downstream

    @property
    def joins(self) -> bool:
        """It gathers a request's inputs from more than one sender (fan-in, tensor
        references): all of them must reach the same replica of it."""
        return len(self.upstream) > 1 or bool(self.refs_in)


@dataclass(frozen=True)
class Topology:
    """The pipeline graph, as every role of it sees it."""

    pipeline: str
    namespace: str
    roles: Mapping[str, RoleTopology]

    @property
    def entry_roles(self) -> tuple[str, ...]:
        return tuple(n for n, r in self.roles.items() if r.entry)

    @property
    def exit_roles(self) -> tuple[str, ...]:
        return tuple(n for n, r in self.roles.items() if r.exit)

    @classmethod
    def from_pipeline(cls, pipeline: Pipeline, namespace: str | None = None) -> Topology:
        refs = [
            RefSpec(edge.source, ref.path, ref.to)
            for edge in pipeline.edges
            for ref in edge.tensor_refs
        ]
        roles = {
            name: RoleTopology(
                name=name,
                upstream=pipeline.upstream(name),
                downstream=pipeline.downstream(name),
                refs_out=tuple(r for r in refs if r.source == name),
                refs_in=tuple(r for r in refs if r.target == name),
            )
            for name in pipeline.topological_order
        }
        ns = namespace if namespace is not None else (pipeline.namespace or "")
        return cls(pipeline=pipeline.name, namespace=ns, roles=roles)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": TOPOLOGY_VERSION,
            "pipeline": self.pipeline,
            "namespace": self.namespace,
            "roles": [
                {
                    "name": r.name,
                    "upstream": list(r.upstream),
                    "downstream": list(r.downstream),
                    "refsOut": [{"path": x.path, "to": x.target} for x in r.refs_out],
                    "refsIn": [{"path": x.path, "from": x.source} for x in r.refs_in],
                }
                for r in self.roles.values()
            ],
        }

    @classmethod
    def from_json(cls, obj: object) -> Topology:
        try:
            if not isinstance(obj, dict) or obj.get("version") != TOPOLOGY_VERSION:
                raise ContractError(f"topology: expected version {TOPOLOGY_VERSION} object")
            roles: dict[str, RoleTopology] = {}
            for r in obj["roles"]:
                name = str(r["name"])
                roles[name] = RoleTopology(
                    name=name,
                    upstream=tuple(str(x) for x in r["upstream"]),
                    downstream=tuple(str(x) for x in r["downstream"]),
                    refs_out=tuple(
                        RefSpec(name, str(x["path"]), str(x["to"])) for x in r["refsOut"]
                    ),
                    refs_in=tuple(
                        RefSpec(str(x["from"]), str(x["path"]), name) for x in r["refsIn"]
                    ),
                )
            return cls(pipeline=str(obj["pipeline"]), namespace=str(obj["namespace"]), roles=roles)
        except (KeyError, TypeError) as exc:
            raise ContractError(f"topology: malformed ({exc!r})") from None


@dataclass(frozen=True)
class Peer:
    """Where one downstream role listens: host:port entries (DNS names are re-resolved)."""

    role: str
    addresses: tuple[str, ...]
    relay: str = "auto"

    def render(self) -> str:
        suffix = "" if self.relay == "auto" else f"@{self.relay}"
        return f"{self.role}={'|'.join(self.addresses)}{suffix}"


@dataclass(frozen=True)
class RoleConfig:
    pipeline: str
    namespace: str
    role: str
    replica: int
    handler: str
    pool: PoolSettings
    topology: Topology
    downstream: tuple[Peer, ...] = ()
    same_gpu_peers: frozenset[str] = frozenset()
    rdma_peers: frozenset[str] = frozenset()
    node_local: bool = False
    bind_host: str = "0.0.0.0"
    ingress_port: int = DEFAULT_INGRESS_PORT
    lane_port: int = DEFAULT_LANE_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    concurrency: int = DEFAULT_CONCURRENCY
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_SECONDS
    pod_name: str = ""
    topology_file: str = DEFAULT_TOPOLOGY_FILE
    peers_file: str = ""
    metrics_dump: str = ""
    peer_key_file: str = ""
    handler_args: Mapping[str, Any] = field(default_factory=dict)
    max_batch_size: int = 1
    max_batch_wait_ms: float = 0.0
    dispatch: str = "load"
    compat: str = ""  # the role's compat token (disagg_core.compat; "": auto from the handler)
    compatible_with: frozenset[str] = frozenset()

    @property
    def me(self) -> RoleTopology:
        return self.topology.roles[self.role]

    def peer(self, role: str) -> Peer:
        for p in self.downstream:
            if p.role == role:
                return p
        raise ContractError(f"{PREFIX}DOWNSTREAM has no entry for role {role!r}")


# ---- the environment: one table ------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """How one variable's value is written and read back (`name` is for error messages)."""

    render: Callable[[Any], str]
    parse: Callable[[str, str], Any]  # (variable name, raw text) -> value


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ContractError(f"{name}={raw!r} is not an integer") from None


def _parse_seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ContractError(f"{name}={raw!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise ContractError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def _parse_bytes(name: str, raw: str) -> int:
    try:
        return parse_bytes(raw)
    except ValueError as exc:
        raise ContractError(f"{name}={raw!r}: {exc}") from None


def _parse_device(name: str, raw: str) -> PoolDevice:
    if raw not in POOL_DEVICES:
        raise ContractError(f"{name}={raw!r}; expected one of {POOL_DEVICES}")
    return raw


DISPATCH_MODES = ("load", "hash")


def _parse_dispatch(name: str, raw: str) -> str:
    if raw not in DISPATCH_MODES:
        raise ContractError(f"{name}={raw!r}; expected one of {', '.join(DISPATCH_MODES)}")
    return raw


def _parse_json_object(name: str, raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ContractError(f"{name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ContractError(f"{name} must be a JSON object, got {raw[:40]!r}")
    return value


def _parse_batch_size(name: str, raw: str) -> int:
    value = _parse_int(name, raw)
    if value < 1:
        raise ContractError(f"{name}={raw!r} must be at least 1")
    return value


def _parse_millis(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ContractError(f"{name}={raw!r} is not a number of milliseconds") from None
    if not 0 <= value <= 60_000:
        raise ContractError(f"{name}={raw!r} must be in 0..60000 milliseconds")
    return value


TEXT = Kind(str, lambda name, raw: raw)
INT = Kind(str, _parse_int)
ORDINAL = Kind(str, lambda name, raw: _parse_int(name, raw) if raw else None)
SECONDS = Kind(lambda v: f"{v:g}", _parse_seconds)
BYTES = Kind(str, _parse_bytes)
FLAG = Kind(lambda v: "1" if v else "0", lambda name, raw: raw == "1")
DEVICE = Kind(str, _parse_device)
ROLES = Kind(
    lambda v: ",".join(sorted(v)), lambda name, raw: frozenset(filter(None, raw.split(",")))
)
JSON_OBJECT = Kind(
    lambda v: json.dumps(v, sort_keys=True, separators=(",", ":")) if v else "",
    _parse_json_object,
)
BATCH_SIZE = Kind(lambda v: str(v) if v > 1 else "", _parse_batch_size)
MILLIS = Kind(lambda v: f"{v:g}" if v else "", _parse_millis)


def _parse_compat(name: str, raw: str) -> str:
    if not raw:
        return ""
    try:
        return compat.Compat.from_wire({"token": raw}, name).token
    except compat.CompatError as exc:
        raise ContractError(str(exc)) from None


def _parse_tokens(name: str, raw: str) -> frozenset[str]:
    try:
        return frozenset(compat.check_token(t, name) for t in filter(None, raw.split(",")))
    except compat.CompatError as exc:
        raise ContractError(str(exc)) from None


COMPAT = Kind(str, _parse_compat)
TOKENS = Kind(lambda v: ",".join(sorted(v)), _parse_tokens)
PEERS = Kind(lambda v: ",".join(p.render() for p in v), lambda name, raw: parse_downstream(raw))
DISPATCH = Kind(lambda v: "" if v == "load" else str(v), _parse_dispatch)


@dataclass(frozen=True)
class EnvVar:
    """One `DISAGG_*` variable: the RoleConfig field it carries (a dotted path for the pool),
    its default (None: required) and what it means. `optional` ones are rendered only when
    set (the empty string is their unset value)."""

    key: str
    field: str
    kind: Kind
    doc: str
    default: str | None = None
    optional: bool = False

    @property
    def name(self) -> str:
        return PREFIX + self.key


ENV: Final[tuple[EnvVar, ...]] = (
    EnvVar("PIPELINE", "pipeline", TEXT, "pipeline name"),
    EnvVar("NAMESPACE", "namespace", TEXT, 'namespace ("" locally)', default=""),
    EnvVar("ROLE", "role", TEXT, "this container's role"),
    EnvVar(
        "REPLICA",
        "replica",
        ORDINAL,
        "replica index; unset in pods: the ordinal ending DISAGG_POD_NAME, else 0",
        default="",
    ),
    EnvVar(
        "POD_NAME",
        "pod_name",
        TEXT,
        "pod name (downward API), for the replica ordinal and logs",
        default="",
        optional=True,
    ),
    EnvVar("HANDLER", "handler", TEXT, "module.path:function (or :Class) of the handler"),
    EnvVar(
        "HANDLER_ARGS",
        "handler_args",
        JSON_OBJECT,
        "JSON object handed to the handler's setup(ctx) as ctx.args (roles[].handlerArgs)",
        default="{}",
        optional=True,
    ),
    EnvVar(
        "MAX_BATCH_SIZE",
        "max_batch_size",
        BATCH_SIZE,
        "requests gathered into one batch() call of the handler (roles[].batching; 1: none)",
        default="1",
        optional=True,
    ),
    EnvVar(
        "MAX_BATCH_WAIT_MS",
        "max_batch_wait_ms",
        MILLIS,
        "how long a batch may wait to fill after its first request, milliseconds",
        default="0",
        optional=True,
    ),
    EnvVar("BIND_HOST", "bind_host", TEXT, "ingress/lane/metrics bind address", "0.0.0.0"),
    EnvVar("INGRESS_PORT", "ingress_port", INT, "relay ingress port", str(DEFAULT_INGRESS_PORT)),
    EnvVar(
        "LANE_PORT",
        "lane_port",
        INT,
        "inline lane port: small payloads on a plain socket beside the ZMQ ingress "
        "(relay/lane.py; 0 = any free port)",
        str(DEFAULT_LANE_PORT),
    ),
    EnvVar(
        "METRICS_PORT",
        "metrics_port",
        INT,
        "/metrics /healthz /readyz port",
        str(DEFAULT_METRICS_PORT),
    ),
    EnvVar(
        "POOL_SIZE",
        "pool.size",
        BYTES,
        "receive pool bytes (integer or quantity, e.g. 256Mi)",
        format_bytes(DEFAULT_POOL_SIZE),
    ),
    EnvVar(
        "POOL_MIN_BLOCK",
        "pool.min_block",
        BYTES,
        "buddy minimum block",
        format_bytes(DEFAULT_MIN_BLOCK),
    ),
    EnvVar("POOL_DEVICE", "pool.device", DEVICE, " | ".join(POOL_DEVICES), DEFAULT_POOL_DEVICE),
    EnvVar("CONCURRENCY", "concurrency", INT, "requests handled at once", str(DEFAULT_CONCURRENCY)),
    EnvVar(
        "REQUEST_TIMEOUT",
        "request_timeout",
        SECONDS,
        "seconds a request may live",
        f"{DEFAULT_REQUEST_TIMEOUT_SECONDS:g}",
    ),
    EnvVar(
        "DOWNSTREAM",
        "downstream",
        PEERS,
        "peers this role sends to, per role: `role=host:port[|host:port...][@relay]` joined "
        "by `,`; host may be a DNS name (a headless Service: every A record is a replica, "
        f"re-resolved) or an IP; relay {'|'.join(RELAYS)}",
        default="",
    ),
    EnvVar(
        "SAME_GPU_PEERS",
        "same_gpu_peers",
        ROLES,
        "comma list of roles sharing this container's GPU (same pod)",
        default="",
    ),
    EnvVar(
        "RDMA_PEERS",
        "rdma_peers",
        ROLES,
        "comma list of target roles whose pods, like this one, request an RDMA device "
        "(relay auto prefers nixl to them where the image has it)",
        default="",
    ),
    EnvVar(
        "NODE_LOCAL",
        "node_local",
        FLAG,
        '"1" when every peer shares this host\'s /dev/shm (disagg up)',
        default="0",
    ),
    EnvVar(
        "DISPATCH",
        "dispatch",
        DISPATCH,
        "how this role picks a downstream replica for a new request: `load` (power of two "
        "choices over the load replicas advertise; roles that join inputs always hash) or "
        "`hash` (rendezvous hash of the request id, as before loads were advertised)",
        default="load",
        optional=True,
    ),
    EnvVar(
        "TOPOLOGY_FILE",
        "topology_file",
        TEXT,
        "path of the topology file",
        DEFAULT_TOPOLOGY_FILE,
    ),
    EnvVar(
        "PEERS_FILE",
        "peers_file",
        TEXT,
        'JSON {"role": ["host:port", ...]} overriding the addresses of DISAGG_DOWNSTREAM, '
        "re-read when it changes (`disagg up` scales replicas with it; pods use DNS instead)",
        default="",
        optional=True,
    ),
    EnvVar(
        "METRICS_DUMP",
        "metrics_dump",
        TEXT,
        "the role writes its final metrics to this path on exit",
        default="",
        optional=True,
    ),
    EnvVar(
        "COMPAT",
        "compat",
        COMPAT,
        "the role's compat token (roles[].compat, else auto: plus a hash of its handler and "
        "image), advertised to senders, which pair only with compatible revisions "
        "(docs/rollout.md)",
        default="",
        optional=True,
    ),
    EnvVar(
        "COMPATIBLE_WITH",
        "compatible_with",
        TOKENS,
        "comma list of further compat tokens this revision interoperates with "
        "(roles[].compatibleWith)",
        default="",
        optional=True,
    ),
    EnvVar(
        "PEER_KEY_FILE",
        "peer_key_file",
        TEXT,
        "path of the pipeline's peer key (hex; in pods the `key` of the Secret P-peer-key, "
        "docs/security.md)",
        default="",
        optional=True,
    ),
)


def _field(config: object, path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def render_env(config: RoleConfig) -> dict[str, str]:
    """The environment a container gets for `config` (the operator and `disagg up` use it)."""
    env = {}
    for var in ENV:
        value = var.kind.render(_field(config, var.field))
        if value or not var.optional:
            env[var.name] = value
    return env


def env_table() -> list[tuple[str, str | None, str]]:
    """(name, default or None if required, meaning) per variable, for docs/contract.md: the
    roles' variables, then those only the gateway reads."""
    gateway = [var for var in GATEWAY_ENV if var.key in _GATEWAY_ONLY]
    return [(var.name, var.default, var.doc) for var in (*ENV, *gateway)]


def write_topology(topology: Topology, path: str) -> None:
    with open(path, "w") as f:
        json.dump(topology.to_json(), f, indent=2)


def parse_downstream(text: str) -> tuple[Peer, ...]:
    peers: list[Peer] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        role, sep, rest = item.partition("=")
        if not sep or not role:
            raise ContractError(f"{PREFIX}DOWNSTREAM: {item!r} is not role=host:port")
        addresses, _, relay = rest.partition("@")
        relay = relay or "auto"
        if relay not in RELAYS:
            raise ContractError(f"{PREFIX}DOWNSTREAM: unknown relay {relay!r} for {role}")
        hosts = tuple(a for a in addresses.split("|") if a)
        for host in hosts:
            if not re.fullmatch(r"[A-Za-z0-9_.\-]+:\d{1,5}|\[[0-9a-fA-F:.]+\]:\d{1,5}", host):
                raise ContractError(f"{PREFIX}DOWNSTREAM: {host!r} (role {role}) is not host:port")
        if not hosts:
            raise ContractError(f"{PREFIX}DOWNSTREAM: role {role} has no address")
        peers.append(Peer(role, hosts, relay))
    return tuple(peers)


def _values(env: Mapping[str, str]) -> dict[str, Any]:
    """Every table variable parsed (defaults filled in), keyed by RoleConfig field path."""
    values: dict[str, Any] = {}
    for var in ENV:
        raw = env.get(var.name) or var.default
        if raw is None:
            raise ContractError(f"{var.name} is required")
        values[var.field] = var.kind.parse(var.name, raw)
    return values


def _replica(replica: int | None, pod_name: str) -> int:
    if replica is not None:
        return replica
    match = re.search(r"-(\d+)$", pod_name)
    return int(match.group(1)) if match else 0


def parse_env(env: Mapping[str, str], topology: Topology | None = None) -> RoleConfig:
    """Build a RoleConfig from the environment; reads the topology file unless given."""
    values = _values(env)
    topology_file = values["topology_file"]
    if topology is None:
        try:
            with open(topology_file) as f:
                topology = Topology.from_json(json.load(f))
        except (OSError, json.JSONDecodeError) as exc:
            raise ContractError(f"cannot read topology file {topology_file}: {exc}") from None
    role = values["role"]
    if role not in topology.roles:
        raise ContractError(f"{PREFIX}ROLE={role!r} is not a role of the topology")
    downstream = values.pop("downstream")
    me = topology.roles[role]
    missing = (set(me.downstream) | {r.target for r in me.refs_out}) - {p.role for p in downstream}
    if missing:
        raise ContractError(f"{PREFIX}DOWNSTREAM lacks addresses for {sorted(missing)}")
    pool = PoolSettings(
        size=values.pop("pool.size"),
        min_block=values.pop("pool.min_block"),
        device=values.pop("pool.device"),
    )
    values["replica"] = _replica(values["replica"], values["pod_name"])
    return RoleConfig(**values, pool=pool, topology=topology, downstream=downstream)


def from_environ() -> RoleConfig:
    return parse_env(os.environ)


# ---- the gateway ----------------------------------------------------------------------------
DEFAULT_GATEWAY_PORT = 8080
DEFAULT_GATEWAY_MAX_BODY = 256 * 2**20
GATEWAY_APIS = ("native", "openai")


@dataclass(frozen=True)
class GatewayConfig:
    """What `disagg gateway` is told: where the entry roles are and how to serve."""

    pipeline: str
    namespace: str
    topology: Topology
    entries: tuple[Peer, ...]
    bind_host: str = "0.0.0.0"
    port: int = DEFAULT_GATEWAY_PORT
    reply_port: int = DEFAULT_INGRESS_PORT
    advertise_host: str = ""
    api: str = "native"
    model: str = ""
    token_file: str = ""
    max_body: int = DEFAULT_GATEWAY_MAX_BODY
    pool_size: int = DEFAULT_POOL_SIZE
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_SECONDS
    node_local: bool = False
    peers_file: str = ""
    topology_file: str = DEFAULT_TOPOLOGY_FILE
    peer_key_file: str = ""


def _parse_api(name: str, raw: str) -> str:
    if raw not in GATEWAY_APIS:
        raise ContractError(f"{name}={raw!r}; expected one of {GATEWAY_APIS}")
    return raw


def _role_var(key: str, field: str) -> EnvVar:
    """A role variable the gateway reads too: same name, kind and default."""
    var = next(v for v in ENV if v.key == key)
    return EnvVar(key, field, var.kind, var.doc, var.default, var.optional)


GATEWAY_ENV: Final[tuple[EnvVar, ...]] = (
    _role_var("PIPELINE", "pipeline"),
    _role_var("NAMESPACE", "namespace"),
    _role_var("BIND_HOST", "bind_host"),
    _role_var("INGRESS_PORT", "reply_port"),
    _role_var("POOL_SIZE", "pool_size"),
    _role_var("REQUEST_TIMEOUT", "request_timeout"),
    _role_var("DOWNSTREAM", "entries"),
    _role_var("NODE_LOCAL", "node_local"),
    _role_var("TOPOLOGY_FILE", "topology_file"),
    _role_var("PEERS_FILE", "peers_file"),
    _role_var("PEER_KEY_FILE", "peer_key_file"),
    EnvVar("GATEWAY_PORT", "port", INT, "gateway: HTTP port", str(DEFAULT_GATEWAY_PORT)),
    EnvVar(
        "GATEWAY_API",
        "api",
        Kind(str, _parse_api),
        "gateway: native | openai (adds /v1/models, /v1/completions, /v1/chat/completions)",
        "native",
    ),
    EnvVar(
        "GATEWAY_MODEL",
        "model",
        TEXT,
        "gateway: the model name the OpenAI API serves (required with api openai)",
        default="",
        optional=True,
    ),
    EnvVar(
        "GATEWAY_TOKEN_FILE",
        "token_file",
        TEXT,
        "gateway: path of a bearer token; when set, API routes need `Authorization: Bearer`",
        default="",
        optional=True,
    ),
    EnvVar(
        "GATEWAY_MAX_BODY",
        "max_body",
        BYTES,
        "gateway: largest request body (bytes or a quantity)",
        format_bytes(DEFAULT_GATEWAY_MAX_BODY),
    ),
    EnvVar(
        "POD_IP",
        "advertise_host",
        TEXT,
        "gateway: the address exit roles send replies to (downward API status.podIP; "
        "default the bind host, 127.0.0.1 for a wildcard)",
        default="",
        optional=True,
    ),
)
_GATEWAY_ONLY: Final = frozenset(v.key for v in GATEWAY_ENV) - frozenset(v.key for v in ENV)


def render_gateway_env(config: GatewayConfig) -> dict[str, str]:
    """The environment of a gateway container (the operator and `disagg bench`)."""
    env = {}
    for var in GATEWAY_ENV:
        value = var.kind.render(_field(config, var.field))
        if value or not var.optional:
            env[var.name] = value
    return env


def parse_gateway_env(env: Mapping[str, str], topology: Topology | None = None) -> GatewayConfig:
    """Build a GatewayConfig from the environment; reads the topology file unless given."""
    values: dict[str, Any] = {}
    for var in GATEWAY_ENV:
        raw = env.get(var.name) or var.default
        if raw is None:
            raise ContractError(f"{var.name} is required")
        values[var.field] = var.kind.parse(var.name, raw)
    if topology is None:
        topology = _read_topology(values["topology_file"])
    if values["api"] == "openai" and not values["model"]:
        raise ContractError(f"{PREFIX}GATEWAY_MODEL is required with {PREFIX}GATEWAY_API=openai")
    missing = set(topology.entry_roles) - {p.role for p in values["entries"]}
    if missing:
        raise ContractError(f"{PREFIX}DOWNSTREAM lacks addresses for entry roles {sorted(missing)}")
    if not values["advertise_host"]:
        wildcard = values["bind_host"] in ("0.0.0.0", "::")
        values["advertise_host"] = "127.0.0.1" if wildcard else values["bind_host"]
    return GatewayConfig(**values, topology=topology)


def _read_topology(path: str) -> Topology:
    try:
        with open(path) as f:
            return Topology.from_json(json.load(f))
    except (OSError, json.JSONDecodeError) as exc:
        raise ContractError(f"cannot read topology file {path}: {exc}") from None
