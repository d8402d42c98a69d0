"""How a large tcp payload is cut over parallel streams: pure planning, no sockets.

One TCP stream on loopback tops out where one core copies (the sender's copy into the
kernel, the receiver's copy out of it); NIXL's UCX tcp and the bench's `raw_tcp_n` go
faster with several streams, each sent and received by its own thread. A payload of at
least STREAMS_MIN bytes goes over `stream_count` connections: its tensor bytes, taken in
manifest order as one sequence, are cut into that many contiguous stripes at multiples
of ALIGN (each copy starts on a page), and stripe `i` travels on connection `i`.

`stream_count` is the one derivation of N: the relay's sender, its receiver's bound
(`max_streams`) and the bench's `raw_tcp_n` limit all use it.
"""

from __future__ import annotations

import itertools
import os
import struct
from collections.abc import Sequence

STREAMS_MIN = 4 << 20  # smaller payloads stay on the one ZMQ stream (chunks) or go inline
STRIPE_MIN = 4 << 20  # no stripe shorter than this (a thread hand-off costs ~50 us)
MAX_STREAMS = 8  # the most stripe connections one sender may open to one receiver
ALIGN = 4096  # stripes are cut at multiples of this (a page) in the payload's bytes
HEADER = struct.Struct("<QQ")  # before each stripe on its connection: xid, stripe bytes

FAILED = "stripes failed"  # how a nack for a payload its stripes lost begins: send it again

Segment = tuple[int, int, int]  # (tensor index, start in the tensor, length)


def default_streams(cpus: int | None = None) -> int:
    """How many streams a payload may use when nobody says: one per core (both ends copy,
    each stream is a thread on each side), at least 1, at most MAX_STREAMS."""
    count = os.cpu_count() if cpus is None else cpus
    return max(1, min(MAX_STREAMS, count or 1))


def check_streams(streams: int) -> int:
    """A configured stream count, bounded: 1..MAX_STREAMS (ValueError naming the field)."""
    if isinstance(streams, bool) or not isinstance(streams, int):
        raise ValueError(f"streams must be an integer, not {type(streams).__name__}")
    if not 1 <= streams <= MAX_STREAMS:
        raise ValueError(f"streams must be within [1, {MAX_STREAMS}], not {streams}")
    return streams


def stream_count(nbytes: int, max_streams: int | None = None) -> int:
    """The streams a payload of `nbytes` goes over: 0 below STREAMS_MIN (not striped),
    else as many stripes of at least STRIPE_MIN as fit, up to `max_streams` (default
    `default_streams()`)."""
    if nbytes < STREAMS_MIN:
        return 0
    limit = default_streams() if max_streams is None else check_streams(max_streams)
    return max(1, min(limit, nbytes // STRIPE_MIN))


def cuts(total: int, streams: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """[start, length) of each stripe of `total` bytes over `streams`: contiguous, in
    order, covering `total`; every cut a multiple of `align`; none empty (fewer stripes
    when `total` is too short for `streams` aligned ones)."""
    if streams < 1:
        raise ValueError("streams must be at least 1")
    if align < 1:
        raise ValueError("align must be at least 1")
    streams = max(1, min(streams, total // align))
    bounds = [0]
    for k in range(1, streams):
        bounds.append((total * k // streams) // align * align)
    bounds.append(total)
    return [(a, b - a) for a, b in itertools.pairwise(bounds) if b > a]


def stripe_plan(sizes: Sequence[int], streams: int, align: int = ALIGN) -> list[list[Segment]]:
    """Each stripe's segments, for tensors of `sizes` bytes laid end to end: stripe `i` is
    the `(tensor index, start, length)` pieces of bytes `cuts(...)[i]` (empty tensors
    have none). Sender and receiver compute the same plan from the manifest."""
    plan: list[list[Segment]] = []
    ends: list[int] = []
    at = 0
    for size in sizes:
        if size < 0:
            raise ValueError("tensor sizes must not be negative")
        at += size
        ends.append(at)
    tensor, tensor_start = 0, 0  # the tensor holding the next byte, where it begins
    for start, length in cuts(at, streams, align) if at else []:
        segments: list[Segment] = []
        pos, end = start, start + length
        while pos < end:
            while ends[tensor] <= pos:  # skips empty tensors too
                tensor_start = ends[tensor]
                tensor += 1
            take = min(end, ends[tensor]) - pos
            segments.append((tensor, pos - tensor_start, take))
            pos += take
        plan.append(segments)
    return plan


def stripe_bytes(plan: Sequence[Sequence[Segment]]) -> list[int]:
    """Each stripe's length (what its header says)."""
    return [sum(length for _, _, length in stripe) for stripe in plan]
