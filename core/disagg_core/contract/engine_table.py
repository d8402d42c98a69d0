"""The engine router's endpoint list: which replicas of a pipeline's engine roles the gateway
may route to, and how a request goes through them (`EngineRoute`). Pure.

One derivation for `disagg up` and Kubernetes: `replica_endpoint` turns where a replica is
reached (host, HTTP port, KV port) into its `EngineEndpoint`; `disagg up` calls it with
127.0.0.1 and the ports it picked, the operator with each replica's pod DNS name under the
headless Service (every replica up to `autoscaling.maxReplicas`, so scaling changes no
gateway's configuration). A decode replica's `kv` is also what its prefill engines are
told in `decodes` (their allow-list), so the gateway never names an endpoint they refuse.

On Kubernetes the table is the `engines` section of the topology file (`EngineTable`): the
gateway reads it at start and refuses, naming what is missing, a table without an entry
replica or without the decode replicas' HTTP and KV endpoints. A listed replica that does
not resolve or answer (scaled below the maximum) is skipped by the router's choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_core.contract.env import ContractError
from disagg_core.spec import Pipeline


@dataclass(frozen=True)
class EngineEndpoint:
    """One replica of an engine role as the gateway and its peers reach it: `key`
    ("decode/0"), its HTTP base URL, and (a decode replica) its connector's KV endpoint."""

    key: str
    url: str
    kv_endpoint: str = ""


@dataclass(frozen=True)
class EngineRoute:
    """The engine roles an OpenAI request goes through: `entry` (the prefill role, or a
    lone engine), then `decode` (None: the entry answers), KV over `relay`. `paired`: each
    prefill replica sends only to the decode replica of its own pod (a colocation group:
    `decodes` is 127.0.0.1), so a request's prefill replica has its decode replica's index."""

    entry: str
    decode: str | None = None
    relay: str = "tcp"
    paired: bool = False

    @property
    def roles(self) -> tuple[str, ...]:
        return (self.entry,) + ((self.decode,) if self.decode else ())


def route_of(pipeline: Pipeline, *, node_local: bool) -> EngineRoute:
    """The pipeline's engine route (the spec allows one entry engine role); an `auto` kv
    edge is shm on one node, tcp otherwise."""
    entries = [
        name
        for name in pipeline.engine_roles
        if not any(edge.kind == "kv" for edge in pipeline.edges_to(name))
    ]
    if not entries:
        raise ValueError(f"pipeline {pipeline.name!r} has no engine role to route to")
    entry = entries[0]
    targets = pipeline.kv_targets(entry)
    if not targets:
        return EngineRoute(entry)
    edge = next(e for e in pipeline.edges_from(entry) if e.kind == "kv")
    relay = pipeline.relay_for(edge)
    if relay == "auto":
        relay = "shm" if node_local else "tcp"
    return EngineRoute(entry, targets[0], relay)


def replica_endpoint(
    pipeline: Pipeline, role: str, index: int, *, host: str, port: int, kv_port: int
) -> EngineEndpoint:
    """Replica `index` of engine role `role`, reached at `host`: HTTP on `port`, and, when
    the role receives KV, its connector on `kv_port`."""
    consumer = pipeline.kv_role(role) == "kv_consumer"
    return EngineEndpoint(
        f"{role}/{index}", f"http://{host}:{port}", f"tcp://{host}:{kv_port}" if consumer else ""
    )


@dataclass(frozen=True)
class EngineTable:
    """The `engines` section of the topology file: the route and every replica the gateway
    may route to, per role (those that are not up are skipped when choosing)."""

    route: EngineRoute
    replicas: Mapping[str, tuple[EngineEndpoint, ...]]

    def check(self) -> None:
        """ContractError naming what the gateway lacks to route: an entry replica, the
        decode role's replicas, or a decode replica's KV endpoint."""
        for role in self.route.roles:
            if not self.replicas.get(role):
                raise ContractError(
                    f"topology: engines.replicas.{role} lists no replica (the gateway needs "
                    f"the HTTP endpoints of engine role {role!r})"
                )
        if self.route.decode is not None:
            for i, replica in enumerate(self.replicas[self.route.decode]):
                if not replica.kv_endpoint:
                    raise ContractError(
                        f"topology: engines.replicas.{self.route.decode}[{i}].kv is missing "
                        "(the decode replica's KV endpoint, which the prefill engine sends to)"
                    )
        if self.route.paired and self.route.decode is not None:
            counts = {len(self.replicas[r]) for r in self.route.roles}
            if len(counts) != 1:
                raise ContractError(
                    "topology: engines.paired needs as many entry as decode replicas"
                )

    def to_json(self) -> dict[str, Any]:
        route = self.route
        return {
            "entry": route.entry,
            **({"decode": route.decode} if route.decode else {}),
            "relay": route.relay,
            **({"paired": True} if route.paired else {}),
            "replicas": {
                role: [
                    {"url": r.url, **({"kv": r.kv_endpoint} if r.kv_endpoint else {})}
                    for r in replicas
                ]
                for role, replicas in self.replicas.items()
            },
        }

    @classmethod
    def from_json(cls, obj: object) -> EngineTable:
        """The section as read; ContractError naming the field when malformed or lacking."""
        if not isinstance(obj, dict):
            raise ContractError("topology: engines is not an object")
        entry = obj.get("entry")
        if not isinstance(entry, str) or not entry:
            raise ContractError("topology: engines.entry is missing (the entry engine role)")
        decode = obj.get("decode")
        if decode is not None and (not isinstance(decode, str) or not decode):
            raise ContractError("topology: engines.decode is not a role name")
        relay = obj.get("relay", "tcp")
        if relay not in ("tcp", "shm"):
            raise ContractError(f"topology: engines.relay {relay!r} is not tcp or shm")
        paired = obj.get("paired", False)
        if not isinstance(paired, bool):
            raise ContractError("topology: engines.paired is not a boolean")
        listed = obj.get("replicas")
        if not isinstance(listed, dict):
            raise ContractError("topology: engines.replicas is missing (the engines' endpoints)")
        replicas: dict[str, tuple[EngineEndpoint, ...]] = {}
        for role, items in listed.items():
            if not isinstance(items, list):
                raise ContractError(f"topology: engines.replicas.{role} is not a list")
            found = []
            for i, item in enumerate(items):
                url = item.get("url") if isinstance(item, dict) else None
                if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                    raise ContractError(
                        f"topology: engines.replicas.{role}[{i}].url is not an http(s) URL"
                    )
                kv = item.get("kv", "")
                if not isinstance(kv, str) or (kv and not kv.startswith("tcp://")):
                    raise ContractError(
                        f"topology: engines.replicas.{role}[{i}].kv is not a tcp:// endpoint"
                    )
                found.append(EngineEndpoint(f"{role}/{i}", url, kv))
            replicas[str(role)] = tuple(found)
        table = cls(EngineRoute(entry, decode, relay, paired), replicas)
        table.check()
        return table
