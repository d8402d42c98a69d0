"""`disagg operator` as its own process (the real entry point, credentials from KUBECONFIG):
it reconciles, serves liveness and metrics and stops on SIGTERM. (That it never imports torch
is an import-linter contract: `make lint`.)"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import urllib.error
import urllib.request

from tests.integration import operator_support as s
from tests.k8s.server import EmulatorThread
from tests.support import free_port

NAME = "text-to-video"
DISAGG = [sys.executable, "-m", "disagg_runtime.cli"]


def fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return str(response.read().decode())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def test_the_operator_process(k8s: EmulatorThread, kubeconfig: pathlib.Path, tmp_path, disagg_crd):
    k8s.apply_file(disagg_crd)
    liveness, metrics = free_port(), free_port()
    log = (tmp_path / "operator.log").open("w")
    argv = [
        "--standalone",
        "--all-namespaces",
        f"--liveness-port={liveness}",
        f"--metrics-port={metrics}",
        "--log-level=warning",
    ]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    process = subprocess.Popen(
        [*DISAGG, "operator", *argv],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        k8s.wait_for(
            lambda: fetch(f"http://127.0.0.1:{liveness}/healthz") or process.poll() is not None,
            30,
            0.1,
            "liveness",
        )
        assert process.poll() is None, (tmp_path / "operator.log").read_text()
        k8s.create(s.example(), s.NS)
        k8s.wait_for(lambda: len(s.children(k8s, NAME)) == 9, s.WAIT, message="children")
        k8s.wait_for(lambda: s.pipeline_status(k8s, NAME).get("phase"), s.WAIT, message="status")
        # the duration is observed when the reconcile returns, just after the status write
        spec_count = 'disagg_operator_reconcile_duration_seconds_count{kind="spec"}'
        k8s.wait_for(
            lambda: spec_count in (fetch(f"http://127.0.0.1:{metrics}/metrics") or ""),
            s.WAIT,
            message="the reconcile's duration",
        )
        text = fetch(f"http://127.0.0.1:{metrics}/metrics") or ""
        assert "disagg_operator_pipelines_managed 1.0" in text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        log.close()
    output = (tmp_path / "operator.log").read_text()
    assert "Traceback" not in output, output
