"""Scenarios 1 and 4 of issue 13 on the test node: each sample of manifests/samples is
applied with kubectl, becomes Ready from real pod readiness, serves requests from a client
pod, and leaves nothing behind when deleted.

What the pods are checked for: hostname = pod name, the uid/gid of the pod's securityContext,
a read-only root, /dev/shm a tmpfs of the emptyDir's sizeLimit, one network namespace per
pod; edges between pods use tcp (the runtime's choice without DISAGG_NODE_LOCAL): no pod but
a colocation pod may hold shared-memory segments.
"""

from __future__ import annotations

import os
import pathlib
import re
import time
from collections.abc import Callable
from typing import Any

import pytest

from disagg_core import quantity
from tests.e2e_local.local_cluster import NS, OPERATOR_NS, SAMPLES, LocalCluster, sample

pytestmark = [pytest.mark.e2e_local, pytest.mark.timeout(600)]
READY_TIMEOUT = 180.0
# requests per sample: text-to-video takes ~10 s a request on two shared cores
REQUESTS = {"fan-out": 6, "llm-prefill-decode": 4, "text-to-video": 2}
LABEL = re.compile(r'(\w+)="([^"]*)"')
SAMPLE_NAMES = sorted(p.stem for p in SAMPLES.glob("*.yaml"))


def container_pid(cluster: LocalCluster, pod: str, container: str) -> int:
    worker = cluster.node.worker(NS, pod)
    c = next(c for c in worker.containers if c.name == container)
    assert c.process is not None and c.process.returncode is None, f"{pod}/{container} runs"
    return c.process.pid


def check_sandbox(cluster: LocalCluster, pod: dict[str, Any]) -> set[str]:
    """Check one pod's sandbox; returns the shm segments its containers see (the same set
    for every container: they share the pod's /dev/shm)."""
    name = pod["metadata"]["name"]
    spec = pod["spec"]
    shm_limit = next(
        quantity.parse_bytes(v["emptyDir"]["sizeLimit"])
        for v in spec["volumes"]
        if v["name"] == "dshm"
    )
    seen: list[set[str]] = []
    for c in spec["containers"]:
        pid = container_pid(cluster, name, c["name"])
        root = f"/proc/{pid}/root"
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
        uid = spec["securityContext"]["runAsUser"]
        assert re.search(rf"^Uid:\s+{uid}\s+{uid}\s+{uid}", status, re.M), status
        assert pathlib.Path(f"{root}/etc/hostname").read_text().strip() == name
        with open(f"/proc/{pid}/mounts") as f:
            mounts = {line.split()[1]: line.split() for line in f}
        assert "ro" in mounts["/"][3].split(","), "readOnlyRootFilesystem"
        assert mounts["/dev/shm"][2] == "tmpfs"
        vfs = os.statvfs(f"{root}/dev/shm")
        assert vfs.f_blocks * vfs.f_frsize == shm_limit
        seen.append(set(os.listdir(f"{root}/dev/shm")))
        assert os.path.exists(f"{root}/etc/disagg/topology.json")
    assert all(s == seen[0] for s in seen), seen
    return seen[0]


def counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def edge_relays(text: str) -> list[tuple[str, str, str]]:
    """(source, target, relay) of every edge that carried a message
    (`disagg_edge_messages_total{edge, relay}` above 0)."""
    found = []
    for line in text.splitlines():
        if line.startswith("disagg_edge_messages_total{") and float(line.rsplit(" ", 1)[1]) > 0:
            labels = dict(LABEL.findall(line))
            source, target = labels["edge"].split("->")
            found.append((source, target, labels["relay"]))
    return found


def check_gateway(cluster: LocalCluster, name: str, doc: dict[str, Any]) -> None:
    """The rendered gateway Deployment serves: its pod gets ready (every entry role
    reachable) and answers an OpenAI completion at its pod IP, through the roles' pods."""
    import json
    import urllib.request

    def gateway_pod() -> dict[str, Any] | None:
        pods = [
            p
            for p in cluster.pods(name)
            if p["metadata"]["labels"].get("app.kubernetes.io/component") == "gateway"
        ]
        ready = [
            p
            for p in pods
            if any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or []
            )
        ]
        return ready[0] if ready else None

    cluster.wait_for(lambda: gateway_pod() is not None, f"{name}'s gateway ready", READY_TIMEOUT)
    pod = gateway_pod()
    assert pod is not None
    port = doc["spec"]["gateway"].get("port", 8080)
    body = {"model": doc["spec"]["gateway"]["model"], "prompt": "hello", "max_tokens": 4}
    request = urllib.request.Request(
        f"http://{pod['status']['podIP']}:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["choices"][0]["finish_reason"] == "length", answer
    assert answer["usage"]["completion_tokens"] == 4, answer


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_sample_runs_and_deletes_cleanly(
    local_cluster: LocalCluster, name: str, figures: Callable[[str], None]
) -> None:
    cluster = local_cluster
    doc = sample(name)
    t0 = time.monotonic()
    cluster.kubectl("apply", "-f", str(SAMPLES / f"{name}.yaml"))
    cluster.wait_for(lambda: cluster.ready(name), f"{name} Ready", READY_TIMEOUT)
    ready_s = time.monotonic() - t0
    every = cluster.pods(name)
    pods = [p for p in every if "disagg.dev/role" in p["metadata"]["labels"]]  # the roles'
    assert pods and all(p["status"]["phase"] == "Running" for p in pods)
    assert len({p["status"]["podIP"] for p in pods}) == len(pods), "one IP per pod"
    colocated = {p["metadata"]["name"] for p in pods if len(p["spec"]["containers"]) > 1}
    for pod in pods:
        # each role's receive pool lives in its own pod's /dev/shm, seen by no other pod
        segments = check_sandbox(cluster, pod)
        assert len(segments) == len(pod["spec"]["containers"]), segments
        assert not segments & set(os.listdir("/dev/shm")), "pod segments stay off the host"

    if doc["spec"].get("gateway", {}).get("api") == "openai":
        check_gateway(cluster, name, doc)

    requests = REQUESTS.get(name, 2)
    result = cluster.run_client(f"client-{name}", doc, requests=requests, concurrency=2)
    assert result["ok"] == requests and result["failed"] == 0, result

    done, edge_bytes = 0.0, 0.0
    unit = {
        c["name"]: p["metadata"]["labels"]["disagg.dev/role"]
        for p in pods
        for c in p["spec"]["containers"]
    }
    relays: dict[str, int] = {}
    for pod in pods:
        for c in pod["spec"]["containers"]:
            text = cluster.metrics(pod, c["name"])
            done += counter(text, "disagg_requests_total", outcome="done")
            edge_bytes += counter(text, "disagg_edge_bytes_total", direction="out")
            for source, target, relay in edge_relays(text):
                # shm only inside a (colocation) pod, tcp between pods
                expected = "shm" if unit[source] == unit[target] else "tcp"
                assert relay == expected, (source, target, relay)
                relays[relay] = relays.get(relay, 0) + 1
    roles = len(doc["spec"]["roles"])
    assert done >= requests * roles, f"every role finished every request ({done})"
    assert edge_bytes > 0

    # scenario 4: delete the pipeline; every child, pod, process and netns goes
    pods = cluster.pods(name)  # the gateway's pod goes too
    workers = [cluster.node.worker(NS, p["metadata"]["name"]) for p in pods]
    netns = [w.sandbox.netns for w in workers]
    pids = [c.process.pid for w in workers for c in w.containers if c.process is not None]
    pids += [w.sandbox.pause.pid for w in workers if w.sandbox.pause is not None]
    t1 = time.monotonic()
    cluster.kubectl("delete", "disaggregatedpipeline", name, "--wait=false")
    cluster.wait_for(lambda: not cluster.children(name), f"{name}'s children gone", 60)

    def sandboxes_gone() -> bool:
        listed = cluster.node.leftovers()
        return not any(n in item for n in netns for item in listed)

    cluster.wait_for(sandboxes_gone, f"{name}'s pod sandboxes gone", 60)
    deleted_s = time.monotonic() - t1
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], "processes gone"
    figures(
        f"scenario 1+4 {name}: Ready in {ready_s:.1f} s, {len(pods)} pods "
        f"({len(colocated)} colocation), edges by relay {relays}, requests ok "
        f"{result['ok']} failed {result['failed']}, "
        f"p50 {result['p50_s']} s, max {result['max_s']} s; deleted: children, pods, "
        f"processes, netns gone in {deleted_s:.1f} s"
    )


PROBE_API = """
import json, kubernetes
from kubernetes.client.rest import ApiException
kubernetes.config.load_incluster_config()
core, apps = kubernetes.client.CoreV1Api(), kubernetes.client.AppsV1Api()
out = {"statefulsets": len(apps.list_stateful_set_for_all_namespaces().items)}
for name, call in (("nodes", core.list_node), ("namespaces", core.list_namespace)):
    try:
        call()
        out[name] = 200
    except ApiException as e:
        out[name] = e.status
print("RESULT " + json.dumps(out), flush=True)
"""


def test_the_operator_pod_runs_in_cluster_within_its_rbac(local_cluster: LocalCluster) -> None:
    """The operator runs as the chart's pod: non-root, in-cluster credentials, and none of its
    calls (every sample reconciled before this test) was refused by the chart's RBAC; a pod
    of its ServiceAccount is refused what the chart does not grant (a live RBAC check)."""
    cluster = local_cluster
    assert cluster.operator_pod
    pod = cluster.operator_ready()
    assert pod is not None, "the operator pod is Ready"
    name, account = pod["metadata"]["name"], pod["spec"]["serviceAccountName"]
    pid = cluster.node.worker(OPERATOR_NS, name).containers[0].process.pid  # type: ignore[union-attr]
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    assert re.search(r"^Uid:\s+65532\s", status, re.MULTILINE), "runs as the chart's uid"
    environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"KUBERNETES_SERVICE_HOST={cluster.node.bridge.gateway}".encode() in environ
    assert not [c for c in cluster.k8s.calls if c.user is None], "every call authenticated"
    operator_calls = [c for c in cluster.k8s.calls if c.user and c.user.endswith(f":{account}")]
    assert operator_calls, "the operator's calls came with its service-account token"
    assert cluster.denied() == [], "the chart's RBAC allowed every call the operator made"
    probe = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "rbac-probe", "namespace": OPERATOR_NS},
        "spec": {
            "serviceAccountName": account,
            "automountServiceAccountToken": True,  # as the chart's Deployment (not its SA)
            "restartPolicy": "Never",
            "containers": [
                {"name": "probe", "image": "local", "command": ["python", "-c", PROBE_API]}
            ],
        },
    }
    cluster.kubectl.apply([probe])
    result = cluster.client_result("rbac-probe", timeout=60, namespace=OPERATOR_NS)
    assert result["statefulsets"] >= 0 and result["nodes"] == 403 and result["namespaces"] == 403, (
        result
    )
