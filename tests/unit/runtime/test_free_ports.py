"""`disagg up` promises ports to roles before they bind them; the kernel must not hand one
of them to a port-0 bind (a role's inline lane) in between."""

from __future__ import annotations

import itertools
import random
import socket

from disagg_runtime.local.supervisor import HOST, ephemeral_range, free_ports


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    assert 0 < low <= high
    ports = list(itertools.islice(free_ports(random.Random(7)), 200))
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports) or low - 1024 < 256
    with socket.socket() as s:
        s.bind((HOST, ports[-1]))  # still free a moment later


def test_a_port_in_use_is_skipped() -> None:
    busy = next(free_ports(random.Random(1)))  # the same seed tries this port first again
    with socket.socket() as taken:
        taken.bind((HOST, busy))
        taken.listen()
        assert next(free_ports(random.Random(1))) != busy


def test_port_zero_binds_never_land_on_a_promised_port() -> None:
    promised = set(itertools.islice(free_ports(), 50))
    for _ in range(50):
        with socket.socket() as s:
            s.bind((HOST, 0))
            assert s.getsockname()[1] not in promised
