"""Watch fan-out: the per-resource event log and the streams that read from it.

Every write appends one event to its resource's log (bounded: a watcher further behind than
the log reaches gets ``410 Expired``) and wakes the streams waiting on it; each stream keeps a
cursor into the log, filters by its selectors and namespace, and turns selector transitions
into ADDED/DELETED. A stream first sends a snapshot (the emulator's indexed select) taken in
the same synchronous step as its starting cursor, so no event falls in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp.web
from kmock._internal import rendering

from . import semantics as sem
from .errors import _bad_request, api_error, status_body
from .resources import ResourceType

if TYPE_CHECKING:
    from .emulator import ApiCall, KubeEmulator

JSON = dict[str, Any]
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


def _meta(obj: JSON) -> JSON:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


@dataclass
class WatchEvent:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    obj: JSON  # storage form
    old: JSON | None  # the previous state, for selector transitions
    # the event's JSON line as sent, by (API version, event type): serialized once for every
    # stream that sends it, not once per stream
    lines: dict[tuple[str, str], bytes] = field(default_factory=dict)


class EventLog:
    """The per-storage event history that watches read from (bounded; 410 Gone beyond it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.events: list[WatchEvent] = []
        self.offset = 0  # absolute index of events[0]
        self.trimmed_rv = 0  # events with rv <= this were dropped
        self.changed = asyncio.Event()

    @property
    def end(self) -> int:
        return self.offset + len(self.events)

    def append(self, event: WatchEvent) -> None:
        self.events.append(event)
        if len(self.events) > self.limit:
            drop = len(self.events) // 2
            self.trimmed_rv = self.events[drop - 1].rv
            del self.events[:drop]
            self.offset += drop
        self.wake()

    def wake(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def since(self, cursor: int) -> list[WatchEvent]:
        return self.events[max(0, cursor - self.offset) :]

    def cursor_after(self, rv: int) -> int:
        for index, event in enumerate(self.events):
            if event.rv > rv:
                return self.offset + index
        return self.end


async def stream_watch(
    emu: KubeEmulator,
    request: rendering.Request,
    rt: ResourceType,
    ns: str | None,
    name: str | None,
    call: ApiCall,
) -> aiohttp.web.StreamResponse:
    params = request.params
    try:
        labels = sem.parse_label_selector(params.get("labelSelector"))
        fields = sem.parse_field_selector(params.get("fieldSelector"))
    except sem.SelectorError as e:
        raise _bad_request(str(e)) from None
    if name is not None:
        fields.append(sem.FieldRequirement("metadata.name", "=", name))
    if ns is not None:
        fields.append(sem.FieldRequirement("metadata.namespace", "=", ns))
    bookmarks = params.get("allowWatchBookmarks") == "true"
    send_initial = params.get("sendInitialEvents") == "true"
    rv_param = params.get("resourceVersion", "")
    table = emu._wants_table(request)
    timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None

    def matches(obj: JSON | None) -> bool:
        return obj is not None and sem.match_labels(labels, obj) and sem.match_fields(fields, obj)

    # Snapshot and log position in one synchronous step: no event can fall in between.
    log = emu._log(rt.storage_key)
    initial: list[tuple[str, JSON]] = []
    gone = False
    if send_initial or rv_param in ("", "0"):
        initial = [("ADDED", o) for o in emu._store.select(rt.storage_key, ns, labels, fields)]
        cursor = log.end
    else:
        try:
            since = int(rv_param)
        except ValueError:
            raise _bad_request(f"invalid resource version: {rv_param!r}") from None
        gone = since < log.trimmed_rv
        cursor = log.cursor_after(since)
    start_rv = emu._rv

    response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    assert request._raw_request is not None
    await response.prepare(request._raw_request)
    call.code = response.status
    first_table = True

    def line(event_type: str, obj: JSON) -> bytes:
        nonlocal first_table
        if event_type == "ERROR" or event_type == "BOOKMARK":
            payload = obj
        elif table:
            view = emu._view(rt, obj)
            payload = emu._table(rt, [view], rv=_meta(view)["resourceVersion"], headers=first_table)
            first_table = False
        else:
            payload = emu._view(rt, obj)
        return (json.dumps({"type": event_type, "object": payload}) + "\n").encode()

    def event_line(event_type: str, event: WatchEvent) -> bytes:
        if table:
            return line(event_type, event.obj)
        key = (rt.api_version, event_type)
        found = event.lines.get(key)
        if found is None:
            found = event.lines[key] = line(event_type, event.obj)
        return found

    async def send(event_type: str, obj: JSON) -> None:
        await response.write(line(event_type, obj))

    def bookmark(rv: int, initial_end: bool = False) -> JSON:
        meta: JSON = {"resourceVersion": str(rv)}
        if initial_end:
            meta["annotations"] = {INITIAL_EVENTS_END: "true"}
        return {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout if timeout else None
    next_bookmark = loop.time() + emu.bookmark_interval

    def expired(rv: int) -> JSON:
        message = f"too old resource version: {rv_param} ({rv})"
        return status_body(api_error(410, "Expired", message))

    try:
        if gone:
            await send("ERROR", expired(log.trimmed_rv))
        else:
            for start in range(0, len(initial), 100):  # a hundred objects per write
                await response.write(b"".join(line(t, o) for t, o in initial[start : start + 100]))
            if send_initial:
                await send("BOOKMARK", bookmark(start_rv, initial_end=True))
        while not gone and not emu._closed:
            if cursor < log.offset:  # this watcher lagged behind the log's retention
                await send("ERROR", expired(log.trimmed_rv))
                break
            pending = log.since(cursor)
            batch: list[bytes] = []  # one write for all the events pending
            for event in pending:
                cursor += 1
                new_match, old_match = matches(event.obj), matches(event.old)
                if event.type == "MODIFIED" and new_match and not old_match:
                    batch.append(event_line("ADDED", event))
                elif event.type == "MODIFIED" and old_match and not new_match:
                    batch.append(event_line("DELETED", event))
                elif new_match:
                    batch.append(event_line(event.type, event))
            if batch:
                await response.write(b"".join(batch))
            if pending:
                continue  # drain everything before a bookmark claims "up to here"
            now = loop.time()
            if deadline is not None and now >= deadline:
                break
            if bookmarks and now >= next_bookmark:
                await send("BOOKMARK", bookmark(emu._rv))
                next_bookmark = now + emu.bookmark_interval
                continue
            wait = next_bookmark - now if bookmarks else 3600.0
            if deadline is not None:
                wait = min(wait, deadline - now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(log.changed.wait(), timeout=max(wait, 0.0))
        await response.write_eof()
    except ConnectionError:
        pass
    return response
