"""Admission of custom resources against their CRD's schema, as the API server does it
(k8s.io/apiextensions-apiserver's customResourceStrategy), with ``disagg_operator.gen.crdschema``
(jsonschema and cel-python under the server's wording):

1. unknown fields: ``fieldValidation=Strict`` refuses them (a 400 ``strict decoding error``;
   kubectl sends Strict), ``Warn`` (the server's default) prunes them with a ``Warning``
   header, ``Ignore`` prunes them silently; server-side apply reports them earlier, from its
   typed conversion (``fieldsets.typed_errors``);
2. the schema's defaults;
3. the OpenAPI schema (types, formats, ranges, lengths, enums, required, list-type
   uniqueness): a 422 ``Invalid`` whose message and ``details.causes`` are the server's;
4. the CEL rules (x-kubernetes-validations), unless a type error blocks them.

Only ``metadata.name`` and ``generateName`` are the schema's; the rest of metadata is
ObjectMeta's, checked by the emulator as for every kind.
"""

from __future__ import annotations

import copy
import ipaddress
import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

import kmock

from disagg_operator.gen.crdschema import cel, values
from disagg_operator.gen.crdschema import errors as fe
from disagg_operator.gen.crdschema.errors import FieldError

from . import fieldsets as fs
from .errors import api_error
from .resources import ResourceType
from .ssa import Writer

JSON = dict[str, Any]
VALIDATIONS: Final = ("Strict", "Warn", "Ignore")
DEFAULT_VALIDATION: Final = "Warn"  # the API server's, when a request names none
_BLOCKED: Final = (
    "some validation rules were not checked because the object was invalid; correct the "
    "existing errors to complete validation"
)


def field_validation(params: Mapping[str, str]) -> str:
    """The request's ``fieldValidation`` (400 for an unknown one)."""
    value = params.get("fieldValidation") or DEFAULT_VALIDATION
    if value not in VALIDATIONS:
        raise api_error(
            400,
            "BadRequest",
            f'fieldValidation parameter unsupported: "{value}" (valid values: Ignore, Strict, '
            "Warn)",
        )
    return value


def invalid(rt: ResourceType, name: str, errors: list[FieldError]) -> kmock.KubernetesError:
    """422 Invalid with the server's message and causes."""
    return api_error(
        422,
        "Invalid",
        fe.invalid_message(rt.kind, name, errors, rt.group),
        name=name,
        group=rt.group,
        kind=rt.kind,
        causes=[error.cause() for error in errors],
    )


def admit_custom(
    rt: ResourceType, obj: JSON, *, validation: str, old: JSON | None = None
) -> list[str]:
    """Prunes, defaults and validates ``obj`` (in place) as its CRD says; returns the warnings
    to send. Raises 400 (Strict, unknown fields) or 422 (schema, CEL)."""
    if rt.schema is None:
        return []
    schema = rt.schema if isinstance(rt.schema, dict) else dict(rt.schema)
    name = str((obj.get("metadata") or {}).get("name", ""))
    unknown = values.prune(obj, schema, root=True)
    if unknown and validation == "Strict":
        listed = ", ".join(f'unknown field "{path}"' for path in unknown)
        raise api_error(400, "BadRequest", f"strict decoding error: {listed}")
    warnings = [f'unknown field "{path}"' for path in unknown] if validation == "Warn" else []
    values.apply_defaults(obj, schema)
    checked = _schema_view(obj)
    errors = values.validate(checked, schema)
    if any(error.kind == fe.TYPE_INVALID for error in errors):
        errors.append(FieldError(fe.INVALID, "<nil>", _BLOCKED, None))
    else:
        errors += list(rule_errors(checked, schema, old=_schema_view(old) if old else None))
    if errors:
        raise invalid(rt, name, errors)
    return warnings


def typed_patch(rt: ResourceType, ns: str | None, name: str, body: JSON, writer: Writer) -> JSON:
    """An apply patch through structured-merge-diff's typed conversion (a CRD's schema):
    undeclared fields are refused under Strict, else pruned (warned under Warn); a wrong type
    is refused. The refusal is the server's: a 500 with its message."""
    if not rt.from_crd or not rt.schema:
        return body
    schema = rt.schema if isinstance(rt.schema, dict) else dict(rt.schema)
    view = {k: v for k, v in body.items() if k not in ("apiVersion", "kind", "metadata")}
    problems = fs.typed_errors(view, fs.schema_shape(schema))
    unknown = [p for p in problems if p.endswith(": field not declared in schema")]
    if writer.validation != "Strict" and unknown and len(unknown) == len(problems):
        body = copy.deepcopy(body)
        pruned = values.prune(body, schema, root=True)
        if writer.validation == "Warn":
            writer.warnings += [f'unknown field "{path}"' for path in pruned]
        return body
    if problems:
        where = f"{ns or ''}/{name}; {rt.api_version}, Kind={rt.kind}"
        text = (
            problems[0]
            if len(problems) == 1
            else "errors:\n" + "\n".join(f"  {p}" for p in problems)
        )
        raise api_error(500, "", f"failed to create typed patch object ({where}): {text}")
    return body


def _schema_view(obj: JSON) -> JSON:
    """``obj`` as its schema sees it: of metadata only name and generateName."""
    view = dict(obj)
    meta = obj.get("metadata") or {}
    view["metadata"] = {k: meta[k] for k in ("name", "generateName") if k in meta}
    return view


def rule_errors(value: Any, schema: JSON, *, old: Any = None) -> Iterator[FieldError]:
    """The CEL rules that ``value`` breaks, each at its node's path (plus its fieldPath). On
    an update (``old``), a node whose value did not change is not evaluated again (the
    server's validation ratcheting: an unchanged value is not refused)."""
    for path, node, item, before in _paired(value, old, schema):
        rules = node.get("x-kubernetes-validations") or []
        if rules and before is not None and before == item:
            continue
        for entry in rules:
            rule = _compiled(entry, node)
            if rule.transition and before is None:
                continue  # a transition rule needs the old value (a new item has none)
            result = cel.evaluate(rule, item, before)
            if result is True:
                continue
            where = path
            if rule.field_path:
                where = (path + rule.field_path) if path else rule.field_path.lstrip(".")
            detail = rule.message or f"failed rule: {rule.rule}"
            if isinstance(result, str):
                detail = f"{result} evaluating rule: {rule.rule}"
            kind = node.get("type") or ""
            yield FieldError(fe.INVALID, where or "<nil>", detail, kind)


_RULES: dict[tuple[str, str, str], cel.Rule] = {}


def _compiled(entry: JSON, node: JSON) -> cel.Rule:
    key = (str(entry.get("rule")), str(entry.get("message")), str(entry.get("fieldPath")))
    if key not in _RULES:
        _RULES[key] = cel.compile_rule(entry, None)  # the CRD's check compiled it on its node
    return _RULES[key]


def _paired(
    value: Any, old: Any, schema: JSON, path: str = ""
) -> Iterator[tuple[str, JSON, Any, Any]]:
    """`values.walk` with each node's old value: object fields by name, the items of a
    `x-kubernetes-list-type: map` list by their map keys (as the server correlates them, so
    that a reordered or renamed item is compared with its own old self, or with none), other
    lists' items by index."""
    yield path, schema, value, old
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                before = old.get(key) if isinstance(old, dict) else None
                yield from _paired(item, before, sub, fe.child(path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        olds = old if isinstance(old, list) else []
        keys = schema.get("x-kubernetes-list-map-keys") or []
        mapped = schema.get("x-kubernetes-list-type") == "map" and bool(keys)
        by_key = {_map_key(o, keys): o for o in olds if mapped and isinstance(o, dict)}
        for i, item in enumerate(value):
            if mapped:
                before = by_key.get(_map_key(item, keys)) if isinstance(item, dict) else None
            else:
                before = olds[i] if i < len(olds) else None
            yield from _paired(item, before, schema["items"], f"{path}[{i}]")


def _map_key(item: JSON, keys: list[str]) -> str:
    return json.dumps([item.get(k) for k in keys])


# ------------------------------------------------------------------ built-in kinds

_LOOPBACK: Final = "may not be in the loopback range (127.0.0.0/8, ::1/128)"
_LINK_LOCAL: Final = "may not be in the link-local range (169.254.0.0/16, fe80::/10)"
_LINK_LOCAL_MULTICAST: Final = (
    "may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)"
)


def _address_errors(address: Any, path: str) -> list[FieldError]:
    """An endpoint address as the API server's validation refuses it (ValidateEndpointIP)."""
    try:
        ip = ipaddress.ip_address(str(address))
    except ValueError:
        return [FieldError(fe.INVALID, path, "must be a valid IP address", address)]
    if ip.is_unspecified:
        return [FieldError(fe.INVALID, path, "may not be unspecified (0.0.0.0)", address)]
    if ip.is_loopback:
        return [FieldError(fe.INVALID, path, _LOOPBACK, address)]
    if ip.is_link_local:
        return [FieldError(fe.INVALID, path, _LINK_LOCAL, address)]
    if ip.is_multicast and (
        ip in ipaddress.ip_network("224.0.0.0/24") or ip in ipaddress.ip_network("ff02::/16")
    ):
        return [FieldError(fe.INVALID, path, _LINK_LOCAL_MULTICAST, address)]
    return []


def builtin_errors(rt: ResourceType, obj: JSON) -> list[FieldError]:
    """What the API server's validation of a built-in kind refuses, as far as emulated:
    loopback, link-local and unspecified addresses in Endpoints and EndpointSlices."""
    found: list[FieldError] = []
    if rt.storage_key == ("", "endpoints"):
        for i, subset in enumerate(obj.get("subsets") or []):
            for field in ("addresses", "notReadyAddresses"):
                for j, address in enumerate((subset or {}).get(field) or []):
                    where = f"subsets[{i}].{field}[{j}].ip"
                    found += _address_errors((address or {}).get("ip"), where)
    elif rt.storage_key == ("discovery.k8s.io", "endpointslices") and obj.get("addressType") in (
        "IPv4",
        "IPv6",
    ):
        for i, endpoint in enumerate(obj.get("endpoints") or []):
            for j, address in enumerate((endpoint or {}).get("addresses") or []):
                found += _address_errors(address, f"endpoints[{i}].addresses[{j}]")
    return found


def admit_builtin(rt: ResourceType, obj: JSON) -> None:
    """422 for what ``builtin_errors`` finds."""
    if rt.from_crd:
        return
    errors = builtin_errors(rt, obj)
    if errors:
        raise invalid(rt, str((obj.get("metadata") or {}).get("name", "")), errors)


# ------------------------------------------------------------------ nodes

NOT_READY_TAINT: Final = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}


def node_taints(node: JSON) -> None:
    """The node lifecycle controller's taint (in place): ``node.kubernetes.io/not-ready``
    NoSchedule while the Node's Ready condition is not True, removed once it is."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    spec = node.setdefault("spec", {})
    taints = [t for t in spec.get("taints") or [] if t.get("key") != NOT_READY_TAINT["key"]]
    if not ready:
        taints.append(dict(NOT_READY_TAINT))
    if taints:
        spec["taints"] = taints
    else:
        spec.pop("taints", None)
        if not spec:
            node.pop("spec")


# ------------------------------------------------------------------ warnings

_TEMPLATE_KINDS: Final = {
    ("apps", "deployments"): "spec.template.spec",
    ("apps", "statefulsets"): "spec.template.spec",
    ("apps", "daemonsets"): "spec.template.spec",
    ("apps", "replicasets"): "spec.template.spec",
    ("batch", "jobs"): "spec.template.spec",
    ("", "pods"): "spec",
}
DUPLICATE_PORT: Final = "duplicate port name"


def pod_warnings(rt: ResourceType, obj: JSON) -> list[str]:
    """The API server's warnings on a pod spec (pkg/api/pod/warnings.go), as far as emulated:
    a port name used twice in the pod's containers."""
    where = _TEMPLATE_KINDS.get(rt.storage_key)
    if where is None:
        return []
    spec: Any = obj
    for part in where.split("."):
        spec = spec.get(part) if isinstance(spec, dict) else None
    if not isinstance(spec, dict):
        return []
    warnings: list[str] = []
    seen: dict[str, str] = {}
    for i, container in enumerate(spec.get("containers") or []):
        for j, port in enumerate((container or {}).get("ports") or []):
            name = (port or {}).get("name")
            if not name:
                continue
            path = f"{where}.containers[{i}].ports[{j}]"
            if name in seen:
                warnings.append(
                    f"{path}: {DUPLICATE_PORT} {json.dumps(name)} with {seen[name]}, services and "
                    f"probes that select ports by name will use {seen[name]}"
                )
            else:
                seen[name] = path
    return warnings
