"""What a role container is told through its environment: `ENV`, the one table of variables
(name, RoleConfig field, default, meaning), and `RoleConfig`, what the runtime builds from it.
docs/contract.md prints the table."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from disagg_core.contract.env import (
    BATCH_SIZE,
    BYTES,
    COMPAT,
    DEVICE,
    DISPATCH,
    FLAG,
    INT,
    JSON_OBJECT,
    MILLIS,
    ORDINAL,
    PEERS,
    PREFIX,
    ROLES,
    SECONDS,
    TEXT,
    TOKENS,
    ContractError,
    EnvVar,
    Peer,
    parse_values,
    render,
)
from disagg_core.contract.topology import (
    DEFAULT_TOPOLOGY_FILE,
    RoleTopology,
    Topology,
    read_topology,
)
from disagg_core.quantity import format_bytes
from disagg_core.spec import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MIN_BLOCK,
    DEFAULT_POOL_DEVICE,
    DEFAULT_POOL_SIZE,
    DEFAULT_REQUEST_TIMEOUT_SECONDS,
    POOL_DEVICES,
    RELAYS,
    PoolSettings,
)

DEFAULT_INGRESS_PORT = 7400
DEFAULT_LANE_PORT = 7500
DEFAULT_METRICS_PORT = 9400
DEFAULT_PEER_KEY_FILE = "/etc/disagg-peer-key/key"
DEFAULT_RANK_PORT = 29500  # torch.distributed's usual MASTER_PORT
DEFAULT_LEADER = "127.0.0.1"


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
    ranks: int = 1  # rank processes this container starts (roles[].ranks)
    nodes: int = 1  # pods of this replica's group (roles[].nodes)
    node_rank: int = 0  # this pod's place in its group: 0 is the leader
    leader: str = DEFAULT_LEADER  # where global rank 0 listens for the others (MASTER_ADDR)
    rank_port: int = DEFAULT_RANK_PORT  # MASTER_PORT

    @property
    def world_size(self) -> int:
        return self.ranks * self.nodes

    @property
    def me(self) -> RoleTopology:
        return self.topology.roles[self.role]

    def peer(self, role: str) -> Peer:
        for p in self.downstream:
            if p.role == role:
                return p
        raise ContractError(f"{PREFIX}DOWNSTREAM has no entry for role {role!r}")


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
        "RANKS",
        "ranks",
        INT,
        "rank processes the role starts in this container (roles[].ranks): local rank 0 is "
        "this process, the others its children; each gets the torch.distributed variables "
        "below",
        default="1",
        optional=True,
    ),
    EnvVar(
        "NODES",
        "nodes",
        INT,
        "pods of this replica's group (roles[].nodes); world size = DISAGG_RANKS x DISAGG_NODES",
        default="1",
        optional=True,
    ),
    EnvVar(
        "NODE_RANK",
        "node_rank",
        INT,
        "this pod's index in its replica's group (0: the leader, which owns the transport)",
        default="0",
        optional=True,
    ),
    EnvVar(
        "LEADER",
        "leader",
        TEXT,
        "host of the group's rank 0 (MASTER_ADDR of every rank)",
        default=DEFAULT_LEADER,
        optional=True,
    ),
    EnvVar(
        "RANK_PORT",
        "rank_port",
        INT,
        "port of the group's rank 0 for torch.distributed's rendezvous (MASTER_PORT)",
        default=str(DEFAULT_RANK_PORT),
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


# rendered only for a replica of more than one rank: a lone process's environment is as it was
RANK_KEYS: Final = frozenset(
    PREFIX + key for key in ("RANKS", "NODES", "NODE_RANK", "LEADER", "RANK_PORT")
)


def render_env(config: RoleConfig) -> dict[str, str]:
    """The environment a container gets for `config` (the operator and `disagg up` use it)."""
    env = render(ENV, config)
    if config.world_size == 1:
        env = {name: value for name, value in env.items() if name not in RANK_KEYS}
    return env


def _replica(replica: int | None, pod_name: str) -> int:
    if replica is not None:
        return replica
    match = re.search(r"-(\d+)$", pod_name)
    return int(match.group(1)) if match else 0


def parse_env(env: Mapping[str, str], topology: Topology | None = None) -> RoleConfig:
    """Build a RoleConfig from the environment; reads the topology file unless given."""
    values = parse_values(ENV, env)
    if topology is None:
        topology = read_topology(values["topology_file"])
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
    _check_ranks(values)
    return RoleConfig(**values, pool=pool, topology=topology, downstream=downstream)


def _check_ranks(values: Mapping[str, Any]) -> None:
    for key, field_name in (("RANKS", "ranks"), ("NODES", "nodes")):
        if values[field_name] < 1:
            raise ContractError(f"{PREFIX}{key}={values[field_name]} must be at least 1")
    if not 0 <= values["node_rank"] < values["nodes"]:
        raise ContractError(
            f"{PREFIX}NODE_RANK={values['node_rank']} is not in 0..{values['nodes'] - 1} "
            f"({PREFIX}NODES={values['nodes']})"
        )
    if not 0 < values["rank_port"] < 65536:
        raise ContractError(f"{PREFIX}RANK_PORT={values['rank_port']} is not a port")


def from_environ() -> RoleConfig:
    return parse_env(os.environ)
