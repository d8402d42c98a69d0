"""The lane: a plain stream socket beside the ZMQ socket, for the latency-bound messages.

Why: one ZMQ message crosses three threads (the sender's ZMQ I/O thread, the receiver's
ZMQ I/O thread, then the application thread), and on small VMs each wake-up costs
20-50 us. A plain socket read by the ingress's own poll loop is woken once: a 4 KiB
payload arrives in about a third of the time. Every sender puts its `inline` and `abort`
messages on the lane, and says `control` in its hello: it runs its credit protocol there,
replies included (an shm sender all of it; a tcp sender all but the commit, whose chunks
follow it on ZMQ).

Frames, all lengths little-endian u32:

    [header length][data length][header: the inline control JSON][data: the slot's bytes]

(an `inline` header is binary where the welcome offers `inline_wire`, an shm `commit`
where it offers `commit_wire`: relay/inline_wire.py)

The lane opens with one frame whose header is `{"op": "lane", "id": <token>, "mac": ...}`
(no data): the one-time token the authenticated welcome gave the sender over ZMQ, so the
ingress can tie the lane to that sender (and refuse a lane that reached another
ingress), and a MAC of it under the peer key (relay/auth.py). Until that hello, a lane
is read only up to a hello's size, and must say it within a few seconds. `abort`s
travel on the lane too, behind the inline payloads they follow. The sender numbers its
lane frames; a later reservation says how many it had sent (`lane`), and the
ingress grants it only once it has taken that many from the lane, so a staged payload
is never delivered ahead of an inline one sent before it.

Anything malformed (a length over the limits, a bad first frame) closes the connection;
the sender then falls back to inline messages over ZMQ. The ingress's reader allocates a
frame only when its inline budget admits it; until then the frame stays in the kernel's
buffers and the sender stalls (flow control, as a full pool stalls staged payloads).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from disagg_runtime.relay.errors import RelayError
from disagg_runtime.relay.protocol import (
    MAX_CONTROL_BYTES,
    MAX_HANDSHAKE_BYTES,
    MAX_INLINE_MESSAGE_BYTES,
)

PREFIX = struct.Struct("<II")
READY = b"\x01"  # the ingress's one-byte answer to the hello: the lane is tied to its sender
SCRATCH_BYTES = 64 << 10  # per connection: small frames are cut from it
MAX_CONNECTIONS = 1024  # per ingress (each holds a socket and its scratch buffer)
MAX_FRAMES_PER_READ = 64  # then back to the poll loop, so one busy lane cannot starve others
HELLO_LIMITS = (MAX_HANDSHAKE_BYTES, 0)  # (header, data) bytes a frame may declare
FRAME_LIMITS = (MAX_CONTROL_BYTES, MAX_INLINE_MESSAGE_BYTES)


class LaneError(RelayError):
    """The lane's byte stream broke the framing, or its peer went away."""


def frame_prefix(header: bytes, data_bytes: int) -> bytes:
    return PREFIX.pack(len(header), data_bytes)


def send_frame(sock: socket.socket, header: bytes, data: bytes | bytearray | memoryview) -> None:
    """Write one frame whole. On a blocking socket with a send timeout (`set_send_timeout`)
    a receiver that stops reading raises BlockingIOError (on a non-blocking one, a full
    buffer does at once); the stream is then cut mid-frame and must be closed."""
    if not data:  # a control frame: one short buffer
        sock.sendall(PREFIX.pack(len(header), 0) + header)
        return
    parts = [frame_prefix(header, len(data)), header, data]
    total = sum(len(p) for p in parts)
    sent = sock.sendmsg(parts)
    if sent < total:  # a partial write: finish from where it stopped
        sock.sendall((b"".join(bytes(p) for p in parts))[sent:])


def frame_buffer(header: bytes, data_bytes: int) -> tuple[bytearray, int]:
    """One buffer for a whole frame, its prefix and header written, and where its data goes:
    the caller writes the data in place and sends it with `send_whole` (one copy of the data
    and one system call, where `send_frame` takes the data already built elsewhere)."""
    at = PREFIX.size + len(header)
    frame = bytearray(at + data_bytes)
    PREFIX.pack_into(frame, 0, len(header), data_bytes)
    frame[PREFIX.size : at] = header
    return frame, at


def send_whole(sock: socket.socket, frame: bytearray) -> None:
    """Write a frame built by `frame_buffer` whole; failures as for `send_frame`."""
    sock.sendall(frame)


class Frame:
    """One received frame: `header` bytes and `data`, a writable view the tensors keep."""

    __slots__ = ("charge", "data", "header")

    def __init__(self, body: bytearray, header_bytes: int, charge: int = 0) -> None:
        view = memoryview(body)
        self.header = view[:header_bytes]
        self.data = view[header_bytes:]
        self.charge = charge  # bytes the reader's `admit` granted for it (returned by its user)


class LaneReader:
    """Cuts one non-blocking connection's stream into frames. `read()` takes what the
    socket holds now and returns the frames completed; LaneError when the peer closed or
    broke the framing. Small frames are cut out of a scratch buffer (one system call for
    many); a large one is received straight into its own buffer.

    `limits` bounds what a frame may declare (header, data); `admit(nbytes)`, when given, is
    asked before a frame's buffer is allocated: on False the reader stops (`blocked`), the
    frame's prefix kept, and retries on the next `read()`."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        admit: Callable[[int], bool] | None = None,
        limits: tuple[int, int] = FRAME_LIMITS,
    ) -> None:
        self.sock = sock
        self.limits = limits
        self._admit = admit
        self.blocked = False
        self.started_at = time.monotonic()  # when the frame now arriving began to
        self._scratch = bytearray(SCRATCH_BYTES)
        self._view = memoryview(self._scratch)  # never resized: the view stays valid
        self._have = 0  # bytes at the start of scratch not yet parsed
        self._body: bytearray | None = None  # the frame being filled
        self._header_bytes = 0
        self._got = 0
        self._charge = 0

    @property
    def partial(self) -> bool:
        """A frame has begun and is not complete."""
        return self._body is not None or self._have > 0

    def read(self) -> list[Frame]:
        frames: list[Frame] = []
        if self.blocked:  # retry the frame that did not fit
            self.blocked = False
            self._parse(frames)
            if self.blocked:
                return frames
        recv_into = self.sock.recv_into
        while len(frames) < MAX_FRAMES_PER_READ and not self.blocked:
            body = self._body
            target = memoryview(body)[self._got :] if body is not None else self._view[self._have :]
            try:  # never waits, on a blocking socket too (the sender reads its replies so)
                n = recv_into(target, 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return frames
            except OSError as exc:
                raise LaneError(f"lane connection failed: {exc}") from None
            if n == 0:
                raise LaneError("lane closed by the other end")
            if body is not None:
                self._got += n
                self._complete(frames)
            else:
                if not self._have:  # a trickle keeps no frame alive longer than its deadline
                    self.started_at = time.monotonic()
                self._have += n
                self._parse(frames)
            if n < target.nbytes:
                break  # the socket is drained for now (poll says when there is more)
        return frames

    def _parse(self, frames: list[Frame]) -> None:
        """Cut the frames whose prefix is in scratch: each one complete there is copied out
        at once (one allocation, one copy); the first one that is not becomes `_body`, and
        the rest of it is received straight into it."""
        used, have = 0, self._have
        max_header, max_data = self.limits
        admit = self._admit
        while self._body is None and have - used >= PREFIX.size:
            header_bytes, data_bytes = PREFIX.unpack_from(self._scratch, used)
            if header_bytes > max_header or data_bytes > max_data:
                raise LaneError(
                    f"lane frame of {header_bytes} + {data_bytes} B is over the limits "
                    f"({max_header} B header, {max_data} B data)"
                )
            total = header_bytes + data_bytes
            if admit is not None and not admit(total):
                self.blocked = True  # the prefix stays: parsed again on the next read
                break
            used += PREFIX.size
            charge = total if admit is not None else 0
            end = used + total
            if end <= have:  # all here
                frames.append(Frame(bytearray(self._view[used:end]), header_bytes, charge))
                used = end
                continue
            self._body = bytearray(total)
            self._body[: have - used] = self._view[used:have]
            self._header_bytes, self._got, self._charge = header_bytes, have - used, charge
            used = have
        if used == have:
            self._have = 0
        elif used:  # keep the start of a frame whose prefix is not complete yet
            self._scratch[: have - used] = self._scratch[used:have]
            self._have = have - used

    def _complete(self, frames: list[Frame]) -> None:
        if self._body is not None and self._got == len(self._body):
            frames.append(Frame(self._body, self._header_bytes, self._charge))
            self._body = None
            self._charge = 0

    def abandon(self) -> int:
        """Drop the frame being received; returns what `admit` had granted for it."""
        charge, self._charge, self._body = self._charge, 0, None
        return charge

    def close(self) -> None:
        self.sock.close()


def _tcp_host(endpoint: str) -> str:
    """`tcp://host:port` (host may be [v6]) -> host."""
    return endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")


def _bind_host(host: str) -> str:
    """The address to listen on beside a ZMQ endpoint bound to `host`."""
    if host in ("*", ""):
        return "::"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host  # a name: let getaddrinfo pick
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)  # ZMQ reports IPv4 binds as ::ffff:a.b.c.d when dual-stack
    return "::" if ip.is_unspecified else host


def listen(endpoint: str, port: int = 0) -> tuple[socket.socket, dict[str, Any]] | None:
    """A listening socket for the lane of the ingress bound at `endpoint` (its LAST_ENDPOINT),
    on `port` for tcp (0: any free one), and what the welcome tells senders about it; None
    when the endpoint has no lane. OSError when a fixed port is taken."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :] + ".lane"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            sock.bind(path)
        except OSError:
            sock.close()
            return None
        sock.listen(64)
        sock.setblocking(False)
        return sock, {"lane_path": path}
    if not endpoint.startswith("tcp://"):
        return None
    host = _bind_host(_tcp_host(endpoint))
    try:
        if host == "::" and socket.has_dualstack_ipv6():
            sock = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            if host == "::":
                host = "0.0.0.0"
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            sock = socket.create_server((host, port), family=family)
    except OSError:
        if port:
            raise  # a declared port must be ours: say so rather than serve without it
        return None
    sock.setblocking(False)
    return sock, {"lane_port": sock.getsockname()[1]}


def accept(listener: socket.socket) -> socket.socket | None:
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return None
    conn.setblocking(False)
    if conn.family != socket.AF_UNIX:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def connect(endpoint: str, welcome: dict[str, Any], timeout: float) -> socket.socket | None:
    """Open the lane the welcome from the ingress at `endpoint` offers (None: it offers none).
    OSError when it cannot be reached. The socket has `timeout` for connecting; see
    `set_send_timeout` for sending."""
    path, port = welcome.get("lane_path"), welcome.get("lane_port")
    if isinstance(path, str) and endpoint.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        return sock
    if type(port) is not int or not endpoint.startswith("tcp://"):
        return None
    sock = socket.create_connection((_tcp_host(endpoint), port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """Make `sock` blocking with a kernel send timeout: a send then costs one system call
    (Python's own socket timeouts poll before every send)."""
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
