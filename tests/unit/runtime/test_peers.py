"""Peer resolution: every replica address, sticky per request, re-resolved over time."""

from __future__ import annotations

import time

import pytest

from disagg_core.contract import Peer
from disagg_runtime import peers
from disagg_runtime.relay import RelayError


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
