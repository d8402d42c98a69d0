"""Traces: the W3C traceparent rules, the envelope's trace field, the OTEL_* reading, a
role's spans on the real OpenTelemetry SDK (in-memory exporter), the span file and the
timelines read back from it."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from disagg_runtime import tracing
from disagg_runtime.observe import timeline
from disagg_runtime.relay import Message
from disagg_runtime.role.spans import MAX_SENDS, RoleSpans
from disagg_runtime.tracing.config import TraceConfig, TracingConfigError, from_env
from disagg_runtime.tracing.otel import OtelTracer
from disagg_runtime.tracing.spanfile import SpanFileExporter
from disagg_runtime.wire import envelope, tracecontext
from disagg_runtime.wire.envelope import Meta, Reply

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{PARENT}-01"


# ---- W3C traceparent ----------------------------------------------------------------------------
def test_a_valid_traceparent_parses_and_prints_back() -> None:
    parsed = tracecontext.parse(GOOD)
    assert parsed == tracecontext.TraceParent(int(TRACE, 16), int(PARENT, 16), 1)
    assert parsed.sampled and parsed.header() == GOOD
    assert tracecontext.valid(GOOD) == GOOD and tracecontext.sampled(GOOD)
    unsampled = f"00-{TRACE}-{PARENT}-00"
    assert tracecontext.valid(unsampled) == unsampled and not tracecontext.sampled(unsampled)
    assert tracecontext.valid(f" {GOOD}\t") == GOOD  # optional whitespace around the value


@pytest.mark.parametrize(
    "value",
    [
        "",
        None,
        42,
        GOOD.upper(),  # hex must be lower-case
        f"00-{'0' * 32}-{PARENT}-01",  # all-zero trace-id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent-id
        f"ff-{TRACE}-{PARENT}-01",  # version ff is invalid
        f"00-{TRACE}-{PARENT}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE}-{PARENT}-1",
        f"00-{TRACE[:-1]}-{PARENT}-01",
        f"00_{TRACE}_{PARENT}_01",
        f"cc-{TRACE}-{PARENT}-01x",  # a later version's extra fields follow a dash
        GOOD + "-" + "a" * 300,  # longer than any traceparent
        "garbage",
    ],
)
def test_a_malformed_traceparent_is_ignored(value: object) -> None:
    assert tracecontext.parse(value) is None
    assert tracecontext.valid(value) == ""


def test_a_later_version_is_read_by_its_first_four_fields() -> None:
    later = f"cc-{TRACE}-{PARENT}-01-what-comes-next"
    assert tracecontext.valid(later) == GOOD


# ---- the envelope --------------------------------------------------------------------------------
def meta(**changes: object) -> Meta:
    return Meta("r1", "data", "encoder", 1e12, Reply("tcp://127.0.0.1:1", "tcp")).with_(**changes)


def test_the_trace_rides_in_the_envelope_only_when_set() -> None:
    assert "trace" not in meta().to_json()
    traced = meta(trace=GOOD)
    assert traced.to_json()["trace"] == GOOD
    assert envelope.parse(json.loads(json.dumps(traced.to_json()))) == traced
    assert envelope.parse(meta().to_json()).trace == ""


@pytest.mark.parametrize("bad", ["nonsense", 7, None, ["x"], GOOD.upper(), GOOD + "x" * 500])
def test_a_malformed_trace_in_an_envelope_is_dropped_not_an_error(bad: object) -> None:
    """A bad traceparent must not fail the request (W3C: ignore it); the rest still parses."""
    parsed = envelope.parse({**meta().to_json(), "trace": bad})
    assert parsed.trace == "" and parsed.rid == "r1"


# ---- OTEL_* --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "exporters"),
    [
        ({}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ("otlp", "console")),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, ()),
        ({"OTEL_TRACES_EXPORTER": "none", "DISAGG_TRACE_FILE": "/tmp/x"}, ("file",)),
        ({"DISAGG_TRACE_FILE": "/tmp/x", "OTEL_SDK_DISABLED": "true"}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_SDK_DISABLED": "TRUE"}, ()),
    ],
)
def test_tracing_is_on_only_when_something_collects(
    env: dict[str, str], exporters: tuple[str, ...]
) -> None:
    config = from_env(env, service="p/encoder")
    assert config.exporters == exporters and config.enabled == bool(exporters)


def test_service_name_and_sampler_follow_the_environment() -> None:
    assert from_env({}, service="p/encoder").service == "p/encoder"
    named = from_env({"OTEL_SERVICE_NAME": "mine"}, service="p/encoder")
    assert named.service == "mine" and named.default_sampler
    assert not from_env({"OTEL_TRACES_SAMPLER": "always_on"}, service="s").default_sampler


def test_an_unknown_exporter_is_named() -> None:
    with pytest.raises(TracingConfigError, match="OTEL_TRACES_EXPORTER: 'zipkin'"):
        from_env({"OTEL_TRACES_EXPORTER": "zipkin"}, service="s")


def test_off_is_the_no_op_tracer_which_passes_the_parent_on() -> None:
    tracer = tracing.open_tracer("s", env={})
    assert tracer is tracing.NOOP and not tracer.enabled
    span = tracer.start("x", parent=GOOD)
    assert span.traceparent == GOOD and not span.recording


def test_asked_for_without_the_sdk_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "disagg_runtime.tracing.otel", None)  # import fails
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    with pytest.raises(tracing.TracingUnavailable, match=r"pip install 'disagg\[tracing\]'"):
        tracing.open_tracer("s", env=env, strict=True)
    with caplog.at_level(logging.WARNING):
        assert tracing.open_tracer("s", env=env) is tracing.NOOP
    assert "disagg[tracing]" in caplog.text and "otlp exporter" in caplog.text
    assert not tracing.available()


# ---- a role's spans on the SDK -------------------------------------------------------------------
@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch) -> tuple[OtelTracer, InMemorySpanExporter]:
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    tracer = OtelTracer(TraceConfig(service="p/encoder"), {"disagg.role": "encoder"})
    exporter = InMemorySpanExporter()
    tracer.provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tracer, exporter


def message(received_at: float, nbytes: int = 100) -> Message:
    return Message("r1", None, nbytes, None, received_at)


def test_a_role_visit_is_a_span_under_the_sender_with_queue_handler_and_send(sdk) -> None:
    tracer, exporter = sdk
    spans = RoleSpans(tracer, "encoder", 0)
    t0 = time.monotonic()
    visit = spans.begin(meta(trace=GOOD), [message(t0 - 0.010)], t0)
    assert visit is not None
    out = meta(trace=visit.span.traceparent)
    visit.handled(t0 + 0.020)
    spans.sent(out, "denoiser", t0 + 0.020, "shm", 4096)
    spans.end(visit)
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    assert set(by_name) == {"encoder", "queue", "handler", "send denoiser"}
    role = by_name["encoder"]
    assert role.context.trace_id == int(TRACE, 16)
    assert role.parent is not None and role.parent.span_id == int(PARENT, 16)
    assert role.parent.is_remote
    for child in ("queue", "handler", "send denoiser"):
        assert by_name[child].parent.span_id == role.context.span_id
        assert by_name[child].context.trace_id == int(TRACE, 16)
    assert out.trace == f"00-{TRACE}-{role.context.span_id:016x}-01"
    queued = by_name["queue"]
    assert 0.009 < (queued.end_time - queued.start_time) / 1e9 < 0.5  # arrival -> taken
    assert role.start_time == queued.start_time  # the visit starts at the arrival
    send = by_name["send denoiser"]
    assert send.attributes["disagg.relay"] == "shm" and send.attributes["disagg.bytes"] == 4096
    assert role.attributes["disagg.request_id"] == "r1"
    assert role.resource.attributes["service.name"] == "p/encoder"


def test_a_failure_marks_the_role_span_and_sends_past_the_cap_are_counted(sdk) -> None:
    tracer, exporter = sdk
    spans = RoleSpans(tracer, "decoder", 1)
    visit = spans.begin(meta(trace=GOOD), [message(time.monotonic())], time.monotonic())
    assert visit is not None
    out = meta(trace=visit.span.traceparent)
    for _ in range(MAX_SENDS + 5):
        spans.sent(out, "client", time.monotonic(), "tcp", 10)
    spans.failed(out, "handler", "ValueError: boom")
    spans.end(visit)
    spans.sent(out, "client", time.monotonic(), "tcp", 10)  # after the end: nothing
    finished = exporter.get_finished_spans()
    assert sum(s.name == "send client" for s in finished) == MAX_SENDS
    (role,) = [s for s in finished if s.name == "decoder"]
    assert role.status.description == "ValueError: boom"
    assert role.attributes["disagg.sends"] == MAX_SENDS + 5
    assert role.attributes["disagg.failure"] == "handler"


def test_untraced_and_unsampled_messages_record_nothing(sdk) -> None:
    tracer, exporter = sdk
    spans = RoleSpans(tracer, "encoder", 0)
    now = time.monotonic()
    assert spans.begin(meta(), [message(now)], now) is None
    assert spans.begin(meta(trace=f"00-{TRACE}-{PARENT}-00"), [message(now)], now) is None
    assert RoleSpans(tracing.NOOP, "encoder", 0).begin(meta(trace=GOOD), [], now) is None
    assert exporter.get_finished_spans() == ()


def test_a_new_trace_is_sampled_at_the_default_ratio(sdk) -> None:
    tracer, _ = sdk
    sampled = sum(tracer.start("request").recording for _ in range(4000))
    assert 10 <= sampled <= 90  # 1 % of 4,000, with room
    assert tracer.start("request", parent=GOOD).recording  # a sampled parent is followed


# ---- the span file and the timelines -------------------------------------------------------------
def test_spans_written_to_the_file_read_back_as_timelines(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    path = tmp_path / "spans.jsonl"
    tracers = {
        name: OtelTracer(
            TraceConfig(exporters=("file",), file=str(path), service=name, default_sampler=False),
            {},
        )
        for name in ("client", "encoder", "decoder")
    }
    t0 = time.monotonic() - 1.0  # in the past: sends and role spans end "now"
    root = tracers["client"].start("request", kind="client", at=t0)
    encoder = RoleSpans(tracers["encoder"], "encoder", 0)
    visit = encoder.begin(meta(trace=root.traceparent), [message(t0 + 0.001)], t0 + 0.003)
    assert visit is not None
    visit.handled(t0 + 0.013)
    encoder.sent(meta(trace=visit.span.traceparent), "decoder", t0 + 0.013, "shm", 1)
    encoder.end(visit)
    decoder = RoleSpans(tracers["decoder"], "decoder", 0)
    later = decoder.begin(meta(trace=visit.span.traceparent), [message(t0 + 0.02)], t0 + 0.02)
    assert later is not None
    later.handled(t0 + 0.05)
    decoder.failed(meta(trace=later.span.traceparent), "handler", "boom")
    decoder.end(later)
    root.end(t0 + 0.06)
    for tracer in tracers.values():
        tracer.shutdown()
    path.write_text(path.read_text() + "{not json\n")  # a run killed mid-line
    records = timeline.load(str(path))
    assert len(records) == 1 + 2 * 3 + 1  # root; two visits of role, queue, handler; a send
    (line,) = timeline.timelines(records)
    assert line.name == "request" and line.failed and 59 < line.total_ms < 61
    assert line.visits[0].total_ms > 900  # arrival at t0 + 1 ms until its end "now"
    assert [v.role for v in line.visits] == ["encoder", "decoder"]
    enc, dec = line.visits
    assert 1.5 < enc.queued_ms < 2.5 and 9.5 < enc.computing_ms < 10.5 and enc.moving_ms > 0
    assert dec.failed and 29 < dec.computing_ms < 31
    text = "\n".join(timeline.render([line]))
    assert line.trace_id in text and "encoder" in text and "(failed)" in text


def test_the_span_file_exporter_appends_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    first, second = SpanFileExporter(str(path)), SpanFileExporter(str(path))
    tracer = OtelTracer(TraceConfig(service="s"), {})
    tracer.provider.add_span_processor(SimpleSpanProcessor(first))
    tracer.provider.add_span_processor(SimpleSpanProcessor(second))
    tracer.start("one", parent=GOOD).end()
    first.shutdown()
    second.shutdown()
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(x)["parent_id"] == PARENT for x in lines)
