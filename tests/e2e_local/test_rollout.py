"""Issue 19 on the test node: a coordinated rollout under steady traffic, with revision
pairing. prefill (2 pods) -> decode (2 pods), both `compat: kv-1`, one rollout group with
maxSkew 0.5. While a client pod sends requests, prefill's image and both roles' compat
are changed together to kv-2 (a new prefill build with a new payload contract on both sides
of the edge; no engine has `local/prefill:kv-N`, so the node runs these pods from the test's
venv and the image string is what changes). The operator steps the StatefulSets'
partitions; the node replaces pods highest ordinal first.

Checks: the rollout completes; at every observed moment the two roles' updated fractions
(pods running kv-2, read from the pods' own DISAGG_COMPAT) differ by at most maxSkew; no
request crossed revisions (decode refuses a payload stamped by another revision:
pairing_handlers.py) and none failed. Senders roll first (rollout.py `feeds`): without that
rule decode could finish before prefill's last old pod, which then held requests with no
partner (1 of 400 timed out in 2 of 3 runs). Without the compat bump (REVISION changed
alone, pairing not engaged) the same scenario had 12 of 400 requests cross revisions.

Two more causes of lost requests (1-2 of 400 in 3 of 5 runs) are gone: a replaced pod now
says goodbye to its senders before it closes (role.py; an inline request sent to it while
it closed was lost), and the test node keeps a deleted pod until its containers stopped,
as a node does (before, its StatefulSet started the replacement beside the draining pod,
so the operator let the receiver's last old pod go while the old sender still drained).

The last one (1-2 of 400 timing out after 60 s, in some runs) was the test node's: it
gave a freed pod address to the next pod at once, and the pods that had talked to the gone
one kept a neighbour entry naming its MAC, so their handshakes to the new pod stalled until
the entry aged out (a new prefill's to a new decoder given the old decoder's address:
60 s). Addresses now go round robin (network.py `next_host`), as on a node; and the
runtime no longer waits a deadline out in one handshake (peers.CONNECT_S), a role with a
compat token is not ready before a replica pairs with it, and a draining role fails what
still waits for a partner instead of losing it."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e_local.local_cluster import NS, REPO, LocalCluster
from tests.k8s.node.network import can_create_namespaces

pytestmark = [pytest.mark.e2e_local, pytest.mark.timeout(900)]
NAME = "pairing"
HANDLERS = "tests.e2e_local.pairing_handlers"
MAX_SKEW = 0.5  # spec.rollout.maxSkew "50%"


def prefill_image(token: str) -> str:
    return f"local/prefill:{token}"


def pipeline(token: str, name: str = NAME, replicas: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "image": "local",
            "transport": {"poolSize": "8Mi", "minBlock": "64Ki", "requestTimeoutSeconds": 60},
            "rollout": {"maxSkew": f"{MAX_SKEW:.0%}", "groups": [["prefill", "decode"]]},
            "roles": [
                {
                    "name": role,
                    "handler": f"{HANDLERS}:{role}",
                    "replicas": replicas,
                    # no engine has these images (the node runs the test's venv): a new
                    # image string is what a new prefill build would be to the operator
                    **({"image": prefill_image(token)} if role == "prefill" else {}),
                    "compat": token,
                    "env": [{"name": "REVISION", "value": token}],
                    "startupSeconds": 120,
                }
                for role in ("prefill", "decode")
            ],
            "edges": [{"from": "prefill", "to": "decode"}],
        },
    }


@pytest.fixture(scope="module")
def rollout_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    reason = can_create_namespaces()
    if reason is not None:
        pytest.skip(reason)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), old]))  # the handlers
    try:
        # the chart's operator pod (as test_autoscaling): the pods' handlers are the tests'
        # own, so the node runs these `image: local` pods from the venv with PYTHONPATH
        cluster = LocalCluster(tmp_path_factory.mktemp("rollout"), operator_pod=True)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old
    try:
        yield cluster
    finally:
        left = cluster.close()
    assert not left, f"the node left these behind: {left}"


def fractions(
    cluster: LocalCluster, token: str, mismatched: list[str] | None = None
) -> dict[str, float]:
    """Per role, the share of its pods that run `token` (read from the pods' own env);
    prefill pods whose image is not their token's go to `mismatched`."""
    mismatched = [] if mismatched is None else mismatched
    counts: dict[str, list[int]] = {"prefill": [0, 0], "decode": [0, 0]}
    for pod in cluster.pods(NAME):
        role = pod["metadata"]["labels"].get("disagg.dev/role")
        if role not in counts or pod["metadata"].get("deletionTimestamp"):
            continue
        container = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if role == "prefill" and container["image"] != prefill_image(env["DISAGG_COMPAT"]):
            mismatched.append(f"{pod['metadata']['name']}: {container['image']} runs {env}")
        counts[role][0] += env.get("DISAGG_COMPAT") == token
        counts[role][1] += 1
    return {role: new / total if total else 0.0 for role, (new, total) in counts.items()}


def test_rollout_under_traffic_never_crosses_revisions(
    rollout_cluster: LocalCluster, figures: Callable[[str], None]
) -> None:
    cluster = rollout_cluster
    cluster.kubectl.apply([pipeline("kv-1")])
    cluster.wait_for(lambda: cluster.ready(NAME), "Ready", 240)

    client_doc = copy.deepcopy(pipeline("kv-1"))
    client_doc["spec"]["roles"][0]["handler"] = "prefill"  # demo.sample_input's entry name
    cluster.run_client("warm", client_doc, requests=4, timeout=60)  # the pairs serve at all
    cluster.run_client(
        "steady", client_doc, requests=400, concurrency=2, pause=0.25, timeout=60, wait=False
    )

    observed: list[dict[str, float]] = []
    mismatched: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            observed.append(fractions(cluster, "kv-2", mismatched))
            stop.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        cluster.wait_for(lambda: cluster.k8s.get("v1/pods", "steady", NS), "client pod", 30)
        cluster.kubectl.apply([pipeline("kv-2")])

        def rolled() -> bool:
            status = (cluster.pipeline(NAME) or {}).get("status") or {}
            phase = (status.get("rollout") or {}).get("phase")
            return phase == "Complete" and fractions(cluster, "kv-2") == {
                "prefill": 1.0,
                "decode": 1.0,
            }

        cluster.wait_for(rolled, "the rollout to kv-2 to complete", 600)
        cluster.wait_for(lambda: cluster.ready(NAME), "Ready after the rollout", 120)
    finally:
        stop.set()
        watcher.join(timeout=10)
    result = cluster.client_result("steady", timeout=400)
    skew = max(abs(f["prefill"] - f["decode"]) for f in observed)
    steps = sorted({(f["prefill"], f["decode"]) for f in observed})
    figures(
        f"rollout kv-1 -> kv-2 (prefill 2 + decode 2, maxSkew {MAX_SKEW}) under traffic: "
        f"requests ok={result['ok']} failed={result['failed']} p50={result['p50_s']}s "
        f"max={result['max_s']}s; max observed skew {skew:.2f}; (prefill, decode) updated "
        f"fractions seen {steps}"
    )
    assert skew <= MAX_SKEW + 1e-9, steps
    assert not mismatched, mismatched[:3]  # the image and the compat token went together
    assert result["ok"] + result["failed"] == 400
    # none crossed revisions (decode refuses such a request: it would fail) and none failed
    assert result["failed"] == 0, result["errors"]
    cluster.kubectl("delete", "disaggregatedpipeline", NAME)
    cluster.wait_for(lambda: not cluster.children(NAME), "children gone", 90)


def live_pods(cluster: LocalCluster, name: str) -> tuple[int, int]:
    """(prefill, decode) pods of pipeline `name` that are not being deleted."""
    counts = {"prefill": 0, "decode": 0}
    for pod in cluster.pods(name):
        role = pod["metadata"]["labels"].get("disagg.dev/role")
        if role in counts and not pod["metadata"].get("deletionTimestamp"):
            counts[role] += 1
    return counts["prefill"], counts["decode"]


def pod_lines(cluster: LocalCluster, name: str, client_log: list[str]) -> list[str]:
    """The lines of every role pod's log (all restarts) naming a request the client log
    lines name: where a failed request went, for the diagnosis."""
    import re

    rids = {r for line in client_log for r in re.findall(r"[0-9a-f]{32}", line)}
    found = []
    for pod in cluster.pods(name):
        role = pod["metadata"]["labels"].get("disagg.dev/role")
        if not role or not rids:
            continue
        text = cluster.node.logs(NS, pod["metadata"]["name"], role)
        found += [
            f"{pod['metadata']['name']}: {x}"
            for x in text.splitlines()
            if any(r in x for r in rids)
        ]
    return found[:200]


def settled(cluster: LocalCluster, name: str, replicas: int) -> bool:
    """Every role's StatefulSet asks for `replicas`, has that many Ready, and no other pod
    of the pipeline is left (a scaled-away pod is gone once its drain ended)."""
    for role in ("prefill", "decode"):
        sts = cluster.k8s.get("apps/v1/statefulsets", f"{name}-{role}", NS) or {}
        spec = int((sts.get("spec") or {}).get("replicas", -1))
        ready = int((sts.get("status") or {}).get("readyReplicas", 0))
        if spec != replicas or ready != replicas:
            return False
    return len([p for p in cluster.pods(name) if "disagg.dev/role" in p["metadata"]["labels"]]) == (
        2 * replicas
    )


UPDOWN = "updown"
UPDOWN_REQUESTS = 600  # ~120 s at one request every 0.2 s: outlasts the down and the up


def test_scale_down_then_up_under_load_loses_nothing(
    rollout_cluster: LocalCluster, figures: Callable[[str], None]
) -> None:
    """Both roles 2 -> 1 -> 2 replicas while a client sends steadily: the removed pods
    (highest ordinal) stop taking work, drain and go (runtime.py: readiness drops, the
    senders re-resolve, goodbye, what was handed back is resent), the new ones join through
    DNS. The old loss (8 of 80 in a down-then-up under load) must not come back.

    What a scale-down does here, as on a node: the operator lowers the StatefulSets'
    replicas; the StatefulSet controller deletes the highest ordinal; the pod, terminating,
    leaves its EndpointSlice (so the Service name stops listing it); the kubelet sends
    SIGTERM (no preStop; terminationGracePeriodSeconds the default 30 s) and the role
    stops being ready, keeps receiving until its senders re-resolved the name
    (RESOLVE_EVERY + 1 s), says goodbye, serves what crossed it, hands back what it cannot
    finish, and exits; only then does the pod go. Both down-steps settle in 13-15 s."""
    cluster = rollout_cluster
    cluster.kubectl.apply([pipeline("kv-1", UPDOWN)])
    cluster.wait_for(lambda: cluster.ready(UPDOWN), "Ready", 240)
    client_doc = copy.deepcopy(pipeline("kv-1", UPDOWN))
    client_doc["spec"]["roles"][0]["handler"] = "prefill"  # demo.sample_input's entry name
    cluster.run_client("updown-warm", client_doc, requests=4, timeout=60)
    cluster.run_client(
        "updown-steady",
        client_doc,
        requests=UPDOWN_REQUESTS,
        concurrency=2,
        pause=0.2,
        timeout=60,
        wait=False,
    )
    seen: list[tuple[float, tuple[int, int]]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def watch() -> None:
        while not stop.is_set():
            pods = live_pods(cluster, UPDOWN)
            if not seen or seen[-1][1] != pods:
                seen.append((time.monotonic() - t0, pods))
            stop.wait(0.5)

    def client_running() -> bool:
        pod = cluster.k8s.get("v1/pods", "updown-steady", NS) or {}
        return (pod.get("status") or {}).get("phase") == "Running"

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        cluster.wait_for(client_running, "the client pod running", 60)
        time.sleep(5.0)  # requests flowing through 2 + 2
        cluster.kubectl.apply([pipeline("kv-1", UPDOWN, replicas=1)])
        cluster.wait_for(lambda: settled(cluster, UPDOWN, 1), "scaled down to 1 + 1", 180)
        down_s = time.monotonic() - t0
        time.sleep(5.0)  # requests flowing through 1 + 1
        cluster.kubectl.apply([pipeline("kv-1", UPDOWN, replicas=2)])
        cluster.wait_for(lambda: settled(cluster, UPDOWN, 2), "scaled up to 2 + 2", 180)
        up_s = time.monotonic() - t0
        under_load = client_running()
    finally:
        stop.set()
        watcher.join(timeout=10)
    result = cluster.client_result("updown-steady", timeout=600)
    steps = " -> ".join(f"{p}+{d} ({t:.0f} s)" for t, (p, d) in seen)
    figures(
        f"scale down then up (prefill + decode 2 -> 1 -> 2) under traffic: requests "
        f"ok={result['ok']} failed={result['failed']} p50={result['p50_s']}s "
        f"max={result['max_s']}s; down settled at {down_s:.0f} s, up at {up_s:.0f} s; "
        f"live pods {steps}"
    )
    assert under_load, f"the client finished before the scale-up settled: {result}"
    assert result["ok"] + result["failed"] == UPDOWN_REQUESTS, result
    assert result["failed"] == 0, result["errors"]
    cluster.kubectl("delete", "disaggregatedpipeline", UPDOWN)
    cluster.wait_for(lambda: not cluster.children(UPDOWN), "children gone", 90)


KILL = "kill"
KILL_REQUESTS = 500  # ~60 s at one request every 0.1 s (two in flight): outlasts the restart


def kill_pipeline() -> dict[str, Any]:
    """prefill (1) -> middle (2 replicas) -> decode (1), no revision pairing."""
    doc = pipeline("kv-1", KILL)
    prefill, decode = doc["spec"]["roles"]
    middle = {**copy.deepcopy(decode), "name": "middle", "handler": f"{HANDLERS}:middle"}
    for role in (prefill, middle, decode):
        role.pop("compat")
        role["replicas"] = 2 if role is middle else 1
    doc["spec"]["roles"] = [prefill, middle, decode]
    doc["spec"]["edges"] = [{"from": "prefill", "to": "middle"}, {"from": "middle", "to": "decode"}]
    doc["spec"].pop("rollout")
    return doc


@pytest.mark.xfail(
    strict=False,
    reason=(
        "issue 31, open: 1 of 500 requests timed out in 3 of 4 runs (h31b), and in 1 of 3 "
        "after aborts got their own thread; 0 of 500 in 4 of 4 runs of h31's session "
        "(middle-1 had served 1-9 requests when killed: the kill rarely catches one). "
        "Prefill reported it lost at the kill; the client did not act on the report in "
        "time (cause not found: a failure now shows when prefill's report went out and "
        "whether it reached the client after the request ended)"
    ),
)
def test_kill_9_of_one_of_two_middle_replicas_under_load_fails_nothing(
    rollout_cluster: LocalCluster, figures: Callable[[str], None]
) -> None:
    """kill -9 of middle-1 while a client sends steadily: what it held is reported lost
    by prefill (its connection died: routing/inflight.py) and resent whole by the client
    (nothing of it had come back: routing/migration.py), so none fails; the container is
    restarted, Ready again, and takes requests."""
    cluster = rollout_cluster
    doc = kill_pipeline()
    cluster.kubectl.apply([doc])
    cluster.wait_for(lambda: cluster.ready(KILL), "Ready", 240)
    client_doc = copy.deepcopy(doc)
    client_doc["spec"]["roles"][0]["handler"] = "prefill"  # demo.sample_input's entry name
    cluster.run_client("kill-warm", client_doc, requests=4, timeout=60)
    cluster.run_client(
        "kill-steady", client_doc, requests=KILL_REQUESTS, concurrency=2, pause=0.1,
        timeout=30, wait=False,
    )  # fmt: skip
    victim = f"{KILL}-middle-1"

    def state() -> dict[str, Any]:
        pod = cluster.k8s.get("v1/pods", victim, NS) or {}
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
        return dict(statuses[0])

    def served(pod_name: str) -> float:
        pod = cluster.k8s.get("v1/pods", pod_name, NS)
        assert pod is not None, pod_name
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in cluster.metrics(pod, "middle").splitlines()
            if line.startswith("disagg_requests_total{") and 'outcome="done"' in line
        )

    def client_running() -> bool:
        pod = cluster.k8s.get("v1/pods", "kill-steady", NS) or {}
        return (pod.get("status") or {}).get("phase") == "Running"

    cluster.wait_for(client_running, "the client pod running", 60)
    time.sleep(5.0)  # requests flowing through both middle replicas
    before = served(victim)
    t0 = time.monotonic()
    cluster.node.kill(NS, victim, "middle", signal.SIGKILL)
    cluster.wait_for(
        lambda: state().get("restartCount") == 1 and state().get("ready"),
        "middle-1 restarted and Ready",
        180,
    )
    back_s = time.monotonic() - t0
    under_load = client_running()
    result = cluster.client_result("kill-steady", timeout=600)
    after = cluster.run_client("kill-after", client_doc, requests=40, concurrency=4, timeout=30)
    took = served(victim)  # the restarted process's own count: since it came back
    last = (state().get("lastState") or {}).get("terminated") or {}
    figures(
        f"kill -9 of middle-1 (of 2) under traffic: requests ok={result['ok']} "
        f"failed={result['failed']} p50={result['p50_s']}s max={result['max_s']}s; it had "
        f"served {before:.0f}, back and Ready in {back_s:.1f} s, then served {took:.0f} "
        f"since it came back (a later client: {after['ok']}/40 ok)"
    )
    assert last.get("exitCode") == 128 + signal.SIGKILL, last
    assert under_load, f"the client finished before middle-1 was back: {result}"
    assert result["ok"] + result["failed"] == KILL_REQUESTS, result
    # nothing streams here: every request had streamed nothing when it was caught
    assert result["failed"] == 0, (result, pod_lines(cluster, KILL, result.get("log") or []))
    assert after["ok"] == 40, after
    assert took > 0, "the restarted replica took no requests"
    cluster.kubectl("delete", "disaggregatedpipeline", KILL)
    cluster.wait_for(lambda: not cluster.children(KILL), "children gone", 90)
