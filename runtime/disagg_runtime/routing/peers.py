"""Outgoing connections of a role: downstream roles (by DNS or explicit addresses) and
clients' reply endpoints.

Replicas come and go: a downstream role's addresses are re-resolved (a headless Service
name returns one A record per ready pod) at most every `RESOLVE_EVERY` seconds, so scaling
never restarts peers. Locally (`disagg up`) a peers file plays the part of DNS: the
launcher rewrites it when it scales, and roles re-read it when it changes.

A new request goes to the replica of each downstream role that its load reports favour
(dispatch.py: power of two choices over what receivers advertise), and every later
message of it from this sender (stream chunks, the end, aborts) follows it there: the
choice is pinned by request id. Roles whose inputs meet from several senders (fan-in
joins, tensor references) are chosen by rendezvous hashing of the request id instead,
so all senders agree without talking; so is every role when dispatch is `hash`.

Revision pairing (disagg_core.compat): each replica advertises its compat token in the
relay welcome. Before a replica is chosen, `compatible_endpoints` filters out those found
incompatible with this role's own token (a verdict is kept for `VERDICT_S`, then asked
again: a pod's address may be reused by another revision), so whatever policy picks among
replicas only ever sees compatible ones. A role that declared a token is not ready until
some replica was found to pair with it (`PeerSet.trouble`).

A replica that does not complete a relay handshake within `CONNECT_S` (its pod is gone
while a stale name lookup still lists it, or it cannot be reached) is given up on
(`Unanswered`, a kind of PeerLost: nothing was sent) and skipped for `LOST_S` while any
other replica is listed, so a request goes elsewhere instead of waiting out its deadline
in a handshake.
"""

from __future__ import annotations

import collections
import errno
import ipaddress
import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import zmq

from disagg_core.compat import Compat, compatible
from disagg_core.contract import Peer
from disagg_runtime.relay import (
    NotAPeer,
    PeerLost,
    Relay,
    RelayError,
    RelayTimeout,
    TcpSender,
    Unanswered,
    WrongRole,
    connect,
)
from disagg_runtime.routing import dispatch

T = TypeVar("T")
log = logging.getLogger(__name__)
RESOLVE_EVERY = 5.0
FILE_RESOLVE_EVERY = 0.25
MAX_PINS = 1 << 16  # requests remembered per downstream role (least recently used go first)
VERDICT_S = 10.0  # how long a replica's pairing verdict is trusted before it is asked again
CONNECT_S = 5.0  # a replica that has not completed a handshake by then is given up on
LOST_S = 10.0  # ... and skipped this long, while other replicas are listed
Resolver = Callable[[str, int], list[str]]
Viewer = Callable[[str], dispatch.View | None]  # endpoint -> what we know of its load


def resolve_dns(host: str, port: int) -> list[str]:
    """Every address of `host`, as ZMQ tcp endpoints (sorted, so all roles agree)."""
    try:
        addrs = [str(ipaddress.ip_address(host))]
    except ValueError:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addrs = sorted({str(info[4][0]) for info in infos})
    return [f"tcp://[{a}]:{port}" if ":" in a else f"tcp://{a}:{port}" for a in addrs]


pick = dispatch.rendezvous  # the replica a request hashes to


def compatible_endpoints(
    endpoints: list[str], rejected: Mapping[str, float], now: float
) -> list[str]:
    """`endpoints` less those found incompatible (`rejected`: endpoint -> until when)."""
    return [e for e in endpoints if rejected.get(e, float("-inf")) <= now]


def answering_endpoints(endpoints: list[str], lost: Mapping[str, float], now: float) -> list[str]:
    """`endpoints` less those that did not answer lately (`lost`: endpoint -> until when),
    unless that leaves none: then all of them (one may answer now; failing at once would
    not help the request)."""
    answering = [e for e in endpoints if lost.get(e, float("-inf")) <= now]
    return answering or endpoints


class NoCompatibleReplica(RelayError):
    """Replicas of the role are reachable, but none pairs with this role's revision."""


class PeersFile:
    """`{"role": ["host:port", ...]}` in a JSON file, re-read when it changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._roles: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()

    def addresses(self, role: str) -> tuple[str, ...] | None:
        with self._lock:
            try:
                st = os.stat(self.path)
                stamp = (st.st_mtime_ns, st.st_size)
                if stamp != self._stamp:
                    with open(self.path) as f:
                        data = json.load(f)
                    self._roles = {str(k): tuple(str(a) for a in v) for k, v in data.items()}
                    self._stamp = stamp
            except (OSError, ValueError, AttributeError, TypeError) as exc:
                log.debug("peers file %s unreadable, keeping the last view: %s", self.path, exc)
            return self._roles.get(role)


def write_peers_file(path: str, roles: dict[str, list[str]]) -> None:
    """Replace the file atomically, so a reader never sees half of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(roles, f)
    os.replace(tmp, path)


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

    def send(
        self,
        kind: str,
        endpoint: str,
        payload: Any,
        *,
        request_id: str,
        timeout: float,
        meta: Mapping[str, Any] | None = None,
        repick: Callable[[], str] | None = None,
        role: str | None = None,
        lost: Callable[[str], None] | None = None,
    ) -> tuple[Relay, int]:
        """Send on the relay to `endpoint` (opening it if need be); returns it and the bytes
        moved. A relay whose receiver lost its session (PeerLost: it restarted, or its pod
        went away; nothing of the payload was delivered) is replaced by a fresh connection
        once, within `timeout`, to the endpoint `repick` names then (a fresh look at the
        replicas: a pod scaled away is no longer among them), else to the same one; so is one
        that serves another `role` than the one named (WrongRole), or one that did not answer
        the handshake within CONNECT_S (Unanswered: `lost` is told, so that `repick` skips it;
        the second try may take all the time left). A relay that failed otherwise is dropped,
        and the error raised."""
        return self.on_relay(
            kind,
            endpoint,
            lambda relay, remaining: relay.send(
                payload, request_id=request_id, timeout=remaining, meta=meta
            ),
            timeout=timeout,
            repick=repick,
            role=role,
            lost=lost,
        )

    def on_relay(
        self,
        kind: str,
        endpoint: str,
        operation: Callable[[Relay, float], T],
        *,
        timeout: float,
        repick: Callable[[], str] | None = None,
        role: str | None = None,
        lost: Callable[[str], None] | None = None,
    ) -> tuple[Relay, T]:
        """`operation(relay, seconds left)` on the relay to `endpoint`, reconnecting and
        trying once more as `send` does; the relay it ran on and its result."""
        deadline = time.monotonic() + timeout
        for attempt in (1, 2):
            remaining = max(0.05, deadline - time.monotonic())
            relay: Relay | None = None
            try:
                relay = self.get(kind, endpoint, timeout=remaining, role=role, bounded=attempt == 1)
                remaining = max(0.05, deadline - time.monotonic())
                return relay, operation(relay, remaining)
            except PeerLost as exc:
                if relay is not None:  # (one that failed to open, or WrongRole, is not kept)
                    self.drop(kind, endpoint, relay)
                if attempt == 2:
                    raise
                if isinstance(exc, Unanswered) and lost is not None:
                    lost(endpoint)
                endpoint = repick() if repick is not None else endpoint
                log.info("sending again, to %s: %s", endpoint, exc)
            except RelayError:
                if relay is not None:
                    self.drop(kind, endpoint, relay)
                raise
        raise AssertionError("unreachable")

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


class PeerSet:
    """The replicas of one downstream role and the relay kind used to reach them.

    `hashed`: requests go where rendezvous hashing puts them (every sender agrees), never
    by load; else a request's first message chooses by load and the rest follow it (pins
    kept for `pin_s` after their last use, at most MAX_PINS)."""

    def __init__(
        self,
        peer: Peer,
        kind: str,
        *,
        resolver: Resolver = resolve_dns,
        peers_file: PeersFile | None = None,
        hashed: bool = False,
        pin_s: float = 300.0,
        filters: tuple[dispatch.Filter, ...] = dispatch.DEFAULT_FILTERS,
        rng: random.Random | None = None,
        compat: Compat | None = None,
    ) -> None:
        self.peer = peer
        self.kind = kind
        self.hashed = hashed
        self.pin_s = pin_s
        self.filters = filters
        self._rng = rng or random.Random()
        self.compat = compat  # this role's own revision: replicas must pair with it
        self._resolver = resolver
        self._file = peers_file
        self._rejected: dict[str, float] = {}  # endpoint -> until when it is skipped
        self._lost: dict[str, float] = {}  # endpoint -> until when it is skipped (Unanswered)
        self._verdicts: dict[str, tuple[bool, float, Compat | None]] = {}  # ok, when, theirs
        self._endpoints: list[str] = []
        self._resolved_at = float("-inf")
        self._lock = threading.Lock()
        self._pins: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()

    def endpoints(self, *, refresh: bool = False) -> list[str]:
        with self._lock:
            listed = self._file.addresses(self.peer.role) if self._file is not None else None
            every = FILE_RESOLVE_EVERY if listed is not None else RESOLVE_EVERY
            if refresh or time.monotonic() - self._resolved_at > every:
                found: list[str] = []
                for address in listed if listed is not None else self.peer.addresses:
                    host, _, port = address.rpartition(":")
                    try:
                        found.extend(self._resolver(host.strip("[]"), int(port)))
                    except OSError as exc:
                        log.debug("cannot resolve %s for %s: %s", address, self.peer.role, exc)
                if found or not self._endpoints:
                    self._endpoints = sorted(set(found))
                    for gone in (set(self._verdicts) | set(self._lost)) - set(self._endpoints):
                        self._verdicts.pop(gone, None)
                        self._rejected.pop(gone, None)
                        self._lost.pop(gone, None)
                self._resolved_at = time.monotonic()
            return list(self._endpoints)

    @property
    def pairing(self) -> bool:
        """Whether replicas are filtered at all (this role declared a compat token)."""
        return self.compat is not None and self.compat.declared

    def endpoint_for(self, rid: str, views: Viewer | None = None, *, new: bool = True) -> str:
        """The replica for a message of request `rid`: where its earlier messages went
        (while that replica is listed), else, for a `new` message with `views` to go by, the
        one dispatch.choose picks (then pinned), else the one it hashes to (an abort of a
        request never sent here, say, goes where hashing would have put it)."""
        endpoints = self.endpoints()
        if not endpoints:
            endpoints = self.endpoints(refresh=True)
        if not endpoints:
            raise RelayError(f"no replica of role {self.peer.role!r} is reachable")
        with self._lock:
            usable = compatible_endpoints(endpoints, self._rejected, time.monotonic())
            if usable:
                usable = answering_endpoints(usable, self._lost, time.monotonic())
        if not usable:
            raise NoCompatibleReplica(self._no_pair(len(endpoints)))
        endpoints = usable  # the choice below sees only replicas that pair with us
        if self.hashed or views is None:
            return pick(endpoints, rid)
        now = time.monotonic()
        with self._lock:
            pinned = self._pins.get(rid)
            if pinned is not None and pinned[0] in endpoints:
                self._pins[rid] = (pinned[0], now)
                self._pins.move_to_end(rid)
                return pinned[0]
        if not new:
            return pick(endpoints, rid)
        if len(endpoints) == 1 and self.filters == dispatch.DEFAULT_FILTERS:
            chosen: str | None = endpoints[0]  # what choose gives a lone replica, views unread
        else:
            seen = {e: views(e) for e in endpoints}
            chosen = dispatch.choose(endpoints, seen, rid, rng=self._rng, filters=self.filters)
        if chosen is None:
            raise RelayError(f"no replica of role {self.peer.role!r} may take request {rid}")
        with self._lock:
            self._pins[rid] = (chosen, now)
            self._pins.move_to_end(rid)
            while self._pins and (
                len(self._pins) > MAX_PINS or now - next(iter(self._pins.values()))[1] > self.pin_s
            ):
                self._pins.popitem(last=False)
        return chosen

    def lost(self, endpoint: str) -> None:
        """`endpoint` did not answer a handshake (Unanswered): skip it for LOST_S while
        other replicas are listed."""
        log.info(
            "replica %s of role %s did not answer: skipped for a while", endpoint, self.peer.role
        )
        with self._lock:
            self._lost[endpoint] = time.monotonic() + LOST_S

    def unpin(self, rid: str) -> None:
        """Forget where `rid` went (its last message was sent)."""
        with self._lock:
            self._pins.pop(rid, None)

    def admit(self, endpoint: str, theirs: Compat | None) -> bool:
        """Record whether the replica at `endpoint`, advertising `theirs`, pairs with us."""
        ok = compatible(self.compat, theirs)
        now = time.monotonic()
        with self._lock:
            before = self._verdicts.get(endpoint)
            self._verdicts[endpoint] = (ok, now, theirs)
            if ok:
                self._rejected.pop(endpoint, None)
            else:
                self._rejected[endpoint] = now + VERDICT_S
        if not ok and (before is None or before[0]):
            log.info(
                "replica %s of role %s runs compat %s, which does not pair with ours (%s): skipped",
                endpoint,
                self.peer.role,
                theirs.token if theirs else None,
                self.compat.token if self.compat else None,
            )
        return ok

    def unchecked(self) -> list[str]:
        """Resolved replicas whose pairing verdict is missing or older than VERDICT_S."""
        endpoints = self.endpoints()
        now = time.monotonic()
        with self._lock:
            asked = {e: v[1] for e, v in self._verdicts.items()}
        return [e for e in endpoints if now - asked.get(e, float("-inf")) > VERDICT_S]

    def trouble(self) -> str | None:
        """Why this role cannot send on to this peer role now (the role is then not ready:
        upstream keeps sending to replicas of ours that do have a partner), or None: some
        listed replica was found to pair with our revision. Until one was (none listed or
        reached yet: a new revision whose partners are still starting) the role is not
        ready either, so no request comes here to wait for a partner."""
        if not self.pairing:
            return None
        endpoints = self.endpoints()
        with self._lock:
            checked = [self._verdicts[e] for e in endpoints if e in self._verdicts]
            if any(ok for ok, _, _ in checked):
                return None
        if not checked:
            mine = self.compat.token if self.compat else None
            return (
                f"no replica of role {self.peer.role!r} has been found to pair with compat "
                f"token {mine!r} yet ({len(endpoints)} listed, none asked successfully)"
            )
        return self._no_pair(len(endpoints))

    def _no_pair(self, count: int) -> str:
        with self._lock:
            theirs = sorted({v[2].token for v in self._verdicts.values() if v[2] is not None})
        mine = self.compat.token if self.compat else None
        return (
            f"none of the {count} replicas of role {self.peer.role!r} pairs with compat "
            f"token {mine!r} (they run {', '.join(theirs) or 'unknown'}); waiting for a "
            "compatible revision"
        )

    def reroute(self, rid: str, views: Viewer | None = None, *, new: bool = True) -> str:
        """The replica for `rid` once the one it went to was lost (PeerLost): its pin
        forgotten, the replicas looked up afresh (a pod scaled away is gone from them)."""
        self.unpin(rid)
        self.endpoints(refresh=True)
        return self.endpoint_for(rid, views, new=new)


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
