"""The operator <-> runtime contract: what a role container is told, and nothing else.

Two parts, both rendered by the operator (and by `disagg up` for local processes) and
parsed into a `RoleConfig`. Torch-free: the operator imports it.

- The environment: the `ENV` table is the one list of variables (name, default, meaning).
  `render_env` and `parse_env` are driven by it, and docs/contract.md prints it.
- The topology file (JSON, mounted from a ConfigMap): the pipeline's graph as the runtime
  needs it: per role whether it is an entry or exit, its upstream roles (fan-in joins wait
  for all), its tensor references in and out. See `Topology`.

Which values a role gets is decided by `disagg_core.placement.role_config`, the one
derivation shared by the operator's planner and `disagg up`.

The gateway (`disagg gateway`, the pipeline's HTTP front door) is configured the same way:
`GATEWAY_ENV` is its table (the role variables it shares keep their meaning: DISAGG_DOWNSTREAM
names the entry roles, DISAGG_INGRESS_PORT is where exit roles send replies,
DISAGG_POOL_SIZE sizes its reply pool), parsed by `parse_gateway_env` into a
`GatewayConfig`. In front of engine roles it is no peer of the roles (it routes over HTTP
from the topology's `engines`), so those reply-path variables (`REPLY_PATH`) are not
rendered for it.

An engine role (spec/engines.py) runs no `disagg role`: `engine` renders its command
line and KV connector configuration (`engine_command`, `EngineLaunch`); `engine_table`
the gateway's list of engine replicas (`EngineTable`, the topology file's `engines`).

Modules: role (ENV, RoleConfig), ranks (RANK_ENV: what each rank process of a replica of
several ranks is told, torch.distributed's names), topology, gateway (GATEWAY_ENV,
GatewayConfig), env (the value kinds and the table machinery both tables use). This
package only re-exports.
"""

from __future__ import annotations

from disagg_core.contract.engine import EngineLaunch, engine_command, kv_transfer_config
from disagg_core.contract.engine_table import (
    EngineEndpoint,
    EngineRoute,
    EngineTable,
    replica_endpoint,
    route_of,
)
from disagg_core.contract.env import (
    DISPATCH_MODES,
    PREFIX,
    ContractError,
    EnvVar,
    Kind,
    Peer,
    parse_downstream,
)
from disagg_core.contract.gateway import (
    DEFAULT_GATEWAY_IDLE_TIMEOUT,
    DEFAULT_GATEWAY_MAX_BODY,
    DEFAULT_GATEWAY_MAX_CONNECTIONS,
    DEFAULT_GATEWAY_MAX_JSON,
    DEFAULT_GATEWAY_PORT,
    GATEWAY_APIS,
    GATEWAY_ENV,
    REPLY_PATH,
    GatewayConfig,
    env_table,
    parse_gateway_env,
    render_gateway_env,
    takes_replies,
)
from disagg_core.contract.ranks import RANK_ENV, Rank, pod_ranks, rank_of
from disagg_core.contract.role import (
    DEFAULT_INGRESS_PORT,
    DEFAULT_LANE_PORT,
    DEFAULT_LEADER,
    DEFAULT_METRICS_PORT,
    DEFAULT_PEER_KEY_FILE,
    DEFAULT_RANK_PORT,
    ENV,
    RoleConfig,
    from_environ,
    parse_env,
    render_env,
)
from disagg_core.contract.topology import (
    DEFAULT_TOPOLOGY_FILE,
    TOPOLOGY_VERSION,
    RefSpec,
    RoleTopology,
    Topology,
    read_topology,
    write_topology,
)
from disagg_core.contract.tracing import tracing_env

__all__ = [
    "DEFAULT_GATEWAY_IDLE_TIMEOUT",
    "DEFAULT_GATEWAY_MAX_BODY",
    "DEFAULT_GATEWAY_MAX_CONNECTIONS",
    "DEFAULT_GATEWAY_MAX_JSON",
    "DEFAULT_GATEWAY_PORT",
    "DEFAULT_INGRESS_PORT",
    "DEFAULT_LANE_PORT",
    "DEFAULT_LEADER",
    "DEFAULT_METRICS_PORT",
    "DEFAULT_PEER_KEY_FILE",
    "DEFAULT_RANK_PORT",
    "DEFAULT_TOPOLOGY_FILE",
    "DISPATCH_MODES",
    "ENV",
    "GATEWAY_APIS",
    "GATEWAY_ENV",
    "PREFIX",
    "RANK_ENV",
    "REPLY_PATH",
    "TOPOLOGY_VERSION",
    "ContractError",
    "EngineEndpoint",
    "EngineLaunch",
    "EngineRoute",
    "EngineTable",
    "EnvVar",
    "GatewayConfig",
    "Kind",
    "Peer",
    "Rank",
    "RefSpec",
    "RoleConfig",
    "RoleTopology",
    "Topology",
    "engine_command",
    "env_table",
    "from_environ",
    "kv_transfer_config",
    "parse_downstream",
    "parse_env",
    "parse_gateway_env",
    "pod_ranks",
    "rank_of",
    "read_topology",
    "render_env",
    "render_gateway_env",
    "replica_endpoint",
    "route_of",
    "takes_replies",
    "tracing_env",
    "write_topology",
]
