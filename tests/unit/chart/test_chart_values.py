"""The chart's values: strict `helm lint` passes with every value set, for Kubernetes 1.30
and the newest version kubernetes-validate ships, and values.schema.json (or, for what a
schema cannot say, the templates) reject bad values with a message that names the value."""

from __future__ import annotations

from typing import Any

import helm_python
import kubernetes_validate
import pytest

from tests.unit.chart import chart_support as c

KUBE_VERSIONS = ("v1.30.0", f"v{kubernetes_validate.utils.latest_version()}")
WARNING = 2  # helm lint severities: 1 info, 2 warning, 3 error
TEMPLATE_CHECKED = "must differ"

BAD: list[tuple[dict[str, Any], str]] = [
    ({"replicas": 0}, "at '/replicas': minimum: got 0, want 1"),
    ({"replicas": "two"}, "at '/replicas': got string, want integer"),
    ({"replicas": 2}, "at '/peering/enabled': value must be true"),
    ({"replicas": 2, "peering": {"enabled": False}}, "at '/peering/enabled': value must be true"),
    ({"image": {"repository": ""}}, "at '/image/repository'"),
    ({"image": {"tag": "latest tag"}}, "at '/image/tag': 'latest tag' does not match"),
    ({"image": {"digest": "sha256:abc"}}, "at '/image/digest'"),
    ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy': value must be one of"),
    ({"imagePullSecrets": ["regcred"]}, "at '/imagePullSecrets/0': got string, want object"),
    ({"watch": {"namespaces": "ml"}}, "at '/watch/namespaces': got string, want array"),
    ({"watch": {"namespaces": ["ML"]}}, "at '/watch/namespaces/0': 'ML' does not match"),
    ({"watch": {"namespaces": ["ml", "ml"]}}, "at '/watch/namespaces'"),
    ({"watch": {"namespace": ["ml"]}}, "additional properties 'namespace' not allowed"),
    ({"peering": {"enabled": "yes"}}, "at '/peering/enabled': got string, want boolean"),
    ({"peering": {"name": "Not_A_Name"}}, "at '/peering/name': 'Not_A_Name' does not match"),
    ({"logLevel": "trace"}, "at '/logLevel': value must be one of 'debug', 'info'"),
    ({"operator": {"gpuMode": "mig"}}, "at '/operator/gpuMode': value must be one of"),
    ({"operator": {"draApiVersion": "v1"}}, "at '/operator/draApiVersion': value must be one of"),
    ({"operator": {"progressDeadlineSeconds": 0}}, "at '/operator/progressDeadlineSeconds'"),
    ({"operator": {"autoscaleIntervalSeconds": -1}}, "at '/operator/autoscaleIntervalSeconds'"),
    ({"operator": {"clusterDomain": "Cluster Local"}}, "at '/operator/clusterDomain'"),
    ({"liveness": {"port": 80}}, "at '/liveness/port': minimum: got 80, want 1,024"),
    ({"metrics": {"port": 70000}}, "at '/metrics/port': maximum: got 70,000, want 65,535"),
    ({"metrics": {"enabled": "true"}}, "at '/metrics/enabled': got string, want boolean"),
    ({"metrics": {"service": {"type": "Ingress"}}}, "at '/metrics/service/type'"),
    (
        {"metrics": {"serviceMonitor": {"interval": "soon"}}},
        "at '/metrics/serviceMonitor/interval'",
    ),
    ({"resources": {"limits": {"memory": "lots"}}}, "at '/resources/limits/memory'"),
    ({"resources": {"limit": {}}}, "additional properties 'limit' not allowed"),
    ({"serviceAccount": {"create": "no"}}, "at '/serviceAccount/create': got string, want boolean"),
    ({"nodeSelector": {"zone": 1}}, "at '/nodeSelector/zone': got number, want string"),
    ({"tolerations": {"key": "a"}}, "at '/tolerations': got object, want array"),
    ({"affinity": []}, "at '/affinity': got array, want object"),
    ({"podLabels": {"team": True}}, "at '/podLabels/team': got boolean, want string"),
    (
        {"podDisruptionBudget": {"maxUnavailable": "150%"}},
        "at '/podDisruptionBudget/maxUnavailable'",
    ),
    ({"podDisruptionBudget": {"minAvailable": -1}}, "at '/podDisruptionBudget/minAvailable'"),
    ({"replica": 1}, "additional properties 'replica' not allowed"),
    # What the schema cannot express, the templates check:
    ({"metrics": {"port": 8080}}, "liveness.port and metrics.port must differ (both are 8080)"),
]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", sorted(c.VALUE_SETS))
def test_strict_lint_passes(values: str, kube_version: str) -> None:
    report = helm_python.lint(c.CHART, c.VALUE_SETS[values], strict=True, kube_version=kube_version)
    problems = [m for m in report["messages"] if m["severity"] >= WARNING]
    assert (problems, report["errors"]) == ([], [])


@pytest.mark.parametrize(("values", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_values_are_rejected_clearly(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmError) as caught:
        c.render(values)
    assert message in str(caught.value)
    if TEMPLATE_CHECKED not in message:  # lint only logs a template's `fail`
        assert helm_python.lint(c.CHART, values, strict=True)["errors"], "helm lint must fail"


def test_good_values_pass_the_schema() -> None:
    with helm_python.Chart.load(c.CHART) as chart:
        for values in c.VALUE_SETS.values():
            chart.validate_schema(chart.merge_values(values))
        chart.validate_schema(chart.values)
