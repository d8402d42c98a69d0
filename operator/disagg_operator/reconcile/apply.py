"""Reading, applying and pruning a pipeline's children, and writing its status, through
`k8s.client.Api` (the one module that talks to the Kubernetes API).

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
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from disagg_operator import names
from disagg_operator.k8s.client import JSON, Api, ApiError, ObjectRef
from disagg_operator.plan import model
from disagg_operator.reconcile import cache

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


def ownership(current: Mapping[str, Any] | None, owner: model.Owner) -> Ownership | Conflict:
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


def prunable(obj: Mapping[str, Any], owner: model.Owner) -> bool:
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
    owner: model.Owner,
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


async def owned_statefulsets(api: Api, owner: model.Owner, namespace: str) -> list[JSON]:
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
