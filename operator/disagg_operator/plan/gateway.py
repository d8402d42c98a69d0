"""The gateway's objects (`spec.gateway`, on by default). Pure; `planner.plan` adds them.

    Deployment        P-gateway   `disagg gateway` (the roles' image: spec.image, else the
                                  first entry role's), spec.gateway.replicas
    Service           P           ClusterIP, port `http` = spec.gateway.port -> the pods'

Pods are labelled app.kubernetes.io/component: gateway and disagg.dev/pipeline: P (the
pipeline's NetworkPolicy admits them to the roles) and carry no disagg.dev/role label, so
the autoscaler never counts them. They get the gateway's contract (DISAGG_GATEWAY_*, see
`contract`): the entry roles by Service DNS name and ingress port, replies on port
`ingress` (7400) at the pod's IP (DISAGG_POD_IP from the downward API), the topology file
from the ConfigMap, the pipeline's peer key (Secret P-peer-key, as role pods: the gateway is
a peer of the roles) and with `auth` the token Secret's key mounted at /etc/disagg-gateway.
In front of engine roles it routes from the topology file's `engines` section
(plan/engines.gateway_table: every replica's HTTP endpoint by pod DNS name, the decode
replicas' KV endpoints) over HTTP, not as a peer: so without the reply path
(`contract.takes_replies`): no DISAGG_DOWNSTREAM and the other `contract.REPLY_PATH`
variables, no `ingress` port or its NetworkPolicy rule, no peer key.
Probes: readiness GET /readyz (every entry role reachable), liveness GET /healthz. Hardened
as role pods are (non-root, read-only root, no capabilities, no service-account token).
spec.gateway.podTemplate is deep-merged last; labels and DISAGG_* variables are put back.
"""

from __future__ import annotations

import copy
from typing import Any, Final

from disagg_core import contract
from disagg_core.spec import Pipeline
from disagg_operator import names
from disagg_operator.plan import merge, pods

CONTAINER: Final = "gateway"
COMMAND: Final = ("disagg", "gateway")
TOKEN_DIR: Final = "/etc/disagg-gateway"
TOKEN_FILE: Final = f"{TOKEN_DIR}/token"
REPLY_PORT: Final = contract.DEFAULT_INGRESS_PORT


def deployment_name(pipeline: Pipeline) -> str:
    return pipeline.derived_name(CONTAINER)


def service_name(pipeline: Pipeline) -> str:
    return pipeline.name


def url(pipeline: Pipeline, namespace: str) -> str:
    return f"http://{service_name(pipeline)}.{namespace}.svc:{pipeline.gateway.port}"


def labels(pipeline: Pipeline) -> dict[str, str]:
    return {
        names.LABEL_NAME: names.APP_NAME,
        names.LABEL_INSTANCE: pipeline.name,
        names.LABEL_COMPONENT: CONTAINER,
        names.LABEL_MANAGED_BY: names.MANAGER,
        names.LABEL_PIPELINE: pipeline.name,
    }


def selector(pipeline: Pipeline) -> dict[str, str]:
    return {names.LABEL_PIPELINE: pipeline.name, names.LABEL_COMPONENT: CONTAINER}


def image(pipeline: Pipeline) -> str | None:
    return pipeline.image or pipeline.image_for(pipeline.entry_roles[0])


def config(
    pipeline: Pipeline, namespace: str, entries: tuple[contract.Peer, ...]
) -> contract.GatewayConfig:
    """The gateway's contract; the token and peer key paths are where `deployment` mounts
    their Secrets."""
    spec = pipeline.gateway
    return contract.GatewayConfig(
        pipeline=pipeline.name,
        namespace=namespace,
        topology=contract.Topology.from_pipeline(pipeline, namespace=namespace),
        entries=entries,
        port=spec.port,
        reply_port=REPLY_PORT,
        api=spec.api,
        model=spec.model or "",
        token_file=TOKEN_FILE if spec.auth is not None else "",
        pool_size=pipeline.transport.pool_size,
        request_timeout=pipeline.transport.request_timeout_seconds,
        peer_key_file=contract.DEFAULT_PEER_KEY_FILE,
        max_tokens=pipeline.gateway_max_tokens,
    )


def env(config: contract.GatewayConfig) -> list[dict[str, Any]]:
    rendered = [{"name": k, "value": v} for k, v in contract.render_gateway_env(config).items()]
    if not contract.takes_replies(config.topology):
        return rendered
    pod_ip = {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
    return [*rendered, {"name": contract.PREFIX + "POD_IP", "valueFrom": pod_ip}]


def deployment(
    pipeline: Pipeline,
    namespace: str,
    entries: tuple[contract.Peer, ...],
    *,
    config_map: str,
    spec_hash: str,
    peer_key_secret: str,
) -> dict[str, Any]:
    spec = pipeline.gateway
    tracing = [{"name": k, "value": v} for k, v in contract.tracing_env(pipeline).items()]
    ours_config = config(pipeline, namespace, entries)
    replies = contract.takes_replies(ours_config.topology)
    ours = env(ours_config) + tracing
    reply_port = [{"name": "ingress", "containerPort": REPLY_PORT, "protocol": "TCP"}]
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image(pipeline),
        "command": list(COMMAND),
        "env": ours,
        "ports": [
            {"name": "http", "containerPort": spec.port, "protocol": "TCP"},
            *(reply_port if replies else []),
        ],
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "securityContext": pods._container_security(),
        "volumeMounts": [
            {"name": "topology", "mountPath": pods.TOPOLOGY_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    resources: dict[str, Any] = {}
    if spec.resources.requests:
        resources["requests"] = dict(spec.resources.requests)
    if spec.resources.limits:
        resources["limits"] = dict(spec.resources.limits)
    if resources:
        container["resources"] = resources
    volumes: list[dict[str, Any]] = [
        {"name": "topology", "configMap": {"name": config_map}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if replies:  # a peer of the roles: it authenticates to them with the pipeline's key
        container["volumeMounts"].append(
            {"name": pods.PEER_KEY_VOLUME, "mountPath": pods.PEER_KEY_DIR, "readOnly": True}
        )
        volumes.append(
            {
                "name": pods.PEER_KEY_VOLUME,
                "secret": {
                    "secretName": peer_key_secret,
                    "defaultMode": pods.PEER_KEY_MODE,
                    "items": [{"key": pods.PEER_KEY_KEY, "path": pods.PEER_KEY_KEY}],
                },
            }
        )
    if spec.auth is not None:
        container["volumeMounts"].append(
            {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True}
        )
        volumes.append(
            {
                "name": "token",
                "secret": {
                    "secretName": spec.auth.name,
                    "items": [{"key": spec.auth.key, "path": "token"}],
                },
            }
        )
    template: dict[str, Any] = {
        "metadata": {
            "labels": labels(pipeline),
            "annotations": {names.ANNOTATION_SPEC_HASH: spec_hash},
        },
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": pods._pod_security(),
            "containers": [container],
            "volumes": volumes,
        },
    }
    if spec.pod_template:
        template = merge.deep_merge(template, copy.deepcopy(spec.pod_template))
    pinned = {names.ANNOTATION_SPEC_HASH: spec_hash}
    template = pods._reassert(template, labels(pipeline), pinned, {CONTAINER: ours})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name(pipeline),
            "namespace": namespace,
            "labels": labels(pipeline),
        },
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector(pipeline)},
            "template": template,
        },
    }


def network_policy_name(pipeline: Pipeline) -> str:
    return pipeline.derived_name("gateway-network")


def network_policy(
    pipeline: Pipeline, namespace: str, roles: dict[str, Any], clients: list[dict[str, Any]]
) -> dict[str, Any]:
    """NetworkPolicy P-gateway-network (with the pipeline's, unless spec.networkPolicy is
    off): the gateway's HTTP port admits its namespace's pods and `clients`
    (spec.networkPolicy.clients); its reply port (`ingress`) only the role pods (`roles`, a
    selector), which send it results (none in front of engine roles). Egress stays open."""
    ingress: list[dict[str, Any]] = [
        {
            "from": [{"podSelector": {}}, *copy.deepcopy(clients)],
            "ports": [{"protocol": "TCP", "port": pipeline.gateway.port}],
        }
    ]
    if contract.takes_replies(contract.Topology.from_pipeline(pipeline, namespace=namespace)):
        ingress.append(
            {
                "from": [{"podSelector": copy.deepcopy(roles)}],
                "ports": [{"protocol": "TCP", "port": REPLY_PORT}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": network_policy_name(pipeline),
            "namespace": namespace,
            "labels": labels(pipeline),
        },
        "spec": {
            "podSelector": {"matchLabels": selector(pipeline)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def service(pipeline: Pipeline, namespace: str) -> dict[str, Any]:
    port = pipeline.gateway.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(pipeline),
            "namespace": namespace,
            "labels": labels(pipeline),
        },
        "spec": {
            "type": "ClusterIP",
            "selector": selector(pipeline),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
