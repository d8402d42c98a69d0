"""The Helm chart against what the operator really does.

RBAC: what the chart's roles grant its ServiceAccount, evaluated the way the API server's
RBAC authorizer would (ClusterRoleBindings grant everywhere, RoleBindings in their
namespace; cluster-scoped resources only through ClusterRoleBindings), equals the API calls
recorded in operator_rbac_observed.json (tests/integration/test_operator_rbac.py, cluster-wide
with peering) plus the documented additions below, and nothing else. No wildcards.

Install: the chart rendered by Helm is applied with the real kubectl to the Kubernetes API
emulator; then the operator runs as the chart's Deployment would run it (its command,
arguments and environment, read back from the emulator) and reconciles a sample pipeline to
Ready. Its liveness and readiness probes and its metrics Service reach it on the ports the
chart declares, and every API call it made is one the chart's RBAC allows its ServiceAccount.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import helm_python
import pytest
import yaml

from disagg_operator.gen import generate, install
from tests.integration import operator_support as s
from tests.k8s.fixtures import Kubectl
from tests.k8s.server import EmulatorThread
from tests.support import REPO, free_port

Rule = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)
Obj = dict[str, Any]
CHART = REPO / generate.CHART
NAMESPACE = "disagg-system"
RELEASE = "disagg-operator"
PEERINGS = frozenset({
    ("kopf.dev", "clusterkopfpeerings", "list"),
    ("kopf.dev", "clusterkopfpeerings", "watch"),
    ("kopf.dev", "clusterkopfpeerings/status", "patch"),
})  # fmt: skip
# Granted beyond what the recorded scenario calls; charts/disagg-operator/README.md says why.
ADDITIONS: dict[Rule, str] = {
    ("", "configmaps", "delete"): "pruning a child the plan dropped applies to every kind",
    ("apps", "deployments", "delete"): "pruning the gateway when spec.gateway.enabled is false",
    # PodMonitors (operator/disagg_operator/plan/podmonitor.py): the emulator serves no
    # monitoring.coreos.com, so the recorded run makes none; a real API server's apply of an
    # absent object needs create besides patch
    **{
        ("monitoring.coreos.com", "podmonitors", verb): "a pipeline's PodMonitor"
        for verb in ("get", "list", "create", "patch", "delete")
    },
}
PEERING_ADDITIONS: dict[Rule, str] = {
    ("kopf.dev", "clusterkopfpeerings", "patch"): (
        "kopf's own peering CRD has no status subresource, so kopf patches the object itself "
        "(the recorded run used a CRD with one)"
    ),
}
CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "clusterkopfpeerings"}
NAMESPACE_WATCH = {("", "namespaces", "list"), ("", "namespaces", "watch")}


def observed() -> set[Rule]:
    return s.recorded_rbac()


def namespaced_peering(rules: Iterable[Rule]) -> set[Rule]:
    """The cluster-wide peering rules as a namespaced operator needs them (kopfpeerings)."""
    return {(g, r.replace("clusterkopfpeerings", "kopfpeerings"), v) for g, r, v in rules}


def cluster_scoped(rule: Rule) -> bool:
    return rule[1].split("/")[0] in CLUSTER_SCOPED


# ---------------------------------------------------------------------------- RBAC model


def expand(rules: Iterable[Mapping[str, Any]]) -> set[Rule]:
    """RBAC PolicyRules as (group, resource, verb) triples; wildcards are refused."""
    found: set[Rule] = set()
    for rule in rules:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no names, no URLs
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), rule
                    found.add((group, resource, verb))
    return found


@dataclass
class Grants:
    """What RBAC allows one ServiceAccount: everywhere, and per namespace."""

    everywhere: set[Rule] = field(default_factory=set)
    namespaces: dict[str, set[Rule]] = field(default_factory=dict)

    def allows(self, rule: Rule, namespace: str | None) -> bool:
        if rule in self.everywhere:
            return True
        if namespace is None or cluster_scoped(rule):
            return False
        return rule in self.namespaces.get(namespace, set())


def grants(objects: Iterable[Mapping[str, Any]], account: str, namespace: str) -> Grants:
    objects = list(objects)
    roles: dict[tuple[str, str, str], set[Rule]] = {}
    for obj in objects:
        if obj["kind"] in ("ClusterRole", "Role"):
            meta = obj["metadata"]
            key = (obj["kind"], meta.get("namespace", ""), meta["name"])
            roles[key] = expand(obj.get("rules") or ())
    result = Grants()
    for obj in objects:
        if obj["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        subjects = obj.get("subjects") or ()
        me = {"kind": "ServiceAccount", "name": account, "namespace": namespace}
        if not any({k: sub.get(k) for k in me} == me for sub in subjects):
            continue
        ref = obj["roleRef"]
        where = obj["metadata"].get("namespace", "")
        key = (ref["kind"], "" if ref["kind"] == "ClusterRole" else where, ref["name"])
        assert key in roles, f"{obj['kind']} {obj['metadata']['name']} refers to a missing role"
        if obj["kind"] == "ClusterRoleBinding":
            result.everywhere |= roles[key]
        else:
            result.namespaces.setdefault(where, set()).update(roles[key])
    return result


def chart_grants(values: Mapping[str, Any]) -> Grants:
    objects = install.render(CHART, values, release=RELEASE, namespace=NAMESPACE)
    account = next(o for o in objects if o["kind"] == "ServiceAccount")["metadata"]["name"]
    return grants(objects, account, NAMESPACE)


# ---------------------------------------------------------------------------- RBAC tests


def test_cluster_wide_peering_grants_exactly_what_the_operator_calls():
    """The recorded scenario's configuration: every call allowed, nothing more than the
    documented additions."""
    granted = chart_grants({"peering": {"enabled": True}})
    assert granted.namespaces == {}
    missing = observed() - granted.everywhere
    extra = granted.everywhere - observed() - set(ADDITIONS) - set(PEERING_ADDITIONS)
    assert (missing, extra) == (set(), set())


def test_the_default_install_grants_the_calls_without_peering():
    granted = chart_grants({})
    assert granted.namespaces == {}
    assert granted.everywhere == (observed() - PEERINGS) | set(ADDITIONS)


def test_a_namespaced_install_grants_in_its_namespaces_only():
    granted = chart_grants(
        {"watch": {"namespaces": ["ml", "research"]}, "peering": {"enabled": True}}
    )
    wanted = namespaced_peering(observed() | set(ADDITIONS) | set(PEERING_ADDITIONS))
    assert granted.everywhere == {r for r in wanted if cluster_scoped(r)} | NAMESPACE_WATCH
    workload = {r for r in wanted if not cluster_scoped(r)}
    assert granted.namespaces == {"ml": workload, "research": workload}
    assert granted.allows(("apps", "statefulsets", "patch"), "ml")
    assert not granted.allows(("apps", "statefulsets", "patch"), "default")
    assert not granted.allows(("apps", "statefulsets", "watch"), None)


def test_namespaced_rbac_grants_roles_in_the_watched_namespaces_only():
    values = {"watch": {"namespaces": ["ml", "research"]}, "rbac": {"namespaced": True}}
    objects = install.render(CHART, values, release=RELEASE, namespace=NAMESPACE)
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "ClusterRole"} == {
        f"{RELEASE}-cluster"
    }  # only the read-only cluster rules
    assert sorted(
        (o["kind"], o["metadata"]["namespace"])
        for o in objects
        if o["kind"] in ("Role", "RoleBinding")
    ) == [("Role", "ml"), ("Role", "research"), ("RoleBinding", "ml"), ("RoleBinding", "research")]
    granted = chart_grants(values)
    wanted = (observed() - PEERINGS) | set(ADDITIONS)
    assert granted.everywhere == {r for r in wanted if cluster_scoped(r)} | NAMESPACE_WATCH
    assert all(verb in ("list", "watch") for _, _, verb in granted.everywhere)
    workload = {r for r in wanted if not cluster_scoped(r)}
    assert granted.namespaces == {"ml": workload, "research": workload}
    assert not granted.allows(("", "secrets", "create"), "default")


@pytest.mark.parametrize("namespaces", [[], ["team-*"]], ids=["cluster", "glob"])
def test_namespaced_rbac_needs_namespace_names(namespaces: list[str]):
    with pytest.raises(helm_python.HelmError, match=r"rbac\.namespaced needs watch\.namespaces"):
        install.render(CHART, {"watch": {"namespaces": namespaces}, "rbac": {"namespaced": True}})


def test_globs_bind_the_workload_rules_cluster_wide():
    granted = chart_grants({"watch": {"namespaces": ["team-*"]}})
    wanted = (observed() - PEERINGS) | set(ADDITIONS) | NAMESPACE_WATCH
    assert granted.everywhere == wanted
    assert granted.namespaces == {}


def test_rbac_can_be_left_to_the_cluster_admin():
    objects = install.render(CHART, {"rbac": {"create": False}})
    assert not [o for o in objects if o["apiVersion"].startswith("rbac.")]


def test_the_additions_are_not_observed_calls():
    """Once the recorded scenario makes a call, it is no longer an addition: move it."""
    assert set(ADDITIONS) & observed() == set()
    assert set(PEERING_ADDITIONS) & observed() == set()


def test_the_chart_readme_explains_the_additions():
    readme = (CHART / "README.md").read_text()
    for group, resource, verb in {**ADDITIONS, **PEERING_ADDITIONS}:
        assert f"`{group or 'core'}` `{resource}`: {verb}" in readme, resource


# ---------------------------------------------------------------------------- the install


def fetch(url: str) -> tuple[int, str] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status), str(response.read().decode())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def environment(container: Mapping[str, Any], pod: str) -> dict[str, str]:
    """The container's env as the kubelet would set it (downward API: the pod's name)."""
    env: dict[str, str] = {}
    for var in container.get("env") or ():
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, var
            env[var["name"]] = pod
    return env


def port(container: Mapping[str, Any], name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == name_or_number))


SCENARIOS = {
    "defaults": {},
    "namespaced-ha": {"watch": {"namespaces": ["default"]}, "peering": {"enabled": True}},
    "namespaced-roles": {"watch": {"namespaces": ["default"]}, "rbac": {"namespaced": True}},
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_chart_installs_and_runs_the_operator(
    k8s: EmulatorThread, kubectl: Kubectl, kubeconfig: pathlib.Path, tmp_path, scenario: str
):
    values = {
        **SCENARIOS[scenario],
        "liveness": {"port": free_port()},
        "metrics": {"port": free_port()},
    }
    peering = bool(values.get("peering"))
    namespace_doc = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    crds = install.crds(CHART) + (kopf_peering_crds() if peering else [])
    kubectl.apply([namespace_doc, *crds])
    kubectl.apply(install.render(CHART, values, release=RELEASE, namespace=NAMESPACE))
    kubectl("apply", "-f", str(s.EXAMPLE))  # text-to-video, in default

    deployment = kubectl.json("get", "deployment", RELEASE, "-n", NAMESPACE)
    pod_spec = deployment["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    stored = kubectl.json("get", "clusterroles,clusterrolebindings,roles,rolebindings", "-A")[
        "items"
    ]
    allowed = grants(stored, pod_spec["serviceAccountName"], NAMESPACE)
    kubectl("get", "serviceaccount", pod_spec["serviceAccountName"], "-n", NAMESPACE)

    pod = f"{RELEASE}-7d9c5b8f4-x2x7q"
    bin_dir = pathlib.Path(sys.executable).parent  # `disagg` and the tools the command uses
    env = {**os.environ, **environment(container, pod), "KUBECONFIG": str(kubeconfig)}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    env.pop("KUBERNETES_SERVICE_HOST", None)
    k8s.clear_calls()
    log_path = tmp_path / "operator.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [*container["command"], *container["args"]],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
        try:
            calls = run_to_ready(k8s, kubectl, process, container, log_path)
            if peering:
                peers = k8s.get("kopf.dev/v1/kopfpeerings", RELEASE, "default") or {}
                assert pod in (peers.get("status") or {}), peers  # POD_ID is its identity
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    output = log_path.read_text()
    assert "Traceback" not in output, output
    assert calls, "the operator made no API calls"
    denied = sorted(
        {(c.rbac, c.namespace) for c in calls if not allowed.allows(c.rbac, c.namespace)}
    )
    assert denied == [], f"calls the chart's RBAC does not allow: {denied}"


def run_to_ready(
    k8s: EmulatorThread,
    kubectl: Kubectl,
    process: subprocess.Popen[bytes],
    container: Mapping[str, Any],
    log_path: pathlib.Path,
) -> list[Any]:
    """Probe, reconcile to Ready, scrape; returns the API calls the operator made."""
    probes = [container["livenessProbe"]["httpGet"], container["readinessProbe"]["httpGet"]]
    urls = [f"http://127.0.0.1:{port(container, p['port'])}{p['path']}" for p in probes]
    k8s.wait_for(
        lambda: all(fetch(u) for u in urls) or process.poll() is not None, 30, 0.1, "probes"
    )
    assert process.poll() is None, log_path.read_text()
    assert [(fetch(u) or (0, ""))[0] for u in urls] == [200, 200]
    name = s.example()["metadata"]["name"]
    k8s.wait_for(lambda: len(s.children(k8s, name)) == 9, s.WAIT, message="children")
    s.mark_ready(k8s, name)
    k8s.wait_for(
        lambda: s.pipeline_status(k8s, name).get("phase") == "Ready", s.WAIT, message="Ready"
    )
    calls = [c for c in k8s.calls if c.resource is not None]
    kubectl("wait", f"dpipe/{name}", "--for=condition=Ready", "--timeout=10s")

    service = kubectl.json("get", "service", f"{RELEASE}-metrics", "-n", NAMESPACE)
    (service_port,) = service["spec"]["ports"]
    scraped = fetch(f"http://127.0.0.1:{port(container, service_port['targetPort'])}/metrics")
    assert scraped is not None and "disagg_operator_pipelines_managed 1.0" in scraped[1]
    return calls


def kopf_peering_crds() -> list[Obj]:
    text = (CHART / "files" / "kopf-peering-crds.yaml").read_text()
    return [d for d in yaml.safe_load_all(text) if d]
