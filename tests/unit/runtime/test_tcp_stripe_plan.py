"""The tcp relay's stripe plan (relay/backends/tcp/stripe_plan.py): how many streams a
payload takes, and how its bytes are cut over them, apart from any socket."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg_runtime.bench import raw_tcp
from disagg_runtime.relay.backends.tcp import stripe_plan as sp

MiB = 1 << 20


def test_small_payloads_are_not_striped() -> None:
    for nbytes in (0, 4096, 64 << 10, MiB, sp.STREAMS_MIN - 1):
        assert sp.stream_count(nbytes, 8) == 0


def test_stream_count_grows_with_size_up_to_the_bound() -> None:
    assert sp.stream_count(sp.STREAMS_MIN, 8) == 1
    assert sp.stream_count(2 * sp.STRIPE_MIN, 8) == 2
    assert sp.stream_count(2 * sp.STRIPE_MIN - 1, 8) == 1  # no stripe under STRIPE_MIN
    assert sp.stream_count(256 * MiB, 8) == 8
    assert sp.stream_count(256 * MiB, 3) == 3
    assert sp.stream_count(256 * MiB, 1) == 1


def test_stream_count_default_is_one_per_core_bounded() -> None:
    assert sp.default_streams(2) == 2
    assert sp.default_streams(64) == sp.MAX_STREAMS
    assert sp.default_streams(0) == 1
    assert sp.stream_count(256 * MiB) == sp.default_streams()


@pytest.mark.parametrize("bad", [0, -1, sp.MAX_STREAMS + 1, 2.0, True, "2"])
def test_configured_streams_are_bounded(bad: object) -> None:
    with pytest.raises(ValueError, match="streams"):
        sp.check_streams(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="streams"):
        sp.stream_count(64 * MiB, bad)  # type: ignore[arg-type]


def test_the_bench_limit_uses_the_relays_n() -> None:
    """raw_tcp_n runs over the streams the relay cuts that size over: one derivation."""
    for size in (64 << 10, MiB, 16 * MiB, 64 * MiB, 256 * MiB):
        want = sp.stream_count(size) or sp.default_streams()
        assert raw_tcp.streams_for(size) == want


def test_cuts_are_aligned_contiguous_and_cover() -> None:
    total = 37 * MiB + 12345
    parts = sp.cuts(total, 3)
    assert len(parts) == 3
    assert parts[0][0] == 0
    assert sum(n for _, n in parts) == total
    for (a, n), (b, _) in itertools.pairwise(parts):
        assert a + n == b and b % sp.ALIGN == 0


def test_too_short_for_the_streams_gives_fewer_stripes() -> None:
    assert sp.cuts(3 * sp.ALIGN + 5, 8) == [
        (0, sp.ALIGN),
        (sp.ALIGN, sp.ALIGN),
        (2 * sp.ALIGN, sp.ALIGN + 5),
    ]
    assert sp.cuts(100, 4) == [(0, 100)]
    assert sp.cuts(0, 4) == []


def test_plan_splits_tensors_across_stripes_and_skips_empty_ones() -> None:
    sizes = [5 * MiB + 1, 0, 3 * MiB, 7]
    plan = sp.stripe_plan(sizes, 2)
    total = sum(sizes)
    half = (total // 2) // sp.ALIGN * sp.ALIGN
    assert plan[0] == [(0, 0, half)]
    assert plan[1] == [(0, half, sizes[0] - half), (2, 0, 3 * MiB), (3, 0, 7)]
    assert sp.stripe_bytes(plan) == [half, total - half]


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="negative"):
        sp.stripe_plan([4, -1], 2)
    with pytest.raises(ValueError, match="streams"):
        sp.cuts(10, 0)
    with pytest.raises(ValueError, match="align"):
        sp.cuts(10, 1, 0)


@given(
    sizes=st.lists(st.integers(0, 3 * sp.ALIGN + 7), min_size=0, max_size=6),
    streams=st.integers(1, sp.MAX_STREAMS),
    align=st.sampled_from([1, 8, sp.ALIGN]),
)
def test_every_byte_of_every_tensor_is_in_exactly_one_stripe(
    sizes: list[int], streams: int, align: int
) -> None:
    plan = sp.stripe_plan(sizes, streams, align)
    assert len(plan) <= streams
    covered: list[list[tuple[int, int]]] = [[] for _ in sizes]
    at = 0  # the stripes, in order, walk the tensors' bytes in order
    for stripe in plan:
        assert stripe, "no stripe is empty"
        for i, start, n in stripe:
            assert n > 0
            covered[i].append((start, n))
            at += n
    assert at == sum(sizes)
    for size, pieces in zip(sizes, covered, strict=True):
        pos = 0
        for start, n in pieces:
            assert start == pos
            pos += n
        assert pos == size
