"""One request in flight at the client, and how its messages add up to its result.

A request's exit roles each send `data` (one result), or a stream: `chunk`s numbered from
0, then an `end` with their count; any role may send an `error`. `Pending.take` folds one
such message in and says when the request is complete (all its exits heard from) or has
failed (an error, a chunk out of order, an end that counts differently). No I/O here.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from disagg_runtime.client.errors import FAILURES, RequestFailed
from disagg_runtime.routing.peers import Dedicated, RelayCache
from disagg_runtime.wire.envelope import Meta, Reply

END = object()  # the last item of a request's `chunks`


@dataclass(frozen=True)
class Streamed:
    """The result of an exit role whose chunks went to `on_chunk`: how many there were."""

    count: int


def detach(value: Any) -> Any:
    """Deep-copy tensors out of pool memory (containers rebuilt, scalars kept)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: detach(v) for k, v in value.items()}
    if isinstance(value, list):
        return [detach(v) for v in value]
    if isinstance(value, tuple):
        return tuple(detach(v) for v in value)
    return value


@dataclass(frozen=True)
class Outcome:
    """A request's end: its result, or why it failed."""

    result: Any = None
    failure: RequestFailed | None = None


@dataclass
class Pending:
    exits: frozenset[str]
    deadline: float
    future: Future[Any] = field(default_factory=Future)
    chunks: queue.Queue[Any] = field(default_factory=queue.Queue)
    results: dict[str, Any] = field(default_factory=dict)
    streamed: dict[str, list[Any]] = field(default_factory=dict)
    next_seq: dict[str, int] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    on_chunk: Callable[[Any], None] | None = None

    def take(self, meta: Meta, payload: Any) -> Outcome | None:
        """Fold in one message of the request (see the module docstring): its Outcome once
        the request is complete or failed, else None. Chunks go to `on_chunk`, or onto
        `chunks` (for `Client.stream`) and into the result."""
        if meta.kind == "error":
            error = dict(meta.error)
            where = f"role {error.get('role', meta.source)} (replica {error.get('replica', '?')})"
            message = f"request {meta.rid} failed at {where}: {error.get('message', '')}"
            kind = FAILURES.get(error.get("reason", ""), RequestFailed)
            return Outcome(failure=kind(message, role=meta.source, error=error))
        if meta.kind == "data":
            self.results[meta.source] = payload
        elif meta.kind == "chunk":
            expected = self.next_seq.get(meta.source, 0)
            if meta.seq != expected:
                return Outcome(
                    failure=RequestFailed(
                        f"stream from {meta.source}: chunk {meta.seq}, expected {expected}"
                    )
                )
            self.next_seq[meta.source] = expected + 1
            if self.on_chunk is not None:
                self.on_chunk(payload)
                return None
            self.streamed.setdefault(meta.source, []).append(payload)
            self.chunks.put(payload)
        elif meta.kind == "end":
            got = self.next_seq.get(meta.source, 0)
            if meta.count != got:
                return Outcome(
                    failure=RequestFailed(
                        f"stream from {meta.source}: {got} of {meta.count} chunks"
                    )
                )
            self.ended.add(meta.source)
            if self.on_chunk is not None:
                self.results[meta.source] = Streamed(got)
            self.streamed.setdefault(meta.source, [])  # a stream of no chunks is []
        if set(self.results) | self.ended >= self.exits:
            outputs: dict[str, Any] = {**self.streamed, **self.results}
            result = outputs if len(self.exits) > 1 else next(iter(outputs.values()), None)
            return Outcome(result=result)
        return None


class Requests(Protocol):
    """What a request started outside `Client.start` (client/direct.py) uses of its client."""

    exits: frozenset[str]
    reply: Reply
    timeout: float
    relays: RelayCache
    uploads: Dedicated

    def _track(self, rid: str, pending: Pending) -> None: ...

    def _finish(
        self, rid: str, *, result: Any = None, exc: BaseException | None = None
    ) -> None: ...
