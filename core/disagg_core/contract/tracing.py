"""`spec.monitoring.tracing` as the OpenTelemetry environment every role and the gateway
get (the runtime's tracing reads these names, as any OpenTelemetry SDK does):

    OTEL_EXPORTER_OTLP_ENDPOINT   the endpoint (OTLP/HTTP; /v1/traces is appended)
    OTEL_TRACES_SAMPLER           parentbased_traceidratio: a caller's sampled traceparent
    OTEL_TRACES_SAMPLER_ARG       is followed, new traces are sampled at the ratio

A variable a role's own `env` sets wins (the operator leaves it out; the local launcher
keeps what the shell already has).
"""

from __future__ import annotations

from disagg_core.spec import Pipeline

ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
SAMPLER = "OTEL_TRACES_SAMPLER"
SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"


def tracing_env(pipeline: Pipeline) -> dict[str, str]:
    """The OTEL_* variables of `pipeline` (empty when it configures no tracing)."""
    tracing = pipeline.monitoring.tracing
    if tracing is None:
        return {}
    return {
        ENDPOINT: tracing.endpoint,
        SAMPLER: "parentbased_traceidratio",
        SAMPLER_ARG: repr(tracing.sample_ratio),
    }
