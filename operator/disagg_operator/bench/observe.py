"""Observing through watches: when each child was first seen and when each pipeline's status
caught up with its spec. A list, then a watch from the list's resourceVersion (again after a
410 Gone), so the bench puts no polling load on the API server or the operator; "seen" is
when the watch event reaches the bench."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

import aiohttp
import kopf

from disagg_operator import names
from disagg_operator.bench.config import RETRY, BenchError, WaitTimeout
from disagg_operator.bench.workload import LABEL_RUN, Json, Key
from disagg_operator.k8s import client as kube

Handler = Callable[[str, Json, float], None]  # (event type, object, when seen)
WATCH_SECONDS: Final = 300  # the server ends a watch after this; the bench resumes it
LIST_TRIES: Final = 10  # a list that fails (a slow or throttling server) is tried again
CHECK_EVERY: Final = 0.02  # seconds between checks of what the bench waits for


class Observer:
    """Watches the pipelines of one run and the children in one namespace; records when
    each child was first seen and when each pipeline's status caught up with its spec."""

    def __init__(self, connection: kopf.ConnectionInfo, namespace: str, run: str) -> None:
        self.connection = connection
        self.namespace = namespace
        self.run = run
        self.children: dict[Key, float] = {}  # first seen (monotonic), while present
        self.owners: dict[Key, str] = {}  # the child's disagg.dev/pipeline label
        self.pipelines: set[str] = set()
        self.reconciled: dict[str, float] = {}  # status.observedGeneration >= generation
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self.failure: BaseException | None = None

    async def start(self, kinds: Sequence[tuple[str, str]], timeout: float) -> None:
        """Start the watches; returns once each has listed what exists."""
        info = self.connection
        self._session = session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers={"User-Agent": "disagg-bench", **info.as_http_headers()},
            proxy=info.proxy_url,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            read_bufsize=1 << 22,
        )
        pipelines = kube.collection_path(
            names.PIPELINE_API_VERSION, names.PIPELINE_KIND, self.namespace
        )
        streams: list[tuple[str, str, Handler]] = [
            (pipelines, f"{LABEL_RUN}={self.run}", self._pipeline_event)
        ]
        for version, kind in kinds:
            path = kube.collection_path(version, kind, self.namespace)
            streams.append((path, names.LABEL_PIPELINE, self._child_event(kind)))
        listed = [asyncio.Event() for _ in streams]
        for (path, selector, handle), ready in zip(streams, listed, strict=True):
            task = asyncio.create_task(self._follow(session, path, selector, handle, ready))
            self._tasks.append(task)
        await self.until(lambda: all(r.is_set() for r in listed), timeout, "the watches to start")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def until(
        self,
        predicate: Callable[[], bool],
        timeout: float,
        what: str,
        *,
        progress: Callable[[], None] | None = None,
        every: float = 5.0,
    ) -> None:
        """Until `predicate` holds (checked after watch events, at most every CHECK_EVERY
        seconds: the times recorded are the events', not the checks'); `progress` is called
        every `every` seconds meanwhile."""
        deadline = time.monotonic() + timeout
        next_progress = time.monotonic() + every
        while not predicate():
            if self.failure is not None:
                raise BenchError(f"watching failed: {self.failure}") from self.failure
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}")
            if progress is not None and now >= next_progress:
                progress()
                next_progress = now + every
            await asyncio.sleep(CHECK_EVERY)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))

    def done_at(self, name: str, expected: Iterable[Key]) -> float | None:
        """When `name` was complete: every child seen and its status caught up."""
        children = self.children_at(expected)
        status = self.reconciled.get(name)
        return None if children is None or status is None else max(children, status)

    def children_at(self, expected: Iterable[Key]) -> float | None:
        """When the last of `expected` was first seen (None: one is missing)."""
        seen = [self.children.get(key) for key in expected]
        return None if None in seen else max(s for s in seen if s is not None)

    def left_of(self, pipelines: Iterable[str]) -> tuple[int, int]:
        """(pipelines, children) of these pipelines that still exist."""
        wanted = set(pipelines)
        kids = sum(1 for owner in self.owners.values() if owner in wanted)
        return len(self.pipelines & wanted), kids

    # ------------------------------------------------------------------ streams

    def _pipeline_event(self, type_: str, obj: Json, now: float) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name"))
        if type_ == "DELETED":
            self.pipelines.discard(name)
            self.reconciled.pop(name, None)
            return
        self.pipelines.add(name)
        observed = (obj.get("status") or {}).get("observedGeneration")
        generation = meta.get("generation")
        if observed is not None and generation is not None and observed >= generation:
            self.reconciled.setdefault(name, now)

    def _child_event(self, kind: str) -> Handler:
        def handle(type_: str, obj: Json, now: float) -> None:
            meta = obj.get("metadata") or {}
            key = (kind, str(meta.get("name")))
            if type_ == "DELETED":
                self.children.pop(key, None)
                self.owners.pop(key, None)
                return
            self.children.setdefault(key, now)
            self.owners[key] = str((meta.get("labels") or {}).get(names.LABEL_PIPELINE))

        return handle

    async def _follow(
        self,
        session: aiohttp.ClientSession,
        path: str,
        selector: str,
        handle: Handler,
        listed: asyncio.Event,
    ) -> None:
        """List, then watch from the list's resourceVersion; again after a 410 Gone."""
        server = self.connection.server.rstrip("/")
        version: str | None = None
        try:
            while True:
                if version is None:
                    page = await _get_json(session, server + path, {"labelSelector": selector})
                    now = time.monotonic()
                    for item in page.get("items") or []:
                        handle("ADDED", item, now)
                    version = str((page.get("metadata") or {}).get("resourceVersion") or "")
                    listed.set()
                    self._bump()
                version = await self._watch(session, server + path, selector, version, handle)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self.failure = error
            self._bump()

    async def _watch(
        self,
        session: aiohttp.ClientSession,
        url: str,
        selector: str,
        version: str,
        handle: Handler,
    ) -> str | None:
        """One watch request; returns where to resume (None: list again)."""
        params = {
            "watch": "true",
            "labelSelector": selector,
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        try:
            async with session.get(url, params=params) as response:
                if response.status == 410:
                    return None
                if response.status >= 400:
                    text = await response.text()
                    raise BenchError(f"watch {url}: {response.status} {text[:300]}")
                async for line in response.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    type_, obj = event.get("type"), event.get("object") or {}
                    if type_ == "ERROR":
                        if obj.get("code") == 410:
                            return None
                        raise BenchError(f"watch {url}: {obj.get('message')}")
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if type_ != "BOOKMARK":
                        handle(str(type_), obj, time.monotonic())
                        self._bump()
        except (aiohttp.ClientError, TimeoutError):
            await asyncio.sleep(RETRY)  # the stream broke: resume where it was
        return version

    def _bump(self) -> None:
        self._changed.set()


async def _get_json(session: aiohttp.ClientSession, url: str, params: Mapping[str, str]) -> Json:
    """A GET, tried again on throttling, server errors and broken connections."""
    for attempt in range(1, LIST_TRIES + 1):
        try:
            async with session.get(url, params=params) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            if attempt == LIST_TRIES:
                raise BenchError(f"GET {url}: {error}") from error
            await asyncio.sleep(RETRY * attempt)
            continue
        if (status == 429 or status >= 500) and attempt < LIST_TRIES:
            await asyncio.sleep(RETRY * attempt)
            continue
        if status >= 400:
            raise BenchError(f"GET {url}: {status} {text[:300]}")
        return dict(json.loads(text))
    raise AssertionError("unreachable")  # pragma: no cover
