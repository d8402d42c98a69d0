"""What `disagg gateway` (the pipeline's HTTP front door) is told: `GATEWAY_ENV`, its table.
The role variables it shares keep their meaning: DISAGG_DOWNSTREAM names the entry roles,
DISAGG_INGRESS_PORT is where exit roles send replies, DISAGG_POOL_SIZE sizes its reply pool.
In front of engine roles the gateway is no peer (it routes over HTTP from the topology's
`engines`), so the variables of `REPLY_PATH` are not rendered for it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from disagg_core.contract.env import (
    BYTES,
    INT,
    PREFIX,
    SECONDS,
    TEXT,
    ContractError,
    EnvVar,
    Kind,
    Peer,
    parse_values,
    render,
)
from disagg_core.contract.role import DEFAULT_INGRESS_PORT, ENV
from disagg_core.contract.topology import DEFAULT_TOPOLOGY_FILE, Topology, read_topology
from disagg_core.quantity import format_bytes
from disagg_core.spec import DEFAULT_POOL_SIZE, DEFAULT_REQUEST_TIMEOUT_SECONDS

DEFAULT_GATEWAY_PORT = 8080
DEFAULT_GATEWAY_MAX_BODY = 256 * 2**20
# Bounds before authentication (the gateway's `limits`): rendered only when not the default.
DEFAULT_GATEWAY_IDLE_TIMEOUT = 15.0
DEFAULT_GATEWAY_MAX_CONNECTIONS = 1024
DEFAULT_GATEWAY_MAX_JSON = 16 * 2**20
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
    idle_timeout: float = DEFAULT_GATEWAY_IDLE_TIMEOUT
    max_connections: int = DEFAULT_GATEWAY_MAX_CONNECTIONS
    max_json: int = DEFAULT_GATEWAY_MAX_JSON
    max_tokens: int = 0  # the model's largest max_tokens (0: not known here)
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


def _unless_default(kind: Kind, default: object) -> Kind:
    """`kind`, rendered empty (so left out) for the default value."""
    return Kind(lambda value: "" if value == default else kind.render(value), kind.parse)


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
        "GATEWAY_IDLE_TIMEOUT",
        "idle_timeout",
        _unless_default(SECONDS, DEFAULT_GATEWAY_IDLE_TIMEOUT),
        "gateway: seconds a connection has to complete its next request's headers (new, "
        "idle or slow connections are closed after it)",
        f"{DEFAULT_GATEWAY_IDLE_TIMEOUT:g}",
        optional=True,
    ),
    EnvVar(
        "GATEWAY_MAX_CONNECTIONS",
        "max_connections",
        _unless_default(INT, DEFAULT_GATEWAY_MAX_CONNECTIONS),
        "gateway: open connections at most (more are answered 503 and closed)",
        str(DEFAULT_GATEWAY_MAX_CONNECTIONS),
        optional=True,
    ),
    EnvVar(
        "GATEWAY_MAX_JSON",
        "max_json",
        _unless_default(BYTES, DEFAULT_GATEWAY_MAX_JSON),
        "gateway: largest JSON body (large tensors belong in safetensors bodies)",
        format_bytes(DEFAULT_GATEWAY_MAX_JSON),
        optional=True,
    ),
    EnvVar(
        "GATEWAY_MAX_TOKENS",
        "max_tokens",
        _unless_default(INT, 0),
        "gateway: the largest max_tokens of the OpenAI API (400 above it; the pipeline "
        "annotation disagg.dev/gateway-max-tokens)",
        "0",
        optional=True,
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
# What only a gateway over handler roles reads (server.client_for: it submits to the entry
# roles as their peer and takes the exit roles' replies at its pod's address).
REPLY_PATH: Final = frozenset(
    ("DOWNSTREAM", "INGRESS_PORT", "POOL_SIZE", "NODE_LOCAL", "PEERS_FILE", "PEER_KEY_FILE")
) | {"POD_IP"}


def takes_replies(topology: Topology) -> bool:
    """Whether the gateway is a peer of the roles (submits to them, takes replies): not in
    front of engine roles, which it asks over HTTP."""
    return not topology.engine_roles


def render_gateway_env(config: GatewayConfig) -> dict[str, str]:
    """The environment of a gateway container (the operator and `disagg bench`): without
    `REPLY_PATH` in front of engine roles."""
    if takes_replies(config.topology):
        return render(GATEWAY_ENV, config)
    return render(tuple(v for v in GATEWAY_ENV if v.key not in REPLY_PATH), config)


def parse_gateway_env(env: Mapping[str, str], topology: Topology | None = None) -> GatewayConfig:
    """Build a GatewayConfig from the environment; reads the topology file unless given."""
    values = parse_values(GATEWAY_ENV, env)
    if topology is None:
        topology = read_topology(values["topology_file"])
    if values["api"] == "openai" and not values["model"]:
        raise ContractError(f"{PREFIX}GATEWAY_MODEL is required with {PREFIX}GATEWAY_API=openai")
    if topology.engine_roles:
        _check_engines(topology, values["api"])
    missing = set(topology.entry_roles) - {p.role for p in values["entries"]}
    if topology.engines is None and missing:
        raise ContractError(f"{PREFIX}DOWNSTREAM lacks addresses for entry roles {sorted(missing)}")
    if not values["advertise_host"]:
        wildcard = values["bind_host"] in ("0.0.0.0", "::")
        values["advertise_host"] = "127.0.0.1" if wildcard else values["bind_host"]
    return GatewayConfig(**values, topology=topology)


def _check_engines(topology: Topology, api: str) -> None:
    """A gateway in front of engine roles routes from the topology's `engines` section (the
    replicas' HTTP and KV endpoints) and speaks only the OpenAI API."""
    if topology.engines is None:
        raise ContractError(
            f"the topology names engine roles {list(topology.engine_roles)} but has no "
            "`engines` section (their replicas' HTTP endpoints and the decode replicas' KV "
            "endpoints): the gateway cannot route to them; render it with an operator that "
            "writes it"
        )
    if api != "openai":
        raise ContractError(
            f"{PREFIX}GATEWAY_API={api!r}: a gateway in front of engine roles serves "
            f"only the OpenAI API ({PREFIX}GATEWAY_API=openai)"
        )
    unknown = set(topology.engines.route.roles) - set(topology.engine_roles)
    if unknown:
        raise ContractError(f"topology: engines routes to {sorted(unknown)}, not engine roles")


def env_table() -> list[tuple[str, str | None, str]]:
    """(name, default or None if required, meaning) per variable, for docs/contract.md: the
    roles' variables, then those only the gateway reads."""
    gateway = [var for var in GATEWAY_ENV if var.key in _GATEWAY_ONLY]
    return [(var.name, var.default, var.doc) for var in (*ENV, *gateway)]
