"""The local cluster of the e2e_local scenarios: the API emulator, the test node (pods as
sandboxed processes) and the operator, driven with the real kubectl. The operator runs
either as its own process on the host (`disagg operator`, credentials from a kubeconfig,
GPU mode `none` as on a cluster without GPUs), or, with `operator_pod=True`, as a pod of
the Helm chart's Deployment: the chart rendered by Helm (helm-python-sdk) and applied with
kubectl, the emulator serving HTTPS and enforcing RBAC (the chart's ClusterRoles for the
operator's ServiceAccount; an admin token for kubectl and the node), the operator logging
in with in-cluster configuration (the service-account token and ca.crt the kubelet
mounts, `KUBERNETES_SERVICE_HOST`/`PORT` of the node's `kubernetes` Service).

Every wait has a deadline; `LocalCluster.close` stops the operator, terminates every pod and
removes the node's network, and says what was left behind.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import yaml

from disagg_operator.autoscaling import scaling as autoscaling
from disagg_operator.gen import generate, install
from tests.k8s.fixtures import Kubectl
from tests.k8s.node import Node, apiserver
from tests.k8s.node.apiserver import InCluster
from tests.k8s.rbac import Authenticator
from tests.k8s.server import EmulatorThread
from tests.k8s.tls import ServerTls

T = TypeVar("T")
Obj = dict[str, Any]
REPO = pathlib.Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "disagg.dev_disaggregatedpipelines.yaml"
SAMPLES = REPO / "manifests" / "samples"
EXAMPLES = REPO / "examples"
CLIENT = pathlib.Path(__file__).with_name("client_pod.py")
NS = "default"
PIPELINES = "disagg.dev/v1alpha1/disaggregatedpipelines"
LABEL_PIPELINE = "disagg.dev/pipeline"
CHART = REPO / generate.CHART
OPERATOR_NS = "disagg-system"
RELEASE = "disagg-operator"
OPERATOR_VALUES: Obj = {
    "operator": {"gpuMode": "none"},  # no GPUs on this node (no DRA, no device plugin)
    "logLevel": "warning",
    # quicker than the chart's 10 s, so that a restarted operator is seen Ready sooner
    "probes": {"readiness": {"periodSeconds": 2}},
}


def wait_for(
    predicate: Callable[[], T | None], message: str, timeout: float, node: Node | None = None
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        if node is not None and node.errors:
            raise AssertionError(f"the test node failed: {node.errors}")
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {message}")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sample(name: str, folder: pathlib.Path = SAMPLES) -> Obj:
    doc = yaml.safe_load((folder / f"{name}.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def entries_and_exits(doc: Obj) -> tuple[list[Obj], list[str]]:
    """Entry roles (no incoming edge) and exit roles (no outgoing edge) of a pipeline."""
    roles = doc["spec"]["roles"]
    edges = doc["spec"].get("edges") or []
    targets = {e["to"] for e in edges}
    sources = {e["from"] for e in edges}
    entries = [r for r in roles if r["name"] not in targets]
    exits = [r["name"] for r in roles if r["name"] not in sources]
    return entries, exits


def merged(base: Obj, over: Obj) -> Obj:
    """Helm's merge of values: mappings merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out


class LocalCluster:
    def __init__(
        self,
        workdir: pathlib.Path,
        *,
        backoff: float = 1.0,
        operator_args: tuple[str, ...] = (),
        image_env: dict[str, str] | None = None,
        operator_pod: bool = False,
        operator_values: Obj | None = None,
    ) -> None:
        """`image_env`: environment every container starts with, as an image's ENV would
        set it (the pod's own env comes on top). `operator_pod`: the operator as the
        chart's pod (see the module docstring), with `operator_values` over
        OPERATOR_VALUES; `operator_args` are for the host process only."""
        if operator_pod and operator_args:
            raise ValueError("operator_args are for the host operator: use operator_values")
        self.workdir = workdir
        self.operator_args = operator_args
        self.operator_pod = operator_pod
        self.auth = Authenticator() if operator_pod else None
        self.tls = ServerTls() if operator_pod else None
        self.k8s = EmulatorThread(tls=self.tls, auth=self.auth).start()
        self.kubeconfig = workdir / "kubeconfig.yaml"
        self.kubeconfig.write_text(yaml.safe_dump(self.k8s.kubeconfig(), sort_keys=False))
        cache = workdir / "kubectl-cache"
        cache.mkdir(exist_ok=True)
        kubectl = pathlib.Path(sys.executable).parent / "kubectl"
        self.kubectl = Kubectl(str(kubectl), self.kubeconfig, cache)
        self.k8s.apply_file(CRD)
        in_cluster = None
        if self.tls is not None and self.auth is not None:
            in_cluster = InCluster(self.tls.ca_pem, self.auth.service_account_token)
        self.node = Node(
            self.k8s.url,
            backoff=backoff,
            extra_env=image_env,
            ca_pem=self.tls.ca_pem if self.tls is not None else None,
            token=self.k8s.token,
            in_cluster=in_cluster,
            images=True,  # the chart's operator and the samples' roles from their images
        ).start()
        if self.tls is not None:
            # the address pods reach the API at, and the `kubernetes` Service's names
            self.tls.issue(self.node.bridge.gateway, *apiserver.NAMES)
        self.operator: subprocess.Popen[bytes] | None = None
        self.operator_log = workdir / "operator.log"
        try:
            if operator_pod:
                self.install_chart(merged(OPERATOR_VALUES, operator_values or {}))
            else:
                self.start_operator()
        except BaseException as exc:
            try:
                logs = self.operator_logs()[-4000:] if operator_pod else ""
            except Exception as e:  # no pod yet, or no worker for it
                logs = f"(no operator logs: {e!r})"
            finally:
                left = self.close()
            if operator_pod:
                raise AssertionError(
                    f"the operator did not start ({exc!r}); left behind: {left}; its logs:\n{logs}"
                ) from exc
            raise

    # ------------------------------------------------------------------ the operator pod

    def install_chart(self, values: Obj) -> None:
        """Render the chart with Helm, `kubectl apply` it, wait for the operator pod Ready."""
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NS}}
        docs = install.render(CHART, values, release=RELEASE, namespace=OPERATOR_NS)
        self.kubectl.apply([namespace, *docs])
        self.wait_for(self.operator_ready, "the operator pod Ready", 120)

    def operator_pods(self) -> list[Obj]:
        if not self.operator_pod:
            return []
        selector = f"app.kubernetes.io/instance={RELEASE}"
        return self.k8s.list("v1/pods", OPERATOR_NS, selector)

    def operator_ready(self) -> Obj | None:
        """The operator pod when it is Ready (it is the only one)."""
        pods = self.operator_pods()
        if len(pods) != 1:
            return None
        conditions = (pods[0].get("status") or {}).get("conditions") or []
        ok = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
        return pods[0] if ok else None

    def operator_logs(self) -> str:
        if not self.operator_pod:
            return self.operator_log.read_text(errors="replace")
        out = []
        for pod in self.operator_pods():
            name = pod["metadata"]["name"]
            if self.node.kubelet is not None and self.node.kubelet.worker(OPERATOR_NS, name):
                out.append(self.node.logs(OPERATOR_NS, name, "operator"))
        return "".join(out)

    def operator_restarts(self) -> int:
        (pod,) = self.operator_pods()
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
        return int(statuses[0].get("restartCount", 0))

    def kill_operator(self) -> None:
        """kill -9 the operator: its pod's container (the node restarts it), or the host
        process (started again here)."""
        if self.operator_pod:
            (pod,) = self.operator_pods()
            self.node.kill(OPERATOR_NS, pod["metadata"]["name"], "operator")
            return
        assert self.operator is not None
        self.operator.kill()
        self.operator.wait()
        self.start_operator()

    def operator_running(self) -> bool:
        if self.operator_pod:
            return self.operator_ready() is not None
        return self.operator is not None and self.operator.poll() is None

    def denied(self) -> list[str]:
        """Every API call the emulator refused (401/403), as `user verb path code`."""
        return [
            f"{c.user} {c.verb} {c.path} {c.code}" for c in self.k8s.calls if c.code in (401, 403)
        ]

    def start_operator(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.metrics_port = free_port()
        with self.operator_log.open("ab") as log:
            self.operator = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "disagg_runtime.cli",
                    "operator",
                    "--standalone",
                    "--all-namespaces",
                    "--gpu-mode=none",
                    f"--liveness-port={free_port()}",
                    f"--metrics-port={self.metrics_port}",
                    "--log-level=warning",
                    *self.operator_args,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_for(self, predicate: Callable[[], T | None], message: str, timeout: float) -> T:
        """`wait_for` that fails at once when the node itself failed."""
        return wait_for(predicate, message, timeout, self.node)

    def close(self) -> list[str]:
        """Stop everything; returns what the node left behind (empty when clean) and the
        node's own failures."""
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(30)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait()
        try:
            self.node.stop()
        finally:
            self.k8s.stop()
        return self.node.leftovers() + self.node.errors

    # ------------------------------------------------------------------ reading

    def pipeline(self, name: str) -> Obj | None:
        return self.k8s.get(PIPELINES, name, NS)

    def ready(self, name: str) -> bool:
        status = (self.pipeline(name) or {}).get("status") or {}
        return any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )

    def pods(self, pipeline: str) -> list[Obj]:
        return self.k8s.list("v1/pods", NS, f"{LABEL_PIPELINE}={pipeline}")

    def children(self, pipeline: str) -> list[str]:
        found = []
        for ref in (
            "v1/configmaps",
            "v1/services",
            "v1/secrets",
            "apps/v1/statefulsets",
            "apps/v1/deployments",
            "v1/pods",
        ):
            for obj in self.k8s.list(ref, NS, f"{LABEL_PIPELINE}={pipeline}"):
                found.append(f"{obj['kind']}/{obj['metadata']['name']}")
        return found

    def metrics(self, pod: Obj, container: str) -> str:
        """A role container's /metrics, fetched from the node (host) at the pod IP."""
        spec = next(c for c in pod["spec"]["containers"] if c["name"] == container)
        port = autoscaling.metrics_port(spec)  # `metrics`, `metrics-<k>` in a colocation pod
        url = f"http://{pod['status']['podIP']}:{port}/metrics"
        import urllib.request

        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())

    # ------------------------------------------------------------------ the client pod

    def run_client(
        self,
        name: str,
        doc: Obj,
        *,
        requests: int,
        concurrency: int = 2,
        timeout: float = 60.0,
        pause: float = 0.0,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> Obj:
        """Run a client pod against pipeline `doc` (already Ready); returns its RESULT line
        (or, with wait=False, the pod name)."""
        pipeline = doc["metadata"]["name"]
        entries, exits = entries_and_exits(doc)
        argv = ["python", str(CLIENT), "--pipeline", pipeline, "--requests", str(requests)]
        argv += ["--concurrency", str(concurrency), "--timeout", str(timeout)]
        argv += ["--pause", str(pause), "--handler", entries[0]["handler"]]
        for role in entries:
            svc = self.k8s.get("v1/services", f"{pipeline}-{role['name']}", NS)
            assert svc is not None, f"no Service for entry role {role['name']}"
            port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "ingress")
            argv += ["--entry", f"{role['name']}={pipeline}-{role['name']}:{port}"]
        for role_name in exits:
            argv += ["--exit", role_name]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": "e2e-client"}},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "client",
                        "image": "local",
                        "command": argv,
                        "env": [
                            {
                                "name": "POD_IP",
                                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                            },
                            # the pipeline's peer key, as its roles get it (docs/security.md)
                            {"name": "DISAGG_PEER_KEY_FILE", "value": "/etc/disagg-peer-key/key"},
                            *({"name": k, "value": v} for k, v in (env or {}).items()),
                        ],
                        "volumeMounts": [
                            {
                                "name": "peer-key",
                                "mountPath": "/etc/disagg-peer-key",
                                "readOnly": True,
                            }
                        ],
                    }
                ],
                "volumes": [{"name": "peer-key", "secret": {"secretName": f"{pipeline}-peer-key"}}],
            },
        }
        self.kubectl.apply([pod])
        if not wait:
            return {"pod": name}
        return self.client_result(name, timeout=timeout * (requests // concurrency + 2))

    def client_result(self, name: str, timeout: float, namespace: str = NS) -> Obj:
        def finished() -> Obj | None:
            pod = self.k8s.get("v1/pods", name, namespace) or {}
            phase = (pod.get("status") or {}).get("phase")
            return pod if phase in ("Succeeded", "Failed") else None

        self.wait_for(finished, f"client pod {name}", timeout)
        logs = self.node.logs(namespace, name)
        match = re.search(r"^RESULT (.*)$", logs, re.MULTILINE)
        assert match, f"client pod {name} printed no result:\n{logs[-3000:]}"
        result: Obj = json.loads(match.group(1))
        rids = set(re.findall(r"request ([0-9a-f]{32})", " ".join(result.get("errors") or ())))
        if rids:  # what the client said of the requests that failed, for the diagnosis
            result["log"] = [line for line in logs.splitlines() if any(r in line for r in rids)]
        self.k8s.delete("v1/pods", name, namespace)
        return result
