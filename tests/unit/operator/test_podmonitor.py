"""The PodMonitor: when the planner makes one, what it selects, and that the discovery check
reads the API's answer (podmonitor.py, planner.plan, kube.Api.serves)."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest
import yaml

from disagg_core import spec
from disagg_core.spec.model import Pipeline
from disagg_operator import names
from disagg_operator.plan import model as plan_model
from disagg_operator.plan import planner, podmonitor, pods
from tests.support import EXAMPLES

NS = "ml"
ON = plan_model.PlanOptions(pod_monitors=True, pod_monitor_default=True)


def fan_out(monitoring: dict[str, Any] | None = None) -> Pipeline:
    doc = yaml.safe_load((pathlib.Path(EXAMPLES) / "fan-out.yaml").read_text())
    if monitoring is not None:
        doc = copy.deepcopy(doc)
        doc["spec"]["monitoring"] = monitoring
    return spec.parse_pipeline(doc)


def monitors(pipeline: Pipeline, options: plan_model.PlanOptions) -> list[dict[str, Any]]:
    return [
        o
        for o in planner.plan(pipeline, namespace=NS, options=options)
        if o["kind"] == "PodMonitor"
    ]


@pytest.mark.parametrize(
    ("served", "default", "asked", "made"),
    [
        (False, True, True, False),  # no CRDs: never
        (True, False, None, False),
        (True, True, None, True),
        (True, True, False, False),  # the pipeline says no
        (True, False, True, True),  # the pipeline asks
    ],
)
def test_made_where_served_and_wanted(
    served: bool, default: bool, asked: bool | None, made: bool
) -> None:
    options = plan_model.PlanOptions(pod_monitors=served, pod_monitor_default=default)
    monitoring = None if asked is None else {"podMonitor": asked}
    assert len(monitors(fan_out(monitoring), options)) == int(made)
    kinds = planner.child_kinds(options)
    assert ((podmonitor.API_VERSION, "PodMonitor") in kinds) == served  # pruned only if served


def test_selects_every_role_container_and_the_gateway() -> None:
    (monitor,) = monitors(fan_out(), ON)
    assert monitor["metadata"]["name"] == "fan-out-metrics"
    assert monitor["metadata"]["namespace"] == NS
    assert monitor["spec"]["selector"]["matchLabels"] == {
        names.LABEL_PIPELINE: "fan-out",
        names.LABEL_MANAGED_BY: names.MANAGER,
    }
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    # the colocation group's pod has two containers: every metrics port name they carry
    group = max(len(u.roles) for u in plan_model.workloads(fan_out()))
    role_ports = {pods.runtime_port_name("metrics", k) for k in range(group)}
    assert [e["port"] for e in endpoints] == [*sorted(role_ports), "http"]
    assert all(e["path"] == "/metrics" and e["honorLabels"] for e in endpoints)
    role, gateway = endpoints[0]["relabelings"], endpoints[-1]["relabelings"]
    assert role[0] == {
        "action": "keep",
        "regex": ".+",
        "sourceLabels": ["__meta_kubernetes_pod_label_disagg_dev_role"],
    }
    assert {
        "action": "replace",
        "targetLabel": "role",
        "sourceLabels": ["__meta_kubernetes_pod_container_name"],
    } in role
    assert gateway[0]["regex"] == names.COMPONENT_GATEWAY
    assert "&id" not in yaml.safe_dump(monitor)  # no shared objects (render prints them)
    for rules, component in ((role, "role"), (gateway, "gateway")):
        assert {
            "action": "replace",
            "targetLabel": podmonitor.COMPONENT_LABEL,
            "replacement": component,
        } in rules


def test_the_spec_field_is_a_boolean() -> None:
    assert fan_out({"podMonitor": True}).monitoring.pod_monitor is True
    assert fan_out().monitoring.pod_monitor is None
    with pytest.raises(spec.SpecError, match="podMonitor"):
        fan_out({"podMonitor": "yes"})
    with pytest.raises(spec.SpecError, match="monitoring"):
        fan_out({"scrape": True})


class _Discovery:
    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.paths: list[str] = []

    async def request(self, method: str, path: str, **_: Any) -> Any:
        from disagg_operator.k8s import client as kube

        self.paths.append(path)
        if self.answer is None:
            raise kube.ApiError(404, "NotFound", "the server could not find the requested resource")
        return self.answer


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("answer", "served"),
    [
        (None, False),
        ({"resources": [{"name": "servicemonitors"}]}, False),
        ({"resources": [{"name": "podmonitors"}, {"name": "podmonitors/status"}]}, True),
    ],
)
async def test_discovery_says_whether_podmonitors_are_served(answer: Any, served: bool) -> None:
    from disagg_operator.k8s import client as kube

    fake = _Discovery(answer)
    found = await kube.Api.serves(fake, podmonitor.API_VERSION, podmonitor.PLURAL)  # type: ignore[arg-type]
    assert found is served
    assert fake.paths == ["/apis/monitoring.coreos.com/v1"]


def test_scale_decisions_are_counted_by_direction() -> None:
    from disagg_operator.reconcile.metrics import Metrics

    m = Metrics()
    m.scaled("ml", "p", "decode", 1, 3, "occupancy")
    m.scaled("ml", "p", "decode", 3, 2, "queue")
    labels = {"pipeline_namespace": "ml", "pipeline": "p", "role": "decode"}
    up = m.value(
        "disagg_operator_scale_decisions_total",
        {**labels, "direction": "up", "signal": "occupancy"},
    )
    down = m.value(
        "disagg_operator_scale_decisions_total", {**labels, "direction": "down", "signal": "queue"}
    )
    assert (up, down) == (1.0, 1.0)
    assert m.value("disagg_operator_autoscaled_replicas", labels) == 2.0
