"""Traces across real processes with the real OpenTelemetry SDK and OTLP/HTTP exporter:
examples/text-to-video.yaml (encoder -> 2 denoisers -> decoder, and a tensor reference
from the encoder to the decoder) as `disagg role` processes, the gateway in this process,
all exporting to an OTLP/HTTP receiver started here (bench/otlp_sink.py). And
`disagg up --trace` from the command line: the span file and the timelines it prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from disagg_core.spec import load_pipeline_file
from disagg_runtime.bench.otlp_sink import OtlpSink, ReceivedSpan
from disagg_runtime.gateway.app import Settings
from disagg_runtime.gateway.request import sample_body
from disagg_runtime.gateway.server import gateway_for
from disagg_runtime.local.supervisor import LocalPipeline
from disagg_runtime.role.health import fetch, scrape
from tests.integration.test_gateway import Served
from tests.support import EXAMPLES

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (OpenTelemetry) is needed")

T2V = EXAMPLES / "text-to-video.yaml"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
UNSAMPLED_TRACE = "5bf92f3577b34da6a3ce929d0e0e4736"
SERVER, CONSUMER = 2, 5  # OTLP span kinds
ROLES = ("encoder", "denoiser", "decoder")


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[list[ReceivedSpan], dict[str, dict[str, float]]]]:
    """Three requests through the gateway (a sampled client trace, a malformed
    traceparent, an unsampled one); then every process stopped, so all spans are in."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "DISAGG_DEMO_SCALE": "0.05",
    }
    before = {k: os.environ.get(k) for k in env}
    with OtlpSink() as sink:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint
        os.environ.update(env)
        try:
            local = LocalPipeline(load_pipeline_file(T2V), grace_s=5)
            local.start()
            try:
                local.wait_ready(timeout=90)
                client = local.client(timeout=60)
                gateway = gateway_for(client, Settings(pipeline="text-to-video", timeout=60))
                served = Served(gateway)
                try:
                    body = sample_body(str(T2V), 0)
                    headers = [
                        f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
                        "00-not-a-traceparent-01",
                        f"00-{UNSAMPLED_TRACE}-{CLIENT_SPAN}-00",
                    ]
                    for header in headers:
                        answer = httpx.post(
                            f"{served.url}/v1/infer",
                            content=body,
                            headers={"Content-Type": "application/json", "traceparent": header},
                            timeout=60,
                        )
                        assert answer.status_code == 200, answer.text
                    samples = {}
                    for rp in local.processes:
                        url = f"http://127.0.0.1:{rp.config.metrics_port}/metrics"
                        status, text = fetch(url, 5.0)
                        samples[rp.label] = scrape(text) if status == 200 else {}
                finally:
                    served.close()
                    client.close()
                    gateway.tracer.shutdown()
            finally:
                local.stop()  # each role flushes its spans as it stops
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        yield sink.received(), samples


def _trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def _tree_checks(spans: list[ReceivedSpan]) -> ReceivedSpan:
    """One trace: the gateway's span, then one role span per role, each the child of the
    span that sent to it, each with its queue, handler and send children. Returns the
    gateway's span."""
    (gateway,) = [s for s in spans if s.kind == SERVER]
    assert gateway.name == "POST /v1/infer" and gateway.service == "text-to-video/gateway"
    assert gateway.attributes["http.response.status_code"] == 200
    role = {s.name: s for s in spans if s.kind == CONSUMER}
    assert sorted(role) == sorted(ROLES), [s.name for s in spans]
    assert role["encoder"].parent_id == gateway.span_id
    assert role["denoiser"].parent_id == role["encoder"].span_id
    assert role["decoder"].parent_id == role["denoiser"].span_id  # the join's data input
    for name, span in role.items():
        assert span.service == f"text-to-video/{name}"
        children = sorted(
            s.name for s in spans if s.parent_id == span.span_id and s.kind != CONSUMER
        )
        sends = {
            "encoder": ["send decoder", "send denoiser"],  # the tensor reference, the data
            "denoiser": ["send decoder"],
            "decoder": ["send client"],
        }[name]
        assert children == sorted(["handler", "queue", *sends]), (name, children)
    sent = [s for s in spans if s.name.startswith("send ")]
    assert all(s.attributes["disagg.relay"] in ("shm", "tcp") for s in sent)
    assert all(s.attributes["disagg.bytes"] > 0 for s in sent)
    ids = {s.span_id for s in spans}
    assert all(s.parent_id in ids for s in spans if s is not gateway)  # nothing dangles
    return gateway


def test_one_request_is_one_trace_under_the_callers_span(traced) -> None:
    spans, _ = traced
    gateway = _tree_checks(_trace(spans, CLIENT_TRACE))
    assert gateway.parent_id == CLIENT_SPAN  # the client's traceparent is the parent


def test_a_malformed_traceparent_is_ignored_and_a_trace_started(traced) -> None:
    spans, _ = traced
    roots = [
        s for s in spans if s.kind == SERVER and s.trace_id not in (CLIENT_TRACE, UNSAMPLED_TRACE)
    ]
    (root,) = roots
    assert root.parent_id == ""
    _tree_checks(_trace(spans, root.trace_id))


def test_an_unsampled_traceparent_records_nothing_anywhere(traced) -> None:
    spans, _ = traced
    assert _trace(spans, UNSAMPLED_TRACE) == []
    assert len({s.trace_id for s in spans}) == 2


def test_queue_wait_is_measured_by_every_role(traced) -> None:
    _, samples = traced
    taken: dict[str, float] = {}
    for label, sample in samples.items():
        role = label.split("/")[0]
        taken[role] = taken.get(role, 0) + sample.get("disagg_queue_wait_seconds_count", 0)
    # per message a worker took: the decoder takes the data and the tensor reference
    assert taken == {"encoder": 3, "denoiser": 3, "decoder": 6}


def test_up_trace_writes_the_span_file_and_prints_the_slowest_timelines(tmp_path: Path) -> None:
    out = tmp_path / "spans.jsonl"
    env = {**os.environ, "DISAGG_DEMO_SCALE": "0.05"}
    env.pop("OTEL_TRACES_SAMPLER", None)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "disagg_runtime.cli",
            "up",
            str(T2V),
            "--requests",
            "4",
            "--trace",
            str(out),
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout)
    trace = summary["trace"]
    assert trace["file"] == str(out) and trace["requests"] == 4  # every one: always on
    assert trace["spans"] == 4 * (1 + 3 * 3 + 4)  # root; role, queue, handler; 4 sends
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == trace["spans"]
    assert {r["service"] for r in records} == {f"text-to-video/{n}" for n in ("client", *ROLES)}
    slowest = "\n".join(trace["slowest"])
    assert slowest.count("trace ") == 3 and all(role in slowest for role in ROLES)
    assert "queued" in slowest and "computing" in slowest and "moving" in slowest
