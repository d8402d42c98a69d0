"""The `tcp` relay: across nodes, the slot's bytes streamed as chunk messages that land
at their place in the receiver's pool.

- `send`: the sender (`TcpSender`; inline limits, `chunk_plan`, `ChunkStream`);
- `land`: the receiver's side (`TcpLanding`: chunked commits, `Chunked`, `chunk_targets`).

The two share only the chunk order (`chunk_plan` and `chunk_targets` agree on it).

Payloads of STREAMS_MIN (4 MiB) or more to a receiver whose pool is host memory go over
parallel streams instead: `stripe_plan` (how many, and how the bytes are cut: pure),
`stripe_send` (the sender's connections, one thread each), `stripe_land` (the receiver's
authenticated connections, landing each stripe in place).
"""

from __future__ import annotations

from disagg_runtime.relay.backends.tcp.land import TcpLanding, chunk_targets
from disagg_runtime.relay.backends.tcp.send import (
    HOST_POOLS,
    TCP_INLINE_MAX,
    ChunkStream,
    TcpSender,
    chunk_plan,
    inline_limit,
)
from disagg_runtime.relay.registry import Backend

__all__ = [
    "BACKEND",
    "HOST_POOLS",
    "TCP_INLINE_MAX",
    "ChunkStream",
    "TcpLanding",
    "TcpSender",
    "chunk_plan",
    "chunk_targets",
    "inline_limit",
]
BACKEND = Backend("tcp", sender=TcpSender, landing=TcpLanding)
