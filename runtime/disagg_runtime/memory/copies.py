"""Device-aware copies, kept apart from the pool (memory) and the slot layout.

A copy with a GPU on either side runs on a dedicated copy stream
(one per thread and device), never on the producer's stream:

    producer stream   ──work──●(its current tail)───────────more work───>  (never waits)
                               ╲ wait_stream
    copy stream                 ●──copy slot<-tensor──●(Fence event)
                                                       ╲ wait: host (Fence.wait) or,
                                                          for CUDA IPC, the receiver

`src.record_stream(copy)` keeps the caching allocator from reusing a source tensor's
memory until the copy has read it, so the producer may drop its tensors at once.
`write_tensors` returns a `Fence`; whoever hands the slot on waits on it first.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from disagg_runtime.wire import codec

_local = threading.local()


@dataclass(frozen=True)
class Fence:
    """Copies queued on copy streams; empty when every copy was host to host (done)."""

    events: tuple[torch.cuda.Event, ...] = ()

    def done(self) -> bool:
        return all(bool(cast(Any, e).query()) for e in self.events)

    def wait(self) -> None:
        """Block this thread (only) until the copies are done."""
        for event in self.events:
            event.synchronize()


def new_event(*, interprocess: bool = False) -> torch.cuda.Event:
    """A CUDA event without timing (an interprocess one can be opened by another process)."""
    event = cast(Any, torch.cuda).Event(interprocess=interprocess)
    return cast(torch.cuda.Event, event)


def new_stream(device: torch.device) -> torch.cuda.Stream:
    return cast(torch.cuda.Stream, cast(Any, torch.cuda).Stream(device=device))


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's dedicated copy stream on `device` (created once)."""
    streams: dict[torch.device, torch.cuda.Stream] = _local.__dict__.setdefault("streams", {})
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = new_stream(device)
    return stream


def _copy_device(dst: torch.Tensor, src: torch.Tensor) -> torch.device:
    return dst.device if dst.is_cuda else src.device


def copy_async(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    stream: torch.cuda.Stream | None = None,
    fresh_dst: bool = False,
) -> Fence:
    """`dst.copy_(src)` for each pair with a GPU on one side, on copy streams ordered after
    the current streams of every device involved; never makes those streams wait. With
    `fresh_dst`, the destinations were just allocated on the current stream and are kept
    from reuse until the copy wrote them."""
    groups: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in pairs:
        groups.setdefault(_copy_device(dst, src), []).append((dst, src))
    events: list[torch.cuda.Event] = []
    for device, group in groups.items():
        s = stream if stream is not None and stream.device == device else copy_stream(device)
        involved = {device} | {t.device for pair in group for t in pair if t.is_cuda}
        for other in involved:
            s.wait_stream(torch.cuda.current_stream(other))
        with torch.cuda.stream(s):
            for dst, src in group:
                dst.copy_(src, non_blocking=True)
                if src.is_cuda:
                    src.record_stream(s)
                if fresh_dst and dst.is_cuda:
                    dst.record_stream(s)
            event = new_event()
            event.record(s)
        events.append(event)
    return Fence(tuple(events))


def to_device(payload: Any, device: torch.device | str) -> Any:
    """`payload` with every tensor that is not on `device` copied there, on the dedicated
    copy stream; returns once the copies are done (so a slot they came from may be freed).
    Containers are rebuilt, tensors already on `device` are kept as they are."""
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def move(obj: Any, depth: int) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device == target:
                return obj
            if not (obj.is_cuda or target.type == "cuda"):
                return obj.to(target)
            dst = torch.empty(obj.shape, dtype=obj.dtype, device=target)
            pairs.append((dst, obj.detach()))
            return dst
        if depth > codec.MAX_DEPTH:
            return obj
        if isinstance(obj, dict):
            return {k: move(v, depth + 1) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [move(v, depth + 1) for v in obj]
            return tuple(items) if isinstance(obj, tuple) else items
        return obj

    moved = move(payload, 0)
    if pairs:
        copy_async(pairs, fresh_dst=True).wait()
    return moved
