"""The gateway's HTTP routes (aiohttp), status codes and middlewares.

    GET  /healthz  /readyz  /metrics  /openapi.json        no token needed
    POST /v1/infer                                          native API (see `native`)
    GET  /v1/models  POST /v1/completions  /v1/chat/completions   with api openai

Answers by failure: `errors` (the OpenAI error shape for every route). The OpenAI routes
are in `openai_routes` (over handler roles, or engine roles: `engines`).

A client that goes away (disconnect mid-stream, or while waiting) cancels its request:
the abort reaches every role, which frees the request's pool slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from aiohttp import web

from disagg_core import contract
from disagg_runtime.client import (
    RequestFailed,
    Upload,
)
from disagg_runtime.gateway import limits, native, openapi, sse, tracing, upload
from disagg_runtime.gateway.bridge import Bridge
from disagg_runtime.gateway.engines import EngineRouter
from disagg_runtime.gateway.errors import RETRY_AFTER_S, HttpError, from_failure
from disagg_runtime.gateway.metrics import GatewayMetrics
from disagg_runtime.gateway.openai_routes import STARTED, OpenAIRoutes
from disagg_runtime.gateway.token import BearerToken
from disagg_runtime.tracing import NOOP, Tracer
from disagg_runtime.wire import codec

log = logging.getLogger(__name__)
OPEN_PATHS: Final = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json"})
READY_CACHE_S: Final = 1.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
STREAM_PIECE: Final = 1 << 20  # tcp uploads: the body is read and sent on in pieces of this


@dataclass
class Settings:
    pipeline: str
    api: str = "native"
    model: str = ""
    token: str | BearerToken = ""  # a file's token is read again when the file changes
    max_body: int = 256 * 2**20
    timeout: float = 30.0
    # Bounds before authentication (see `limits`).
    idle_timeout: float = contract.DEFAULT_GATEWAY_IDLE_TIMEOUT  # for the next headers
    max_connections: int = contract.DEFAULT_GATEWAY_MAX_CONNECTIONS
    max_json: int = contract.DEFAULT_GATEWAY_MAX_JSON  # parsed, JSON costs several times this
    json_in_flight: int = 64 * 2**20  # bytes of JSON bodies read and parsed at once
    max_uploads: int = 16  # large (staged) uploads at once, each holding a pool slot
    max_uploads_per_client: int = 4  # of them, from one client address
    upload_stall: float = upload.STALL_S  # a large body that sends nothing this long: 408
    max_tokens: int = 0  # the model's largest max_tokens (0: the pipeline checks alone)

    @property
    def json_limit(self) -> int:
        return min(self.max_json, self.max_body)


async def _read_upto(request: web.Request, limit: int) -> bytes:
    """A body without Content-Length, refused (413) once it passes `limit` bytes."""
    pieces, size = [], 0
    async for piece in request.content.iter_any():
        size += len(piece)
        if size > limit:
            raise HttpError(413, f"body is over the limit of {limit} bytes", kind="too_large")
        pieces.append(piece)
    return b"".join(pieces)


def _raw(text: str) -> bytes:
    """A header's bytes back: aiohttp decodes bytes that are not UTF-8 as surrogates."""
    return text.encode("utf-8", "surrogateescape")


def _nothing() -> None:
    """`sent` for a payload that holds no memory of the gateway's."""


@dataclass
class GatewayApp(OpenAIRoutes):
    """Routes over one `Bridge` (to the pipeline); `ready` says why the gateway cannot serve ("":
    it can)."""

    settings: Settings
    pipeline: Bridge | None  # None: a pipeline of engine roles (`engines`), no /v1/infer
    ready: Callable[[], Awaitable[str]]
    tracer: Tracer = NOOP  # each request's span (tracing.py), the parent of the roles' spans
    engines: EngineRouter | None = None  # OpenAI requests to engine roles (engines.py)
    metrics: GatewayMetrics = field(init=False)
    arena: upload.Arena = field(init=False)
    token: BearerToken = field(init=False)
    json_budget: limits.Budget = field(init=False)
    uploads: limits.Uploads = field(init=False)
    started: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        token = self.settings.token
        self.token = token if isinstance(token, BearerToken) else BearerToken(token)
        self.metrics = GatewayMetrics(self.settings.pipeline)
        self.arena = upload.Arena(upload.arena_size(self.settings.max_body))
        self.json_budget = limits.Budget(self.settings.json_in_flight)
        self.uploads = limits.Uploads(
            self.settings.max_uploads, self.settings.max_uploads_per_client
        )

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._measure, tracing.middleware(self.tracer), self._auth],
            client_max_size=self.settings.max_body,
        )
        app.on_response_prepare.append(upload.close_after)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/openapi.json", self.openapi_doc)
        if self.pipeline is not None:
            app.router.add_post("/v1/infer", self.infer)
        if self.engines is not None:
            engines = self.engines

            async def close_engines(_: web.Application) -> None:
                await engines.close()

            app.on_cleanup.append(close_engines)
        if self.settings.api == "openai":
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/completions", self.completions)
            app.router.add_post("/v1/chat/completions", self.chat)
        return app

    # ---- middlewares ---------------------------------------------------------------------------
    @web.middleware
    async def _measure(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "other"
        started = time.monotonic()
        request[STARTED] = started
        self.metrics.inflight.inc()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except HttpError as exc:
            status = exc.status
            return exc.response()
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's convention)
            raise
        finally:
            self.metrics.inflight.dec()
            self.metrics.answered(name, status, time.monotonic() - started)
            if request.content_length:
                self.metrics.bytes_in.inc(request.content_length)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        token = self.token.current()
        if token and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            scheme, _, value = given.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                _raw(value.strip()), _raw(token)
            )
            if not ok:
                raise HttpError(
                    401,
                    "missing or wrong bearer token",
                    kind="unauthorized",
                    headers={"WWW-Authenticate": 'Bearer realm="disagg"'},
                )
        return await handler(request)

    # ---- plain routes --------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, request: web.Request) -> web.Response:
        problem = await self.ready()
        if not problem:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {problem}\n")

    async def metrics_text(self, request: web.Request) -> web.Response:
        body = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def openapi_doc(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.document(self.settings.api, self.settings.model))

    @property
    def bridge(self) -> Bridge:
        """The pipeline of handler roles (the native routes exist only where there is one)."""
        if self.pipeline is None:
            raise HttpError(404, "this pipeline runs engines: use the OpenAI API", kind="not_found")
        return self.pipeline

    # ---- native API ----------------------------------------------------------------------------
    async def infer(self, request: web.Request) -> web.StreamResponse:
        payload, sent = await self._native_input(request)
        accept = request.headers.get("Accept", "")
        if sse.CONTENT_TYPE in accept:
            return await self._native_stream(request, payload, sent)
        try:
            result = await self.bridge.call(payload, sent=sent)
        except Exception as exc:
            raise from_failure(exc) from None
        if native.SAFETENSORS in accept:
            body = await asyncio.to_thread(native.to_safetensors, result)
            content_type = native.SAFETENSORS
        else:
            body = native.dumps({"outputs": native.to_json(result)})
            content_type = "application/json"
        self.metrics.bytes_out.inc(len(body))
        return web.Response(body=body, content_type=content_type)

    async def _native_input(self, request: web.Request) -> tuple[Any, Callable[[], None]]:
        """The payload, and what to call once it is submitted (frees the body's memory)."""
        self._check_length(request)
        try:
            if request.content_type == native.SAFETENSORS:
                return await self._read_safetensors(request)
            if request.content_type not in ("application/json", "application/octet-stream", ""):
                raise HttpError(
                    415,
                    f"unsupported Content-Type {request.content_type!r}; use "
                    f"application/json or {native.SAFETENSORS}",
                    kind="unsupported_media_type",
                )
            doc = await self._json(request)
            return native.request_from_json(doc), _nothing
        except native.InputError as exc:
            raise from_failure(exc) from None

    def _check_length(self, request: web.Request) -> None:
        length = request.content_length
        if length is not None and length > self.settings.max_body:
            raise HttpError(
                413,
                f"body of {length} bytes is over the limit of {self.settings.max_body}",
                kind="too_large",
            )

    async def _json(self, request: web.Request) -> Any:
        """A JSON body, parsed: at most `json_limit` bytes, and only while the bytes of the
        JSON bodies in flight fit `json_in_flight` (429 otherwise, before reading)."""
        limit = self.settings.json_limit
        length = request.content_length
        if length is not None and length > limit:
            raise HttpError(
                413,
                f"a JSON body of {length} bytes is over the JSON limit of {limit}; send "
                f"large tensors as {native.SAFETENSORS}",
                kind="too_large",
            )
        held = limit if length is None else length
        if not self.json_budget.take(held):
            raise HttpError(
                429,
                "too many JSON bytes in flight; retry",
                kind="overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        try:
            doc = await self._parse(await self._read(request, limit))
        finally:
            self.json_budget.give(held)
        if held >= limits.TRIM_AFTER:  # the body's bytes are gone: give the heap back
            await asyncio.to_thread(limits.give_back, held)
        return doc

    async def _parse(self, body: bytes) -> Any:
        if len(body) < limits.TRIM_AFTER:
            return native.loads(body)
        return await asyncio.to_thread(native.loads, body)  # the loop keeps serving

    async def _read(self, request: web.Request, limit: int | None = None) -> bytes:
        try:
            if request.content.is_eof():  # here whole (small bodies): no timer to set
                return await request.read()
            async with asyncio.timeout(self.settings.timeout):
                if limit is None or request.content_length is not None:
                    return await request.read()
                return await _read_upto(request, limit)
        except TimeoutError:
            raise HttpError(
                408,
                f"the request body was not received within {self.settings.timeout} s",
                kind="request_timeout",
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise HttpError(
                413, f"body is over the limit of {self.settings.max_body} bytes", kind="too_large"
            ) from None

    async def _read_safetensors(self, request: web.Request) -> tuple[Any, Callable[[], None]]:
        length = request.content_length
        if length is None:
            raise HttpError(411, "a safetensors body needs Content-Length", kind="length_required")
        if length < upload.MIN_TAKEOVER:
            return native.request_from_safetensors(await self._read(request)), _nothing
        client = request.remote or ""
        refused = self.uploads.enter(client)
        if refused:
            retry = {"Retry-After": str(RETRY_AFTER_S)}
            raise HttpError(429, f"{refused}; retry", kind="overloaded", headers=retry)
        try:
            return await self._staged(request)
        finally:
            self.uploads.leave(client)

    async def _staged(self, request: web.Request) -> tuple[Any, Callable[[], None]]:
        deadline = time.monotonic() + self.settings.timeout
        body = upload.Body(request, deadline, stall_s=self.settings.upload_stall)
        try:
            return await self._land(body)
        except upload.BodyTimeout as exc:
            raise HttpError(408, str(exc), kind="request_timeout") from None
        except upload.BodyError as exc:
            raise HttpError(400, str(exc), kind="invalid_input", param="$") from None
        except RequestFailed as exc:  # no slot in the entry role's pool
            raise from_failure(exc) from None
        finally:
            body.close()

    async def _land(self, body: upload.Body) -> tuple[Any, Callable[[], None]]:
        """Read the safetensors header, then the tensors straight into a slot of the entry
        role's pool laid out for them (shm); over tcp, into the arena, sending each piece
        on to the entry role as it comes (`Upload`); else into the arena, to be parsed in
        place and sent."""
        prefix = bytearray(8)
        await body.fill([memoryview(prefix)])
        size = native.header_size(prefix, body.length)
        header = bytearray(size)
        await body.fill([memoryview(header)])
        metadata, spans = native.parse_header(header, body.length - 8 - size)
        manifest, places = native.slot_layout(metadata, spans)
        await body.flowing()  # no slot for a body that stops after its header
        remaining = max(0.0, body.deadline - time.monotonic())
        reserved = streaming = None
        if manifest.nbytes:  # (a body of metadata only has nothing to land)
            reserved = await self.bridge.reserve(manifest, remaining)
        if reserved is None:
            slot = self.arena.take(body.length)
            try:
                slot.view[:8] = prefix
                slot.view[8 : 8 + size] = header
                data = slot.view[8 + size :]
                starts = native.data_starts(metadata, spans) if manifest.nbytes else []
                streaming = self.bridge.upload(manifest, data, starts, remaining, slot.release)
                if streaming is not None:  # from here the upload frees the slot
                    await self.bridge.granted(streaming)
                    return await self._stream_body(body, data, streaming)
                await body.fill([data])
                return native.request_from_safetensors(slot.view), slot.release
            except BaseException:
                if streaming is None:
                    slot.release()
                raise
        body.deadline = min(body.deadline, reserved.grant.write_by)
        try:
            await body.fill(
                [
                    reserved.slot[at : at + span.meta.nbytes]
                    for span, at in zip(spans, places, strict=True)
                ]
            )
        except BaseException:
            self.bridge.release(reserved)
            raise
        return reserved, reserved.release

    async def _stream_body(
        self, body: upload.Body, data: memoryview, streaming: Upload
    ) -> tuple[Any, Callable[[], None]]:
        """Receive the data section piece by piece, each piece's chunks sent on at once
        (tcp: `Upload`); a body that stops short cuts the transfer, freeing the slot."""
        body.deadline = min(body.deadline, streaming.write_by)
        try:
            for at in range(0, len(data), STREAM_PIECE):
                piece = data[at : at + STREAM_PIECE]
                await body.fill([piece])
                streaming.advance(at + len(piece))
        except BaseException:
            streaming.release()
            raise
        return streaming, streaming.release

    async def _native_stream(
        self, request: web.Request, payload: Any, sent: Callable[[], None]
    ) -> web.StreamResponse:
        out = sse.EventStream(request)
        count = 0
        try:
            async with contextlib.aclosing(self.bridge.stream(payload, sent=sent)) as chunks:
                async for chunk in chunks:
                    if count == 0:
                        self.metrics.first_chunk("/v1/infer", time.monotonic() - request[STARTED])
                    await out.send(sse.encode(native.to_json(chunk), "chunk"))
                    count += 1
            await out.send(sse.encode({"chunks": count}, "end"))
        except (RequestFailed, codec.CodecError) as exc:
            failure = from_failure(exc)
            if not out.started:
                raise failure from None
            await out.send(sse.encode({**failure.body, "status": failure.status}, "error"))
        self.metrics.bytes_out.inc(out.bytes_out)
        return await out.finish()
