"""The gateway's span of each HTTP request, and the traceparent its envelopes carry.

A client's `traceparent` header (W3C Trace Context) is the parent of the gateway's span;
without one, or with one that does not parse (ignored, as the recommendation says), the
span starts a trace. The span's traceparent is `current()` inside the request's task:
the bridge hands it to the client, whose envelopes carry it to every role. With tracing
off, a valid header from the client is passed on unchanged (a participant that does not
trace still propagates), so roles that do trace hang under the caller's trace.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from disagg_runtime.tracing import Tracer
from disagg_runtime.wire import tracecontext

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_CURRENT: contextvars.ContextVar[str] = contextvars.ContextVar("disagg_traceparent", default="")
UNTRACED = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json"})


def current() -> str:
    """The traceparent of the HTTP request being served ("" outside one, or untraced)."""
    return _CURRENT.get()


def middleware(tracer: Tracer) -> Middleware:
    @web.middleware
    async def trace(request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("traceparent", "")
        if request.path in UNTRACED:
            return await handler(request)
        if not tracer.enabled:
            token = _CURRENT.set(tracecontext.valid(header))
            try:
                return await handler(request)
            finally:
                _CURRENT.reset(token)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "other"
        span = tracer.start(
            f"{request.method} {route}",
            parent=header,
            kind="server",
            attrs={"http.request.method": request.method, "http.route": route},
        )
        token = _CURRENT.set(span.traceparent)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            _CURRENT.reset(token)
            span.set("http.response.status_code", status)
            if status >= 500:
                span.fail(f"HTTP {status}")
            span.end()

    return trace
