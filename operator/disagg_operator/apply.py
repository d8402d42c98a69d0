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
- before applying, each planned object's current version (from one labelled list per kind,
  else a GET) must be ours: absent, or controlled by this pipeline (ownerReference uid), or
  an orphan labelled with this pipeline's name (adopted, e.g. after `disagg render | kubectl
  apply`). Anything else (another pipeline's object, or an unrelated object with the same
  name) is a `Conflict`: left alone and reported;
- children of the pipeline that the plan no longer holds (a removed role, a group dissolved)
  are deleted, but only those carrying our labels and controlled by this pipeline's uid.

Status: a merge patch of the `status` subresource, skipped when nothing would change, with the
pipeline's uid as precondition (a pipeline recreated under the same name is not written to).

Pods (`pipeline_pods`): listed, never written, for the autoscaler (`scaling_loop`).

The peer key Secret (`ensure_created`): read, and created (POST) only when absent; never
patched, so a key once made stays until someone deletes the Secret (which rotates it: the
reconciler makes a new one). A create that loses a race (409) reads the winner's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import quote

import aiohttp
import kopf

from disagg_operator import names, planner

JSON = dict[str, Any]
FIELD_MANAGER: Final = names.MANAGER
DEFAULT_TIMEOUT: Final = 30.0  # seconds per request
CONNECTION_LIMIT: Final = 64  # concurrent connections to the API server
LIST_PAGE: Final = 500
APPLY_CONTENT_TYPE: Final = "application/apply-patch+yaml"  # JSON is YAML
MERGE_CONTENT_TYPE: Final = "application/merge-patch+json"
PLURALS: Final[Mapping[str, str]] = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "StatefulSet": "statefulsets",
    "ResourceClaimTemplate": "resourceclaimtemplates",
    "NetworkPolicy": "networkpolicies",
    "Secret": "secrets",
    "Pod": "pods",
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

    @property
    def retryable(self) -> bool:
        """Worth retrying soon: no response, a conflict, throttling, a server error."""
        return self.status in (0, 409, 429) or self.status >= 500


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
        self, connection: kopf.ConnectionInfo | None = None, *, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self._connection = connection
        self._timeout = aiohttp.ClientTimeout(total=timeout)
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
                headers={"User-Agent": FIELD_MANAGER, **info.as_http_headers()},
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
            raise ApiError(0, type(error).__name__, f"{method} {path}: {error}") from error
        parsed = _parse(text)
        if status >= 400:
            reason = str(parsed.get("reason") or response.reason or "Error")
            message = str(parsed.get("message") or text[:500])
            raise ApiError(status, reason, f"{method} {path}: {message}")
        return parsed

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
        return [o for o in self.objects if o.get("kind") == "StatefulSet"]


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
) -> ApplyResult:
    """Apply the plan (in its order), then prune what it no longer holds (see the module
    docstring). Idempotent: with nothing changed, every apply is a no-op."""
    existing = await list_children(api, kinds, namespace=namespace, pipeline=owner.name)
    outcome: dict[str, list[Any]] = {k: [] for k in ("created", "updated", "unchanged")}
    objects: list[JSON] = []
    conflicts: list[Conflict] = []
    for desired in planned:
        ref = ObjectRef.of(desired)
        current = existing.get(ref) if ref in existing else await api.get(ref)
        verdict = ownership(current, owner)
        if isinstance(verdict, Conflict):
            conflicts.append(verdict)
            continue
        stored = await api.apply(desired)
        objects.append(stored)
        if current is None:
            outcome["created"].append(ref)
        elif _version(stored) != _version(current):
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


async def ensure_created(api: Api, obj: Mapping[str, Any]) -> tuple[JSON, bool]:
    """The stored object of `obj`'s name, created from `obj` when absent; and whether this
    call created it. An existing object is returned as it is, never changed."""
    ref = ObjectRef.of(obj)
    current = await api.get(ref)
    if current is not None:
        return current, False
    try:
        return await api.create(obj), True
    except ApiError as error:
        if error.status != 409:
            raise
    current = await api.get(ref)  # someone else created it meanwhile
    if current is None:
        raise ApiError(409, "Conflict", f"{ref} was created and deleted while we created it")
    return current, False


async def owned_statefulsets(api: Api, owner: planner.Owner, namespace: str) -> list[JSON]:
    """The pipeline's StatefulSets (controlled by its uid), for the status builder."""
    children = await list_children(
        api, [("apps/v1", "StatefulSet")], namespace=namespace, pipeline=owner.name
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
