"""What the gateway answers when a request fails, in the OpenAI error shape.

Answers by failure (body `{"error": {"message", "type", "param", "code", ...}}`, the
OpenAI error shape for every route):

    400 invalid_input        the body cannot be a payload; `param` is its JSON path
    401 unauthorized         token missing or wrong (when the gateway has one)
    404 model_not_found      an OpenAI request for another model
    408 request_timeout      the body did not come within the request timeout (stalled)
    411 length_required      a safetensors body without Content-Length
    413 too_large            body over the limit (DISAGG_GATEWAY_MAX_BODY)
    429 overloaded           the entry role refused for load (Retry-After)
    503 unavailable          no entry role replica reachable (Retry-After)
    502 role_failed          a role failed the request: `role`, `replica`, `exception`
    504 timeout              no result within the pipeline's request timeout

An error message may quote the input, so what it echoes is bounded (`bounded`).
"""

from __future__ import annotations

from typing import Final

from aiohttp import web

from disagg_runtime.client import (
    TOO_LARGE,
    RequestFailed,
    RequestOverloaded,
    RequestTimeout,
    UploadExpired,
)
from disagg_runtime.gateway import native, openai
from disagg_runtime.wire import codec

RETRY_AFTER_S: Final = 1
MAX_ECHO: Final = 1000  # characters of an error message (they may quote the input)
MAX_PARAM: Final = 200  # characters of a field path or other detail of an error


def bounded(text: str, limit: int = 0) -> str:
    """`text` as echoed to a client: at most `limit` (MAX_ECHO) characters, its head and
    tail kept (a request cannot make its error answer larger than itself)."""
    limit = limit or MAX_ECHO
    if len(text) <= limit:
        return text
    keep = (limit - 40) // 2
    return f"{text[:keep]}...({len(text) - 2 * keep} characters cut)...{text[-keep:]}"


class HttpError(Exception):
    """An answer other than 200, with the OpenAI-shaped error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: str,
    ) -> None:
        message = bounded(message)
        super().__init__(message)
        self.status = status
        param = None if param is None else bounded(param, MAX_PARAM)
        self.body = openai.error(message, kind=kind, code=kind, param=param)
        self.body["error"].update({k: bounded(v, MAX_PARAM) for k, v in extra.items()})
        self.headers = headers or {}

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status, headers=self.headers)


def from_failure(exc: BaseException) -> HttpError:
    """The answer for a request that failed after it reached the gateway's logic."""
    if isinstance(exc, native.InputError):
        return HttpError(400, str(exc), kind="invalid_input", param=exc.path)
    if isinstance(exc, openai.ModelNotFound):
        return HttpError(404, str(exc), kind="model_not_found", param="$.model")
    if isinstance(exc, codec.CodecError):
        return HttpError(400, str(exc), kind="invalid_input", param="$")
    if isinstance(exc, UploadExpired):  # the body came too slowly, as upload.BodyTimeout
        return HttpError(408, str(exc), kind="request_timeout")
    if isinstance(exc, RequestTimeout):
        return HttpError(504, str(exc), kind="timeout")
    if isinstance(exc, RequestFailed):
        error = exc.error
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if error.get("reason") == TOO_LARGE:  # no wait or retry helps
            return HttpError(413, str(exc), kind="too_large")
        if isinstance(exc, RequestOverloaded) or error.get("reason") == "overloaded":
            return HttpError(429, str(exc), kind="overloaded", headers=retry, role=exc.role)
        if not error:  # never reached a role: none reachable, or the gateway is closing
            return HttpError(503, str(exc), kind="unavailable", headers=retry)
        return HttpError(
            502,
            str(exc),
            kind="role_failed",
            role=error.get("role", exc.role),
            replica=error.get("replica", ""),
            exception=error.get("type", "") or error.get("reason", ""),
        )
    raise exc
