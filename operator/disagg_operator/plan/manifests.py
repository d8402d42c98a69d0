"""The planned objects one by one (ConfigMap, ResourceClaimTemplate, Services, NetworkPolicy,
StatefulSets, the gateway's Service and Deployment, the peer key Secret) and their names.
Pure; `planner.plan` puts them in apply order, and `planner`'s docstring states the rules."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from disagg_core import contract
from disagg_core.spec import ColocationGroup, Pipeline, Role
from disagg_operator import names
from disagg_operator.plan import engines, gateway, groups, model, pods


def topology_config_map_name(pipeline: Pipeline) -> str:
    return pipeline.derived_name("topology")


def network_policy_name(pipeline: Pipeline) -> str:
    return pipeline.derived_name("network")


def peer_key_secret_name(pipeline: str) -> str:
    return f"{pipeline}-peer-key"


def peer_key_digest(key: str) -> str:
    """disagg.dev/peer-key-hash of a peer key (the Secret's `key`, as text)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def peer_key_secret(
    pipeline: str, *, namespace: str, key: str, owner: model.Owner | None = None
) -> dict[str, Any]:
    """The Secret the role pods mount (see the module docstring); `key` comes from the
    caller (`secrets.token_hex(32)`), so that this stays pure."""
    secret: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(
            peer_key_secret_name(pipeline), namespace, model.common_labels(pipeline, "peer-key")
        ),
        "type": "Opaque",
        "data": {pods.PEER_KEY_KEY: base64.b64encode(key.encode()).decode()},
    }
    if owner is not None:
        secret["metadata"]["ownerReferences"] = [owner.reference()]
    return secret


def claim_template_name(pipeline: Pipeline, group: str) -> str:
    return f"{pipeline.derived_name(group)}-gpu"


def _meta(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels}


def config_map(
    pipeline: Pipeline, namespace: str, options: model.PlanOptions | None = None
) -> dict[str, Any]:
    """The topology ConfigMap; for engine roles with the gateway's `engines` section."""
    table = engines.gateway_table(pipeline, namespace, options or model.PlanOptions())
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(
            topology_config_map_name(pipeline),
            namespace,
            model.common_labels(pipeline.name, "topology"),
        ),
        "data": {pods.TOPOLOGY_KEY: model.topology_text(pipeline, namespace, table)},
    }


def claim_template(
    pipeline: Pipeline,
    unit: model.Workload,
    group: ColocationGroup,
    namespace: str,
    options: model.PlanOptions,
) -> dict[str, Any]:
    return {
        "apiVersion": options.dra_api_version,
        "kind": "ResourceClaimTemplate",
        "metadata": _meta(
            claim_template_name(pipeline, group.name), namespace, unit.labels(pipeline)
        ),
        "spec": {
            "metadata": {"labels": unit.labels(pipeline)},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": pods.GPU_CLAIM,
                            "exactly": {
                                "deviceClassName": model.gpu_device_class(pipeline),
                                "allocationMode": "ExactCount",
                                "count": 1,
                            },
                        }
                    ]
                }
            },
        },
    }


def service(pipeline: Pipeline, unit: model.Workload, role: Role, namespace: str) -> dict[str, Any]:
    service_ports = [
        {"name": name, "port": port, "targetPort": port, "protocol": "TCP"}
        for name, port in _own_ports(pipeline, unit, role)
    ]
    service_ports += [
        {
            "name": port.name,
            "port": port.container_port,
            "targetPort": port.container_port,
            "protocol": port.protocol,
        }
        for port in role.ports
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(
            pipeline.derived_name(role.name), namespace, unit.labels(pipeline, role.name)
        ),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": _leaders(unit.selector(pipeline), role),
            "ports": service_ports,
        },
    }


def _own_ports(pipeline: Pipeline, unit: model.Workload, role: Role) -> list[tuple[str, int]]:
    """(name, port) of what disagg runs in `role`'s container: the runtime's ingress, lane
    and metrics ports, or an engine's HTTP and KV ports."""
    if engines.is_engine(role):
        return engines.ports(pipeline, role)
    ports = model.role_ports(unit)[role.name]
    return [("ingress", ports.ingress), ("lane", ports.lane), ("metrics", ports.metrics)]


def _leaders(selector: dict[str, str], role: Role) -> dict[str, str]:
    """A group's leader alone stands for the group (peers see one address per group)."""
    return groups.member_labels(selector, 0) if groups.grouped(role) else selector


def ranks_services(
    pipeline: Pipeline, unit: model.Workload, namespace: str
) -> list[dict[str, Any]]:
    """Service P-R-ranks of a role of groups (`groups.ranks_service`); none otherwise."""
    role = unit.roles[0]
    if not groups.grouped(role):
        return []
    config = model.role_config(pipeline, role.name, namespace=namespace)
    return [
        groups.ranks_service(
            pipeline,
            role,
            unit.labels(pipeline),
            unit.selector(pipeline),
            namespace,
            config.rank_port,
        )
    ]


def ranks_network_policy(
    pipeline: Pipeline, unit: model.Workload, namespace: str
) -> list[dict[str, Any]]:
    """NetworkPolicy P-R-ranks of a role of groups: its pods admit each other on every port
    (the rank port's rendezvous, then gloo's and NCCL's own connections on ports they
    pick); policies add up, so P-network still admits the peers on the runtime's ports."""
    if not groups.grouped(unit.roles[0]):
        return []
    members = {"matchLabels": unit.selector(pipeline)}
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(
                groups.ranks_service_name(pipeline, unit.roles[0].name),
                namespace,
                unit.labels(pipeline),
            ),
            "spec": {
                "podSelector": copy.deepcopy(members),
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": copy.deepcopy(members)}]}],
            },
        }
    ]


def role_selector(pipeline: str) -> dict[str, Any]:
    """A LabelSelector of every role pod of the pipeline (not its gateway's)."""
    return {
        "matchLabels": {names.LABEL_PIPELINE: pipeline, names.LABEL_MANAGED_BY: names.MANAGER},
        "matchExpressions": [{"key": names.LABEL_ROLE, "operator": "Exists"}],
    }


def gateway_selector(pipeline: str) -> dict[str, Any]:
    return {
        "matchLabels": {
            names.LABEL_COMPONENT: names.COMPONENT_GATEWAY,
            names.LABEL_PIPELINE: pipeline,
        }
    }


def network_policy(
    pipeline: Pipeline,
    units: tuple[model.Workload, ...],
    namespace: str,
    options: model.PlanOptions,
) -> dict[str, Any]:
    settings = pipeline.network_policy
    runtime: set[tuple[str, int]] = set()
    metrics: set[tuple[str, int]] = set()
    kv: set[tuple[str, int]] = set()
    producers: set[str] = set()  # the units of the roles that send KV blocks
    for unit in units:
        for role in unit.roles:
            runtime |= {(port.protocol, port.container_port) for port in role.ports}
            if engines.is_engine(role):
                for name, port in engines.ports(pipeline, role):
                    if name == engines.KV_PORT_NAME:
                        kv.add(("TCP", port))
                        producers |= {
                            model.workload_of(pipeline, edge.source, options).unit
                            for edge in pipeline.edges_to(role.name)
                            if edge.kind == "kv"
                        }
                    else:  # the HTTP port: the gateway's requests, the scrapers' /metrics
                        runtime.add(("TCP", port))
                        metrics.add(("TCP", port))
                continue
            ports = model.role_ports(unit)[role.name]
            runtime |= {("TCP", ports.ingress), ("TCP", ports.lane)}
            metrics.add(("TCP", ports.metrics))
    peers: list[dict[str, Any]] = [
        {"podSelector": role_selector(pipeline.name)},
        {"podSelector": gateway_selector(pipeline.name)},
        *(dict(peer) for peer in settings.clients),
    ]
    scrapers: list[dict[str, Any]] = [dict(p) for p in settings.metrics_from] or [
        {"podSelector": {}}
    ]
    scrapers += [
        {
            "namespaceSelector": {"matchLabels": {names.LABEL_NAMESPACE_NAME: other}},
            "podSelector": {},
        }
        for other in options.metrics_namespaces
        if other != namespace or settings.metrics_from
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(
            network_policy_name(pipeline), namespace, model.common_labels(pipeline.name, "network")
        ),
        "spec": {
            "podSelector": role_selector(pipeline.name),
            "policyTypes": ["Ingress"],
            "ingress": [  # a rule without ports would admit every port: left out
                {"from": copy.deepcopy(sources), "ports": _policy_ports(ports)}
                for sources, ports in (
                    (peers, runtime),
                    (scrapers, metrics),
                    ([_unit_pods(pipeline.name, producers)], kv),  # from prefill pods only
                )
                if ports
            ],
        },
    }


def _unit_pods(pipeline: str, units: set[str]) -> dict[str, Any]:
    """A NetworkPolicy peer: the pods of the pipeline's `units`."""
    selector = role_selector(pipeline)
    selector["matchExpressions"] = [
        {"key": names.LABEL_ROLE, "operator": "In", "values": sorted(units)}
    ]
    return {"podSelector": selector}


def _policy_ports(ports: set[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"protocol": protocol, "port": port} for protocol, port in sorted(ports)]


def stateful_sets(
    pipeline: Pipeline,
    unit: model.Workload,
    namespace: str,
    options: model.PlanOptions,
    mode: model.GpuMode,
    peer_key_hash: str | None,
) -> list[dict[str, Any]]:
    """The unit's StatefulSet; for a role of groups, the leaders' (P-R) and one per worker
    node rank (P-R-wk), all of `unit.replicas` (groups) pods."""
    role = unit.roles[0]
    if not groups.grouped(role):
        return [stateful_set(pipeline, unit, namespace, options, mode, peer_key_hash)]
    config = model.role_config(pipeline, role.name, namespace=namespace, options=options)
    leader = groups.leader_host(pipeline, role.name, namespace, options.cluster_domain)
    return [
        stateful_set(
            pipeline,
            unit,
            namespace,
            options,
            mode,
            peer_key_hash,
            node_rank=k,
            config=groups.member_config(config, node_rank=k, leader=leader),
        )
        for k in range(role.nodes)
    ]


def stateful_set(
    pipeline: Pipeline,
    unit: model.Workload,
    namespace: str,
    options: model.PlanOptions,
    mode: model.GpuMode,
    peer_key_hash: str | None,
    *,
    node_rank: int | None = None,
    config: contract.RoleConfig | None = None,
) -> dict[str, Any]:
    """One StatefulSet of `unit`; `node_rank` and `config` for a member of a role's groups."""
    configs = {
        role.name: model.role_config(pipeline, role.name, namespace=namespace, options=options)
        for role in unit.roles
    }
    labels = unit.labels(pipeline)
    selector = unit.selector(pipeline)
    name = unit.name
    service = pipeline.derived_name(unit.roles[0].name)
    if node_rank is not None and config is not None:
        configs[unit.roles[0].name] = config
        labels = groups.member_labels(labels, node_rank)
        selector = groups.member_labels(selector, node_rank)
        name = groups.member_name(pipeline, unit.roles[0].name, node_rank)
        service = groups.ranks_service_name(pipeline, unit.roles[0].name)
    commands = {
        role.name: engines.command(pipeline, role.name, namespace=namespace, options=options)
        for role in unit.roles
        if engines.is_engine(role)
    }
    template = pods.pod_template(
        pipeline,
        unit.roles,
        configs,
        engine_commands=commands,
        labels=labels,
        spec_hash=model.spec_hash(pipeline, namespace, tuple(r.name for r in unit.roles)),
        config_map=topology_config_map_name(pipeline),
        peer_key_secret=peer_key_secret_name(pipeline.name),
        peer_key_hash=peer_key_hash,
        shared=unit.group is not None,
        gpu=mode if unit.group is not None else "none",
        claim_template=(
            claim_template_name(pipeline, unit.group.name) if unit.group is not None else None
        ),
    )
    if node_rank:
        template = groups.as_worker(template, unit.roles[0].name)
    spec: dict[str, Any] = {
        "serviceName": service,
        "replicas": unit.replicas,
        "podManagementPolicy": "Parallel",
        "updateStrategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"partition": options.partitions.get(unit.unit, 0)},
        },
        "selector": {"matchLabels": selector},
        "template": template,
    }
    if unit.unit in model.external_units(pipeline):
        del spec["replicas"]  # the HPA's (or KEDA's) field
    meta = _meta(name, namespace, labels)
    meta["annotations"] = {names.ANNOTATION_TEMPLATE_HASH: template_hash(template)}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta, "spec": spec}


def template_hash(template: Mapping[str, Any]) -> str:
    """A unit's pod template, hashed: the live StatefulSet's copy of it tells the rollout
    whether its pods still have to move to a new revision."""
    text = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def gateway_objects(
    pipeline: Pipeline,
    units: tuple[model.Workload, ...],
    namespace: str,
    options: model.PlanOptions,
) -> list[dict[str, Any]]:
    ports = {name: p for w in units for name, p in model.role_ports(w).items()}
    domain = options.cluster_domain
    # in front of engine roles the gateway routes from the topology's `engines`, no peers
    peers = contract.takes_replies(contract.Topology.from_pipeline(pipeline, namespace=namespace))
    entries = tuple(
        contract.Peer(
            role,
            (f"{pipeline.derived_name(role)}.{namespace}.svc.{domain}:{ports[role].ingress}",),
        )
        for role in (pipeline.entry_roles if peers else ())
    )
    policy = []
    if pipeline.network_policy.enabled:
        clients = [dict(peer) for peer in pipeline.network_policy.clients]
        policy = [
            gateway.network_policy(pipeline, namespace, role_selector(pipeline.name), clients)
        ]
    return [
        gateway.service(pipeline, namespace),
        *policy,
        gateway.deployment(
            pipeline,
            namespace,
            entries,
            config_map=topology_config_map_name(pipeline),
            spec_hash=model.gateway_hash(
                pipeline, namespace, engines.gateway_table(pipeline, namespace, options)
            ),
            peer_key_secret=peer_key_secret_name(pipeline.name),
        ),
    ]
