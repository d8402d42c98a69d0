"""The test node's pod address allocation (tests/k8s/node/network.py `next_host`)."""

from __future__ import annotations

from tests.k8s.node.network import FIRST_HOST, LAST_HOST, next_host


def test_addresses_go_round_robin_so_a_freed_one_is_not_reused_at_once() -> None:
    used: set[int] = set()
    last = FIRST_HOST - 1
    given = []
    for _ in range(3):
        last = next_host(last, used) or 0
        used.add(last)
        given.append(last)
    assert given == [FIRST_HOST, FIRST_HOST + 1, FIRST_HOST + 2]
    used.discard(FIRST_HOST + 1)  # a pod went: its address is not the next one given
    assert next_host(last, used) == FIRST_HOST + 3


def test_allocation_wraps_around_and_skips_addresses_in_use() -> None:
    used = {LAST_HOST, FIRST_HOST}
    assert next_host(LAST_HOST, used) == FIRST_HOST + 1
    assert next_host(LAST_HOST - 1, {LAST_HOST}) == FIRST_HOST


def test_a_full_subnet_gives_none() -> None:
    every = set(range(FIRST_HOST, LAST_HOST + 1))
    assert next_host(FIRST_HOST, every) is None
