"""Field ownership (``metadata.managedFields``), as the API server keeps it for server-side
apply (structured-merge-diff):

- every write records who set which fields: an apply as an ``Apply`` entry of its
  ``fieldManager`` (exactly the fields it applied), any other write (create, update, patch)
  as an ``Update`` entry of its manager (the fields it changed, taken from the others);
- an apply merges into the live object (`fieldsets.merge`) and removes the fields its manager
  applied last time and no longer does, unless another manager owns them;
- an apply that would change a field another manager owns is a 409 Conflict with the
  server's message, unless ``force=true`` (then the field changes owner);
- ``status`` is the status subresource's (entries with ``subresource: status``); the main
  resource's entries leave it out, as do ``apiVersion``, ``kind`` and the server's metadata.

An entry keeps its ``time`` while its fields stay the same, so a write that changes nothing
changes nothing (no new resourceVersion).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Final

import kmock

from . import fieldsets as fs
from .errors import api_error

JSON = dict[str, Any]
_SERVER_META: Final = (
    "name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
    "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "selfLink",
)  # fmt: skip


@dataclass
class Entry:
    manager: str
    operation: str  # Apply or Update
    api_version: str
    time: str
    subresource: str | None
    fields: dict[fs.Path, bool] = field(default_factory=dict)

    def same_slot(self, manager: str, operation: str, subresource: str | None) -> bool:
        return (self.manager, self.operation, self.subresource) == (
            manager,
            operation,
            subresource,
        )

    def as_json(self) -> JSON:
        out: JSON = {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
            "time": self.time,
            "fieldsType": "FieldsV1",
            "fieldsV1": fs.to_fields_v1(self.fields),
        }
        if self.subresource:
            out["subresource"] = self.subresource
        return out


def entries(obj: JSON | None) -> list[Entry]:
    found: list[Entry] = []
    for raw in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        if not isinstance(raw, dict) or not raw.get("manager"):
            continue
        found.append(
            Entry(
                manager=str(raw["manager"]),
                operation=str(raw.get("operation", "Update")),
                api_version=str(raw.get("apiVersion", "")),
                time=str(raw.get("time", "")),
                subresource=raw.get("subresource"),
                fields=fs.from_fields_v1(raw.get("fieldsV1") or {}),
            )
        )
    return found


def _store(obj: JSON, found: list[Entry]) -> None:
    kept = [e.as_json() for e in found if e.fields]
    meta = obj.setdefault("metadata", {})
    if kept:
        meta["managedFields"] = kept
    else:
        meta.pop("managedFields", None)


def tracked(obj: JSON, subresource: str | None, *, has_status: bool) -> JSON:
    """The part of ``obj`` whose fields have owners for this (sub)resource."""
    if subresource == "status":
        return {"status": copy.deepcopy(obj["status"])} if "status" in obj else {}
    view = {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("apiVersion", "kind")}
    if has_status:
        view.pop("status", None)
    meta = {k: v for k, v in (view.get("metadata") or {}).items() if k not in _SERVER_META}
    if meta:
        view["metadata"] = meta
    else:
        view.pop("metadata", None)
    return view


def _conflict_error(conflicts: list[tuple[Entry, fs.Path]]) -> kmock.KubernetesError:
    def who(entry: Entry) -> str:
        if entry.operation == "Update":
            return f'"{entry.manager}" using {entry.api_version} at {entry.time}'
        return f'"{entry.manager}"'

    if len(conflicts) == 1:
        entry, path = conflicts[0]
        message = f"Apply failed with 1 conflict: conflict with {who(entry)}: {fs.text(path)}"
    else:
        lines: list[str] = []
        for manager in sorted({who(e) for e, _ in conflicts}):
            lines.append(f"conflicts with {manager}:")
            lines += [f"- {fs.text(p)}" for e, p in conflicts if who(e) == manager]
        message = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
    causes = [
        {
            "reason": "FieldManagerConflict",
            "message": f"conflict with {who(e)}",
            "field": fs.text(p),
        }
        for e, p in conflicts
    ]
    return api_error(409, "Conflict", message, causes=causes)


def apply(
    live: JSON | None,
    patch: JSON,
    *,
    manager: str,
    force: bool,
    shape: fs.Shape,
    api_version: str,
    subresource: str | None,
    has_status: bool,
    now: str,
) -> JSON:
    """The object after ``manager`` applies ``patch`` over ``live`` (None: it creates), with
    its managedFields; 409 on conflicts unless ``force``."""
    base = copy.deepcopy(live) if live is not None else {}
    patch_view = tracked(patch, subresource, has_status=has_status)
    live_view = tracked(base, subresource, has_status=has_status)
    applied = fs.field_set(patch_view, shape)
    found = entries(live)
    conflicts: list[tuple[Entry, fs.Path]] = []
    for entry in found:
        if entry.subresource != subresource or entry.same_slot(manager, "Apply", subresource):
            continue
        for path, leaf in applied.items():
            if not leaf or not entry.fields.get(path, False):
                continue
            present, current = fs.lookup(live_view, path, shape)
            wanted = fs.lookup(patch_view, path, shape)[1]
            if present and current != wanted:
                conflicts.append((entry, path))
    if conflicts and not force:
        raise _conflict_error(conflicts)
    for entry, path in conflicts:
        entry.fields.pop(path, None)
    mine = next((e for e in found if e.same_slot(manager, "Apply", subresource)), None)
    merged_view = fs.merge(live_view, patch_view, shape)
    others: set[fs.Path] = set()
    for entry in found:
        if entry is not mine and entry.subresource == subresource:
            others.update(entry.fields)
    removed: list[fs.Path] = []
    for path in sorted(set(mine.fields if mine else {}) - set(applied), key=len):
        if any(path[: len(done)] == done for done in removed):
            continue  # gone with its parent
        if any(other[: len(path)] == path for other in others):
            continue  # another manager still owns it (or a field below it)
        fs.remove(merged_view, path, shape)
        removed.append(path)
    result = _recombine(base, patch, merged_view, subresource, has_status=has_status)
    if mine is None:
        mine = Entry(manager, "Apply", api_version, now, subresource)
        found.append(mine)
    if mine.fields != applied or mine.api_version != api_version:
        mine.fields, mine.time, mine.api_version = applied, now, api_version
    _store(result, found)
    return result


def _recombine(
    base: JSON, patch: JSON, view: JSON, subresource: str | None, *, has_status: bool
) -> JSON:
    """The whole object from its tracked part ``view`` and the untracked rest of ``base``."""
    if subresource == "status":
        result = copy.deepcopy(base)
        if "status" in view:
            result["status"] = view["status"]
        else:
            result.pop("status", None)
        return result
    result = {k: v for k, v in view.items() if k != "metadata"}
    for key in ("apiVersion", "kind"):
        if key in patch or key in base:
            result[key] = patch.get(key, base.get(key))
    if has_status and "status" in base:
        result["status"] = copy.deepcopy(base["status"])
    meta = {k: v for k, v in (base.get("metadata") or {}).items() if k in _SERVER_META}
    for key in ("name", "namespace"):
        if key in (patch.get("metadata") or {}) and key not in meta:
            meta[key] = patch["metadata"][key]
    meta.update(view.get("metadata") or {})
    result["metadata"] = meta
    return result


def record_update(
    old: JSON | None,
    new: JSON,
    *,
    manager: str,
    shape: fs.Shape,
    api_version: str,
    subresource: str | None,
    has_status: bool,
    now: str,
) -> None:
    """Sets ``new``'s managedFields after a write that is not an apply (in place): the fields
    it changed become ``manager``'s (an Update entry), taken from the others; fields it
    removed leave every entry."""
    found = entries(old)
    old_view = tracked(old, subresource, has_status=has_status) if old else {}
    new_view = tracked(new, subresource, has_status=has_status)
    old_set, new_set = fs.field_set(old_view, shape), fs.field_set(new_view, shape)
    changed: dict[fs.Path, bool] = {}
    for path, leaf in new_set.items():
        moved = leaf and fs.lookup(old_view, path, shape)[1] != fs.lookup(new_view, path, shape)[1]
        if path not in old_set or moved:
            changed[path] = leaf
    for entry in found:
        if entry.subresource != subresource:
            continue
        kept = {p: leaf for p, leaf in entry.fields.items() if p in new_set and not changed.get(p)}
        if kept != entry.fields:
            entry.fields = kept
    if changed:
        mine = next((e for e in found if e.same_slot(manager, "Update", subresource)), None)
        if mine is None:
            mine = Entry(manager, "Update", api_version, now, subresource)
            found.append(mine)
        for path in changed:  # the parents of what it set are its too
            for n in range(1, len(path)):
                mine.fields.setdefault(path[:n], False)
        mine.fields.update(changed)
        mine.time, mine.api_version = now, api_version
    _store(new, found)


@dataclass
class Writer:
    """Who writes and how: ``manager`` (``fieldManager``, else the client's User-Agent),
    ``validation`` (``fieldValidation``), ``force``; ``warnings`` collects what the answer's
    ``Warning`` headers say."""

    manager: str = "tests"
    validation: str = "Warn"
    force: bool = False
    warnings: list[str] = field(default_factory=list)
