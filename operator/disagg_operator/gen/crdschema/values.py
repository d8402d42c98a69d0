"""What a CRD's structural schema does to a value, as the API server does it: defaulting
(`apply_defaults`), pruning of unknown fields (`prune`), validation against the OpenAPI
schema (`validate`, with jsonschema's Draft 4 validator: OpenAPI v3.0 keeps its boolean
exclusiveMinimum/Maximum) and the list-type rules (`list_errors`), each error worded as the
server's (k8s.io/apiextensions-apiserver's ValidateCustomResource over kube-openapi)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any, Final

import jsonschema

from disagg_operator.gen.crdschema import errors as e

Schema = dict[str, Any]

_COPIED: Final = (
    "type", "enum", "pattern", "minLength", "maxLength", "minItems", "maxItems", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "required",
    "minProperties", "maxProperties", "uniqueItems",
)  # fmt: skip
_TYPE_NAMES: Final = {
    bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
    dict: "object", type(None): "null",
}  # fmt: skip


def type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def to_json_schema(schema: Schema) -> Schema:
    """A structural schema node as JSON Schema draft 4 (unknown fields are pruned before
    validation, so objects stay open)."""
    out: Schema = {key: schema[key] for key in _COPIED if key in schema}
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(v) for k, v in schema["properties"].items()}
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(schema["additionalProperties"])
    elif schema.get("additionalProperties") is False:
        out["additionalProperties"] = False
    if isinstance(schema.get("items"), dict):
        out["items"] = to_json_schema(schema["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = [to_json_schema(branch) for branch in schema[key]]
    if "not" in schema:
        out["not"] = to_json_schema(schema["not"])
    return out


def _path(base: str, parts: Any) -> str:
    text = base
    for part in parts:
        text = f"{text}[{part}]" if isinstance(part, int) else e.child(text, str(part))
    return text


def _field_error(error: jsonschema.ValidationError, base: str) -> e.FieldError | None:
    where = _path(base, error.absolute_path)
    value, keyword, bound = error.instance, error.validator, error.validator_value
    shown = where or "<root>"
    if keyword == "type":
        wanted = bound if isinstance(bound, str) else ",".join(str(b) for b in bound)
        got = type_name(value)
        return e.FieldError(
            e.TYPE_INVALID, where, f'{shown} in body must be of type {wanted}: "{got}"', got
        )
    if keyword == "required":
        missing = str(error.message).split("'")[1] if "'" in error.message else ""
        return e.FieldError(e.REQUIRED, e.child(where, missing))
    if keyword == "enum":
        supported = ", ".join(json.dumps(v) for v in bound)
        return e.FieldError(e.NOT_SUPPORTED, where, f"supported values: {supported}", value)
    if keyword == "maxLength":
        return e.FieldError(e.TOO_LONG, where, f"may not be more than {bound} bytes")
    if keyword in ("maxItems", "maxProperties"):
        return e.FieldError(e.TOO_MANY, where, f"{len(value)}: must have at most {bound} items")
    details = {
        "pattern": f"should match '{bound}'",
        "minLength": f"should be at least {bound} chars long",
        "minItems": f"should have at least {bound} items",
        "minProperties": f"should have at least {bound} properties",
        "multipleOf": f"should be a multiple of {bound}",
        "uniqueItems": "shouldn't contain duplicates",
        "anyOf": "must validate at least one schema (anyOf)",
        "oneOf": "must validate one and only one schema (oneOf)",
        "not": "must not validate the schema (not)",
    }
    if keyword in ("minimum", "maximum"):
        exclusive = error.schema.get("exclusive" + keyword.capitalize(), False)
        relation = "greater than" if keyword == "minimum" else "less than"
        detail = f"should be {relation}{'' if exclusive else ' or equal to'} {bound}"
    elif keyword in details:
        detail = details[keyword]
    elif keyword in ("exclusiveMinimum", "exclusiveMaximum"):
        return None  # reported with its minimum/maximum
    else:
        detail = str(error.message)
    if keyword in ("minItems", "minProperties"):
        value = len(value)
    return e.FieldError(e.INVALID, where, f"{shown} in body {detail}", value)


def validate(value: Any, schema: Schema, path: str = "") -> list[e.FieldError]:
    """The schema's errors in `value` (after defaulting and pruning), in the server's words,
    plus the list-type rules (`list_errors`)."""
    validator = _validator(schema)
    found: list[e.FieldError] = []
    for error in sorted(validator.iter_errors(value), key=lambda err: list(err.absolute_path)):
        if error.validator in ("anyOf", "oneOf") and schema_is_int_or_string(error.schema):
            got = type_name(error.instance)
            found.append(
                e.FieldError(
                    e.TYPE_INVALID,
                    _path(path, error.absolute_path),
                    f"{_path(path, error.absolute_path) or '<root>'} in body must be of type "
                    f'integer,string: "{got}"',
                    got,
                )
            )
            continue
        converted = _field_error(error, path)
        if converted is not None:
            found.append(converted)
    return found + list_errors(value, schema, path)


_VALIDATORS: dict[int, tuple[Schema, jsonschema.Draft4Validator]] = {}


def _validator(schema: Schema) -> jsonschema.Draft4Validator:
    """The schema's validator, made once per schema object (a CRD's is validated often)."""
    cached = _VALIDATORS.get(id(schema))
    if cached is not None and cached[0] is schema:
        return cached[1]
    validator = jsonschema.Draft4Validator(to_json_schema(schema))
    if len(_VALIDATORS) > 256:
        _VALIDATORS.clear()
    _VALIDATORS[id(schema)] = (schema, validator)
    return validator


def schema_is_int_or_string(schema: Schema) -> bool:
    branches = schema.get("anyOf") or []
    return len(branches) == 2 and {b.get("type") for b in branches} == {"integer", "string"}


def list_errors(value: Any, schema: Schema, path: str = "") -> list[e.FieldError]:
    """x-kubernetes-list-type set and map: `Duplicate value` for a repeated item or key."""
    found: list[e.FieldError] = []
    for where, node, item in walk(value, schema, path):
        if not isinstance(item, list):
            continue
        kind = node.get("x-kubernetes-list-type")
        if kind == "set":
            seen: list[Any] = []
            for i, element in enumerate(item):
                if element in seen:
                    found.append(e.FieldError(e.DUPLICATE, f"{where}[{i}]", value=element))
                seen.append(element)
        elif kind == "map":
            keys = node.get("x-kubernetes-list-map-keys") or []
            seen_keys: list[tuple[Any, ...]] = []
            for i, element in enumerate(item):
                if not isinstance(element, dict):
                    continue
                key = tuple(element.get(k) for k in keys)
                if key in seen_keys:
                    shown = {k: element.get(k) for k in keys if k in element}
                    found.append(e.FieldError(e.DUPLICATE, f"{where}[{i}]", value=shown))
                seen_keys.append(key)
    return found


def walk(value: Any, schema: Schema, path: str = "") -> Iterator[tuple[str, Schema, Any]]:
    """Every (path, schema node, value) of `value` that the schema describes, parents first."""
    yield path, schema, value
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from walk(item, sub, e.child(path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from walk(item, schema["items"], f"{path}[{i}]")


def apply_defaults(value: Any, schema: Schema) -> Any:
    """`value` with the schema's defaults filled in (in place for objects and lists)."""
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for key, sub in properties.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        extra = schema.get("additionalProperties")
        for key in list(value):
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                value[key] = apply_defaults(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            value[i] = apply_defaults(item, schema["items"])
    return value


def prune(value: Any, schema: Schema, path: str = "", *, root: bool = False) -> list[str]:
    """Drops the fields the schema does not declare (in place); returns their paths
    (`spec.bogusField`). x-kubernetes-preserve-unknown-fields keeps a subtree; at the root,
    apiVersion, kind and metadata are the API server's (metadata is ObjectMeta)."""
    dropped: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
        for key in list(value):
            where = e.child(path, key)
            if root and key in ("apiVersion", "kind", "metadata"):
                continue
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                dropped += prune(value[key], sub, where)
            elif not keep:
                del value[key]
                dropped.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            dropped += prune(item, schema["items"], f"{path}[{i}]")
    return dropped
