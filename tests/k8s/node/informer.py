"""A watch-fed cache of one resource (all namespaces), like client-go's informer: list, then
watch from the list's resourceVersion; relist after an expired watch or a broken stream.
Every change (and every relist) calls the handlers with the object's (namespace, name)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from .api import Api, ApiError, Obj

log = logging.getLogger(__name__)
Key = tuple[str, str]
Handler = Callable[[Key], None]


def key_of(obj: Obj) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta["name"]))


class Informer:
    def __init__(self, api: Api, resource: str) -> None:
        self.api = api
        self.resource = resource
        self.cache: dict[Key, Obj] = {}
        self.handlers: list[Handler] = []
        self.synced = asyncio.Event()

    def get(self, namespace: str, name: str) -> Obj | None:
        return self.cache.get((namespace, name))

    def items(self, namespace: str | None = None) -> list[Obj]:
        return [o for (ns, _), o in list(self.cache.items()) if namespace in (None, ns)]

    def _notify(self, key: Key) -> None:
        for handler in self.handlers:
            try:
                handler(key)
            except Exception:
                log.exception("informer %s: handler failed for %s", self.resource, key)

    async def run(self) -> None:
        while True:
            try:
                listed = await self.api.list(self.resource)
                fresh = {key_of(o): o for o in listed.get("items") or []}
                gone = set(self.cache) - set(fresh)
                self.cache = fresh
                self.synced.set()
                for key in [*fresh, *gone]:
                    self._notify(key)
                await self._watch(str(listed["metadata"]["resourceVersion"]))
            except asyncio.CancelledError:
                raise
            except (ApiError, aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
                log.debug("informer %s: %s; relisting", self.resource, exc)
                await asyncio.sleep(0.2)

    async def _watch(self, version: str) -> None:
        while True:
            async for event in self.api.watch(self.resource, version):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    return  # expired: relist
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "BOOKMARK":
                    continue
                key = key_of(obj)
                if kind == "DELETED":
                    self.cache.pop(key, None)
                else:
                    self.cache[key] = obj
                self._notify(key)
