"""What tests across the suite share: where the repository is, polling until something holds,
a free loopback port, and a Secret volume as the kubelet lays it out. Plain Python, no
pytest: the GPU checks run it on a bare machine."""

from __future__ import annotations

import os
import pathlib
import socket
import time
from collections.abc import Callable
from typing import Final, TypeVar

REPO: Final = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES: Final = REPO / "examples"
WAIT: Final = 10.0  # a generous upper bound for anything that should happen "soon"

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = WAIT,
    *,
    interval: float = 0.01,
    message: str | Callable[[], str] = "condition",
) -> T:
    """Polls `predicate` every `interval` seconds until it returns something truthy, and
    returns that. After `timeout` seconds, AssertionError naming `message`; a callable one is
    asked then, so that it can describe the state at the time."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            what = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def wait_until(
    predicate: Callable[[], object],
    timeout: float = WAIT,
    what: str | Callable[[], str] = "the condition",
    *,
    interval: float = 0.05,
) -> None:
    """`wait_for` for a predicate whose value is not needed; `what` names the condition
    (a callable is asked at the timeout, to describe the state then)."""
    wait_for(predicate, timeout, interval=interval, message=what)


def free_port() -> int:
    """A loopback TCP port free right now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SecretVolume:
    """A directory laid out as the kubelet lays out a Secret volume."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.generation = 0
        (root / "token").symlink_to("..data/token")

    def write(self, value: str) -> None:
        self.generation += 1
        fresh = self.root / f"..2026_12_01_{self.generation}"
        fresh.mkdir()
        (fresh / "token").write_text(value)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(fresh.name)
        os.replace(tmp, self.root / "..data")  # the atomic swap

    @property
    def path(self) -> str:
        return str(self.root / "token")
