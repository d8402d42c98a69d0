"""Outgoing connections of a role: downstream roles (by DNS or explicit addresses) and
clients' reply endpoints.

Replicas come and go: a downstream role's addresses are re-resolved (a headless Service
name returns one A record per ready pod) at most every `RESOLVE_EVERY` seconds, so scaling
never restarts peers. Locally (`disagg up`) a peers file plays the part of DNS: the
launcher rewrites it when it scales, and roles re-read it when it changes.

A request is pinned to one replica of each downstream role by rendezvous hashing of its
id, so every message of a request (stream chunks, tensor references, aborts) meets at
the same replica, in order; adding or removing a replica moves only the requests that
hashed to it.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from disagg_core.contract import Peer
from disagg_runtime.relay import Relay, RelayError, connect

log = logging.getLogger(__name__)
RESOLVE_EVERY = 5.0
FILE_RESOLVE_EVERY = 0.25
Resolver = Callable[[str, int], list[str]]


def resolve_dns(host: str, port: int) -> list[str]:
    """Every address of `host`, as ZMQ tcp endpoints (sorted, so all roles agree)."""
    try:
        addrs = [str(ipaddress.ip_address(host))]
    except ValueError:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addrs = sorted({str(info[4][0]) for info in infos})
    return [f"tcp://[{a}]:{port}" if ":" in a else f"tcp://{a}:{port}" for a in addrs]


def pick(endpoints: list[str], rid: str) -> str:
    """The replica a request is pinned to (highest random weight)."""
    key = rid.encode()
    return max(endpoints, key=lambda e: (zlib.crc32(key + b"@" + e.encode()), e))


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
    """One relay per (kind, endpoint), opened on first use, shared by all workers."""

    def __init__(self, *, timeout: float, context: Any = None) -> None:
        self._timeout = timeout
        self._context = context
        self._relays: dict[tuple[str, str], Relay] = {}
        self._lock = threading.Lock()

    def get(self, kind: str, endpoint: str) -> Relay:
        key = (kind, endpoint)
        with self._lock:
            relay = self._relays.get(key)
        if relay is not None:
            return relay
        relay = connect(kind, endpoint, timeout=self._timeout, context=self._context)
        with self._lock:
            existing = self._relays.setdefault(key, relay)
        if existing is not relay:
            relay.close()
        return existing

    def drop(self, kind: str, endpoint: str) -> None:
        """Forget a relay that failed, so the next send reconnects."""
        with self._lock:
            relay = self._relays.pop((kind, endpoint), None)
        if relay is not None:
            relay.close()

    def close(self) -> None:
        with self._lock:
            relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            relay.close()


class PeerSet:
    """The replicas of one downstream role and the relay kind used to reach them."""

    def __init__(
        self,
        peer: Peer,
        kind: str,
        *,
        resolver: Resolver = resolve_dns,
        peers_file: PeersFile | None = None,
    ) -> None:
        self.peer = peer
        self.kind = kind
        self._resolver = resolver
        self._file = peers_file
        self._endpoints: list[str] = []
        self._resolved_at = float("-inf")
        self._lock = threading.Lock()

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
                self._resolved_at = time.monotonic()
            return list(self._endpoints)

    def endpoint_for(self, rid: str) -> str:
        endpoints = self.endpoints()
        if not endpoints:
            endpoints = self.endpoints(refresh=True)
        if not endpoints:
            raise RelayError(f"no replica of role {self.peer.role!r} is reachable")
        return pick(endpoints, rid)
