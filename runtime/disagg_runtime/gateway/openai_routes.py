"""The gateway's OpenAI routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`):
a part of `GatewayApp` (app.py), whose pipeline of handler roles (`bridge`) or engine
roles (`engines`) answers them; openai.py holds the pure parsing and answer shapes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from disagg_runtime.client import RequestFailed
from disagg_runtime.gateway import native, openai, sse
from disagg_runtime.gateway.errors import HttpError, from_failure
from disagg_runtime.wire import codec

if TYPE_CHECKING:
    from disagg_runtime.gateway.app import Settings
    from disagg_runtime.gateway.bridge import Bridge
    from disagg_runtime.gateway.engines import EngineRouter
    from disagg_runtime.gateway.metrics import GatewayMetrics


STARTED: Final = web.RequestKey("started", float)  # when the request came (app.py's middleware)


class OpenAIRoutes:
    """The OpenAI routes of `GatewayApp`, which provides what is declared here."""

    settings: Settings
    metrics: GatewayMetrics
    engines: EngineRouter | None
    started: int

    @property
    def bridge(self) -> Bridge:
        raise NotImplementedError

    def _check_length(self, request: web.Request) -> None:
        raise NotImplementedError

    async def _json(self, request: web.Request) -> Any:
        raise NotImplementedError

    def _chunks(self, payload: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """An OpenAI request's chunks: from the engine roles, else the pipeline's roles."""
        if self.engines is not None:
            return self.engines.stream(payload)
        return self.bridge.stream(payload)

    # ---- OpenAI API ----------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(openai.models(self.settings.model, self.started))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        self._check_length(request)
        parse = openai.parse_chat if chat else openai.parse_completion
        try:
            doc = await self._json(request)
            payload, sampling = parse(doc, self.settings.model, self.settings.max_tokens)
        except (native.InputError, openai.ModelNotFound) as exc:
            raise from_failure(exc) from None
        answer = openai.Answer(self.settings.model, chat)
        done = openai.Completion(stop=sampling.stop)
        if sampling.stream:
            return await self._openai_stream(request, payload, sampling, answer, done)
        try:
            async with contextlib.aclosing(self._chunks(payload)) as chunks:
                async for chunk in chunks:
                    done.feed(chunk)
                    if done.stopped:
                        break  # leaving the stream aborts the rest of the request
            done.finish()
        except (RequestFailed, ValueError, HttpError) as exc:
            raise self._openai_failure(exc) from None
        body = answer.whole(done)
        response = web.json_response(body)
        self.metrics.bytes_out.inc(len(response.body or b""))  # type: ignore[arg-type]
        return response

    async def _openai_stream(
        self,
        request: web.Request,
        payload: dict[str, Any],
        sampling: openai.Sampling,
        answer: openai.Answer,
        done: openai.Completion,
    ) -> web.StreamResponse:
        out = sse.EventStream(request)
        first = True
        try:
            async with contextlib.aclosing(self._chunks(payload)) as chunks:
                async for chunk in chunks:
                    text = done.feed(chunk)
                    if first:
                        self.metrics.first_chunk(request.path, time.monotonic() - request[STARTED])
                    if text or first:
                        await out.send(sse.encode(answer.delta(text, first=first)))
                        first = False
                    if done.stopped:
                        break
            tail = done.finish()
            if first or tail:
                await out.send(sse.encode(answer.delta(tail, first=first)))
            await out.send(sse.encode(answer.delta("", finish=done.finish_reason)))
            if sampling.include_usage:
                await out.send(sse.encode(answer.usage_chunk(done)))
            await out.send(sse.DONE)
        except (RequestFailed, ValueError, HttpError) as exc:
            failure = self._openai_failure(exc)
            if not out.started:
                raise failure from None
            await out.send(sse.encode({**failure.body, "status": failure.status}))
        self.metrics.bytes_out.inc(out.bytes_out)
        return await out.finish()

    def _openai_failure(self, exc: Exception) -> HttpError:
        if isinstance(exc, HttpError):  # an engine's answer (engines.py)
            return exc
        if isinstance(exc, (RequestFailed, native.InputError, codec.CodecError)):
            return from_failure(exc)
        # a chunk that is not {"text": ...}: the pipeline does not speak this API
        return HttpError(
            502, f"the pipeline's answer is not text chunks: {exc}", kind="role_failed"
        )
