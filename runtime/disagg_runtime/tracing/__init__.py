"""Traces of requests across roles: OpenTelemetry when asked for, nothing otherwise.

    gateway span (server) ── envelope.trace ──> role span (consumer) ──> next role's span ...
                                                  ├─ queue    (received -> a worker took it)
                                                  ├─ handler  (the user handler's call)
                                                  └─ send <target>  (each hand-off: relay, bytes)

`open_tracer(service)` reads the OTEL_* environment (config.py). Off (the default), it is
`NOOP`, with no import of OpenTelemetry. Asked for without the `tracing` extra installed,
it logs what to install and is `NOOP` too: a role must start either way. A layer of its
own beside `memory` (only `wire` below): the role, the client, the gateway and the local
launcher all record spans.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from disagg_runtime.tracing.api import NOOP, Attrs, AttrValue, NoopSpan, Span, SpanKind, Tracer
from disagg_runtime.tracing.config import TraceConfig, TracingConfigError, from_env

__all__ = [
    "NOOP",
    "AttrValue",
    "Attrs",
    "NoopSpan",
    "Span",
    "SpanKind",
    "TraceConfig",
    "Tracer",
    "TracingConfigError",
    "TracingUnavailable",
    "available",
    "open_tracer",
]
log = logging.getLogger(__name__)
INSTALL = "pip install 'disagg[tracing]'"


class TracingUnavailable(RuntimeError):
    """Tracing was asked for, but OpenTelemetry's SDK is not installed."""


def available() -> bool:
    """Whether the `tracing` extra (the SDK and its OTLP/HTTP exporter) is installed."""
    try:
        import disagg_runtime.tracing.otel  # noqa: F401
    except ImportError:
        return False
    return True


def open_tracer(
    service: str,
    *,
    resource: Attrs | None = None,
    env: Mapping[str, str] | None = None,
    strict: bool = False,
) -> Tracer:
    """The tracer of one process (`service`: its default service name). Without the SDK,
    `strict` raises TracingUnavailable; else a warning says what to install."""
    config = from_env(os.environ if env is None else env, service=service)
    if not config.enabled:
        return NOOP
    try:
        from disagg_runtime.tracing.otel import OtelTracer
    except ImportError as exc:
        message = (
            f"tracing asked for ({config.why}) but OpenTelemetry's SDK is not installed "
            f"({exc.name or exc}): {INSTALL}"
        )
        if strict:
            raise TracingUnavailable(message) from None
        log.warning("%s; tracing stays off", message)
        return NOOP
    return OtelTracer(config, resource or {})
