"""The operator under a slow and failing API server: the emulator holds each of the
operator's requests 100-300 ms and fails 5 % of them (429 with Retry-After, 500, 504 after a
stall). Every pipeline still converges (children and status), the failures are retried
(the operator's counters show them), the log has no ERROR lines (a retried request is a
WARNING), and liveness answers throughout. The test's own requests are not slowed down."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

from prometheus_client.parser import text_string_to_metric_families

from tests.integration import operator_support as s
from tests.integration.test_operator_process import fetch
from tests.k8s.faults import Faults
from tests.k8s.server import EmulatorThread
from tests.support import free_port

PIPELINES = 12
CONVERGE = 180.0  # seconds: generous, the machine is shared


def reconciled(k8s: EmulatorThread, name: str) -> bool:
    pipeline = k8s.get(s.PIPELINES, name, s.NS)
    if pipeline is None:
        return False
    observed = (pipeline.get("status") or {}).get("observedGeneration")
    wanted = s.planned_children(s.example())
    return observed == pipeline["metadata"]["generation"] and len(s.children(k8s, name)) == wanted


def failures_seen(text: str) -> dict[str, float]:
    """The operator's requests by outcome (its own client and kopf's)."""
    outcomes: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "disagg_operator_api_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels["outcome"]
                    outcomes[key] = outcomes.get(key, 0.0) + sample.value
    return outcomes


def test_the_operator_converges_under_latency_and_errors(
    k8s: EmulatorThread, kubeconfig: pathlib.Path, tmp_path: pathlib.Path, disagg_crd
):
    k8s.apply_file(disagg_crd)
    faults = Faults(
        latency=(0.1, 0.3),
        error_rate=0.05,
        stall=0.5,
        user_agents=("disagg-operator", "kopf"),
        rng=random.Random(20),
    )
    k8s.call(setattr, k8s.emulator, "faults", faults)
    liveness, metrics = free_port(), free_port()
    log_path = tmp_path / "operator.log"
    argv = [
        sys.executable,
        "-m",
        "disagg_runtime.cli",
        "operator",
        "--standalone",
        f"--namespace={s.NS}",
        f"--liveness-port={liveness}",
        f"--metrics-port={metrics}",
        "--log-level=warning",
    ]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    probes: list[bool] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.wait(1.0):
            probes.append(fetch(f"http://127.0.0.1:{liveness}/healthz") is not None)

    with log_path.open("w") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        prober = threading.Thread(target=probe, daemon=True)
        try:
            k8s.wait_for(
                lambda: fetch(f"http://127.0.0.1:{liveness}/healthz") or process.poll(),
                60,
                0.2,
                "liveness",
            )
            assert process.poll() is None, log_path.read_text()
            prober.start()
            names = [f"slow-{i}" for i in range(PIPELINES)]
            for name in names:
                doc = s.example()
                doc["metadata"]["name"] = name
                k8s.create(doc, s.NS)
            started = time.monotonic()
            k8s.wait_for(
                lambda: all(reconciled(k8s, n) for n in names), CONVERGE, 0.5, "convergence"
            )
            took = time.monotonic() - started
            outcomes = failures_seen(fetch(f"http://127.0.0.1:{metrics}/metrics") or "")
            stop.set()
            prober.join(timeout=5)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            stop.set()
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    output = log_path.read_text()
    injected = k8s.call(lambda: dict(faults.injected))
    print(f"{PIPELINES} pipelines converged in {took:.1f} s; injected {injected}; {outcomes}")
    assert injected["delayed"] > 100 and sum(injected[c] for c in ("429", "500", "504")) > 0
    # the operator saw the failures and retried them (and converged: above)
    assert sum(v for k, v in outcomes.items() if k in ("429", "500", "504")) > 0
    # no error storm: retried failures are warnings; liveness never failed
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert errors == [], "\n".join(errors[:20])
    assert "Traceback" not in output, output[-3000:]
    assert probes and all(probes), probes
