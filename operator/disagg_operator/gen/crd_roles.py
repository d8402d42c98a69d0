"""The CRD schema of one role (`spec.roles[]`): its transport and pool, env, ports,
resources and autoscaling, with the defaults and limits of the spec module."""

from __future__ import annotations

from disagg_core import compat, quantity, relays
from disagg_core.spec import MAX_TARGET_QUEUE, engines, limits
from disagg_core.spec import model as m
from disagg_operator.gen import crd_kit


def _pool_fields(*, defaults: bool) -> dict[str, crd_kit.Schema]:
    """poolSize, minBlock, poolDevice: with the pipeline's defaults, or without (a role's
    override, where an absent field means "the pipeline's")."""
    role = "" if defaults else " Unset: the pipeline's spec.transport value."

    def default(value: object) -> dict[str, object]:
        return {"default": value} if defaults else {}

    return {
        "poolSize": crd_kit.quantity(
            "Bytes of the receive pool each replica stages incoming payloads in, as a "
            "quantity (e.g. 256Mi); allocated and touched once at start." + role,
            pattern=crd_kit.SIZE_PATTERN,
            **default(quantity.format_bytes(m.DEFAULT_POOL_SIZE)),
        ),
        "minBlock": crd_kit.quantity(
            "Smallest block of the pool's buddy allocator, a power of two (e.g. 1Mi)." + role,
            pattern=crd_kit.SIZE_PATTERN,
            **default(quantity.format_bytes(m.DEFAULT_MIN_BLOCK)),
        ),
        "poolDevice": crd_kit.string(
            "Where the pool lives: cpu (shared memory in /dev/shm), cpu-pinned (page-locked "
            "host memory) or cuda (device memory)." + role,
            enum=list(m.POOL_DEVICES),
            **default(m.DEFAULT_POOL_DEVICE),
        ),
    }


def engine_schema() -> crd_kit.Schema:
    port = {"minimum": 1, "maximum": 65535, "format": "int32"}
    return crd_kit.object_schema(
        "Run an inference engine instead of a handler (docs/vllm.md): it keeps its own "
        "continuous batching and KV cache. A kv edge from one engine role to another makes "
        "the source the prefill (KV producer) and the target the decode (KV consumer); "
        "ranks becomes the engine's tensor parallel size.",
        {
            "kind": crd_kit.string("The engine.", enum=list(engines.ENGINE_KINDS)),
            "model": crd_kit.string(
                "The model the engine serves: a directory in the container, or a name the "
                "engine resolves.",
                maxLength=limits.MAX_URL_LENGTH,
            ),
            "args": {
                **crd_kit.free_object(
                    "Engine arguments by camelCase name: maxModelLen: 512 is vLLM's "
                    "--max-model-len 512; true is a flag, false its --no- form. model, host, "
                    "port, tensorParallelSize, kvTransferConfig and servedModelName are set "
                    "by disagg."
                ),
                "maxProperties": engines.MAX_ENGINE_ARGS,
            },
            "port": crd_kit.integer(
                "The engine's HTTP port (OpenAI API, /health, /metrics).",
                default=engines.DEFAULT_ENGINE_PORT,
                **port,
            ),
            "kvPort": crd_kit.integer(
                "The port a decode engine's KV ingress listens on.",
                default=engines.DEFAULT_KV_PORT,
                **port,
            ),
        },
        required=("kind", "model"),
    )


def transport_schema() -> crd_kit.Schema:
    fields = _pool_fields(defaults=True)
    return crd_kit.object_schema(
        "Transport defaults of the pipeline: the relay of each edge and every role's pool.",
        {
            "relay": crd_kit.string(
                "Default relay of an edge: auto (shared memory within a pod, TCP otherwise), "
                f"{relays.describe()}.",
                enum=list(m.RELAYS),
                default=m.DEFAULT_RELAY,
            ),
            **fields,
            "requestTimeoutSeconds": crd_kit.number(
                "Seconds a request may live from entry to result before it is failed.",
                minimum=0,
                exclusiveMinimum=True,
                maximum=m.MAX_REQUEST_TIMEOUT_SECONDS,
                default=m.DEFAULT_REQUEST_TIMEOUT_SECONDS,
            ),
            "migrationAttempts": crd_kit.integer(
                "How often a request lost with a replica (killed, restarted, drained) before "
                "any output of it came back is resent to a live replica, within its "
                "deadline; 0 never resends (roles[].idempotent: false opts one role out).",
                minimum=0,
                maximum=m.MAX_MIGRATION_ATTEMPTS,
                default=m.DEFAULT_MIGRATION_ATTEMPTS,
            ),
        },
        default={},
    )


def env_schema() -> crd_kit.Schema:
    item = crd_kit.object_schema(
        "An environment variable, as in a Kubernetes container.",
        {
            "name": crd_kit.string(
                "Variable name (letters, digits, '_'); the DISAGG_ prefix is reserved.",
                pattern=crd_kit.ENV_NAME_PATTERN,
                maxLength=limits.MAX_ENV_NAME_LENGTH,
            ),
            "value": crd_kit.string("The value (quote numbers in YAML)."),
            "valueFrom": crd_kit.free_object(
                "A source for the value, as a Kubernetes EnvVarSource (secretKeyRef, "
                "configMapKeyRef, fieldRef, resourceFieldRef)."
            ),
        },
        required=("name",),
        **{
            "x-kubernetes-validations": [
                crd_kit.rule(
                    "!self.name.startsWith('DISAGG_')",
                    "the DISAGG_ prefix is reserved for the contract",
                    ".name",
                ),
                crd_kit.rule(
                    "!(has(self.value) && has(self.valueFrom))",
                    "set either value or valueFrom, not both",
                ),
            ]
        },
    )
    return crd_kit.array(
        "Extra environment variables of the role's container, after the contract's.",
        item,
        maxItems=limits.MAX_ENV,
        **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


def ports_schema() -> crd_kit.Schema:
    item = crd_kit.object_schema(
        "A port the role's container exposes, also published on the role's Service.",
        {
            "name": crd_kit.string(
                "Port name: at most 15 lowercase letters, digits and single '-', with at least "
                "one letter (an IANA service name); ingress and metrics are the runtime's.",
                pattern=crd_kit.PORT_NAME_PATTERN,
                maxLength=15,
            ),
            "containerPort": crd_kit.integer(
                "Port number in the container.", minimum=1, maximum=65535, format="int32"
            ),
            "protocol": crd_kit.string(
                "Protocol of the port.", enum=list(m.PORT_PROTOCOLS), default="TCP"
            ),
        },
        required=("name", "containerPort"),
        **{
            "x-kubernetes-validations": [
                crd_kit.rule("self.name.matches('[a-z]')", "a port name needs a letter", ".name"),
                crd_kit.rule("!self.name.contains('--')", "a port name has no '--'", ".name"),
            ]
        },
    )
    protocol = "(has({0}.protocol) ? {0}.protocol : 'TCP')"
    same = f"q.containerPort == p.containerPort && {protocol.format('q')} == {protocol.format('p')}"
    return crd_kit.array(
        "Extra ports of the role's container (the runtime's ingress and metrics ports are "
        "added by the operator).",
        item,
        maxItems=limits.MAX_PORTS,
        **{
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "x-kubernetes-validations": [
                crd_kit.rule(
                    f"self.all(p, self.exists_one(q, {same}))",
                    "each containerPort/protocol pair may appear once",
                )
            ],
        },
    )


def resources_schema() -> crd_kit.Schema:
    def quantities(what: str) -> crd_kit.Schema:
        return {
            "type": "object",
            "description": f"{what} per resource name (cpu, memory, nvidia.com/gpu, ...), "
            "as Kubernetes quantities.",
            "additionalProperties": crd_kit.quantity(
                "A quantity (e.g. 500m, 2Gi, 1).", pattern=crd_kit.SIZE_PATTERN
            ),
        }

    return crd_kit.object_schema(
        "Compute resources of the role's container, as in Kubernetes. Memory should cover the "
        "pool when poolDevice is cpu (it lives in the pod's /dev/shm).",
        {"requests": quantities("Requests"), "limits": quantities("Limits")},
    )


def autoscaling_schema() -> crd_kit.Schema:
    return crd_kit.object_schema(
        "Backlog-driven scaling: the operator keeps the mean receive-pool occupancy of the "
        "role's replicas near targetPoolOccupancy and, when set, their mean queue depth near "
        "targetQueuePerReplica (the larger ratio wins), within [minReplicas, maxReplicas].",
        {
            "minReplicas": crd_kit.integer(
                "Fewest replicas.", minimum=1, maximum=m.MAX_REPLICAS, format="int32", default=1
            ),
            "maxReplicas": crd_kit.integer(
                "Most replicas.", minimum=1, maximum=m.MAX_REPLICAS, format="int32"
            ),
            "targetPoolOccupancy": crd_kit.number(
                "Wanted mean fraction of the receive pool in use, in (0, 1].",
                minimum=0,
                exclusiveMinimum=True,
                maximum=1,
                default=m.DEFAULT_TARGET_POOL_OCCUPANCY,
            ),
            "targetQueuePerReplica": crd_kit.number(
                "Wanted mean number of requests waiting for a worker per replica; unset: pool "
                "occupancy is the only signal (queued requests then only block scale-down).",
                minimum=0,
                exclusiveMinimum=True,
                maximum=MAX_TARGET_QUEUE,
            ),
            "scaleUpStabilizationSeconds": crd_kit.integer(
                "Seconds of recommendations considered before scaling up (the lowest wins).",
                minimum=0,
                maximum=m.MAX_STABILIZATION_SECONDS,
                format="int32",
                default=m.DEFAULT_SCALE_UP_STABILIZATION_SECONDS,
            ),
            "scaleDownStabilizationSeconds": crd_kit.integer(
                "Seconds of recommendations considered before scaling down (the highest wins).",
                minimum=0,
                maximum=m.MAX_STABILIZATION_SECONDS,
                format="int32",
                default=m.DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS,
            ),
            "tolerance": crd_kit.number(
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
                crd_kit.rule(
                    crd_kit.given("self.minReplicas", "self.minReplicas <= self.maxReplicas"),
                    "minReplicas must not be greater than maxReplicas",
                    ".minReplicas",
                )
            ]
        },
    )


def role_schema() -> crd_kit.Schema:
    strings = {"type": "string", "description": "One element."}
    return crd_kit.object_schema(
        "A stage of the pipeline: replicas of a container running the handler.",
        {
            "name": crd_kit.string(
                "Role name, unique in the pipeline: a DNS-1035 label. Objects are named "
                "<pipeline>-<role>, at most 52 characters.",
                pattern=crd_kit.DNS_1035_LABEL,
                maxLength=m.MAX_LABEL_LENGTH,
            ),
            "replicas": crd_kit.integer(
                "Replicas to run (to start with, when autoscaling). Unset: "
                "autoscaling.minReplicas, else 1.",
                minimum=0,
                maximum=m.MAX_REPLICAS,
                format="int32",
            ),
            "ranks": crd_kit.integer(
                "Processes per pod of a replica, one torch.distributed rank each (tensor or "
                "sequence parallel; one GPU each where the role asks for GPUs: resources are "
                "one rank's). Rank 0 owns the transport and hands every request to the others "
                "(docs/handlers.md).",
                minimum=1,
                maximum=limits.MAX_RANKS,
                format="int32",
                default=m.DEFAULT_RANKS,
            ),
            "nodes": crd_kit.integer(
                "Pods per replica: a group of a leader and nodes-1 workers, each running "
                "`ranks` ranks of one world. The leader (StatefulSet <pipeline>-<role>) is the "
                "only member peers see; worker k runs in StatefulSet <pipeline>-<role>-w<k>; "
                "`replicas` counts groups, and a group restarts whole when a member fails or "
                "is deleted (docs/handlers.md). Fixed once the role exists (a change is refused "
                "at admission). `disagg up` runs groups as rank sets on one machine.",
                minimum=1,
                maximum=limits.MAX_NODES,
                format="int32",
                default=m.DEFAULT_NODES,
            ),
            "idempotent": crd_kit.boolean(
                "Whether running a request twice here is harmless (default true: every "
                "built-in handler). false: a request that may have run at this role is not "
                "resent when a replica is lost (spec.transport.migrationAttempts); it fails, "
                "naming the role."
            ),
            "engine": engine_schema(),
            "handler": crd_kit.string(
                "What each request is handed to: 'package.module:function', or "
                "'package.module:Class' with setup(ctx), __call__ or batch(payloads), close() "
                "(docs/handlers.md).",
                pattern=crd_kit.HANDLER_PATTERN,
                maxLength=limits.MAX_HANDLER_LENGTH,
            ),
            "image": crd_kit.string(
                "Container image of the role. Unset: spec.image.",
                pattern=crd_kit.NO_WHITESPACE,
                maxLength=limits.MAX_IMAGE_LENGTH,
            ),
            "command": crd_kit.array(
                "Container command. Unset: [disagg, role].", strings, maxItems=limits.MAX_ARGS
            ),
            "args": crd_kit.array("Container arguments.", strings, maxItems=limits.MAX_ARGS),
            "env": env_schema(),
            "resources": resources_schema(),
            "ports": ports_schema(),
            "transport": crd_kit.object_schema(
                "The role's own receive pool, overriding spec.transport field by field.",
                _pool_fields(defaults=False),
            ),
            "concurrency": crd_kit.integer(
                "Requests one replica handles at once.",
                minimum=1,
                maximum=m.MAX_CONCURRENCY,
                format="int32",
                default=m.DEFAULT_CONCURRENCY,
            ),
            "autoscaling": autoscaling_schema(),
            "handlerArgs": crd_kit.free_object(
                "Free-form JSON object handed to the handler class's setup(ctx) as ctx.args "
                "(model directory, dtype, ...); reaches the pod as DISAGG_HANDLER_ARGS."
            ),
            "batching": crd_kit.object_schema(
                "Gather waiting requests into one batch() call of the handler class.",
                {
                    "maxBatchSize": crd_kit.integer(
                        "Most requests in one batch; at most the role's concurrency.",
                        minimum=1,
                        format="int32",
                    ),
                    "maxWaitMilliseconds": crd_kit.number(
                        "How long a batch waits to fill after its first request.",
                        minimum=0,
                        maximum=60000,
                        default=m.DEFAULT_MAX_BATCH_WAIT_MILLISECONDS,
                    ),
                },
                required=("maxBatchSize",),
            ),
            "compat": crd_kit.string(
                "Compat token of the role's payload contract: bump it (on both sides of an "
                "edge, to the same value) when what the role sends or reads changes; senders "
                "route only to replicas whose token pairs with theirs, so a rollout never "
                "crosses incompatible revisions (docs/rollout.md). Unset: auto, which pairs "
                "with anything.",
                pattern=f"^{compat.TOKEN_PATTERN}$",
                maxLength=63,
            ),
            "compatibleWith": crd_kit.array(
                "Further compat tokens this revision still interoperates with.",
                crd_kit.string(
                    "A compat token.", pattern=f"^{compat.TOKEN_PATTERN}$", maxLength=63
                ),
                maxItems=compat.MAX_ACCEPTS,
            ),
            "startupSeconds": crd_kit.integer(
                "How long the startup probe allows the handler's setup (model loading).",
                minimum=1,
                format="int32",
                default=m.DEFAULT_STARTUP_SECONDS,
            ),
            "podTemplate": crd_kit.free_object(
                "A Kubernetes PodTemplateSpec (metadata, spec) merged last into the role's "
                "pod template: maps merge, containers/volumes/env merge by name, other lists "
                "are replaced, null removes a field. Labels and DISAGG_* variables stay. "
                "Settings that weaken the pod (privileged, host namespaces, hostPath, root, "
                "added capabilities, privilege escalation, hardening removed with null) are "
                f"refused unless the pipeline is annotated {m.ANNOTATION_ALLOW_PRIVILEGED}: "
                '"true" (docs/security.md).'
            ),
        },
        required=("name",),
        **{
            "x-kubernetes-validations": [
                crd_kit.rule(
                    "has(self.handler) != has(self.engine)",
                    "a role runs either a handler or an engine: set exactly one",
                ),
                crd_kit.rule(
                    crd_kit.given(
                        "self.batching",
                        "self.batching.maxBatchSize <= "
                        f"(has(self.concurrency) ? self.concurrency : {m.DEFAULT_CONCURRENCY})",
                    ),
                    "batching.maxBatchSize exceeds concurrency: larger batches never form",
                    ".batching.maxBatchSize",
                ),
                crd_kit.rule(
                    f"(has(self.nodes) ? self.nodes : {m.DEFAULT_NODES}) == "
                    f"(has(oldSelf.nodes) ? oldSelf.nodes : {m.DEFAULT_NODES})",
                    "nodes cannot change on a live role: every group's pods and world size "
                    "would change, and the role's StatefulSets' serviceName and selector are "
                    "immutable. Remove the role (or the pipeline) and add it again, or give the "
                    "role a new name (docs/troubleshooting.md)",
                    ".nodes",
                ),
            ]
        },
    )
