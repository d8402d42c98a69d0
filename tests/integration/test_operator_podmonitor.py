"""The operator's PodMonitors against the API emulator: none where the cluster does not serve
them (discovery says so; nothing is listed or applied), one for a pipeline that asks where it
does (a minimal PodMonitor CRD stands in for the Prometheus Operator's), pruned when the
pipeline stops asking."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from disagg_operator.plan import podmonitor, pods
from tests.integration import operator_support as s
from tests.k8s.server import EmulatorThread

pytestmark = pytest.mark.asyncio
NS = s.NS
MONITORS = f"{podmonitor.API_VERSION}/{podmonitor.PLURAL}"
CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{podmonitor.PLURAL}.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "plural": podmonitor.PLURAL,
            "singular": "podmonitor",
            "kind": podmonitor.KIND,
            "listKind": "PodMonitorList",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def asking(name: str, wanted: bool) -> dict[str, Any]:
    doc = s.pipeline_doc(name, [{"name": "a"}, {"name": "b"}], edges=[{"from": "a", "to": "b"}])
    doc["spec"]["monitoring"] = {"podMonitor": wanted}
    return doc


@pytest.fixture
def k8s_crd(k8s: EmulatorThread, disagg_crd: Any) -> Iterator[EmulatorThread]:
    k8s.apply_file(disagg_crd)
    yield k8s


async def test_no_podmonitor_where_the_cluster_serves_none(k8s_crd: EmulatorThread) -> None:
    k8s = k8s_crd
    async with s.running_operator(k8s) as operator:
        await s.call(k8s.create, asking("plain", True), NS)
        await s.until(k8s, lambda: s.pipeline_status(k8s, "plain").get("phase"), "a status")
        assert operator.reconciler.options.pod_monitors is False
    calls = s.observed_rbac(k8s)
    assert not {c for c in calls if "podmonitors" in c[1]}, calls


async def test_a_pipeline_that_asks_gets_one_and_loses_it_when_it_stops(
    k8s_crd: EmulatorThread,
) -> None:
    k8s = k8s_crd
    await s.call(k8s.apply, CRD)
    async with s.running_operator(k8s):
        await s.call(k8s.create, asking("watched", True), NS)
        found = await s.until(
            k8s, lambda: k8s.get(MONITORS, "watched-metrics", NS), "the PodMonitor"
        )
        assert found is not None
        monitor: dict[str, Any] = found
        assert monitor["spec"]["selector"]["matchLabels"]["disagg.dev/pipeline"] == "watched"
        ports = [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]]
        assert ports == [pods.runtime_port_name("metrics", 0), podmonitor.GATEWAY_PORT]
        owners = monitor["metadata"]["ownerReferences"]
        assert [o["kind"] for o in owners] == ["DisaggregatedPipeline"]
        patch = [{"op": "replace", "path": "/spec/monitoring/podMonitor", "value": False}]
        await s.call(k8s.patch, s.PIPELINES, "watched", patch, NS, patch_type="json")
        await s.until(
            k8s, lambda: k8s.get(MONITORS, "watched-metrics", NS) is None, "the PodMonitor pruned"
        )
    calls = {c for c in s.observed_rbac(k8s) if "podmonitors" in c[1]}
    assert {verb for _, _, verb in calls} <= {"get", "list", "create", "patch", "delete"}
