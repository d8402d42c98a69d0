"""Pod templates of the planner's StatefulSets: containers, contract env, probes, volumes,
hardening and the GPU of a colocation group. The rules are in `planner`'s docstring."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from typing import Any, Final

from disagg_core import contract, quantity
from disagg_core.spec import EnvSetting, Pipeline, Role
from disagg_operator import names
from disagg_operator.plan import engines, merge
from disagg_operator.plan.groups import group_index_env

TOPOLOGY_KEY: Final = os.path.basename(contract.DEFAULT_TOPOLOGY_FILE)  # topology.json
TOPOLOGY_DIR: Final = os.path.dirname(contract.DEFAULT_TOPOLOGY_FILE)  # /etc/disagg
PEER_KEY_KEY: Final = os.path.basename(contract.DEFAULT_PEER_KEY_FILE)  # key
PEER_KEY_DIR: Final = os.path.dirname(contract.DEFAULT_PEER_KEY_FILE)  # /etc/disagg-peer-key
PEER_KEY_VOLUME: Final = "peer-key"
PEER_KEY_MODE: Final = 0o440  # owner and group (fsGroup 65532) read; nobody else
DEFAULT_COMMAND: Final = ("disagg", "role")
GPU_CLAIM: Final = "gpu"
DEVICE_PLUGIN_RESOURCE: Final = "nvidia.com/gpu"
SHM_MARGIN: Final = 64 * 2**20
NONROOT_ID: Final = 65532
_DROPPED_ENV: Final = (contract.PREFIX + "REPLICA",)  # the ordinal of DISAGG_POD_NAME instead


def pod_template(
    pipeline: Pipeline,
    roles: Sequence[Role],
    configs: Mapping[str, contract.RoleConfig],
    *,
    labels: Mapping[str, str],
    spec_hash: str,
    config_map: str,
    peer_key_secret: str,
    peer_key_hash: str | None = None,
    shared: bool,
    gpu: str,
    claim_template: str | None,
    engine_commands: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """The PodTemplateSpec of one unit: a container per role of `roles` (in order).

    `shared` marks a colocation group (shared process namespace); `gpu` is the GPU mode
    (`dra` needs `claim_template`), "none" for a lone role. `peer_key_hash` (when the key is
    known) becomes the pod annotation disagg.dev/peer-key-hash. `engine_commands`: the
    command of each engine role of `roles` (`engines.command`).
    """
    commands = engine_commands or {}
    containers = [
        _container(pipeline, role, configs[role.name], claim=gpu == "dra", index=k, engine=commands)
        for k, role in enumerate(roles)
    ]
    if gpu == "device-plugin":
        limits = containers[0].setdefault("resources", {}).setdefault("limits", {})
        limits.setdefault(DEVICE_PLUGIN_RESOURCE, "1")
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        "containers": containers,
        "volumes": _volumes(pipeline, roles, config_map, peer_key_secret),
    }
    if shared:
        spec["shareProcessNamespace"] = True
    if gpu == "dra" and claim_template is not None:
        spec["resourceClaims"] = [{"name": GPU_CLAIM, "resourceClaimTemplateName": claim_template}]
    annotations = _pinned(spec_hash, peer_key_hash)
    if len(roles) > 1:
        annotations["kubectl.kubernetes.io/default-container"] = roles[0].name
    template: dict[str, Any] = {
        "metadata": {"labels": dict(labels), "annotations": annotations},
        "spec": spec,
    }
    for role in roles:
        if role.pod_template:
            template = merge.deep_merge(template, role.pod_template)
    ours = {role.name: _planned_env(role, configs[role.name]) for role in roles}
    return _reassert(template, labels, _pinned(spec_hash, peer_key_hash), ours)


def _pinned(spec_hash: str, peer_key_hash: str | None) -> dict[str, str]:
    """The annotations a podTemplate cannot change: what rolls the pods."""
    result = {names.ANNOTATION_SPEC_HASH: spec_hash}
    if peer_key_hash is not None:
        result[names.ANNOTATION_PEER_KEY_HASH] = peer_key_hash
    return result


def _planned_env(role: Role, config: contract.RoleConfig) -> list[dict[str, Any]]:
    """The variables of a role container a podTemplate cannot change."""
    return engines.env() if engines.is_engine(role) else contract_env(config)


def contract_env(config: contract.RoleConfig) -> list[dict[str, Any]]:
    """The contract part of a container's env: DISAGG_* as rendered, DISAGG_POD_NAME from
    the downward API."""
    env: list[dict[str, Any]] = [group_index_env()] if config.nodes > 1 else []
    env += [
        {"name": key, "value": value}
        for key, value in contract.render_env(config).items()
        if key not in _DROPPED_ENV
    ]
    env.append(
        {
            "name": contract.PREFIX + "POD_NAME",
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
        }
    )
    return env


def runtime_port_name(kind: str, index: int) -> str:
    """The name of the runtime's `kind` port (ingress, lane, metrics) of the container at
    `index` of a pod: `kind` for the first, `kind-<index>` for the others (port names are
    unique in a pod, so that what selects a port by name reaches every container's)."""
    return kind if index == 0 else f"{kind}-{index}"


def _container(
    pipeline: Pipeline,
    role: Role,
    config: contract.RoleConfig,
    *,
    claim: bool,
    index: int,
    engine: Mapping[str, Sequence[str]],
) -> dict[str, Any]:
    """A role's container: a handler's `disagg role` (or its command) with the contract
    env, the runtime's ports and probes; an engine's server (`engines`)."""
    image = pipeline.image_for(role.name)
    container: dict[str, Any] = {"name": role.name, "image": image}
    if engines.is_engine(role):
        container["command"] = list(engine[role.name])
        own_env = engines.env()
        ports = [
            (engines.port_name(kind, index), port) for kind, port in engines.ports(pipeline, role)
        ]
        probes = engines.probes(role)
    else:
        container["command"] = list(role.command if role.command is not None else DEFAULT_COMMAND)
        if role.args is not None:
            container["args"] = list(role.args)
        own = {var.name for var in role.env}  # the role's own OTEL_* win over spec.monitoring's
        own_env = contract_env(config) + [
            {"name": k, "value": v}
            for k, v in contract.tracing_env(pipeline).items()
            if k not in own
        ]
        ports = [
            (runtime_port_name(kind, index), port)
            for kind, port in (
                ("ingress", config.ingress_port),
                ("lane", config.lane_port),
                ("metrics", config.metrics_port),
            )
        ]
        probes = _probes(config.metrics_port, role.startup_seconds)
    container["env"] = own_env + [_user_env(var) for var in role.env]
    container["ports"] = [
        {"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports
    ] + [
        {"name": p.name, "containerPort": p.container_port, "protocol": p.protocol}
        for p in role.ports
    ]
    resources: dict[str, Any] = {}
    if role.resources.requests:
        resources["requests"] = _per_rank(role.resources.requests, role.ranks)
    if role.resources.limits:
        resources["limits"] = _per_rank(role.resources.limits, role.ranks)
    if claim:
        resources["claims"] = [{"name": GPU_CLAIM}]
    if resources:
        container["resources"] = resources
    container.update(probes)
    container["securityContext"] = _container_security()
    container["volumeMounts"] = [
        {"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": PEER_KEY_VOLUME, "mountPath": PEER_KEY_DIR, "readOnly": True},
    ]
    return container


def _per_rank(quantities: Mapping[str, str], ranks: int) -> dict[str, str]:
    """A role's resources are one rank's: a pod of `ranks` ranks asks for that many times
    each (GPUs included: one per rank)."""
    if ranks == 1:
        return dict(quantities)
    return {name: quantity.scale_quantity(value, ranks) for name, value in quantities.items()}


def _user_env(var: EnvSetting) -> dict[str, Any]:
    if var.value_from is not None:
        return {"name": var.name, "valueFrom": copy.deepcopy(dict(var.value_from))}
    return {"name": var.name, "value": var.value}


def _probes(port: int, startup_seconds: int) -> dict[str, Any]:
    """/healthz fails until the handler's setup is done: the startup probe gives it
    `startupSeconds` (liveness starts after it), readiness gates traffic."""

    def get(path: str) -> dict[str, Any]:
        return {"path": path, "port": port}

    return {
        "startupProbe": {
            "httpGet": get("/healthz"),
            "periodSeconds": 5,
            "failureThreshold": max(1, -(-startup_seconds // 5)),
        },
        "readinessProbe": {
            "httpGet": get("/readyz"),
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": get("/healthz"),
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": NONROOT_ID,
        "runAsGroup": NONROOT_ID,
        "fsGroup": NONROOT_ID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": NONROOT_ID,
        "runAsGroup": NONROOT_ID,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _sidecar_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def shm_size(pipeline: Pipeline, roles: Sequence[Role]) -> int:
    """Bytes of the pod's /dev/shm: every role's pool plus a margin."""
    return sum(pipeline.pool_for(role.name).size for role in roles) + SHM_MARGIN


def _volumes(
    pipeline: Pipeline, roles: Sequence[Role], config_map: str, peer_key_secret: str
) -> list[dict[str, Any]]:
    shm = quantity.format_bytes(shm_size(pipeline, roles))
    return [
        {"name": "topology", "configMap": {"name": config_map}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
        {"name": "tmp", "emptyDir": {}},
        {
            "name": PEER_KEY_VOLUME,
            "secret": {
                "secretName": peer_key_secret,
                "defaultMode": PEER_KEY_MODE,
                "items": [{"key": PEER_KEY_KEY, "path": PEER_KEY_KEY}],
            },
        },
    ]


def _reassert(
    template: dict[str, Any],
    labels: Mapping[str, str],
    pinned: Mapping[str, str],
    planned_env: Mapping[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """Put back what a podTemplate must not change: labels (the selector), the pinned
    annotations, and the DISAGG_* variables of each role container (first, as planned).
    Containers the podTemplate adds (sidecars, init containers) get no privilege escalation
    and no capabilities unless they say otherwise (which `podpolicy` then judges)."""
    meta = template.setdefault("metadata", {})
    meta["labels"] = {**(meta.get("labels") or {}), **labels}
    meta["annotations"] = {**(meta.get("annotations") or {}), **pinned}
    spec = template.get("spec") or {}
    for kind in ("initContainers", "containers"):
        for container in spec.get(kind) or []:
            if isinstance(container, dict) and container.get("name") not in planned_env:
                theirs = container.get("securityContext") or {}
                container["securityContext"] = merge.deep_merge(_sidecar_security(), theirs)
    for container in spec.get("containers", []):
        ours = planned_env.get(container.get("name"))
        if ours is None:
            continue
        planned = {var["name"] for var in ours}
        theirs = [
            var
            for var in container.get("env") or []
            if not str(var.get("name", "")).startswith(contract.PREFIX)
            and var.get("name") not in planned
        ]
        container["env"] = [*ours, *theirs]
    return template
