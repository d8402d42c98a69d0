"""Which relay an edge uses: `auto` resolved with what this process and its peers allow."""

from __future__ import annotations

import logging

from disagg_core.contract import ContractError, RoleConfig
from disagg_runtime.relay import registry

log = logging.getLogger(__name__)


def relay_kind(config: RoleConfig, role: str, requested: str) -> str:
    """`auto` is cuda-ipc to a same-GPU peer when this process can use CUDA IPC, else shm
    where peers share /dev/shm (same pod, or `disagg up`), else nixl to a peer whose pod,
    like ours, requests an RDMA device (`rdma_peers`) when this process has nixl, else
    tcp; an automatic cuda-ipc or nixl that is not possible falls back (to shm, to tcp)
    with the reason logged. An explicit kind that
    this process cannot use (cuda-ipc without CUDA) is a start-up error naming why
    (ContractError). Whether the receiver's pool is on the GPU is only known at connect:
    the cuda-ipc sender then falls back to the receiver's shared memory by itself, again
    with the reason logged."""
    if requested != "auto":
        backend = registry.find(requested)
        reason = backend.unavailable() if backend is not None else None
        if backend is not None and reason is not None:
            raise ContractError(
                f"edge {config.role}->{role}: relay {requested} needs {backend.needs}: {reason}"
            )
        return requested
    if role in config.same_gpu_peers:
        reason = registry.backend("cuda-ipc").unavailable()
        if reason is None:
            return "cuda-ipc"
        log.info(  # expected on machines without GPUs: not a warning
            "edge %s->%s: same GPU, but CUDA IPC is not possible (%s); using shm",
            config.role,
            role,
            reason,
        )
        return "shm"
    if config.node_local:
        return "shm"
    if role in config.rdma_peers:
        reason = registry.backend("nixl").unavailable()
        if reason is None:
            return "nixl"
        log.info(  # an image without the nixl extra: tcp works, only slower
            "edge %s->%s: both pods have RDMA devices, but the nixl relay is not possible "
            "(%s); using tcp",
            config.role,
            role,
            reason,
        )
    return "tcp"
