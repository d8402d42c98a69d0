"""This process's membership of its replica's world (ranks.py draws the picture): joining
torch.distributed, starting the pod's other ranks, watching them, and the lost-world
decision that every rank shares (a failed collective means the replica restarts whole)."""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import torch
import torch.distributed as dist

from disagg_core.contract import Rank, RoleConfig
from disagg_runtime.role.handler import SetupContext

RANK_LOST_EXIT: Final = 3  # the exit code of a replica that lost a rank
WATCH_S: Final = 0.2
MIN_TIMEOUT_S: Final = 10.0
EXIT_WAIT_S: Final = 1.0  # a collective failed: how long a dying local rank may take to exit
_PR_SET_PDEATHSIG: Final = 1
log = logging.getLogger(__name__)


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _die_with_parent(parent: int) -> None:
    """preexec of a child rank: SIGKILL it when the pod's first process dies (it owns no
    memory of the replica's to release), and let only that process decide on SIGTERM."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class World:
    """This process's membership of its replica's world: the process groups, the child
    ranks it started (local rank 0 only) and whether the world is still whole."""

    def __init__(self, config: RoleConfig, rank: Rank) -> None:
        self.config = config
        self.rank = rank
        self.timeout_s = max(MIN_TIMEOUT_S, config.request_timeout)
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        self.broken: str | None = None
        self.closing = False  # rank 0 told the others to stop: their exits are no loss
        self._lost: list[Callable[[str], None]] = []
        self._watcher: threading.Thread | None = None
        self.group: Any = None
        self.feed_group: Any = None

    def spawn(self) -> None:
        """Start the pod's other ranks (local rank 0 only): the same environment plus theirs.
        Under `disagg up` (node-local) the leader also starts the group's other "pods", each
        the first process of its rank set (NODE_RANK k), which starts its own ranks."""
        from disagg_core.contract import PREFIX, pod_ranks

        for other in pod_ranks(self.config)[1:]:
            self._start(other.rank, other.env())
        if self.rank.node_rank == 0 and self.config.node_local:
            for node in range(1, self.config.nodes):
                self._start(node * self.config.ranks, {PREFIX + "NODE_RANK": str(node)})

    def _start(self, rank: int, env: dict[str, str]) -> None:
        self.children[rank] = subprocess.Popen(
            [sys.executable, "-m", "disagg_runtime.role.ranks"],
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        )

    def join(self) -> None:
        """Join the world (blocks until every rank has, or the timeout)."""
        os.environ.update(self.rank.env())
        kind = backend()
        if kind == "nccl":
            torch.cuda.set_device(self.rank.local_rank)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        dist.init_process_group(
            kind,
            init_method="env://",
            rank=self.rank.rank,
            world_size=self.rank.world_size,
            timeout=timeout,
        )
        self.group = dist.group.WORLD
        self.feed_group = self.group if kind == "gloo" else dist.new_group(backend="gloo")
        log.info(
            "rank %d/%d (local %d) joined via %s:%d (%s)",
            self.rank.rank,
            self.rank.world_size,
            self.rank.local_rank,
            self.rank.master_addr,
            self.rank.master_port,
            kind,
        )

    def on_lost(self, callback: Callable[[str], None]) -> None:
        self._lost.append(callback)
        if self._watcher is None and self.children:
            self._watcher = threading.Thread(target=self._watch, name="disagg-ranks", daemon=True)
            self._watcher.start()

    def lose(self, why: str) -> None:
        """The world is not whole any more (first reason wins)."""
        if self.broken is not None:
            return
        self.broken = why
        log.error("replica lost a rank: %s; it restarts whole", why)
        for callback in self._lost:
            callback(why)

    def lose_collective(self, exc: BaseException, why: str) -> None:
        """A collective failed: most often because a local rank just died, and its exit is
        the better reason (it names the rank), so wait up to EXIT_WAIT_S for one."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while self.broken is None and self.children:
            if self._exited():
                return
            if time.monotonic() > deadline:
                break
            time.sleep(WATCH_S / 4)
        self.lose(f"{why}: {type(exc).__name__}: {exc}")

    def _exited(self) -> bool:
        for rank, child in self.children.items():
            code = child.poll()
            if code is not None and not self.closing:
                self.lose(f"rank {rank} (pid {child.pid}) exited with code {code}")
                return True
        return False

    def _watch(self) -> None:
        while self.broken is None and not self.closing and not self._exited():
            time.sleep(WATCH_S)

    def close(self) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + 5.0
        for child in self.children.values():
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if dist.is_initialized() and self.broken is None:
            dist.destroy_process_group()

    def context(self, ctx: SetupContext) -> SetupContext:
        return dataclasses.replace(
            ctx, rank=self.rank.rank, world_size=self.rank.world_size, group=self.group
        )


def collective_failure(exc: BaseException) -> bool:
    names = {type(exc).__name__, *(t.__name__ for t in type(exc).__mro__)}
    if names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}:
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Timed out", "gloo", "NCCL")
    )
