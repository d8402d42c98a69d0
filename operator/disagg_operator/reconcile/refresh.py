"""When a pipeline's status is computed again without a spec change: the reconciler's timers
and background tasks (`Scheduler`), apart from what one reconcile or refresh does.

- Child events are coalesced (`Scheduler.request`): events within `coalesce` seconds give
  one refresh (a rollout gives dozens of StatefulSet events; they cost one status
  computation and at most one write).
- A refresh that fails on the API is tried again after `retry_delay` (jittered exponential
  backoff) while the pipeline is tracked, so a failed status write never leaves it stale.
- While Progressing is True, a refresh is scheduled for when the progress deadline passes
  (`Scheduler.recheck`, with `status.recheck_delay`), so that
  `Degraded/ProgressDeadlineExceeded` appears without any event.
- While a rollout step waits, a refresh is scheduled for when its deadline passes
  (`Scheduler.recheck_step`, with `RolloutTracker.step_deadline_delay`), so that a stuck
  pod's step is reported stalled without any event.
- A rollout step that is done spawns the reconcile that applies the next
  (`Scheduler.spawn_reconcile`).

The timers of a pipeline live in its state (`Timers`), so forgetting the pipeline cancels
them; the tasks live here, so closing the reconciler cancels them.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

from disagg_operator.k8s import client as kube
from disagg_operator.reconcile.cache import Key

COALESCE: Final = 0.1  # seconds: child events within this window give one status refresh
REFRESH_RETRY: Final = 1.0  # seconds before a failed refresh is tried again; doubles ...
REFRESH_RETRY_CAP: Final = 60.0  # ... up to this, jittered

log = logging.getLogger(__name__)

Uniform = Callable[[float, float], float]


def retry_ceiling(failures: int) -> float:
    """The longest wait before trying a refresh again after `failures` (>= 1) in a row."""
    return min(REFRESH_RETRY_CAP, REFRESH_RETRY * 2.0 ** (failures - 1))


def retry_delay(failures: int, uniform: Uniform = random.uniform) -> float:
    """The wait before the next try: between half the ceiling and the ceiling, so that
    pipelines failing together (an API server outage) do not all come back at once."""
    ceiling = retry_ceiling(failures)
    return uniform(ceiling / 2, ceiling)


@dataclass
class Timers:
    """A pipeline's scheduled refreshes."""

    due: asyncio.TimerHandle | None = None  # a coalesced (or retried) refresh
    recheck: asyncio.TimerHandle | None = None  # when the progress deadline passes
    step: asyncio.TimerHandle | None = None  # when the rollout step's deadline passes
    failures: int = 0  # refreshes failed on the API in a row

    def cancel(self) -> None:
        for timer in (self.recheck, self.step, self.due):
            if timer is not None:
                timer.cancel()


@dataclass
class Scheduler:
    """Runs refreshes and reconciles later, as tasks; `timers` finds a pipeline's `Timers`
    while it is tracked (None once forgotten: no retry then)."""

    refresh: Callable[[Key], Awaitable[object]]
    reconcile: Callable[[Key], Awaitable[object]]
    timers: Callable[[Key], Timers | None]
    coalesce: float = COALESCE
    backoff: Callable[[int], float] = retry_delay  # failures in a row -> seconds
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set, init=False, repr=False)

    def request(self, key: Key, timers: Timers) -> None:
        """A refresh `coalesce` seconds from now, once for all requests meanwhile."""
        if timers.due is None:
            timers.due = asyncio.get_running_loop().call_later(self.coalesce, self._due, key)

    def recheck(self, key: Key, timers: Timers, delay: float | None) -> None:
        """A refresh `delay` seconds from now (the progress deadline), instead of the one
        scheduled before; None: none."""
        timers.recheck = self._later(timers.recheck, key, delay)

    def recheck_step(self, key: Key, timers: Timers, delay: float | None) -> None:
        """As `recheck`, for the rollout step's deadline (a timer of its own: the two
        deadlines pass at different times)."""
        timers.step = self._later(timers.step, key, delay)

    def spawn_refresh(self, key: Key) -> None:
        self._spawn(self._refresh_task(key), f"disagg-refresh-{key[1]}")

    def spawn_reconcile(self, key: Key) -> None:
        self._spawn(self._reconcile_logged(key), f"disagg-step-{key[1]}")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _later(
        self, before: asyncio.TimerHandle | None, key: Key, delay: float | None
    ) -> asyncio.TimerHandle | None:
        if before is not None:
            before.cancel()
        if delay is None:
            return None
        return asyncio.get_running_loop().call_later(delay, self.spawn_refresh, key)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _due(self, key: Key) -> None:
        timers = self.timers(key)
        if timers is not None:
            timers.due = None
        self.spawn_refresh(key)

    async def _refresh_task(self, key: Key) -> None:
        """A scheduled refresh; on an API error, again later while the pipeline is tracked."""
        try:
            await self.refresh(key)
        except kube.ApiError as error:
            timers = self.timers(key)
            if timers is None:
                return
            timers.failures += 1
            delay = self.backoff(timers.failures)
            log.warning("status of %s/%s: %s; again in %.1f s", *key, error, delay)
            if timers.due is None:
                timers.due = asyncio.get_running_loop().call_later(delay, self._due, key)
        else:
            timers = self.timers(key)
            if timers is not None:
                timers.failures = 0

    async def _reconcile_logged(self, key: Key) -> None:
        try:
            await self.reconcile(key)
        except Exception:  # kopf's own retries take over on the next event
            log.exception("rollout step of %s/%s failed", *key)
