"""The test node (tests/k8s/node) itself, with small Python pods (no torch): StatefulSet
semantics, endpoints, cluster DNS, volumes, env, security context, probes, restarts with
back-off, graceful termination, and a teardown that leaves nothing. Needs root (skipped
otherwise, saying why)."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from dnslib import QTYPE, RCODE, DNSRecord

from tests.k8s.node import Node, can_create_namespaces

if TYPE_CHECKING:
    from tests.k8s.server import EmulatorThread

pytestmark = pytest.mark.timeout(180)
NS = "default"
STS = "apps/v1/statefulsets"
SERVER = (
    "import http.server, os\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        bad = os.path.exists('/tmp/unready') and self.path == '/ready'\n"
    "        self.send_response(500 if bad else 200); self.end_headers()\n"
    "    def log_message(self, *a): pass\n"
    "print('uid', os.getuid(), os.getgid(), 'host', os.uname().nodename, flush=True)\n"
    "print('env', os.environ.get('POD'), os.environ.get('TOKEN'), os.environ.get('X'),"
    " flush=True)\n"
    "http.server.HTTPServer(('0.0.0.0', 8080), H).serve_forever()\n"
)


@pytest.fixture
def node(k8s: EmulatorThread) -> Iterator[Node]:
    reason = can_create_namespaces()
    if reason is not None:
        pytest.skip(reason)
    node = Node(k8s.url, backoff=0.5).start()
    try:
        yield node
    finally:
        node.stop()
    assert node.leftovers() == []
    assert node.errors == []


def statefulset(replicas: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "web", "namespace": NS},
        "spec": {
            "serviceName": "web",
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "securityContext": {"runAsUser": 65532, "runAsGroup": 65533},
                    "terminationGracePeriodSeconds": 2,
                    "volumes": [
                        {"name": "cfg", "configMap": {"name": "cfg"}},
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Mi"}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                    "containers": [
                        {
                            "name": "web",
                            "image": "ignored",
                            "command": ["python", "-c", SERVER],
                            "env": [
                                {
                                    "name": "POD",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                },
                                {
                                    "name": "TOKEN",
                                    "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}},
                                },
                                {"name": "X", "value": "$(POD)-x"},
                            ],
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "readinessProbe": {
                                "httpGet": {"path": "/ready", "port": "http"},
                                "periodSeconds": 1,
                                "failureThreshold": 1,
                            },
                            "securityContext": {"readOnlyRootFilesystem": True},
                            "volumeMounts": [
                                {"name": "cfg", "mountPath": "/etc/cfg", "readOnly": True},
                                {"name": "shm", "mountPath": "/dev/shm"},
                                {"name": "tmp", "mountPath": "/tmp"},
                            ],
                        }
                    ],
                },
            },
            **spec,
        },
    }


def setup_objects(k8s: EmulatorThread) -> None:
    k8s.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cfg", "namespace": NS},
            "data": {"a": "one"},
        }
    )
    k8s.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s", "namespace": NS},
            "data": {"token": base64.b64encode(b"sekrit").decode()},
        }
    )
    k8s.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": NS},
            "spec": {
                "clusterIP": "None",
                "selector": {"app": "web"},
                "ports": [{"name": "http", "port": 8080}],
            },
        }
    )


def ready_replicas(k8s: EmulatorThread) -> int:
    return int(((k8s.get(STS, "web", NS) or {}).get("status") or {}).get("readyReplicas", 0))


def dns(node: Node, name: str) -> tuple[int, list[str]]:
    reply = DNSRecord.parse(DNSRecord.question(name).send(node.bridge.gateway, 53, timeout=3))
    return reply.header.rcode, sorted(str(r.rdata) for r in reply.rr if r.rtype == QTYPE.A)


def in_pod(node: Node, pod: str, path: str) -> str:
    pid = node.worker(NS, pod).containers[0].process.pid  # type: ignore[union-attr]
    with open(f"/proc/{pid}/root{path}") as f:
        return f.read()


def test_statefulset_pods_endpoints_dns_volumes(k8s: EmulatorThread, node: Node) -> None:
    def state() -> str:
        pods = [
            (
                p["metadata"]["name"],
                p["metadata"]["uid"][:8],
                p["metadata"].get("deletionTimestamp"),
                p["metadata"].get("finalizers"),
                (p.get("status") or {}).get("phase"),
                [c["status"] for c in (p.get("status") or {}).get("conditions") or []],
            )
            for p in k8s.list("v1/pods", NS)
        ]
        sts = (k8s.get(STS, "web", NS) or {}).get("status")
        kubelet = node.kubelet
        workers = (
            []
            if kubelet is None
            else [(w.name, w.uid[:8], w.phase) for w in list(kubelet.workers.values())]
        )
        return f"pods {pods} sts {sts} node errors {node.errors} workers {workers}"

    setup_objects(k8s)
    k8s.create(statefulset(2))
    k8s.wait_for(lambda: ready_replicas(k8s) == 2, 30, 0.1, "2 ready replicas")
    pods = {p["metadata"]["name"]: p for p in k8s.list("v1/pods", NS, "app=web")}
    assert sorted(pods) == ["web-0", "web-1"]
    ips = {name: p["status"]["podIP"] for name, p in pods.items()}
    assert pods["web-1"]["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == "1"
    assert pods["web-0"]["metadata"]["ownerReferences"][0]["kind"] == "StatefulSet"

    log = node.logs(NS, "web-0")
    assert "uid 65532 65533 host web-0" in log
    assert "env web-0 sekrit web-0-x" in log
    assert in_pod(node, "web-0", "/etc/cfg/a") == "one"
    assert "nameserver " + node.bridge.gateway in in_pod(node, "web-0", "/etc/resolv.conf")
    assert "search default.svc.cluster.local" in in_pod(node, "web-0", "/etc/resolv.conf")
    pid = node.worker(NS, "web-0").containers[0].process.pid  # type: ignore[union-attr]
    vfs = os.statvfs(f"/proc/{pid}/root/dev/shm")
    assert vfs.f_blocks * vfs.f_frsize == 8 << 20

    # endpoints and DNS
    everyone = (0, sorted(ips.values()))
    k8s.wait_for(lambda: dns(node, "web.default.svc.cluster.local") == everyone, 10, 0.1, "dns")
    assert dns(node, "web-1.web.default.svc.cluster.local") == (0, [ips["web-1"]])
    assert dns(node, "nope.default.svc.cluster.local")[0] == RCODE.NXDOMAIN
    eps = k8s.get("v1/endpoints", "web", NS)
    assert eps is not None
    assert sorted(a["ip"] for a in eps["subsets"][0]["addresses"]) == sorted(ips.values())

    # a pod that stops being ready leaves DNS, and comes back
    open(f"/proc/{pid}/root/tmp/unready", "w").close()
    k8s.wait_for(
        lambda: dns(node, "web.default.svc.cluster.local")[1] == [ips["web-1"]], 15, 0.2, "unready"
    )
    os.unlink(f"/proc/{pid}/root/tmp/unready")
    k8s.wait_for(lambda: ready_replicas(k8s) == 2, 15, 0.1, "ready again")

    # a ConfigMap change reaches the running pod in place
    k8s.patch("v1/configmaps", "cfg", {"data": {"a": "two"}}, NS)
    k8s.wait_for(lambda: in_pod(node, "web-0", "/etc/cfg/a") == "two", 15, 0.2, "cm update")

    # scale up and down: ordinals
    k8s.patch(STS, "web", {"spec": {"replicas": 3}}, NS)
    k8s.wait_for(lambda: ready_replicas(k8s) == 3, 30, 0.1, "3 ready replicas")
    k8s.patch(STS, "web", {"spec": {"replicas": 1}}, NS)
    k8s.wait_for(
        lambda: [p["metadata"]["name"] for p in k8s.list("v1/pods", NS, "app=web")] == ["web-0"],
        30,
        0.1,
        "scaled to web-0",
    )

    # rolling update with a partition: only ordinals >= partition move
    k8s.patch(
        STS,
        "web",
        {
            "spec": {
                "replicas": 2,
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 1}},
            }
        },
        NS,
    )
    k8s.wait_for(lambda: ready_replicas(k8s) == 2, 30, 0.1, lambda: "2 ready again: " + state())
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in k8s.list("v1/pods", NS)}
    k8s.patch(
        STS,
        "web",
        {"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}},
        NS,
    )

    def rolled() -> bool:
        status = (k8s.get(STS, "web", NS) or {}).get("status") or {}
        return status.get("updatedReplicas") == 1 and status.get("readyReplicas") == 2

    k8s.wait_for(rolled, 30, 0.1, "web-1 updated")
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in k8s.list("v1/pods", NS)}
    assert after["web-0"] == before["web-0"] and after["web-1"] != before["web-1"]
    status = (k8s.get(STS, "web", NS) or {})["status"]
    assert status["currentRevision"] != status["updateRevision"]


def pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"containers": [{"name": "c", "image": "x", "command": command}], **spec},
    }


def status_of(k8s: EmulatorThread, name: str) -> dict[str, Any]:
    obj = k8s.get("v1/pods", name, NS) or {}
    return dict(((obj.get("status") or {}).get("containerStatuses") or [{}])[0])


def test_restarts_back_off_and_termination_is_graceful_then_forced(
    k8s: EmulatorThread, node: Node
) -> None:
    k8s.create(pod("crash", ["python", "-c", "raise SystemExit(3)"]))
    k8s.create(
        pod(
            "stubborn",
            [
                "python",
                "-c",
                "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('up', flush=True)\ntime.sleep(600)",
            ],
            terminationGracePeriodSeconds=1,
        )
    )
    k8s.create(pod("done", ["python", "-c", "print('bye')"], restartPolicy="Never"))
    # back-off: 0, 0.5, 1, 2 s between restarts; waiting shows as CrashLoopBackOff
    k8s.wait_for(
        lambda: (
            status_of(k8s, "crash").get("state", {}).get("waiting", {}).get("reason")
            == "CrashLoopBackOff"
        ),
        30,
        0.05,
        "CrashLoopBackOff",
    )
    k8s.wait_for(lambda: status_of(k8s, "crash").get("restartCount", 0) >= 4, 30, 0.05, "4")
    last = status_of(k8s, "crash")["lastState"]["terminated"]
    assert last["exitCode"] == 3 and last["reason"] == "Error"
    k8s.wait_for(
        lambda: (
            ((k8s.get("v1/pods", "done", NS) or {}).get("status") or {}).get("phase") == "Succeeded"
        ),
        15,
        0.1,
        "Succeeded",
    )
    time.sleep(0.6)  # a few kubelet ticks: a finished Never container is never started again
    assert node.logs(NS, "done") == "bye\n"
    k8s.wait_for(lambda: "up" in node.logs(NS, "stubborn"), 15, 0.1, "stubborn up")
    worker = node.worker(NS, "stubborn")
    process = worker.containers[0].process
    assert process is not None
    t0 = time.monotonic()
    k8s.delete("v1/pods", "stubborn", NS)
    # as on a node, the pod stays in the API, being deleted, while its container runs
    terminating = k8s.get("v1/pods", "stubborn", NS)
    assert terminating is not None and terminating["metadata"].get("deletionTimestamp")
    k8s.wait_for(lambda: process.returncode is not None, 10, 0.05, "killed")
    took = time.monotonic() - t0
    assert 0.9 <= took < 5, took  # SIGTERM ignored, SIGKILL after the 1 s grace period
    assert process.returncode == -9
    k8s.wait_for(lambda: k8s.get("v1/pods", "stubborn", NS) is None, 10, 0.05, "pod gone")
