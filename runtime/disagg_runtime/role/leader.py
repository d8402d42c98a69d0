"""Rank 0's handler wrapper (ranks.py draws the picture): every call, batch and stream step
goes to the other ranks through the feed before rank 0's own handler runs, one at a time
across the replica, with a keep-alive when idle so that the others' waits carry a timeout;
any failure while the world is broken becomes RankLost, naming the rank."""

from __future__ import annotations

import collections
import inspect
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Final

from disagg_runtime.role import rankfeed
from disagg_runtime.role.handler import Handler, SetupContext
from disagg_runtime.role.world import World, collective_failure

KEEPALIVE_S: Final = 2.0


class RankLost(RuntimeError):
    """Another rank of this replica is gone: the replica restarts whole."""


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
            with Guard(self.world):
                result = self.inner(payload)
        return self._streamed(result, seq, 0)

    def batch(self, payloads: list[Any]) -> list[Any]:
        with self._lock:
            seq = self._post(rankfeed.BATCH, payloads)
            with Guard(self.world):
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
        with Guard(self.world):
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
                        with Guard(self.world):
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
                self.world.lose_collective(exc, "the feed failed")
            finally:
                self._lock.release()


class Guard:
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
        if world.broken is None and collective_failure(exc):
            world.lose_collective(exc, "a collective failed")
        if world.broken is not None:
            raise RankLost(
                f"replica lost a rank ({world.broken}); this request failed, the replica restarts"
            ) from exc
