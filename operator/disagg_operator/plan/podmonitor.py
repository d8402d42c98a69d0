"""The PodMonitor of a pipeline (monitoring.coreos.com/v1, the Prometheus Operator): pure.

    PodMonitor  P-metrics  selects the pipeline's pods {disagg.dev/pipeline: P,
                           app.kubernetes.io/managed-by: disagg-operator} in its namespace

One podMetricsEndpoint per metrics port name a role container may carry
(`pods.runtime_port_name("metrics", k)` for the container at index k of a pod: `metrics`,
`metrics-1`, ...; every unit's containers),
keeping only role pods (label disagg.dev/role present), and one for the gateway's `http`
port, keeping only gateway pods. Each sets the target labels the rules and the dashboard
read from ``up``: disagg_component = role | gateway, pipeline, and for roles role = the
container's name (a role's name, also inside a colocation group). ``honorLabels``: the
series' own pipeline/role/replica labels win over the target's.

Made when the cluster serves PodMonitors (`PlanOptions.pod_monitors`, detected by the
reconciler) and the pipeline wants one: `spec.monitoring.podMonitor`, else
`PlanOptions.pod_monitor_default` (the chart's monitoring.podMonitors).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final

from disagg_core.spec import Pipeline
from disagg_operator import names
from disagg_operator.plan import pods

API_VERSION: Final = "monitoring.coreos.com/v1"
KIND: Final = "PodMonitor"
PLURAL: Final = "podmonitors"
GATEWAY_PORT: Final = "http"  # gateway.py's container port (the gateway serves /metrics there)
COMPONENT_LABEL: Final = "disagg_component"  # the target label the rules select `up` by


def wanted(pipeline: Pipeline, default: bool) -> bool:
    chosen = pipeline.monitoring.pod_monitor
    return default if chosen is None else chosen


def name(pipeline: Pipeline) -> str:
    return pipeline.derived_name("metrics")


def _meta_label(label: str) -> str:
    """Kubernetes service discovery's name of a pod label: __meta_kubernetes_pod_label_*."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _keep(label: str, regex: str) -> dict[str, Any]:
    return {"action": "keep", "sourceLabels": [_meta_label(label)], "regex": regex}


def _set(target: str, *, source: str | None = None, value: str | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"action": "replace", "targetLabel": target}
    if source is not None:
        rule["sourceLabels"] = [source]
    else:
        rule["replacement"] = value
    return rule


def _endpoint(port: str, relabelings: list[dict[str, Any]]) -> dict[str, Any]:
    return {"port": port, "path": "/metrics", "honorLabels": True, "relabelings": relabelings}


def endpoints(containers_per_pod: Iterable[int]) -> list[dict[str, Any]]:
    """The endpoints for pods of at most max(containers_per_pod) role containers."""

    def pipeline_label() -> dict[str, Any]:  # a fresh dict each time: no shared objects
        return _set("pipeline", source=_meta_label(names.LABEL_PIPELINE))

    ports = dict.fromkeys(
        pods.runtime_port_name("metrics", k) for n in containers_per_pod for k in range(n)
    )
    roles = [
        _endpoint(
            port,
            [
                _keep(names.LABEL_ROLE, ".+"),
                _set(COMPONENT_LABEL, value="role"),
                pipeline_label(),
                _set("role", source="__meta_kubernetes_pod_container_name"),
            ],
        )
        for port in ports
    ]
    gateway = _endpoint(
        GATEWAY_PORT,
        [
            _keep(names.LABEL_COMPONENT, names.COMPONENT_GATEWAY),
            _set(COMPONENT_LABEL, value="gateway"),
            pipeline_label(),
        ],
    )
    return [*roles, gateway]


def pod_monitor(
    pipeline: Pipeline, namespace: str, containers_per_pod: Iterable[int], labels: dict[str, str]
) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name(pipeline), "namespace": namespace, "labels": labels},
        "spec": {
            "selector": {
                "matchLabels": {
                    names.LABEL_PIPELINE: pipeline.name,
                    names.LABEL_MANAGED_BY: names.MANAGER,
                }
            },
            "podMetricsEndpoints": endpoints(containers_per_pod),
        },
    }
