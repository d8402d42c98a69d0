"""The API server's rules for a CustomResourceDefinition's schema, worded as the server
words its refusal (k8s.io/apiextensions-apiserver: apis/apiextensions/validation and
pkg/apiserver/schema), from the Kubernetes documentation's "Specifying a structural schema":

- every node has a `type`, unless x-kubernetes-int-or-string or
  x-kubernetes-preserve-unknown-fields; the root is an object, an array has items;
- inside anyOf/allOf/oneOf/not, no type, description, default, additionalProperties or
  nullable (the int-or-string patterns excepted);
- additionalProperties and properties are mutually exclusive;
- at the root, metadata may only restrict name and generateName (a description is more),
  kind and apiVersion are strings;
- x-kubernetes-list-type is atomic, set or map (on arrays only); a map list has
  x-kubernetes-list-map-keys naming scalar properties of its object items, required or
  defaulted; keys only with map; x-kubernetes-map-type atomic or granular (on objects);
- a default is pruned-equal (no unknown fields) and valid against its own schema;
- CEL rules compile, and their estimated cost stays within the per-rule and the total budget.

`check(crd)` returns the errors (empty: accepted); `message` words them as a 422.
"""

from __future__ import annotations

import copy
from typing import Any, Final

from disagg_operator.gen.crdschema import cel, values
from disagg_operator.gen.crdschema import errors as e
from disagg_operator.gen.crdschema.errors import FieldError

Schema = dict[str, Any]

_NESTED_FORBIDDEN: Final = ("type", "description", "default", "additionalProperties", "nullable")
_COST_HINT: Final = (
    "(try simplifying the rule, or adding maxItems, maxProperties, and maxLength where arrays, "
    "maps, and strings are declared)"
)


def check(crd: dict[str, Any]) -> list[FieldError]:
    """Every reason the API server refuses `crd`'s schemas."""
    versions = (crd.get("spec") or {}).get("versions") or []
    schemas = [((v.get("schema") or {}).get("openAPIV3Schema")) for v in versions]
    found: list[FieldError] = []
    if schemas and all(s == schemas[0] for s in schemas):
        # identical schemas are hoisted to spec.validation, as the server reports them
        if schemas[0] is not None:
            found += check_schema(schemas[0], "spec.validation.openAPIV3Schema")
        return found
    for i, schema in enumerate(schemas):
        if schema is not None:
            found += check_schema(schema, f"spec.versions[{i}].schema.openAPIV3Schema")
    return found


def message(crd: dict[str, Any], found: list[FieldError]) -> str:
    name = str((crd.get("metadata") or {}).get("name", ""))
    return e.invalid_message("CustomResourceDefinition", name, found, "apiextensions.k8s.io")


def check_schema(schema: Schema, path: str) -> list[FieldError]:
    found: list[FieldError] = []
    _node(schema, path, "root", found)
    _metadata(schema, path, found)
    found += _rules(schema, path)
    return found


def _node(s: Schema, path: str, level: str, found: list[FieldError]) -> None:
    kind = s.get("type")
    int_or_string = bool(s.get("x-kubernetes-int-or-string"))
    preserve = s.get("x-kubernetes-preserve-unknown-fields")
    if preserve is False:
        found.append(
            FieldError(
                e.INVALID,
                f"{path}.x-kubernetes-preserve-unknown-fields",
                "must be true or undefined",
                False,
            )
        )
    exempt = int_or_string or s.get("x-kubernetes-embedded-resource")
    if not kind and not exempt and not (preserve and level != "root"):
        where = {
            "root": "at the root",
            "item": "for specified array items",
            "field": "for specified object fields",
        }[level]
        found.append(FieldError(e.REQUIRED, f"{path}.type", f"must not be empty {where}"))
    if level == "root" and kind and kind != "object":
        found.append(FieldError(e.INVALID, f"{path}.type", "must be object at the root", kind))
    if kind == "array" and "items" not in s:
        found.append(FieldError(e.REQUIRED, f"{path}.items", "must be specified"))
    if "properties" in s and "additionalProperties" in s and s["additionalProperties"] is not True:
        found.append(
            FieldError(
                e.FORBIDDEN,
                f"{path}.additionalProperties",
                "additionalProperties and properties are mutual exclusive",
            )
        )
    _nested(s, path, found)
    _list_type(s, path, found)
    _default(s, path, found)
    for key, sub in (s.get("properties") or {}).items():
        _node(sub, f"{path}.properties[{key}]", "field", found)
    if isinstance(s.get("additionalProperties"), dict):
        _node(s["additionalProperties"], f"{path}.additionalProperties", "field", found)
    if isinstance(s.get("items"), dict):
        _node(s["items"], f"{path}.items", "item", found)


def _nested(s: Schema, path: str, found: list[FieldError]) -> None:
    """Value validations only inside anyOf/allOf/oneOf/not (int-or-string's pattern aside)."""
    int_or_string = values.schema_is_int_or_string(s)
    for key in ("anyOf", "allOf", "oneOf"):
        for i, branch in enumerate(s.get(key) or []):
            if key == "anyOf" and int_or_string and set(branch) == {"type"}:
                continue
            _nested_branch(branch, f"{path}.{key}[{i}]", found)
    if isinstance(s.get("not"), dict):
        _nested_branch(s["not"], f"{path}.not", found)


def _nested_branch(branch: Schema, path: str, found: list[FieldError]) -> None:
    for field in _NESTED_FORBIDDEN:
        if field in branch:
            found.append(
                FieldError(e.FORBIDDEN, f"{path}.{field}", "must be empty to be structural")
            )
    for ext in ("x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource",
                "x-kubernetes-int-or-string"):  # fmt: skip
        if branch.get(ext):
            found.append(FieldError(e.FORBIDDEN, f"{path}.{ext}", "must be false to be structural"))


def _list_type(s: Schema, path: str, found: list[FieldError]) -> None:
    list_type = s.get("x-kubernetes-list-type")
    keys: list[str] = list(s.get("x-kubernetes-list-map-keys") or [])
    kind = s.get("type")
    if list_type is not None and kind != "array":
        if not kind:
            found.append(
                FieldError(
                    e.REQUIRED,
                    f"{path}.type",
                    "must be array if x-kubernetes-list-type is specified",
                )
            )
        else:
            found.append(
                FieldError(
                    e.INVALID,
                    f"{path}.type",
                    "must be array if x-kubernetes-list-type is specified",
                    kind,
                )
            )
    if list_type is not None and list_type not in ("atomic", "set", "map"):
        found.append(
            FieldError(
                e.NOT_SUPPORTED,
                f"{path}.x-kubernetes-list-type",
                'supported values: "atomic", "set", "map"',
                list_type,
            )
        )
    items = s.get("items") if isinstance(s.get("items"), dict) else None
    set_of_objects = list_type == "set" and items is not None and items.get("type") == "object"
    if set_of_objects and items is not None and items.get("x-kubernetes-map-type") != "atomic":
        found.append(
            FieldError(
                e.INVALID,
                f"{path}.items.x-kubernetes-map-type",
                "must be atomic as item of a list with x-kubernetes-list-type=set",
                items.get("x-kubernetes-map-type"),
            )
        )
    map_type = s.get("x-kubernetes-map-type")
    if map_type is not None and kind != "object":
        found.append(
            FieldError(
                e.INVALID,
                f"{path}.type",
                "must be object if x-kubernetes-map-type is specified",
                kind,
            )
        )
    if map_type is not None and map_type not in ("atomic", "granular"):
        found.append(
            FieldError(
                e.NOT_SUPPORTED,
                f"{path}.x-kubernetes-map-type",
                'supported values: "atomic", "granular"',
                map_type,
            )
        )
    if list_type != "map":
        if keys:
            found.append(
                FieldError(
                    e.FORBIDDEN,
                    f"{path}.x-kubernetes-list-map-keys",
                    "must be empty if x-kubernetes-list-type is not map",
                )
            )
        return
    if not keys:
        found.append(
            FieldError(
                e.REQUIRED,
                f"{path}.x-kubernetes-list-map-keys",
                "must not be empty if x-kubernetes-list-type is map",
            )
        )
    if items is None:
        found.append(
            FieldError(
                e.REQUIRED, f"{path}.items", "must have a schema if x-kubernetes-list-type is map"
            )
        )
        return
    if items.get("type") != "object":
        found.append(
            FieldError(
                e.INVALID,
                f"{path}.items.type",
                "must be object if parent array's x-kubernetes-list-type is map",
                items.get("type", ""),
            )
        )
        return
    properties, required = items.get("properties") or {}, set(items.get("required") or [])
    for i, key in enumerate(keys):
        if key not in properties:
            found.append(
                FieldError(
                    e.INVALID,
                    f"{path}.x-kubernetes-list-map-keys",
                    "entries must all be names of item properties",
                    keys,
                )
            )
            continue
        if properties[key].get("type") in ("array", "object"):
            found.append(
                FieldError(
                    e.INVALID,
                    f"{path}.items.properties[{key}].type",
                    "must be a scalar type if parent array's x-kubernetes-list-type is map",
                    properties[key]["type"],
                )
            )
        if key in keys[:i]:
            found.append(
                FieldError(
                    e.INVALID,
                    f"{path}.x-kubernetes-list-map-keys",
                    "must not contain duplicate entries",
                    keys,
                )
            )
        if key not in required and "default" not in properties[key]:
            found.append(
                FieldError(
                    e.REQUIRED,
                    f"{path}.items.properties[{key}]",
                    "all map keys must be required or have a default value",
                )
            )


def _default(s: Schema, path: str, found: list[FieldError]) -> None:
    if "default" not in s:
        return
    default = s["default"]
    pruned = copy.deepcopy(default)
    values.prune(pruned, s)
    if pruned != default:
        found.append(
            FieldError(e.INVALID, f"{path}.default", "must not have unknown fields", default)
        )
        return
    defaulted = values.apply_defaults(copy.deepcopy(default), s)
    found.extend(values.validate(defaulted, s, f"{path}.default"))


def _metadata(schema: Schema, path: str, found: list[FieldError]) -> None:
    properties = schema.get("properties") or {}
    for key in ("kind", "apiVersion"):
        if key in properties and properties[key].get("type") != "string":
            found.append(
                FieldError(
                    e.INVALID,
                    f"{path}.properties[{key}].type",
                    "must be string",
                    properties[key].get("type", ""),
                )
            )
    if "metadata" not in properties:
        return
    metadata = dict(properties["metadata"])
    if metadata.get("type") != "object":
        found.append(
            FieldError(
                e.INVALID,
                f"{path}.properties[metadata].type",
                "must be object",
                metadata.get("type", ""),
            )
        )
    names = set(metadata.get("properties") or {})
    if names and names <= {"name", "generateName"}:
        metadata.pop("properties")
    metadata.pop("type", None)
    metadata.pop("default", None)
    if metadata:
        found.append(
            FieldError(
                e.FORBIDDEN,
                f"{path}.properties[metadata]",
                "must not specify anything other than name and generateName, but metadata is "
                "implicitly specified",
            )
        )


def _rules(schema: Schema, path: str) -> list[FieldError]:
    """CEL rules: compiled, each within the per-rule budget, all within the total."""
    found: list[FieldError] = []
    total = 0

    def visit(s: Schema, where: str, ancestors: list[Schema]) -> None:
        nonlocal total
        for i, entry in enumerate(s.get("x-kubernetes-validations") or []):
            rule_path = f"{where}.x-kubernetes-validations[{i}].rule"
            try:
                cel.compile_rule(entry, s)
                cost = cel.cost(str(entry.get("rule", "")), s)
            except cel.CompileError as error:
                found.append(
                    FieldError(
                        e.INVALID, rule_path, f"compilation failed: {error}", entry.get("rule", "")
                    )
                )
                continue
            if cost > cel.PER_RULE_LIMIT:
                found.append(
                    FieldError(
                        e.FORBIDDEN,
                        rule_path,
                        f"estimated rule cost exceeds budget by factor of "
                        f"{_factor(cost, cel.PER_RULE_LIMIT)} {_COST_HINT}",
                    )
                )
            total += cost * cel.cardinality(ancestors)
        for key, sub in (s.get("properties") or {}).items():
            visit(sub, f"{where}.properties[{key}]", ancestors)
        if isinstance(s.get("additionalProperties"), dict):
            visit(s["additionalProperties"], f"{where}.additionalProperties", [*ancestors, s])
        if isinstance(s.get("items"), dict):
            visit(s["items"], f"{where}.items", [*ancestors, s])

    visit(schema, path, [])
    if total > cel.TOTAL_LIMIT:
        found.append(
            FieldError(
                e.FORBIDDEN,
                path,
                "x-kubernetes-validations estimated rule cost total for entire OpenAPIv3 schema "
                f"exceeds budget by factor of {_factor(total, cel.TOTAL_LIMIT)} {_COST_HINT}",
            )
        )
    return found


def _factor(cost: int, limit: int) -> str:
    return f"{cost / limit:.6g}x"
