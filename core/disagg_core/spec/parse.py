"""Document -> model, field by field: shapes, types, formats and per-object rules.

Each reader below takes one object of the document, records what is wrong with it at
its path and still returns a model object (with defaults or placeholders where a field was
unusable), so that cross-object checks (`checks`) can run on the rest and the user sees
every problem at once. A role or edge whose name fields are unusable gets the name "", which
later checks skip: its own problem has already been reported.
"""

from __future__ import annotations

import copy
import json
import keyword
import re
from typing import TypeVar

from disagg_core import compat, quantity
from disagg_core.spec import fields as f
from disagg_core.spec import limits
from disagg_core.spec import model as m
from disagg_core.spec.fields import Collector, child

TOP_KEYS = ("apiVersion", "kind", "metadata", "spec", "status")
METADATA_KEYS = (
    "name", "namespace", "labels", "annotations", "uid", "resourceVersion", "generation",
    "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "finalizers",
    "managedFields", "ownerReferences", "generateName", "selfLink",
)  # fmt: skip
NETWORK_POLICY_KEYS = ("enabled", "clients", "metricsFrom")
MONITORING_KEYS = ("podMonitor", "tracing")
TRACING_KEYS = ("endpoint", "sampleRatio")
PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")
SELECTOR_KEYS = ("matchLabels", "matchExpressions")
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
SPEC_KEYS = (
    "image", "transport", "roles", "edges", "colocation", "ratioLocks", "networkPolicy",
    "rollout", "gateway", "monitoring",
)  # fmt: skip
ROLLOUT_KEYS = (
    "maxUnavailable", "maxSkew", "partition", "paused", "stepDeadlineSeconds", "groups",
)  # fmt: skip
MAX_ROLLOUT_STEP_DEADLINE_SECONDS = 86_400
GATEWAY_KEYS = (
    "enabled", "replicas", "port", "api", "model", "auth", "resources", "podTemplate",
)  # fmt: skip
RATIO_LOCK_KEYS = ("leader", "follower", "leaderShare", "followerShare", "tolerance")
TRANSPORT_KEYS = (
    "relay",
    "poolSize",
    "minBlock",
    "poolDevice",
    "requestTimeoutSeconds",
    "migrationAttempts",
)
POOL_OVERRIDE_KEYS = ("poolSize", "minBlock", "poolDevice")
ROLE_KEYS = (
    "name", "replicas", "handler", "image", "command", "args", "env", "resources", "ports",
    "transport", "concurrency", "autoscaling", "podTemplate", "handlerArgs", "batching",
    "startupSeconds", "compat", "compatibleWith", "ranks", "nodes", "idempotent",
)  # fmt: skip
BATCHING_KEYS = ("maxBatchSize", "maxWaitMilliseconds")
PORT_KEYS = ("name", "containerPort", "protocol")
AUTOSCALING_KEYS = (
    "minReplicas", "maxReplicas", "targetPoolOccupancy", "scaleUpStabilizationSeconds",
    "scaleDownStabilizationSeconds", "tolerance", "targetQueuePerReplica",
)  # fmt: skip

MAX_TARGET_QUEUE = 10_000
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_ENV_PREFIX = "DISAGG_"  # the contract the operator injects
PORT_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")  # IANA_SVC_NAME, also <= 15 chars
MAX_PORT_NAME_LENGTH = 15
_DNS_1035_RULE = (
    "use at most 63 lowercase letters, digits and '-', starting with a letter and ending with "
    "a letter or digit (a DNS-1035 label)"
)
_DNS_1123_RULE = (
    "use at most 63 lowercase letters, digits and '-', starting and ending with a letter or "
    "digit (a DNS-1123 label)"
)
T = TypeVar("T")


def parse_document(doc: object) -> tuple[m.Pipeline, Collector]:
    """The pipeline a document describes and the problems found reading it."""
    out = Collector()
    required = ("apiVersion", "kind", "metadata", "spec")
    top = f.fields(out, doc, "", known=TOP_KEYS, required=required)
    if top is None:
        return m.Pipeline(name=""), out
    _expect(out, top, "apiVersion", m.API_VERSION)
    _expect(out, top, "kind", m.KIND)
    meta = _section(out, top, "metadata", known=METADATA_KEYS, required=("name",))
    name = _pipeline_name(out, meta)
    namespace = _dns_label(out, meta, "namespace", "metadata", DNS_1123_LABEL)
    labels = f.string_map(out, meta, "labels", "metadata")
    annotations = f.string_map(out, meta, "annotations", "metadata")
    spec = _section(out, top, "spec", known=SPEC_KEYS, required=("roles",))
    image = _image(out, spec, "spec")
    transport = _transport(out, spec.get("transport", {}), "spec.transport")
    roles = tuple(_role(out, raw, path) for path, raw in f.items(out, spec, "roles", "spec"))
    if isinstance(spec.get("roles"), list) and not roles:
        out.add("spec.roles", "a pipeline needs at least one role")
    edges = tuple(_edge(out, raw, path) for path, raw in f.items(out, spec, "edges", "spec"))
    groups = [_group(out, raw, path) for path, raw in f.items(out, spec, "colocation", "spec")]
    locks = [_ratio_lock(out, raw, path) for path, raw in f.items(out, spec, "ratioLocks", "spec")]
    network = _network_policy(out, spec.get("networkPolicy", {}), "spec.networkPolicy")
    rollout = _rollout(out, spec.get("rollout", {}), "spec.rollout")
    gateway = _gateway(out, spec.get("gateway", {}), "spec.gateway")
    monitoring = _monitoring(out, spec.get("monitoring", {}), "spec.monitoring")
    pipeline = m.Pipeline(
        name=name,
        namespace=namespace,
        labels=labels,
        annotations=annotations,
        image=image,
        transport=transport,
        roles=roles,
        edges=edges,
        colocation=tuple(groups),
        ratio_locks=tuple(lock for lock in locks if lock is not None),
        network_policy=network,
        rollout=rollout,
        gateway=gateway,
        monitoring=monitoring,
    )
    return pipeline, out


def _section(
    out: Collector,
    top: dict[str, object],
    key: str,
    *,
    known: tuple[str, ...],
    required: tuple[str, ...],
) -> dict[str, object]:
    """A top-level mapping; {} when it is missing (already reported) or not a mapping."""
    if key not in top:
        return {}
    return f.fields(out, top[key], key, known=known, required=required) or {}


def _expect(out: Collector, top: dict[str, object], key: str, wanted: str) -> None:
    value = f.text(out, top, key, "")
    if value is not None and value != wanted:
        out.add(key, f"must be {wanted!r}, got {value!r}")


def _pipeline_name(out: Collector, meta: dict[str, object]) -> str:
    name = _dns_label(out, meta, "name", "metadata", DNS_1035_LABEL) or ""
    if len(name) > m.MAX_PIPELINE_NAME_LENGTH and not out.flawed("metadata.name"):
        out.add(
            "metadata.name",
            f"{name!r} has {len(name)} characters; a pipeline name may have at most "
            f"{m.MAX_PIPELINE_NAME_LENGTH} (role and group names are appended to it)",
        )
    return name


def _dns_label(
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


def _image(out: Collector, raw: dict[str, object], path: str) -> str | None:
    image = f.text(out, raw, "image", path)
    if image is not None and any(ch.isspace() for ch in image):
        out.add(child(path, "image"), f"an image reference has no whitespace, got {image!r}")
    return image


def _transport(out: Collector, raw: object, path: str) -> m.Transport:
    t = f.fields(out, raw, path, known=TRANSPORT_KEYS) or {}
    timeout = f.number(out, t, "requestTimeoutSeconds", path)
    if timeout is not None and not 0 < timeout <= m.MAX_REQUEST_TIMEOUT_SECONDS:
        out.add(
            child(path, "requestTimeoutSeconds"),
            f"must be positive and at most {m.MAX_REQUEST_TIMEOUT_SECONDS:g}, got {timeout:g}",
        )
        timeout = None
    default = m.Transport()
    return m.Transport(
        relay=f.choice(out, t, "relay", path, m.RELAYS) or default.relay,
        pool_size=_or(_pool_size(out, t, path), default.pool_size),
        min_block=_or(_min_block(out, t, path), default.min_block),
        pool_device=f.choice(out, t, "poolDevice", path, m.POOL_DEVICES) or default.pool_device,
        request_timeout_seconds=_or(timeout, default.request_timeout_seconds),
        migration_attempts=_or(
            f.integer(
                out, t, "migrationAttempts", path, minimum=0, maximum=m.MAX_MIGRATION_ATTEMPTS
            ),
            default.migration_attempts,
        ),
    )


def _rollout(out: Collector, raw: object, path: str) -> m.Rollout:
    r = f.fields(out, raw, path, known=ROLLOUT_KEYS) or {}
    default = m.Rollout()
    skew = f.int_or_percent(out, r, "maxSkew", path, minimum=1, max_percent=100)
    deadline = f.integer(out, r, "stepDeadlineSeconds", path, minimum=1)
    if deadline is not None and deadline > MAX_ROLLOUT_STEP_DEADLINE_SECONDS:
        out.add(
            child(path, "stepDeadlineSeconds"),
            f"must be at most {MAX_ROLLOUT_STEP_DEADLINE_SECONDS}, got {deadline}",
        )
        deadline = None
    groups = []
    for group_path, group in f.items(out, r, "groups", path):
        if not isinstance(group, list) or not all(isinstance(x, str) and x for x in group):
            out.add(group_path, "expected a list of role names")
        elif long := [k for k, x in enumerate(group) if len(x) > m.MAX_LABEL_LENGTH]:
            out.add(f"{group_path}[{long[0]}]", f"at most {m.MAX_LABEL_LENGTH} characters")
        elif len(group) < 2:
            out.add(group_path, f"a rollout group needs at least 2 roles, got {len(group)}")
        elif len(group) > (most := limits.MAX_ITEMS["spec.rollout.groups[]"]):
            out.add(group_path, f"at most {most} items, got {len(group)}")
        else:
            groups.append(tuple(group))
    return m.Rollout(
        max_unavailable=_or(
            f.int_or_percent(out, r, "maxUnavailable", path, minimum=1, max_percent=100),
            default.max_unavailable,
        ),
        max_skew=_or(skew, default.max_skew),
        partition=_or(
            f.int_or_percent(out, r, "partition", path, max_percent=100), default.partition
        ),
        paused=_or(f.boolean(out, r, "paused", path), False),
        step_deadline_seconds=_or(deadline, default.step_deadline_seconds),
        groups=tuple(groups),
    )


def _pool_override(out: Collector, raw: object, path: str) -> m.PoolOverride:
    t = f.fields(out, raw, path, known=POOL_OVERRIDE_KEYS) or {}
    return m.PoolOverride(
        pool_size=_pool_size(out, t, path),
        min_block=_min_block(out, t, path),
        pool_device=f.choice(out, t, "poolDevice", path, m.POOL_DEVICES),
    )


def _pool_size(out: Collector, t: dict[str, object], path: str) -> int | None:
    size = f.size(out, t, "poolSize", path)
    if size is not None and size > m.MAX_POOL_SIZE:
        out.add(
            child(path, "poolSize"),
            f"must be at most {quantity.format_bytes(m.MAX_POOL_SIZE)}, "
            f"got {quantity.format_bytes(size)}",
        )
        return None
    return size


def _min_block(out: Collector, t: dict[str, object], path: str) -> int | None:
    block = f.size(out, t, "minBlock", path)
    if block is not None and (block <= 0 or block & (block - 1)):
        out.add(
            child(path, "minBlock"), f"must be a power of two, got {quantity.format_bytes(block)}"
        )
        return None
    return block


def _role(out: Collector, raw: object, path: str) -> m.Role:
    r = f.fields(out, raw, path, known=ROLE_KEYS, required=("name", "handler"))
    if r is None:
        return m.Role(name="", handler="")
    autoscaling = None
    if "autoscaling" in r:
        autoscaling = _autoscaling(out, r["autoscaling"], child(path, "autoscaling"))
    replicas = f.integer(out, r, "replicas", path, minimum=0, maximum=m.MAX_REPLICAS)
    default_replicas = m.DEFAULT_REPLICAS if autoscaling is None else autoscaling.min_replicas
    return m.Role(
        name=_dns_label(out, r, "name", path, DNS_1035_LABEL) or "",
        handler=_handler(out, r, path),
        replicas=_or(replicas, default_replicas),
        image=_image(out, r, path),
        command=f.texts(out, r, "command", path),
        args=f.texts(out, r, "args", path),
        env=_env(out, r, path),
        resources=_resources(out, r, path),
        ports=_ports(out, r, path),
        transport=_pool_override(out, r.get("transport", {}), child(path, "transport")),
        concurrency=_or(
            f.integer(out, r, "concurrency", path, minimum=1, maximum=m.MAX_CONCURRENCY),
            m.DEFAULT_CONCURRENCY,
        ),
        autoscaling=autoscaling,
        pod_template=copy.deepcopy(f.free_mapping(out, r, "podTemplate", path)),
        handler_args=_handler_args(out, r, path),
        batching=_batching(out, r, path),
        startup_seconds=_or(
            f.integer(out, r, "startupSeconds", path, minimum=1), m.DEFAULT_STARTUP_SECONDS
        ),
        compat=_compat_token(out, r["compat"], child(path, "compat")) if "compat" in r else None,
        compatible_with=_compatible_with(out, r, path),
        ranks=_or(
            f.integer(out, r, "ranks", path, minimum=1, maximum=limits.MAX_RANKS), m.DEFAULT_RANKS
        ),
        nodes=_or(
            f.integer(out, r, "nodes", path, minimum=1, maximum=limits.MAX_NODES), m.DEFAULT_NODES
        ),
        idempotent=_or(f.boolean(out, r, "idempotent", path), True),
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
        max_batch_size=_or(size, 1),
        max_wait_milliseconds=_or(wait, m.DEFAULT_MAX_BATCH_WAIT_MILLISECONDS),
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


def _resources(out: Collector, r: dict[str, object], path: str) -> m.Resources:
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
        min_replicas=_or(low, 1),
        max_replicas=_or(high, max(1, low or 1)),
        target_pool_occupancy=_or(target, m.DEFAULT_TARGET_POOL_OCCUPANCY),
        scale_up_stabilization_seconds=_or(up, m.DEFAULT_SCALE_UP_STABILIZATION_SECONDS),
        scale_down_stabilization_seconds=_or(down, m.DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS),
        tolerance=_or(tolerance, m.DEFAULT_TOLERANCE),
        target_queue_per_replica=None
        if queue is None or not 0 < queue <= MAX_TARGET_QUEUE
        else queue,
    )


def _edge(out: Collector, raw: object, path: str) -> m.Edge:
    e = f.fields(
        out, raw, path, known=("from", "to", "relay", "tensorRefs"), required=("from", "to")
    )
    if e is None:
        return m.Edge(source="", target="")
    return m.Edge(
        source=f.text(out, e, "from", path) or "",
        target=f.text(out, e, "to", path) or "",
        relay=f.choice(out, e, "relay", path, m.RELAYS),
        tensor_refs=_tensor_refs(out, e, path),
    )


def _tensor_refs(out: Collector, e: dict[str, object], path: str) -> tuple[m.TensorRef, ...]:
    refs: list[m.TensorRef] = []
    seen: list[tuple[tuple[m.PathStep, ...], str]] = []
    for item_path, raw in f.items(out, e, "tensorRefs", path):
        t = f.fields(out, raw, item_path, known=("path", "to"), required=("path", "to"))
        if t is None:
            continue
        ref = m.TensorRef(
            path=f.text(out, t, "path", item_path) or "", to=f.text(out, t, "to", item_path) or ""
        )
        if ref.path:
            steps = _payload_path(out, ref.path, child(item_path, "path"), seen)
            if steps is not None:
                seen.append((steps, child(item_path, "path")))
        refs.append(ref)
    return tuple(refs)


def _payload_path(
    out: Collector, path: str, where: str, seen: list[tuple[tuple[m.PathStep, ...], str]]
) -> tuple[m.PathStep, ...] | None:
    try:
        steps = m.parse_payload_path(path)
    except ValueError as error:
        out.add(where, f"malformed payload path: {error} (e.g. 'latents' or 'a.b[0]')")
        return None
    for other, other_where in seen:
        shorter = min(len(steps), len(other))
        if steps[:shorter] == other[:shorter]:
            out.add(where, f"{path!r} overlaps the tensor reference at {other_where}")
            return None
    return steps


def _group(out: Collector, raw: object, path: str) -> m.ColocationGroup:
    g = f.fields(out, raw, path, known=("name", "roles"), required=("roles",))
    if g is None:
        return m.ColocationGroup(name="", roles=())
    roles = f.texts(out, g, "roles", path) or ()
    listed = g.get("roles")
    if isinstance(listed, list) and len(listed) < 2:
        out.add(
            child(path, "roles"), f"a colocation group needs at least 2 roles, got {len(roles)}"
        )
    name = _dns_label(out, g, "name", path, DNS_1035_LABEL)
    return m.ColocationGroup(name=name or (roles[0] if roles else ""), roles=roles)


def _ratio_lock(out: Collector, raw: object, path: str) -> m.RatioLockSpec | None:
    r = f.fields(out, raw, path, known=RATIO_LOCK_KEYS, required=("leader", "follower"))
    if r is None:
        return None
    leader = f.text(out, r, "leader", path)
    follower = f.text(out, r, "follower", path)
    if leader is not None and leader == follower:
        out.add(child(path, "follower"), f"a role cannot be locked to itself ({leader!r})")
    tolerance = f.number(out, r, "tolerance", path)
    if tolerance is not None and not 0 <= tolerance < 1:
        out.add(child(path, "tolerance"), f"must be in [0, 1), got {tolerance}")
    return m.RatioLockSpec(
        leader=leader or "",
        follower=follower or "",
        leader_share=_or(_share(out, r, "leaderShare", path), 1),
        follower_share=_or(_share(out, r, "followerShare", path), 1),
        tolerance=_or(tolerance, 0.0),
    )


def _share(out: Collector, r: dict[str, object], key: str, path: str) -> int | None:
    return f.integer(out, r, key, path, minimum=1, maximum=m.MAX_RATIO_SHARE)


def _monitoring(out: Collector, raw: object, path: str) -> m.Monitoring:
    n = f.fields(out, raw, path, known=MONITORING_KEYS) or {}
    tracing = _tracing(out, n["tracing"], f.child(path, "tracing")) if "tracing" in n else None
    return m.Monitoring(pod_monitor=f.boolean(out, n, "podMonitor", path), tracing=tracing)


def _tracing(out: Collector, raw: object, path: str) -> m.Tracing | None:
    n = f.fields(out, raw, path, known=TRACING_KEYS) or {}
    endpoint = f.text(out, n, "endpoint", path)
    if "endpoint" not in n:
        out.add(f.child(path, "endpoint"), "required: the OTLP/HTTP endpoint, http(s)://host:port")
    elif endpoint is not None and not endpoint.startswith(("http://", "https://")):
        out.add(f.child(path, "endpoint"), f"must be an http:// or https:// URL, got {endpoint!r}")
        endpoint = None
    ratio = f.number(out, n, "sampleRatio", path)
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        out.add(f.child(path, "sampleRatio"), f"must be within 0..1, got {ratio}")
        ratio = None
    if endpoint is None:
        return None
    return m.Tracing(
        endpoint=endpoint,
        sample_ratio=m.DEFAULT_TRACE_SAMPLE_RATIO if ratio is None else ratio,
    )


def _network_policy(out: Collector, raw: object, path: str) -> m.NetworkPolicy:
    n = f.fields(out, raw, path, known=NETWORK_POLICY_KEYS) or {}
    enabled = f.boolean(out, n, "enabled", path)
    return m.NetworkPolicy(
        enabled=_or(enabled, True),
        clients=_peers(out, n, "clients", path),
        metrics_from=_peers(out, n, "metricsFrom", path),
    )


def _peers(
    out: Collector, n: dict[str, object], key: str, path: str
) -> tuple[dict[str, object], ...]:
    """NetworkPolicyPeers: their shape only (the API server checks the rest)."""
    result: list[dict[str, object]] = []
    for item_path, raw in f.items(out, n, key, path):
        peer = f.fields(out, raw, item_path, known=PEER_KEYS)
        if peer is None:
            continue
        if not peer:
            out.add(
                item_path,
                f"name at least one of {', '.join(PEER_KEYS)} (an empty peer admits everyone)",
            )
            continue
        for selector in ("podSelector", "namespaceSelector"):
            if selector in peer:
                _selector(out, peer[selector], child(item_path, selector))
        if "ipBlock" in peer:
            block = (
                f.fields(
                    out,
                    peer["ipBlock"],
                    child(item_path, "ipBlock"),
                    known=("cidr", "except"),
                    required=("cidr",),
                )
                or {}
            )
            f.text(out, block, "cidr", child(item_path, "ipBlock"))
            f.texts(out, block, "except", child(item_path, "ipBlock"))
        result.append(copy.deepcopy(peer))
    return tuple(result)


def _selector(out: Collector, raw: object, path: str) -> None:
    s = f.fields(out, raw, path, known=SELECTOR_KEYS) or {}
    f.string_map(out, s, "matchLabels", path)
    for item_path, item in f.items(out, s, "matchExpressions", path):
        e = f.fields(
            out, item, item_path, known=("key", "operator", "values"), required=("key", "operator")
        )
        if e is not None:
            f.text(out, e, "key", item_path)
            f.choice(out, e, "operator", item_path, SELECTOR_OPERATORS)
            f.texts(out, e, "values", item_path)


def _gateway(out: Collector, raw: object, path: str) -> m.Gateway:
    g = f.fields(out, raw, path, known=GATEWAY_KEYS) or {}
    enabled = g.get("enabled", True)
    if not isinstance(enabled, bool):
        out.add(child(path, "enabled"), f"expected true or false, got {f.kind_of(enabled)}")
        enabled = True
    port = f.integer(out, g, "port", path, minimum=1)
    if port is not None and port > 65535:
        out.add(child(path, "port"), f"must be in 1..65535, got {port}")
        port = None
    api = f.choice(out, g, "api", path, m.GATEWAY_APIS) or "native"
    model = f.text(out, g, "model", path)
    if api == "openai" and model is None and not out.flawed(child(path, "model")):
        out.add(child(path, "model"), "required with api: openai (the name clients ask for)")
    auth = None
    if "auth" in g:
        auth = _gateway_auth(out, g["auth"], child(path, "auth"))
    return m.Gateway(
        enabled=enabled,
        replicas=_or(f.integer(out, g, "replicas", path, minimum=0), m.DEFAULT_GATEWAY_REPLICAS),
        port=_or(port, m.DEFAULT_GATEWAY_PORT),
        api=api,
        model=model,
        auth=auth,
        resources=_resources(out, g, path),
        pod_template=copy.deepcopy(f.free_mapping(out, g, "podTemplate", path)),
    )


def _gateway_auth(out: Collector, raw: object, path: str) -> m.SecretKeyRef | None:
    a = f.fields(out, raw, path, known=("secretRef",), required=("secretRef",))
    if a is None or "secretRef" not in a:
        return None
    ref_path = child(path, "secretRef")
    ref = f.fields(out, a["secretRef"], ref_path, known=("name", "key"), required=("name",))
    if ref is None:
        return None
    name = _dns_label(out, ref, "name", ref_path, DNS_1123_LABEL)
    key = f.text(out, ref, "key", ref_path) or m.DEFAULT_TOKEN_KEY
    return m.SecretKeyRef(name=name, key=key) if name else None


def _or(value: T | None, default: T) -> T:
    return default if value is None else value
