"""The one module that talks to the Kubernetes API: reading, applying and pruning a pipeline's
children, and writing its status.

Client: `aiohttp` straight to the REST API, in kopf's own event loop, with the credentials
kopf logged in with (`kopf.ConnectionInfo`: its SSL context and auth headers). Every request
is plain JSON and server-side apply needs only a content type, so a generated client adds
nothing but model (de)serialization we do not want (the planner produces dicts); and the sync
`kubernetes` client would run each call in a worker thread (six on two cores), a bottleneck
when a hundred pipelines reconcile at once. Every request has a timeout.

Children (`apply_children`):
- writes are server-side applies (fieldManager `disagg-operator`, force): the planner's object
  is the whole intent, the API server merges it field by field and drops fields we stop
  sending, and an apply that changes nothing stores nothing (no new resourceVersion, no watch
  event, no rollout);
- before applying, each planned object's current version (from the operator's watch cache
  or one labelled list per kind, else a GET; the GETs all at once) must be ours: absent, or
  controlled by this pipeline (ownerReference uid), or an orphan labelled with this
  pipeline's name (adopted, e.g. after `disagg render | kubectl apply`). Anything else
  (another pipeline's object, or an unrelated object with the same name) is a `Conflict`:
  left alone and reported;
- the applies go kind by kind in the plan's order, the objects of one kind at once;
- children of the pipeline that the plan no longer holds (a removed role, a group dissolved)
  are deleted, but only those carrying our labels and controlled by this pipeline's uid.

Status: a merge patch of the `status` subresource, skipped when nothing would change, with the
pipeline's uid as precondition (a pipeline recreated under the same name is not written to).

Pods (`pipeline_pods`): listed, never written, for the autoscaler (`scaling_loop`).

The peer key Secret (`ensure_created`): read (from the watch cache when it has it), and
created (POST) only when absent; never patched, so a key once made stays until someone
deletes the Secret (which rotates it: the reconciler makes a new one). A create that finds
the name taken (409: a race, or a cache behind) reads the one stored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar
from urllib.parse import quote, unquote, urlsplit

import aiohttp
import kopf

from disagg_operator import cache, names, planner

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


# ---------------------------------------------------------------------------- children


@dataclass(frozen=True)
class Conflict:
    """A planned child whose name is taken by an object this pipeline does not control."""

    ref: ObjectRef
    holder: str  # who controls it, for humans

    def __str__(self) -> str:
        return f"{self.ref} exists and is not this pipeline's ({self.holder})"


@dataclass(frozen=True)
class ApplyResult:
    """What `apply_children` did. `objects`: the children as stored after applying."""

    objects: tuple[JSON, ...] = ()
    created: tuple[ObjectRef, ...] = ()
    updated: tuple[ObjectRef, ...] = ()
    unchanged: tuple[ObjectRef, ...] = ()
    pruned: tuple[ObjectRef, ...] = ()
    conflicts: tuple[Conflict, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated or self.pruned)

    def statefulsets(self) -> list[JSON]:
        """The StatefulSets and the gateway's Deployment: what the status is built from."""
        return [o for o in self.objects if o.get("kind") in ("StatefulSet", "Deployment")]


Ownership = Literal["ours", "adopt", "absent"]


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ownerReference with `controller: true`, if any."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def ownership(current: Mapping[str, Any] | None, owner: planner.Owner) -> Ownership | Conflict:
    """May `owner` apply over `current` (the stored object of a planned name)?"""
    if current is None:
        return "absent"
    controller = controller_of(current)
    if controller is not None:
        if controller.get("uid") == owner.uid:
            return "ours"
        holder = f"controlled by {controller.get('kind')}/{controller.get('name')}"
        return Conflict(ObjectRef.of(current), f"{holder}, uid {controller.get('uid')}")
    labels = (current.get("metadata") or {}).get("labels") or {}
    if labels.get(names.LABEL_PIPELINE) == owner.name:
        return "adopt"  # an orphan made for this pipeline (e.g. from `disagg render`)
    return Conflict(ObjectRef.of(current), "no controller, not labelled for this pipeline")


def _version(obj: Mapping[str, Any] | None) -> str | None:
    return None if obj is None else (obj.get("metadata") or {}).get("resourceVersion")


def _changed(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """Did an apply change the object? A cached entry (`cache.slim`) carries the digest of
    its content (it may be older than the server's version, e.g. a status update not seen
    yet); a listed object is compared by resourceVersion."""
    if "digest" in before:
        return bool(before["digest"] != cache.digest(after))
    return _version(after) != _version(before)


def prunable(obj: Mapping[str, Any], owner: planner.Owner) -> bool:
    """A child this pipeline made: our labels and controlled by the pipeline's uid."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    controller = controller_of(obj) or {}
    return (
        labels.get(names.LABEL_MANAGED_BY) == names.MANAGER
        and labels.get(names.LABEL_PIPELINE) == owner.name
        and controller.get("uid") == owner.uid
    )


async def list_children(
    api: Api, kinds: Iterable[tuple[str, str]], *, namespace: str, pipeline: str
) -> dict[ObjectRef, JSON]:
    """Every object of `kinds` labelled with the pipeline's name, by reference."""
    selector = f"{names.LABEL_PIPELINE}={pipeline}"
    lists = await asyncio.gather(
        *(api.list(version, kind, namespace, selector) for version, kind in kinds)
    )
    return {ObjectRef.of(obj): obj for items in lists for obj in items}


async def apply_children(
    api: Api,
    planned: Sequence[Mapping[str, Any]],
    *,
    owner: planner.Owner,
    namespace: str,
    kinds: Iterable[tuple[str, str]],
    existing: Mapping[ObjectRef, JSON] | None = None,
) -> ApplyResult:
    """Apply the plan (kind by kind in its order, the objects of a kind at once), then prune
    what it no longer holds (see the module docstring). Idempotent: with nothing changed,
    every apply is a no-op. `existing`: the pipeline's labelled children as cached
    (`cache`), else they are listed; a planned child not among them is read with a GET."""
    if existing is None:
        existing = await list_children(api, kinds, namespace=namespace, pipeline=owner.name)
    outcome: dict[str, list[Any]] = {k: [] for k in ("created", "updated", "unchanged")}
    objects: list[JSON] = []
    conflicts: list[Conflict] = []
    refs = [ObjectRef.of(desired) for desired in planned]
    unknown = [ref for ref in refs if ref not in existing]
    fetched = await all_of([api.get(ref) for ref in unknown])
    current_of: dict[ObjectRef, JSON | None] = {r: existing[r] for r in refs if r in existing}
    current_of.update(zip(unknown, fetched, strict=True))
    allowed = []
    for desired, ref in zip(planned, refs, strict=True):
        verdict = ownership(current_of[ref], owner)
        if isinstance(verdict, Conflict):
            conflicts.append(verdict)
        else:
            allowed.append((desired, ref))
    for wave in _waves(allowed):
        stored_wave = await all_of([api.apply(desired) for desired, _ in wave])
        for (_, ref), stored in zip(wave, stored_wave, strict=True):
            current = current_of[ref]
            objects.append(stored)
            if current is None:
                outcome["created"].append(ref)
            elif _changed(current, stored):
                outcome["updated"].append(ref)
            else:
                outcome["unchanged"].append(ref)
    wanted = {ObjectRef.of(o) for o in planned}
    pruned: list[ObjectRef] = []
    for ref, obj in sorted(existing.items()):
        if ref in wanted or not prunable(obj, owner):
            continue
        if await api.delete(ref, uid=(obj.get("metadata") or {}).get("uid")):
            pruned.append(ref)
    return ApplyResult(
        objects=tuple(objects),
        created=tuple(outcome["created"]),
        updated=tuple(outcome["updated"]),
        unchanged=tuple(outcome["unchanged"]),
        pruned=tuple(pruned),
        conflicts=tuple(conflicts),
    )


async def ensure_created(
    api: Api, obj: Mapping[str, Any], *, likely_absent: bool = False
) -> tuple[JSON, bool]:
    """The stored object of `obj`'s name, created from `obj` when absent; and whether this
    call created it. An existing object is returned as it is, never changed.
    `likely_absent` (the watch cache has not seen it): create first and read only when
    the name is taken (409), one request instead of two for a new object."""
    ref = ObjectRef.of(obj)
    if not likely_absent:
        current = await api.get(ref)
        if current is not None:
            return current, False
    try:
        return await api.create(obj), True
    except ApiError as error:
        if error.status != 409:
            raise
    current = await api.get(ref)  # it exists (made by someone else, or not yet in the cache)
    if current is None:
        raise ApiError(409, "Conflict", f"{ref} was created and deleted while we created it")
    return current, False


T = TypeVar("T")


async def all_of(requests: Sequence[Awaitable[T]]) -> list[T]:
    """Every request's result, all in flight at once; the first failure is raised once all
    have ended (none is left running behind the caller's back)."""
    results = await asyncio.gather(*requests, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


def _waves(
    planned: Sequence[tuple[Mapping[str, Any], ObjectRef]],
) -> list[list[tuple[Mapping[str, Any], ObjectRef]]]:
    """The plan cut into runs of one kind, in order: a kind's objects are applied together,
    and a kind only after the kinds before it (the ConfigMap before the pods that mount it)."""
    waves: list[list[tuple[Mapping[str, Any], ObjectRef]]] = []
    for item in planned:
        if waves and waves[-1][0][1].kind == item[1].kind:
            waves[-1].append(item)
        else:
            waves.append([item])
    return waves


async def owned_statefulsets(api: Api, owner: planner.Owner, namespace: str) -> list[JSON]:
    """The pipeline's StatefulSets and gateway Deployment (controlled by its uid), for the
    status builder."""
    children = await list_children(
        api,
        [("apps/v1", "StatefulSet"), ("apps/v1", "Deployment")],
        namespace=namespace,
        pipeline=owner.name,
    )
    return [obj for obj in children.values() if (controller_of(obj) or {}).get("uid") == owner.uid]


async def pipeline_pods(api: Api, namespace: str, pipeline: str) -> list[JSON]:
    """The pods of the pipeline's StatefulSets (label disagg.dev/pipeline), for the
    autoscaler: their IPs, readiness and metrics ports."""
    selector = f"{names.LABEL_PIPELINE}={pipeline},{names.LABEL_ROLE}"
    return await api.list("v1", "Pod", namespace, selector)


# ---------------------------------------------------------------------------- status


def pipeline_ref(namespace: str, name: str) -> ObjectRef:
    return ObjectRef(names.PIPELINE_API_VERSION, names.PIPELINE_KIND, namespace, name)


def status_differs(current: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> bool:
    """Would merging `wanted` into `current` change anything?"""
    current = current or {}
    return any(current.get(key) != value for key, value in wanted.items())


async def get_pipeline(api: Api, namespace: str, name: str) -> JSON | None:
    return await api.get(pipeline_ref(namespace, name))


async def write_status(api: Api, pipeline: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Write `status` into the pipeline's status subresource unless it is already there.
    Returns whether a write was sent."""
    if not status_differs(pipeline.get("status"), status):
        return False
    meta = pipeline["metadata"]
    ref = pipeline_ref(meta.get("namespace", ""), meta["name"])
    try:
        await api.patch_status(ref, status, uid=meta["uid"])
    except ApiError as exc:
        if exc.status == 404:  # deleted meanwhile: nothing left to report on
            return False
        raise
    return True
