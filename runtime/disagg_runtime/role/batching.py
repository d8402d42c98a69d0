"""Gather waiting requests into one `batch()` call (`roles[].batching`).

    worker threads ── submit(payload, deadline) ──> pending (arrival order) ──> batcher thread
          │ wait on their Ticket                                       plan(): cut a batch?
          └──────────── result / exception / timeout <── run_batch(payloads) -> outputs

`plan` is the whole policy and pure: a batch is cut when `max_size` live requests wait, or
when the oldest has waited `max_wait`; requests aborted or past their deadline are dropped
before they can join one. Everything else applies to each request alone: an output that is
an Exception fails its own request, a worker whose deadline passes gives up on its ticket
(taken back if still pending; its output discarded if its batch already runs). Only a
`batch()` that raises fails every request of that batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


class BatchTimeout(TimeoutError):
    """The request's deadline passed before its batch produced its output."""


class BatchCancelled(RuntimeError):
    """The request was aborted while it waited for a batch."""


@dataclass
class Ticket:
    """One submitted request: the worker waits on it, the batcher fills it."""

    payload: Any
    arrived: float  # monotonic
    deadline: float  # monotonic
    cancelled: Callable[[], bool] = lambda: False
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _value: Any = None
    _error: BaseException | None = None

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        if not self._done.is_set():
            self._value, self._error = value, error
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float) -> Any:
        """The output; raises its exception, or BatchTimeout when `timeout` passes first."""
        if not self._done.wait(max(0.0, timeout)):
            raise BatchTimeout("request deadline passed while waiting for its batch")
        if self._error is not None:
            raise self._error
        return self._value


@dataclass(frozen=True)
class Plan:
    """What to do now: indexes into the pending list (arrival order)."""

    take: tuple[int, ...] = ()  # run these as one batch now
    expired: tuple[int, ...] = ()  # past their deadline: fail with a timeout
    cancelled: tuple[int, ...] = ()  # aborted: drop
    wait: float | None = None  # else sleep this long (None: until something arrives)


def plan(pending: Sequence[Ticket], *, now: float, max_size: int, max_wait: float) -> Plan:
    """Cut a batch when `max_size` live tickets wait or the oldest live one has waited
    `max_wait`; drop cancelled and expired tickets first. Pure."""
    cancelled = tuple(i for i, t in enumerate(pending) if t.cancelled())
    expired = tuple(i for i, t in enumerate(pending) if i not in cancelled and t.deadline <= now)
    dead = set(cancelled) | set(expired)
    live = [i for i in range(len(pending)) if i not in dead]
    if not live:
        return Plan(expired=expired, cancelled=cancelled)
    oldest = pending[live[0]]
    if len(live) >= max_size or now >= oldest.arrived + max_wait:
        return Plan(take=tuple(live[:max_size]), expired=expired, cancelled=cancelled)
    soonest = min(pending[i].deadline for i in live)
    return Plan(
        expired=expired,
        cancelled=cancelled,
        wait=max(0.0, min(oldest.arrived + max_wait, soonest) - now),
    )


class Batcher:
    """One thread that runs `run_batch` on gathered tickets, one batch at a time."""

    def __init__(
        self,
        run_batch: Callable[[list[Any]], list[Any]],
        *,
        max_size: int,
        max_wait_s: float,
        name: str = "disagg-batcher",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_size < 1 or max_wait_s < 0:
            raise ValueError(f"max_size {max_size} must be >= 1, max_wait_s {max_wait_s} >= 0")
        self._run_batch = run_batch
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._pending: list[Ticket] = []
        self._cond = threading.Condition()
        self._closed = False
        self.batches = 0  # batch() calls made (for tests and metrics)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, payload: Any, *, timeout: float, cancelled: Callable[[], bool] = lambda: False
    ) -> Any:
        """Run `payload` in a batch; blocks the caller up to `timeout` seconds."""
        now = self._clock()
        ticket = Ticket(payload, arrived=now, deadline=now + timeout, cancelled=cancelled)
        with self._cond:
            if self._closed:
                raise BatchCancelled("the role is stopping")
            self._pending.append(ticket)
            self._cond.notify()
        try:
            return ticket.result(timeout)
        except BatchTimeout:
            with self._cond:  # still waiting for a batch: take it back
                if ticket in self._pending:
                    self._pending.remove(ticket)
            raise

    def close(self) -> None:
        """Stop: pending tickets fail with BatchCancelled; a running batch finishes."""
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        for ticket in pending:
            ticket.resolve(error=BatchCancelled("the role is stopping"))
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                decision = plan(
                    self._pending,
                    now=self._clock(),
                    max_size=self.max_size,
                    max_wait=self.max_wait_s,
                )
                take = [self._pending[i] for i in decision.take]
                expired = [self._pending[i] for i in decision.expired]
                cancelled = [self._pending[i] for i in decision.cancelled]
                gone = set(decision.take) | set(decision.expired) | set(decision.cancelled)
                self._pending = [t for i, t in enumerate(self._pending) if i not in gone]
                if not take and not gone:
                    self._cond.wait(decision.wait if decision.wait is not None else 0.5)
                    continue
            for ticket in expired:
                ticket.resolve(error=BatchTimeout("request deadline passed before its batch ran"))
            for ticket in cancelled:
                ticket.resolve(error=BatchCancelled("request aborted while waiting for a batch"))
            if take:
                self._run(take)

    def _run(self, tickets: list[Ticket]) -> None:
        self.batches += 1
        try:
            outputs = self._run_batch([t.payload for t in tickets])
        except Exception as exc:  # the whole batch failed: each of its requests fails
            for ticket in tickets:
                ticket.resolve(error=exc)
            return
        if len(outputs) != len(tickets):
            error = ValueError(f"batch returned {len(outputs)} outputs for {len(tickets)} inputs")
            for ticket in tickets:
                ticket.resolve(error=error)
            return
        for ticket, output in zip(tickets, outputs, strict=True):
            if isinstance(output, BaseException):
                ticket.resolve(error=output)
            else:
                ticket.resolve(output)
