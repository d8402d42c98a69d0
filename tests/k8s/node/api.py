"""The node's API client: HTTP or HTTPS (a CA to trust and a bearer token, when the emulator
serves TLS and authenticates) to the API server (the emulator), as a kubelet or a
controller manager talks to it: list + watch, create, merge/strategic patches, the status
subresource, delete. Bodies stay plain dicts."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

import aiohttp

Obj = dict[str, Any]
# resource -> API path prefix (group/version)
PATHS: Final[dict[str, str]] = {
    "pods": "/api/v1",
    "services": "/api/v1",
    "endpoints": "/api/v1",
    "configmaps": "/api/v1",
    "secrets": "/api/v1",
    "serviceaccounts": "/api/v1",
    "statefulsets": "/apis/apps/v1",
    "deployments": "/apis/apps/v1",
    "endpointslices": "/apis/discovery.k8s.io/v1",
}
KINDS: Final[dict[str, tuple[str, str]]] = {
    "pods": ("v1", "Pod"),
    "endpoints": ("v1", "Endpoints"),
    "endpointslices": ("discovery.k8s.io/v1", "EndpointSlice"),
}


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def path(resource: str, namespace: str | None = None, name: str | None = None) -> str:
    out = PATHS[resource]
    if namespace:
        out += f"/namespaces/{namespace}"
    out += f"/{resource}"
    return f"{out}/{name}" if name else out


class Api:
    def __init__(self, url: str, *, ca_pem: bytes | None = None, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self._ca = ca_pem
        self._headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            context = ssl.create_default_context(cadata=self._ca.decode()) if self._ca else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=context) if context else None,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=None),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(
        self,
        method: str,
        url_path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Obj:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self.session.request(
            method,
            self.url + url_path,
            data=data,
            headers=headers,
            params=params,
            timeout=aiohttp.ClientTimeout(total=15),
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ApiError(resp.status, text[:300])
            return dict(json.loads(text)) if text else {}

    async def get(self, resource: str, namespace: str, name: str) -> Obj | None:
        try:
            return await self._call("GET", path(resource, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, resource: str, selector: str = "") -> Obj:
        params = {"labelSelector": selector} if selector else None
        return await self._call("GET", path(resource), params=params)

    async def watch(self, resource: str, resource_version: str) -> AsyncIterator[Obj]:
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "300",
        }
        async with self.session.get(
            self.url + path(resource),
            params=params,
            timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
        ) as resp:
            if resp.status >= 400:
                raise ApiError(resp.status, (await resp.text())[:300])
            async for line in resp.content:
                if line.strip():
                    yield dict(json.loads(line))

    async def create(self, resource: str, namespace: str, body: Obj) -> Obj:
        return await self._call("POST", path(resource, namespace), body)

    async def patch(
        self, resource: str, namespace: str, name: str, body: Obj, *, strategic: bool = False
    ) -> Obj:
        ctype = (
            "application/strategic-merge-patch+json"
            if strategic
            else "application/merge-patch+json"
        )
        return await self._call("PATCH", path(resource, namespace, name), body, content_type=ctype)

    async def patch_status(self, resource: str, namespace: str, name: str, status: Obj) -> Obj:
        return await self._call(
            "PATCH",
            path(resource, namespace, name) + "/status",
            {"status": status},
            content_type="application/merge-patch+json",
        )

    async def apply(self, resource: str, namespace: str, name: str, body: Obj) -> Obj:
        """Server-side apply (creates the object when absent)."""
        return await self._call(
            "PATCH",
            path(resource, namespace, name),
            body,
            content_type="application/apply-patch+yaml",
            params={"fieldManager": "disagg-test-node", "force": "true"},
        )

    async def replace(self, resource: str, namespace: str, name: str, body: Obj) -> Obj:
        return await self._call("PUT", path(resource, namespace, name), body)

    async def delete(self, resource: str, namespace: str, name: str) -> None:
        try:
            await self._call("DELETE", path(resource, namespace, name))
        except ApiError as e:
            if e.status != 404:
                raise
