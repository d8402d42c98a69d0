"""The `Tracer` on OpenTelemetry's SDK (the `tracing` extra): imported only when asked for.

One `TracerProvider` per tracer, never the global one, so several roles can share a
process (tests) and nothing else in the process is traced by accident. Spans leave
through a `BatchSpanProcessor` per exporter (a background thread, a bounded queue that
drops rather than blocks when full: the SDK's defaults of 2,048 spans, 512 a batch):

- `otlp`: OTLP/HTTP protobuf (`opentelemetry-exporter-otlp-proto-http`), configured by
  the SDK from OTEL_EXPORTER_OTLP_* itself (endpoint, headers, timeout, compression).
- `console`: the SDK's console exporter (one JSON object per span on stdout).
- `file`: one JSON line per span appended to DISAGG_TRACE_FILE (spanfile.py).

The sampler is the SDK's, from OTEL_TRACES_SAMPLER[_ARG]; unset, parent-based with
config.DEFAULT_RATIO of new traces. A request whose traceparent says "not sampled"
records nothing downstream.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased

from disagg_runtime.tracing.api import Attrs, AttrValue, Span, SpanKind
from disagg_runtime.tracing.config import DEFAULT_RATIO, TraceConfig
from disagg_runtime.tracing.spanfile import SpanFileExporter
from disagg_runtime.wire import tracecontext

_KINDS: Mapping[str, trace.SpanKind] = {
    "internal": trace.SpanKind.INTERNAL,
    "server": trace.SpanKind.SERVER,
    "client": trace.SpanKind.CLIENT,
    "producer": trace.SpanKind.PRODUCER,
    "consumer": trace.SpanKind.CONSUMER,
}
SHUTDOWN_MS = 5000
# the wall clock at monotonic 0, taken once: a span's children then sit exactly inside it
_EPOCH_NS = time.time_ns() - time.monotonic_ns()


def _wall_ns(at: float | None) -> int:
    """A monotonic instant (now when None) as the epoch nanoseconds spans carry."""
    return _EPOCH_NS + (time.monotonic_ns() if at is None else int(at * 1e9))


def _exporter(kind: str, config: TraceConfig) -> SpanExporter:
    if kind == "otlp":
        return OTLPSpanExporter()
    if kind == "console":
        return ConsoleSpanExporter()
    return SpanFileExporter(config.file)


class OtelSpan:
    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self._tracer = tracer
        self._span = span
        self._recording = span.is_recording()
        self._traceparent = ""

    @property
    def traceparent(self) -> str:
        if not self._traceparent:
            c = self._span.get_span_context()
            parent = tracecontext.TraceParent(c.trace_id, c.span_id, c.trace_flags)
            self._traceparent = parent.header()
        return self._traceparent

    @property
    def recording(self) -> bool:
        return self._recording

    def child(self, name: str, start: float, end: float, attrs: Attrs | None = None) -> None:
        if not self._recording:
            return
        ctx = trace.set_span_in_context(self._span, otel_context.Context())
        span = self._tracer.start_span(name, ctx, attributes=attrs, start_time=_wall_ns(start))
        span.end(end_time=_wall_ns(end))

    def set(self, key: str, value: AttrValue) -> None:
        if self._recording:
            self._span.set_attribute(key, value)

    def fail(self, message: str) -> None:
        if self._recording:
            self._span.set_status(trace.Status(trace.StatusCode.ERROR, message[:512]))

    def end(self, at: float | None = None) -> None:
        self._span.end(end_time=_wall_ns(at))


class OtelTracer:
    def __init__(self, config: TraceConfig, resource: Attrs) -> None:
        self.config = config
        attributes = {**resource, "service.name": config.service}
        # Resource.create adds OTEL_RESOURCE_ATTRIBUTES; None: the SDK reads OTEL_TRACES_SAMPLER
        sampler: Sampler | None = None
        if config.default_sampler:
            sampler = ParentBased(TraceIdRatioBased(DEFAULT_RATIO))
        self.provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
        for kind in config.exporters:
            self.provider.add_span_processor(BatchSpanProcessor(_exporter(kind, config)))
        self._tracer = self.provider.get_tracer("disagg")

    @property
    def enabled(self) -> bool:
        return True

    def start(
        self,
        name: str,
        *,
        parent: str = "",
        at: float | None = None,
        kind: SpanKind = "internal",
        attrs: Attrs | None = None,
    ) -> Span:
        ctx = otel_context.Context()  # never the thread's current span: only `parent`
        p = tracecontext.parse(parent) if parent else None
        if p is not None:
            remote = trace.SpanContext(
                p.trace_id, p.span_id, is_remote=True, trace_flags=trace.TraceFlags(p.flags)
            )
            ctx = trace.set_span_in_context(trace.NonRecordingSpan(remote), ctx)
        # attributes after the sampler's verdict: the SDK would copy them for a span it
        # then drops (8 us of an unsampled root's 18); no sampler here reads them
        span = self._tracer.start_span(name, ctx, kind=_KINDS[kind], start_time=_wall_ns(at))
        if attrs and span.is_recording():
            span.set_attributes(attrs)
        return OtelSpan(self._tracer, span)

    def shutdown(self) -> None:
        self.provider.force_flush(SHUTDOWN_MS)
        self.provider.shutdown()
