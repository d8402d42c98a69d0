"""Whether and where a process traces, read from the OpenTelemetry environment variables.

    OTEL_SDK_DISABLED=true                    off, whatever else is set
    OTEL_TRACES_EXPORTER=otlp|console|none    otlp when an OTLP endpoint is set (below)
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT        full URL of the traces endpoint, or
    OTEL_EXPORTER_OTLP_ENDPOINT               base URL (/v1/traces is appended), OTLP/HTTP
    OTEL_SERVICE_NAME                         else <pipeline>/<role> (gateway: <pipeline>/gateway)
    OTEL_TRACES_SAMPLER[_ARG]                 the SDK's sampler names; unset: parent-based,
                                              DEFAULT_RATIO of new traces (the SDK's default
                                              would be all of them)
    DISAGG_TRACE_FILE=PATH                    also append each span as a JSON line to PATH
                                              (`disagg up --trace`: no collector needed)

Unlike the SDK's own default (`otlp` to localhost:4318), nothing is traced unless an
endpoint, an exporter or a trace file is named: a role must not spend a thread and a
socket on spans nobody collects. Nor, by default, is every request: a span costs tens of
microseconds of Python in the SDK, and a role visit records four, so sampling every
request of a fast pipeline costs a large share of its throughput (`disagg bench pipeline
--trace` measures it); 1 % of new traces is sampled by default. A traceparent that arrives
sampled is followed whatever the ratio (parent-based). Pure: the environment is handed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

EXPORTERS = ("otlp", "console", "none")
TRACE_FILE = "DISAGG_TRACE_FILE"
SAMPLER = "OTEL_TRACES_SAMPLER"
DEFAULT_RATIO = 0.01
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class TracingConfigError(ValueError):
    """An OTEL_* variable has a value this runtime cannot use."""


@dataclass(frozen=True)
class TraceConfig:
    exporters: tuple[str, ...] = ()  # "otlp", "console", "file"
    file: str = ""
    service: str = ""
    default_sampler: bool = True  # OTEL_TRACES_SAMPLER unset: parent-based DEFAULT_RATIO

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)

    @property
    def why(self) -> str:
        """The variables that asked for tracing (for the message when the SDK is missing)."""
        return ", ".join(f"{e} exporter" for e in self.exporters)


def _flag(value: str) -> bool:
    return value.strip().lower() == "true"


def from_env(env: Mapping[str, str], *, service: str) -> TraceConfig:
    """The process's tracing, `service` being its default service name."""
    if _flag(env.get("OTEL_SDK_DISABLED", "")):
        return TraceConfig()
    named = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    named = [e for e in named if e]
    for exporter in named:
        if exporter not in EXPORTERS:
            raise TracingConfigError(
                f"OTEL_TRACES_EXPORTER: {exporter!r} is not one of {', '.join(EXPORTERS)}"
            )
    if not named and any(env.get(v, "").strip() for v in ENDPOINT_VARS):
        named = ["otlp"]
    exporters = [e for e in named if e != "none"]
    file = env.get(TRACE_FILE, "").strip()
    if file:
        exporters.append("file")
    return TraceConfig(
        exporters=tuple(dict.fromkeys(exporters)),
        file=file,
        service=env.get("OTEL_SERVICE_NAME", "").strip() or service,
        default_sampler=not env.get(SAMPLER, "").strip(),
    )
