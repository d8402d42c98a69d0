"""The door of the tcp stripe connections (stripe_land.py): accepting them, the nonce
each is sent, reading its hello; nothing for a connection before its hello checks out.

One thread serves every connection that has not said its hello, through one selector:
each is sent a fresh nonce (32 hex chars) at once, may then send one length-prefixed
hello of at most MAX_HANDSHAKE_BYTES, and must do so within STRANGER_S; at most
MAX_STRANGERS wait at once (more are closed at once). A whole hello is handed to `admit`,
which says why it is refused (the connection is closed and the refusal counted) or takes
the connection over.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg_runtime.relay import auth, lane
from disagg_runtime.relay import protocol as proto

NONCE_CHARS = 2 * auth.NONCE_BYTES  # the challenge: the nonce as hex text
HELLO_PREFIX = struct.Struct("<I")
MAX_STRANGERS = 16  # connections before their hello; more are refused at once
STRANGER_S = 5.0  # a connection must say its hello this soon
ACCEPT_TICK_S = 0.5  # how often the acceptor looks at those deadlines

Admit = Callable[[socket.socket, str, bytes], "str | None"]  # (sock, nonce, hello) -> refusal


@dataclass(eq=False)
class _Stranger:
    sock: socket.socket
    nonce: str
    opened_at: float
    got: bytearray = field(default_factory=bytearray)


class Acceptor:
    """The acceptor thread over `listener` (see the module docstring)."""

    def __init__(self, listener: socket.socket, admit: Admit, refusals: auth.Refusals) -> None:
        self._listener = listener
        self._admit = admit
        self.refusals = refusals
        self.port: int = listener.getsockname()[1]
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(
            target=self._accept_loop, name="disagg-tcp-stripes", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        strangers: dict[int, _Stranger] = {}
        try:
            while not self._closed:
                for key, _ in sel.select(ACCEPT_TICK_S):
                    if key.fileobj is self._listener:
                        self._accept(sel, strangers)
                    elif key.fileobj is not self._wake_r:
                        self._hear(sel, strangers, key.fd)
                now = time.monotonic()
                for fd, s in list(strangers.items()):
                    if now - s.opened_at > STRANGER_S:
                        self.refusals.refuse("stripe connection: no hello in time")
                        self._drop_stranger(sel, strangers, fd)
        finally:
            for fd in list(strangers):
                self._drop_stranger(sel, strangers, fd)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, strangers: dict[int, _Stranger]) -> None:
        while (sock := lane.accept(self._listener)) is not None:
            if len(strangers) >= MAX_STRANGERS:
                self.refusals.refuse(f"{len(strangers)} stripe connections without a hello")
                sock.close()
                continue
            nonce = auth.nonce()
            try:
                sock.send(nonce.encode())  # 32 bytes into an empty buffer
            except OSError:
                sock.close()
                continue
            strangers[sock.fileno()] = _Stranger(sock, nonce, time.monotonic())
            sel.register(sock, selectors.EVENT_READ)

    def _drop_stranger(
        self, sel: selectors.BaseSelector, strangers: dict[int, _Stranger], fd: int
    ) -> _Stranger:
        s = strangers.pop(fd)
        sel.unregister(s.sock)
        s.sock.close()
        return s

    def _hear(self, sel: selectors.BaseSelector, strangers: dict[int, _Stranger], fd: int) -> None:
        """Read a stranger's hello; once whole, it is a stripe connection or closed."""
        s = strangers[fd]
        limit = HELLO_PREFIX.size + proto.MAX_HANDSHAKE_BYTES
        try:
            data = s.sock.recv(limit - len(s.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.refusals.refuse("stripe connection closed before its hello")
            self._drop_stranger(sel, strangers, fd)
            return
        s.got += data
        if len(s.got) < HELLO_PREFIX.size:
            return
        (size,) = HELLO_PREFIX.unpack_from(s.got)
        if size > proto.MAX_HANDSHAKE_BYTES:
            self.refusals.refuse(f"stripe hello of {size} B")
            self._drop_stranger(sel, strangers, fd)
            return
        if len(s.got) < HELLO_PREFIX.size + size:
            return
        strangers.pop(fd)
        sel.unregister(s.sock)
        if len(s.got) != HELLO_PREFIX.size + size:
            problem: str | None = "bytes after the hello"
        else:
            problem = self._admit(s.sock, s.nonce, bytes(s.got[HELLO_PREFIX.size :]))
        if problem is not None:
            self.refusals.refuse(f"stripe connection: {problem}")
            s.sock.close()


def listener_for(endpoint: str) -> socket.socket | None:
    """A listening socket for stripe connections beside a tcp:// ingress (None: another
    transport, or no port free)."""
    if not endpoint.startswith("tcp://"):
        return None
    listening = lane.listen(endpoint)
    return listening[0] if listening is not None else None
