"""Ports that `disagg up` promises to its roles before they bind them.

A probe bind says a port is free now, not that it stays free until the role binds it: two
launchers on one machine (two `disagg up`, a bench beside a test) could each promise the
same port to a role of theirs, and one role would fail to start (EADDRINUSE). So every
promised port is also claimed: an exclusive flock on a per-port file in a per-user
directory, held while the iterator that promised it lives. Another launcher skips a
claimed port. A flock dies with its process, so a SIGKILLed launcher leaves no claim the
next one has to clear (the empty files stay; they hold nothing).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from collections.abc import Generator

HOST = "127.0.0.1"


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port-0 binds (net.ipv4.ip_local_port_range)."""
    with (
        contextlib.suppress(OSError, ValueError),
        open("/proc/sys/net/ipv4/ip_local_port_range") as f,
    ):
        low, high = (int(p) for p in f.read().split())
        return low, high
    return 32768, 60999


def claims_dir() -> str:
    """Where this user's launchers claim ports (private: 0700)."""
    path = os.path.join(tempfile.gettempdir(), f"disagg-ports-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _claim(directory: str, port: int) -> int | None:
    """An fd holding the claim on `port`, or None where another launcher holds it."""
    fd = os.open(os.path.join(directory, str(port)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_ports(rng: random.Random | None = None) -> Generator[int, None, None]:
    """Ports free now and claimed while this iterator lives, never the same one twice, and
    outside the kernel's ephemeral range: a role's lane binds port 0 while its neighbours
    start, and the kernel could otherwise hand it a port already promised to another
    role's ingress or metrics server."""
    rng = rng or random.Random()
    low, _ = ephemeral_range()
    first = max(1024, low - 16384)
    if low - first < 256:  # an unusual range: fall back to what the kernel picks
        first, low = low, 65536
    directory = claims_dir()
    held: list[int] = []  # the claims' fds: closed (released) with the generator
    seen: set[int] = set()
    try:
        while True:
            port = rng.randrange(first, low)
            if port in seen:
                continue
            seen.add(port)
            fd = _claim(directory, port)
            if fd is None:
                continue
            if not _bindable(port):
                os.close(fd)
                continue
            held.append(fd)
            yield port
    finally:
        for fd in held:
            os.close(fd)
