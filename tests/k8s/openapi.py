"""``/openapi/v2`` and ``/openapi/v3`` for the served kinds, as far as clients read them:

- v3: the root lists each group-version (``api/v1``, ``apis/<g>/<v>``) with its
  ``serverRelativeURL``; a group-version's document has every resource's paths, whose
  operations carry ``x-kubernetes-group-version-kind`` and the query parameters the server
  takes (``fieldValidation``, ``fieldManager``, ``dryRun``, ``force``): kubectl reads the
  PATCH operation to learn that it can leave validation to the server
  (``--validate=strict``, its default) instead of needing a client-side schema;
  ``components.schemas`` holds the custom kinds' schemas (their CRD's openAPIV3Schema);
- v2: one Swagger 2.0 document with the custom kinds' definitions and the same paths, as
  JSON (the emulator speaks no protobuf answers).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, Final

from .resources import ResourceType

JSON = dict[str, Any]
INFO: Final = {"title": "Kubernetes", "version": "v1.37.0"}
_QUERY: Final = (
    ("dryRun", "When present, modifications are not persisted (All)."),
    ("fieldManager", "A name for the actor making the changes."),
    (
        "fieldValidation",
        "How the server treats unknown and duplicate fields: Ignore, Warn or Strict.",
    ),
)
_FORCE: Final = ("force", "Force an apply over other managers' fields.")


def group_version_key(rt: ResourceType) -> str:
    return f"api/{rt.version}" if not rt.group else f"apis/{rt.group}/{rt.version}"


def definition_name(rt: ResourceType) -> str:
    """``dev.disagg.v1alpha1.DisaggregatedPipeline`` (the group reversed, as Kubernetes)."""
    group = ".".join(reversed(rt.group.split("."))) if rt.group else "io.k8s.api.core"
    return f"{group}.{rt.version}.{rt.kind}"


def _parameters(*extra: tuple[str, str]) -> list[JSON]:
    return [
        {"name": name, "in": "query", "description": text, "schema": {"type": "string"}}
        for name, text in (*_QUERY, *extra)
    ]


def _gvk(rt: ResourceType) -> JSON:
    return {"group": rt.group, "version": rt.version, "kind": rt.kind}


def _operation(rt: ResourceType, action: str, *params: JSON) -> JSON:
    return {
        "operationId": f"{action}{rt.kind}",
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": _gvk(rt),
        "parameters": list(params),
        "responses": {"200": {"description": "OK"}},
    }


def paths(rt: ResourceType) -> dict[str, JSON]:
    """The resource's collection and item paths, with their operations."""
    prefix = f"/{group_version_key(rt)}"
    base = (
        f"{prefix}/namespaces/{{namespace}}/{rt.plural}"
        if rt.namespaced
        else f"{prefix}/{rt.plural}"
    )
    write = _parameters()
    found: dict[str, JSON] = {
        base: {
            "get": _operation(rt, "list"),
            "post": _operation(rt, "post", *write),
        },
        f"{base}/{{name}}": {
            "get": _operation(rt, "get"),
            "put": _operation(rt, "put", *write),
            "patch": _operation(rt, "patch", *_parameters(_FORCE)),
            "delete": _operation(rt, "delete", *_parameters()[:1]),
        },
    }
    for sub in sorted(rt.subresources):
        found[f"{base}/{{name}}/{sub}"] = {
            "get": _operation(rt, "get"),
            "put": _operation(rt, "put", *write),
            "patch": _operation(rt, "patch", *_parameters(_FORCE)),
        }
    return found


def _schema(rt: ResourceType) -> JSON | None:
    if rt.schema is None:
        return None
    schema = json.loads(json.dumps(rt.schema))
    schema["x-kubernetes-group-version-kind"] = [_gvk(rt)]
    return dict(schema)


def v3_document(types: Iterable[ResourceType]) -> JSON:
    """One group-version's OpenAPI v3 document."""
    doc: JSON = {"openapi": "3.0.0", "info": INFO, "paths": {}, "components": {"schemas": {}}}
    for rt in types:
        doc["paths"].update(paths(rt))
        schema = _schema(rt)
        if schema is not None:
            doc["components"]["schemas"][definition_name(rt)] = schema
    return doc


def v3_root(types: Iterable[ResourceType]) -> JSON:
    """``/openapi/v3``: each group-version and where its document is."""
    grouped: dict[str, list[ResourceType]] = {}
    for rt in types:
        grouped.setdefault(group_version_key(rt), []).append(rt)
    found: dict[str, JSON] = {}
    for key, members in sorted(grouped.items()):
        digest = hashlib.sha512(json.dumps(v3_document(members), sort_keys=True).encode())
        found[key] = {
            "serverRelativeURL": f"/openapi/v3/{key}?hash={digest.hexdigest()[:64].upper()}"
        }
    return {"paths": found}


def v2_document(types: Iterable[ResourceType]) -> JSON:
    """``/openapi/v2``: Swagger 2.0, the custom kinds' definitions and every path."""
    doc: JSON = {"swagger": "2.0", "info": INFO, "paths": {}, "definitions": {}}
    for rt in types:
        for path, operations in paths(rt).items():
            doc["paths"][path] = {
                verb: {**op, "parameters": [_v2_param(p) for p in op["parameters"]]}
                for verb, op in operations.items()
            }
        schema = _schema(rt)
        if schema is not None:
            doc["definitions"][definition_name(rt)] = schema
    return doc


def _v2_param(param: JSON) -> JSON:
    return {"name": param["name"], "in": "query", "type": "string", "uniqueItems": True}
