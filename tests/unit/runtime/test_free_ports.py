"""`disagg up` promises ports to roles before they bind them; the kernel must not hand one
of them to a port-0 bind (a role's inline lane) in between."""

from __future__ import annotations

import itertools
import random
import socket
import subprocess
import sys

from disagg_runtime.local.ports import HOST, ephemeral_range, free_ports


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


def test_two_launchers_never_promise_the_same_port() -> None:
    """Promised ports are free but not yet bound: a second launcher (here, the same seed,
    so the same ports are tried in the same order) must skip the first one's claims."""
    first = free_ports(random.Random(3))
    mine = list(itertools.islice(first, 40))
    theirs = list(itertools.islice(free_ports(random.Random(3)), 40))
    assert not set(mine) & set(theirs)
    first.close()  # the launcher ends: its claims go with it
    assert next(free_ports(random.Random(3))) == mine[0]


def test_a_claim_survives_only_its_process() -> None:
    """A SIGKILLed launcher leaves no claim behind: flocks die with their process."""
    script = (
        "import itertools, random, sys\n"
        "from disagg_runtime.local.ports import free_ports\n"
        "it = free_ports(random.Random(5))\n"
        "print(next(it), flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        claimed = int(child.stdout.readline())
        assert next(free_ports(random.Random(5))) != claimed
    finally:
        child.kill()
        child.wait()
    assert next(free_ports(random.Random(5))) == claimed
