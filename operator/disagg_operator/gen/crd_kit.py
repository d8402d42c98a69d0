"""The CRD schema's building blocks: typed field schemas with descriptions, CEL rules, and
the patterns (names, quantities, payload paths, percentages) the CRD shares with the parser."""

from __future__ import annotations

from typing import Any, Final

Schema = dict[str, Any]

DNS_1035_LABEL: Final = "^[a-z]([-a-z0-9]*[a-z0-9])?$"

DNS_1123_LABEL: Final = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

# The parser accepts any Python identifiers; the CRD only their ASCII forms.
_IDENT = "[A-Za-z_][A-Za-z0-9_]*"

HANDLER_PATTERN: Final = f"^{_IDENT}(\\.{_IDENT})*:{_IDENT}$"

ENV_NAME_PATTERN: Final = "^[A-Za-z_][A-Za-z0-9_]*$"

PORT_NAME_PATTERN: Final = "^[a-z0-9]([a-z0-9-]*[a-z0-9])?$"

_KEY, _INDEX = "[A-Za-z_][A-Za-z0-9_-]*", "\\[(0|[1-9][0-9]*)\\]"

PAYLOAD_PATH_PATTERN: Final = f"^({_KEY}|{_INDEX})(\\.{_KEY}|{_INDEX})*$"

# resource.Quantity as Kubernetes publishes it; SIZE_PATTERN without a sign (sizes are >= 0).
_NUMBER = "(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))"

_SUFFIX = f"(([KMGTPE]i)|[numkMGTPE]|([eE](\\+|-)?{_NUMBER}))"

QUANTITY_PATTERN: Final = f"^(\\+|-)?{_NUMBER}{_SUFFIX}?$"

SIZE_PATTERN: Final = f"^\\+?{_NUMBER}{_SUFFIX}?$"

NO_WHITESPACE: Final = "^\\S+$"


def string(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def integer(description: str, **extra: Any) -> Schema:
    return {"type": "integer", "description": description, **extra}


def number(description: str, **extra: Any) -> Schema:
    return {"type": "number", "description": description, **extra}


def boolean(description: str) -> Schema:
    return {"type": "boolean", "description": description}


def object_schema(
    description: str, properties: dict[str, Schema], *, required: tuple[str, ...] = (), **extra: Any
) -> Schema:
    schema: Schema = {"type": "object", "description": description}
    if required:
        schema["required"] = list(required)
    schema["properties"] = properties
    schema.update(extra)
    return schema


def array(description: str, items: Schema, **extra: Any) -> Schema:
    return {"type": "array", "description": description, "items": items, **extra}


def free_object(description: str) -> Schema:
    return {
        "type": "object",
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
    }


def quantity(description: str, *, pattern: str = QUANTITY_PATTERN, **extra: Any) -> Schema:
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": pattern,
        "x-kubernetes-int-or-string": True,
        **extra,
    }


PERCENT_PATTERN: Final = "^(0|[1-9][0-9]?|100)%$"

POSITIVE_PERCENT_PATTERN: Final = "^([1-9][0-9]?|100)%$"


def int_or_percent(description: str, *, minimum: int, default: int | str) -> Schema:
    """Kubernetes' int-or-percent form (a Deployment's maxUnavailable): `2` or `"25%"`."""
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "minimum": minimum,  # of an integer; a string has the pattern
        "pattern": POSITIVE_PERCENT_PATTERN if minimum > 0 else PERCENT_PATTERN,
        "x-kubernetes-int-or-string": True,
        "default": default,
    }


def rule(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    result = {"rule": rule, "message": message}
    if field_path is not None:
        result["fieldPath"] = field_path
    return result


def given(field: str, rule: str) -> str:
    """`rule` where `field` is set, else true. A conditional rather than `!has(f) || rule`:
    the same in CEL, and cel-python (used by the tests) mis-evaluates the `||` form when the
    right side nests a macro over the optional field."""
    return f"has({field}) ? ({rule}) : true"
