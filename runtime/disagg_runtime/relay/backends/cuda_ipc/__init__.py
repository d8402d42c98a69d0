"""The `cuda-ipc` relay: GPU to GPU within one GPU (colocated roles), one package so the
sender and the landing share the handle formats without importing each other.

- `handles`: the pool export and event handles (formats, checks, mapping) both sides use;
- `send`: the sender (an shm sender that maps the receiver's device pool once);
- `land`: the receiver's side (the welcome's export, commits held until their event).

Imported only when a role selects it (relay/registry.py).
"""

from __future__ import annotations

from disagg_runtime.relay.backends.cuda_ipc import handles
from disagg_runtime.relay.backends.cuda_ipc.land import CudaIpcLanding
from disagg_runtime.relay.backends.cuda_ipc.send import CudaIpcSender
from disagg_runtime.relay.registry import Backend

BACKEND = Backend(
    "cuda-ipc",
    sender=CudaIpcSender,
    landing=CudaIpcLanding,
    unavailable=lambda: handles.unavailable_reason(),  # late-bound: looked up at each check
    needs="CUDA",
)
