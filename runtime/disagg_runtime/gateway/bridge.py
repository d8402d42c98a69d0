"""The pipeline as the event loop sees it: the thread-based `Client` behind awaitables.

`call` waits for a whole result; `stream` yields chunks as the thread that receives the
client's messages hands them over (`Client.start(on_chunk=...)` ->
`loop.call_soon_threadsafe`). Leaving either early (the HTTP client went away, the handler
was cancelled, a stop sequence matched) cancels the request, which sends an abort that
frees every role's slots.

Small payloads are submitted on the loop's thread (a send to an entry role is a few tens
of microseconds, less than a thread hop); large ones from a worker thread, so one upload
does not stall every other connection while it is written into the entry role's pool.
`sent` runs once the payload's memory is no longer read (the submission returned), even
when the HTTP request was abandoned meanwhile: it may free the body the payload views.

A payload may also be a `Reserved` slot in the entry role's pool that the body was read
into (`reserve`), or an `Upload` streaming the body to the entry role over tcp as it is
read (`upload`): submitting either commits it, from a worker thread too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from disagg_runtime.client import Client, RequestFailed, Reserved, Streamed, Upload
from disagg_runtime.gateway import tracing
from disagg_runtime.wire import codec
from disagg_runtime.wire.manifest import Manifest

INLINE_BYTES = 256 * 1024
SUBMIT_THREADS = 4
_END = object()
Sent = Callable[[], None] | None


def _release_late(work: Future[Reserved | None]) -> None:
    if not work.cancelled() and work.exception() is None and (reserved := work.result()):
        reserved.release()


class Bridge:
    """Submit to the entry roles from async code; `client` is shared by all requests."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._submit = ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="gateway-submit")

    async def _start(
        self, payload: Any, on_chunk: Any = None, timeout: float | None = None, sent: Sent = None
    ) -> tuple[str, Future[Any]]:
        work: Future[tuple[str, Future[Any]]]
        trace = tracing.current()  # this task's: the worker threads below do not see it
        if isinstance(payload, (Reserved, Upload)):
            work = self._submit.submit(payload.start, on_chunk=on_chunk, trace=trace)
        elif codec.payload_nbytes(payload) <= INLINE_BYTES:
            try:
                return self.client.start(payload, timeout=timeout, on_chunk=on_chunk, trace=trace)
            finally:
                if sent is not None:
                    sent()
        else:
            work = self._submit.submit(
                self.client.start, payload, timeout=timeout, on_chunk=on_chunk, trace=trace
            )
        abandoned: list[bool] = []

        def submitted(_: Future[tuple[str, Future[Any]]]) -> None:  # on the worker thread
            if sent is not None:
                sent()
            if abandoned and work.exception() is None:
                self.client.cancel(work.result()[0], "abandoned by the HTTP client")

        work.add_done_callback(submitted)
        try:
            return await asyncio.wrap_future(work)
        except asyncio.CancelledError:
            abandoned.append(True)  # `submitted` cancels the request once it is sent
            if work.done() and not work.cancelled() and work.exception() is None:
                self.client.cancel(work.result()[0], "abandoned by the HTTP client")
            raise

    async def reserve(self, manifest: Manifest, timeout: float) -> Reserved | None:
        """A slot for `manifest` in the entry role's pool (Client.reserve), or None. One
        granted after the caller gave up is released."""
        work = self._submit.submit(self.client.reserve, manifest, timeout=timeout)
        try:
            return await asyncio.wrap_future(work)
        except asyncio.CancelledError:
            work.add_done_callback(_release_late)
            raise

    def upload(
        self,
        manifest: Manifest,
        data: memoryview,
        starts: list[int],
        timeout: float,
        on_done: Callable[[], None],
    ) -> Upload | None:
        """An `Upload` of the payload whose bytes will arrive in `data` (Client.upload:
        from here on it calls `on_done`); None where the entry relay is not tcp."""
        return self.client.upload(
            manifest, data, starts, timeout=timeout, on_done=on_done, trace=tracing.current()
        )

    async def granted(self, upload: Upload) -> None:
        """Wait for the upload's slot (RequestFailed if none); cancelled: it is cut."""
        try:
            await asyncio.wrap_future(upload.granted)
        except BaseException:
            upload.release()
            raise

    def release(self, reserved: Reserved) -> None:
        """Give an unused slot back, without waiting (it takes the relay's lock)."""
        self._submit.submit(reserved.release)

    def close(self) -> None:
        self._submit.shutdown(wait=True)

    async def call(self, payload: Any, *, timeout: float | None = None, sent: Sent = None) -> Any:
        """The exit role's result (streams: the list of chunks)."""
        rid, future = await self._start(payload, timeout=timeout, sent=sent)
        try:
            return await asyncio.wrap_future(future)
        finally:
            if not future.done():
                self.client.cancel(rid, "abandoned by the HTTP client")

    async def stream(
        self, payload: Any, *, timeout: float | None = None, sent: Sent = None
    ) -> AsyncGenerator[Any, None]:
        """Chunks as they arrive; a pipeline that does not stream yields its one result.
        Raises the request's failure (RequestFailed, RequestTimeout) where it happens."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[Any] = asyncio.Queue()

        def post(item: Any) -> None:  # on the thread that receives the client's messages
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
                loop.call_soon_threadsafe(chunks.put_nowait, item)

        rid, future = await self._start(payload, on_chunk=post, timeout=timeout, sent=sent)
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
