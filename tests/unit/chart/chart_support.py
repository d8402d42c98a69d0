"""Shared by tests/unit/chart: value sets that exercise every template, and small lookups in
rendered objects. Rendering is Helm's own (`disagg_operator.gen.install.render`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from disagg_operator.gen import generate, install
from tests.support import REPO

CHART = REPO / generate.CHART
Obj = dict[str, Any]

# Every value away from its default somewhere; together they render every template.
FULL: Obj = {
    "replicas": 3,
    "image": {
        "repository": "registry.example.com:5000/ml/disagg-operator",
        "digest": "sha256:" + "ab" * 32,
        "pullPolicy": "Always",
    },
    "imagePullSecrets": [{"name": "regcred"}],
    "fullnameOverride": "dop",
    "watch": {"namespaces": ["ml", "research"]},
    "peering": {"enabled": True, "name": "disagg"},
    "logLevel": "debug",
    "operator": {
        "clusterDomain": "k8s.example",
        "gpuMode": "device-plugin",
        "draApiVersion": "resource.k8s.io/v1beta2",
        "progressDeadlineSeconds": 120,
        "autoscaleIntervalSeconds": 5,
    },
    "liveness": {"port": 18080, "stallSeconds": 120},
    "probes": {
        "liveness": {"initialDelaySeconds": 1, "periodSeconds": 3, "failureThreshold": 2},
        "readiness": {"periodSeconds": 2, "successThreshold": 1},
    },
    "metrics": {
        "port": 19090,
        "service": {"type": "NodePort", "annotations": {"example.com/scrape": "true"}},
        "serviceMonitor": {
            "enabled": True,
            "interval": "15s",
            "scrapeTimeout": "5s",
            "labels": {"release": "prometheus"},
        },
    },
    "monitoring": {
        "podMonitors": True,
        "dashboard": {
            "enabled": True,
            "labels": {"team": "ml"},
            "annotations": {"grafana_folder": "disagg"},
        },
        "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "resources": {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"cpu": 1, "memory": "1Gi"},
    },
    "serviceAccount": {"name": "disagg-sa", "annotations": {"example.com/role": "ops"}},
    "podAnnotations": {"example.com/team": "ml"},
    "podLabels": {"team": "ml"},
    "priorityClassName": "system-cluster-critical",
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}
    ],
    "affinity": {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "rel"}},
                    },
                }
            ]
        }
    },
    "podDisruptionBudget": {"enabled": True, "minAvailable": 1},
    "rbac": {"namespaced": True},
    "networkPolicy": {"metricsNamespaces": ["monitoring"]},
}
GLOBS: Obj = {"watch": {"namespaces": ["team-*", "ml"]}, "peering": {"enabled": True}}
CLUSTER_HA: Obj = {
    "replicas": 2,
    "peering": {"enabled": True},
    "podDisruptionBudget": {"enabled": True},
}
BARE: Obj = {
    "metrics": {"enabled": False},
    "rbac": {"create": False},
    "serviceAccount": {"create": False, "name": "existing"},
    "image": {"tag": "0.1.0-rc.1"},
}
VALUE_SETS: dict[str, Obj] = {
    "defaults": {},
    "full": FULL,
    "globs": GLOBS,
    "cluster-ha": CLUSTER_HA,
    "bare": BARE,
}


def render(values: Mapping[str, Any] | None = None, release: str = "rel") -> list[Obj]:
    return install.render(CHART, values, release=release, namespace="ops")


def only(objects: Iterable[Obj], kind: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def of_kind(objects: Iterable[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def container(objects: Iterable[Obj]) -> Obj:
    containers = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def port_of(container: Mapping[str, Any], name: str) -> int:
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == name))


def flag(args: Iterable[str], name: str) -> str | None:
    """The value of `--name=VALUE` in args (the last one), None when absent."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return values[-1] if values else None


def peering_crds() -> list[Obj]:
    path = CHART / "files" / "kopf-peering-crds.yaml"
    return [d for d in yaml.safe_load_all(path.read_text()) if d]
