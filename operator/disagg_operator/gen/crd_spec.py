"""The CRD schema of `spec` around the roles: edges, colocation groups, rollout, ratio locks,
network policy, monitoring, the gateway, and the CEL rules that relate fields across them."""

from __future__ import annotations

from disagg_core.spec import MAX_ROLLOUT_STEP_DEADLINE_SECONDS, limits
from disagg_core.spec import model as m
from disagg_core.spec.engines import EDGE_KINDS
from disagg_operator.gen import crd_kit, crd_roles


def edge_schema() -> crd_kit.Schema:
    ref = crd_kit.object_schema(
        "A tensor of the payload sent straight to a later role instead of through the target.",
        {
            "path": crd_kit.string(
                "Where the tensor is in the payload: keys and [indexes], e.g. latents, a.b[0].",
                pattern=crd_kit.PAYLOAD_PATH_PATTERN,
                maxLength=limits.MAX_PATH_LENGTH,
            ),
            "to": crd_kit.string(
                "The role that reads it; it must be downstream of the edge's target.",
                pattern=crd_kit.DNS_1035_LABEL,
                maxLength=m.MAX_LABEL_LENGTH,
            ),
        },
        required=("path", "to"),
    )
    return crd_kit.object_schema(
        "The source role hands each result to the target role.",
        {
            "from": crd_kit.string(
                "Source role.", pattern=crd_kit.DNS_1035_LABEL, maxLength=m.MAX_LABEL_LENGTH
            ),
            "to": crd_kit.string(
                "Target role.", pattern=crd_kit.DNS_1035_LABEL, maxLength=m.MAX_LABEL_LENGTH
            ),
            "kind": crd_kit.string(
                "What the edge carries: payload (a handler's result) or kv (an engine's KV "
                "blocks, prefill to decode; both ends engine roles).",
                enum=list(EDGE_KINDS),
                default="payload",
            ),
            "relay": crd_kit.string(
                "Relay of this edge. Unset: spec.transport.relay.", enum=list(m.RELAYS)
            ),
            "tensorRefs": crd_kit.array(
                "Tensors that skip the target and go to a later role.",
                ref,
                maxItems=limits.MAX_TENSOR_REFS,
            ),
        },
        required=("from", "to"),
        **{
            "x-kubernetes-validations": [
                crd_kit.rule("self.from != self.to", "an edge from a role to itself (a self-loop)"),
                crd_kit.rule(
                    crd_kit.given("self.tensorRefs", "self.tensorRefs.all(t, t.to != self.to)"),
                    "a tensor reference to the edge's own target: send it in the payload",
                    ".tensorRefs",
                ),
            ]
        },
    )


def group_schema() -> crd_kit.Schema:
    return crd_kit.object_schema(
        "Roles that share one GPU: they run as containers of one pod (same replicas).",
        {
            "name": crd_kit.string(
                "Group name: a DNS-1035 label; the workload is <pipeline>-<name>. Unset: the "
                "first role's name.",
                pattern=crd_kit.DNS_1035_LABEL,
                maxLength=m.MAX_LABEL_LENGTH,
            ),
            "roles": crd_kit.array(
                "The roles of the group, at least two.",
                crd_kit.string(
                    "A role name.", pattern=crd_kit.DNS_1035_LABEL, maxLength=m.MAX_LABEL_LENGTH
                ),
                minItems=2,
                maxItems=limits.MAX_GROUP_ROLES,
                **{"x-kubernetes-list-type": "set"},
            ),
        },
        required=("roles",),
    )


def rollout_schema() -> crd_kit.Schema:
    role = crd_kit.string("A role.", pattern=crd_kit.DNS_1035_LABEL, maxLength=m.MAX_LABEL_LENGTH)
    return crd_kit.object_schema(
        "How a change of the pod templates rolls across roles: step by step through each "
        "StatefulSet's rolling-update partition, coupled roles (ratio locks and groups) "
        "keeping their updated fractions within maxSkew of each other.",
        {
            "maxUnavailable": crd_kit.int_or_percent(
                "Pods of one role moved to the new revision per step: a count, or a percentage "
                "of the role's pods (rounded down, at least 1).",
                minimum=1,
                default=1,
            ),
            "maxSkew": crd_kit.int_or_percent(
                "Largest difference between the updated fractions of coupled roles: a "
                "percentage of each role's pods (100%: they roll independently), or a count of "
                "pods (over each role's replicas); a value below one pod's share is rounded up "
                "to one pod.",
                minimum=1,
                default="100%",
            ),
            "partition": crd_kit.int_or_percent(
                "Pods per role kept on the old revision (a canary hold): a count, or a "
                "percentage of the role's pods (rounded up).",
                minimum=0,
                default=0,
            ),
            "paused": {"type": "boolean", "description": "Hold the rollout where it is."},
            "stepDeadlineSeconds": crd_kit.integer(
                "Seconds a step may take to get every pod ready before the rollout stops "
                "with the RolloutStalled condition.",
                minimum=1,
                maximum=MAX_ROLLOUT_STEP_DEADLINE_SECONDS,
                default=m.DEFAULT_ROLLOUT_STEP_DEADLINE_SECONDS,
            ),
            "groups": crd_kit.array(
                "Roles that roll together besides those bound by a ratio lock.",
                crd_kit.array(
                    "Roles of one rollout group.", role, minItems=2, maxItems=limits.MAX_ROLES
                ),
                maxItems=limits.MAX_ROLES,
            ),
        },
    )


def ratio_lock_schema() -> crd_kit.Schema:
    return crd_kit.object_schema(
        "Hold two roles' replica counts in proportion: follower = ceil(leader * "
        "followerShare / leaderShare); when the leader scales, the follower follows.",
        {
            "leader": crd_kit.string(
                "The role whose replica count leads.",
                pattern=crd_kit.DNS_1035_LABEL,
                maxLength=m.MAX_LABEL_LENGTH,
            ),
            "follower": crd_kit.string(
                "The role that follows; it follows at most one leader.",
                pattern=crd_kit.DNS_1035_LABEL,
                maxLength=m.MAX_LABEL_LENGTH,
            ),
            "leaderShare": crd_kit.integer(
                "Leader's side of the ratio (e.g. 4 in 4:1).", minimum=1, maximum=m.MAX_RATIO_SHARE
            ),
            "followerShare": crd_kit.integer(
                "Follower's side of the ratio (e.g. 1 in 4:1).",
                minimum=1,
                maximum=m.MAX_RATIO_SHARE,
            ),
            "tolerance": crd_kit.number(
                "Relative drift from the ratio that is left alone, in [0, 1).",
                minimum=0,
                maximum=1,
                exclusiveMaximum=True,
            ),
        },
        required=("leader", "follower"),
        **{
            "x-kubernetes-validations": [
                crd_kit.rule("self.leader != self.follower", "a role cannot be locked to itself")
            ]
        },
    )


def _selector(description: str) -> crd_kit.Schema:
    requirement = crd_kit.object_schema(
        "A label selector requirement.",
        {
            "key": crd_kit.string("The label key."),
            "operator": crd_kit.string(
                "In, NotIn, Exists or DoesNotExist.", enum=["In", "NotIn", "Exists", "DoesNotExist"]
            ),
            "values": crd_kit.array(
                "Values (In, NotIn).", {"type": "string", "description": "A value."}
            ),
        },
        required=("key", "operator"),
    )
    return crd_kit.object_schema(
        description + " A Kubernetes LabelSelector; {} selects all.",
        {
            "matchLabels": {
                "type": "object",
                "description": "Labels that must match exactly.",
                "additionalProperties": {"type": "string", "description": "A label value."},
            },
            "matchExpressions": crd_kit.array("Label requirements.", requirement),
        },
    )


def network_peers_schema(description: str) -> crd_kit.Schema:
    peer = crd_kit.object_schema(
        "A Kubernetes NetworkPolicyPeer: pods (of namespaces) or an IP block.",
        {
            "podSelector": _selector(
                "Pods (in the pipeline's namespace unless namespaceSelector)."
            ),
            "namespaceSelector": _selector("Namespaces (all their pods unless podSelector)."),
            "ipBlock": crd_kit.object_schema(
                "Addresses outside the cluster's pods.",
                {
                    "cidr": crd_kit.string("A CIDR, e.g. 10.0.0.0/16."),
                    "except": crd_kit.array(
                        "CIDRs within cidr to leave out.",
                        {"type": "string", "description": "A CIDR."},
                    ),
                },
                required=("cidr",),
            ),
        },
        minProperties=1,
    )
    return crd_kit.array(description, peer, maxItems=limits.MAX_NETWORK_PEERS)


def monitoring_schema() -> crd_kit.Schema:
    return crd_kit.object_schema(
        "Scraping of the pipeline by the Prometheus Operator. docs/observability.md.",
        {
            "podMonitor": crd_kit.boolean(
                "true: a PodMonitor <pipeline>-metrics for the roles' and the gateway's metrics "
                "ports; false: none. Unset: the operator's default (the chart's "
                "monitoring.podMonitors). Only where the PodMonitor CRD is installed."
            ),
            "tracing": crd_kit.object_schema(
                "Traces (OpenTelemetry over OTLP/HTTP): every role and the gateway get "
                "OTEL_EXPORTER_OTLP_ENDPOINT and a parent-based ratio sampler. Unset: none, "
                "unless a role's env sets OTEL_* itself.",
                {
                    "endpoint": crd_kit.string(
                        "OTLP/HTTP base URL of a collector, e.g. "
                        "http://otel-collector.observability:4318 (/v1/traces is appended).",
                        minLength=1,
                        maxLength=limits.MAX_URL_LENGTH,
                        pattern="^https?://",
                    ),
                    "sampleRatio": crd_kit.number(
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


def network_policy_schema() -> crd_kit.Schema:
    return crd_kit.object_schema(
        "The pipeline's NetworkPolicy <pipeline>-network: the role ports admit only the "
        "pipeline's own pods, its gateway and `clients`; the metrics ports the namespace (or "
        "`metricsFrom`) and the operator. docs/security.md.",
        {
            "enabled": {
                **crd_kit.boolean("false: no NetworkPolicy (an existing one is deleted)."),
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
    refs_known = crd_kit.given("e.tensorRefs", f"e.tensorRefs.all(t, {known.format('t.to')})")
    named = "g.name in g.roles || !self.roles.exists(r, r.name == g.name)"
    unique = "self.colocation.exists_one(h, has(h.name) && h.name == g.name)"
    return [
        crd_kit.rule(
            "has(self.image) || self.roles.all(r, has(r.image))",
            "spec.image is required unless every role sets image",
            ".image",
        ),
        crd_kit.rule(
            crd_kit.given(
                "self.edges",
                f"self.edges.all(e, {known.format('e.from')} && {known.format('e.to')})",
            ),
            "every edge's from and to must name a role of spec.roles",
            ".edges",
        ),
        crd_kit.rule(
            crd_kit.given(
                "self.edges", "self.roles.exists(r, !self.edges.exists(e, e.to == r.name))"
            ),
            "no entry role: every role has an incoming edge, so none takes requests",
            ".edges",
        ),
        crd_kit.rule(
            crd_kit.given("self.edges", f"self.edges.all(e, {refs_known})"),
            "every tensor reference's to must name a role of spec.roles",
            ".edges",
        ),
        crd_kit.rule(
            crd_kit.given(
                "self.edges", f"self.edges.all(e, {relay} != 'cuda-ipc' || ({same_group}))"
            ),
            "relay cuda-ipc needs both roles of the edge in one colocation group (one GPU)",
            ".edges",
        ),
        crd_kit.rule(
            crd_kit.given(
                "self.ratioLocks",
                f"self.ratioLocks.all(l, {known.format('l.leader')} && "
                f"{known.format('l.follower')})",
            ),
            "every ratio lock's leader and follower must name a role of spec.roles",
            ".ratioLocks",
        ),
        crd_kit.rule(
            crd_kit.given(
                "self.colocation", f"self.colocation.all(g, g.roles.all(n, {known.format('n')}))"
            ),
            "every colocation role must name a role of spec.roles",
            ".colocation",
        ),
        crd_kit.rule(
            crd_kit.given(
                "self.colocation",
                "self.colocation.all(g, g.roles.all(n, "
                "self.colocation.exists_one(h, n in h.roles)))",
            ),
            "a role belongs to at most one colocation group (one pod)",
            ".colocation",
        ),
        crd_kit.rule(
            crd_kit.given(
                "self.colocation", f"self.colocation.all(g, {crd_kit.given('g.name', unique)})"
            ),
            "colocation group names must be unique",
            ".colocation",
        ),
        crd_kit.rule(
            crd_kit.given(
                "self.colocation", f"self.colocation.all(g, {crd_kit.given('g.name', named)})"
            ),
            "a colocation group may not take the name of a role outside it (the derived "
            "object names would collide)",
            ".colocation",
        ),
    ]


def gateway_schema() -> crd_kit.Schema:
    return crd_kit.object_schema(
        "The pipeline's HTTP front door: a Deployment <pipeline>-gateway behind a ClusterIP "
        "Service <pipeline> (port name http). On unless enabled is false.",
        {
            "enabled": {"type": "boolean", "description": "Run the gateway.", "default": True},
            "replicas": crd_kit.integer(
                "Gateway replicas.", minimum=0, format="int32", default=m.DEFAULT_GATEWAY_REPLICAS
            ),
            "port": crd_kit.integer(
                "HTTP port of the gateway and its Service.",
                minimum=1,
                maximum=65535,
                format="int32",
                default=m.DEFAULT_GATEWAY_PORT,
            ),
            "api": crd_kit.string(
                "native (/v1/infer), or openai to add /v1/models, /v1/completions and "
                "/v1/chat/completions for model.",
                enum=list(m.GATEWAY_APIS),
                default="native",
            ),
            "model": crd_kit.string(
                "The model name the OpenAI API serves (required with api openai).", minLength=1
            ),
            "auth": crd_kit.object_schema(
                "Bearer-token authentication of clients.",
                {
                    "secretRef": crd_kit.object_schema(
                        "The Secret (in the pipeline's namespace) and key holding the token.",
                        {
                            "name": crd_kit.string("Secret name.", pattern=crd_kit.DNS_1123_LABEL),
                            "key": crd_kit.string(
                                "Key in the Secret.", default=m.DEFAULT_TOKEN_KEY
                            ),
                        },
                        required=("name",),
                    )
                },
                required=("secretRef",),
            ),
            "resources": crd_roles.resources_schema(),
            "podTemplate": crd_kit.free_object(
                "A PodTemplateSpec deep-merged into the gateway's pod template."
            ),
        },
        required=(),
        **{
            "x-kubernetes-validations": [
                crd_kit.rule(
                    "!has(self.api) || self.api != 'openai' || has(self.model)",
                    "model is required with api: openai",
                    ".model",
                )
            ]
        },
    )


def spec_schema() -> crd_kit.Schema:
    return crd_kit.object_schema(
        "The pipeline: roles (stages), the edges between them, and which roles share a GPU.",
        {
            "image": crd_kit.string(
                "Default container image of every role (a role's image overrides it).",
                pattern=crd_kit.NO_WHITESPACE,
                maxLength=limits.MAX_IMAGE_LENGTH,
            ),
            "transport": crd_roles.transport_schema(),
            "roles": crd_kit.array(
                "The roles, each a StatefulSet (or part of its colocation group's).",
                crd_roles.role_schema(),
                minItems=1,
                maxItems=limits.MAX_ROLES,
                **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
            ),
            "edges": crd_kit.array(
                "Where results flow; the graph must be acyclic with at least one entry role.",
                edge_schema(),
                maxItems=limits.MAX_EDGES,
                **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["from", "to"]},
            ),
            "colocation": crd_kit.array(
                "Groups of roles that share one GPU and one pod.",
                group_schema(),
                maxItems=limits.MAX_GROUPS,
            ),
            "networkPolicy": network_policy_schema(),
            "ratioLocks": crd_kit.array(
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


def root_rules() -> list[dict[str, str]]:
    room = m.MAX_DERIVED_NAME_LENGTH - 1  # the '-' between pipeline and role
    name = "self.metadata.name"
    fits = f"size({name}) + size(g.name) <= {room}"
    return [
        crd_kit.rule(
            f"self.spec.roles.all(r, size({name}) + size(r.name) <= {room})",
            f"<pipeline>-<role> must fit in {m.MAX_DERIVED_NAME_LENGTH} characters (StatefulSet "
            "pod labels are limited to 63)",
            ".spec.roles",
        ),
        crd_kit.rule(
            crd_kit.given(
                "self.spec.colocation",
                f"self.spec.colocation.all(g, {crd_kit.given('g.name', fits)})",
            ),
            f"<pipeline>-<group> must fit in {m.MAX_DERIVED_NAME_LENGTH} characters",
            ".spec.colocation",
        ),
    ]
