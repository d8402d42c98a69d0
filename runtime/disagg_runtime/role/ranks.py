"""A replica of several ranks (`roles[].ranks` per pod x `roles[].nodes` pods): one world.

    pod 0 (leader)                                   pod k (worker, nodes > 1)
    disagg role = rank 0 ── RoleRuntime: ingress,    disagg role = rank k*N ── worker loop
      │                    pool, senders, metrics,     └─ children: ranks k*N+1 ..
      │                    probes; leader.py
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

import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from disagg_core.contract import RoleConfig, rank_of
from disagg_runtime.role import rankfeed
from disagg_runtime.role.handler import Handler, SetupContext, default_device, load
from disagg_runtime.role.leader import LeaderHandler, RankLost
from disagg_runtime.role.world import RANK_LOST_EXIT, World, collective_failure

__all__ = ["RANK_LOST_EXIT", "RankLost", "main", "serve_rank"]
log = logging.getLogger(__name__)


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
        if collective_failure(exc):
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
    feed = rankfeed.Feed(world.feed_group, rank=0, private=handler.writes_inputs)
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
