"""Scenario 2 of issue 13 on the test node: examples/slow-denoiser.yaml under load. The
operator, as the chart's pod (autoscaling every 2 s), scrapes the real /metrics of the real
denoiser pods from inside the cluster network and scales its StatefulSet up; the node starts
the new pods, they join through DNS and take requests; after the load the StatefulSet scales
back down. No request may fail; the figures line is recorded before the checks.

Pod IPs are reused, as a CNI does: a denoiser pod scaled away and another created later can
get the same address, so the encoder's cached relay to that address meets a new process.
Requests used to be lost there (its session was the old process's); the relay now sees its
connection lost and reconnects (relay/sender.py, PeerLost). The node hands addresses out
round robin, as host-local IPAM does: one reused at once was unreachable from pods holding a
stale neighbour entry for it (handshakes stalled ~60 s in the rollout scenario). Before that
change this scenario, with the operator pod, once lost 8 of 80 requests to decoder timeouts
(cause not pinned down; the same shape); none were lost in 6 runs after it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests.e2e_local.local_cluster import EXAMPLES, NS, LocalCluster, sample
from tests.k8s.node.network import can_create_namespaces

pytestmark = [pytest.mark.e2e_local, pytest.mark.timeout(600)]
NAME = "slow-denoiser"
STS = "apps/v1/statefulsets"
DENOISER = f"{NAME}-denoiser"
REQUESTS = 80  # ~40 s of denoising for one replica: new pods take ~20 s to be Ready
# the demo's tensor scale (1 MiB latents, not 10 MiB), for the client's inputs and, as the
# image's environment, for every pod: the roles read it from their own environment (the
# spec reserves DISAGG_ names), and at full scale the encoder and decoder, not the denoiser,
# are what is slow on a shared 2-core machine
IMAGE_ENV = {"DISAGG_DEMO_SCALE": "0.1"}


@pytest.fixture(scope="module")
def scaling_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    reason = can_create_namespaces()
    if reason is not None:
        pytest.skip(reason)
    cluster = LocalCluster(
        tmp_path_factory.mktemp("scaling"),
        operator_pod=True,  # the chart's pod: it scrapes the roles from inside the cluster
        operator_values={"operator": {"autoscaleIntervalSeconds": 2}},
        image_env=IMAGE_ENV,
    )
    try:
        yield cluster
    finally:
        left = cluster.close()
    assert not left, f"the node left these behind: {left}"


def replicas(cluster: LocalCluster) -> tuple[int, int]:
    sts = cluster.k8s.get(STS, DENOISER, NS) or {}
    spec = int((sts.get("spec") or {}).get("replicas", 0))
    return spec, int((sts.get("status") or {}).get("readyReplicas", 0))


def requests_done(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("disagg_requests_total{") and 'outcome="done"' in line
    )


def test_slow_denoiser_scales_up_under_load_and_back_down(
    scaling_cluster: LocalCluster, figures: Callable[[str], None]
) -> None:
    cluster = scaling_cluster
    doc = sample(NAME, EXAMPLES)
    cluster.kubectl("apply", "-f", str(EXAMPLES / f"{NAME}.yaml"))
    cluster.wait_for(lambda: cluster.ready(NAME), "Ready", 180)
    assert replicas(cluster) == (1, 1)

    history: list[int] = [1]
    served: dict[str, float] = {}  # denoiser pod -> requests it finished (highest seen)
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            spec, _ready = replicas(cluster)
            if spec != history[-1]:
                history.append(spec)
            for pod in cluster.k8s.list("v1/pods", NS, f"disagg.dev/pipeline={NAME}"):
                if pod["metadata"]["labels"].get("disagg.dev/role") != "denoiser":
                    continue
                with contextlib.suppress(OSError, KeyError, StopIteration):
                    done = requests_done(cluster.metrics(pod, "denoiser"))
                    name = pod["metadata"]["name"] + "/" + pod["metadata"]["uid"][:8]
                    served[name] = max(done, served.get(name, 0.0))
            time.sleep(1.0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = cluster.run_client(
            "load",
            doc,
            requests=REQUESTS,
            concurrency=8,
            timeout=60,
            env=IMAGE_ENV,
        )
        helped = sorted(name for name, done in served.items() if done > 0)
        figures(
            f"scenario 2 {NAME}: denoiser replicas over time "
            f"{' -> '.join(map(str, history))}, {len(helped)} denoiser pods served, requests "
            f"ok {result['ok']} failed {result['failed']} (p50 {result['p50_s']} s, max "
            f"{result['max_s']} s)"
        )
        errors = "\n".join(result["errors"])
        assert result["ok"] == REQUESTS and result["failed"] == 0, f"{result}\n{errors}"
        assert max(history) > 1, f"the denoiser never scaled up: {history}"
        # the replicas that joined (found through DNS) took requests
        assert len(helped) >= 2, f"one denoiser replica served: {served}, replicas {history}"
        cluster.wait_for(lambda: replicas(cluster)[0] == 1, "scaled back to 1", 120)
    finally:
        stop.set()
        watcher.join(5)
    cluster.kubectl("delete", "disaggregatedpipeline", NAME)
    cluster.wait_for(lambda: not cluster.children(NAME), "children gone", 60)
