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

A replica that does not complete a relay handshake within `relays.CONNECT_S` (its pod is gone
while a stale name lookup still lists it, or it cannot be reached) is given up on
(`Unanswered`, a kind of PeerLost: nothing was sent) and skipped while any other replica
is listed, so a request goes elsewhere instead of waiting out its deadline in a handshake.
A live replica too starved of CPU to answer in time is one such: the skip starts at
`UNANSWERED_S` and doubles with each silence in a row (`unanswered_skip`), up to `LOST_S`,
so a slow replica is asked again within a second or two while a gone one (it also leaves
the name lookup) stays skipped; one that answers is forgiven. A replica whose connection
died or restarted under a request (`lost`) is skipped `LOST_S` at once.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping

from disagg_core.compat import Compat, compatible
from disagg_core.contract import Peer
from disagg_runtime.relay import RelayError
from disagg_runtime.routing import dispatch
from disagg_runtime.routing.relays import Viewer

__all__ = ["LOST_S", "NoCompatibleReplica", "PeerSet", "PeersFile", "Viewer", "resolve_dns"]
log = logging.getLogger(__name__)
RESOLVE_EVERY = 5.0
FILE_RESOLVE_EVERY = 0.25
MAX_PINS = 1 << 16  # requests remembered per downstream role (least recently used go first)
VERDICT_S = 10.0  # how long a replica's pairing verdict is trusted before it is asked again
LOST_S = 10.0  # a replica lost (connection died) is skipped this long; silences at most this
UNANSWERED_S = 1.0  # the first skip of a replica that did not answer a handshake in CONNECT_S
STRIKES_S = 60.0  # silences further apart than this are not "in a row"
Resolver = Callable[[str, int], list[str]]


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


def unanswered_skip(strikes: int) -> float:
    """How long a replica is skipped after its `strikes`-th unanswered handshake in a row:
    UNANSWERED_S doubling, at most LOST_S."""
    return float(min(LOST_S, UNANSWERED_S * 2 ** max(0, strikes - 1)))


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
        self._strikes: dict[str, tuple[int, float]] = {}  # endpoint -> silences in a row, last
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
                        self._strikes.pop(gone, None)
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
        """The replica at `endpoint` was lost (its connection died, it restarted): skip it
        for LOST_S while other replicas are listed."""
        log.info("replica %s of role %s was lost: skipped for a while", endpoint, self.peer.role)
        with self._lock:
            self._lost[endpoint] = time.monotonic() + LOST_S

    def unanswered(self, endpoint: str) -> None:
        """`endpoint` did not answer a handshake in time (Unanswered): skip it while other
        replicas are listed, for `unanswered_skip` of its silences in a row."""
        now = time.monotonic()
        with self._lock:
            strikes, last = self._strikes.get(endpoint, (0, float("-inf")))
            strikes = strikes + 1 if now - last <= STRIKES_S else 1
            self._strikes[endpoint] = (strikes, now)
            skip = unanswered_skip(strikes)
            self._lost[endpoint] = max(self._lost.get(endpoint, float("-inf")), now + skip)
        log.info(
            "replica %s of role %s did not answer (%d in a row): skipped for %.0f s",
            endpoint,
            self.peer.role,
            strikes,
            skip,
        )

    def unpin(self, rid: str) -> None:
        """Forget where `rid` went (its last message was sent)."""
        with self._lock:
            self._pins.pop(rid, None)

    def admit(self, endpoint: str, theirs: Compat | None) -> bool:
        """Record whether the replica at `endpoint`, advertising `theirs`, pairs with us."""
        ok = compatible(self.compat, theirs)
        now = time.monotonic()
        with self._lock:
            self._strikes.pop(endpoint, None)  # it answered
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
