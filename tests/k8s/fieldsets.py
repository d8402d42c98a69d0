"""Field sets, as server-side apply (sigs.k8s.io/structured-merge-diff) keeps them: the paths
of an object's fields, with lists merged as their schema says (`Shape`).

A path is a tuple of elements: ``("f", "spec")`` (a field), ``("k", '{"name":"a"}')`` (an item
of a map list, by its keys), ``("v", '"x"')`` (an item of a set list), ``("i", "0")``; its text
is structured-merge-diff's (``.spec.roles[name="a"].replicas``) and a set's JSON is
``managedFields[].fieldsV1`` (``{"f:spec": {"f:roles": {"k:{\\"name\\":\\"a\\"}": {".": {}}}}}``).

Shapes: a CRD's schema (`SchemaShape`: x-kubernetes-list-type, default atomic; map-type;
declared fields and types, for the typed conversion's errors), or the built-in kinds' list
keys as their OpenAPI publishes them (`BuiltinShape`: containers by name, container ports by
containerPort and protocol, ...; other lists atomic).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

JSON = dict[str, Any]
Element = tuple[str, str]
Path = tuple[Element, ...]

# list -> its map keys (built-in kinds, from their OpenAPI x-kubernetes-list-map-keys)
_BUILTIN_KEYS: Final[dict[str, tuple[str, ...]]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "imagePullSecrets": ("name",),
    "resourceClaims": ("name",),
    "claims": ("name",),
    "volumeMounts": ("mountPath",),
    "volumeDevices": ("devicePath",),
    "conditions": ("type",),
    "ownerReferences": ("uid",),
    "hostAliases": ("ip",),
    "topologySpreadConstraints": ("topologyKey", "whenUnsatisfiable"),
}
_BUILTIN_SETS: Final = frozenset({"finalizers"})
# built-in fields that are maps (not structs): their own node is a member of a field set
_BUILTIN_MAPS: Final = frozenset(
    {"labels", "annotations", "data", "binaryData", "stringData", "matchLabels", "selector",
     "nodeSelector", "limits", "requests", "capacity", "allocatable", "parameters"}
)  # fmt: skip
_KEY_DEFAULTS: Final = {"protocol": "TCP"}


@dataclass(frozen=True)
class Shape:
    """How a node merges: ``list_kind`` (atomic, set, map) and ``keys`` for a list node,
    ``atomic`` for a map node; ``schema`` (a CRD's node) for the typed conversion."""

    field: str | None = None
    schema: JSON | None = None
    builtin: bool = True

    def child(self, key: str) -> Shape:
        if not self.builtin:
            node = self.schema or {}
            sub = (node.get("properties") or {}).get(key)
            if sub is None and isinstance(node.get("additionalProperties"), dict):
                sub = node["additionalProperties"]
            return Shape(key, sub, builtin=False)
        return Shape(key)

    def items(self) -> Shape:
        if not self.builtin:
            sub = (self.schema or {}).get("items")
            return Shape(self.field, sub if isinstance(sub, dict) else None, builtin=False)
        return Shape(None)

    def list_kind(self, items: list[Any]) -> tuple[str, tuple[str, ...]]:
        if not self.builtin:
            node = self.schema or {}
            kind = str(node.get("x-kubernetes-list-type") or "atomic")
            return kind, tuple(node.get("x-kubernetes-list-map-keys") or ())
        if self.field in _BUILTIN_SETS:
            return "set", ()
        if self.field == "ports":
            dicts = [i for i in items if isinstance(i, dict)]
            container = any("containerPort" in i for i in dicts)
            return "map", ("containerPort", "protocol") if container else ("port", "protocol")
        keys = _BUILTIN_KEYS.get(self.field or "")
        return ("map", keys) if keys else ("atomic", ())

    @property
    def is_map(self) -> bool:
        """A map (keys chosen by the user), not a struct: its node is itself a member."""
        if not self.builtin:
            node = self.schema or {}
            return "properties" not in node
        return self.field in _BUILTIN_MAPS

    @property
    def atomic_map(self) -> bool:
        return not self.builtin and (self.schema or {}).get("x-kubernetes-map-type") == "atomic"


def schema_shape(schema: JSON | None) -> Shape:
    return Shape(None, schema, builtin=schema is None) if schema else Shape(None)


def item_key(item: Any, keys: tuple[str, ...]) -> str:
    """A map-list item's key element: its key fields as JSON, in key order."""
    values = {k: item.get(k, _KEY_DEFAULTS.get(k)) for k in keys} if isinstance(item, dict) else {}
    return json.dumps({k: v for k, v in values.items() if v is not None}, separators=(",", ":"))


def _elements(value: Any, shape: Shape) -> Iterator[tuple[Element, Any, Shape]]:
    """The children of a node: (element, value, shape)."""
    if isinstance(value, dict) and not shape.atomic_map:
        for key, item in value.items():
            yield ("f", key), item, shape.child(key)
    elif isinstance(value, list):
        kind, keys = shape.list_kind(value)
        if kind == "map":
            for item in value:
                yield ("k", item_key(item, keys)), item, shape.items()
        elif kind == "set":
            for item in value:
                yield ("v", json.dumps(item, separators=(",", ":"))), item, shape.items()


def _granular(value: Any, shape: Shape) -> bool:
    """A node whose children are owned one by one (else it is a leaf)."""
    if isinstance(value, dict):
        return bool(value) and not shape.atomic_map
    if isinstance(value, list):
        return bool(value) and shape.list_kind(value)[0] != "atomic"
    return False


def field_set(value: Any, shape: Shape, prefix: Path = ()) -> dict[Path, bool]:
    """Every path of ``value`` below ``prefix``: True for a leaf, False for a node with
    children that is a member itself (``"."`` in fieldsV1: list items, maps; a struct is
    only the prefix of its fields)."""
    found: dict[Path, bool] = {}
    for element, item, sub in _elements(value, shape):
        path = (*prefix, element)
        granular = _granular(item, sub)
        if not granular or element[0] != "f" or (isinstance(item, dict) and sub.is_map):
            found[path] = not granular
        if granular:
            found.update(field_set(item, sub, path))
        elif element[0] == "k" and isinstance(item, dict):
            found.update(field_set(item, sub, path))  # an item's key fields are its fields
            found[path] = False
    return found


def lookup(value: Any, path: Path, shape: Shape) -> tuple[bool, Any]:
    """(present, value) at ``path``."""
    current, sub = value, shape
    for element in path:
        match = next(((it, s) for e, it, s in _elements(current, sub) if e == element), None)
        if match is None:
            return False, None
        current, sub = match
    return True, current


def remove(value: Any, path: Path, shape: Shape) -> None:
    """Deletes the node at ``path`` from ``value`` (in place), if there."""
    parents, last = path[:-1], path[-1]
    present, parent = lookup(value, parents, shape)
    if not present:
        return
    if isinstance(parent, dict) and last[0] == "f":
        parent.pop(last[1], None)
    elif isinstance(parent, list):
        for i, (element, _, _) in enumerate(_elements(parent, _shape_at(shape, value, parents))):
            if element == last:
                del parent[i]
                return


def _shape_at(shape: Shape, value: Any, path: Path) -> Shape:
    current, sub = value, shape
    for element in path:
        match = next(((it, s) for e, it, s in _elements(current, sub) if e == element), None)
        if match is None:
            return sub
        current, sub = match
    return sub


def merge(live: Any, patch: Any, shape: Shape) -> Any:
    """``patch`` applied over ``live``: objects merge by field, map lists by key, set lists by
    value, atomic lists and scalars are replaced."""
    if isinstance(live, dict) and isinstance(patch, dict) and not shape.atomic_map:
        result = dict(live)
        for key, item in patch.items():
            result[key] = merge(live[key], item, shape.child(key)) if key in live else item
        return result
    if isinstance(live, list) and isinstance(patch, list):
        kind, keys = shape.list_kind(live + patch)
        if kind == "map":
            result_list = list(live)
            index = {item_key(it, keys): n for n, it in enumerate(result_list)}
            for item in patch:
                key = item_key(item, keys)
                if key in index:
                    result_list[index[key]] = merge(result_list[index[key]], item, shape.items())
                else:
                    index[key] = len(result_list)
                    result_list.append(item)
            return result_list
        if kind == "set":
            return list(live) + [item for item in patch if item not in live]
    return patch


def text(path: Path) -> str:
    """structured-merge-diff's path text: ``.spec.roles[name="a"].replicas``."""
    out = ""
    for kind, value in path:
        if kind == "f":
            out += f".{value}"
        elif kind == "k":
            pairs = json.loads(value)
            out += "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in pairs.items()) + "]"
        elif kind == "v":
            out += f"[={value}]"
        else:
            out += f"[{value}]"
    return out


def to_fields_v1(paths: dict[Path, bool]) -> JSON:
    """``managedFields[].fieldsV1`` of a set."""
    root: JSON = {}
    for path, leaf in sorted(paths.items()):
        node = root
        for kind, value in path:
            node = node.setdefault(f"{kind}:{value}", {})
        if not leaf:
            node["."] = {}
    return root


def from_fields_v1(fields: JSON, prefix: Path = ()) -> dict[Path, bool]:
    found: dict[Path, bool] = {}
    for key, sub in fields.items():
        if key == ".":
            continue
        kind, _, value = key.partition(":")
        path = (*prefix, (kind, value))
        nested = {k: v for k, v in (sub or {}).items() if k != "."}
        if "." in (sub or {}) or not nested:  # a member: a leaf, or a node marked "."
            found[path] = not nested and "." not in (sub or {})
        found.update(from_fields_v1(nested, path))
    return found


# ------------------------------------------------------------------ typed conversion

_EXPECTED: Final = {
    "integer": ("numeric (int or float)", (int,)),
    "number": ("numeric (int or float)", (int, float)),
    "string": ("string", (str,)),
    "boolean": ("boolean", (bool,)),
    "object": ("map", (dict,)),
    "array": ("list", (list,)),
}


def typed_errors(value: Any, shape: Shape, prefix: Path = ()) -> list[str]:
    """What structured-merge-diff's conversion of ``value`` to its CRD's typed form refuses:
    undeclared fields, wrong types, map-list items without their keys or repeated (empty
    for built-in shapes)."""
    if shape.builtin or shape.schema is None:
        return []
    node = shape.schema
    where = text(prefix)
    if node.get("x-kubernetes-preserve-unknown-fields") and not node.get("properties"):
        return []
    kind = node.get("type")
    if value is None:
        return []
    if kind in _EXPECTED and not node.get("x-kubernetes-int-or-string"):
        words, types = _EXPECTED[kind]
        wrong = isinstance(value, bool) != (kind == "boolean") or not isinstance(value, types)
        if wrong:
            got = _smd_type(value)
            return [f"{where}: expected {words}, got {got}"]
    errors: list[str] = []
    if isinstance(value, dict):
        properties = node.get("properties") or {}
        open_map = isinstance(node.get("additionalProperties"), dict) or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        for key, item in value.items():
            path = (*prefix, ("f", key))
            if key not in properties and not open_map:
                errors.append(f"{text(path)}: field not declared in schema")
                continue
            errors += typed_errors(item, shape.child(key), path)
    elif isinstance(value, list):
        list_kind, keys = shape.list_kind(value)
        seen: set[str] = set()
        for n, item in enumerate(value):
            if list_kind == "map":
                missing = [k for k in keys if not isinstance(item, dict) or k not in item]
                if missing:
                    errors.append(
                        f"{where}: element {n}: associative list with keys has an element that "
                        f'omits key field "{missing[0]}" (and doesn\'t have default value)'
                    )
                    continue
                key = item_key(item, keys)
                if key in seen:
                    errors.append(f"{where}: duplicate entries for key {text(((('k', key)),))}")
                seen.add(key)
                errors += typed_errors(item, shape.items(), (*prefix, ("k", key)))
            else:
                errors += typed_errors(item, shape.items(), (*prefix, ("i", str(n))))
    return errors


def _smd_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "numeric"
    if isinstance(value, str):
        return "string"
    return "map" if isinstance(value, dict) else "list" if isinstance(value, list) else "null"
