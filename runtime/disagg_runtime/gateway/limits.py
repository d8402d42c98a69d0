"""What the gateway bounds before a request is authenticated: connections, idle and slow
headers, and the JSON bytes it holds at once.

- Idle and slow headers: aiohttp's `keepalive_timeout` (the `RequestHandler` arms it when a
  connection opens and after each answer, and closes the connection if the next request's
  headers are not complete by then) is the gateway's `idle_timeout`: one bound for a
  connection that sends nothing, one that trickles its headers (slowloris), and an idle
  keep-alive connection. Header size and count are aiohttp's (`max_line_size`,
  `max_field_size`, 8 KiB each, at most 128 headers). Bodies have the request timeout.
- Connections: `Runner` (an aiohttp `AppRunner`) answers a connection past
  `max_connections` with `503` and closes it at once, before its first byte is parsed.
- JSON bodies: `Budget` holds the bytes of JSON bodies being read and parsed (at most
  `json_in_flight` together): a body that does not fit is 429 with Retry-After before it is
  read. Parsed JSON costs several times its size, so the JSON limit is lower than the
  safetensors one (large tensors belong in safetensors, which lands in place). After a
  large body, `give_back` returns freed heap to the system (glibc `malloc_trim`), which it
  otherwise keeps.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time
from typing import Any, Final

from aiohttp import web

BUSY: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
    b"Connection: close\r\n\r\n"
)
TRIM_AFTER: Final = 1 << 20  # bodies at least this large give memory back after parsing
TRIM_EVERY_S: Final = 1.0


class Runner(web.AppRunner):
    """An AppRunner whose server turns away connections over `max_connections`."""

    def __init__(self, app: web.Application, *, max_connections: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.max_connections = max_connections
        self.refused = 0
        self._open: set[object] = set()

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            if len(self._open) >= self.max_connections:
                self.refused += 1
                transport.write(BUSY)
                handler.force_close()
                transport.close()
                return
            self._open.add(handler)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self._open.discard(handler)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]
        return server

    @property
    def open_connections(self) -> int:
        return len(self._open)


class Budget:
    """Bytes held at once by some kind of work; `take` says whether `n` more fit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)


_libc: Any = None
_trimmed = [float("-inf")]


def give_back(nbytes: int) -> None:
    """After a body of `nbytes`: return the freed heap to the system (glibc only; at most
    once per TRIM_EVERY_S). Cheap to call; runs `malloc_trim` on the caller's thread."""
    global _libc
    now = time.monotonic()
    if nbytes < TRIM_AFTER or now - _trimmed[0] < TRIM_EVERY_S:
        return
    _trimmed[0] = now
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name) if name else False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is not None:
        trim(0)


class Uploads:
    """Large (staged) uploads at once, in total and per client address: each holds a slot
    of the entry role's pool (or the arena) while its body comes."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self._by_client: dict[str, int] = {}
        self.active = 0

    def enter(self, client: str) -> str:
        """ "" when the upload may go on (then `leave` once done), else why not."""
        if self.active >= self.total:
            return f"{self.active} large uploads are in flight (at most {self.total})"
        mine = self._by_client.get(client, 0)
        if mine >= self.per_client:
            return f"this client has {mine} large uploads in flight (at most {self.per_client})"
        self.active += 1
        self._by_client[client] = mine + 1
        return ""

    def leave(self, client: str) -> None:
        self.active -= 1
        left = self._by_client.pop(client, 1) - 1
        if left:
            self._by_client[client] = left
