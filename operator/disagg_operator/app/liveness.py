"""The operator's liveness: kopf's /healthz answers 500 when the operator is stuck.

kopf's endpoint alone answers as long as its event loop runs, whatever else has stopped. A
probe handler (`register`) adds two checks, each of which fails only when waiting longer
would not help:

- watches: every resource the operator watches must have been heard from (a watch answered,
  an event, a BOOKMARK) within `stall_after` seconds. kopf reconnects a watch that has been
  silent for `settings.watching.inactivity_timeout` (70 s) and API servers send BOOKMARKs
  about once a minute, so a healthy watch is heard from at least that often, however quiet
  the cluster is. Silence for longer means kopf's watcher is hung or gone, or the API server
  has not answered a watch all that time (a restart then costs nothing and renews the
  connections).
- work: while reconciles or status refreshes wait or run, one of them must end (done or
  failed) at least every `stall_after` seconds (`Progress`). A request hung without a
  timeout, or a lock never released, leaves work waiting forever; a slow API server does
  not: requests time out, fail and are retried, and each of those ends.

A blocked event loop is left to kubelet: the endpoint does not answer within the probe's
timeoutSeconds. The answer's JSON (when healthy) reports the watches' ages, the work in
flight and the loop's lag (how long a wake-up waited for its turn), for humans.

Watches are heard through `kopfcost` (kopf offers no hook; a private kopf module is wrapped).
When that wrapping is not possible (another kopf version), the watch check is skipped and the
answer says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import kopf

from disagg_operator.app import kopfcost
from disagg_operator.reconcile.progress import Clock, Progress

DEFAULT_STALL_AFTER: Final = 300.0  # seconds
PROBE_ID: Final = "disagg-liveness"
SERVER_LOGGER: Final = "aiohttp.server"  # where aiohttp logs a request handler's exception


class ProbeFailureLogged(logging.Filter):
    """Drops aiohttp's report of a failing /healthz: kopf has already logged why, in one line
    (`Handler 'disagg-liveness' failed permanently: stuck: ...`), and aiohttp's "Error
    handling request" adds a full traceback of kopf's internals on every probe (kubelet
    probes every few seconds)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(getattr(error, "__cause__", None), kopf.PermanentError)


def quiet_probe_failures() -> None:
    """Install `ProbeFailureLogged` on aiohttp's server logger (once)."""
    logger = logging.getLogger(SERVER_LOGGER)
    if not any(isinstance(f, ProbeFailureLogged) for f in logger.filters):
        logger.addFilter(ProbeFailureLogged())


@dataclass
class Watches:
    """When each watched resource (by plural) was last heard from."""

    clock: Clock = time.monotonic
    heard: dict[str, float] = field(default_factory=dict)

    def hear(self, resource: str) -> None:
        self.heard[resource] = self.clock()


def problems(
    now: float,
    *,
    started: float,
    watched: Iterable[str],
    heard: Mapping[str, float] | None,
    work_stalled_for: float,
    stall_after: float,
) -> list[str]:
    """Why the operator is stuck (empty: it is not). `heard` None: watches not observable.
    A resource never heard from counts from `started` (kopf's start-up lists come first)."""
    found: list[str] = []
    if heard is not None:
        for resource in sorted(set(watched)):
            silent = now - heard.get(resource, started)
            if silent > stall_after:
                found.append(f"the watch of {resource} has been silent for {silent:.0f} s")
    if work_stalled_for > stall_after:
        found.append(f"reconciles have waited {work_stalled_for:.0f} s without one ending")
    return found


def register(
    registry: kopf.OperatorRegistry,
    progress: Progress,
    *,
    watched: Iterable[str],
    stall_after: float = DEFAULT_STALL_AFTER,
    clock: Clock = time.monotonic,
) -> Watches | None:
    """Add the probe handler to `registry`; the `Watches` it reads (None when kopf's watches
    cannot be observed)."""
    resources = tuple(watched)
    quiet_probe_failures()
    watches = Watches(clock=clock)
    observed = kopfcost.observe_watches(watches.hear)
    started = clock()

    @kopf.on.probe(registry=registry, id=PROBE_ID)
    async def alive(**_: Any) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        asked = loop.time()
        await asyncio.sleep(0)  # back in line: how long the loop's queue is right now
        lag = loop.time() - asked
        now = clock()
        found = problems(
            now,
            started=started,
            watched=resources,
            heard=watches.heard if observed else None,
            work_stalled_for=progress.stalled_for(now),
            stall_after=stall_after,
        )
        if found:
            raise kopf.PermanentError("stuck: " + "; ".join(found))
        ages = {r: round(now - watches.heard.get(r, started), 1) for r in resources}
        return {
            "watches_heard_s_ago": ages if observed else "not observable",
            "work_pending": progress.pending,
            "loop_lag_s": round(lag, 3),
        }

    return watches if observed else None
