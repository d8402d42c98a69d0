"""Relays move payloads between two role processes.

`shm` (same node) writes tensors once into the receiver's shared pool; `tcp` (ZMQ, across
nodes) streams them into the receiver's pool; `cuda-ipc` (roles on one GPU) copies them
once, GPU to GPU, into the receiver's CUDA pool (relay/cuda_ipc.py). All end at an
`Ingress`. Tensors on a GPU are copied once, on a dedicated stream, whatever the relay.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from disagg_core.spec.model import RELAYS
from disagg_runtime.relay.errors import NotAPeer, RelayError, RelayTimeout
from disagg_runtime.relay.ingress import Ingress, Message
from disagg_runtime.relay.sender import Sender, ShmSender, TcpSender

__all__ = [
    "KINDS",
    "Ingress",
    "Message",
    "NotAPeer",
    "Relay",
    "RelayError",
    "RelayTimeout",
    "Sender",
    "ShmSender",
    "TcpSender",
    "connect",
]
KINDS = tuple(kind for kind in RELAYS if kind != "auto")  # what `auto` resolves to


class Relay(Protocol):
    """What a role needs from a connection to one downstream peer."""

    @property
    def kind(self) -> str: ...

    @property
    def endpoint(self) -> str: ...

    def send(
        self,
        payload: Any,
        *,
        request_id: str,
        timeout: float | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> int: ...

    def abort(self, request_id: str) -> None: ...

    def close(self) -> None: ...


def connect(kind: str, endpoint: str, **options: Any) -> Relay:
    """Open a relay of `kind` to the ingress at `endpoint`."""
    if kind == "shm":
        return ShmSender(endpoint, **options)
    if kind == "tcp":
        return TcpSender(endpoint, **options)
    if kind == "cuda-ipc":  # imported here: it is the only relay that needs CUDA
        from disagg_runtime.relay.cuda_ipc import CudaIpcSender

        return CudaIpcSender(endpoint, **options)
    raise RelayError(f"unknown relay {kind!r}; expected one of {', '.join(KINDS)}")
