"""Engine roles' part of the plan (spec/engines.py): what differs from a handler role's pod.

An engine container runs `python -m vllm.entrypoints.openai.api_server` with the argv of
`disagg_core.contract.engine_command` (one derivation with `disagg up`), so the model, the
engine arguments, `--tensor-parallel-size` from `ranks` and the KV connector's
`--kv-transfer-config` from the pipeline's `kv` edges are what `disagg up` would run:

- a decode (consumer) engine listens for KV on tcp://0.0.0.0:kvPort;
- a prefill (producer) engine is given `decodes`: the KV endpoint of every replica its
  blocks may go to, tcp://P-U-i.P-R.NS.svc.<domain>:kvPort (the pod's DNS name under the
  decode role's headless Service) for i below the decode unit's replica bound (its
  `autoscaling.maxReplicas` when it has one, so the autoscaler's moves inside the bounds
  do not roll the prefill pods; else its replicas), or tcp://127.0.0.1:kvPort when both
  run in one pod (a colocation group);
- both read the pipeline's peer key from the Secret mounted as in every role pod.

Ports: the engine's HTTP port (OpenAI API, /health, /metrics) is named `engine` and a
consumer's KV ingress `kv` (`-<k>` for the k-th container of a pod, as the runtime's);
an engine container serves none of the runtime's ingress, lane or metrics ports. Probes:
the startup probe GETs /health for the role's startupSeconds (engines load the model and
warm up before it answers: 12-30 s for a tiny model on a CPU), then readiness and liveness
GET /health. HOME is /tmp (the writable emptyDir under the read-only root: vLLM's and the
Hugging Face caches), DISAGG_POD_NAME comes from the downward API.

Pure; `pods` and `manifests` call these for the roles with an `engine`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

from disagg_core import contract
from disagg_core.spec import Pipeline, Role
from disagg_operator.plan import model

ENGINE_PORT_NAME: Final = "engine"  # the engine's HTTP port
KV_PORT_NAME: Final = "kv"  # a consumer's KV ingress
HEALTH_PATH: Final = "/health"
METRICS_PATH: Final = "/metrics"
PYTHON: Final = "python"  # the engine image's interpreter, on its PATH
HOME: Final = "/tmp"
RESERVED_PORT_NAMES: Final = (ENGINE_PORT_NAME, KV_PORT_NAME)


def is_engine(role: Role) -> bool:
    return role.engine is not None


def port_name(kind: str, index: int) -> str:
    """`kind` for the first container of a pod, `kind-<index>` for the others (port names
    are unique in a pod)."""
    return kind if index == 0 else f"{kind}-{index}"


def replica_bound(role: Role, unit: model.Workload) -> int:
    """How many replicas of `role`'s unit a peer must know of: the autoscaler's ceiling
    when it scales the unit (moves inside the bounds then change no peer's pod), else
    the unit's replicas."""
    ceiling = role.autoscaling.max_replicas if role.autoscaling is not None else 0
    return max(unit.replicas, ceiling)


def endpoints(
    pipeline: Pipeline, role: str, *, namespace: str, options: model.PlanOptions
) -> tuple[contract.EngineEndpoint, ...]:
    """Every replica of engine role `role` by its pod's DNS name under the unit's headless
    Service, up to the unit's replica bound (contract.replica_endpoint: as `disagg up`)."""
    engine = pipeline.role(role).engine
    assert engine is not None
    home = model.workload_of(pipeline, role, options)
    service = pipeline.derived_name(home.roles[0].name)  # the governing Service
    domain = f"{service}.{namespace}.svc.{options.cluster_domain}"
    count = replica_bound(pipeline.role(role), home)
    return tuple(
        contract.replica_endpoint(
            pipeline,
            role,
            i,
            host=f"{home.name}-{i}.{domain}",
            port=engine.port,
            kv_port=engine.kv_port,
        )
        for i in range(count)
    )


def colocated(pipeline: Pipeline, role: str, other: str, options: model.PlanOptions) -> bool:
    """Both roles run in one pod (a colocation group)."""
    return any(r.name == other for r in model.workload_of(pipeline, role, options).roles)


def kv_endpoints(
    pipeline: Pipeline, decode: str, *, near: str, namespace: str, options: model.PlanOptions
) -> tuple[str, ...]:
    """The KV endpoints of every replica of consumer `decode` as seen from role `near`."""
    engine = pipeline.role(decode).engine
    assert engine is not None
    if colocated(pipeline, decode, near, options):
        return (f"tcp://127.0.0.1:{engine.kv_port}",)
    found = endpoints(pipeline, decode, namespace=namespace, options=options)
    return tuple(e.kv_endpoint for e in found)


def gateway_table(
    pipeline: Pipeline, namespace: str, options: model.PlanOptions
) -> contract.EngineTable | None:
    """What the gateway routes over (the topology file's `engines`): the route and every
    replica of its roles; the decode replicas' `kv` is what the prefill engines are told
    (`kv_endpoints`), so the gateway names only endpoints they send to. Prefill and decode
    in one pod are `paired`: a request's prefill replica is its decode replica's pod's.
    None for a pipeline without engine roles."""
    if not pipeline.engine_roles:
        return None
    route = contract.route_of(pipeline, node_local=False)
    replicas = {
        role: endpoints(pipeline, role, namespace=namespace, options=options)
        for role in route.roles
    }
    decode = route.decode
    if decode is not None:
        near = route.entry
        told = kv_endpoints(pipeline, decode, near=near, namespace=namespace, options=options)
        if colocated(pipeline, decode, route.entry, options):
            route = dataclasses.replace(route, paired=True)
            told = told * len(replicas[decode])
        replicas[decode] = tuple(
            dataclasses.replace(e, kv_endpoint=kv)
            for e, kv in zip(replicas[decode], told, strict=True)
        )
    return contract.EngineTable(route, replicas)


def launch(
    pipeline: Pipeline, role: str, *, namespace: str, options: model.PlanOptions
) -> contract.EngineLaunch:
    """Where each replica of engine role `role` runs (the same for every pod of it: a
    pod's /dev/shm is its own, so the role's name names the connector's memory)."""
    engine = pipeline.role(role).engine
    assert engine is not None
    decodes = tuple(
        endpoint
        for target in pipeline.kv_targets(role)
        for endpoint in kv_endpoints(
            pipeline, target, near=role, namespace=namespace, options=options
        )
    )
    consumer = pipeline.kv_role(role) == "kv_consumer"
    return contract.EngineLaunch(
        name=role,
        host="0.0.0.0",
        port=engine.port,
        key_file=contract.DEFAULT_PEER_KEY_FILE,
        kv_listen=f"tcp://0.0.0.0:{engine.kv_port}" if consumer else "",
        decodes=decodes,
    )


def command(
    pipeline: Pipeline, role: str, *, namespace: str, options: model.PlanOptions
) -> list[str]:
    """The engine container's command."""
    where = launch(pipeline, role, namespace=namespace, options=options)
    return contract.engine_command(pipeline, role, where, python=PYTHON)


def ports(pipeline: Pipeline, role: Role) -> list[tuple[str, int]]:
    """(kind, port) of the engine's own ports: its HTTP port, and a consumer's KV port."""
    assert role.engine is not None
    result = [(ENGINE_PORT_NAME, role.engine.port)]
    if pipeline.kv_role(role.name) == "kv_consumer":
        result.append((KV_PORT_NAME, role.engine.kv_port))
    return result


def env() -> list[dict[str, Any]]:
    """The engine container's own variables (put back after a podTemplate, like DISAGG_*)."""
    return [
        {"name": "HOME", "value": HOME},
        {
            "name": contract.PREFIX + "POD_NAME",
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
        },
    ]


def probes(role: Role) -> dict[str, Any]:
    """/health answers once the engine has loaded the model and started its core; the
    startup probe gives it the role's startupSeconds (liveness starts after it)."""
    assert role.engine is not None
    get = {"path": HEALTH_PATH, "port": role.engine.port}
    return {
        "startupProbe": {
            "httpGet": dict(get),
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": max(1, -(-role.startup_seconds // 5)),
        },
        "readinessProbe": {
            "httpGet": dict(get),
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": dict(get),
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
    }
