"""Counting kopf's own API requests (its watches, progress annotations, Events, peering), and
hearing its watches.

kopf sends every request through one function, `kopf._cogs.clients.api.request` (with its
own retries inside), and reads every watch through `api.stream`; it offers no hook, so
`_install` wraps both once per process. `observe` reports each request's outcome (the final
one, after kopf's retries) to every recorder registered; `observe_watches` tells its
listeners the resource (plural) of every watch answered and of every event or BOOKMARK a
watch delivers (for `liveness`). A private kopf module: when it is not there (another kopf
version), kopf's requests are simply not counted, its watches not heard, and both functions
say so by returning False.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from disagg_operator.k8s import client as kube

Record = Callable[[str, str, str], None]
log = logging.getLogger(__name__)
_recorders: list[Record] = []
_listeners: list[Callable[[str], None]] = []


def observe(record: Record) -> bool:
    """Report kopf's requests to `record` (verb, resource, outcome); whether it can."""
    if not _install():
        return False
    _recorders.append(record)
    return True


def forget(record: Record) -> None:
    if record in _recorders:
        _recorders.remove(record)


def observe_watches(listener: Callable[[str], None]) -> bool:
    """Tell `listener` the resource of every watch answered and every event received."""
    if not _install():
        return False
    _listeners.append(listener)
    return True


def forget_watches(listener: Callable[[str], None]) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def _install() -> bool:
    try:
        from kopf._cogs.clients import api
    except ImportError:  # pragma: no cover - another kopf layout
        return False
    original = getattr(api, "request", None)
    original_stream = getattr(api, "stream", None)
    if original is None or original_stream is None:  # pragma: no cover
        return False
    if getattr(original, "_disagg_counted", False):
        return True

    @functools.wraps(original)
    async def counted(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        try:
            response = await original(method, url, *args, **kwargs)
        except Exception as error:
            _report(method, url, str(getattr(error, "status", None) or "error"))
            raise
        _report(method, url, str(getattr(response, "status", "error")))
        return response

    @functools.wraps(original_stream)
    async def heard(url: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        resource = kube.request_kind("GET", url)[1]
        async with contextlib.aclosing(original_stream(url, *args, **kwargs)) as items:
            async for item in items:
                _hear(resource)
                yield item

    counted._disagg_counted = True  # type: ignore[attr-defined]
    api.request = counted
    api.stream = heard
    return True


def _hear(resource: str) -> None:
    for listener in list(_listeners):
        try:
            listener(resource)
        except Exception:  # pragma: no cover - a listener must never break kopf
            log.exception("hearing a kopf watch failed")


def _report(method: str, url: str, outcome: str) -> None:
    verb, resource = kube.request_kind(method, url)
    if verb == "watch" and outcome.startswith("2"):
        _hear(resource)
    for record in list(_recorders):
        try:
            record(verb, resource, outcome)
        except Exception:  # pragma: no cover - a recorder must never break kopf
            log.exception("counting a kopf request failed")
