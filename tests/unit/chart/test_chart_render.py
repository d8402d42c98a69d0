"""The Helm chart rendered by Helm itself (helm-python-sdk): with its defaults and with every
value changed, every object is valid Kubernetes (kubernetes-validate, strict, 1.30 and the
newest schemas it ships), the Deployment is hardened, its probes and Service reach the ports
the operator really listens on, and its arguments are ones `disagg operator` accepts."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import stat
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

from disagg_operator.app import main
from disagg_operator.gen import install
from disagg_operator.plan import pods
from disagg_runtime import cli
from tests.support import REPO
from tests.unit.chart import chart_support as c

NEWEST = kubernetes_validate.utils.latest_version()
VERSIONS = ("1.30", NEWEST)
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "ClusterKopfPeering", "KopfPeering"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[c.Obj]]:
    return {name: c.render(values) for name, values in c.VALUE_SETS.items()}


def test_defaults_render_the_operator(rendered: dict[str, list[c.Obj]]) -> None:
    objects = rendered["defaults"]
    kinds = sorted(o["kind"] for o in objects)
    expected = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service", "Deployment")
    assert kinds == sorted([*expected, "ClusterRole", "ClusterRoleBinding"])
    assert {o["metadata"].get("namespace", "ops") for o in objects} == {"ops"}
    deployment = c.only(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert c.container(objects)["image"] == "ghcr.io/disagg/operator:0.1.0"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("values", sorted(c.VALUE_SETS))
def test_every_object_is_valid_kubernetes(
    rendered: dict[str, list[c.Obj]], values: str, version: str
) -> None:
    for obj in rendered[values]:
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_crds_are_valid_kubernetes() -> None:
    for crd in [*install.crds(c.CHART), *c.peering_crds()]:
        for version in VERSIONS:
            kubernetes_validate.validate(crd, version, strict=True)


def test_peering_objects_match_kopfs_crds(rendered: dict[str, list[c.Obj]]) -> None:
    schemas = {
        crd["spec"]["names"]["kind"]: crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for crd in c.peering_crds()
    }
    groups = {crd["spec"]["names"]["kind"]: crd["spec"]["group"] for crd in c.peering_crds()}
    scopes = {crd["spec"]["names"]["kind"]: crd["spec"]["scope"] for crd in c.peering_crds()}
    seen = set()
    for objects in rendered.values():
        for obj in objects:
            if obj["kind"] in schemas:
                seen.add(obj["kind"])
                assert obj["apiVersion"] == f"{groups[obj['kind']]}/v1"
                assert ("namespace" in obj["metadata"]) == (scopes[obj["kind"]] == "Namespaced")
                jsonschema.validate(obj, schemas[obj["kind"]])
    assert seen == {"ClusterKopfPeering", "KopfPeering"}


def test_the_deployment_is_hardened(rendered: dict[str, list[c.Obj]]) -> None:
    for objects in rendered.values():
        pod = c.only(objects, "Deployment")["spec"]["template"]["spec"]
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": pods.NONROOT_ID,
            "runAsGroup": pods.NONROOT_ID,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        security = c.container(objects)["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["privileged"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["runAsNonRoot"] is True
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is True  # the operator needs its token
        mounts = {m["mountPath"] for m in c.container(objects)["volumeMounts"]}
        assert mounts == {"/tmp"}  # the only writable path


def _parse(args: list[str]) -> main.OperatorConfig:
    namespace = cli._build_parser().parse_args(["operator", *args])
    return main.config_from_args(namespace)


def test_the_arguments_are_the_operators(rendered: dict[str, list[c.Obj]]) -> None:
    config = _parse(c.container(rendered["defaults"])["args"])
    assert config.options.metrics_namespaces == ("ops",)  # the operator's own: it scrapes
    # otherwise the chart's defaults are the CLI's
    bare_options = dataclasses.replace(config.options, metrics_namespaces=())
    assert dataclasses.replace(config, options=bare_options) == main.OperatorConfig(standalone=True)

    config = _parse(c.container(rendered["full"])["args"])
    assert config.namespaces == ("ml", "research")
    assert (config.liveness_port, config.metrics_port) == (18080, 19090)
    assert config.liveness_stall == 120
    assert (config.peering, config.standalone) == ("disagg", False)
    assert config.options.cluster_domain == "k8s.example"
    assert config.options.gpu_mode == "device-plugin"
    assert config.options.dra_api_version == "resource.k8s.io/v1beta2"
    assert config.progress_deadline == 120
    assert config.options.metrics_namespaces == ("ops", "monitoring")

    assert _parse(c.container(rendered["globs"])["args"]).namespaces == ("team-*", "ml")
    assert _parse(c.container(rendered["bare"])["args"]).metrics_port == 0
    cluster_ha = _parse(c.container(rendered["cluster-ha"])["args"])
    assert (cluster_ha.clusterwide, cluster_ha.peering) == (True, "rel-disagg-operator")


def test_the_log_level_reaches_the_operator(rendered: dict[str, list[c.Obj]]) -> None:
    args = c.container(rendered["full"])["args"]
    assert cli._build_parser().parse_args(["operator", *args]).log_level == "debug"


def test_peering_gives_each_pod_its_own_priority(
    rendered: dict[str, list[c.Obj]], tmp_path: pathlib.Path
) -> None:
    """kopf pauses every peer that shares the highest priority: the command draws one per
    pod and passes the chart's arguments through untouched (no glob expansion)."""
    assert c.container(rendered["defaults"])["command"] == ["disagg", "operator"]
    box = c.container(rendered["globs"])
    assert box["command"][:2] == ["/bin/sh", "-c"]
    fake = tmp_path / "disagg"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "team-a").touch()  # a file a glob would match
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    priorities = set()
    for _ in range(3):
        result = subprocess.run(
            [*box["command"], *box["args"]],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            check=True,
            timeout=10,
        )
        lines = result.stdout.splitlines()
        assert lines[0] == "operator"
        assert lines[1:-1] == box["args"]
        assert lines[-1].startswith("--priority=")
        priorities.add(int(lines[-1].removeprefix("--priority=")))
        assert _parse([*box["args"], lines[-1]]).priority in priorities
    assert len(priorities) == 3


def test_probes_and_service_reach_the_operators_ports(rendered: dict[str, list[c.Obj]]) -> None:
    for name, objects in rendered.items():
        box = c.container(objects)
        live = c.port_of(box, "liveness")
        assert str(live) == c.flag(box["args"], "liveness-port"), name
        for probe in ("livenessProbe", "readinessProbe"):
            assert box[probe]["httpGet"] == {"path": "/healthz", "port": "liveness"}, name
        metrics = c.flag(box["args"], "metrics-port")
        services = c.of_kind(objects, "Service")
        if metrics == "0":
            assert services == [] and "metrics" not in {p["name"] for p in box["ports"]}
            continue
        assert str(c.port_of(box, "metrics")) == metrics, name
        (service,) = services
        assert service["spec"]["ports"] == [
            {"name": "metrics", "port": int(metrics), "targetPort": "metrics", "protocol": "TCP"}
        ]
        pod_labels = c.only(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()


def test_the_full_values_reach_the_objects(rendered: dict[str, list[c.Obj]]) -> None:
    objects = rendered["full"]
    deployment = c.only(objects, "Deployment")
    pod = deployment["spec"]["template"]
    box = c.container(objects)
    assert deployment["metadata"]["name"] == "dop"
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert box["image"] == "registry.example.com:5000/ml/disagg-operator@sha256:" + "ab" * 32
    assert box["imagePullPolicy"] == "Always"
    assert box["resources"] == c.FULL["resources"]
    assert box["livenessProbe"]["periodSeconds"] == 3
    assert box["readinessProbe"]["periodSeconds"] == 2
    assert pod["metadata"]["annotations"]["example.com/team"] == "ml"
    assert pod["metadata"]["labels"]["team"] == "ml"
    spec = pod["spec"]
    assert spec["serviceAccountName"] == "disagg-sa"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["priorityClassName"] == "system-cluster-critical"
    for key in ("nodeSelector", "tolerations", "affinity"):
        assert spec[key] == c.FULL[key]
    assert box["env"] == [
        {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]
    account = c.only(objects, "ServiceAccount")
    assert account["metadata"]["name"] == "disagg-sa"
    assert account["metadata"]["annotations"] == {"example.com/role": "ops"}
    budget = c.only(objects, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1 and "maxUnavailable" not in budget["spec"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    service = c.only(objects, "Service")
    assert service["spec"]["type"] == "NodePort"
    monitor = c.only(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ops"]}
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "5s"}
    ]
    assert "--pod-monitors" in box["args"]
    dashboard = next(
        o for o in c.of_kind(objects, "ConfigMap") if "dashboard" in o["metadata"]["name"]
    )
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "disagg"}
    shipped = (c.CHART / "files" / "dashboards" / "disagg.json").read_text()
    assert json.loads(dashboard["data"]["disagg.json"]) == json.loads(shipped)
    rule = c.only(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    shipped_rules = yaml.safe_load((c.CHART / "files" / "rules" / "disagg.rules.yaml").read_text())
    assert rule["spec"] == shipped_rules
    peerings = c.of_kind(objects, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["ml", "research"]
    assert {p["metadata"]["name"] for p in peerings} == {"disagg"}


def test_the_cluster_ha_values(rendered: dict[str, list[c.Obj]]) -> None:
    objects = rendered["cluster-ha"]
    assert c.only(objects, "ClusterKopfPeering")["metadata"]["name"] == "rel-disagg-operator"
    assert c.only(objects, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert c.only(objects, "Deployment")["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 1,
        "maxUnavailable": 0,
    }


def test_the_bare_values(rendered: dict[str, list[c.Obj]]) -> None:
    objects = rendered["bare"]
    assert sorted(o["kind"] for o in objects) == ["Deployment"]
    pod = c.only(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "existing"
    assert c.container(objects)["image"] == "ghcr.io/disagg/operator:0.1.0-rc.1"


def test_names_follow_the_release() -> None:
    named = {o["metadata"]["name"] for o in c.render(release="disagg-operator")}
    assert named == {"disagg-operator", "disagg-operator-cluster", "disagg-operator-metrics"}
    named = {o["metadata"]["name"] for o in c.render(release="prod")}
    assert named == {"prod-disagg-operator", "prod-disagg-operator-cluster"} | {
        "prod-disagg-operator-metrics"
    }


def test_notes_say_what_to_do_next() -> None:
    text = install.notes(c.CHART)
    assert "kubectl apply --server-side --force-conflicts -f crds/" in text
    assert "kubectl get dpipe -w" in text
    ha = install.notes(c.CHART, {"peering": {"enabled": True}, "watch": {"namespaces": ["team-*"]}})
    assert "kopf-peering-crds.yaml" in ha and "Create a KopfPeering" in ha


def test_chart_metadata_matches_the_project() -> None:
    chart = yaml.safe_load((c.CHART / "Chart.yaml").read_text())
    project = (REPO / "pyproject.toml").read_text()
    assert f'version = "{chart["appVersion"]}"' in project
    assert chart["kubeVersion"] == ">=1.30.0-0"
    schema = json.loads((c.CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((c.CHART / "values.yaml").read_text())
    assert set(defaults) <= set(schema["properties"])
