"""Lifecycle behaviours of a real API server and its controllers that the emulator keeps: a
new Node's not-ready taint, graceful pod deletion held until the kubelet confirms, a
Namespace Terminating until its pods are gone, and the autoscaling/v2 group (the HPA
sample applies)."""

from __future__ import annotations

from typing import Any

import kmock

from tests.k8s.fixtures import Kubectl
from tests.k8s.server import EmulatorThread
from tests.support import REPO

TAINT = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}


def node(ready: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}
    if ready is not None:
        doc["status"] = {"conditions": [{"type": "Ready", "status": ready}]}
    return doc


def test_a_new_node_is_tainted_not_ready_until_it_reports_ready(k8s: EmulatorThread) -> None:
    created = k8s.create(node(None))
    assert created["spec"]["taints"] == [TAINT]
    ready = k8s.patch_status("v1/nodes", "n1", node("True")["status"])
    assert "taints" not in ready.get("spec", {})
    again = k8s.patch_status("v1/nodes", "n1", node("False")["status"])
    assert again["spec"]["taints"] == [TAINT]


def pod(name: str, node_name: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "i"}]}
    if node_name:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_a_bound_pod_stays_terminating_until_its_kubelet_confirms(k8s: EmulatorThread) -> None:
    k8s.create(pod("bound", "n1"))
    k8s.create(pod("unbound", None))
    k8s.delete("v1/pods", "unbound", "default")
    assert k8s.get("v1/pods", "unbound", "default") is None  # never scheduled: at once
    k8s.delete("v1/pods", "bound", "default")
    held = k8s.get("v1/pods", "bound", "default")
    assert held is not None and held["metadata"]["deletionGracePeriodSeconds"] == 30
    assert held["metadata"]["deletionTimestamp"]
    k8s.call(
        k8s.emulator.op_delete,
        k8s.emulator.resolve("v1/pods"),
        "default",
        "bound",
        {"gracePeriodSeconds": 0},
    )  # the kubelet, once its containers stopped
    assert k8s.get("v1/pods", "bound", "default") is None


def test_a_namespace_terminates_until_its_pods_are_gone(k8s: EmulatorThread) -> None:
    k8s.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "t"}})
    k8s.create(pod("p", "n1"), "t")
    k8s.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}, "t")
    k8s.delete("v1/namespaces", "t")
    ns = k8s.get("v1/namespaces", "t")
    assert ns is not None and ns["status"]["phase"] == "Terminating"
    assert k8s.get("v1/configmaps", "c", "t") is None  # its contents are deleted
    refused = k8s.call(
        lambda: _refusal(k8s, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "d"}})
    )
    assert refused == 403
    k8s.call(
        k8s.emulator.op_delete, k8s.emulator.resolve("v1/pods"), "t", "p", {"gracePeriodSeconds": 0}
    )
    assert k8s.get("v1/namespaces", "t") is None


def _refusal(k8s: EmulatorThread, body: dict[str, Any]) -> int:
    try:
        k8s.emulator.create_object(body, "t")
    except kmock.KubernetesError as error:
        return int(error.status or 0)
    return 201


def test_the_hpa_sample_applies(kubectl: Kubectl, k8s: EmulatorThread) -> None:
    sample = REPO / "manifests" / "samples" / "external-scaling" / "hpa-denoiser.yaml"
    kubectl("apply", "-f", str(sample))
    (hpa,) = k8s.list("autoscaling/v2/horizontalpodautoscalers", "default")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    assert "horizontalpodautoscalers" in kubectl("api-resources", "--api-group=autoscaling").stdout
