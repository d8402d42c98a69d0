"""Server-Sent Events on an aiohttp response: one `event:`/`data:` block per message.

The response is prepared lazily, on the first event, so that a request which fails before
its first chunk still gets a real HTTP status code instead of an `error` event.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

CONTENT_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"  # the OpenAI stream terminator


def encode(data: Any, event: str | None = None) -> bytes:
    """One event; `data` is JSON-encoded on a single line (JSON never needs a newline)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


class EventStream:
    """Write events to `request`'s response, preparing it on the first write."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.bytes_out = 0

    @property
    def started(self) -> bool:
        return self.response is not None

    async def send(self, raw: bytes) -> None:
        if self.response is None:
            self.response = web.StreamResponse(
                status=200,
                headers={
                    "Content-Type": CONTENT_TYPE,
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",  # proxies (nginx) must not buffer the stream
                },
            )
            await self.response.prepare(self.request)
        await self.response.write(raw)
        self.bytes_out += len(raw)

    async def finish(self) -> web.StreamResponse:
        if self.response is None:
            raise RuntimeError("EventStream.finish() before any send()")
        await self.response.write_eof()
        return self.response
