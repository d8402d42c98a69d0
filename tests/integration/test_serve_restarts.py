"""`disagg up --serve` supervises: kill -9 of one of two replicas of a middle role under
steady load through the gateway fails none of the requests (none of them had streamed
anything: what the dead replica held moves to the live one), the gateway stays up, the
replica is started again after its back-off and takes traffic, and the run's summary says
what was restarted. Real processes, real HTTP (httpx), one run for the module."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections import Counter

import httpx
import torch

from disagg_runtime.local.supervisor import remove_segments_of
from tests.integration.test_up import PIPELINES, disagg, ready, role_children, role_env, samples
from tests.support import wait_for

LOAD_THREADS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _body(i: int) -> dict[str, object]:
    x = torch.full((1024,), float(i))
    data = base64.b64encode(x.numpy().tobytes()).decode()
    return {"inputs": {"x": {"dtype": "float32", "shape": [1024], "data": data}, "sleep": 0.05}}


def _middle(up: subprocess.Popen[bytes], replica: str) -> tuple[int, str] | None:
    """(pid, metrics port) of middle replica `replica`, if it runs."""
    for pid, env in role_children(up.pid).items():
        if env.get("DISAGG_ROLE") == "middle" and env.get("DISAGG_REPLICA") == replica:
            return pid, env["DISAGG_METRICS_PORT"]
    return None


def _done(port: str) -> float:
    return sum(
        v for k, v in samples(int(port)).items() if k == 'disagg_requests_total{outcome="done"}'
    )


def test_a_killed_middle_replica_is_restarted_and_no_request_fails() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    up = subprocess.Popen(
        [*disagg(), "up", str(PIPELINES / "serve-kill.yaml"), "--serve", "--port", str(port)],
        env=role_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    children: set[int] = set()
    statuses: Counter[str] = Counter()
    stop = threading.Event()

    def load(seed: int) -> None:
        with httpx.Client(timeout=30.0) as http:
            i = 0
            while not stop.is_set():
                try:
                    r = http.post(f"{url}/v1/infer", json=_body(seed * 100_000 + i))
                    statuses[str(r.status_code) if r.status_code != 200 else "ok"] += 1
                    if r.status_code != 200:
                        statuses[f"{r.status_code}: {r.text[:200]}"] += 1
                except httpx.HTTPError as exc:
                    statuses[f"{type(exc).__name__}: {exc}"] += 1
                i += 1

    threads = [threading.Thread(target=load, args=(s,), daemon=True) for s in range(LOAD_THREADS)]
    try:
        wait_for(lambda: _gateway_ready(url), 90, interval=0.25, message="gateway ready")
        children.update(role_children(up.pid))
        for thread in threads:
            thread.start()
        time.sleep(2.0)
        found = _middle(up, "1")
        assert found is not None
        killed, metrics_port = found
        before = statuses["ok"]
        os.kill(killed, signal.SIGKILL)
        # started again (a new pid), ready, and taking traffic
        wait_for(
            lambda: (m := _middle(up, "1")) is not None and m[0] != killed and ready(m[1]),
            60,
            interval=0.2,
            message="middle/1 restarted and ready",
        )
        children.update(role_children(up.pid))
        took = _done(metrics_port)
        wait_for(
            lambda: _done(metrics_port) > took + 5, 30, interval=0.2, message="new middle/1 serves"
        )
        assert up.poll() is None  # the gateway stayed up
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=40)
        up.send_signal(signal.SIGINT)
        try:
            _, err = up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            _, err = up.communicate(timeout=10)
        for pid in children:  # leave nothing behind, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            remove_segments_of(pid)
    stderr = err.decode(errors="replace")
    failed = {k: n for k, n in statuses.items() if k != "ok"}
    assert statuses["ok"] > before + 50, (statuses, stderr[-2000:])
    assert not failed, (failed, stderr[-2000:])
    assert "role middle/1 was restarted 1 time(s)" in stderr, stderr[-2000:]
    assert up.returncode == 0, stderr[-2000:]
    moved = re.search(r"(\d+) request\(s\) moved to a live replica", stderr)
    assert moved is not None and int(moved[1]) >= 1, stderr[-2000:]  # it held some


def _gateway_ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200
    return False
