"""The operator <-> runtime contract: what a role container is told, and nothing else.

Two parts, both rendered by the operator (and by `disagg up` for local processes) and
parsed here into a `RoleConfig`. Torch-free: the operator imports it.

Environment (all strings):

    DISAGG_PIPELINE            pipeline name                                   required
    DISAGG_NAMESPACE           namespace ("" locally)
    DISAGG_ROLE                this container's role                           required
    DISAGG_REPLICA             replica index; else the ordinal ending DISAGG_POD_NAME
    DISAGG_POD_NAME            pod name (downward API), for the replica ordinal and logs
    DISAGG_HANDLER             module.path:function                            required
    DISAGG_BIND_HOST           ingress/metrics bind address (default 0.0.0.0)
    DISAGG_INGRESS_PORT        relay ingress port (default 7400)
    DISAGG_LANE_PORT           inline lane port: small payloads on a plain socket beside
                               the ZMQ ingress (relay/lane.py; default 7500, 0 = any)
    DISAGG_METRICS_PORT        /metrics /healthz /readyz port (default 9400)
    DISAGG_POOL_SIZE           receive pool bytes (integer or quantity, e.g. 256Mi)
    DISAGG_POOL_MIN_BLOCK      buddy minimum block (default 1Mi)
    DISAGG_POOL_DEVICE         cpu | cpu-pinned | cuda
    DISAGG_CONCURRENCY         requests handled at once (default 4)
    DISAGG_REQUEST_TIMEOUT     seconds a request may live (default 30)
    DISAGG_DOWNSTREAM          peers this role sends to, per role:
                               `role=host:port[|host:port...][@relay]` joined by `,`
                               host may be a DNS name (a headless Service: every A record
                               is a replica, re-resolved) or an IP; relay auto|shm|tcp|cuda-ipc
    DISAGG_SAME_GPU_PEERS      comma list of roles sharing this container's GPU (same pod)
    DISAGG_NODE_LOCAL          "1" when every peer shares this host's /dev/shm (disagg up)
    DISAGG_TOPOLOGY_FILE       path of the topology file (default /etc/disagg/topology.json)
    DISAGG_PEERS_FILE          optional JSON {"role": ["host:port", ...]} overriding the
                               addresses of DISAGG_DOWNSTREAM, re-read when it changes
                               (`disagg up` scales replicas with it; pods use DNS instead)
    DISAGG_METRICS_DUMP        optional path: the role writes its final metrics there on exit

Topology file (JSON, mounted from a ConfigMap): the pipeline's graph as the runtime needs
it: per role whether it is an entry or exit, its upstream roles (fan-in joins wait for
all), its tensor references in and out. See `Topology`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_core.quantity import parse_bytes
from disagg_core.spec.model import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MIN_BLOCK,
    DEFAULT_POOL_SIZE,
    DEFAULT_REQUEST_TIMEOUT_SECONDS,
    Pipeline,
    PoolSettings,
)

PREFIX = "DISAGG_"
DEFAULT_INGRESS_PORT = 7400
DEFAULT_LANE_PORT = 7500
DEFAULT_METRICS_PORT = 9400
DEFAULT_TOPOLOGY_FILE = "/etc/disagg/topology.json"
TOPOLOGY_VERSION = 1
RELAYS = ("auto", "shm", "tcp", "cuda-ipc")
POOL_DEVICES = ("cpu", "cpu-pinned", "cuda")


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

    @property
    def me(self) -> RoleTopology:
        return self.topology.roles[self.role]

    def peer(self, role: str) -> Peer:
        for p in self.downstream:
            if p.role == role:
                return p
        raise ContractError(f"{PREFIX}DOWNSTREAM has no entry for role {role!r}")


def render_env(config: RoleConfig) -> dict[str, str]:
    """The environment a container gets for `config` (the operator and `disagg up` use it)."""
    env = {
        "PIPELINE": config.pipeline,
        "NAMESPACE": config.namespace,
        "ROLE": config.role,
        "REPLICA": str(config.replica),
        "HANDLER": config.handler,
        "BIND_HOST": config.bind_host,
        "INGRESS_PORT": str(config.ingress_port),
        "LANE_PORT": str(config.lane_port),
        "METRICS_PORT": str(config.metrics_port),
        "POOL_SIZE": str(config.pool.size),
        "POOL_MIN_BLOCK": str(config.pool.min_block),
        "POOL_DEVICE": config.pool.device,
        "CONCURRENCY": str(config.concurrency),
        "REQUEST_TIMEOUT": f"{config.request_timeout:g}",
        "DOWNSTREAM": ",".join(p.render() for p in config.downstream),
        "SAME_GPU_PEERS": ",".join(sorted(config.same_gpu_peers)),
        "NODE_LOCAL": "1" if config.node_local else "0",
        "TOPOLOGY_FILE": config.topology_file,
    }
    if config.peers_file:
        env["PEERS_FILE"] = config.peers_file
    if config.metrics_dump:
        env["METRICS_DUMP"] = config.metrics_dump
    return {PREFIX + k: v for k, v in env.items()}


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


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(PREFIX + key)
    if raw is None or raw == "":
        if default is None:
            raise ContractError(f"{PREFIX}{key} is required")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ContractError(f"{PREFIX}{key}={raw!r} is not an integer") from None


def _required(env: Mapping[str, str], key: str) -> str:
    value = env.get(PREFIX + key, "")
    if not value:
        raise ContractError(f"{PREFIX}{key} is required")
    return value


def _replica(env: Mapping[str, str]) -> int:
    if env.get(PREFIX + "REPLICA"):
        return _int(env, "REPLICA")
    match = re.search(r"-(\d+)$", env.get(PREFIX + "POD_NAME", ""))
    return int(match.group(1)) if match else 0


def parse_env(env: Mapping[str, str], topology: Topology | None = None) -> RoleConfig:
    """Build a RoleConfig from the environment; reads the topology file unless given."""
    topology_file = env.get(PREFIX + "TOPOLOGY_FILE") or DEFAULT_TOPOLOGY_FILE
    if topology is None:
        try:
            with open(topology_file) as f:
                topology = Topology.from_json(json.load(f))
        except (OSError, json.JSONDecodeError) as exc:
            raise ContractError(f"cannot read topology file {topology_file}: {exc}") from None
    role = _required(env, "ROLE")
    if role not in topology.roles:
        raise ContractError(f"{PREFIX}ROLE={role!r} is not a role of the topology")
    device = env.get(PREFIX + "POOL_DEVICE") or "cpu"
    if device not in POOL_DEVICES:
        raise ContractError(f"{PREFIX}POOL_DEVICE={device!r}; expected one of {POOL_DEVICES}")
    try:
        pool = PoolSettings(
            size=parse_bytes(env.get(PREFIX + "POOL_SIZE") or DEFAULT_POOL_SIZE),
            min_block=parse_bytes(env.get(PREFIX + "POOL_MIN_BLOCK") or DEFAULT_MIN_BLOCK),
            device=device,  # type: ignore[arg-type]  # checked against POOL_DEVICES above
        )
        timeout = float(env.get(PREFIX + "REQUEST_TIMEOUT") or DEFAULT_REQUEST_TIMEOUT_SECONDS)
    except ValueError as exc:
        raise ContractError(f"bad pool or timeout setting: {exc}") from None
    downstream = parse_downstream(env.get(PREFIX + "DOWNSTREAM", ""))
    missing = set(topology.roles[role].downstream) | {
        r.target for r in topology.roles[role].refs_out
    }
    missing -= {p.role for p in downstream}
    if missing:
        raise ContractError(f"{PREFIX}DOWNSTREAM lacks addresses for {sorted(missing)}")
    return RoleConfig(
        pipeline=_required(env, "PIPELINE"),
        namespace=env.get(PREFIX + "NAMESPACE", ""),
        role=role,
        replica=_replica(env),
        handler=_required(env, "HANDLER"),
        pool=pool,
        topology=topology,
        downstream=downstream,
        same_gpu_peers=frozenset(filter(None, env.get(PREFIX + "SAME_GPU_PEERS", "").split(","))),
        node_local=env.get(PREFIX + "NODE_LOCAL", "0") == "1",
        bind_host=env.get(PREFIX + "BIND_HOST") or "0.0.0.0",
        ingress_port=_int(env, "INGRESS_PORT", DEFAULT_INGRESS_PORT),
        lane_port=_int(env, "LANE_PORT", DEFAULT_LANE_PORT),
        metrics_port=_int(env, "METRICS_PORT", DEFAULT_METRICS_PORT),
        concurrency=_int(env, "CONCURRENCY", DEFAULT_CONCURRENCY),
        request_timeout=timeout,
        pod_name=env.get(PREFIX + "POD_NAME", ""),
        topology_file=topology_file,
        peers_file=env.get(PREFIX + "PEERS_FILE", ""),
        metrics_dump=env.get(PREFIX + "METRICS_DUMP", ""),
    )


def from_environ() -> RoleConfig:
    return parse_env(os.environ)
