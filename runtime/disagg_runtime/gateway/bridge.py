"""The pipeline as the event loop sees it: the thread-based `Client` behind awaitables.

`call` waits for a whole result; `stream` yields chunks as the client's receive thread
hands them over (`Client.start(on_chunk=...)` -> `loop.call_soon_threadsafe`). Leaving
either early (the HTTP client went away, the handler was cancelled, a stop sequence
matched) cancels the request, which sends an abort that frees every role's slots.

Small payloads are submitted on the loop's thread (a send to an entry role is a few tens
of microseconds, less than a thread hop); large ones from a worker thread, so one upload
does not stall every other connection while it is written into the entry role's pool.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from concurrent.futures import Future
from typing import Any

from disagg_runtime.client import Client, RequestFailed, Streamed

INLINE_BYTES = 256 * 1024
_END = object()


def payload_nbytes(value: Any) -> int:
    """Tensor bytes in a payload (to choose inline or threaded submission)."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.numel() * value.element_size())
    if isinstance(value, dict):
        return sum(payload_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_nbytes(v) for v in value)
    return 0


class Pipeline:
    """Submit to the entry roles from async code; `client` is shared by all requests."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def _start(
        self, payload: Any, on_chunk: Any = None, timeout: float | None = None
    ) -> tuple[str, Future[Any]]:
        if payload_nbytes(payload) <= INLINE_BYTES:
            return self.client.start(payload, timeout=timeout, on_chunk=on_chunk)
        return await asyncio.to_thread(
            self.client.start, payload, timeout=timeout, on_chunk=on_chunk
        )

    async def call(self, payload: Any, *, timeout: float | None = None) -> Any:
        """The exit role's result (streams: the list of chunks)."""
        rid, future = await self._start(payload, timeout=timeout)
        try:
            return await asyncio.wrap_future(future)
        finally:
            if not future.done():
                self.client.cancel(rid, "abandoned by the HTTP client")

    async def stream(
        self, payload: Any, *, timeout: float | None = None
    ) -> AsyncGenerator[Any, None]:
        """Chunks as they arrive; a pipeline that does not stream yields its one result.
        Raises the request's failure (RequestFailed, RequestTimeout) where it happens."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[Any] = asyncio.Queue()

        def post(item: Any) -> None:  # on the client's receive thread
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
                loop.call_soon_threadsafe(chunks.put_nowait, item)

        rid, future = await self._start(payload, on_chunk=post, timeout=timeout)
        future.add_done_callback(lambda _: post(_END))
        try:
            while True:
                item = await chunks.get()
                if item is _END:
                    break
                yield item
            result = future.result()  # raises the failure, if it ended by one
            if isinstance(result, dict) and len(self.client.exits) > 1:
                rest = {k: v for k, v in result.items() if not isinstance(v, Streamed)}
                if rest:
                    yield rest  # exit roles that did not stream
            elif not isinstance(result, Streamed):
                yield result  # not a streaming pipeline: its one result
        finally:
            if not future.done():
                self.client.cancel(rid, "abandoned by the HTTP client")
                with contextlib.suppress(RequestFailed):
                    future.result(timeout=0)
