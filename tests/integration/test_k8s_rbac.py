"""The emulator with TLS and RBAC (opt-in): kubectl over HTTPS with the test CA, 401 without
a token it knows, and the Helm chart's RBAC enforced for the operator's ServiceAccount: what
the chart grants is answered, anything else is 403 Forbidden."""

from __future__ import annotations

import json
import pathlib
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from disagg_operator.gen import generate, install
from tests.k8s.fixtures import Kubectl
from tests.k8s.rbac import Authenticator
from tests.k8s.server import EmulatorThread, kubeconfig_for
from tests.k8s.tls import ServerTls
from tests.support import REPO

CHART = REPO / generate.CHART
NS = "disagg-system"
ACCOUNT = "disagg-operator"  # the chart's ServiceAccount for release disagg-operator


@pytest.fixture
def secure() -> Iterator[EmulatorThread]:
    k8s = EmulatorThread(tls=ServerTls(), auth=Authenticator()).start()
    yield k8s
    k8s.stop()


def kubectl_for(tmp_path: pathlib.Path, name: str, config: dict[str, Any]) -> Kubectl:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    (tmp_path / f"cache-{name}").mkdir()
    return Kubectl(
        str(pathlib.Path(sys.executable).parent / "kubectl"), path, tmp_path / f"cache-{name}"
    )


def test_https_with_the_test_ca_and_an_admin_token(secure: EmulatorThread, tmp_path):
    assert secure.url.startswith("https://127.0.0.1:")
    admin = kubectl_for(tmp_path, "admin", secure.kubeconfig())
    assert admin("get", "namespaces", "-o", "name").stdout.split() == [
        "namespace/default",
        "namespace/kube-node-lease",
        "namespace/kube-public",
        "namespace/kube-system",
    ]
    assert secure.calls[-1].user == "admin"
    # no token, or one the emulator never issued: 401 (kubectl would prompt for a password)
    assert secure.tls is not None
    for headers in ({}, {"Authorization": "Bearer made-up"}):
        request = urllib.request.Request(f"{secure.url}/api/v1/pods", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, context=secure.tls.client_context(), timeout=10)
        assert caught.value.code == 401
    untrusted = kubectl_for(
        tmp_path,
        "untrusted",
        kubeconfig_for(secure.url, ca_pem=ServerTls().ca_pem, token=secure.token),
    )
    failed = untrusted("get", "pods", check=False)
    assert failed.returncode != 0 and "certificate" in failed.stderr, failed.stderr


def test_the_chart_rbac_is_enforced_for_the_operator_service_account(
    secure: EmulatorThread, tmp_path
):
    admin = kubectl_for(tmp_path, "admin", secure.kubeconfig())
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    admin.apply([namespace, *install.render(CHART, {}, release="disagg-operator", namespace=NS)])
    assert secure.tls is not None and secure.emulator.auth is not None
    token = secure.emulator.auth.service_account_token(NS, ACCOUNT)
    operator = kubectl_for(
        tmp_path, "operator", kubeconfig_for(secure.url, ca_pem=secure.tls.ca_pem, token=token)
    )
    # granted by the chart (cluster-wide: watch.namespaces is empty)
    assert operator("get", "statefulsets", "-A").returncode == 0
    assert operator("get", "configmaps", "-n", "default").returncode == 0
    assert operator("get", "crd").returncode == 0
    # not granted: the chart reads no Nodes, never deletes Namespaces, writes no RBAC
    for args in (
        ("get", "nodes"),
        ("delete", "namespace", "default", "--wait=false"),
        ("get", "clusterroles"),
    ):
        refused = operator(*args, check=False)
        assert refused.returncode != 0 and "Forbidden" in refused.stderr, (args, refused.stderr)
        assert f'User "system:serviceaccount:{NS}:{ACCOUNT}"' in refused.stderr
    codes = {(c.verb, c.resource, c.code) for c in secure.calls if c.user and ACCOUNT in c.user}
    assert ("list", "nodes", 403) in codes and ("list", "statefulsets", 200) in codes
    assert secure.get("v1/namespaces", "default") is not None  # the delete did nothing


IN_CLUSTER = """
import json, os, kubernetes
from kubernetes.client.rest import ApiException
out = {"host": os.environ.get("KUBERNETES_SERVICE_HOST"), "uid": os.getuid()}
base = "/var/run/secrets/kubernetes.io/serviceaccount"
keys = os.listdir(base) if os.path.isdir(base) else []  # and the kubelet's ..data
out["files"] = sorted(k for k in keys if not k.startswith(".."))
if out["files"]:
    kubernetes.config.load_incluster_config()
    core = kubernetes.client.CoreV1Api()
    out["configmaps"] = len(core.list_namespaced_config_map("default").items)
    try:
        core.list_node()
        out["nodes"] = 200
    except ApiException as e:
        out["nodes"] = e.status
print("RESULT " + json.dumps(out), flush=True)
"""


def test_pods_get_in_cluster_access_and_their_account_rbac(secure: EmulatorThread, tmp_path):
    """The test node with in-cluster access: a pod finds the API through the `kubernetes`
    Service's env and its mounted token and CA, as the operator's pod does; RBAC applies
    to its ServiceAccount. A pod that opts out, or whose ServiceAccount opts out, gets no
    token."""
    from tests.k8s.node import Node, can_create_namespaces
    from tests.k8s.node.apiserver import InCluster

    reason = can_create_namespaces()
    if reason is not None:
        pytest.skip(reason)
    assert secure.tls is not None and secure.emulator.auth is not None
    auth = secure.emulator.auth
    node = Node(
        secure.url,
        backoff=0.5,
        ca_pem=secure.tls.ca_pem,
        token=secure.token,
        in_cluster=InCluster(secure.tls.ca_pem, auth.service_account_token),
    ).start()
    try:
        secure.tls.issue(node.bridge.gateway)
        admin = kubectl_for(tmp_path, "admin", secure.kubeconfig())
        admin.apply([
            *install.render(CHART, {}, release="disagg-operator", namespace="default"),
            *(pod(n, automount) for n, automount in NAMES.items()),
        ])  # fmt: skip
        results = {n: result(secure, node, n) for n in NAMES}
    finally:
        node.stop()
    assert node.leftovers() == [] and node.errors == []
    assert results["reader"] == {
        "host": node.bridge.gateway,
        "uid": 65532,
        "files": ["ca.crt", "namespace", "token"],
        "configmaps": 0,
        "nodes": 403,
    }
    for name in ("opted-out", "inherits"):  # the chart's ServiceAccount does not automount
        assert results[name]["files"] == [] and results[name]["host"], results


NAMES = {"reader": True, "opted-out": False, "inherits": None}  # automountServiceAccountToken


def pod(name: str, automount: bool | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "serviceAccountName": ACCOUNT,
        "restartPolicy": "Never",
        "securityContext": {"runAsUser": 65532, "runAsGroup": 65532},
        "containers": [{"name": "c", "image": "local", "command": ["python", "-c", IN_CLUSTER]}],
    }
    if automount is not None:
        spec["automountServiceAccountToken"] = automount
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def result(k8s: EmulatorThread, node: Any, name: str) -> dict[str, Any]:
    def done() -> bool:
        phase = ((k8s.get("v1/pods", name, "default") or {}).get("status") or {}).get("phase")
        return phase in ("Succeeded", "Failed")

    k8s.wait_for(done, 60, 0.2, f"pod {name} done")
    logs = node.logs("default", name)
    line = next((x for x in logs.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, logs[-3000:]
    return dict(json.loads(line[len("RESULT ") :]))
