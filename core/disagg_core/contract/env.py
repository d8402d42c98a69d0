"""How `DISAGG_*` variables are written and read: value kinds, one table row (`EnvVar`), and
rendering/parsing a whole table. The role's table is `contract.role.ENV`, the gateway's
`contract.gateway.GATEWAY_ENV`; both go through `render` and `parse_values` here."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from disagg_core import compat
from disagg_core.quantity import parse_bytes
from disagg_core.spec import POOL_DEVICES, RELAYS, PoolDevice

PREFIX = "DISAGG_"


class ContractError(ValueError):
    """The environment or topology file given to a role is missing or malformed."""


@dataclass(frozen=True)
class Peer:
    """Where one downstream role listens: host:port entries (DNS names are re-resolved)."""

    role: str
    addresses: tuple[str, ...]
    relay: str = "auto"

    def render(self) -> str:
        suffix = "" if self.relay == "auto" else f"@{self.relay}"
        return f"{self.role}={'|'.join(self.addresses)}{suffix}"


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


def _field(config: object, path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def render(table: tuple[EnvVar, ...], config: object) -> dict[str, str]:
    """The variables of `table` for `config` (optional ones only when set)."""
    env = {}
    for var in table:
        value = var.kind.render(_field(config, var.field))
        if value or not var.optional:
            env[var.name] = value
    return env


def parse_values(table: tuple[EnvVar, ...], env: Mapping[str, str]) -> dict[str, Any]:
    """Every variable of `table` parsed (defaults filled in), keyed by its field path."""
    values: dict[str, Any] = {}
    for var in table:
        raw = env.get(var.name) or var.default
        if raw is None:
            raise ContractError(f"{var.name} is required")
        values[var.field] = var.kind.parse(var.name, raw)
    return values
