"""The operator's occupancy autoscaler, end to end: the real operator (kopf, in this event
loop) against the emulator, with real `disagg role` processes on loopback as the pods.

The test plays the StatefulSet controller and the kubelet (`Kubelet`): it keeps a
`LocalPipeline`'s replicas at each StatefulSet's spec.replicas and mirrors every live
replica as a Pod (podIP 127.0.0.1, Ready, its container ports set to the process's real
ports), so the operator lists pods, scrapes real /metrics and scales real processes. Role
processes import `pipeline_handlers` by name: this folder goes on PYTHONPATH.
Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from disagg_core import spec
from disagg_operator import names
from disagg_operator.app import main
from disagg_operator.autoscaling import scaling as autoscaling
from disagg_runtime.local.supervisor import LocalPipeline
from tests.integration import operator_support as s
from tests.k8s.server import EmulatorThread

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
HERE = Path(__file__).resolve().parent
NAME = "scaled"
NS = s.NS
SLOW_STS = f"{NAME}-slow"
PODS = "v1/pods"
BIG = 64 * 1024  # float32 elements: 256 KiB per request, staged in the receive pools
IN_FLIGHT = 16  # requests kept in flight: ~half of slow's 8 MiB pool while it has 1 replica
SCALE_WAIT = 25.0


def pipeline_doc(*, scale_down_s: int = 2, external: str | None = None) -> dict[str, Any]:
    """a -> slow -> b; `slow` sleeps payload["sleep"] per request and autoscales."""
    doc = s.pipeline_doc(
        NAME,
        [
            {"name": "a", "handler": "pipeline_handlers:identity"},
            {
                "name": "slow",
                "handler": "pipeline_handlers:slow",
                "autoscaling": {
                    "minReplicas": 1,
                    "maxReplicas": 3,
                    "targetPoolOccupancy": 0.2,
                    "tolerance": 0.1,
                    "scaleUpStabilizationSeconds": 0,
                    "scaleDownStabilizationSeconds": scale_down_s,
                },
            },
            {"name": "b", "handler": "pipeline_handlers:identity"},
        ],
        [{"from": "a", "to": "slow"}, {"from": "slow", "to": "b"}],
    )
    doc["spec"]["transport"] = {"poolSize": "8Mi", "minBlock": "64Ki", "requestTimeoutSeconds": 20}
    if external is not None:
        doc["metadata"]["annotations"] = {names.ANNOTATION_EXTERNAL_SCALING: external}
    return doc


@pytest.fixture
def k8s_crd(k8s: EmulatorThread, disagg_crd: Any) -> Iterator[EmulatorThread]:
    """The emulator with the CRD; afterwards the operator's calls (pods list included) must
    be in operator_rbac_observed.json."""
    k8s.apply_file(disagg_crd)
    yield k8s
    missing = s.observed_rbac(k8s) - s.recorded_rbac()
    assert not missing, f"calls missing from {s.RBAC_FILE.name}: {missing}"
    assert ("", "pods", "list") in s.recorded_rbac()


@contextlib.asynccontextmanager
async def operator(k8s: EmulatorThread, *, interval: float = 0.5) -> AsyncIterator[main.Operator]:
    """The operator with a short autoscaling interval until the block ends."""
    config = main.OperatorConfig(
        liveness_port=0,
        metrics_port=0,
        standalone=True,
        connection=k8s.connection_info(),
        autoscale_interval=interval,
        scrape_timeout=1.0,
    )
    built = main.build(config)
    try:
        async with s.run(built):
            yield built
    finally:
        assert not built.scaler.running


def sts_replicas(k8s: EmulatorThread, name: str = SLOW_STS) -> int | None:
    sts = k8s.get(s.STS, name, NS)
    return None if sts is None else (sts.get("spec") or {}).get("replicas")


def decisions(k8s: EmulatorThread) -> list[dict[str, Any]]:
    return list(s.pipeline_status(k8s, NAME).get(autoscaling.STATUS_DECISIONS) or [])


# ---------------------------------------------------------------------------- the kubelet


class Kubelet:
    """Keeps `local`'s replicas at the StatefulSets' spec.replicas and mirrors them as Pods."""

    def __init__(self, k8s: EmulatorThread, local: LocalPipeline) -> None:
        self.k8s = k8s
        self.local = local
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-kubelet", daemon=True)

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the kubelet thread did not stop"

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self.sync()
            except BaseException as error:  # surfaced by the test
                self.errors.append(error)
                return

    def sync(self) -> None:
        selector = f"{names.LABEL_PIPELINE}={NAME}"
        for sts in self.k8s.list(s.STS, NS, selector):
            unit = sts["metadata"]["labels"][names.LABEL_ROLE]
            wanted = int(sts["spec"].get("replicas", 1))
            if len(self.local.live(unit)) != wanted:
                self.local.scale(unit, wanted, ready_timeout=20)
            self._mirror(sts, unit)

    def _mirror(self, sts: dict[str, Any], unit: str) -> None:
        name = sts["metadata"]["name"]
        live = {f"{name}-{rp.config.replica}": rp for rp in self.local.live(unit)}
        selector = f"{names.LABEL_PIPELINE}={NAME},{names.LABEL_ROLE}={unit}"
        pods = {p["metadata"]["name"] for p in self.k8s.list(PODS, NS, selector)}
        for gone in sorted(pods - set(live)):
            self.k8s.delete(PODS, gone, NS)
        for pod_name in sorted(set(live) - pods):
            config = live[pod_name].config
            self.k8s.create(pod(sts, pod_name, config.ingress_port, config.metrics_port), NS)
            ready = {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
            self.k8s.patch_status(PODS, pod_name, ready, NS)
        count = len(live)
        observed = {
            "observedGeneration": sts["metadata"]["generation"],
            "replicas": count,
            "readyReplicas": count,
            "updatedReplicas": count,
            "availableReplicas": count,
        }
        if {k: (sts.get("status") or {}).get(k) for k in observed} != observed:
            self.k8s.patch_status(s.STS, name, observed, NS)


def pod(sts: dict[str, Any], name: str, ingress: int, metrics: int) -> dict[str, Any]:
    """A pod of `sts` whose container ports are the local process's real ones."""
    template = copy.deepcopy(sts["spec"]["template"])
    (container,) = template["spec"]["containers"]
    container["ports"] = [
        {"name": "ingress", "containerPort": ingress, "protocol": "TCP"},
        {"name": "metrics", "containerPort": metrics, "protocol": "TCP"},
    ]
    owner = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": sts["metadata"]["name"],
        "uid": sts["metadata"]["uid"],
        "controller": True,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": template["metadata"]["labels"],
            "ownerReferences": [owner],
        },
        "spec": {"containers": [container]},
    }


# ---------------------------------------------------------------------------- load


class Load:
    """Keeps IN_FLIGHT requests in the pipeline until stopped; counts the outcomes."""

    def __init__(self, local: LocalPipeline) -> None:
        self.client = local.client(timeout=20)
        self.done = 0
        self.failed: list[BaseException] = []
        self._slots = threading.Semaphore(IN_FLIGHT)
        self._stop = threading.Event()
        self._pending: set[Future[Any]] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="test-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 25.0) -> None:
        """Stop submitting and wait for the requests in flight."""
        self._stop.set()
        self._thread.join(timeout=timeout)
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self._pending, f"{len(self._pending)} requests still in flight"

    def close(self) -> None:
        self._stop.set()
        self.client.close()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            if not self._slots.acquire(timeout=0.1):
                continue
            i += 1
            payload = {"x": torch.full((BIG,), float(i)), "i": i, "sleep": 0.2}
            future = self.client.submit_async(payload, timeout=20)
            with self._lock:
                self._pending.add(future)
            future.add_done_callback(self._finished)

    def _finished(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)
        error = future.exception()
        if error is None:
            self.done += 1
        else:
            self.failed.append(error)
        self._slots.release()


@pytest.fixture
def local(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalPipeline]:
    """The pipeline's role processes, as `disagg up` would start them (1 replica each)."""
    paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    pipeline = LocalPipeline(spec.parse_pipeline(pipeline_doc()), grace_s=5.0)
    with pipeline:
        pipeline.wait_ready(30)
        yield pipeline


# ---------------------------------------------------------------------------- tests


async def test_a_slow_role_is_scaled_up_under_load_and_back_down_after_the_window(
    k8s_crd: EmulatorThread, local: LocalPipeline
):
    k8s = k8s_crd
    events: list[tuple[str, str, str]] = []
    async with operator(k8s) as op:
        post = op.reconciler.post_event

        def recording(body: Any, type_: str, reason: str, message: str) -> None:
            events.append((type_, reason, message))
            post(body, type_, reason, message)

        op.reconciler.post_event = recording
        await s.call(k8s.create, pipeline_doc(), NS)
        with Kubelet(k8s, local) as kubelet:
            await s.until(
                k8s, lambda: s.pipeline_status(k8s, NAME).get("phase") == "Ready", "Ready", 15
            )
            assert sts_replicas(k8s) == 1
            assert decisions(k8s) == [], "no decision while idle"

            load = Load(local)
            try:
                load.start()
                await s.until(
                    k8s, lambda: (sts_replicas(k8s) or 0) > 1, "slow scaled up", SCALE_WAIT
                )
                await s.until(k8s, lambda: decisions(k8s), "a decision in the status")
                up = decisions(k8s)[0]
                assert (up["role"], up["fromReplicas"]) == ("slow", 1)
                assert up["toReplicas"] > 1
                assert up["occupancy"] > 0.2 * 1.1 and "scale up" in up["reason"]
                await s.until(
                    k8s,
                    lambda: ("Normal", autoscaling.EVENT_SCALED_UP) in s.event_reasons(k8s, NAME),
                    "a ScaledUp Event",
                )
                status = s.pipeline_status(k8s, NAME)
                latest = decisions(k8s)[-1]["toReplicas"]
                assert status[autoscaling.STATUS_REPLICAS] == {"slow": latest}
                # the kubelet starts the replicas, and the new pods take load
                await s.until(
                    k8s,
                    lambda: len(local.live("slow")) == sts_replicas(k8s),
                    "new slow replicas running",
                    SCALE_WAIT,
                )
                await asyncio.sleep(1.0)
                under_load = decisions(k8s)
                await asyncio.to_thread(load.stop)
            finally:
                await asyncio.to_thread(load.close)
            assert load.failed == [], load.failed[:3]
            assert load.done > 0
            assert all(d["toReplicas"] > 1 for d in under_load), "no scale-down under load"

            await s.until(k8s, lambda: sts_replicas(k8s) == 1, "slow scaled down", SCALE_WAIT)
            await s.until(
                k8s, lambda: decisions(k8s)[-1]["toReplicas"] == 1, "the decision in the status"
            )
            down = decisions(k8s)[-1]
            assert (down["role"], down["toReplicas"]) == ("slow", 1)
            assert "scale down" in down["reason"]
            await s.until(
                k8s,
                lambda: ("Normal", autoscaling.EVENT_SCALED_DOWN) in s.event_reasons(k8s, NAME),
                "a ScaledDown Event",
            )
            await s.until(k8s, lambda: len(local.live("slow")) == 1, "extra replicas stopped")
            assert kubelet.errors == []
        # only slow was ever scaled, and every decision is in the status and an Event
        assert {d["role"] for d in decisions(k8s)} == {"slow"}
        assert [r for _, r, _ in events if r.startswith("Scaled")] == [
            "ScaledUp" if d["toReplicas"] > d["fromReplicas"] else "ScaledDown"
            for d in decisions(k8s)
        ]
        assert sts_replicas(k8s, f"{NAME}-a") == sts_replicas(k8s, f"{NAME}-b") == 1


async def test_a_restart_resumes_from_the_autoscaled_replicas(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    await s.call(k8s.create, pipeline_doc(), NS)
    recorded = {autoscaling.STATUS_REPLICAS: {"slow": 3}}
    await s.call(k8s.patch_status, s.PIPELINES, NAME, recorded, NS)
    async with operator(k8s, interval=0):  # no scaling: only the resume is under test
        await s.until(k8s, lambda: sts_replicas(k8s) is not None, "the StatefulSet")
        assert sts_replicas(k8s) == 3, "resumed, not snapped back to spec.replicas"
        assert sts_replicas(k8s, f"{NAME}-a") == 1


async def test_the_forced_apply_wins_over_a_manual_scale_of_an_autoscaled_role(
    k8s_crd: EmulatorThread,
):
    k8s = k8s_crd
    async with operator(k8s, interval=0):
        await s.call(k8s.create, pipeline_doc(), NS)
        await s.until(k8s, lambda: sts_replicas(k8s) == 1, "the StatefulSet")
        scale = {"spec": {"replicas": 5}}
        await s.call(k8s.patch, s.STS, SLOW_STS, scale, NS, subresource="scale")
        assert sts_replicas(k8s) == 5
        touch = {"metadata": {"labels": {"touched": "yes"}}}  # any change: a reconcile
        await s.call(k8s.patch, s.PIPELINES, NAME, touch, NS)
        await s.until(k8s, lambda: sts_replicas(k8s) == 1, "the operator's count back")


async def test_external_scaling_leaves_spec_replicas_to_the_hpa(k8s_crd: EmulatorThread):
    k8s = k8s_crd
    async with operator(k8s, interval=0.2) as op:
        await s.call(k8s.create, pipeline_doc(external="slow"), NS)
        await s.until(k8s, lambda: k8s.get(s.STS, SLOW_STS, NS) is not None, "the StatefulSet")
        stored = k8s.get(s.STS, SLOW_STS, NS)
        assert stored is not None and "replicas" not in stored["spec"]
        assert sts_replicas(k8s, f"{NAME}-a") == 1

        # the HPA scales through the scale subresource; reconciles leave its value alone
        scale = {"spec": {"replicas": 4}}
        await s.call(k8s.patch, s.STS, SLOW_STS, scale, NS, subresource="scale")
        touch = {"metadata": {"labels": {"touched": "yes"}}}
        await s.call(k8s.patch, s.PIPELINES, NAME, touch, NS)
        await s.until(k8s, lambda: op.reconciler.states.get((NS, NAME)) is not None, "state")
        await asyncio.sleep(1.0)  # reconciles and autoscaling steps
        assert sts_replicas(k8s) == 4
        state = op.reconciler.states[(NS, NAME)]
        assert state.replicas == {} and state.scaling is None, "nothing autoscaled"
        assert decisions(k8s) == []
