"""What each rank process of a replica is told: torch.distributed's own variables.

A replica of a role with `ranks: N` and `nodes: M` is one world of N x M ranks. The container
(`disagg role`, told DISAGG_RANKS/NODES/NODE_RANK/LEADER/RANK_PORT) is local rank 0 of its pod
and starts the N - 1 others as children; every rank process gets the variables of
`RANK_ENV`, which `torch.distributed.init_process_group(init_method="env://")` and libraries
built on it (transformers' `tp_plan`, diffusers, vLLM) read:

    global rank = NODE_RANK x RANKS + LOCAL_RANK        rank 0: the leader pod's first process

Rank 0 alone owns the replica's transport (ingress, pool, senders, metrics, probes). A rank
process is recognised by `RANK` being set in its environment alongside DISAGG_RANKS.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from disagg_core.contract.env import ContractError
from disagg_core.contract.role import RoleConfig


@dataclass(frozen=True)
class RankVar:
    name: str
    doc: str


RANK_ENV: Final[tuple[RankVar, ...]] = (
    RankVar(
        "RANK", "global rank in the replica's world: DISAGG_NODE_RANK x DISAGG_RANKS + LOCAL_RANK"
    ),
    RankVar("WORLD_SIZE", "ranks in the replica: DISAGG_RANKS x DISAGG_NODES"),
    RankVar("LOCAL_RANK", "rank within this pod (its GPU index where the pod has GPUs)"),
    RankVar("LOCAL_WORLD_SIZE", "ranks in this pod: DISAGG_RANKS"),
    RankVar("GROUP_RANK", "this pod's index in the group: DISAGG_NODE_RANK"),
    RankVar("MASTER_ADDR", "where rank 0 listens: DISAGG_LEADER"),
    RankVar("MASTER_PORT", "rank 0's rendezvous port: DISAGG_RANK_PORT"),
)


@dataclass(frozen=True)
class Rank:
    """One rank process's place in its replica's world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def leader(self) -> bool:
        """Global rank 0: the process that owns the transport."""
        return self.rank == 0

    def env(self) -> dict[str, str]:
        values = (
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.node_rank,
            self.master_addr,
            self.master_port,
        )
        return {var.name: str(value) for var, value in zip(RANK_ENV, values, strict=True)}


def pod_ranks(config: RoleConfig) -> tuple[Rank, ...]:
    """The ranks of this container, local rank 0 first."""
    return tuple(
        Rank(
            rank=config.node_rank * config.ranks + local,
            world_size=config.world_size,
            local_rank=local,
            local_world_size=config.ranks,
            node_rank=config.node_rank,
            master_addr=config.leader,
            master_port=config.rank_port,
        )
        for local in range(config.ranks)
    )


def rank_of(config: RoleConfig, env: Mapping[str, str]) -> Rank:
    """This process's rank: from `RANK`/`LOCAL_RANK` when a launcher set them (a child rank),
    else local rank 0 of the pod. Refuses a `RANK` that does not fit the contract."""
    ranks = pod_ranks(config)
    if "LOCAL_RANK" not in env:
        return ranks[0]
    try:
        local = int(env["LOCAL_RANK"])
    except ValueError:
        raise ContractError(f"LOCAL_RANK={env['LOCAL_RANK']!r} is not an integer") from None
    if not 0 <= local < len(ranks):
        raise ContractError(f"LOCAL_RANK={local} is not in 0..{len(ranks) - 1} (DISAGG_RANKS)")
    rank = ranks[local]
    if env.get("RANK", str(rank.rank)) != str(rank.rank):
        raise ContractError(f"RANK={env['RANK']!r}, but DISAGG_NODE_RANK/RANKS make it {rank.rank}")
    return rank
