"""The one derivation of a role's contract: pipeline + role + placement -> `RoleConfig`.

The operator's planner (one container of a pod) and `disagg up` (one local process per
replica) both call `role_config`. Everything a role is told about the pipeline comes from
the pipeline here, the same way for both; only the `Placement` differs, i.e. where the
replica runs and how it reaches its targets:

    in a pod        addresses  P-T.NS.svc.<domain>:port (127.0.0.1:port inside the pod)
                    ports      the planner's ingress/lane/metrics rule, replica from the pod
    disagg up       addresses  127.0.0.1:port of every replica of T (a peers file updates them)
                    ports      free loopback ports, node_local (shared /dev/shm)

Targets of role R: its edge targets, then the targets of its tensor references that are not
already edge targets (in that order). The relay to a target is the edge's relay, else
`spec.transport.relay`; a target reached only through tensor references is `auto`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from disagg_core import compat
from disagg_core.contract import (
    DEFAULT_INGRESS_PORT,
    DEFAULT_LANE_PORT,
    DEFAULT_LEADER,
    DEFAULT_METRICS_PORT,
    DEFAULT_RANK_PORT,
    DEFAULT_TOPOLOGY_FILE,
    Peer,
    RoleConfig,
    Topology,
)
from disagg_core.relays import requests_rdma
from disagg_core.spec import Pipeline, RelayKind


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one replica of a role runs: the only input that differs between a pod and a
    local process. `addresses` maps each target role to its host:port entries."""

    namespace: str
    addresses: Mapping[str, tuple[str, ...]]
    replica: int = 0
    ingress_port: int = DEFAULT_INGRESS_PORT
    lane_port: int = DEFAULT_LANE_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    bind_host: str = "0.0.0.0"
    node_local: bool = False
    topology_file: str = DEFAULT_TOPOLOGY_FILE
    peers_file: str = ""
    peer_key_file: str = ""  # the pipeline's peer key ("" : none given)
    node_rank: int = 0  # the pod's place in its replica's group (roles[].nodes)
    leader: str = DEFAULT_LEADER  # the group's rank 0 host (in one pod: loopback)
    rank_port: int = DEFAULT_RANK_PORT


def targets(pipeline: Pipeline, role: str) -> tuple[str, ...]:
    """The roles `role` sends to: edge targets, then further tensor-reference targets."""
    me = Topology.from_pipeline(pipeline).roles[role]
    return tuple(dict.fromkeys([*me.downstream, *(ref.target for ref in me.refs_out)]))


def relays(pipeline: Pipeline, role: str) -> dict[str, RelayKind]:
    """The relay to each target of `role` (tensor-reference-only targets: `auto`)."""
    by_edge = {edge.target: pipeline.relay_for(edge) for edge in pipeline.edges_from(role)}
    return {target: by_edge.get(target, "auto") for target in targets(pipeline, role)}


def rdma_peers(pipeline: Pipeline, role: str) -> frozenset[str]:
    """Targets of `role` whose pods request an RDMA device, when `role`'s pod does too."""

    def rdma(name: str) -> bool:
        resources = pipeline.role(name).resources
        return requests_rdma([*resources.requests, *resources.limits])

    if not rdma(role):
        return frozenset()
    return frozenset(target for target in targets(pipeline, role) if rdma(target))


def role_config(pipeline: Pipeline, role: str, placement: Placement) -> RoleConfig:
    """The contract of one replica of `role` placed by `placement`."""
    group = pipeline.colocation_group_of(role)
    me = pipeline.role(role)
    return RoleConfig(
        pipeline=pipeline.name,
        namespace=placement.namespace,
        role=role,
        replica=placement.replica,
        handler=pipeline.role(role).handler,
        pool=pipeline.pool_for(role),
        topology=Topology.from_pipeline(pipeline, namespace=placement.namespace),
        downstream=tuple(
            Peer(target, placement.addresses[target], relay)
            for target, relay in relays(pipeline, role).items()
        ),
        same_gpu_peers=frozenset(group.roles) - {role} if group else frozenset(),
        rdma_peers=rdma_peers(pipeline, role) - (frozenset(group.roles) if group else frozenset()),
        node_local=placement.node_local,
        bind_host=placement.bind_host,
        ingress_port=placement.ingress_port,
        lane_port=placement.lane_port,
        metrics_port=placement.metrics_port,
        concurrency=pipeline.role(role).concurrency,
        request_timeout=pipeline.transport.request_timeout_seconds,
        topology_file=placement.topology_file,
        peers_file=placement.peers_file,
        peer_key_file=placement.peer_key_file,
        handler_args=me.handler_args,
        max_batch_size=me.batching.max_batch_size if me.batching else 1,
        max_batch_wait_ms=me.batching.max_wait_milliseconds if me.batching else 0.0,
        compat=me.compat or compat.default_token(me.handler, pipeline.image_for(role)),
        compatible_with=frozenset(me.compatible_with),
        ranks=me.ranks,
        nodes=me.nodes,
        node_rank=placement.node_rank,
        leader=placement.leader,
        rank_port=placement.rank_port,
    )
