"""The topology file (JSON, mounted from a ConfigMap): the pipeline's graph as the runtime
needs it: per role whether it is an entry or exit, its upstream roles (fan-in joins wait for
all), its tensor references in and out."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_core.contract.engine_table import EngineTable
from disagg_core.contract.env import ContractError
from disagg_core.spec import DEFAULT_MIGRATION_ATTEMPTS, Pipeline

DEFAULT_TOPOLOGY_FILE = "/etc/disagg/topology.json"
TOPOLOGY_VERSION = 1


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
    idempotent: bool = True  # roles[].idempotent: a request may run here twice
    engine: bool = False  # roles[].engine: a vLLM server, reached over HTTP, not a peer

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
    migration_attempts: int = DEFAULT_MIGRATION_ATTEMPTS  # spec.transport.migrationAttempts
    engines: EngineTable | None = None  # the gateway's engine replicas (the operator's)

    @property
    def engine_roles(self) -> tuple[str, ...]:
        return tuple(n for n, r in self.roles.items() if r.engine)

    @property
    def entry_roles(self) -> tuple[str, ...]:
        return tuple(n for n, r in self.roles.items() if r.entry)

    @property
    def exit_roles(self) -> tuple[str, ...]:
        return tuple(n for n, r in self.roles.items() if r.exit)

    @property
    def not_idempotent(self) -> frozenset[str]:
        return frozenset(n for n, r in self.roles.items() if not r.idempotent)

    def ran_before(self, role: str) -> frozenset[str]:
        """The roles a request may have run at when it reached `role` and `role` had not
        started it (it handed the request back): every role whose inputs (upstream roles,
        tensor references: a join waits for all) may all have come without passing
        through `role`; other branches of a fan-out included. An unknown role: all."""
        if role not in self.roles:
            return frozenset(self.roles)
        inputs = {
            name: {*r.upstream, *(x.source for x in r.refs_in)} for name, r in self.roles.items()
        }
        ran: set[str] = set()
        grew = True
        while grew:  # a fixed point: the roles are few, the order need not be known
            grew = False
            for name, needs in inputs.items():
                if name != role and name not in ran and needs <= ran:
                    ran.add(name)
                    grew = True
        return frozenset(ran)

    def resend_unsafe(self) -> dict[str, frozenset[str]]:
        """Per role R, the roles that are not idempotent and may have run a request R
        handed back (`ran_before`); only roles with some. A request lost with a replica
        (not handed back) may have run anywhere: `not_idempotent` is what bars it."""
        bad = self.not_idempotent
        if not bad:
            return {}
        unsafe = {name: self.ran_before(name) & bad for name in self.roles}
        return {name: found for name, found in unsafe.items() if found}

    @classmethod
    def from_pipeline(cls, pipeline: Pipeline, namespace: str | None = None) -> Topology:
        """Built once per pipeline and namespace (the planner asks for it per role)."""
        key = (cls, namespace)
        if key not in pipeline.derived:
            pipeline.derived[key] = cls._build(pipeline, namespace)
        topology: Topology = pipeline.derived[key]
        return topology

    @classmethod
    def _build(cls, pipeline: Pipeline, namespace: str | None) -> Topology:
        refs = [
            RefSpec(edge.source, ref.path, ref.to)
            for edge in pipeline.edges
            for ref in edge.tensor_refs
        ]
        by_source: dict[str, list[RefSpec]] = {}
        by_target: dict[str, list[RefSpec]] = {}
        for ref in refs:
            by_source.setdefault(ref.source, []).append(ref)
            by_target.setdefault(ref.target, []).append(ref)
        roles = {
            name: RoleTopology(
                name=name,
                upstream=pipeline.upstream(name),
                downstream=pipeline.downstream(name),
                refs_out=tuple(by_source.get(name, ())),
                refs_in=tuple(by_target.get(name, ())),
                idempotent=pipeline.role(name).idempotent,
                engine=pipeline.role(name).engine is not None,
            )
            for name in pipeline.topological_order
        }
        ns = namespace if namespace is not None else (pipeline.namespace or "")
        return cls(
            pipeline=pipeline.name,
            namespace=ns,
            roles=roles,
            migration_attempts=pipeline.transport.migration_attempts,
        )

    def to_json(self, only: tuple[str, ...] | None = None) -> dict[str, Any]:
        """The topology file's document (with `only`, just those roles' entries)."""
        wanted = None if only is None else frozenset(only)
        chosen = [r for r in self.roles.values() if wanted is None or r.name in wanted]
        engines = {} if self.engines is None or only is not None else {"engines": self.engines}
        return {
            "version": TOPOLOGY_VERSION,
            "pipeline": self.pipeline,
            "namespace": self.namespace,
            "migrationAttempts": self.migration_attempts,
            "roles": [
                {
                    "name": r.name,
                    "upstream": list(r.upstream),
                    "downstream": list(r.downstream),
                    "refsOut": [{"path": x.path, "to": x.target} for x in r.refs_out],
                    "refsIn": [{"path": x.path, "from": x.source} for x in r.refs_in],
                    **({} if r.idempotent else {"idempotent": False}),
                    **({"engine": True} if r.engine else {}),
                }
                for r in chosen
            ],
            **{k: v.to_json() for k, v in engines.items()},
        }

    @classmethod
    def from_json(cls, obj: object) -> Topology:
        try:
            if not isinstance(obj, dict) or obj.get("version") != TOPOLOGY_VERSION:
                raise ContractError(f"topology: expected version {TOPOLOGY_VERSION} object")
            roles: dict[str, RoleTopology] = {}
            for r in obj["roles"]:
                name = str(r["name"])
                idempotent = r.get("idempotent", True)
                if not isinstance(idempotent, bool):
                    raise ContractError(f"topology: role {name}: idempotent is not a boolean")
                engine = r.get("engine", False)
                if not isinstance(engine, bool):
                    raise ContractError(f"topology: role {name}: engine is not a boolean")
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
                    idempotent=idempotent,
                    engine=engine,
                )
            attempts = obj.get("migrationAttempts", DEFAULT_MIGRATION_ATTEMPTS)
            if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 0:
                raise ContractError(f"topology: migrationAttempts {attempts!r} is not a count")
            return cls(
                pipeline=str(obj["pipeline"]),
                namespace=str(obj["namespace"]),
                roles=roles,
                migration_attempts=attempts,
                engines=EngineTable.from_json(obj["engines"]) if "engines" in obj else None,
            )
        except (KeyError, TypeError) as exc:
            raise ContractError(f"topology: malformed ({exc!r})") from None


def write_topology(topology: Topology, path: str) -> None:
    with open(path, "w") as f:
        json.dump(topology.to_json(), f, indent=2)


def read_topology(path: str) -> Topology:
    try:
        with open(path) as f:
            return Topology.from_json(json.load(f))
    except (OSError, json.JSONDecodeError) as exc:
        raise ContractError(f"cannot read topology file {path}: {exc}") from None
