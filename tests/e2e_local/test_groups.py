"""Issue 33 on the test node: a role of groups (`roles[].nodes: 2`) from the runtime image.
ingest -> vision, vision a group of two pods per replica (the leader, P-R-g, and a worker,
P-R-w1-g): the kubelet expands the worker's DISAGG_LEADER from its pod-index label, the two
pods form one gloo world over the headless `-ranks` Service's DNS (the leader is Ready only
once the world formed and its feed said hello), ingest reaches the group through the role's
Service (the leader only), and requests pass. Then: the worker pod is deleted and the whole
group starts again (the leader recreated too: the operator's group restart) and serves; the
role is scaled 1 -> 2 groups, both new pods come together and the new group serves (counted
from its leader's own /metrics).

One scenario, one cluster (module scope): `make test` pays for it once."""

from __future__ import annotations

import datetime
import pathlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e_local.local_cluster import NS, LocalCluster, sample
from tests.e2e_local.test_autoscaling import requests_done

pytestmark = [pytest.mark.e2e_local, pytest.mark.timeout(600)]
NAME = "groups"
ROLE = "vision"
LEADERS = f"{NAME}-{ROLE}"  # the leaders' StatefulSet; the workers' is LEADERS-w1
READY_TIMEOUT = 180.0


def pipeline() -> dict[str, Any]:
    image = sample("fan-out")["spec"]["image"]  # the runtime image, as the samples name it
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "image": image,
            "transport": {"poolSize": "64Mi", "minBlock": "64Ki", "requestTimeoutSeconds": 20},
            "roles": [
                {"name": "ingest", "handler": "disagg_runtime.demo:ingest"},
                {
                    "name": ROLE,
                    "handler": "disagg_runtime.demo:embed_image",
                    "nodes": 2,
                    "startupSeconds": 120,
                },
            ],
            "edges": [{"from": "ingest", "to": ROLE}],
        },
    }


def pod(cluster: LocalCluster, name: str) -> dict[str, Any]:
    return cluster.k8s.get("v1/pods", name, NS) or {"metadata": {}}


def ready(obj: dict[str, Any]) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def role_of(obj: dict[str, Any]) -> str | None:
    return (obj["metadata"].get("labels") or {}).get("disagg.dev/role")


def running(obj: dict[str, Any]) -> bool:
    statuses = (obj.get("status") or {}).get("containerStatuses") or []
    return bool(statuses) and all("running" in (s.get("state") or {}) for s in statuses)


def container_env(cluster: LocalCluster, name: str) -> dict[str, str]:
    """The role process's own environment, as the kubelet made it (from /proc)."""
    worker = cluster.node.worker(NS, name)
    (c,) = [c for c in worker.containers if c.name == ROLE]
    assert c.process is not None
    raw = pathlib.Path(f"/proc/{c.process.pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def group_serving(cluster: LocalCluster, g: int, uids: tuple[str, str] | None = None) -> bool:
    """Both members of group g run (new ones, when `uids` names the old), the leader is
    Ready and the role's Service has its address."""
    leader, worker = pod(cluster, f"{LEADERS}-{g}"), pod(cluster, f"{LEADERS}-w1-{g}")
    if uids is not None and {leader["metadata"].get("uid"), worker["metadata"].get("uid")} & {
        None,
        *uids,
    }:
        return False
    if not (running(leader) and running(worker) and ready(leader)):
        return False
    ip = (leader.get("status") or {}).get("podIP")
    slices = cluster.k8s.list(
        "discovery.k8s.io/v1/endpointslices", NS, f"kubernetes.io/service-name={LEADERS}"
    )
    served = {
        a
        for s in slices
        for e in s.get("endpoints") or []
        if (e.get("conditions") or {}).get("ready")
        for a in e["addresses"]
    }
    return ip in served


def uids(cluster: LocalCluster, g: int) -> tuple[str, str]:
    return (
        pod(cluster, f"{LEADERS}-{g}")["metadata"]["uid"],
        pod(cluster, f"{LEADERS}-w1-{g}")["metadata"]["uid"],
    )


def test_a_role_of_groups(local_cluster: LocalCluster, figures: Callable[[str], None]) -> None:
    cluster = local_cluster
    doc = pipeline()
    t0 = time.monotonic()
    cluster.kubectl.apply([doc])
    cluster.wait_for(lambda: cluster.ready(NAME), "Ready", READY_TIMEOUT)
    cluster.wait_for(lambda: group_serving(cluster, 0), "group 0 serving", READY_TIMEOUT)
    ready_s = time.monotonic() - t0
    names = sorted(p["metadata"]["name"] for p in cluster.pods(NAME) if role_of(p) == ROLE)
    assert names == [f"{LEADERS}-0", f"{LEADERS}-w1-0"], names  # one group: two pods
    line = [f"Ready in {ready_s:.1f} s with pods {names}"]

    # the kubelet expanded $(DISAGG_GROUP_INDEX) in the worker's DISAGG_LEADER
    env = container_env(cluster, f"{LEADERS}-w1-0")
    leader_host = f"{LEADERS}-0.{LEADERS}-ranks.{NS}.svc.cluster.local"
    assert env["DISAGG_GROUP_INDEX"] == "0", env
    assert env["DISAGG_LEADER"] == leader_host, env["DISAGG_LEADER"]
    assert (env["DISAGG_NODES"], env["DISAGG_NODE_RANK"]) == ("2", "1")
    # ... and the worker joined the leader's world over that name (gloo between the pods)
    logs = cluster.node.logs(NS, f"{LEADERS}-w1-0", ROLE)
    assert f"rank 1/2 (local 0) joined via {leader_host}" in logs, logs[-3000:]
    first = cluster.run_client("client-0", doc, requests=4)
    assert first["ok"] == 4, first

    # delete the worker: the group starts again whole (its leader too) and serves
    before = uids(cluster, 0)
    t0 = time.monotonic()
    cluster.kubectl("delete", "pod", f"{LEADERS}-w1-0", "--wait=false")
    cluster.wait_for(
        lambda: group_serving(cluster, 0, before), "group 0 restarted whole", READY_TIMEOUT
    )
    regroup_s = time.monotonic() - t0
    events = cluster.k8s.list("v1/events", NS)
    assert any(e.get("reason") == "GroupRestarted" for e in events), "the operator said so"
    after = cluster.run_client("client-1", doc, requests=4)
    assert after["ok"] == 4, after
    line.append(f"worker deleted: group restarted whole in {regroup_s:.1f} s, then ok 4/4")

    # scale 1 -> 2 groups: the leader and the worker of group 1 come together, and it serves
    t0 = time.monotonic()
    cluster.kubectl(
        "patch",
        "disaggregatedpipeline",
        NAME,
        "--type=json",
        '-p=[{"op": "add", "path": "/spec/roles/1/replicas", "value": 2}]',
    )

    def both_new() -> bool:
        pods = {p["metadata"]["name"] for p in cluster.pods(NAME)}
        return {f"{LEADERS}-1", f"{LEADERS}-w1-1"} <= pods

    cluster.wait_for(both_new, "group 1's pods", 60)
    appeared_s = time.monotonic() - t0
    created = [
        datetime.datetime.fromisoformat(pod(cluster, n)["metadata"]["creationTimestamp"])
        for n in (f"{LEADERS}-1", f"{LEADERS}-w1-1")
    ]
    apart_s = abs((created[0] - created[1]).total_seconds())
    assert apart_s <= 5, f"group 1's leader and worker came {apart_s} s apart"
    cluster.wait_for(lambda: group_serving(cluster, 1), "group 1 serving", READY_TIMEOUT)
    scaled_s = time.monotonic() - t0
    sts = cluster.k8s.get("apps/v1/statefulsets", f"{LEADERS}-w1", NS) or {}
    assert sts["spec"]["replicas"] == 2
    leader1 = pod(cluster, f"{LEADERS}-1")
    deadline = time.monotonic() + 120
    served, rounds = 0.0, 0
    while served == 0 and time.monotonic() < deadline:  # ingest spreads over both leaders
        result = cluster.run_client(f"client-{2 + rounds}", doc, requests=6)
        assert result["ok"] == 6, result
        served = requests_done(cluster.metrics(leader1, ROLE))
        rounds += 1
    assert served > 0, "the new group served no request"
    line.append(
        f"scaled 1 -> 2 groups: both pods in {appeared_s:.1f} s ({apart_s:.0f} s apart), "
        f"serving in {scaled_s:.1f} s, new group served {served:.0f} of {6 * rounds}"
    )

    cluster.kubectl("delete", "disaggregatedpipeline", NAME)
    cluster.wait_for(lambda: not cluster.children(NAME), "children gone", 90)
    figures("issue 33 groups (nodes: 2): " + "; ".join(line))
