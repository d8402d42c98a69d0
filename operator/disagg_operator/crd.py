"""The DisaggregatedPipeline CustomResourceDefinition, built from the spec module's names,
enums and defaults. The checked-in YAML (crds/ and the chart's copy) is generated from here
by `make generate`; `make verify` fails when it is stale (see `generate`).

What the schema checks: types, enums, formats (names, quantities, payload paths), ranges,
uniqueness (list-map keys: role names, env names, port names, edge from/to pairs; set:
a group's roles) and, through CEL rules, what relates fields: autoscaling min <= max, edges
and tensor references and groups naming declared roles, no self-loop, an entry role, a role
in at most one group, derived names within 52 characters, cuda-ipc only inside a group.
What only the operator's validator (`disagg_core.spec`) checks, reported in the status:
cycles, tensor references that do not lead downstream or overlap, pool size vs minimum block,
requests vs limits, equal replicas/autoscaling/ports inside a group, handler keywords.

Defaults are the spec module's; where the parser's default depends on other fields (a role's
`replicas` follows `autoscaling.minReplicas`, a group's `name` its first role) there is none,
so that the stored object means the same as the one written. List sizes and string lengths
are bounded (`MAX_*`) so that the API server can bound the cost of the CEL rules.
"""

from __future__ import annotations

from typing import Any, Final

import yaml

from disagg_core import autoscale, compat, quantity, relays
from disagg_core.spec import MAX_ROLLOUT_STEP_DEADLINE_SECONDS, MAX_TARGET_QUEUE, limits
from disagg_core.spec import model as m
from disagg_operator import names

Schema = dict[str, Any]

MAX_CONDITIONS: Final = 8
MAX_SCALE_DECISIONS: Final = 50

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


def _string(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def _integer(description: str, **extra: Any) -> Schema:
    return {"type": "integer", "description": description, **extra}


def _number(description: str, **extra: Any) -> Schema:
    return {"type": "number", "description": description, **extra}


def _boolean(description: str) -> Schema:
    return {"type": "boolean", "description": description}


def _object(
    description: str, properties: dict[str, Schema], *, required: tuple[str, ...] = (), **extra: Any
) -> Schema:
    schema: Schema = {"type": "object", "description": description}
    if required:
        schema["required"] = list(required)
    schema["properties"] = properties
    schema.update(extra)
    return schema


def _array(description: str, items: Schema, **extra: Any) -> Schema:
    return {"type": "array", "description": description, "items": items, **extra}


def _free_object(description: str) -> Schema:
    return {
        "type": "object",
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
    }


def _quantity(description: str, *, pattern: str = QUANTITY_PATTERN, **extra: Any) -> Schema:
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": pattern,
        "x-kubernetes-int-or-string": True,
        **extra,
    }


PERCENT_PATTERN: Final = "^(0|[1-9][0-9]?|100)%$"
POSITIVE_PERCENT_PATTERN: Final = "^([1-9][0-9]?|100)%$"


def _int_or_percent(description: str, *, minimum: int, default: int | str) -> Schema:
    """Kubernetes' int-or-percent form (a Deployment's maxUnavailable): `2` or `"25%"`."""
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "minimum": minimum,  # of an integer; a string has the pattern
        "pattern": POSITIVE_PERCENT_PATTERN if minimum > 0 else PERCENT_PATTERN,
        "x-kubernetes-int-or-string": True,
        "default": default,
    }


def _rule(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    result = {"rule": rule, "message": message}
    if field_path is not None:
        result["fieldPath"] = field_path
    return result


def _pool_fields(*, defaults: bool) -> dict[str, Schema]:
    """poolSize, minBlock, poolDevice: with the pipeline's defaults, or without (a role's
    override, where an absent field means "the pipeline's")."""
    role = "" if defaults else " Unset: the pipeline's spec.transport value."

    def default(value: object) -> dict[str, object]:
        return {"default": value} if defaults else {}

    return {
        "poolSize": _quantity(
            "Bytes of the receive pool each replica stages incoming payloads in, as a "
            "quantity (e.g. 256Mi); allocated and touched once at start." + role,
            pattern=SIZE_PATTERN,
            **default(quantity.format_bytes(m.DEFAULT_POOL_SIZE)),
        ),
        "minBlock": _quantity(
            "Smallest block of the pool's buddy allocator, a power of two (e.g. 1Mi)." + role,
            pattern=SIZE_PATTERN,
            **default(quantity.format_bytes(m.DEFAULT_MIN_BLOCK)),
        ),
        "poolDevice": _string(
            "Where the pool lives: cpu (shared memory in /dev/shm), cpu-pinned (page-locked "
            "host memory) or cuda (device memory)." + role,
            enum=list(m.POOL_DEVICES),
            **default(m.DEFAULT_POOL_DEVICE),
        ),
    }


def transport_schema() -> Schema:
    fields = _pool_fields(defaults=True)
    return _object(
        "Transport defaults of the pipeline: the relay of each edge and every role's pool.",
        {
            "relay": _string(
                "Default relay of an edge: auto (shared memory within a pod, TCP otherwise), "
                f"{relays.describe()}.",
                enum=list(m.RELAYS),
                default=m.DEFAULT_RELAY,
            ),
            **fields,
            "requestTimeoutSeconds": _number(
                "Seconds a request may live from entry to result before it is failed.",
                minimum=0,
                exclusiveMinimum=True,
                maximum=m.MAX_REQUEST_TIMEOUT_SECONDS,
                default=m.DEFAULT_REQUEST_TIMEOUT_SECONDS,
            ),
        },
        default={},
    )


def env_schema() -> Schema:
    item = _object(
        "An environment variable, as in a Kubernetes container.",
        {
            "name": _string(
                "Variable name (letters, digits, '_'); the DISAGG_ prefix is reserved.",
                pattern=ENV_NAME_PATTERN,
                maxLength=limits.MAX_ENV_NAME_LENGTH,
            ),
            "value": _string("The value (quote numbers in YAML)."),
            "valueFrom": _free_object(
                "A source for the value, as a Kubernetes EnvVarSource (secretKeyRef, "
                "configMapKeyRef, fieldRef, resourceFieldRef)."
            ),
        },
        required=("name",),
        **{
            "x-kubernetes-validations": [
                _rule(
                    "!self.name.startsWith('DISAGG_')",
                    "the DISAGG_ prefix is reserved for the contract",
                    ".name",
                ),
                _rule(
                    "!(has(self.value) && has(self.valueFrom))",
                    "set either value or valueFrom, not both",
                ),
            ]
        },
    )
    return _array(
        "Extra environment variables of the role's container, after the contract's.",
        item,
        maxItems=limits.MAX_ENV,
        **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


def ports_schema() -> Schema:
    item = _object(
        "A port the role's container exposes, also published on the role's Service.",
        {
            "name": _string(
                "Port name: at most 15 lowercase letters, digits and single '-', with at least "
                "one letter (an IANA service name); ingress and metrics are the runtime's.",
                pattern=PORT_NAME_PATTERN,
                maxLength=15,
            ),
            "containerPort": _integer(
                "Port number in the container.", minimum=1, maximum=65535, format="int32"
            ),
            "protocol": _string(
                "Protocol of the port.", enum=list(m.PORT_PROTOCOLS), default="TCP"
            ),
        },
        required=("name", "containerPort"),
        **{
            "x-kubernetes-validations": [
                _rule("self.name.matches('[a-z]')", "a port name needs a letter", ".name"),
                _rule("!self.name.contains('--')", "a port name has no '--'", ".name"),
            ]
        },
    )
    protocol = "(has({0}.protocol) ? {0}.protocol : 'TCP')"
    same = f"q.containerPort == p.containerPort && {protocol.format('q')} == {protocol.format('p')}"
    return _array(
        "Extra ports of the role's container (the runtime's ingress and metrics ports are "
        "added by the operator).",
        item,
        maxItems=limits.MAX_PORTS,
        **{
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "x-kubernetes-validations": [
                _rule(
                    f"self.all(p, self.exists_one(q, {same}))",
                    "each containerPort/protocol pair may appear once",
                )
            ],
        },
    )


def resources_schema() -> Schema:
    def quantities(what: str) -> Schema:
        return {
            "type": "object",
            "description": f"{what} per resource name (cpu, memory, nvidia.com/gpu, ...), "
            "as Kubernetes quantities.",
            "additionalProperties": _quantity(
                "A quantity (e.g. 500m, 2Gi, 1).", pattern=SIZE_PATTERN
            ),
        }

    return _object(
        "Compute resources of the role's container, as in Kubernetes. Memory should cover the "
        "pool when poolDevice is cpu (it lives in the pod's /dev/shm).",
        {"requests": quantities("Requests"), "limits": quantities("Limits")},
    )


def autoscaling_schema() -> Schema:
    return _object(
        "Backlog-driven scaling: the operator keeps the mean receive-pool occupancy of the "
        "role's replicas near targetPoolOccupancy and, when set, their mean queue depth near "
        "targetQueuePerReplica (the larger ratio wins), within [minReplicas, maxReplicas].",
        {
            "minReplicas": _integer(
                "Fewest replicas.", minimum=1, maximum=m.MAX_REPLICAS, format="int32", default=1
            ),
            "maxReplicas": _integer(
                "Most replicas.", minimum=1, maximum=m.MAX_REPLICAS, format="int32"
            ),
            "targetPoolOccupancy": _number(
                "Wanted mean fraction of the receive pool in use, in (0, 1].",
                minimum=0,
                exclusiveMinimum=True,
                maximum=1,
                default=m.DEFAULT_TARGET_POOL_OCCUPANCY,
            ),
            "targetQueuePerReplica": _number(
                "Wanted mean number of requests waiting for a worker per replica; unset: pool "
                "occupancy is the only signal (queued requests then only block scale-down).",
                minimum=0,
                exclusiveMinimum=True,
                maximum=MAX_TARGET_QUEUE,
            ),
            "scaleUpStabilizationSeconds": _integer(
                "Seconds of recommendations considered before scaling up (the lowest wins).",
                minimum=0,
                maximum=m.MAX_STABILIZATION_SECONDS,
                format="int32",
                default=m.DEFAULT_SCALE_UP_STABILIZATION_SECONDS,
            ),
            "scaleDownStabilizationSeconds": _integer(
                "Seconds of recommendations considered before scaling down (the highest wins).",
                minimum=0,
                maximum=m.MAX_STABILIZATION_SECONDS,
                format="int32",
                default=m.DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS,
            ),
            "tolerance": _number(
                "Relative deviation from the target that causes no scaling, in [0, 1).",
                minimum=0,
                maximum=1,
                exclusiveMaximum=True,
                default=m.DEFAULT_TOLERANCE,
            ),
        },
        required=("maxReplicas",),
        **{
            "x-kubernetes-validations": [
                _rule(
                    _given("self.minReplicas", "self.minReplicas <= self.maxReplicas"),
                    "minReplicas must not be greater than maxReplicas",
                    ".minReplicas",
                )
            ]
        },
    )


def role_schema() -> Schema:
    strings = {"type": "string", "description": "One element."}
    return _object(
        "A stage of the pipeline: replicas of a container running the handler.",
        {
            "name": _string(
                "Role name, unique in the pipeline: a DNS-1035 label. Objects are named "
                "<pipeline>-<role>, at most 52 characters.",
                pattern=DNS_1035_LABEL,
                maxLength=m.MAX_LABEL_LENGTH,
            ),
            "replicas": _integer(
                "Replicas to run (to start with, when autoscaling). Unset: "
                "autoscaling.minReplicas, else 1.",
                minimum=0,
                maximum=m.MAX_REPLICAS,
                format="int32",
            ),
            "handler": _string(
                "What each request is handed to: 'package.module:function', or "
                "'package.module:Class' with setup(ctx), __call__ or batch(payloads), close() "
                "(docs/handlers.md).",
                pattern=HANDLER_PATTERN,
                maxLength=limits.MAX_HANDLER_LENGTH,
            ),
            "image": _string(
                "Container image of the role. Unset: spec.image.",
                pattern=NO_WHITESPACE,
                maxLength=limits.MAX_IMAGE_LENGTH,
            ),
            "command": _array(
                "Container command. Unset: [disagg, role].", strings, maxItems=limits.MAX_ARGS
            ),
            "args": _array("Container arguments.", strings, maxItems=limits.MAX_ARGS),
            "env": env_schema(),
            "resources": resources_schema(),
            "ports": ports_schema(),
            "transport": _object(
                "The role's own receive pool, overriding spec.transport field by field.",
                _pool_fields(defaults=False),
            ),
            "concurrency": _integer(
                "Requests one replica handles at once.",
                minimum=1,
                maximum=m.MAX_CONCURRENCY,
                format="int32",
                default=m.DEFAULT_CONCURRENCY,
            ),
            "autoscaling": autoscaling_schema(),
            "handlerArgs": _free_object(
                "Free-form JSON object handed to the handler class's setup(ctx) as ctx.args "
                "(model directory, dtype, ...); reaches the pod as DISAGG_HANDLER_ARGS."
            ),
            "batching": _object(
                "Gather waiting requests into one batch() call of the handler class.",
                {
                    "maxBatchSize": _integer(
                        "Most requests in one batch; at most the role's concurrency.",
                        minimum=1,
                        format="int32",
                    ),
                    "maxWaitMilliseconds": _number(
                        "How long a batch waits to fill after its first request.",
                        minimum=0,
                        maximum=60000,
                        default=m.DEFAULT_MAX_BATCH_WAIT_MILLISECONDS,
                    ),
                },
                required=("maxBatchSize",),
            ),
            "compat": _string(
                "Compat token of the role's payload contract: bump it (on both sides of an "
                "edge, to the same value) when what the role sends or reads changes; senders "
                "route only to replicas whose token pairs with theirs, so a rollout never "
                "crosses incompatible revisions (docs/rollout.md). Unset: auto, which pairs "
                "with anything.",
                pattern=f"^{compat.TOKEN_PATTERN}$",
                maxLength=63,
            ),
            "compatibleWith": _array(
                "Further compat tokens this revision still interoperates with.",
                _string("A compat token.", pattern=f"^{compat.TOKEN_PATTERN}$", maxLength=63),
                maxItems=compat.MAX_ACCEPTS,
            ),
            "startupSeconds": _integer(
                "How long the startup probe allows the handler's setup (model loading).",
                minimum=1,
                format="int32",
                default=m.DEFAULT_STARTUP_SECONDS,
            ),
            "podTemplate": _free_object(
                "A Kubernetes PodTemplateSpec (metadata, spec) merged last into the role's "
                "pod template: maps merge, containers/volumes/env merge by name, other lists "
                "are replaced, null removes a field. Labels and DISAGG_* variables stay. "
                "Settings that weaken the pod (privileged, host namespaces, hostPath, root, "
                "added capabilities, privilege escalation, hardening removed with null) are "
                f"refused unless the pipeline is annotated {m.ANNOTATION_ALLOW_PRIVILEGED}: "
                '"true" (docs/security.md).'
            ),
        },
        required=("name", "handler"),
        **{
            "x-kubernetes-validations": [
                _rule(
                    _given(
                        "self.batching",
                        "self.batching.maxBatchSize <= "
                        f"(has(self.concurrency) ? self.concurrency : {m.DEFAULT_CONCURRENCY})",
                    ),
                    "batching.maxBatchSize exceeds concurrency: larger batches never form",
                    ".batching.maxBatchSize",
                )
            ]
        },
    )


def edge_schema() -> Schema:
    ref = _object(
        "A tensor of the payload sent straight to a later role instead of through the target.",
        {
            "path": _string(
                "Where the tensor is in the payload: keys and [indexes], e.g. latents, a.b[0].",
                pattern=PAYLOAD_PATH_PATTERN,
                maxLength=limits.MAX_PATH_LENGTH,
            ),
            "to": _string(
                "The role that reads it; it must be downstream of the edge's target.",
                pattern=DNS_1035_LABEL,
                maxLength=m.MAX_LABEL_LENGTH,
            ),
        },
        required=("path", "to"),
    )
    return _object(
        "The source role hands each result to the target role.",
        {
            "from": _string("Source role.", pattern=DNS_1035_LABEL, maxLength=m.MAX_LABEL_LENGTH),
            "to": _string("Target role.", pattern=DNS_1035_LABEL, maxLength=m.MAX_LABEL_LENGTH),
            "relay": _string(
                "Relay of this edge. Unset: spec.transport.relay.", enum=list(m.RELAYS)
            ),
            "tensorRefs": _array(
                "Tensors that skip the target and go to a later role.",
                ref,
                maxItems=limits.MAX_TENSOR_REFS,
            ),
        },
        required=("from", "to"),
        **{
            "x-kubernetes-validations": [
                _rule("self.from != self.to", "an edge from a role to itself (a self-loop)"),
                _rule(
                    _given("self.tensorRefs", "self.tensorRefs.all(t, t.to != self.to)"),
                    "a tensor reference to the edge's own target: send it in the payload",
                    ".tensorRefs",
                ),
            ]
        },
    )


def group_schema() -> Schema:
    return _object(
        "Roles that share one GPU: they run as containers of one pod (same replicas).",
        {
            "name": _string(
                "Group name: a DNS-1035 label; the workload is <pipeline>-<name>. Unset: the "
                "first role's name.",
                pattern=DNS_1035_LABEL,
                maxLength=m.MAX_LABEL_LENGTH,
            ),
            "roles": _array(
                "The roles of the group, at least two.",
                _string("A role name.", pattern=DNS_1035_LABEL, maxLength=m.MAX_LABEL_LENGTH),
                minItems=2,
                maxItems=limits.MAX_GROUP_ROLES,
                **{"x-kubernetes-list-type": "set"},
            ),
        },
        required=("roles",),
    )


def rollout_schema() -> Schema:
    role = _string("A role.", pattern=DNS_1035_LABEL, maxLength=m.MAX_LABEL_LENGTH)
    return _object(
        "How a change of the pod templates rolls across roles: step by step through each "
        "StatefulSet's rolling-update partition, coupled roles (ratio locks and groups) "
        "keeping their updated fractions within maxSkew of each other.",
        {
            "maxUnavailable": _int_or_percent(
                "Pods of one role moved to the new revision per step: a count, or a percentage "
                "of the role's pods (rounded down, at least 1).",
                minimum=1,
                default=1,
            ),
            "maxSkew": _int_or_percent(
                "Largest difference between the updated fractions of coupled roles: a "
                "percentage of each role's pods (100%: they roll independently), or a count of "
                "pods (over each role's replicas); a value below one pod's share is rounded up "
                "to one pod.",
                minimum=1,
                default="100%",
            ),
            "partition": _int_or_percent(
                "Pods per role kept on the old revision (a canary hold): a count, or a "
                "percentage of the role's pods (rounded up).",
                minimum=0,
                default=0,
            ),
            "paused": {"type": "boolean", "description": "Hold the rollout where it is."},
            "stepDeadlineSeconds": _integer(
                "Seconds a step may take to get every pod ready before the rollout stops "
                "with the RolloutStalled condition.",
                minimum=1,
                maximum=MAX_ROLLOUT_STEP_DEADLINE_SECONDS,
                default=m.DEFAULT_ROLLOUT_STEP_DEADLINE_SECONDS,
            ),
            "groups": _array(
                "Roles that roll together besides those bound by a ratio lock.",
                _array("Roles of one rollout group.", role, minItems=2, maxItems=limits.MAX_ROLES),
                maxItems=limits.MAX_ROLES,
            ),
        },
    )


def ratio_lock_schema() -> Schema:
    return _object(
        "Hold two roles' replica counts in proportion: follower = ceil(leader * "
        "followerShare / leaderShare); when the leader scales, the follower follows.",
        {
            "leader": _string(
                "The role whose replica count leads.",
                pattern=DNS_1035_LABEL,
                maxLength=m.MAX_LABEL_LENGTH,
            ),
            "follower": _string(
                "The role that follows; it follows at most one leader.",
                pattern=DNS_1035_LABEL,
                maxLength=m.MAX_LABEL_LENGTH,
            ),
            "leaderShare": _integer(
                "Leader's side of the ratio (e.g. 4 in 4:1).", minimum=1, maximum=m.MAX_RATIO_SHARE
            ),
            "followerShare": _integer(
                "Follower's side of the ratio (e.g. 1 in 4:1).",
                minimum=1,
                maximum=m.MAX_RATIO_SHARE,
            ),
            "tolerance": _number(
                "Relative drift from the ratio that is left alone, in [0, 1).",
                minimum=0,
                maximum=1,
                exclusiveMaximum=True,
            ),
        },
        required=("leader", "follower"),
        **{
            "x-kubernetes-validations": [
                _rule("self.leader != self.follower", "a role cannot be locked to itself")
            ]
        },
    )


def _selector(description: str) -> Schema:
    requirement = _object(
        "A label selector requirement.",
        {
            "key": _string("The label key."),
            "operator": _string(
                "In, NotIn, Exists or DoesNotExist.", enum=["In", "NotIn", "Exists", "DoesNotExist"]
            ),
            "values": _array("Values (In, NotIn).", {"type": "string", "description": "A value."}),
        },
        required=("key", "operator"),
    )
    return _object(
        description + " A Kubernetes LabelSelector; {} selects all.",
        {
            "matchLabels": {
                "type": "object",
                "description": "Labels that must match exactly.",
                "additionalProperties": {"type": "string", "description": "A label value."},
            },
            "matchExpressions": _array("Label requirements.", requirement),
        },
    )


def network_peers_schema(description: str) -> Schema:
    peer = _object(
        "A Kubernetes NetworkPolicyPeer: pods (of namespaces) or an IP block.",
        {
            "podSelector": _selector(
                "Pods (in the pipeline's namespace unless namespaceSelector)."
            ),
            "namespaceSelector": _selector("Namespaces (all their pods unless podSelector)."),
            "ipBlock": _object(
                "Addresses outside the cluster's pods.",
                {
                    "cidr": _string("A CIDR, e.g. 10.0.0.0/16."),
                    "except": _array(
                        "CIDRs within cidr to leave out.",
                        {"type": "string", "description": "A CIDR."},
                    ),
                },
                required=("cidr",),
            ),
        },
        minProperties=1,
    )
    return _array(description, peer, maxItems=limits.MAX_NETWORK_PEERS)


def monitoring_schema() -> Schema:
    return _object(
        "Scraping of the pipeline by the Prometheus Operator. docs/observability.md.",
        {
            "podMonitor": _boolean(
                "true: a PodMonitor <pipeline>-metrics for the roles' and the gateway's metrics "
                "ports; false: none. Unset: the operator's default (the chart's "
                "monitoring.podMonitors). Only where the PodMonitor CRD is installed."
            ),
            "tracing": _object(
                "Traces (OpenTelemetry over OTLP/HTTP): every role and the gateway get "
                "OTEL_EXPORTER_OTLP_ENDPOINT and a parent-based ratio sampler. Unset: none, "
                "unless a role's env sets OTEL_* itself.",
                {
                    "endpoint": _string(
                        "OTLP/HTTP base URL of a collector, e.g. "
                        "http://otel-collector.observability:4318 (/v1/traces is appended).",
                        minLength=1,
                        maxLength=limits.MAX_URL_LENGTH,
                        pattern="^https?://",
                    ),
                    "sampleRatio": _number(
                        "Share of new requests traced, 0..1 (a caller's sampled traceparent "
                        f"is followed whatever it is). Default {m.DEFAULT_TRACE_SAMPLE_RATIO}.",
                        minimum=0,
                        maximum=1,
                        default=m.DEFAULT_TRACE_SAMPLE_RATIO,
                    ),
                },
                required=("endpoint",),
            ),
        },
        default={},
    )


def network_policy_schema() -> Schema:
    return _object(
        "The pipeline's NetworkPolicy <pipeline>-network: the role ports admit only the "
        "pipeline's own pods, its gateway and `clients`; the metrics ports the namespace (or "
        "`metricsFrom`) and the operator. docs/security.md.",
        {
            "enabled": {
                **_boolean("false: no NetworkPolicy (an existing one is deleted)."),
                "default": True,
            },
            "clients": network_peers_schema(
                "Peers also admitted to the role ports (ingress, lane and the roles' own "
                "ports): in-cluster clients that are not the pipeline's gateway."
            ),
            "metricsFrom": network_peers_schema(
                "Peers admitted to the metrics ports instead of every pod of the namespace "
                "(e.g. Prometheus' namespace). The operator's namespace is always admitted."
            ),
        },
        default={},
    )


def _given(field: str, rule: str) -> str:
    """`rule` where `field` is set, else true. A conditional rather than `!has(f) || rule`:
    the same in CEL, and cel-python (used by the tests) mis-evaluates the `||` form when the
    right side nests a macro over the optional field."""
    return f"has({field}) ? ({rule}) : true"


def _spec_rules() -> list[dict[str, str]]:
    known = "self.roles.exists(r, r.name == {})"
    relay = (
        "(has(e.relay) ? e.relay : (has(self.transport) && has(self.transport.relay) ? "
        "self.transport.relay : 'auto'))"
    )
    same_group = (
        "has(self.colocation) ? "
        "self.colocation.exists(g, e.from in g.roles && e.to in g.roles) : false"
    )
    refs_known = _given("e.tensorRefs", f"e.tensorRefs.all(t, {known.format('t.to')})")
    named = "g.name in g.roles || !self.roles.exists(r, r.name == g.name)"
    unique = "self.colocation.exists_one(h, has(h.name) && h.name == g.name)"
    return [
        _rule(
            "has(self.image) || self.roles.all(r, has(r.image))",
            "spec.image is required unless every role sets image",
            ".image",
        ),
        _rule(
            _given(
                "self.edges",
                f"self.edges.all(e, {known.format('e.from')} && {known.format('e.to')})",
            ),
            "every edge's from and to must name a role of spec.roles",
            ".edges",
        ),
        _rule(
            _given("self.edges", "self.roles.exists(r, !self.edges.exists(e, e.to == r.name))"),
            "no entry role: every role has an incoming edge, so none takes requests",
            ".edges",
        ),
        _rule(
            _given("self.edges", f"self.edges.all(e, {refs_known})"),
            "every tensor reference's to must name a role of spec.roles",
            ".edges",
        ),
        _rule(
            _given("self.edges", f"self.edges.all(e, {relay} != 'cuda-ipc' || ({same_group}))"),
            "relay cuda-ipc needs both roles of the edge in one colocation group (one GPU)",
            ".edges",
        ),
        _rule(
            _given(
                "self.ratioLocks",
                f"self.ratioLocks.all(l, {known.format('l.leader')} && "
                f"{known.format('l.follower')})",
            ),
            "every ratio lock's leader and follower must name a role of spec.roles",
            ".ratioLocks",
        ),
        _rule(
            _given(
                "self.colocation", f"self.colocation.all(g, g.roles.all(n, {known.format('n')}))"
            ),
            "every colocation role must name a role of spec.roles",
            ".colocation",
        ),
        _rule(
            _given(
                "self.colocation",
                "self.colocation.all(g, g.roles.all(n, "
                "self.colocation.exists_one(h, n in h.roles)))",
            ),
            "a role belongs to at most one colocation group (one pod)",
            ".colocation",
        ),
        _rule(
            _given("self.colocation", f"self.colocation.all(g, {_given('g.name', unique)})"),
            "colocation group names must be unique",
            ".colocation",
        ),
        _rule(
            _given("self.colocation", f"self.colocation.all(g, {_given('g.name', named)})"),
            "a colocation group may not take the name of a role outside it (the derived "
            "object names would collide)",
            ".colocation",
        ),
    ]


def gateway_schema() -> Schema:
    return _object(
        "The pipeline's HTTP front door: a Deployment <pipeline>-gateway behind a ClusterIP "
        "Service <pipeline> (port name http). On unless enabled is false.",
        {
            "enabled": {"type": "boolean", "description": "Run the gateway.", "default": True},
            "replicas": _integer(
                "Gateway replicas.", minimum=0, format="int32", default=m.DEFAULT_GATEWAY_REPLICAS
            ),
            "port": _integer(
                "HTTP port of the gateway and its Service.",
                minimum=1,
                maximum=65535,
                format="int32",
                default=m.DEFAULT_GATEWAY_PORT,
            ),
            "api": _string(
                "native (/v1/infer), or openai to add /v1/models, /v1/completions and "
                "/v1/chat/completions for model.",
                enum=list(m.GATEWAY_APIS),
                default="native",
            ),
            "model": _string(
                "The model name the OpenAI API serves (required with api openai).", minLength=1
            ),
            "auth": _object(
                "Bearer-token authentication of clients.",
                {
                    "secretRef": _object(
                        "The Secret (in the pipeline's namespace) and key holding the token.",
                        {
                            "name": _string("Secret name.", pattern=DNS_1123_LABEL),
                            "key": _string("Key in the Secret.", default=m.DEFAULT_TOKEN_KEY),
                        },
                        required=("name",),
                    )
                },
                required=("secretRef",),
            ),
            "resources": resources_schema(),
            "podTemplate": _free_object(
                "A PodTemplateSpec deep-merged into the gateway's pod template."
            ),
        },
        required=(),
        **{
            "x-kubernetes-validations": [
                _rule(
                    "!has(self.api) || self.api != 'openai' || has(self.model)",
                    "model is required with api: openai",
                    ".model",
                )
            ]
        },
    )


def spec_schema() -> Schema:
    return _object(
        "The pipeline: roles (stages), the edges between them, and which roles share a GPU.",
        {
            "image": _string(
                "Default container image of every role (a role's image overrides it).",
                pattern=NO_WHITESPACE,
                maxLength=limits.MAX_IMAGE_LENGTH,
            ),
            "transport": transport_schema(),
            "roles": _array(
                "The roles, each a StatefulSet (or part of its colocation group's).",
                role_schema(),
                minItems=1,
                maxItems=limits.MAX_ROLES,
                **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
            ),
            "edges": _array(
                "Where results flow; the graph must be acyclic with at least one entry role.",
                edge_schema(),
                maxItems=limits.MAX_EDGES,
                **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["from", "to"]},
            ),
            "colocation": _array(
                "Groups of roles that share one GPU and one pod.",
                group_schema(),
                maxItems=limits.MAX_GROUPS,
            ),
            "networkPolicy": network_policy_schema(),
            "ratioLocks": _array(
                "Replica ratios the autoscaler holds between roles (e.g. denoiser:decoder 4:1).",
                ratio_lock_schema(),
                maxItems=limits.MAX_ROLES,
                **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["follower"]},
            ),
            "rollout": rollout_schema(),
            "gateway": gateway_schema(),
            "monitoring": monitoring_schema(),
        },
        required=("roles",),
        **{"x-kubernetes-validations": _spec_rules()},
    )


def _root_rules() -> list[dict[str, str]]:
    room = m.MAX_DERIVED_NAME_LENGTH - 1  # the '-' between pipeline and role
    name = "self.metadata.name"
    fits = f"size({name}) + size(g.name) <= {room}"
    return [
        _rule(
            f"self.spec.roles.all(r, size({name}) + size(r.name) <= {room})",
            f"<pipeline>-<role> must fit in {m.MAX_DERIVED_NAME_LENGTH} characters (StatefulSet "
            "pod labels are limited to 63)",
            ".spec.roles",
        ),
        _rule(
            _given(
                "self.spec.colocation",
                f"self.spec.colocation.all(g, {_given('g.name', fits)})",
            ),
            f"<pipeline>-<group> must fit in {m.MAX_DERIVED_NAME_LENGTH} characters",
            ".spec.colocation",
        ),
    ]


def status_schema() -> Schema:
    count = {"minimum": 0, "format": "int32"}
    role = _object(
        "Replica counts of one role, from its StatefulSet.",
        {
            "name": _string("Role name."),
            "workload": _string("The StatefulSet that runs the role."),
            "desired": _integer("Replicas wanted (the StatefulSet's spec.replicas).", **count),
            "current": _integer("Replicas that exist.", **count),
            "ready": _integer("Replicas that pass their readiness probe.", **count),
            "updated": _integer("Replicas at the latest pod template.", **count),
        },
        required=("name",),
    )
    condition = _object(
        "A condition in the Kubernetes convention (metav1.Condition).",
        {
            "type": _string("Condition type: Ready, Progressing or Degraded.", maxLength=316),
            "status": _string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "observedGeneration": _integer(
                "The metadata.generation the condition was computed for.", minimum=0
            ),
            "lastTransitionTime": _string("When the status last changed.", format="date-time"),
            "reason": _string(
                "Why, in CamelCase: " + ", ".join(names.REASONS) + ".", maxLength=1024
            ),
            "message": _string("Details for humans.", maxLength=32768),
        },
        required=("type", "status", "lastTransitionTime", "reason", "message"),
    )
    decision = _object(
        "One scaling decision of the autoscaler.",
        {
            "time": _string("When it was made.", format="date-time"),
            "role": _string("The role (or colocation group) scaled."),
            "fromReplicas": _integer("Replicas before.", **count),
            "toReplicas": _integer("Replicas after.", **count),
            "occupancy": _number("Mean pool occupancy that led to it, in [0, 1]."),
            "signal": _string(
                "The signal that drove it: " + ", ".join(autoscale.SIGNALS) + ".",
                enum=list(autoscale.SIGNALS),
            ),
            "reason": _string("Why, for humans."),
        },
        required=("time", "role", "fromReplicas", "toReplicas"),
    )
    return _object(
        "Observed state, written by the operator.",
        {
            "observedGeneration": _integer(
                "The metadata.generation this status describes.", minimum=0
            ),
            "phase": _string("Summary: " + ", ".join(names.PHASES) + ".", enum=list(names.PHASES)),
            "readyRoles": _string(
                "Roles whose replicas are all ready, of all roles (e.g. 3/3); - when invalid."
            ),
            "roles": _array(
                "Per role replica counts.",
                role,
                **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
            ),
            "gateway": _object(
                "The gateway's Deployment and where clients reach it.",
                {
                    "url": _string("In-cluster URL: http://<pipeline>.<namespace>.svc:<port>."),
                    "desired": _integer("Replicas wanted.", **count),
                    "ready": _integer("Replicas that pass their readiness probe.", **count),
                    "warning": _string("Set when the gateway takes requests without a token."),
                },
            ),
            "problems": _array(
                "Why the spec is invalid ('<field path>: <reason>'); empty when valid.",
                {"type": "string", "description": "One problem."},
            ),
            "conditions": _array(
                "Ready, Progressing and Degraded.",
                condition,
                maxItems=MAX_CONDITIONS,
                **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
            ),
            "scaleDecisions": _array(
                "Recent scaling decisions, newest last.",
                decision,
                maxItems=MAX_SCALE_DECISIONS,
            ),
            "autoscaledReplicas": {
                "type": "object",
                "description": (
                    "Replicas the autoscaler set, by workload (role or colocation group): an "
                    "operator restart resumes from them instead of spec.roles[].replicas."
                ),
                "additionalProperties": _integer("Replicas.", **count),
                "maxProperties": limits.MAX_ROLES,
            },
            "rollout": _object(
                "The coordinated rollout of a pod-template change (spec.rollout).",
                {
                    "phase": _string(
                        "Rolling, Paused, Stalled (a step's pods not ready within "
                        "stepDeadlineSeconds) or Complete.",
                        enum=["Rolling", "Paused", "Stalled", "Complete"],
                    ),
                    "summary": _string("Pods at the new revision, of the rolling workloads."),
                    "units": _array(
                        "Per rolling workload (role or colocation group).",
                        _object(
                            "One workload's progress.",
                            {
                                "name": _string("The role or colocation group."),
                                "replicas": _integer("Its replicas.", **count),
                                "updated": _integer("Pods at the new revision.", **count),
                                "ready": _integer("Ready pods.", **count),
                                "target": _integer(
                                    "Pods the current step lets run the new revision.", **count
                                ),
                            },
                        ),
                        maxItems=limits.MAX_ROLES,
                    ),
                    "stalled": _array(
                        "Workloads whose step missed its deadline.",
                        _string("A role or colocation group."),
                        maxItems=limits.MAX_ROLES,
                    ),
                },
            ),
        },
    )


def open_api_schema() -> Schema:
    """The openAPIV3Schema of the v1alpha1 version."""
    return _object(
        "A disaggregated inference pipeline: roles that pass tensors along edges, each role "
        "run by the operator as a StatefulSet with a headless Service.",
        {
            "apiVersion": _string("API version of this object: " + m.API_VERSION + "."),
            "kind": _string("Kind of this object: " + m.KIND + "."),
            # no description: the API server allows only name and generateName restricted here
            "metadata": {
                "type": "object",
                "properties": {
                    "name": _string(
                        "Pipeline name: a DNS-1035 label of at most "
                        f"{m.MAX_PIPELINE_NAME_LENGTH} characters (role and group names are "
                        "appended to it).",
                        pattern=DNS_1035_LABEL,
                        maxLength=m.MAX_PIPELINE_NAME_LENGTH,
                    )
                },
            },
            "spec": spec_schema(),
            "status": status_schema(),
        },
        required=("spec",),
        **{"x-kubernetes-validations": _root_rules()},
    )


def printer_columns() -> list[Schema]:
    return [
        {
            "name": "Ready",
            "type": "string",
            "description": "Roles with all replicas ready, of all roles.",
            "jsonPath": ".status.readyRoles",
        },
        {
            "name": "Phase",
            "type": "string",
            "description": "Pending, Progressing, Ready, Degraded or Invalid.",
            "jsonPath": ".status.phase",
        },
        {
            "name": "Rollout",
            "type": "string",
            "description": "Rollout progress: phase and pods at the new revision.",
            "jsonPath": ".status.rollout.summary",
        },
        {
            "name": "URL",
            "type": "string",
            "description": "The gateway's in-cluster URL.",
            "jsonPath": ".status.gateway.url",
        },
        {
            "name": "Reason",
            "type": "string",
            "description": "Reason of the Ready condition.",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
            "priority": 1,
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> Schema:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": names.CRD_NAME,
            "labels": {names.LABEL_NAME: names.APP_NAME, names.LABEL_COMPONENT: "crd"},
        },
        "spec": {
            "group": names.GROUP,
            "names": {
                "kind": names.PIPELINE_KIND,
                "listKind": names.PIPELINE_KIND + "List",
                "plural": names.PLURAL,
                "singular": names.SINGULAR,
                "shortNames": list(names.SHORT_NAMES),
                "categories": list(names.CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": open_api_schema()},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns(),
                }
            ],
        },
    }


HEADER: Final = (
    "# Generated by `make generate` from operator/disagg_operator/crd.py; do not edit\n"
    "# (`make verify` fails when it is stale).\n"
)


def render() -> str:
    """The CRD file's text."""
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100, allow_unicode=True)
