"""forward.Forwarder.sweep: a request is reported lost with the relay it went on, even when
that relay was dropped from the cache before the sweep saw it gone (another thread's send
found it lost while a transfer held it, so `gone()` read False there), or replaced by a
fresh relay to the restarted replica's same address. Before, the sweep looked only at the
cache's current relay, and such a request waited, unreported, until its deadline (1 of 500
lost in the e2e kill scenario)."""

from __future__ import annotations

import threading
import time
from typing import Any

from disagg_runtime.routing import forward
from disagg_runtime.routing.inflight import Sent
from disagg_runtime.routing.relays import RelayCache
from disagg_runtime.wire.envelope import Meta, Reply

ENDPOINT = "tcp://10.0.0.7:7000"


class FakeRelay:
    """A relay whose receiver is lost or not (what `gone()` reads of a real one)."""

    kind = "tcp"

    def __init__(self, *, lost: bool) -> None:
        self.lost = lost
        self.closed = False

    def gone(self) -> bool:
        return self.lost

    def close(self) -> None:
        self.closed = True


class Peers:
    def __init__(self) -> None:
        self.skipped: list[str] = []

    def lost(self, endpoint: str) -> None:
        self.skipped.append(endpoint)


def _forwarder(cache: RelayCache, peers: Peers) -> tuple[forward.Forwarder, list[str]]:
    reported: list[str] = []
    fwd = forward.Forwarder(
        "prefill",
        0,
        {"middle": peers},  # type: ignore[dict-item]
        cache,
        leaving=threading.Event(),
        edge_sent=lambda *_: None,
        on_lost=lambda sent: reported.extend(s.meta.rid for s in sent),
    )
    return fwd, reported


def _sent(rid: str, relay: Any) -> Sent:
    meta = Meta(rid, "data", "prefill", time.time() + 30.0, Reply("tcp://127.0.0.1:1", "tcp"))
    return Sent(meta, "middle", "tcp", ENDPOINT, relay)


def _cached(cache: RelayCache) -> Any:
    return cache.peek("tcp", ENDPOINT)


def _cache() -> RelayCache:
    return RelayCache(timeout=5.0, key=b"k" * 32)


def test_a_request_on_a_lost_relay_already_dropped_is_reported() -> None:
    cache, peers = _cache(), Peers()
    fwd, reported = _forwarder(cache, peers)
    old = FakeRelay(lost=True)  # dropped from the cache already: not there
    fwd.inflight.add(_sent("held-by-the-dead-one", old))
    fwd.sweep()
    assert reported == ["held-by-the-dead-one"]
    assert peers.skipped == [ENDPOINT]
    fwd.sweep()
    assert reported == ["held-by-the-dead-one"]  # once


def test_a_fresh_relay_to_the_same_address_does_not_hide_the_old_ones_loss() -> None:
    cache, peers = _cache(), Peers()
    fwd, reported = _forwarder(cache, peers)
    old, fresh = FakeRelay(lost=True), FakeRelay(lost=False)
    cache._relays[("tcp", ENDPOINT)] = (fresh, time.monotonic())  # type: ignore[assignment]
    fwd.inflight.add(_sent("on-the-old", old))
    fwd.inflight.add(_sent("on-the-fresh", fresh))
    fwd.sweep()
    assert reported == ["on-the-old"]  # what went to the restarted process is not moved
    assert _cached(cache) is fresh and not fresh.closed
    assert [s.meta.rid for s in fwd.inflight.lost("tcp", ENDPOINT)] == ["on-the-fresh"]


def test_a_lost_relay_still_cached_is_dropped_and_reported() -> None:
    cache, peers = _cache(), Peers()
    fwd, reported = _forwarder(cache, peers)
    relay = FakeRelay(lost=False)
    cache._relays[("tcp", ENDPOINT)] = (relay, time.monotonic())  # type: ignore[assignment]
    fwd.inflight.add(_sent("r", relay))
    fwd.sweep()
    assert reported == [] and _cached(cache) is relay  # alive: kept
    relay.lost = True
    fwd.sweep()
    assert reported == ["r"] and cache.peek("tcp", ENDPOINT) is None and relay.closed
