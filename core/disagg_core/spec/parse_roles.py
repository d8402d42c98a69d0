"""`spec.roles[]`: one role and its parts (handler, env, ports, resources, autoscaling,
batching, compat tokens, pool override)."""

from __future__ import annotations

import copy
import json
import keyword
import re

from disagg_core import compat
from disagg_core.spec import fields as f
from disagg_core.spec import limits
from disagg_core.spec import model as m
from disagg_core.spec.engines import Engine
from disagg_core.spec.fields import Collector, child
from disagg_core.spec.parse_common import (
    DNS_1035_LABEL,
    dns_label,
    image,
    min_block,
    or_default,
    pool_size,
    resources,
)
from disagg_core.spec.parse_engine import engine

ROLE_KEYS = (
    "name", "replicas", "handler", "image", "command", "args", "env", "resources", "ports",
    "transport", "concurrency", "autoscaling", "podTemplate", "handlerArgs", "batching",
    "startupSeconds", "compat", "compatibleWith", "ranks", "nodes", "idempotent",
    "engine",
)  # fmt: skip
BATCHING_KEYS = ("maxBatchSize", "maxWaitMilliseconds")
PORT_KEYS = ("name", "containerPort", "protocol")
AUTOSCALING_KEYS = (
    "minReplicas", "maxReplicas", "targetPoolOccupancy", "scaleUpStabilizationSeconds",
    "scaleDownStabilizationSeconds", "tolerance", "targetQueuePerReplica",
)  # fmt: skip
POOL_OVERRIDE_KEYS = ("poolSize", "minBlock", "poolDevice")
MAX_TARGET_QUEUE = 10_000
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_ENV_PREFIX = "DISAGG_"  # the contract the operator injects
PORT_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")  # IANA_SVC_NAME, also <= 15 chars
MAX_PORT_NAME_LENGTH = 15


def role(out: Collector, raw: object, path: str) -> m.Role:
    r = f.fields(out, raw, path, known=ROLE_KEYS, required=("name",))
    if r is None:
        return m.Role(name="", handler="")
    runs = _engine(out, r, path)
    autoscaling = None
    if "autoscaling" in r:
        autoscaling = _autoscaling(out, r["autoscaling"], child(path, "autoscaling"))
    replicas = f.integer(out, r, "replicas", path, minimum=0, maximum=m.MAX_REPLICAS)
    default_replicas = m.DEFAULT_REPLICAS if autoscaling is None else autoscaling.min_replicas
    return m.Role(
        name=dns_label(out, r, "name", path, DNS_1035_LABEL) or "",
        handler=_handler(out, r, path) if runs is None else "",
        replicas=or_default(replicas, default_replicas),
        image=image(out, r, path),
        command=f.texts(out, r, "command", path),
        args=f.texts(out, r, "args", path),
        env=_env(out, r, path),
        resources=resources(out, r, path),
        ports=_ports(out, r, path),
        transport=_pool_override(out, r.get("transport", {}), child(path, "transport")),
        concurrency=or_default(
            f.integer(out, r, "concurrency", path, minimum=1, maximum=m.MAX_CONCURRENCY),
            m.DEFAULT_CONCURRENCY,
        ),
        autoscaling=autoscaling,
        pod_template=copy.deepcopy(f.free_mapping(out, r, "podTemplate", path)),
        handler_args=_handler_args(out, r, path),
        batching=_batching(out, r, path),
        startup_seconds=or_default(
            f.integer(out, r, "startupSeconds", path, minimum=1), m.DEFAULT_STARTUP_SECONDS
        ),
        compat=_compat_token(out, r["compat"], child(path, "compat")) if "compat" in r else None,
        compatible_with=_compatible_with(out, r, path),
        ranks=or_default(
            f.integer(out, r, "ranks", path, minimum=1, maximum=limits.MAX_RANKS), m.DEFAULT_RANKS
        ),
        nodes=or_default(
            f.integer(out, r, "nodes", path, minimum=1, maximum=limits.MAX_NODES), m.DEFAULT_NODES
        ),
        idempotent=or_default(f.boolean(out, r, "idempotent", path), True),
        engine=runs,
    )


# Fields that configure a handler and mean nothing to an engine.
HANDLER_ONLY_KEYS = ("handler", "handlerArgs", "batching", "nodes")


def _engine(out: Collector, r: dict[str, object], path: str) -> Engine | None:
    """`engine`, else None; a role runs a handler or an engine: exactly one is required."""
    if "engine" not in r:
        if "handler" not in r:
            out.add(child(path, "handler"), "required field missing (or set engine)")
        return None
    where = child(path, "engine")
    for key in HANDLER_ONLY_KEYS:
        if key in r and not (key == "nodes" and r[key] == 1):
            what = "more than one pod per replica" if key == "nodes" else key
            out.add(child(path, key), f"a role with an engine takes no {what}; remove it")
    return engine(out, r["engine"], where)


def _pool_override(out: Collector, raw: object, path: str) -> m.PoolOverride:
    t = f.fields(out, raw, path, known=POOL_OVERRIDE_KEYS) or {}
    return m.PoolOverride(
        pool_size=pool_size(out, t, path),
        min_block=min_block(out, t, path),
        pool_device=f.choice(out, t, "poolDevice", path, m.POOL_DEVICES),
    )


def _compat_token(out: Collector, value: object, path: str) -> str | None:
    try:
        return compat.check_token(value, path)
    except compat.CompatError as error:
        out.add(path, str(error).removeprefix(f"{path}: "))
        return None


def _compatible_with(out: Collector, r: dict[str, object], path: str) -> tuple[str, ...]:
    """`compatibleWith`: further compat tokens this revision interoperates with."""
    found = [_compat_token(out, item, p) for p, item in f.items(out, r, "compatibleWith", path)]
    if len(found) > compat.MAX_ACCEPTS:
        out.add(child(path, "compatibleWith"), f"at most {compat.MAX_ACCEPTS} tokens")
        return ()
    return tuple(dict.fromkeys(t for t in found if t is not None))


def _handler_args(out: Collector, r: dict[str, object], path: str) -> dict[str, object]:
    """`handlerArgs`: a mapping that is plain JSON (it reaches the role as JSON text)."""
    value = f.free_mapping(out, r, "handlerArgs", path)
    if value is None:
        return {}
    try:
        return dict(json.loads(json.dumps(value, allow_nan=False)))
    except (TypeError, ValueError) as error:
        out.add(child(path, "handlerArgs"), f"must be plain JSON (strings, numbers, ...): {error}")
        return {}


def _batching(out: Collector, r: dict[str, object], path: str) -> m.Batching | None:
    if "batching" not in r:
        return None
    path = child(path, "batching")
    b = f.fields(out, r["batching"], path, known=BATCHING_KEYS, required=("maxBatchSize",))
    if b is None:
        return None
    size = f.integer(out, b, "maxBatchSize", path, minimum=1)
    wait = f.number(out, b, "maxWaitMilliseconds", path)
    if wait is not None and not 0 <= wait <= 60_000:
        out.add(child(path, "maxWaitMilliseconds"), f"must be in [0, 60000], got {wait:g}")
        wait = None
    return m.Batching(
        max_batch_size=or_default(size, 1),
        max_wait_milliseconds=or_default(wait, m.DEFAULT_MAX_BATCH_WAIT_MILLISECONDS),
    )


def _handler(out: Collector, r: dict[str, object], path: str) -> str:
    handler = f.text(out, r, "handler", path)
    if handler is None:
        return ""
    module, colon, attr = handler.partition(":")
    if not (colon and _dotted(module) and _dotted(attr) and "." not in attr):
        out.add(
            child(path, "handler"),
            "expected 'package.module:function' (a dotted module path, ':', one function "
            f"name; all Python identifiers), got {handler!r}",
        )
    return handler


def _dotted(name: str) -> bool:
    parts = name.split(".")
    return all(part.isidentifier() and not keyword.iskeyword(part) for part in parts)


def _env(out: Collector, r: dict[str, object], path: str) -> tuple[m.EnvSetting, ...]:
    result: list[m.EnvSetting] = []
    seen: set[str] = set()
    for item_path, raw in f.items(out, r, "env", path):
        e = f.fields(out, raw, item_path, known=("name", "value", "valueFrom"), required=("name",))
        if e is None:
            continue
        name = f.text(out, e, "name", item_path) or ""
        _check_env_name(out, name, child(item_path, "name"), seen)
        value = e.get("value", "")
        if not isinstance(value, str):
            out.add(
                child(item_path, "value"), f"expected a string (quote it), got {f.kind_of(value)}"
            )
            value = ""
        value_from = f.free_mapping(out, e, "valueFrom", item_path)
        if "value" in e and value_from is not None:
            out.add(item_path, "set either value or valueFrom, not both")
        result.append(m.EnvSetting(name=name, value=value, value_from=value_from))
    return tuple(result)


def _check_env_name(out: Collector, name: str, path: str, seen: set[str]) -> None:
    if not name:
        return  # missing or not a string: reported already
    if not ENV_NAME.fullmatch(name):
        out.add(path, f"{name!r} is not a valid variable name (letters, digits, '_')")
    elif name.startswith(RESERVED_ENV_PREFIX):
        out.add(path, f"{name!r}: the {RESERVED_ENV_PREFIX} prefix is reserved for the contract")
    elif name in seen:
        out.add(path, f"duplicate variable {name!r}")
    seen.add(name)


def _ports(out: Collector, r: dict[str, object], path: str) -> tuple[m.Port, ...]:
    result: list[m.Port] = []
    names: dict[object, str] = {}
    numbers: dict[object, str] = {}
    for item_path, raw in f.items(out, r, "ports", path):
        p = f.fields(out, raw, item_path, known=PORT_KEYS, required=("name", "containerPort"))
        if p is None:
            continue
        port = m.Port(
            name=_port_name(out, p, item_path),
            container_port=_port_number(out, p, item_path),
            protocol=f.choice(out, p, "protocol", item_path, m.PORT_PROTOCOLS) or "TCP",
        )
        if port.name:
            _once(out, names, port.name, child(item_path, "name"), f"port name {port.name!r}")
        if port.container_port:
            number_key = (port.container_port, port.protocol)
            what = f"port {port.container_port}/{port.protocol}"
            _once(out, numbers, number_key, child(item_path, "containerPort"), what)
        result.append(port)
    return tuple(result)


def _once(out: Collector, seen: dict[object, str], key: object, path: str, what: str) -> None:
    """Record `key` as used at `path`; report it if it was used before."""
    if key in seen:
        out.add(path, f"duplicate {what} (also at {seen[key]})")
    else:
        seen[key] = path


def _port_name(out: Collector, p: dict[str, object], path: str) -> str:
    name = f.text(out, p, "name", path)
    if name is None:
        return ""
    valid = PORT_NAME.fullmatch(name) and "--" not in name and any(c.isalpha() for c in name)
    if not valid or len(name) > MAX_PORT_NAME_LENGTH:
        out.add(
            child(path, "name"),
            f"{name!r} is not a valid port name: at most {MAX_PORT_NAME_LENGTH} lowercase "
            "letters, digits and single '-', with at least one letter",
        )
    return name


def _port_number(out: Collector, p: dict[str, object], path: str) -> int:
    number = f.integer(out, p, "containerPort", path)
    if number is not None and not 1 <= number <= 65535:
        out.add(child(path, "containerPort"), f"must be in 1..65535, got {number}")
        return 0
    return number or 0


def _autoscaling(out: Collector, raw: object, path: str) -> m.Autoscaling | None:
    a = f.fields(out, raw, path, known=AUTOSCALING_KEYS, required=("maxReplicas",))
    if a is None:
        return None
    low = f.integer(out, a, "minReplicas", path, minimum=1, maximum=m.MAX_REPLICAS)
    high = f.integer(out, a, "maxReplicas", path, minimum=1, maximum=m.MAX_REPLICAS)
    if low is not None and high is not None and low > high:
        out.add(child(path, "minReplicas"), f"minReplicas {low} is greater than maxReplicas {high}")
    target = f.number(out, a, "targetPoolOccupancy", path)
    if target is not None and not 0 < target <= 1:
        out.add(child(path, "targetPoolOccupancy"), f"must be in (0, 1], got {target}")
    tolerance = f.number(out, a, "tolerance", path)
    if tolerance is not None and not 0 <= tolerance < 1:
        out.add(child(path, "tolerance"), f"must be in [0, 1), got {tolerance}")
    queue = f.number(out, a, "targetQueuePerReplica", path)
    if queue is not None and not 0 < queue <= MAX_TARGET_QUEUE:
        out.add(
            child(path, "targetQueuePerReplica"), f"must be in (0, {MAX_TARGET_QUEUE}], got {queue}"
        )
    most = m.MAX_STABILIZATION_SECONDS
    up = f.integer(out, a, "scaleUpStabilizationSeconds", path, minimum=0, maximum=most)
    down = f.integer(out, a, "scaleDownStabilizationSeconds", path, minimum=0, maximum=most)
    return m.Autoscaling(
        min_replicas=or_default(low, 1),
        max_replicas=or_default(high, max(1, low or 1)),
        target_pool_occupancy=or_default(target, m.DEFAULT_TARGET_POOL_OCCUPANCY),
        scale_up_stabilization_seconds=or_default(up, m.DEFAULT_SCALE_UP_STABILIZATION_SECONDS),
        scale_down_stabilization_seconds=or_default(
            down, m.DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS
        ),
        tolerance=or_default(tolerance, m.DEFAULT_TOLERANCE),
        target_queue_per_replica=None
        if queue is None or not 0 < queue <= MAX_TARGET_QUEUE
        else queue,
    )
