"""A replica of several ranks (`roles[].ranks` per pod x `roles[].nodes` pods): one world.

    pod 0 (leader)                                   pod k (worker, nodes > 1)
    disagg role = rank 0 ── RoleRuntime: ingress,    disagg role = rank k*N ── worker loop
      │                    pool, senders, metrics,     └─ children: ranks k*N+1 ..
      │                    probes; LeaderHandler
      └─ children: ranks 1..N-1 ── worker loop
                 (python -m disagg_runtime.role.ranks)

Every rank joins one torch.distributed world (the contract's RANK_ENV: env://, backend
NCCL where the process sees a GPU, one GPU per local rank, else gloo) and gets it in
`setup(ctx)` as `ctx.group`, with `ctx.rank` and `ctx.world_size`. Rank 0 hands each request
to the others through the feed (rankfeed.py, a gloo group of its own) before calling its own
handler, so every rank calls the handler with the same inputs in the same order, and their
collectives meet; rank 0's output is the one sent on. Calls are serialised across the
replica (one collective sequence); a streaming output advances one step at a time, so
several streams interleave.

Locally (`disagg up`, node-local) a group of `nodes` pods is simulated: the leader also starts
the first process of each other rank set, which starts its own ranks; the feed broadcasts
then, as between pods.

Failure: a replica is whole or gone. Every collective has the group's timeout; rank 0
sends a keep-alive when idle so that the others' waits can time out too. A local rank that
exits is seen by its pod's first process within WATCH_S; a rank elsewhere makes the next
collective fail. Rank 0 then fails what is in flight (RankLost, naming the rank), releases its
pool and exits with RANK_LOST_EXIT, and its children die with it (SIGTERM on parent death):
the supervisor (`disagg up`) or the kubelet starts the replica again, whole.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import datetime
import functools
import inspect
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch
import torch.distributed as dist

from disagg_core.contract import Rank, RoleConfig, rank_of
from disagg_runtime.role import rankfeed
from disagg_runtime.role.handler import Handler, SetupContext, default_device, load

RANK_LOST_EXIT: Final = 3  # the exit code of a replica that lost a rank
KEEPALIVE_S: Final = 2.0
WATCH_S: Final = 0.2
MIN_TIMEOUT_S: Final = 10.0
_PR_SET_PDEATHSIG: Final = 1
log = logging.getLogger(__name__)


class RankLost(RuntimeError):
    """Another rank of this replica is gone: the replica restarts whole."""


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

    def _watch(self) -> None:
        while self.broken is None and not self.closing:
            for rank, child in self.children.items():
                code = child.poll()
                if code is not None and not self.closing:
                    self.lose(f"rank {rank} (pid {child.pid}) exited with code {code}")
                    return
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


class LeaderHandler:
    """Rank 0's handler: each call goes to the other ranks through the feed first. A class
    instance with setup/__call__/batch/close, so that `Handler` wraps it like any other."""

    def __init__(self, inner: Handler, world: World, feed: rankfeed.Feed) -> None:
        self.inner = inner
        self.world = world
        self.feed = feed
        self._lock = threading.Lock()  # one call (or stream step) of the replica at a time
        self._retired: collections.deque[tuple[int, int]] = collections.deque()
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        if not inner.can_batch:
            self.batch = None  # type: ignore[assignment]  # Handler then calls __call__

    def setup(self, ctx: SetupContext) -> None:
        with self._lock:
            self._post(rankfeed.HELLO)
        self.inner.setup(self.world.context(ctx))
        threading.Thread(target=self._keepalive, name="disagg-ranks-keepalive", daemon=True).start()

    def __call__(self, payload: Any) -> Any:
        with self._lock:
            seq = self._post(rankfeed.CALL, payload)
            with _Guard(self.world):
                result = self.inner(payload)
        return self._streamed(result, seq, 0)

    def batch(self, payloads: list[Any]) -> list[Any]:
        with self._lock:
            seq = self._post(rankfeed.BATCH, payloads)
            with _Guard(self.world):
                outputs = self.inner.batch(payloads)
        return [self._streamed(out, seq, i) for i, out in enumerate(outputs)]

    def close(self) -> None:
        self._closed.set()
        self.world.closing = True  # the ranks leaving now is the plan, not a loss
        if self.world.broken is None:
            with self._lock:
                self._post(rankfeed.STOP)
        self.inner.close()

    def _post(self, kind: int, payload: Any = None) -> int:
        """Send one notice (the caller holds the lock); first the ENDs of dropped streams."""
        with _Guard(self.world):
            while self._retired:
                seq, index = self._retired.popleft()
                self.feed.send(rankfeed.END, {"seq": seq, "index": index})
            if kind == rankfeed.HELLO:
                self.feed.hello()
            else:
                self.feed.send(kind, payload)
        self._last_sent = time.monotonic()
        return self.feed.seq

    def _streamed(self, result: Any, seq: int, index: int) -> Any:
        """A generator output advances one step at a time, each step a NEXT on every rank;
        one dropped before its end is ENDed on the others with the next notice."""
        if not inspect.isgenerator(result):
            return result
        stream = self._stream(result, seq, index)
        weakref.finalize(stream, self._retired.append, (seq, index))
        return stream

    def _stream(self, inner: Iterator[Any], seq: int, index: int) -> Iterator[Any]:
        try:
            while True:
                with self._lock:
                    self._post(rankfeed.NEXT, {"seq": seq, "index": index})
                    try:
                        with _Guard(self.world):
                            chunk = next(inner)
                    except StopIteration:
                        return
                yield chunk
        finally:
            close = getattr(inner, "close", None)
            if close is not None:
                close()

    def _keepalive(self) -> None:
        while not self._closed.wait(KEEPALIVE_S / 4):
            if self.world.broken is not None:
                return
            if time.monotonic() - self._last_sent < KEEPALIVE_S:
                continue
            if not self._lock.acquire(blocking=False):
                continue
            try:
                self._post(rankfeed.KEEPALIVE)
            except Exception as exc:
                self.world.lose(f"the feed failed: {type(exc).__name__}: {exc}")
            finally:
                self._lock.release()


class _Guard:
    """Turns any failure while another rank is gone into RankLost, naming that rank, and a
    failure of a collective into a lost world."""

    def __init__(self, world: World) -> None:
        self.world = world

    def __enter__(self) -> None:
        if self.world.broken is not None:
            raise RankLost(f"replica lost a rank ({self.world.broken}); it restarts")

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        if exc is None or isinstance(exc, RankLost):
            return
        world = self.world
        if world.broken is None and _collective_failure(exc):
            world.lose(f"a collective failed: {type(exc).__name__}: {exc}")
        if world.broken is not None:
            raise RankLost(
                f"replica lost a rank ({world.broken}); this request failed, the replica restarts"
            ) from exc


def _collective_failure(exc: BaseException) -> bool:
    names = {type(exc).__name__, *(t.__name__ for t in type(exc).__mro__)}
    if names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}:
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Timed out", "gloo", "NCCL")
    )


# ---- ranks other than 0 -------------------------------------------------------------------
def serve_rank(config: RoleConfig, world: World, handler: Handler) -> int:
    """The loop of every rank but 0: the feed's notices in order, until STOP."""
    feed = rankfeed.Feed(world.feed_group, rank=world.rank.rank)
    hello = feed.receive()
    if hello.kind != rankfeed.HELLO:
        raise rankfeed.FeedError(f"rank feed: expected a hello, got kind {hello.kind}")
    ctx = SetupContext(
        role=config.role,
        replica=config.replica,
        device=default_device(),
        args=config.handler_args,
        log=logging.getLogger(f"disagg.handler.{config.role}"),
    )
    handler.setup(world.context(ctx))
    streams: dict[tuple[int, int], Iterator[Any]] = {}
    try:
        while True:
            notice = feed.receive()
            if notice.kind == rankfeed.STOP:
                return 0
            _follow(handler, notice, streams)
    finally:
        for stream in streams.values():
            _quietly(getattr(stream, "close", lambda: None))
        _quietly(handler.close)
        feed.close()


def _follow(handler: Handler, notice: rankfeed.Notice, streams: dict[Any, Iterator[Any]]) -> None:
    """One notice: what rank 0 does now, done here too (outputs other than streams dropped;
    a handler error is rank 0's to report, it raised the same)."""
    if notice.kind in (rankfeed.CALL, rankfeed.BATCH):
        calls = [notice.payload] if notice.kind == rankfeed.CALL else None
        try:
            outputs = [handler(calls[0])] if calls else handler.batch(list(notice.payload))
        except Exception as exc:
            log.debug("handler raised on this rank too: %s", exc)
            return
        for index, output in enumerate(outputs):
            if inspect.isgenerator(output):
                streams[(notice.seq, index)] = output
    elif notice.kind in (rankfeed.NEXT, rankfeed.END):
        key = (int(notice.payload["seq"]), int(notice.payload["index"]))
        stream = streams.get(key)
        if stream is None:
            return
        if notice.kind == rankfeed.END:
            streams.pop(key)
            _quietly(getattr(stream, "close", lambda: None))
            return
        try:
            next(stream)
        except StopIteration:
            streams.pop(key)
        except Exception as exc:
            log.debug("stream raised on this rank too: %s", exc)
            streams.pop(key)


def _quietly(action: Callable[[], Any]) -> None:
    try:
        action()
    except Exception:
        log.exception("rank shutdown step failed")


# ---- entry points -------------------------------------------------------------------------
def main(config: RoleConfig) -> int:
    """`disagg role` for a replica of several ranks (runtime.main hands over here), and the
    child ranks' entry point (`python -m disagg_runtime.role.ranks`)."""
    rank = rank_of(config, os.environ)
    world = World(config, rank)
    if rank.local_rank == 0:
        world.spawn()
    try:
        handler = load(config.handler)
        world.join()
        if rank.leader:
            return _lead(config, world, handler)
        if world.children:  # a worker pod's first rank dies with any of its children
            world.on_lost(lambda why: os._exit(RANK_LOST_EXIT))
        return serve_rank(config, world, handler)
    except rankfeed.FeedError as exc:
        log.error("rank %d: %s", rank.rank, exc)
        return RANK_LOST_EXIT
    except Exception as exc:
        if _collective_failure(exc):
            log.error("rank %d lost its world: %s", rank.rank, exc)
            return RANK_LOST_EXIT
        raise
    finally:
        world.close()


def _lead(config: RoleConfig, world: World, handler: Handler) -> int:
    from disagg_runtime.role.runtime import RoleRuntime

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    world.on_lost(lambda why: stop.set())
    feed = rankfeed.Feed(world.feed_group, rank=0)
    role = RoleRuntime(config, handler=Handler(LeaderHandler(handler, world, feed), handler.name))
    if config.nodes == 1:  # every rank in this pod: they read inputs from the pool itself
        feed.use_pool(role.pool)
    try:
        role.start()
    except BaseException:
        role.stop(grace_s=0)
        raise
    while not stop.wait(0.5):
        pass
    role.stop(grace_s=0 if world.broken else None)
    return RANK_LOST_EXIT if world.broken else 0


if __name__ == "__main__":  # a child rank
    from disagg_core.contract import from_environ

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(main(from_environ()))
