"""The Kubernetes API client: one `aiohttp` session straight to the REST API.

`aiohttp` in kopf's own event loop, with the credentials kopf logged in with
(`kopf.ConnectionInfo`: its SSL context and auth headers). Every request is plain JSON and
server-side apply needs only a content type, so a generated client adds nothing but model
(de)serialization we do not want (the planner produces dicts); and the sync `kubernetes`
client would run each call in a worker thread (six on two cores), a bottleneck when a hundred
pipelines reconcile at once. Every request has a timeout; retryable answers (429, 5xx, none)
are retried with jittered backoff. What is applied, pruned or written is `reconcile.apply`'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote, unquote, urlsplit

import aiohttp
import kopf

from disagg_operator import names

JSON = dict[str, Any]
FIELD_MANAGER: Final = names.MANAGER
DEFAULT_TIMEOUT: Final = 30.0  # seconds per request
CONNECTION_LIMIT: Final = 64  # concurrent connections to the API server
LIST_PAGE: Final = 500
APPLY_CONTENT_TYPE: Final = "application/apply-patch+yaml"  # JSON is YAML
MERGE_CONTENT_TYPE: Final = "application/merge-patch+json"
ATTEMPTS: Final = 5  # tries per request while the answer is retryable (429, 5xx, none)
BACKOFF: Final = 0.25  # seconds before the second try; doubles, capped, fully jittered
BACKOFF_CAP: Final = 8.0
Record = Callable[[str, str, str], None]  # (verb, resource, outcome) of one request sent

log = logging.getLogger(__name__)
PLURALS: Final[Mapping[str, str]] = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "StatefulSet": "statefulsets",
    "Deployment": "deployments",
    "ResourceClaimTemplate": "resourceclaimtemplates",
    "NetworkPolicy": "networkpolicies",
    "Secret": "secrets",
    "Pod": "pods",
    "PodMonitor": "podmonitors",
    names.PIPELINE_KIND: names.PLURAL,
}


class ApiError(Exception):
    """A failed request: `status` is the HTTP status (0: no response), `reason` the Status
    reason (NotFound, Conflict, ...)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    retry_after: float | None = None  # seconds the server asked for (429)

    @property
    def retryable(self) -> bool:
        """Worth retrying soon: no response, a conflict, throttling, a server error."""
        return self.status in (0, 409, 429) or self.status >= 500

    @property
    def transient(self) -> bool:
        """Worth sending the same request again at once (after a backoff): no response,
        throttling, a server error. (A conflict needs fresh reads first.)"""
        return self.status in (0, 429) or self.status >= 500


@dataclass(frozen=True, order=True)
class ObjectRef:
    api_version: str
    kind: str
    namespace: str
    name: str

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> ObjectRef:
        meta = obj["metadata"]
        return cls(obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])

    def path(self, subresource: str | None = None) -> str:
        path = collection_path(self.api_version, self.kind, self.namespace)
        path += "/" + quote(self.name, safe="")
        return path + (f"/{subresource}" if subresource else "")

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    """`/api/v1/namespaces/NS/configmaps`, `/apis/apps/v1/namespaces/NS/statefulsets`, ..."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{base}/namespaces/{quote(namespace, safe='')}/{PLURALS[kind]}"


class Api:
    """A small async client for the API server behind `connection` (see the module docstring).

    `use()` swaps the credentials (kopf calls its login handlers again after a 401); the
    session is rebuilt before the next request. Create and use it inside one event loop.
    """

    def __init__(
        self,
        connection: kopf.ConnectionInfo | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        record: Record | None = None,
        attempts: int = ATTEMPTS,
        user_agent: str = FIELD_MANAGER,
    ) -> None:
        self._connection = connection
        self._user_agent = user_agent
        self.record = record
        self.attempts = max(1, attempts)
        # per read and per connect, not in all: waiting for a free pooled connection (a
        # thousand pipelines reconciling at once) is not the server being slow
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._session_of: kopf.ConnectionInfo | None = None

    def use(self, connection: kopf.ConnectionInfo) -> None:
        self._connection = connection

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _current(self) -> tuple[aiohttp.ClientSession, str]:
        info = self._connection
        if info is None:
            raise ApiError(0, "NotLoggedIn", "no credentials yet (kopf has not logged in)")
        if self._session is None or self._session_of is not info:
            await self.close()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=CONNECTION_LIMIT, ssl=info.as_ssl_context()),
                headers={"User-Agent": self._user_agent, **info.as_http_headers()},
                proxy=info.proxy_url,
                trust_env=info.trust_env,
                timeout=self._timeout,
            )
            self._session_of = info
        return self._session, info.server.rstrip("/")

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> JSON:
        """One request, sent again while the answer is transient (`ApiError.transient`), up
        to `attempts` times, with exponential backoff and full jitter (or the server's
        Retry-After). Every request is idempotent here: GETs, applies, merge patches and
        deletes with a uid precondition; a repeated delete answers 404, read as gone."""
        for attempt in range(1, self.attempts + 1):
            try:
                return await self._send(method, path, params, body, content_type)
            except ApiError as error:
                if not error.transient or attempt == self.attempts:
                    raise
                ceiling = min(BACKOFF_CAP, BACKOFF * 2 ** (attempt - 1))
                delay = max(error.retry_after or 0.0, random.uniform(0, ceiling))
                log.debug("%s %s: %s; try %d in %.2f s", method, path, error, attempt + 1, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _send(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        body: Any,
        content_type: str,
    ) -> JSON:
        session, server = await self._current()
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        try:
            async with session.request(
                method, server + path, params=params, data=data, headers=headers
            ) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            self._record(method, path, params, "error")
            raise ApiError(0, type(error).__name__, f"{method} {path}: {error}") from error
        self._record(method, path, params, str(status))
        parsed = _parse(text)
        if status >= 400:
            reason = str(parsed.get("reason") or response.reason or "Error")
            message = str(parsed.get("message") or text[:500])
            failed = ApiError(status, reason, f"{method} {path}: {message}")
            failed.retry_after = _retry_after(response.headers.get("Retry-After"), parsed)
            raise failed
        return parsed

    def _record(
        self, method: str, path: str, params: Mapping[str, str] | None, outcome: str
    ) -> None:
        if self.record is not None:
            verb, resource = request_kind(method, path, params)
            self.record(verb, resource, outcome)

    async def text(self, path: str) -> str:
        """A GET of a non-JSON path (e.g. /metrics), once: its body."""
        session, server = await self._current()
        try:
            async with session.get(server + path) as response:
                body, status = await response.text(), response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            raise ApiError(0, type(error).__name__, f"GET {path}: {error}") from error
        if status >= 400:
            raise ApiError(status, "Error", f"GET {path}: {body[:200]}")
        return body

    async def get(self, ref: ObjectRef) -> JSON | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", ref.path())
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str
    ) -> list[JSON]:
        """Objects of a kind in a namespace; [] when the API does not serve the kind."""
        path = collection_path(api_version, kind, namespace)
        params = {"labelSelector": label_selector, "limit": str(LIST_PAGE)}
        items: list[JSON] = []
        while True:
            try:
                page = await self.request("GET", path, params=params)
            except ApiError as error:
                if error.status == 404:  # e.g. resource.k8s.io/v1 on a cluster without DRA
                    return []
                raise
            for item in page.get("items") or []:
                items.append({"apiVersion": api_version, "kind": kind, **item})
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            params = {**params, "continue": str(token)}

    async def apply(self, obj: Mapping[str, Any]) -> JSON:
        """Server-side apply of `obj` (created when absent); returns the stored object."""
        params = {"fieldManager": FIELD_MANAGER, "force": "true"}
        ref = ObjectRef.of(obj)
        return await self.request(
            "PATCH", ref.path(), params=params, body=obj, content_type=APPLY_CONTENT_TYPE
        )

    async def create(self, obj: Mapping[str, Any]) -> JSON:
        """POST `obj` to its collection; ApiError 409 (AlreadyExists) when the name is taken."""
        ref = ObjectRef.of(obj)
        path = collection_path(ref.api_version, ref.kind, ref.namespace)
        return await self.request("POST", path, body=obj)

    async def serves(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves `plural` in `api_version` (its discovery document,
        which every authenticated client may read: no RBAC); False when the group is absent."""
        try:
            found = await self.request("GET", f"/apis/{api_version}")
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in found.get("resources") or [])

    async def delete(self, ref: ObjectRef, *, uid: str | None = None) -> bool:
        """Delete (background propagation); False when it was already gone."""
        body: JSON = {"apiVersion": "v1", "kind": "DeleteOptions"}
        body["propagationPolicy"] = "Background"
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", ref.path(), body=body)
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def patch_status(self, ref: ObjectRef, status: Mapping[str, Any], *, uid: str) -> JSON:
        """Merge `status` into the object's status subresource (uid as precondition)."""
        body = {"metadata": {"uid": uid}, "status": dict(status)}
        return await self.request(
            "PATCH", ref.path("status"), body=body, content_type=MERGE_CONTENT_TYPE
        )


def request_kind(method: str, url: str, params: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The Kubernetes verb and resource of a request, as RBAC names them: ("list",
    "statefulsets"), ("patch", "disaggregatedpipelines/status"), ("get", "/version")."""
    split = urlsplit(url)
    query = dict(params or {})
    for pair in split.query.split("&") if split.query else ():
        key, _, value = pair.partition("=")
        query[unquote(key)] = unquote(value)
    parts = [unquote(p) for p in split.path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        rest = parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        rest = parts[3:]
    else:
        return method.lower(), split.path or "/"
    if rest[:1] == ["watch"]:
        rest, query["watch"] = rest[1:], "true"
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    resource = rest[0] if rest else ""
    named = len(rest) >= 2
    if len(rest) >= 3:
        resource += "/" + "/".join(rest[2:])
    verb = {
        "GET": "watch" if query.get("watch") in ("true", "1") else "get" if named else "list",
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if named else "deletecollection",
    }.get(method.upper(), method.lower())
    return verb, resource


def _retry_after(header: str | None, status: Mapping[str, Any]) -> float | None:
    """Seconds a 429 asks to wait: the Retry-After header, else the Status details."""
    value = header or (status.get("details") or {}).get("retryAfterSeconds")
    try:
        return None if value is None else max(0.0, float(value))
    except (TypeError, ValueError):
        return None


def _parse(text: str) -> JSON:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
