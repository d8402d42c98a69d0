"""The dispatch policy (dispatch.py): load reports as they travel, filters, then power of
two choices over the time a new request would take; hashing when nothing is known."""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence

import pytest

from disagg_runtime.routing import dispatch, peers
from disagg_runtime.routing.dispatch import Load, LoadError, View

E = [f"tcp://10.0.0.{i}:7000" for i in range(3)]


def load(queued: int = 0, active: int = 0, workers: int = 1, **kw: object) -> Load:
    fields: dict[str, object] = {"free_bytes": 1 << 20, "pool_bytes": 1 << 20, **kw}
    return Load(queued=queued, active=active, workers=workers, **fields)  # type: ignore[arg-type]


def test_a_load_travels_as_json_and_back() -> None:
    report = load(3, 1, 2, free_bytes=100, pool_bytes=400, service_s=0.25, draining=True)
    assert Load.from_json(report.to_json()) == report
    assert report.occupancy == 0.75
    # later additions are ignored, so an older sender still reads a newer receiver
    assert Load.from_json({**report.to_json(), "future": [1, 2]}) == report


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"queued": -1}, "queued"),
        ({"queued": True}, "queued"),  # a bool is not a count
        ({"active": 1.5}, "active"),
        ({"workers": 0}, "workers"),
        ({"pool_bytes": 1 << 60}, "pool_bytes"),
        ({"free_bytes": 2 << 20}, "free_bytes"),  # more free than the pool holds
        ({"draining": "yes"}, "draining"),
        ({"service_s": float("nan")}, "service_s"),
        ({"service_s": -1.0}, "service_s"),
        ({"service_s": "1"}, "service_s"),
    ],
)
def test_a_malformed_load_is_refused_naming_the_field(
    change: dict[str, object], field: str
) -> None:
    with pytest.raises(LoadError, match=field):
        Load.from_json({**load().to_json(), **change})


@pytest.mark.parametrize("obj", [None, [], "load", 3])
def test_a_load_must_be_an_object(obj: object) -> None:
    with pytest.raises(LoadError, match="object"):
        Load.from_json(obj)


def test_a_missing_count_is_refused() -> None:
    report = load().to_json()
    del report["queued"]
    with pytest.raises(LoadError, match="queued"):
        Load.from_json(report)


def test_an_idle_slow_replica_scores_worse_than_a_busy_fast_one() -> None:
    slow_idle = View(load(service_s=0.5), 0.0)
    fast_busy = View(load(active=1, queued=1, service_s=0.1), 0.0)
    assert dispatch.score(fast_busy) < dispatch.score(slow_idle)
    # what this sender sent since the report counts, and so do workers
    assert dispatch.score(View(load(service_s=0.1), 0.0, sent_since=5)) > dispatch.score(slow_idle)
    assert dispatch.score(View(load(active=4, workers=4, service_s=0.1), 0.0)) < dispatch.score(
        View(load(active=4, workers=1, service_s=0.1), 0.0)
    )
    # a fuller pool breaks a tie
    full = View(load(free_bytes=0, service_s=0.1), 0.0)
    assert dispatch.score(full) > dispatch.score(View(load(service_s=0.1), 0.0))


def test_nothing_known_means_hashing() -> None:
    rng = random.Random(1)
    for i in range(20):
        rid = f"r{i}"
        assert dispatch.choose(E, {}, rid, rng=rng) == peers.pick(E, rid)
        stale = {e: View(load(), age_s=dispatch.MAX_AGE_S + 1) for e in E}
        assert dispatch.choose(E, stale, rid, rng=rng) == peers.pick(E, rid)


def test_the_less_busy_of_two_wins_every_time() -> None:
    views = {E[0]: View(load(queued=5, service_s=0.1), 0.0), E[1]: View(load(service_s=0.1), 0.0)}
    rng = random.Random(2)
    assert {dispatch.choose(E[:2], views, f"r{i}", rng=rng) for i in range(50)} == {E[1]}


def test_a_slow_replica_gets_a_small_share() -> None:
    """Three replicas reporting what a queue of each would look like: the slow one (five
    times slower, hence usually with a request in hand) is rarely chosen."""
    rng = random.Random(3)
    views = {
        E[0]: View(load(active=1, service_s=0.5), 0.0),
        E[1]: View(load(active=1, service_s=0.1), 0.0),
        E[2]: View(load(service_s=0.1), 0.0),
    }
    counts = collections.Counter(dispatch.choose(E, views, f"r{i}", rng=rng) for i in range(600))
    assert counts[E[0]] == 0  # it loses to both others whenever it is drawn
    assert counts[E[2]] > counts[E[1]] > 0


def test_idle_replicas_whose_times_differ_by_noise_share_the_requests() -> None:
    """Two idle replicas, one measured 15 % slower (noise in a handler's time): a tie, not
    every request to the other (which then kept a fresh time while the loser's froze)."""
    rng = random.Random(5)
    views = {
        E[0]: View(load(workers=4, service_s=0.0605), 0.0),
        E[1]: View(load(workers=4, service_s=0.0516), 0.0),
    }
    counts = collections.Counter(
        dispatch.choose(E[:2], views, f"r{i}", rng=rng) for i in range(600)
    )
    assert min(counts.values()) > 200, counts


def test_an_unknown_replica_is_tried_not_preferred() -> None:
    """A replica without a fresh report scores as the mean of the known ones."""
    rng = random.Random(4)
    views: dict[str, View | None] = {
        E[0]: View(load(queued=4, service_s=0.1), 0.0),
        E[1]: View(load(service_s=0.1), 0.0),
        E[2]: None,
    }
    counts = collections.Counter(dispatch.choose(E, views, f"r{i}", rng=rng) for i in range(600))
    assert counts[E[1]] > counts[E[2]] > counts[E[0]]


def test_draining_replicas_get_no_new_requests_unless_all_drain() -> None:
    rng = random.Random(5)
    views = {
        E[0]: View(load(draining=True), 0.0),
        E[1]: View(load(queued=9, service_s=1.0), 0.0),
    }
    assert {dispatch.choose(E[:2], views, f"r{i}", rng=rng) for i in range(30)} == {E[1]}
    both = {e: View(load(draining=True), 0.0) for e in E[:2]}
    assert dispatch.choose(E[:2], both, "r", rng=rng) in E[:2]


@pytest.mark.parametrize(
    "view",
    [
        None,
        View(load(), 0.0),
        View(load(draining=True), 0.0),
        View(load(queued=99, service_s=9.0, free_bytes=0), 0.0),
        View(load(), dispatch.MAX_AGE_S * 10),
    ],
)
def test_a_lone_replica_is_chosen_whatever_its_view(view: View | None) -> None:
    """What PeerSet.endpoint_for relies on to skip reading views when one replica is
    listed: the default filters and the choice never turn a lone replica down."""
    rng = random.Random(7)
    assert dispatch.choose(E[:1], {E[0]: view}, "r", rng=rng) == E[0]


def test_filters_compose_and_may_leave_none() -> None:
    """A caller's own filter (say, replicas of a compatible revision) runs before the
    choice; when it leaves nobody, there is no replica to send to."""
    compatible = {E[2]}

    def only_compatible(endpoints: Sequence[str], views: dispatch.Views) -> list[str]:
        return [e for e in endpoints if e in compatible]

    rng = random.Random(6)
    views = {e: View(load(), 0.0) for e in E}
    filters = (*dispatch.DEFAULT_FILTERS, only_compatible)
    assert dispatch.choose(E, views, "r", rng=rng, filters=filters) == E[2]
    compatible.clear()
    assert dispatch.choose(E, views, "r", rng=rng, filters=filters) is None


def test_hashing_spreads_evenly_over_similar_names() -> None:
    """Endpoints that differ in a port digit or two each get about a third (CRC32 weights
    gave one of them half)."""
    endpoints = ["tcp://127.0.0.1:41233", "tcp://127.0.0.1:41235", "tcp://127.0.0.1:41237"]
    counts = collections.Counter(dispatch.rendezvous(endpoints, f"{i:032x}") for i in range(3000))
    assert all(850 < counts[e] < 1150 for e in endpoints), counts
