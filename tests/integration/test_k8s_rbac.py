"""The emulator with TLS and RBAC (opt-in): kubectl over HTTPS with the test CA, 401 without
a token it knows, and the Helm chart's RBAC enforced for the operator's ServiceAccount: what
the chart grants is answered, anything else is 403 Forbidden."""

from __future__ import annotations

import pathlib
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from disagg_operator import generate, install
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
