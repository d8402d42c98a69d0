"""The pipeline-wide sections: `spec.transport`, `spec.gateway`, `spec.networkPolicy` and
`spec.monitoring`."""

from __future__ import annotations

import copy

from disagg_core.spec import fields as f
from disagg_core.spec import model as m
from disagg_core.spec.fields import Collector, child
from disagg_core.spec.parse_common import (
    DNS_1123_LABEL,
    dns_label,
    min_block,
    or_default,
    pool_size,
    resources,
)

TRANSPORT_KEYS = (
    "relay",
    "poolSize",
    "minBlock",
    "poolDevice",
    "requestTimeoutSeconds",
    "migrationAttempts",
)
GATEWAY_KEYS = (
    "enabled", "replicas", "port", "api", "model", "auth", "resources", "podTemplate",
)  # fmt: skip
NETWORK_POLICY_KEYS = ("enabled", "clients", "metricsFrom")
MONITORING_KEYS = ("podMonitor", "tracing")
TRACING_KEYS = ("endpoint", "sampleRatio")
PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")
SELECTOR_KEYS = ("matchLabels", "matchExpressions")
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def transport(out: Collector, raw: object, path: str) -> m.Transport:
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
        pool_size=or_default(pool_size(out, t, path), default.pool_size),
        min_block=or_default(min_block(out, t, path), default.min_block),
        pool_device=f.choice(out, t, "poolDevice", path, m.POOL_DEVICES) or default.pool_device,
        request_timeout_seconds=or_default(timeout, default.request_timeout_seconds),
        migration_attempts=or_default(
            f.integer(
                out, t, "migrationAttempts", path, minimum=0, maximum=m.MAX_MIGRATION_ATTEMPTS
            ),
            default.migration_attempts,
        ),
    )


def gateway(out: Collector, raw: object, path: str) -> m.Gateway:
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
        replicas=or_default(
            f.integer(out, g, "replicas", path, minimum=0), m.DEFAULT_GATEWAY_REPLICAS
        ),
        port=or_default(port, m.DEFAULT_GATEWAY_PORT),
        api=api,
        model=model,
        auth=auth,
        resources=resources(out, g, path),
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
    name = dns_label(out, ref, "name", ref_path, DNS_1123_LABEL)
    key = f.text(out, ref, "key", ref_path) or m.DEFAULT_TOKEN_KEY
    return m.SecretKeyRef(name=name, key=key) if name else None


def network_policy(out: Collector, raw: object, path: str) -> m.NetworkPolicy:
    n = f.fields(out, raw, path, known=NETWORK_POLICY_KEYS) or {}
    enabled = f.boolean(out, n, "enabled", path)
    return m.NetworkPolicy(
        enabled=or_default(enabled, True),
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


def monitoring(out: Collector, raw: object, path: str) -> m.Monitoring:
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
