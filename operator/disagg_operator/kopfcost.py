"""Counting kopf's own API requests (its watches, progress annotations, Events, peering).

kopf sends every request through one function, `kopf._cogs.clients.api.request` (with its
own retries inside); it offers no hook, so `observe` wraps that function once per process
and reports each call's outcome (the final one, after kopf's retries) to every recorder
registered. A private kopf module: when it is not there (another kopf version), kopf's
requests are simply not counted and `observe` says so by returning False.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from disagg_operator import apply

Record = Callable[[str, str, str], None]
log = logging.getLogger(__name__)
_recorders: list[Record] = []


def observe(record: Record) -> bool:
    """Report kopf's requests to `record` (verb, resource, outcome); whether it can."""
    if not _install():
        return False
    _recorders.append(record)
    return True


def forget(record: Record) -> None:
    if record in _recorders:
        _recorders.remove(record)


def _install() -> bool:
    try:
        from kopf._cogs.clients import api
    except ImportError:  # pragma: no cover - another kopf layout
        return False
    original = getattr(api, "request", None)
    if original is None:  # pragma: no cover
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

    counted._disagg_counted = True  # type: ignore[attr-defined]
    api.request = counted
    return True


def _report(method: str, url: str, outcome: str) -> None:
    verb, resource = apply.request_kind(method, url)
    for record in list(_recorders):
        try:
            record(verb, resource, outcome)
        except Exception:  # pragma: no cover - a recorder must never break kopf
            log.exception("counting a kopf request failed")
