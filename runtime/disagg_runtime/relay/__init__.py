"""Relays move payloads between two role processes.

Each kind is a backend module found through relay/registry.py: `shm` (same node) writes
tensors once into the receiver's shared pool; `tcp` (ZMQ, across nodes) streams them into
the receiver's pool; `cuda-ipc` (roles on one GPU) copies them once, GPU to GPU, into the
receiver's CUDA pool (relay/backends/cuda_ipc/). All end at an `Ingress`: an I/O loop
(relay/ingress/) over a slot ledger (relay/ledger.py) and per-kind landings
(relay/landing.py). Which kind an edge uses is relay/select.py's. Tensors on a GPU are
copied once, on a dedicated stream, whatever the relay.
"""

from __future__ import annotations

from typing import Any

from disagg_core.relays import CONCRETE
from disagg_runtime.relay import registry
from disagg_runtime.relay.backends.shm import ShmSender
from disagg_runtime.relay.backends.tcp import TcpSender
from disagg_runtime.relay.errors import (
    NotAPeer,
    Overloaded,
    PeerLost,
    RelayError,
    RelayTimeout,
    Unanswered,
    WrongRole,
)
from disagg_runtime.relay.ingress import Ingress
from disagg_runtime.relay.ledger import Message
from disagg_runtime.relay.registry import Relay
from disagg_runtime.relay.sender import Sender

__all__ = [
    "KINDS",
    "Ingress",
    "Message",
    "NotAPeer",
    "Overloaded",
    "PeerLost",
    "Relay",
    "RelayError",
    "RelayTimeout",
    "Sender",
    "ShmSender",
    "TcpSender",
    "Unanswered",
    "WrongRole",
    "connect",
]
KINDS: tuple[str, ...] = CONCRETE  # what `auto` resolves to


def connect(kind: str, endpoint: str, **options: Any) -> Relay:
    """Open a relay of `kind` to the ingress at `endpoint`."""
    return registry.backend(kind).sender(endpoint, **options)
