"""Peer resolution: every replica address, sticky per request, re-resolved over time."""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping

import pytest

from disagg_core.compat import Compat, default_token
from disagg_core.contract import Peer
from disagg_runtime.relay import RelayError, Unanswered
from disagg_runtime.routing import dispatch, failover, peers, relays


def test_ip_literals_need_no_dns():
    assert peers.resolve_dns("10.1.2.3", 7400) == ["tcp://10.1.2.3:7400"]
    assert peers.resolve_dns("::1", 7400) == ["tcp://[::1]:7400"]


def test_localhost_resolves_through_getaddrinfo():
    assert "tcp://127.0.0.1:9" in peers.resolve_dns("localhost", 9)


def test_pick_is_stable_and_spreads():
    endpoints = [f"tcp://10.0.0.{i}:1" for i in range(4)]
    assert peers.pick(endpoints, "abc") == peers.pick(list(endpoints), "abc")
    chosen = {peers.pick(endpoints, f"r{i}") for i in range(200)}
    assert chosen == set(endpoints)


def test_peerset_re_resolves_after_the_interval(monkeypatch):
    answers = [["tcp://10.0.0.1:1"], ["tcp://10.0.0.1:1", "tcp://10.0.0.2:1"]]
    calls = []

    def resolver(host, port):
        calls.append((host, port))
        return answers[min(len(calls), len(answers)) - 1]

    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    ps = peers.PeerSet(Peer("decoder", ("svc.ns:1",)), "tcp", resolver=resolver)
    assert ps.endpoints() == ["tcp://10.0.0.1:1"]
    assert ps.endpoints() == ["tcp://10.0.0.1:1"]  # cached
    clock[0] += peers.RESOLVE_EVERY + 1
    assert ps.endpoints() == ["tcp://10.0.0.1:1", "tcp://10.0.0.2:1"]
    assert calls == [("svc.ns", 1), ("svc.ns", 1)]


def test_failed_resolution_keeps_the_last_known_replicas(monkeypatch):
    state = {"fail": False}

    def resolver(host, port):
        if state["fail"]:
            raise OSError("no such host")
        return ["tcp://10.0.0.9:1"]

    ps = peers.PeerSet(Peer("d", ("svc:1",)), "tcp", resolver=resolver)
    assert ps.endpoint_for("r") == "tcp://10.0.0.9:1"
    state["fail"] = True
    assert ps.endpoints(refresh=True) == ["tcp://10.0.0.9:1"]


def test_no_replica_at_all_is_a_relay_error():
    def resolver(host, port):
        raise OSError("nxdomain")

    ps = peers.PeerSet(Peer("d", ("svc:1",)), "tcp", resolver=resolver)
    with pytest.raises(RelayError, match="no replica of role 'd'"):
        ps.endpoint_for("r")


def _views(table: Mapping[str, dispatch.View | None]) -> peers.Viewer:
    return lambda endpoint: table.get(endpoint)


def _load(queued: int) -> dispatch.View:
    report = dispatch.Load(queued, 0, 1, 1 << 20, 1 << 20, service_s=0.1)
    return dispatch.View(report, 0.0)


def test_a_request_follows_its_first_choice(tmp_path):
    """The first message chooses by load; later ones (chunks, the end, aborts) go where it
    went even when the loads say otherwise now; after the end it is forgotten."""
    path = str(tmp_path / "peers.json")
    peers.write_peers_file(path, {"d": ["10.0.0.1:1", "10.0.0.2:1"]})
    ps = peers.PeerSet(Peer("d", ()), "tcp", peers_file=peers.PeersFile(path))
    a, b = ps.endpoints()
    table = {a: _load(0), b: _load(9)}
    assert ps.endpoint_for("r", _views(table)) == a
    table.update({a: _load(9), b: _load(0)})
    assert ps.endpoint_for("r", _views(table)) == a  # a chunk
    assert ps.endpoint_for("r", _views(table), new=False) == a  # the end, an abort
    assert ps.endpoint_for("s", _views(table)) == b  # a new request chooses afresh
    ps.unpin("r")
    assert ps.endpoint_for("r", _views(table)) == b
    # an abort of a request never sent here goes where hashing puts it, and pins nothing
    assert ps.endpoint_for("t", _views(table), new=False) == peers.pick([a, b], "t")
    assert ps.endpoint_for("t", _views(table)) == b


def test_a_lone_replica_is_chosen_without_reading_loads(tmp_path):
    """Reading a view costs a send its sender's lock and a look at its replies: with one
    replica and the default filters the choice cannot differ, so none is read (a caller's
    own filter may still turn it down, so then they are)."""
    path = str(tmp_path / "peers.json")
    peers.write_peers_file(path, {"d": ["10.0.0.1:1"]})
    asked: list[str] = []

    def viewer(endpoint: str) -> dispatch.View | None:
        asked.append(endpoint)
        return None

    ps = peers.PeerSet(Peer("d", ()), "tcp", peers_file=peers.PeersFile(path))
    (only,) = ps.endpoints()
    assert ps.endpoint_for("r", viewer) == only
    assert ps.endpoint_for("r", viewer, new=False) == only  # pinned
    assert asked == []

    def none_pass(endpoints, views):
        return []

    ps = peers.PeerSet(
        Peer("d", ()),
        "tcp",
        peers_file=peers.PeersFile(path),
        filters=(*dispatch.DEFAULT_FILTERS, none_pass),
    )
    with pytest.raises(RelayError, match="may take request r"):
        ps.endpoint_for("r", viewer)
    assert asked == [only]


def test_a_pin_to_a_replica_that_left_chooses_again(tmp_path):
    path = str(tmp_path / "peers.json")
    peers.write_peers_file(path, {"d": ["10.0.0.1:1", "10.0.0.2:1"]})
    ps = peers.PeerSet(Peer("d", ()), "tcp", peers_file=peers.PeersFile(path))
    a, b = ps.endpoints()
    assert ps.endpoint_for("r", _views({a: _load(0), b: _load(5)})) == a
    peers.write_peers_file(path, {"d": ["10.0.0.2:1", "10.0.0.3:11"]})
    time.sleep(peers.FILE_RESOLVE_EVERY + 0.05)
    assert ps.endpoint_for("r", _views({})) in ps.endpoints()


def test_hashed_peer_sets_ignore_loads():
    """Roles that join inputs (and dispatch `hash`): every sender must agree."""
    endpoints = [f"tcp://10.0.0.{i}:1" for i in range(4)]
    ps = peers.PeerSet(Peer("j", tuple(e[6:] for e in endpoints)), "tcp", hashed=True)
    for i in range(20):
        busy = {e: _load(0 if e != peers.pick(endpoints, f"r{i}") else 50) for e in endpoints}
        assert ps.endpoint_for(f"r{i}", _views(busy)) == peers.pick(endpoints, f"r{i}")


def test_pins_are_bounded(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "MAX_PINS", 8)
    ps = peers.PeerSet(Peer("d", ("10.0.0.1:1", "10.0.0.2:1")), "tcp")
    table = {e: _load(0) for e in ps.endpoints()}
    for i in range(50):
        ps.endpoint_for(f"r{i}", _views(table))
    assert len(ps._pins) == 8


# -- revision pairing ------------------------------------------------------------------------


def test_compatible_endpoints_drops_the_rejected_until_their_mark_expires():
    eps = ["tcp://a:1", "tcp://b:1", "tcp://c:1"]
    rejected = {"tcp://b:1": 10.0}
    assert peers.compatible_endpoints(eps, rejected, now=5.0) == ["tcp://a:1", "tcp://c:1"]
    assert peers.compatible_endpoints(eps, rejected, now=10.0) == eps


def _pairing_set(monkeypatch, clock):
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    eps = [f"tcp://10.0.0.{i}:1" for i in range(3)]
    return peers.PeerSet(
        Peer("decode", ("svc:1",)), "tcp", resolver=lambda h, p: eps, compat=Compat("v2")
    ), eps


def test_a_peerset_picks_only_among_replicas_that_pair(monkeypatch):
    clock = [100.0]
    ps, eps = _pairing_set(monkeypatch, clock)
    assert ps.pairing and ps.unchecked() == eps
    # not ready before any replica was found to pair: no request should wait here for one
    assert "has been found to pair with compat token 'v2' yet (3 listed" in (ps.trouble() or "")
    assert not ps.admit(eps[0], Compat("v1"))
    assert "none of the 3 replicas" in (ps.trouble() or "")  # one asked, and it does not pair
    assert not ps.admit(eps[1], Compat("v3", frozenset({"v1"})))
    assert ps.admit(eps[2], Compat("v1", frozenset({"v2"})))
    assert {ps.endpoint_for(f"r{i}") for i in range(50)} == {eps[2]}
    assert ps.trouble() is None and ps.unchecked() == []
    assert not ps.admit(eps[2], Compat("v1"))  # the address now serves another revision
    with pytest.raises(peers.NoCompatibleReplica, match="pairs with compat token 'v2'"):
        ps.endpoint_for("r")
    assert "none of the 3 replicas of role 'decode'" in (ps.trouble() or "")
    clock[0] += peers.VERDICT_S + 1  # verdicts age out: every replica is asked again
    assert ps.unchecked() == eps
    assert ps.endpoint_for("r") in eps


def test_a_role_without_a_declared_token_filters_nothing(monkeypatch):
    eps = ["tcp://10.0.0.1:1"]
    ps = peers.PeerSet(Peer("d", ("svc:1",)), "tcp", resolver=lambda h, p: eps)
    assert not ps.pairing
    assert ps.admit(eps[0], Compat("v1")) and ps.endpoint_for("r") == eps[0]
    auto = Compat(default_token("m:h", None))
    ps = peers.PeerSet(Peer("d", ("svc:1",)), "tcp", resolver=lambda h, p: eps, compat=auto)
    assert not ps.pairing and ps.admit(eps[0], Compat("v1")) and ps.trouble() is None


def test_a_pairing_role_with_no_replica_listed_is_not_ready(monkeypatch):
    ps = peers.PeerSet(
        Peer("decode", ("svc:1",)), "tcp", resolver=lambda h, p: [], compat=Compat("v2")
    )
    assert "(0 listed" in (ps.trouble() or "")


def test_answering_endpoints_skips_lost_ones_unless_none_would_remain():
    eps = ["tcp://a:1", "tcp://b:1"]
    assert peers.answering_endpoints(eps, {"tcp://a:1": 10.0}, now=5.0) == ["tcp://b:1"]
    assert peers.answering_endpoints(eps, {"tcp://a:1": 10.0}, now=10.0) == eps
    assert peers.answering_endpoints(eps, dict.fromkeys(eps, 10.0), now=5.0) == eps


def test_a_replica_that_did_not_answer_is_skipped_for_a_while(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    eps = ["tcp://10.0.0.1:1", "tcp://10.0.0.2:1"]
    ps = peers.PeerSet(Peer("d", ("svc:1",)), "tcp", resolver=lambda h, p: eps)
    gone = ps.endpoint_for("r0")
    ps.lost(gone)
    assert {ps.endpoint_for(f"r{i}") for i in range(40)} == set(eps) - {gone}
    clock[0] += peers.LOST_S + 0.1
    assert {ps.endpoint_for(f"r{i}") for i in range(40)} == set(eps)
    ps.lost(eps[0])
    ps.lost(eps[1])  # both silent: try them anyway rather than fail at once
    assert ps.endpoint_for("r") in eps


def test_a_replica_slow_to_answer_is_asked_again_soon_and_longer_apart_if_it_stays_silent(
    monkeypatch,
):
    """A live replica starved of CPU past the handshake bound (relays.CONNECT_S) used to be
    skipped LOST_S (10 s) at its first silence; now 1 s, doubling with each silence in a
    row up to LOST_S, and forgiven once it answers (admit)."""
    assert [peers.unanswered_skip(n) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 8, 10, 10]
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    eps = ["tcp://10.0.0.1:1", "tcp://10.0.0.2:1"]
    ps = peers.PeerSet(Peer("d", ("svc:1",)), "tcp", resolver=lambda h, p: eps)
    slow = eps[0]

    def chosen() -> set[str]:
        return {ps.endpoint_for(f"r{i}") for i in range(40)}

    for strikes, skip in ((1, 1.0), (2, 2.0), (3, 4.0)):
        ps.unanswered(slow)
        clock[0] += skip - 0.1
        assert chosen() == {eps[1]}, f"silence {strikes}: still skipped"
        clock[0] += 0.2
        assert chosen() == set(eps), f"silence {strikes}: asked again after {skip} s"
    ps.admit(slow, None)  # it answered: the next silence is a first one again
    ps.unanswered(slow)
    clock[0] += 1.1
    assert chosen() == set(eps)
    clock[0] += peers.STRIKES_S + 1  # silences a minute apart are not in a row
    ps.unanswered(slow)
    clock[0] += 1.1
    assert chosen() == set(eps)


def _silent_endpoint() -> tuple[socket.socket, str]:
    """A TCP port that accepts connections and never says a word (no ZMTP greeting):
    a relay handshake to it can only time out."""
    server = socket.create_server(("127.0.0.1", 0))
    return server, f"tcp://127.0.0.1:{server.getsockname()[1]}"


def test_a_handshake_is_given_up_after_connect_s_when_time_is_left(monkeypatch):
    monkeypatch.setattr(relays, "CONNECT_S", 0.3)
    server, endpoint = _silent_endpoint()
    cache = relays.RelayCache(timeout=30.0, key=b"k" * 32)
    try:
        started = time.monotonic()
        with pytest.raises(Unanswered, match=r"did not answer within 0\.3 s"):
            cache.get("tcp", endpoint, timeout=20.0)
        assert time.monotonic() - started < 5.0  # not the 20 s the caller had
        with pytest.raises(RelayError) as unbounded:  # the last try may use all it has
            cache.get("tcp", endpoint, timeout=0.6, bounded=False)
        assert not isinstance(unbounded.value, Unanswered)
        lost: list[str] = []
        with pytest.raises(RelayError):  # tried twice: told which one did not answer
            failover.on_relay(
                cache,
                "tcp",
                endpoint,
                lambda relay, left: None,
                timeout=1.0,
                repick=lambda: endpoint,
                lost=lost.append,
            )
        assert lost == [endpoint]
    finally:
        cache.close()
        server.close()
