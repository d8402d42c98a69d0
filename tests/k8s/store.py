"""The emulator's object storage: objects by resource, namespace and name, with the secondary
indexes that keep lists, watches and garbage collection from scanning everything.

At a thousand pipelines (7,000 children, 10,000 pods) a list by label that scans every object
of a kind, or a cascading delete that scans every object of every kind for its dependents,
dominates the emulator's CPU. So, per storage (a resource's group and plural):

- by namespace: a selector-free list in one namespace touches only that namespace;
- by label (key, value) and by label key: the equality (``=``, ``in``) and existence
  requirements of a label selector narrow the candidates to an intersection of index sets
  before the remaining requirements are checked;
- by owner uid (across storages): ``dependents(uid)`` is a lookup, not a scan.

Objects are stored as the emulator hands them over (storage form); the store never copies.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Any, TypeVar

from . import semantics as sem

JSON = dict[str, Any]
ObjKey = tuple[str | None, str]  # (namespace, name)
StorageKey = tuple[str, str]  # (group, plural)
Ref = tuple[StorageKey, ObjKey]
M = TypeVar("M", bound=Hashable)


def _meta(obj: JSON) -> JSON:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _okey(obj: JSON) -> ObjKey:
    meta = _meta(obj)
    return (meta.get("namespace"), str(meta["name"]))


def sort_key(okey: ObjKey) -> tuple[str, str]:
    """Lists come sorted by namespace, then name (as etcd's key order gives them)."""
    return (okey[0] or "", okey[1])


class _Kind:
    """One storage's objects and indexes."""

    def __init__(self) -> None:
        self.objects: dict[ObjKey, JSON] = {}
        self.by_namespace: dict[str | None, set[ObjKey]] = {}
        self.by_label: dict[tuple[str, str], set[ObjKey]] = {}
        self.by_label_key: dict[str, set[ObjKey]] = {}

    def add(self, okey: ObjKey, obj: JSON) -> None:
        self.objects[okey] = obj
        self.by_namespace.setdefault(okey[0], set()).add(okey)
        for key, value in (_meta(obj).get("labels") or {}).items():
            self.by_label.setdefault((key, str(value)), set()).add(okey)
            self.by_label_key.setdefault(key, set()).add(okey)

    def remove(self, okey: ObjKey) -> JSON | None:
        obj = self.objects.pop(okey, None)
        if obj is None:
            return None
        _discard(self.by_namespace, okey[0], okey)
        for key, value in (_meta(obj).get("labels") or {}).items():
            _discard(self.by_label, (key, str(value)), okey)
            _discard(self.by_label_key, key, okey)
        return obj

    def candidates(
        self, namespace: str | None, labels: Iterable[sem.Requirement]
    ) -> set[ObjKey] | None:
        """The smallest index set that holds every match (None: no index applies)."""
        sets: list[set[ObjKey]] = []
        if namespace is not None:
            sets.append(self.by_namespace.get(namespace, set()))
        for req in labels:
            if req.op == "=":
                sets.append(self.by_label.get((req.key, req.values[0]), set()))
            elif req.op == "in":
                union: set[ObjKey] = set()
                for value in req.values:
                    union |= self.by_label.get((req.key, value), set())
                sets.append(union)
            elif req.op == "exists":
                sets.append(self.by_label_key.get(req.key, set()))
        if not sets:
            return None
        sets.sort(key=len)
        result = set(sets[0])
        for other in sets[1:]:
            result &= other
            if not result:
                break
        return result


def _discard(index: dict[Any, set[M]], key: Any, okey: M) -> None:
    members = index.get(key)
    if members is not None:
        members.discard(okey)
        if not members:
            del index[key]


class ObjectStore:
    """Every stored object, indexed (see the module docstring)."""

    def __init__(self) -> None:
        self._kinds: dict[StorageKey, _Kind] = {}
        self._uids: dict[str, Ref] = {}
        self._owned: dict[str, set[Ref]] = {}  # owner uid -> its dependents

    def ensure(self, key: StorageKey) -> None:
        self._kinds.setdefault(key, _Kind())

    def keys(self) -> list[StorageKey]:
        return list(self._kinds)

    def get(self, key: StorageKey, okey: ObjKey) -> JSON | None:
        kind = self._kinds.get(key)
        return None if kind is None else kind.objects.get(okey)

    def contains(self, key: StorageKey, okey: ObjKey) -> bool:
        kind = self._kinds.get(key)
        return kind is not None and okey in kind.objects

    def objects_of(self, key: StorageKey) -> list[JSON]:
        kind = self._kinds.get(key)
        return [] if kind is None else list(kind.objects.values())

    def live_uid(self, uid: str) -> bool:
        return uid in self._uids

    def put(self, key: StorageKey, obj: JSON) -> None:
        """Store `obj` (new, or the next version of a stored object)."""
        okey = _okey(obj)
        kind = self._kinds.setdefault(key, _Kind())
        old = kind.remove(okey)
        if old is not None:
            self._unlink(key, okey, old)
        kind.add(okey, obj)
        meta = _meta(obj)
        if meta.get("uid"):
            self._uids[str(meta["uid"])] = (key, okey)
        for ref in meta.get("ownerReferences") or []:
            if ref.get("uid"):
                self._owned.setdefault(str(ref["uid"]), set()).add((key, okey))

    def drop(self, key: StorageKey, obj: JSON) -> None:
        okey = _okey(obj)
        kind = self._kinds.get(key)
        old = None if kind is None else kind.remove(okey)
        if old is not None:
            self._unlink(key, okey, old)

    def _unlink(self, key: StorageKey, okey: ObjKey, old: JSON) -> None:
        meta = _meta(old)
        if self._uids.get(str(meta.get("uid", ""))) == (key, okey):
            del self._uids[str(meta["uid"])]
        for ref in meta.get("ownerReferences") or []:
            _discard(self._owned, str(ref.get("uid", "")), (key, okey))

    def select(
        self,
        key: StorageKey,
        namespace: str | None,
        labels: list[sem.Requirement],
        fields: list[sem.FieldRequirement],
    ) -> list[JSON]:
        """The matching objects, sorted by namespace and name."""
        kind = self._kinds.get(key)
        if kind is None:
            return []
        found = kind.candidates(namespace, labels)
        okeys: Iterable[ObjKey] = kind.objects.keys() if found is None else found
        result = []
        for okey in sorted(okeys, key=sort_key):
            obj = kind.objects[okey]
            if sem.match_labels(labels, obj) and sem.match_fields(fields, obj):
                result.append(obj)
        return result

    def in_namespace(self, namespace: str) -> Iterator[tuple[StorageKey, JSON]]:
        """Every object in `namespace`, of every kind (a snapshot: safe to delete while
        iterating)."""
        for key, kind in list(self._kinds.items()):
            for okey in sorted(kind.by_namespace.get(namespace, set()), key=sort_key):
                obj = kind.objects.get(okey)
                if obj is not None:
                    yield key, obj

    def dependents(self, uid: str) -> list[tuple[StorageKey, JSON]]:
        """Objects with an ownerReference to `uid`."""
        found = []
        for key, okey in sorted(self._owned.get(uid, set()), key=lambda r: (r[0], sort_key(r[1]))):
            obj = self.get(key, okey)
            if obj is not None:
                found.append((key, obj))
        return found
