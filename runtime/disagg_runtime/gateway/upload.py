"""Large request bodies read from the socket straight into reusable memory.

aiohttp reads a body in pieces of at most 256 KiB into fresh `bytes` objects, and each
piece must then be copied again to where it belongs; for a 64 MiB body that is hundreds of
allocations, two copies and fresh pages to fault in. Here the connection's transport is
handed to a `BufferedProtocol` for the rest of the body: the event loop `recv_into`s the
kernel's data directly at its place in a slot of an `Arena` (memory faulted in once and
reused body after body), so the body is copied once, by the kernel. The safetensors parser
then views that memory, and the slot goes back to the arena as soon as the payload has been
written into the entry role's pool.

aiohttp's HTTP parser never sees the bytes read this way, so it cannot find the start of a
next request on the connection: the connection closes after the answer (`Connection: close`
is sent, which HTTP clients honour by reconnecting; a 64 MiB body dwarfs a new connection).
"""

from __future__ import annotations

import asyncio
import mmap
from typing import Final

from aiohttp import StreamReader, web

from disagg_runtime.allocator import BuddyAllocator, MiB

MIN_TAKEOVER: Final = 1 * MiB  # smaller bodies are read by aiohttp as usual
CLOSES: Final = web.RequestKey("closes", bool)


class BodyError(ConnectionError):
    """The connection ended (or stalled past the deadline) before the whole body came."""


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
    """Fills `view` from `filled` on; the transport's protocol until it is full."""

    def __init__(self, view: memoryview, filled: int, owner: asyncio.BaseProtocol) -> None:
        self.view = view
        self.filled = filled
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.filled >= len(self.view) and not self.done.done():
            if self.transport is not None:
                self.transport.pause_reading()  # the next bytes are not this body's
            self.done.set_result(None)

    def eof_received(self) -> bool | None:
        self._fail(BodyError(f"body ended after {self.filled} of {len(self.view)} bytes"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(BodyError(f"connection lost after {self.filled} of {len(self.view)} bytes"))
        self.owner.connection_lost(exc)  # aiohttp cancels the handler, as for any disconnect

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


async def read_into(request: web.Request, view: memoryview, timeout: float) -> None:
    """Fill `view` with the request's whole body (len(view) == Content-Length)."""
    content = request.content
    if content.is_eof():  # aiohttp has it all already: the connection stays in step
        _drain(content, view, 0)
        return
    transport = request.transport
    if transport is None:
        raise BodyError("connection already closed")
    owner = request.protocol
    reader = _Reader(view, 0, owner)
    reader.transport = transport
    # from here on the transport's reads go to `reader`; what aiohttp read before is queued
    transport.set_protocol(reader)
    request[CLOSES] = True
    try:
        reader.filled = _drain(content, view, 0)
        if reader.filled < len(view):
            transport.resume_reading()  # aiohttp may have paused it (its buffer was full)
            async with asyncio.timeout(timeout):
                await reader.done
    except TimeoutError:
        raise BodyError(f"body not received within {timeout} s") from None
    finally:
        if reader.done.done() and not reader.done.cancelled():
            reader.done.exception()  # retrieved: a disconnect is reported by cancellation
        if not transport.is_closing():
            transport.set_protocol(owner)
            owner.close()  # aiohttp drops whatever else arrives and closes after the answer
            content.feed_eof()
            transport.resume_reading()  # so that a disconnect still cancels the request


def _drain(content: StreamReader, view: memoryview, filled: int) -> int:
    """Copy what aiohttp has buffered of the body into `view` from `filled`; the new end."""
    while piece := content.read_nowait(-1):
        if filled + len(piece) > len(view):
            raise BodyError(f"body is longer than its Content-Length ({len(view)})")
        view[filled : filled + len(piece)] = piece
        filled += len(piece)
    return filled


async def close_after(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: say `Connection: close` where the body bypassed aiohttp."""
    if request.get(CLOSES):
        response.force_close()
        response.headers["Connection"] = "close"  # aiohttp wrote its headers before this hook
