"""Readers several sections of the document share: DNS-label names, images, resource
quantities, pool sizes, and `or_default` (a field's value, else its default)."""

from __future__ import annotations

import re
from typing import TypeVar

from disagg_core import quantity
from disagg_core.spec import fields as f
from disagg_core.spec import model as m
from disagg_core.spec.fields import Collector, child

DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_1035_RULE = (
    "use at most 63 lowercase letters, digits and '-', starting with a letter and ending with "
    "a letter or digit (a DNS-1035 label)"
)
_DNS_1123_RULE = (
    "use at most 63 lowercase letters, digits and '-', starting and ending with a letter or "
    "digit (a DNS-1123 label)"
)
T = TypeVar("T")


def dns_label(
    out: Collector, raw: dict[str, object], key: str, path: str, pattern: re.Pattern[str]
) -> str | None:
    """A name that must be a DNS label; returned even when malformed, so that references to
    it still resolve and are not reported a second time."""
    name = f.text(out, raw, key, path)
    if name is None:
        return None
    if not pattern.fullmatch(name) or len(name) > m.MAX_LABEL_LENGTH:
        rule = _DNS_1035_RULE if pattern is DNS_1035_LABEL else _DNS_1123_RULE
        out.add(child(path, key), f"{name!r} is not a valid name: {rule}")
    return name


def image(out: Collector, raw: dict[str, object], path: str) -> str | None:
    image = f.text(out, raw, "image", path)
    if image is not None and any(ch.isspace() for ch in image):
        out.add(child(path, "image"), f"an image reference has no whitespace, got {image!r}")
    return image


def resources(out: Collector, r: dict[str, object], path: str) -> m.Resources:
    path = child(path, "resources")
    res = f.fields(out, r.get("resources", {}), path, known=("requests", "limits")) or {}
    requests = _quantities(out, res, "requests", path)
    limits = _quantities(out, res, "limits", path)
    for name in requests.keys() & limits.keys():
        if quantity.parse_quantity(requests[name]) > quantity.parse_quantity(limits[name]):
            out.add(
                child(child(path, "requests"), name),
                f"request {requests[name]} exceeds the limit {limits[name]}",
            )
    return m.Resources(requests=requests, limits=limits)


def _quantities(out: Collector, res: dict[str, object], key: str, path: str) -> dict[str, str]:
    """A resource-name -> quantity mapping; only the valid entries, as strings."""
    if key not in res:
        return {}
    raw = res[key]
    if not isinstance(raw, dict):
        out.add(child(path, key), f"expected a mapping, got {f.kind_of(raw)}")
        return {}
    result: dict[str, str] = {}
    for name, value in raw.items():
        reason = _resource_problem(name, value)
        if reason is not None:
            out.add(child(child(path, key), str(name)), reason)
        elif isinstance(name, str):
            result[name] = value if isinstance(value, str) else repr(value)
    return result


def _resource_problem(name: object, value: object) -> str | None:
    if not isinstance(name, str) or not name:
        return f"resource names are non-empty strings, got {name!r}"
    try:
        amount = quantity.parse_quantity(value)
    except quantity.QuantityError as error:
        return error.reason
    return f"must not be negative, got {value!r}" if amount < 0 else None


def pool_size(out: Collector, t: dict[str, object], path: str) -> int | None:
    size = f.size(out, t, "poolSize", path)
    if size is not None and size > m.MAX_POOL_SIZE:
        out.add(
            child(path, "poolSize"),
            f"must be at most {quantity.format_bytes(m.MAX_POOL_SIZE)}, "
            f"got {quantity.format_bytes(size)}",
        )
        return None
    return size


def min_block(out: Collector, t: dict[str, object], path: str) -> int | None:
    block = f.size(out, t, "minBlock", path)
    if block is not None and (block <= 0 or block & (block - 1)):
        out.add(
            child(path, "minBlock"), f"must be a power of two, got {quantity.format_bytes(block)}"
        )
        return None
    return block


def or_default(value: T | None, default: T) -> T:
    return default if value is None else value
