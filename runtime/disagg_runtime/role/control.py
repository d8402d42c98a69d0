"""A role's sends that its ingress's I/O thread must never make (they wait on peers), each
on a thread of its own:

    ingress I/O thread ──later("overloaded"|"lost")──> control backlog ──> control thread
                       ──later("abort")─────────────> abort backlog ───> abort thread

- the control thread refuses requests as `overloaded`, and reports requests that went to
  a downstream replica now lost to their clients (migration.LOST: they move them to a live
  replica); between those it expires joins that waited too long and looks at the relays
  requests went on (forward.sweep, every `SWEEP_S`), which is how a loss is found when
  nothing more is sent there;
- the abort thread passes aborts downstream: one blocked on a dead replica must not hold
  up the lost reports that let clients move requests in time.

Each backlog is bounded (`BACKLOG`): beyond it an action is dropped and said (an abort not
passed on: the request's deadline frees its slots downstream).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from disagg_runtime.role.handling import Handling
from disagg_runtime.routing import forward, inflight, migration
from disagg_runtime.wire.envelope import Meta

log = logging.getLogger(__name__)
BACKLOG = 4096  # actions waiting for each thread; more are dropped (said)
SWEEP_S = 0.25  # how often relays to replicas holding requests are looked at (forward.sweep)
POLL_S = 0.1  # how long a thread waits for an action before looking at its stop flag


class Control:
    """The control and abort threads' backlogs and loops (see the module docstring)."""

    def __init__(
        self,
        name: str,
        handling: Handling,
        forwarder: forward.Forwarder,
        *,
        stopping: threading.Event,
        max_queue: int,
    ) -> None:
        self.name = name
        self.handling = handling
        self.forward = forwarder
        self._stopping = stopping
        self._max_queue = max_queue  # named in an `overloaded` refusal
        self._control: queue.Queue[tuple[str, Meta, str]] = queue.Queue(BACKLOG)
        self._aborts: queue.Queue[Meta] = queue.Queue(BACKLOG)

    def loops(self) -> list[tuple[str, Callable[[], None]]]:
        """(thread name, target) of each thread to start."""
        return [("control", self.control_loop), ("aborts", self.abort_loop)]

    def empty(self) -> bool:
        """Nothing waits to be sent (part of the role's `idle`)."""
        return self._control.empty() and self._aborts.empty()

    def later(self, action: str, meta: Meta, why: str = "") -> None:
        """Leave a network send to its thread: "abort" (pass it downstream), "overloaded"
        (refuse), "lost" (report to the client, `why`); dropped when the backlog is full."""
        try:
            if action == "abort":
                self._aborts.put_nowait(meta)
            else:
                self._control.put_nowait((action, meta, why))
        except queue.Full:
            log.warning("role %s: backlog full; %s of %s dropped", self.name, action, meta.rid)

    def lost(self, sent: list[inflight.Sent]) -> None:
        """Requests passed on to a downstream replica that is now lost: their clients are
        told (by the control thread), to move them to a live replica."""
        for s in sent:
            why = (
                f"replica {s.endpoint} of role {s.target} was lost (killed or restarted) "
                f"while request {s.meta.rid} may have been there"
            )
            self.later("lost", s.meta.with_(source=s.target), why)

    def control_loop(self) -> None:
        """Expire joins, sweep, then refuse or report what waits (until stopping)."""
        swept = 0.0
        while not self._stopping.is_set():
            try:
                self.handling.expire_joins()
                if time.monotonic() - swept >= SWEEP_S:
                    swept = time.monotonic()
                    self.forward.sweep()
                action, meta, why = self._control.get(timeout=POLL_S)
            except queue.Empty:
                continue
            except Exception:  # the loop must outlive any one request's failure
                log.exception("role %s: error while expiring requests", self.name)
                continue
            try:
                if action == "lost":
                    self.handling.hand_on(meta, migration.LOST, why, role=meta.source)
                else:
                    self.handling.fail(
                        meta,
                        "overloaded",
                        f"role {self.name} is overloaded: {self._max_queue} requests are "
                        "waiting for a worker; try again later",
                    )
            except Exception:
                log.exception("role %s: error on %s of %s", self.name, action, meta.rid)

    def abort_loop(self) -> None:
        """Pass aborts downstream (network sends), until stopping."""
        while not self._stopping.is_set():
            try:
                meta = self._aborts.get(timeout=POLL_S)
            except queue.Empty:
                continue
            try:
                self.handling.pass_abort(meta)
            except Exception:  # the loop must outlive any one abort's failure
                log.exception("role %s: error passing on the abort of %s", self.name, meta.rid)
