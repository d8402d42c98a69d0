"""Scenario 3 of issue 13 on the test node, with the fan-out sample (its requests are the
quickest): kill -9 a role container, delete a pod, cut a pod's network, kill the operator.
Each fault is followed by requests that must succeed; requests caught by a fault must fail
with an error within their timeout, never hang."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e_local.local_cluster import NS, SAMPLES, LocalCluster, sample

pytestmark = [pytest.mark.e2e_local, pytest.mark.timeout(600)]
NAME = "fan-out"
READY_TIMEOUT = 180.0
TIMEOUT = 8.0  # per request, for the requests caught by a fault


def container_state(cluster: LocalCluster, pod: str, container: str) -> dict[str, Any]:
    obj = cluster.k8s.get("v1/pods", pod, NS) or {}
    statuses = (obj.get("status") or {}).get("containerStatuses") or []
    return next((s for s in statuses if s["name"] == container), {})


def segments(cluster: LocalCluster, pod: str, container: str) -> list[str]:
    worker = cluster.node.worker(NS, pod)
    c = next(c for c in worker.containers if c.name == container)
    assert c.process is not None
    return sorted(os.listdir(f"/proc/{c.process.pid}/root/dev/shm"))


def children_uids(cluster: LocalCluster) -> dict[str, str]:
    found = {}
    for ref in ("v1/configmaps", "v1/services", "apps/v1/statefulsets"):
        for obj in cluster.k8s.list(ref, NS, f"disagg.dev/pipeline={NAME}"):
            found[f"{obj['kind']}/{obj['metadata']['name']}"] = obj["metadata"]["uid"]
    return found


def test_faults(local_cluster: LocalCluster, figures: Callable[[str], None]) -> None:
    cluster = local_cluster
    doc = sample(NAME)
    cluster.kubectl("apply", "-f", str(SAMPLES / f"{NAME}.yaml"))
    cluster.wait_for(lambda: cluster.ready(NAME), "Ready", READY_TIMEOUT)
    first = cluster.run_client("client-0", doc, requests=2)
    assert first["ok"] == 2, first
    line = []

    # kill -9 the fuse container while requests are in flight
    fuse = f"{NAME}-fuse-0"
    cluster.run_client(
        "client-1", doc, requests=8, concurrency=2, timeout=TIMEOUT, pause=0.3, wait=False
    )
    time.sleep(2.0)
    t0 = time.monotonic()
    cluster.node.kill(NS, fuse, "fuse", signal.SIGKILL)
    cluster.wait_for(
        lambda: (
            container_state(cluster, fuse, "fuse").get("restartCount") == 1
            and container_state(cluster, fuse, "fuse").get("ready")
        ),
        "fuse restarted and ready",
        READY_TIMEOUT,
    )
    restarted_s = time.monotonic() - t0
    caught = cluster.client_result("client-1", timeout=120)
    assert caught["ok"] + caught["failed"] == 8, caught
    assert caught["max_s"] <= TIMEOUT + 3, f"a request outlived its timeout: {caught}"
    last = container_state(cluster, fuse, "fuse").get("lastState") or {}
    assert last.get("terminated", {}).get("exitCode") == 128 + signal.SIGKILL, last
    after = cluster.run_client("client-2", doc, requests=3)
    assert after["ok"] == 3, after
    left = segments(cluster, fuse, "fuse")
    assert len(left) == 1, f"the restarted role reclaims its killed predecessor's pool: {left}"
    line.append(
        f"kill -9 fuse: restarted and Ready in {restarted_s:.1f} s, in flight ok "
        f"{caught['ok']} failed {caught['failed']} (max {caught['max_s']} s, timeout "
        f"{TIMEOUT:.0f} s), then ok {after['ok']}/3, pool segments in the pod {len(left)}"
    )

    # delete a pod: the StatefulSet controller recreates it
    ingest = f"{NAME}-ingest-0"
    old_uid = (cluster.k8s.get("v1/pods", ingest, NS) or {})["metadata"]["uid"]
    t0 = time.monotonic()
    cluster.kubectl("delete", "pod", ingest, "--wait=false")

    def recreated_ready() -> bool:
        pod = cluster.k8s.get("v1/pods", ingest, NS) or {"metadata": {}}
        if pod["metadata"].get("uid") in (None, old_uid):
            return False
        ip = (pod.get("status") or {}).get("podIP")
        slice_ = (
            cluster.k8s.get("discovery.k8s.io/v1/endpointslices", f"{NAME}-ingest-node", NS) or {}
        )
        ready = [
            a
            for e in slice_.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready")
            for a in e["addresses"]
        ]
        return ip in ready

    cluster.wait_for(recreated_ready, "ingest-0 recreated and Ready", READY_TIMEOUT)
    recreated_s = time.monotonic() - t0
    after = cluster.run_client("client-3", doc, requests=3)
    assert after["ok"] == 3, after
    line.append(f"delete pod: recreated and Ready in {recreated_s:.1f} s, then ok {after['ok']}/3")

    # cut fuse's network: requests time out (in time), then work again once restored
    cluster.node.cut(NS, fuse)
    try:
        cut = cluster.run_client("client-4", doc, requests=2, timeout=TIMEOUT)
    finally:
        cluster.node.restore(NS, fuse)
    assert cut["failed"] == 2, cut
    assert all("timed out" in e for e in cut["errors"]), cut
    assert cut["max_s"] <= TIMEOUT + 3, cut
    cluster.wait_for(lambda: cluster.ready(NAME), "Ready after the cut", READY_TIMEOUT)
    after = cluster.run_client("client-5", doc, requests=3)
    assert after["ok"] == 3, after
    line.append(
        f"cut network: {cut['failed']}/2 timed out (max {cut['max_s']} s, timeout "
        f"{TIMEOUT:.0f} s), then ok {after['ok']}/3"
    )

    # kill -9 the operator (its pod's container: the node restarts it) : no duplicate
    # children, still Ready
    before = children_uids(cluster)
    restarts = cluster.operator_restarts() if cluster.operator_pod else 0
    t0 = time.monotonic()
    cluster.kill_operator()
    if cluster.operator_pod:
        cluster.wait_for(
            lambda: cluster.operator_restarts() == restarts + 1 and cluster.operator_ready(),
            "the operator container restarted and Ready",
            90,
        )
    else:
        time.sleep(5.0)
    back_s = time.monotonic() - t0
    time.sleep(5.0)  # a resumed operator reconciles every pipeline at once
    assert cluster.operator_running(), "the operator runs again"
    assert children_uids(cluster) == before, "same children, none duplicated or replaced"
    assert cluster.ready(NAME)
    after = cluster.run_client("client-6", doc, requests=2)
    assert after["ok"] == 2, after
    where = "pod container" if cluster.operator_pod else "process"
    line.append(
        f"operator {where} killed, back in {back_s:.1f} s: {len(before)} children unchanged, ok 2/2"
    )
    assert cluster.denied() == [], "the operator made no call its RBAC refuses"

    cluster.kubectl("delete", "disaggregatedpipeline", NAME)
    cluster.wait_for(lambda: not cluster.children(NAME), "children gone", 60)
    figures("scenario 3 fan-out: " + "; ".join(line))
