"""The autoscaler on engine roles: the engines' own signals (KV cache usage, waiting
requests) read from the engine's /metrics, named in the decision and its reason."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from disagg_core import autoscale, spec
from disagg_core.autoscale import ENGINE_SIGNALS, Autoscaler, Policy, Sample
from disagg_operator import names
from disagg_operator.autoscaling import podmetrics
from disagg_operator.autoscaling import scaling as autoscaling
from disagg_operator.plan import planner

Obj = dict[str, Any]
NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)


def vllm_exposition(usage: list[float], waiting: list[float], *, old_name: bool = False) -> str:
    """What vLLM 0.32's server exposes (vllm/v1/metrics/loggers.py): a gauge per engine
    core, labelled model_name and engine, beside series the autoscaler ignores."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    kv_name = "vllm:gpu_cache_usage_perc" if old_name else "vllm:kv_cache_usage_perc"
    kv = Gauge(kv_name, "KV-cache usage. 1 means 100 percent usage.", labels, registry=registry)
    wait = Gauge("vllm:num_requests_waiting", "Requests waiting.", labels, registry=registry)
    running = Gauge("vllm:num_requests_running", "Requests running.", labels, registry=registry)
    for engine, (u, w) in enumerate(zip(usage, waiting, strict=True)):
        kv.labels("tiny", str(engine)).set(u)
        wait.labels("tiny", str(engine)).set(w)
        running.labels("tiny", str(engine)).set(9)
    return generate_latest(registry).decode()


def test_parse_reads_the_engines_signals() -> None:
    assert podmetrics.parse(vllm_exposition([0.4], [3])) == autoscaling.Reading(0.4, 3)
    # data parallel: the fullest core's cache, every core's waiting requests
    assert podmetrics.parse(vllm_exposition([0.2, 0.9], [1, 2])) == autoscaling.Reading(0.9, 3)
    assert podmetrics.parse(vllm_exposition([0.5], [0], old_name=True)) == (
        autoscaling.Reading(0.5, 0)
    )
    assert podmetrics.parse("vllm:num_requests_waiting 3\n") is None, "no KV usage"
    assert podmetrics.parse('vllm:kv_cache_usage_perc{engine="0"} NaN\n') is None


def engine_doc() -> Obj:
    return {
        "apiVersion": names.PIPELINE_API_VERSION,
        "kind": names.PIPELINE_KIND,
        "metadata": {"name": "pd", "namespace": "ns", "uid": "u"},
        "spec": {
            "image": "img:1",
            "roles": [
                {"name": "prefill", "engine": {"kind": "vllm", "model": "/m"}},
                {
                    "name": "decode",
                    "replicas": 2,
                    "engine": {"kind": "vllm", "model": "/m"},
                    "autoscaling": {
                        "minReplicas": 1,
                        "maxReplicas": 6,
                        "targetPoolOccupancy": 0.5,
                        "targetQueuePerReplica": 2,
                    },
                },
            ],
            "edges": [{"from": "prefill", "to": "decode", "kind": "kv"}],
            "gateway": {"api": "openai", "model": "tiny"},
        },
    }


def test_an_engine_unit_scales_on_the_engines_signals() -> None:
    plan = autoscaling.scaling_plan(spec.parse_pipeline(engine_doc()))
    policy = plan.policies["decode"]
    assert policy.names == ENGINE_SIGNALS and policy.target_queue == 2
    scaler = Autoscaler(plan.policies)
    full = [Sample(f"d{i}", 0.9, queue_depth=1, at=0.0) for i in range(2)]
    decision = scaler.decide(0.0, {"decode": 2}, {"decode": full})["decode"]
    assert (decision.desired, decision.signal) == (4, "kv-cache")
    assert "KV cache usage 0.90 vs target 0.50" in decision.reason
    assert "waiting requests 1.0/replica vs target 2" in decision.reason
    queued = [Sample(f"d{i}", 0.3, queue_depth=6, at=1.0) for i in range(2)]
    decision = scaler.decide(1.0, {"decode": 2}, {"decode": queued})["decode"]
    assert (decision.desired, decision.signal) == (6, "waiting")
    assert decision.reason.endswith("scale up on waiting")
    record = autoscaling.decision_record(decision, NOW, 0.3)
    assert record["signal"] == "waiting" and "waiting requests" in record["reason"]


def test_without_a_waiting_target_waiting_requests_block_scale_down() -> None:
    policy = Policy(min_replicas=1, max_replicas=4, names=ENGINE_SIGNALS, scale_down_window_s=0)
    samples = [Sample("d0", 0.1, queue_depth=2, at=0.0), Sample("d1", 0.1, at=0.0)]
    raw, reason, signal = autoscale.recommend(policy, 2, samples, 0.0, 30.0)
    assert (raw, signal) == (2, "waiting") and "waiting requests block scale-down" in reason
    raw, reason, _ = autoscale.recommend(policy, 2, [], 0.0, 30.0)
    assert raw == 2 and reason.startswith("no fresh engine samples")


def test_handler_units_keep_the_pool_signals(full_doc: Obj) -> None:
    plan = autoscaling.scaling_plan(spec.parse_pipeline(full_doc))
    assert plan.policies and all(p.names == autoscale.POOL_SIGNALS for p in plan.policies.values())


def test_engine_pods_are_scraped_on_the_engine_port() -> None:
    pipeline = spec.parse_pipeline(engine_doc())
    plan = autoscaling.scaling_plan(pipeline)
    sts = next(
        obj
        for obj in planner.plan(pipeline, namespace="ns")
        if obj["kind"] == "StatefulSet" and obj["metadata"]["name"] == "pd-decode"
    )
    pod = {
        "metadata": {"name": "pd-decode-0", "labels": {names.LABEL_ROLE: "decode"}},
        "spec": sts["spec"]["template"]["spec"],
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    (view,) = autoscaling.pod_views([pod], plan)["decode"]
    assert view.urls == ("http://10.1.2.3:8000/metrics",)
    second = {"name": "decode", "ports": [{"name": "engine-1", "containerPort": 8001}]}
    assert autoscaling.metrics_port(second) == 8001


@pytest.mark.asyncio
async def test_the_scraper_reads_an_engines_metrics_endpoint_bounded() -> None:
    """An HTTP server answering as vLLM's /metrics does; an oversized body reads as None."""
    text = vllm_exposition([0.75], [5])

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/plain")

    async def huge(_: web.Request) -> web.Response:
        return web.Response(body=b"#" * (podmetrics.MAX_BODY + 1))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/huge", huge)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    scraper = podmetrics.Scraper(timeout=1.0)
    try:
        good, big = f"http://127.0.0.1:{port}/metrics", f"http://127.0.0.1:{port}/huge"
        assert await scraper.read_all([good, big]) == {
            good: autoscaling.Reading(0.75, 5),
            big: None,
        }
    finally:
        await scraper.close()
        await runner.cleanup()
