"""`disagg bench transport`'s planning and ratios (bench/ratios.py) and the cut of a payload
over parallel TCP streams (bench/raw_tcp.py): pure logic."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg_runtime.bench import ratios, raw_tcp


def test_plan_puts_limits_first_and_brings_the_parts_of_a_derived_limit() -> None:
    assert ratios.plan(["shm", "memcpy"]) == [
        "copy_torch",
        "copy_memmove",
        "copy_numpy",
        "memcpy",
        "shm",
    ]
    planned = ratios.plan(["tcp", "tcp_limit", "py_unix", "nixl_tcp", "raw_tcp"])
    assert planned == ["py_unix", "raw_tcp", "raw_tcp_n", "tcp_limit", "tcp", "nixl_tcp"]


def test_plan_runs_each_method_once_and_keeps_the_order_of_the_rest() -> None:
    planned = ratios.plan(["fresh_shm", "shm", "copy_numpy", "memcpy", "shm"])
    assert planned == ["copy_torch", "copy_memmove", "copy_numpy", "memcpy", "fresh_shm", "shm"]


def test_a_derived_limit_is_the_fastest_part_measured() -> None:
    rates = {"copy_torch": 6.0, "copy_memmove": 11.0, "copy_numpy": 10.5, "raw_tcp": 3.0}
    assert ratios.best_of("memcpy", rates) == "copy_memmove"
    assert ratios.best_of("tcp_limit", rates) == "raw_tcp"  # the only one measured
    assert ratios.best_of("tcp_limit", {"raw_tcp": 2.4, "raw_tcp_n": 3.1}) == "raw_tcp_n"
    assert ratios.best_of("memcpy", {}) is None
    assert ratios.is_derived("memcpy") and not ratios.is_derived("copy_memmove")


def test_a_relay_row_gets_its_rate_over_every_reference_measured() -> None:
    rates = {"memcpy": 10.0, "tcp_limit": 4.0, "nixl_cma": 5.0, "pickle_zmq": 0.5, "shm": 9.0}
    got = ratios.ratios("shm", 9.0, rates)
    assert got == pytest.approx(
        {"memcpy": 0.9, "tcp_limit": 2.25, "nixl_cma": 1.8, "pickle_zmq": 18}
    )
    assert "shm" not in got  # a relay is not its own reference
    assert ratios.ratios("memcpy", 10.0, rates) == {}  # only relay rows carry peers
    assert ratios.ratios("nixl_cma", 5.0, rates) == {}
    assert ratios.ratios("tcp", 2.0, {"memcpy": 0.0}) == {}  # a zero rate is no reference


def test_split_covers_the_payload_in_order() -> None:
    assert raw_tcp.split(100, 4) == [(0, 25), (25, 25), (50, 25), (75, 25)]
    assert raw_tcp.split(10, 3) == [(0, 10)]  # no part shorter than the stamp
    assert raw_tcp.split(17, 2) == [(0, 9), (9, 8)]
    assert raw_tcp.split(4, 2) == [(0, 8)]  # never less than the stamp
    with pytest.raises(ValueError, match="streams"):
        raw_tcp.split(100, 0)


@given(st.integers(0, 1 << 30), st.integers(1, 16))
def test_split_parts_are_contiguous_even_and_hold_the_stamp(size: int, streams: int) -> None:
    parts = raw_tcp.split(size, streams)
    assert parts[0][0] == 0 and parts[0][1] >= raw_tcp.STAMP.size
    assert sum(n for _, n in parts) == max(size, raw_tcp.STAMP.size)
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(parts))
    assert 1 <= len(parts) <= streams
    assert max(n for _, n in parts) - min(n for _, n in parts) <= 1
