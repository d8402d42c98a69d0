"""What the operator knows of its pipelines, their children and their pods, from watches.

At a thousand pipelines a list per child event (each StatefulSet event listing its
pipeline's StatefulSets again) is most of the API server's load. So the operator reads from
kopf indexes instead: one watch per kind, filtered server side by the operator's labels
(`handlers.configure`), feeds an in-memory index keyed by (namespace, pipeline name). kopf
fills every index from its initial list before it runs any handler, so a reconcile never
sees a half-filled cache; a child that the cache lacks (not ours, or not seen yet) is read
with one GET before it is applied (see `apply.apply_children`).

Entries are slim (`slim`): what ownership, pruning, the status builder and the autoscaler
read. A cached kind that an apply compares against (none today: the workloads are listed
fresh before an apply, for the rollout) would also carry a digest of the object's content
(everything but its status and the fields the server keeps changing), so that "did this apply
change the object" needs no resourceVersion from a possibly older cache entry; computing it
per event costs a JSON dump of the whole object. A full StatefulSet is ~5 KiB of JSON; 3,000
of them as Python objects would be most of the operator's memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Final

from disagg_operator import names
from disagg_operator.plan import pods

JSON = dict[str, Any]
Key = tuple[str, str]  # namespace, pipeline
VOLATILE_META: Final = ("resourceVersion", "managedFields", "generation", "creationTimestamp")
POD_KIND: Final = "Pod"
# The child kinds with an index: the ones whose events matter (a StatefulSet's status moves
# with its pods, the gateway Deployment's with its own). ConfigMaps and Services change only
# when the operator writes them; a watch of each would cost CPU per event at a thousand
# pipelines, for reads that happen only when a pipeline is created or edited (a list by
# label each, as before).
WORKLOAD_KINDS: Final = frozenset({"StatefulSet", "Deployment"})
CACHED_KINDS: Final = WORKLOAD_KINDS
# The peer key Secret is watched anyway (a deleted one is made again), so it is indexed too:
# a reconcile then reads its key from the cache instead of a GET per reconcile.
SECRET_KIND: Final = "Secret"


def digest(obj: Mapping[str, Any]) -> str:
    """A hash of what the operator writes: the object without status and server-kept fields."""
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in VOLATILE_META}
    content = {k: v for k, v in obj.items() if k not in ("status", "metadata")}
    text = json.dumps([meta, content], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _slim_meta(meta: Mapping[str, Any]) -> JSON:
    kept = ("name", "namespace", "uid", "resourceVersion", "generation", "deletionTimestamp")
    result: JSON = {k: meta[k] for k in kept if meta.get(k) is not None}
    result["labels"] = dict(meta.get("labels") or {})
    result["ownerReferences"] = [
        {k: ref.get(k) for k in ("apiVersion", "kind", "name", "uid", "controller")}
        for ref in meta.get("ownerReferences") or ()
    ]
    return result


def slim(obj: Mapping[str, Any], api_version: str, kind: str, *, digested: bool = False) -> JSON:
    """The cache's entry for a child or pod (see the module docstring); `digested`: with the
    digest of its content."""
    meta = obj.get("metadata") or {}
    entry: JSON = {"apiVersion": api_version, "kind": kind, "metadata": _slim_meta(meta)}
    if kind in WORKLOAD_KINDS:  # what the status builder and the rollout read
        spec = obj.get("spec") or {}
        entry["metadata"]["annotations"] = dict(meta.get("annotations") or {})
        entry["spec"] = {"replicas": spec.get("replicas", 1)}
        if kind == "StatefulSet" and spec.get("updateStrategy") is not None:
            entry["spec"]["updateStrategy"] = spec["updateStrategy"]
        entry["status"] = dict(obj.get("status") or {})
    elif kind == SECRET_KIND:
        data = obj.get("data") or {}
        entry["data"] = {k: data[k] for k in (pods.PEER_KEY_KEY,) if k in data}
    elif kind == POD_KIND:
        containers = (obj.get("spec") or {}).get("containers") or ()
        entry["spec"] = {
            "containers": [
                {k: c.get(k) for k in ("name", "ports", "env") if c.get(k) is not None}
                for c in containers
            ]
        }
        status = obj.get("status") or {}
        entry["metadata"]["creationTimestamp"] = meta.get("creationTimestamp")
        entry["status"] = {
            # a group's restart reads the restarts (reconcile/regroup.py)
            "containerStatuses": [
                {"restartCount": c.get("restartCount") or 0}
                for c in status.get("containerStatuses") or ()
            ],
            "phase": status.get("phase"),
            "podIP": status.get("podIP"),
            "conditions": [
                {"type": c.get("type"), "status": c.get("status")}
                for c in status.get("conditions") or ()
                if c.get("type") == "Ready"
            ],
        }
    if digested:
        entry["digest"] = digest(obj)
    return entry


def pipeline_entry(body: Mapping[str, Any]) -> JSON:
    """The cache's entry for a pipeline: the whole document but its managedFields (a record
    of every writer's fields, a few KiB per pipeline on a cluster, which nothing here reads;
    `digest` ignores them too, so a cached and a fetched pipeline parse once)."""
    entry = dict(body)
    meta = entry.get("metadata") or {}
    if "managedFields" in meta:
        entry["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return entry


def index_key(obj: Mapping[str, Any]) -> Key | None:
    """(namespace, pipeline) of a labelled object, else None (not ours to index)."""
    meta = obj.get("metadata") or {}
    pipeline = (meta.get("labels") or {}).get(names.LABEL_PIPELINE)
    namespace = meta.get("namespace")
    return None if not pipeline or not namespace else (str(namespace), str(pipeline))


class Cache:
    """Read access to the operator's kopf indexes, bound on the first handler call (kopf
    creates the indexes inside `kopf.operator`). Unbound (tests without kopf), every read
    says "unknown" (None) and the callers list from the API as before."""

    def __init__(self) -> None:
        self._indexes: dict[str, Mapping[Any, Iterable[JSON]]] = {}

    def bind(self, indexes: Mapping[str, Mapping[Any, Iterable[JSON]]]) -> None:
        self._indexes = dict(indexes)

    @property
    def bound(self) -> bool:
        return bool(self._indexes)

    def _values(self, index: str, key: Any) -> list[JSON] | None:
        found = self._indexes.get(index)
        if found is None:
            return None
        return list(found[key]) if key in found else []

    def children(self, kinds: Iterable[tuple[str, str]], key: Key) -> list[JSON] | None:
        """The pipeline's children of `kinds` (None: some kind is not cached)."""
        result: list[JSON] = []
        for _, kind in kinds:
            values = self._values(index_name(kind), key)
            if values is None:
                return None
            result.extend(values)
        return result

    def secrets(self, key: Key) -> list[JSON] | None:
        """The pipeline's labelled Secrets (its peer key), None when not cached."""
        return self._values(index_name(SECRET_KIND), key)

    def pods(self, key: Key) -> list[JSON] | None:
        return self._values(index_name(POD_KIND), key)

    def pipeline(self, key: Key) -> JSON | None:
        """The pipeline as last watched (None: unknown or gone)."""
        values = self._values(PIPELINE_INDEX, key)
        return values[0] if values else None


PIPELINE_INDEX: Final = "pipelines_by_name"


def index_name(kind: str) -> str:
    """The kopf index (handler id) of a kind: `statefulsets_by_pipeline`, ..."""
    return f"{kind.lower()}s_by_pipeline"
