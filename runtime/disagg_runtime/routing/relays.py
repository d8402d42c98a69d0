"""Relays a role or client keeps open to its peers: one shared relay per (kind, endpoint),
bounded and aged (`RelayCache`), and dedicated tcp connections for transfers that hold
theirs for long (`Dedicated`, uploads streamed as their bytes arrive).

Every relay proves the pipeline's peer key both ways (relay/auth.py) before it is used.
A handshake not done within `CONNECT_S` while more time is left raises `Unanswered` (a
kind of PeerLost: nothing was sent), so the caller can spend the rest on another replica
(failover.py); its replica is then skipped for a while (peers.LOST_S).
"""

from __future__ import annotations

import collections
import errno
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from disagg_runtime.relay import (
    NotAPeer,
    Relay,
    RelayError,
    RelayTimeout,
    TcpSender,
    Unanswered,
    WrongRole,
    connect,
)
from disagg_runtime.routing import dispatch

log = logging.getLogger(__name__)
CONNECT_S = 5.0  # a replica that has not completed a handshake by then is given up on
Viewer = Callable[[str], dispatch.View | None]  # endpoint -> what we know of its load


class RelayCache:
    """Relays by (kind, endpoint), opened on first use, shared by all workers.

    Bounded: at most `max_relays` (least recently used closed first) and none idle for
    longer than `idle_s`, so distinct reply endpoints cannot use up the process's sockets.
    Every relay proves the peer `key` both ways (relay/auth.py) before it is used, so a
    role only ever sends to its pipeline's peers. `trouble()` says why the role should not
    be ready: sockets ran out within the last `window_s` (the older half of the relays is
    then closed, so the process keeps working), or sends kept failing (`failed`) in it
    with no success since. Both age out: a role becomes ready again by itself.
    """

    FAILURES = 8  # failed sends in the window that, with no success, make the role unready

    def __init__(
        self,
        *,
        timeout: float,
        key: bytes,
        pools: str | None = None,
        context: Any = None,
        max_relays: int = 128,
        idle_s: float = 300.0,
        window_s: float | None = None,
    ) -> None:
        self._timeout = timeout
        self._key = key
        self._pools = pools
        self._context = context
        self.max_relays = max_relays
        self.idle_s = idle_s
        self.window_s = window_s if window_s is not None else max(10.0, 2 * timeout)
        self._relays: collections.OrderedDict[tuple[str, str], tuple[Relay, float]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self._exhausted_at = float("-inf")  # sockets ran out
        self._failures: collections.deque[float] = collections.deque(maxlen=self.FAILURES)
        self._ok_at = float("-inf")
        self.refused = 0  # peers that failed authentication when dialled

    def __len__(self) -> int:
        return len(self._relays)

    def get(
        self,
        kind: str,
        endpoint: str,
        *,
        timeout: float | None = None,
        role: str | None = None,
        bounded: bool = True,
    ) -> Relay:
        """The relay to `endpoint`, connecting (within `timeout`, at most the cache's own)
        if there is none; RelayError when it cannot be opened. With `role`, an endpoint whose
        welcome names another role is dropped and WrongRole raised (its address was reused).
        When `bounded` and more than CONNECT_S is left, a handshake not done by then raises
        Unanswered, so the caller can spend the rest on another replica."""
        relay = self._get(kind, endpoint, timeout, bounded)
        if role is not None and relay.peer_role not in (None, role):
            self.drop(kind, endpoint, relay)
            raise WrongRole(
                f"{endpoint} serves role {relay.peer_role!r}, not {role!r} (its address was "
                "taken over by another pod); look the role up again"
            )
        return relay

    def _get(self, kind: str, endpoint: str, timeout: float | None, bounded: bool) -> Relay:
        key = (kind, endpoint)
        now = time.monotonic()
        with self._lock:
            entry = self._relays.get(key)
            if entry is not None:
                self._relays[key] = (entry[0], now)
                self._relays.move_to_end(key)
            stale = self._evict(now, self.max_relays)
        self._close_all(stale)
        if entry is not None:
            return entry[0]
        with self._lock:  # make room first: a full process cannot open the new one
            stale = self._evict(now, self.max_relays - 1)
        self._close_all(stale)
        wait = self._timeout if timeout is None else max(0.05, min(timeout, self._timeout))
        bounded = bounded and wait > CONNECT_S  # time is left to try another replica
        try:
            relay = connect(
                kind,
                endpoint,
                timeout=self._timeout,
                handshake_timeout=min(wait, CONNECT_S) if bounded else wait,
                context=self._context,
                key=self._key,
                pools=self._pools,
            )
        except (zmq.ZMQError, OSError) as exc:
            if bounded and isinstance(exc, RelayTimeout):  # the caller may try another one
                raise Unanswered(f"{endpoint} did not answer within {CONNECT_S:g} s") from None
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._exhausted_at = time.monotonic()
                log.error("out of sockets opening a relay to %s: %s", endpoint, exc)
                with self._lock:  # shed the older half, so probes and new replies can work
                    stale = self._evict(now, len(self._relays) // 2)
                self._close_all(stale)
            raise RelayError(f"cannot open a {kind} relay to {endpoint}: {exc}") from None
        except NotAPeer:
            self.refused += 1
            raise
        with self._lock:
            existing = self._relays.get(key)
            if existing is None:
                self._relays[key] = (relay, time.monotonic())
        if existing is not None:
            relay.close()
            return existing[0]
        return relay

    def _evict(self, now: float, keep: int) -> list[Relay]:
        """Take out relays idle too long, then the least recently used beyond `keep`
        (call with the lock held; close them after releasing it)."""
        out = []
        while self._relays:
            key, (relay, used) = next(iter(self._relays.items()))
            if len(self._relays) <= max(0, keep) and now - used <= self.idle_s:
                break
            del self._relays[key]
            out.append(relay)
        return out

    @staticmethod
    def _close_all(relays: list[Relay]) -> None:
        for relay in relays:  # waits for a send in progress on it, if any
            relay.close()

    def drop(self, kind: str, endpoint: str, relay: Relay | None = None) -> None:
        """Forget a relay that failed (only `relay`, when given: not a fresh one another
        thread opened since), so the next send reconnects."""
        with self._lock:
            entry = self._relays.get((kind, endpoint))
            if entry is not None and relay in (None, entry[0]):
                del self._relays[(kind, endpoint)]
            else:
                entry = None
        if entry is not None:
            entry[0].close()
        elif relay is not None:
            relay.close()

    def succeeded(self) -> None:
        self._ok_at = time.monotonic()

    def failed(self) -> None:
        self._failures.append(time.monotonic())

    def trouble(self) -> str | None:
        """Why sends cannot be trusted to work now (the role is then not ready), or None."""
        now = time.monotonic()
        if now - self._exhausted_at < self.window_s:
            return "out of sockets for relays"
        recent = [t for t in self._failures if now - t < self.window_s]
        if len(recent) == self.FAILURES and self._ok_at < recent[0]:
            return f"the last {self.FAILURES} sends failed and none succeeded since"
        return None

    def peek(self, kind: str, endpoint: str) -> Relay | None:
        """The open relay to `endpoint`, if there is one (opens nothing, uses nothing)."""
        with self._lock:
            entry = self._relays.get((kind, endpoint))
        return entry[0] if entry is not None else None

    def view(self, kind: str, endpoint: str) -> dispatch.View | None:
        """What the open relay to `endpoint` knows of its load (None: no relay, no report);
        opens nothing."""
        with self._lock:
            entry = self._relays.get((kind, endpoint))
        return entry[0].view() if entry is not None else None

    def viewer(self, kind: str) -> Viewer:
        return lambda endpoint: self.view(kind, endpoint)

    def close(self) -> None:
        with self._lock:
            relays = [relay for relay, _ in self._relays.values()]
            self._relays.clear()
        self._close_all(relays)


class Dedicated:
    """tcp connections used by one transfer at a time (an upload streamed as its bytes
    arrive, which holds its connection for as long as its source takes: on a shared relay
    it would hold up every other request to that replica). Each proves the peer key like
    any relay; one handed back in good order is kept for the next transfer (at most `keep`
    idle per endpoint, none longer than `idle_s`), so an upload rarely pays a handshake."""

    def __init__(
        self,
        *,
        timeout: float,
        key: bytes,
        context: Any = None,
        keep: int = 2,
        idle_s: float = 60.0,
    ) -> None:
        self._timeout = timeout
        self._key = key
        self._context = context
        self.keep = keep
        self.idle_s = idle_s
        self._idle: dict[str, list[tuple[TcpSender, float]]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def take(
        self, endpoint: str, *, timeout: float, role: str | None = None, bounded: bool = True
    ) -> TcpSender:
        """An idle connection to `endpoint`, else a fresh one (RelayError if it cannot be
        opened; WrongRole when the endpoint serves another role than `role`; Unanswered, as
        for RelayCache.get, when `bounded` and its handshake takes over CONNECT_S)."""
        relay: TcpSender | None = None
        with self._lock:
            stale = self._expire(time.monotonic())
            idle = self._idle.get(endpoint)
            if idle:
                relay, _ = idle.pop()
                if not idle:
                    del self._idle[endpoint]
        for old in stale:
            old.close()
        if relay is None:
            wait = max(0.05, min(timeout, self._timeout))
            bounded = bounded and wait > CONNECT_S  # time is left to try another replica
            try:
                relay = TcpSender(
                    endpoint,
                    timeout=self._timeout,
                    handshake_timeout=min(wait, CONNECT_S) if bounded else wait,
                    context=self._context,
                    key=self._key,
                    inline_max=0,  # no inline lane: everything of a transfer in one stream
                )
            except RelayTimeout:
                if not bounded:
                    raise
                raise Unanswered(f"{endpoint} did not answer within {CONNECT_S:g} s") from None
            except (zmq.ZMQError, OSError) as exc:
                raise RelayError(f"cannot open a tcp relay to {endpoint}: {exc}") from None
        if role is not None and relay.peer_role not in (None, role):
            relay.close()
            raise WrongRole(f"{endpoint} serves role {relay.peer_role!r}, not {role!r}")
        return relay

    def give(self, relay: TcpSender) -> None:
        """Hand a connection back after its transfer; one that is not in good order (closed,
        its session lost) is closed, as are those beyond `keep`."""
        with self._lock:
            now = time.monotonic()
            stale = self._expire(now)
            idle = self._idle.get(relay.endpoint, [])
            kept = relay.usable and not self._closed and len(idle) < self.keep
            if kept:
                self._idle[relay.endpoint] = [*idle, (relay, now)]
        for old in stale if kept else [*stale, relay]:
            old.close()

    def _expire(self, now: float) -> list[TcpSender]:
        """Take out the idle connections kept longer than `idle_s`, to any endpoint (one to a
        replica that went away is never taken again), to be closed outside the lock."""
        stale: list[TcpSender] = []
        for endpoint in list(self._idle):
            idle = self._idle[endpoint]
            stale += [r for r, since in idle if now - since > self.idle_s]
            idle[:] = [(r, since) for r, since in idle if now - since <= self.idle_s]
            if not idle:
                del self._idle[endpoint]
        return stale

    def close(self) -> None:
        with self._lock:
            self._closed = True
            relays = [r for idle in self._idle.values() for r, _ in idle]
            self._idle.clear()
        for relay in relays:
            relay.close()
