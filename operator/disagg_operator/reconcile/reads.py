"""What a reconcile or a refresh reads of the cluster: the pipeline, its children and its
peer key Secret, from the watch cache (`cache`) where kopf has bound it, else from the API.

So a reconcile costs a GET of the pipeline, one fresh list of its StatefulSets and
Deployment (a rollout must not act on a lagging cache; the apply compares against the same
list), one list per other child kind, plus one apply per child (and a GET for a child not
seen yet; a POST for a peer key Secret not seen yet), and a refresh no request at all unless
the status changed. Where the cache lags our own writes, what we wrote counts.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Final

from disagg_core.spec import Pipeline
from disagg_operator.k8s import client as kube
from disagg_operator.plan import manifests, model, pods
from disagg_operator.reconcile import apply, cache

PEER_KEY_BYTES: Final = 32
WORKLOAD_KINDS: Final = (("apps/v1", "StatefulSet"), ("apps/v1", "Deployment"))  # rollouts


async def current_pipeline(
    api: kube.Api, watched: cache.Cache, key: cache.Key, generation: int
) -> dict[str, Any] | None:
    """The pipeline from the watch cache when it is at least as new as `generation` (what
    the last reconcile read), else from the API."""
    cached = watched.pipeline(key)
    if cached is not None:
        seen = int((cached.get("metadata") or {}).get("generation") or 0)
        if seen >= generation:
            return cached
    return await apply.get_pipeline(api, *key)


async def existing_children(
    api: kube.Api, watched: cache.Cache, kinds: Sequence[tuple[str, str]], key: cache.Key
) -> dict[kube.ObjectRef, dict[str, Any]]:
    """The pipeline's labelled children: the cached kinds from the cache, the others
    listed (one request per kind)."""
    cached = [k for k in kinds if watched.children([k], key) is not None]
    listed = [k for k in kinds if k not in cached]
    found = {kube.ObjectRef.of(o): o for o in watched.children(cached, key) or []}
    if listed:
        namespace, name = key
        found.update(await apply.list_children(api, listed, namespace=namespace, pipeline=name))
    return found


async def workloads(
    api: kube.Api,
    watched: cache.Cache,
    body: Mapping[str, Any],
    applied: Mapping[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """The pipeline's StatefulSets and gateway Deployment (controlled by its uid): cached,
    else listed. One of `applied` (what the last reconcile applied, by name) that the cache
    has not seen yet, or has seen only in an older generation, counts as it was applied (the
    watch lags our own writes; a status built from it would flap to ChildMissing or report
    the old spec)."""
    owner = model.Owner.of(body)
    namespace = body["metadata"]["namespace"]
    found = watched.children(WORKLOAD_KINDS, (namespace, owner.name))
    if found is None:
        return await apply.owned_statefulsets(api, owner, namespace)
    ours = {
        o["metadata"]["name"]: o
        for o in found
        if (apply.controller_of(o) or {}).get("uid") == owner.uid
    }
    for name, mine in applied.items():
        seen = ours.get(name)
        if seen is None or _generation(seen) < _generation(mine):
            ours[name] = mine  # the cache has not caught up with our own apply
    return list(ours.values())


async def peer_key(
    api: kube.Api, watched: cache.Cache, pipeline: Pipeline, namespace: str, owner: model.Owner
) -> tuple[dict[str, Any], bool]:
    """The pipeline's peer key Secret as stored, and whether it was created now (with
    `PEER_KEY_BYTES` random bytes; one that exists is never overwritten)."""
    wanted = manifests.peer_key_secret(
        pipeline.name,
        namespace=namespace,
        key=secrets.token_hex(PEER_KEY_BYTES),
        owner=owner,
    )
    cached = watched.secrets((namespace, owner.name))
    name = wanted["metadata"]["name"]
    found = next((s for s in cached or () if s["metadata"]["name"] == name), None)
    if found is not None and peer_key_text(found):
        return found, False
    return await apply.ensure_created(api, wanted, likely_absent=cached is not None)


def peer_key_text(secret: Mapping[str, Any]) -> str:
    """The `key` of a peer key Secret as stored (base64 in `data`); "" when it has none."""
    raw = (secret.get("data") or {}).get(pods.PEER_KEY_KEY) or ""
    try:
        return base64.b64decode(str(raw), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return ""


def _generation(obj: Mapping[str, Any]) -> int:
    value = (obj.get("metadata") or {}).get("generation")
    return value if isinstance(value, int) else 0
