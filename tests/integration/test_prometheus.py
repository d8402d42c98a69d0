"""The generated dashboard and rules against a real Prometheus (Debian's `prometheus`).

One scenario per module (`scenario`, ~1 min): a local pipeline (the processes and gateway
`disagg up --serve` runs) and an operator metrics endpoint, scraped every second by a
Prometheus of the test's own (tmp data dir, loopback port) loaded with a copy of the
generated rules whose alerts fire at once (``for: 0s``, 15 s windows). Traffic: plain and
streamed requests, requests that fail (5xx), a stranger knocking on a role's ingress
(peer refusals), a burst of slow requests that fills `back`'s 2 MiB pool. Then `front` is
stopped (SIGSTOP: scrapes time out) until no replica answers. Every panel of the checked-in
dashboard JSON must return data, and every alert must fire.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import zmq

from disagg_core.spec import load_pipeline_file
from disagg_operator.reconcile.metrics import Metrics
from disagg_runtime.gateway.app import Settings
from disagg_runtime.gateway.server import gateway_for
from disagg_runtime.local.supervisor import LocalPipeline
from disagg_runtime.observe import catalog, dashboard, rules
from disagg_runtime.observe.generate import DASHBOARD, RULES
from disagg_runtime.relay import protocol as proto
from tests.integration.prometheus_server import PROMTOOL, Prometheus, free_port, missing
from tests.integration.test_gateway import Served
from tests.support import wait_until

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WINDOW = "15s"
ALERTS = (
    "DisaggPoolFull",
    "DisaggNoReadyReplica",
    "DisaggPeerRefusalsRising",
    "DisaggGateway5xx",
    "DisaggRolloutStalled",
)
pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))


def body(i: int, **extra: Any) -> dict[str, Any]:
    x = torch.full((64 * 1024,), float(i))  # 256 KiB: staged in the pools
    data = base64.b64encode(x.numpy().tobytes()).decode()
    tensor = {"dtype": "float32", "shape": [x.numel()], "data": data}
    return {"inputs": {"x": tensor, "i": i, "n": 2, **extra}}


def knock(endpoint: str, times: int) -> None:
    """A stranger's reservations on a role's ingress: refused, counted as peer refusals."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for i in range(times):
            sock.send(proto.pack("reserve", rid=f"x{i}", xid=i, nbytes=1024, wait_s=1))
            if sock.poll(5000):
                sock.recv()
    finally:
        sock.close(linger=0)


@dataclass
class Scenario:
    prometheus: Prometheus
    local: LocalPipeline
    url: str
    seen: dict[str, float] = field(default_factory=dict)  # alert -> seconds until it fired
    # alert -> its labels when first seen firing (a 15 s window's alert may resolve later)
    labels: dict[str, dict[str, str]] = field(default_factory=dict)


class Traffic:
    """Requests in the background for as long as the scenario runs (rates need them)."""

    def __init__(self, url: str, tick: Callable[[], None]) -> None:
        self.url, self.tick, self.stop = url, tick, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            i = 0
            while not self.stop.is_set():
                i += 1
                self.tick()
                try:
                    http.post(f"{self.url}/v1/infer", json=body(i))
                    with http.stream(
                        "POST",
                        f"{self.url}/v1/infer",
                        json=body(i),
                        headers={"Accept": "text/event-stream"},
                    ) as r:
                        for _ in r.iter_lines():
                            pass
                    http.post(f"{self.url}/v1/infer", json=body(i, fail=True))
                except httpx.HTTPError:
                    pass  # front is stopped at the end: requests time out then
                self.stop.wait(0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


def _burst(url: str, count: int) -> None:
    """Slow streamed requests at once: each holds its 256 KiB in back's pool meanwhile."""

    def one(i: int) -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{url}/v1/infer", json=body(i, n=4, chunk_sleep=1.0), timeout=60)

    with ThreadPoolExecutor(count) as pool:
        list(pool.map(one, range(count)))


def _operator_metrics() -> tuple[Callable[[], None], Callable[[], None], int]:
    """An operator's metrics endpoint, and what records a reconcile of each kind into it
    (called with each round of traffic)."""
    metrics = Metrics()
    metrics.count_pipelines(lambda: 1.0)

    def reconciled() -> None:
        metrics.duration.labels(kind="spec").observe(0.02)
        metrics.errors.labels(kind="spec", reason="Conflict").inc()
        metrics.api_request("operator")("patch", "statefulsets", "200")
        metrics.scaled("default", "itest-observe", "back", 1, 2, "occupancy")
        roles = [{"name": "back", "desired": 2, "ready": 2, "updated": 1}]
        metrics.observed("default", "itest-observe", roles, "Stalled")  # a held rollout

    port = free_port()
    return reconciled, metrics.serve(port, "127.0.0.1"), port


def _wait_firing(scenario: Scenario, name: str, timeout: float) -> None:
    t0 = time.monotonic()

    def check() -> bool:
        _seen(scenario, t0)
        return name in scenario.seen

    try:
        wait_until(check, timeout, f"alert {name} firing", interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {scenario.prometheus.diagnose()}") from None


def _provoke(scenario: Scenario, ingress: str, timeout: float) -> None:
    """Strangers' knocks and bursts of slow requests until the pool, refusal and 5xx alerts
    have fired (the background traffic fails a third of its requests: 5xx)."""
    prom, t0 = scenario.prometheus, time.monotonic()
    wanted = ("DisaggPoolFull", "DisaggPeerRefusalsRising", "DisaggGateway5xx")
    while not all(name in scenario.seen for name in wanted):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(
                f"not fired within {timeout} s: {wanted} (fired: "
                f"{scenario.seen}); {prom.diagnose()}"
            )
        knock(ingress, 3)
        burst = threading.Thread(target=_burst, args=(scenario.url, 24), daemon=True)
        burst.start()
        while burst.is_alive():
            _seen(scenario, t0)
            time.sleep(0.5)
        _seen(scenario, t0)


def _seen(scenario: Scenario, t0: float) -> None:
    for name, labels in scenario.prometheus.firing().items():
        scenario.seen.setdefault(name, round(time.monotonic() - t0, 1))
        scenario.labels.setdefault(name, labels)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), old]))
    workdir = tmp_path_factory.mktemp("prometheus")
    local = LocalPipeline(load_pipeline_file(HERE / "pipelines" / "observe.yaml"), grace_s=5)
    stack: list[Callable[[], None]] = [local.stop]
    try:
        local.start()
        local.wait_ready(timeout=60)
        client = local.client()
        stack.append(client.close)
        served = Served(gateway_for(client, Settings(pipeline="itest-observe")))
        stack.append(served.close)
        reconciled, stop_operator, operator_port = _operator_metrics()
        stack.append(stop_operator)
        pipeline = local.pipeline.name
        roles = [
            (
                f"127.0.0.1:{rp.config.metrics_port}",
                {rules.COMPONENT_LABEL: "role", "pipeline": pipeline, "role": rp.config.role},
            )
            for rp in local.processes
        ]
        jobs: dict[str, list[tuple[str, dict[str, str]]]] = {
            "disagg-roles": roles,
            "disagg-gateway": [
                (
                    served.url.removeprefix("http://"),
                    {rules.COMPONENT_LABEL: "gateway", "pipeline": pipeline},
                )
            ],
            "disagg-operator": [(f"127.0.0.1:{operator_port}", {})],
        }
        fast = rules.rules(catalog.catalog(), pending="0s", window=WINDOW)
        prom = Prometheus(workdir, jobs, json.dumps(fast))
        stack.append(prom.stop)
        prom.wait_ready()
        traffic = Traffic(served.url, reconciled)
        stack.append(traffic.close)
        scenario = Scenario(prom, local, served.url)
        wait_until(
            lambda: len(prom.query("up == 1")) == len(roles) + 2,
            30,
            "every target up",
            interval=0.5,
        )
        front = next(rp for rp in local.processes if rp.config.role == "front")
        back = next(rp for rp in local.processes if rp.config.role == "back")
        _provoke(scenario, f"tcp://127.0.0.1:{back.config.ingress_port}", 120)
        os.kill(front.proc.pid, signal.SIGSTOP)  # alive but silent: scrapes time out
        try:
            _wait_firing(scenario, "DisaggNoReadyReplica", 30)
        finally:
            os.kill(front.proc.pid, signal.SIGCONT)
        everyone = len(roles) + 2
        wait_until(
            lambda: len(prom.query("up == 1")) == everyone,
            60,
            "every target up again",
            interval=0.5,
        )
        with contextlib.suppress(AssertionError):  # the test names the panels still empty
            wait_until(lambda: not _empty(prom), 30, "every panel has data", interval=0.5)
        yield scenario
    finally:
        for stop in reversed(stack):
            stop()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def panel_queries() -> list[tuple[str, str]]:
    return dashboard.queries(json.loads((REPO / DASHBOARD).read_text()))


def _empty(prom: Prometheus) -> list[tuple[str, str]]:
    return [
        (title, expr)
        for title, expr in panel_queries()
        if not prom.query(dashboard.instantiate(expr, WINDOW))
    ]


def test_every_panel_of_the_checked_in_dashboard_returns_data(scenario: Scenario) -> None:
    empty = _empty(scenario.prometheus)
    assert not empty, f"panels without data: {empty}"
    assert len(panel_queries()) >= 30


def test_every_alert_fires_in_the_scenario_that_provokes_it(scenario: Scenario) -> None:
    assert set(scenario.seen) == set(ALERTS), scenario.seen
    assert scenario.labels["DisaggGateway5xx"].get("pipeline") == "itest-observe"
    assert scenario.labels["DisaggNoReadyReplica"].get("role") == "front"


def test_the_recording_rules_have_data(scenario: Scenario) -> None:
    for rule in rules.rules(catalog.catalog(), window=WINDOW)["groups"][0]["rules"]:
        if "record" in rule:
            assert scenario.prometheus.query(rule["record"]), rule["record"]


def test_the_shipped_rules_pass_promtool(tmp_path: Path) -> None:
    fast = tmp_path / "fast.rules.yaml"
    groups = rules.rules(catalog.catalog(), pending="0s", window=WINDOW)
    fast.write_text(json.dumps(groups))
    count = len(groups["groups"][0]["rules"])
    assert count == 4 + len(ALERTS)  # the recording rules, then every alert
    for path in (REPO / RULES, fast):
        result = subprocess.run(
            [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"SUCCESS: {count} rules found" in result.stdout, result.stdout
