"""The peers that the latency limits measure against (`limits`' raw and Python unix
sockets, `raw_tcp`, bare NIXL): each a fresh process of its own, forked from one server
process that imported them once.

A spawned process imports torch and the bench again (2-3 s on two cores, more than the
measurement it serves; `disagg bench transport` starts 8 of these per size). The forkserver
imports them once; a child inherits that server's modules and nothing of the parent (no
socket, pool, CUDA context or thread), and its first message, a warm-up, is dropped. NIXL
is not imported there: a NIXL peer sets UCX's environment before its import.

The relays' receivers (`peer.serve`) and the CPU-per-message peers (`stream_cpu`) stay
spawned: they report the receiver's RSS growth and CPU time, and a forked child faults the
libraries' pages in again as it runs, which those figures would count.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import ForkServerContext
from typing import Final

PRELOAD: Final = (
    "torch",
    "disagg_runtime.bench.limits",
    "disagg_runtime.bench.raw_tcp",
    "disagg_runtime.bench.bare_nixl",
)


def context() -> ForkServerContext:
    """The context to start latency peers with (the server starts with the first one)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx
