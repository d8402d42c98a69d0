"""Large request bodies read from the socket straight to where they belong.

aiohttp reads a body in pieces of at most 256 KiB into fresh `bytes` objects, and each
piece must then be copied again to where it belongs; for a 64 MiB body that is hundreds of
allocations, two copies and fresh pages to fault in. Here the connection's transport is
handed to a `BufferedProtocol` for the rest of the body (`Body`): the event loop
`recv_into`s the kernel's data directly into memory the caller names piece by piece, so
the body is copied once, by the kernel. The gateway names a small buffer for the
safetensors header, then the places of the tensors in a slot of the entry role's pool
reserved for them (gateway/app.py), or, where that pool is not mapped in this process, a
slot of an `Arena` (memory faulted in once and reused body after body), which the
safetensors parser then views until the payload is sent.

aiohttp's HTTP parser never sees the bytes read this way, so it cannot find the start of a
next request on the connection: the connection closes after the answer (`Connection: close`
is sent, which HTTP clients honour by reconnecting; a 1 MiB body dwarfs a new connection).
"""

from __future__ import annotations

import asyncio
import collections
import mmap
import time
from typing import Final

from aiohttp import web

from disagg_runtime.memory.allocator import BuddyAllocator, MiB

MIN_TAKEOVER: Final = 1 * MiB  # smaller bodies are read by aiohttp as usual
STALL_S: Final = 5.0  # a large body that sends no byte for this long is 408, its slot freed
CLOSES: Final = web.RequestKey("closes", bool)


class BodyError(ConnectionError):
    """The connection ended before the whole body came."""


class BodyTimeout(BodyError, TimeoutError):
    """The whole body did not come before the deadline (a client that stalled)."""


class Slot:
    """`nbytes` bytes of memory for one body; `release` gives them back (idempotent)."""

    def __init__(self, arena: Arena | None, offset: int, view: memoryview) -> None:
        self._arena = arena
        self._offset = offset
        self.view = view

    def release(self) -> None:
        if self._arena is not None:
            self._arena.allocator.free(self._offset)
            self._arena = None


class Arena:
    """A private anonymous mapping with a buddy allocator over it. Pages are faulted in on
    first use and then stay, so the next body lands in memory that is already there; a
    body that does not fit (all slots busy) gets fresh memory of its own."""

    def __init__(self, size: int) -> None:
        self.size = max(size, MiB)
        self.allocator = BuddyAllocator(self.size, MiB)
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)

    def take(self, nbytes: int) -> Slot:
        offset = self.allocator.allocate(max(nbytes, 1))
        if offset is None:
            return Slot(None, 0, memoryview(bytearray(nbytes)))
        return Slot(self, offset, self._view[offset : offset + nbytes])


def arena_size(max_body: int) -> int:
    """Room for two bodies of the largest size at once (a power-of-two block each)."""
    block = MiB
    while block < max_body:
        block *= 2
    return 2 * block


class _Reader(asyncio.BufferedProtocol):
    """The transport's protocol while a body is read past aiohttp: fills `targets` in turn,
    and pauses reading once they are full (the next bytes are for the next targets)."""

    def __init__(self, owner: asyncio.BaseProtocol, transport: asyncio.Transport) -> None:
        self.owner = owner
        self.transport = transport
        self.targets: collections.deque[memoryview] = collections.deque()
        self.received = 0
        self.done: asyncio.Future[None] | None = None
        self.moved: asyncio.Future[None] | None = None  # set by the next bytes, however few
        self.failure: BodyError | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.targets[0]

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        if self.moved is not None and not self.moved.done():
            self.moved.set_result(None)
        first = self.targets[0]
        if nbytes < len(first):
            self.targets[0] = first[nbytes:]
            return
        self.targets.popleft()
        if not self.targets:
            self.transport.pause_reading()
            if self.done is not None and not self.done.done():
                self.done.set_result(None)

    def eof_received(self) -> bool | None:
        self._fail(BodyError("body ended before its Content-Length"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(BodyError("connection lost before the whole body came"))
        self.owner.connection_lost(exc)  # aiohttp cancels the handler, as for any disconnect

    def _fail(self, exc: BodyError) -> None:
        self.failure = self.failure or exc
        for waiter in (self.done, self.moved):
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)


class Body:
    """A request's body (Content-Length bytes), read into memory the caller names piece
    by piece (`fill`): a header into a small buffer, the data straight into its final
    place. What aiohttp already buffered is copied first; the rest is `recv_into`d by the
    event loop (the transport is handed to a `BufferedProtocol` until `close`, after which
    the connection closes once answered). `deadline` (time.monotonic) bounds the whole
    body: past it, `fill` raises BodyTimeout."""

    def __init__(self, request: web.Request, deadline: float, *, stall_s: float = STALL_S) -> None:
        self.length = request.content_length or 0
        self.deadline = deadline
        self.stall_s = stall_s
        self.filled = 0
        self._content = request.content
        self._left = memoryview(b"")  # buffered by aiohttp, read out, not yet placed
        self._reader: _Reader | None = None
        self._owner = request.protocol
        if self._content.is_eof():  # aiohttp has it all already: the connection stays in step
            return
        transport = request.transport
        if transport is None:
            raise BodyError("connection already closed")
        transport.pause_reading()  # until a `fill` names where the bytes go
        self._reader = _Reader(self._owner, transport)
        # from here on the transport's reads go to `_reader`; what aiohttp read stays queued
        transport.set_protocol(self._reader)
        request[CLOSES] = True

    async def fill(self, views: list[memoryview]) -> None:
        """Fill `views` in order with the body's next bytes."""
        want = sum(len(v) for v in views)
        if self.filled + want > self.length:
            raise BodyError(f"asked past the body's end ({self.length} bytes)")
        targets = collections.deque(v.cast("B") for v in views if len(v))
        self._place(targets)
        self.filled += want
        reader = self._reader
        if reader is not None:
            # reading aiohttp's buffer may have resumed the transport: nothing is asked yet
            reader.transport.pause_reading()
        if not targets:
            return
        if reader is None:  # aiohttp had it all, and it is shorter than said
            raise BodyError(f"body ended after {self.filled - want} of {self.length} bytes")
        if reader.failure is not None:
            raise reader.failure
        reader.targets = targets
        reader.done = asyncio.get_running_loop().create_future()
        reader.transport.resume_reading()
        try:
            await self._wait(reader, reader.done)
        finally:
            reader.transport.pause_reading()
            if reader.done.done() and not reader.done.cancelled():
                reader.done.exception()  # retrieved: a disconnect is reported by cancellation
            reader.done = None

    async def _wait(self, reader: _Reader, done: asyncio.Future[None]) -> None:
        """Until `done`, the deadline, or `stall_s` without a byte (BodyTimeout)."""
        while True:
            seen = reader.received
            left = self.deadline - time.monotonic()
            try:
                async with asyncio.timeout(max(0.0, min(left, self.stall_s))):
                    await asyncio.shield(done)
                return
            except TimeoutError:
                got = self.filled - sum(len(t) for t in reader.targets)
                if left <= self.stall_s:
                    raise BodyTimeout(
                        f"the request body was not received in time: {got} of {self.length} "
                        "bytes came before the deadline"
                    ) from None
                if reader.received == seen:
                    raise BodyTimeout(
                        f"the request body stalled: no byte for {self.stall_s:g} s after "
                        f"{got} of {self.length} bytes"
                    ) from None

    async def flowing(self, scratch: int = 64 << 10) -> None:
        """Wait until the body's data begins to arrive (at most `stall_s`; BodyTimeout):
        the first bytes are kept for the next `fill`. So a client that sends a header and
        stops holds no slot of the entry role's pool."""
        if self._left or self.filled >= self.length:
            return
        piece = self._content.read_nowait(-1)
        if piece:
            self._left = memoryview(piece)
            return
        reader = self._reader
        if reader is None:
            return
        if reader.failure is not None:
            raise reader.failure
        buffer = memoryview(bytearray(min(scratch, self.length - self.filled)))
        reader.targets = collections.deque([buffer])
        reader.moved = asyncio.get_running_loop().create_future()
        reader.transport.resume_reading()
        try:
            await self._wait(reader, reader.moved)
        finally:
            reader.transport.pause_reading()
            if reader.moved.done() and not reader.moved.cancelled():
                reader.moved.exception()
            reader.moved = None
            got = len(buffer) - sum(len(t) for t in reader.targets)
            reader.targets.clear()
            self._left = buffer[:got]

    def _place(self, targets: collections.deque[memoryview]) -> None:
        """Copy what aiohttp has buffered into `targets` (shortening them as they fill)."""
        while targets:
            if not self._left:
                piece = self._content.read_nowait(-1)
                if not piece:
                    return
                self._left = memoryview(piece)
            first = targets[0]
            n = min(len(first), len(self._left))
            first[:n] = self._left[:n]
            self._left = self._left[n:]
            if n == len(first):
                targets.popleft()
            else:
                targets[0] = first[n:]

    def close(self) -> None:
        """Give the connection back to aiohttp, which closes it after the answer."""
        reader, self._reader = self._reader, None
        if reader is None or reader.transport.is_closing():
            return
        reader.transport.set_protocol(self._owner)
        self._owner.close()  # aiohttp drops whatever else arrives and closes after the answer
        self._content.feed_eof()
        reader.transport.resume_reading()  # so that a disconnect still cancels the request


async def close_after(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: say `Connection: close` where the body bypassed aiohttp."""
    if request.get(CLOSES):
        response.force_close()
        response.headers["Connection"] = "close"  # aiohttp wrote its headers before this hook
