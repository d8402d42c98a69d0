"""Handler classes in real roles (in-process roles, real relays and sockets): setup before
live/ready, args from the spec, close on stop, batches with per-request errors."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from disagg_core import contract
from disagg_core.contract import Peer
from disagg_core.spec import parse_pipeline
from disagg_runtime.client import Client, RequestFailed
from disagg_runtime.local import ports, supervisor
from disagg_runtime.role.handler import Handler, SetupContext
from disagg_runtime.role.health import fetch, scrape
from disagg_runtime.role.runtime import RoleRuntime
from tests.relay_rig import KEY, write_key


class Scaler:
    """Multiplies x by args.scale; records its lifecycle; fails requests with fail=True."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.events: list[str] = []
        self.batches: list[int] = []

    def setup(self, ctx: SetupContext) -> None:
        self.gate.wait(10)
        self.scale = float(ctx.args["scale"])
        self.events.append("setup")

    def batch(self, payloads: list[dict[str, Any]]) -> list[Any]:
        self.batches.append(len(payloads))
        time.sleep(0.05)  # a model's forward pass: requests pile up behind it
        return [
            ValueError(f"bad request {p['i']}") if p.get("fail") else {"y": p["x"] * self.scale}
            for p in payloads
        ]

    def close(self) -> None:
        self.events.append("close")


def _doc(batch: int) -> dict[str, Any]:
    role: dict[str, Any] = {
        "name": "model",
        "handler": "unused:Scaler",
        "handlerArgs": {"scale": 3},
        "concurrency": 8,
    }
    if batch > 1:
        role["batching"] = {"maxBatchSize": batch, "maxWaitMilliseconds": 20}
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "itest-lifecycle"},
        "spec": {"image": "local", "transport": {"poolSize": "8Mi"}, "roles": [role]},
    }


def _status(port: int, path: str) -> int:
    try:
        return fetch(f"http://127.0.0.1:{port}{path}", 2.0)[0]
    except OSError:
        return -1


@pytest.fixture
def role() -> Any:
    workdir = tempfile.mkdtemp(prefix="disagg-it-")
    topology_file = os.path.join(workdir, "topology.json")
    pipeline = parse_pipeline(_doc(8))
    [config] = supervisor.plan_local(pipeline, ports.free_ports(), topology_file)
    config = dataclasses.replace(config, peer_key_file=write_key(workdir))
    contract.write_topology(config.topology, topology_file)
    handler = Handler(Scaler)
    running = RoleRuntime(config, handler=handler, grace_s=2.0)
    yield running, handler.target
    running.stop(grace_s=0)


@pytest.mark.timeout(120)
def test_setup_gates_probes_then_batches_fail_alone_and_close_runs(role: Any) -> None:
    running, model = role
    starter = threading.Thread(target=running.start)
    starter.start()
    port = running.config.metrics_port
    deadline = time.monotonic() + 10
    while _status(port, "/healthz") == -1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _status(port, "/healthz") == 503 and _status(port, "/readyz") == 503  # setting up
    model.gate.set()
    starter.join(10)
    assert _status(port, "/healthz") == 200 and _status(port, "/readyz") == 200
    client = Client(
        [Peer("model", (f"127.0.0.1:{running.config.ingress_port}",))],
        ["model"],
        pipeline="itest-lifecycle",
        pool_size=8 << 20,
        timeout=30,
        key=KEY,
    )
    try:
        payloads = [{"x": torch.full((4,), float(i)), "i": i, "fail": i == 5} for i in range(16)]
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(client.submit, p) for p in payloads]
        for i, future in enumerate(futures):
            if i == 5:
                with pytest.raises(RequestFailed, match="bad request 5"):
                    future.result()
            else:
                assert torch.equal(future.result()["y"], torch.full((4,), 3.0 * i))
    finally:
        client.close()
    assert len(model.batches) < 16 and max(model.batches) <= 8 and sum(model.batches) == 16
    samples = scrape(running.metrics.render().decode())
    assert samples["disagg_handler_calls_total"] == len(model.batches)
    assert samples["disagg_role_setup_seconds"] > 0
    running.stop(grace_s=2)
    assert model.events == ["setup", "close"]
