"""The occupancy autoscaler: HPA-like rules, windows, staleness and ratio locks."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_core.autoscale import Autoscaler, Policy, RatioLock, Sample, recommend

POLICY = Policy(min_replicas=1, max_replicas=8, target_occupancy=0.5, scale_down_window_s=60)


def samples(occupancy: float, n: int, at: float, **kw) -> list[Sample]:
    return [Sample(f"r{i}", occupancy, at=at, **kw) for i in range(n)]


def run(scaler: Autoscaler, loads: list[float], *, start: int = 2, step_s: float = 15.0):
    """Feed one occupancy per decision; replicas follow decisions; return the counts."""
    replicas, counts = start, []
    for i, load in enumerate(loads):
        now = i * step_s
        decision = scaler.decide(now, {"d": replicas}, {"d": samples(load, replicas, now)})["d"]
        replicas = decision.desired
        counts.append(replicas)
    return counts


def test_steady_load_inside_tolerance_changes_nothing():
    scaler = Autoscaler({"d": POLICY})
    assert run(scaler, [0.5, 0.53, 0.47, 0.52] * 10) == [2] * 40


def test_spike_scales_up_within_one_decision():
    scaler = Autoscaler({"d": POLICY})
    counts = run(scaler, [0.5, 1.0])
    assert counts == [2, 4]  # ceil(2 * 1.0 / 0.5)


def test_scale_up_step_is_limited():
    policy = Policy(1, 50, target_occupancy=0.1, max_step_up=3)
    assert run(Autoscaler({"d": policy}), [1.0]) == [5]


def test_scale_down_waits_for_the_window():
    scaler = Autoscaler({"d": POLICY})
    counts = run(scaler, [0.5] + [0.1] * 8, start=4)  # decisions every 15 s, window 60 s
    assert counts[:5] == [4, 4, 4, 4, 4]  # the 0.5 reading is still inside the window
    assert counts[5] == 1  # first decision with only low readings in the window
    assert counts[-1] == 1


def test_oscillating_load_does_not_flap():
    scaler = Autoscaler({"d": POLICY})
    counts = run(scaler, [1.0, 0.1] * 20)
    changes = sum(1 for a, b in itertools.pairwise(counts) if a != b)
    assert changes <= 2, counts  # up once, then held up by the down window


def test_stale_or_missing_samples_never_scale_down():
    policy = Policy(1, 8, target_occupancy=0.5, scale_down_window_s=0)
    scaler = Autoscaler({"d": policy}, stale_after_s=30)
    old = samples(0.0, 4, at=0.0)
    decision = scaler.decide(100.0, {"d": 4}, {"d": old})["d"]
    assert decision.desired == 4 and "no fresh" in decision.reason
    partial = samples(0.0, 3, at=100.0)  # one of four replicas has no sample
    decision = scaler.decide(100.0, {"d": 4}, {"d": partial})["d"]
    assert decision.desired == 4 and "block scale-down" in decision.reason
    failed = [*partial, Sample("r3", None, at=100.0)]  # a failed scrape
    assert scaler.decide(100.0, {"d": 4}, {"d": failed})["d"].desired == 4


def test_queued_requests_block_scale_down():
    policy = Policy(1, 8, target_occupancy=0.5, scale_down_window_s=0)
    desired, reason, _ = recommend(policy, 4, samples(0.05, 4, 0.0, queue_depth=2), 0.0, 30)
    assert desired == 4 and "queued" in reason


def test_not_ready_replicas_count_as_idle_when_scaling_up():
    ready = [Sample("a", 0.9, at=0.0), Sample("b", 0.9, at=0.0)]
    starting = [Sample("c", None, ready=False, at=0.0), Sample("d", None, ready=False, at=0.0)]
    # alone, two busy replicas would ask for 4; counting the two starting ones as idle, 4
    # replicas at mean 0.45 are about at target: no further step while they come up
    desired, _, _ = recommend(POLICY, 4, ready + starting, 0.0, 30)
    assert desired == 4
    assert recommend(POLICY, 2, ready, 0.0, 30)[0] == 4


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.floats(min_value=0, max_value=1), min_size=1, max_size=30),
    lo=st.integers(1, 4),
    span=st.integers(0, 6),
    start=st.integers(1, 12),
)
def test_min_and_max_always_hold(loads, lo, span, start):
    policy = Policy(lo, lo + span, target_occupancy=0.6, scale_down_window_s=30)
    counts = run(Autoscaler({"d": policy}), loads, start=start)
    assert all(lo <= c <= lo + span for c in counts)


def test_ratio_lock_makes_the_follower_follow():
    policies = {"den": Policy(1, 16, target_occupancy=0.5), "dec": Policy(1, 4)}
    lock = RatioLock("den", "dec", leader_share=4, follower_share=1)
    scaler = Autoscaler(policies, [lock])
    now = 0.0
    decisions = scaler.decide(
        now,
        {"den": 4, "dec": 1},
        {"den": samples(1.0, 4, now), "dec": samples(0.7, 1, now)},
    )
    assert decisions["den"].desired == 8
    assert decisions["dec"].desired == 2 and "ratio lock" in decisions["dec"].reason


def test_ratio_lock_tolerance_leaves_small_drift_alone():
    policies = {"den": Policy(1, 16), "dec": Policy(1, 8)}
    lock = RatioLock("den", "dec", 4, 1, tolerance=0.5)
    scaler = Autoscaler(policies, [lock])
    decisions = scaler.decide(
        0.0, {"den": 8, "dec": 3}, {"den": samples(0.7, 8, 0.0), "dec": samples(0.7, 3, 0.0)}
    )
    assert decisions["dec"].desired == 3  # wants 2; 3 is within 50 %


def test_ratio_lock_respects_the_followers_bounds():
    policies = {"den": Policy(1, 32, target_occupancy=0.5), "dec": Policy(1, 3)}
    scaler = Autoscaler(policies, [RatioLock("den", "dec", 2, 1)])
    decisions = scaler.decide(
        0.0, {"den": 8, "dec": 3}, {"den": samples(1.0, 8, 0.0), "dec": samples(0.7, 3, 0.0)}
    )
    assert decisions["den"].desired == 16
    assert decisions["dec"].desired == 3


def test_policy_rejects_bad_bounds():
    import pytest

    with pytest.raises(ValueError, match="minReplicas"):
        Policy(3, 2)
    with pytest.raises(ValueError, match="targetPoolOccupancy"):
        Policy(1, 2, target_occupancy=1.5)


def test_a_fresh_autoscaler_holds_scale_downs_for_one_window():
    policy = Policy(1, 8, target_occupancy=0.5, scale_down_window_s=60)
    scaler = Autoscaler({"d": policy})
    idle = samples(0.0, 4, at=100.0)
    assert scaler.decide(100.0, {"d": 4}, {"d": idle})["d"].desired == 4  # first look
    assert scaler.decide(130.0, {"d": 4}, {"d": samples(0.0, 4, 130.0)})["d"].desired == 4
    assert scaler.decide(161.0, {"d": 4}, {"d": samples(0.0, 4, 161.0)})["d"].desired == 1
    # scale-up is never held
    fresh = Autoscaler({"d": policy})
    assert fresh.decide(0.0, {"d": 1}, {"d": samples(1.0, 1, 0.0)})["d"].desired == 2


# -- the queue signal ----------------------------------------------------------------------


QUEUE_POLICY = Policy(1, 8, target_occupancy=0.4, scale_down_window_s=0, target_queue=2)


def test_a_queue_of_small_payloads_scales_up_where_occupancy_does_not():
    """Eight queued 1 MiB requests fill 6 % of a 128 MiB pool: occupancy says idle."""
    backlog = samples(0.06, 1, 0.0, queue_depth=8)
    assert recommend(Policy(1, 8, target_occupancy=0.4), 1, backlog, 0.0, 30)[0] == 1
    desired, reason, signal = recommend(QUEUE_POLICY, 1, backlog, 0.0, 30)
    assert (desired, signal) == (4, "queue")
    assert "queue 8.0/replica vs target 2" in reason


def test_the_larger_ratio_drives_and_is_named():
    full_pool = samples(0.8, 2, 0.0, queue_depth=1)  # occupancy 2x target, queue 0.5x
    assert recommend(QUEUE_POLICY, 2, full_pool, 0.0, 30)[::2] == (4, "occupancy")
    long_queue = samples(0.2, 2, 0.0, queue_depth=6)  # occupancy 0.5x, queue 3x
    assert recommend(QUEUE_POLICY, 2, long_queue, 0.0, 30)[::2] == (6, "queue")


def test_with_a_queue_target_a_short_queue_no_longer_blocks_scale_down():
    quiet = [*samples(0.05, 4, 0.0, queue_depth=0), Sample("r4", 0.05, queue_depth=1, at=0.0)]
    desired, _, signal = recommend(QUEUE_POLICY, 5, quiet, 0.0, 30)
    assert desired < 5 and signal in ("queue", "occupancy")


def test_decisions_record_their_signal_and_locks_theirs():
    scaler = Autoscaler({"den": QUEUE_POLICY, "dec": Policy(1, 8)}, [RatioLock("den", "dec", 1, 1)])
    decisions = scaler.decide(
        0.0, {"den": 1, "dec": 1}, {"den": samples(0.0, 1, 0.0, queue_depth=8)}
    )
    assert (decisions["den"].desired, decisions["den"].signal) == (4, "queue")
    assert (decisions["dec"].desired, decisions["dec"].signal) == (4, "ratio-lock")


def test_a_queue_target_must_be_positive():
    with pytest.raises(ValueError, match="targetQueuePerReplica"):
        Policy(1, 2, target_queue=0)


def test_a_window_counts_in_scrape_results_and_a_timed_out_scrape_is_no_signal():
    """CPU starvation: most scrapes time out. A scale-down needs its lower recommendation to
    hold in results that cover the window, not two results a window apart; decisions with
    no fresh sample (every scrape timed out) are not a signal either way."""
    policy = Policy(1, 8, target_occupancy=0.5, scale_down_window_s=60)
    timed_out = [Sample(f"r{i}", None, ready=True, at=0.0) for i in range(4)]
    scaler = Autoscaler({"d": policy})
    assert scaler.decide(0.0, {"d": 4}, {"d": samples(0.0, 4, 0.0)})["d"].desired == 4
    for t in (20.0, 40.0):  # the scrapes time out: no signal, and the run is broken
        decision = scaler.decide(t, {"d": 4}, {"d": timed_out})["d"]
        assert decision.desired == 4 and "no fresh pool samples" in decision.reason
    # idle results a window apart are not a window held in results
    assert scaler.decide(45.0, {"d": 4}, {"d": samples(0.0, 4, 45.0)})["d"].desired == 4
    assert scaler.decide(110.0, {"d": 4}, {"d": samples(0.0, 4, 110.0)})["d"].desired == 4
    # two results late in a window do not cover it; from 110 on they do: down it goes
    assert scaler.decide(115.0, {"d": 4}, {"d": samples(0.0, 4, 115.0)})["d"].desired == 4
    assert scaler.decide(140.0, {"d": 4}, {"d": samples(0.0, 4, 140.0)})["d"].desired == 1


def test_an_up_window_needs_its_signal_held_in_results():
    policy = Policy(1, 8, target_occupancy=0.5, scale_up_window_s=30)
    scaler = Autoscaler({"d": policy})
    busy = lambda t: samples(1.0, 2, t)  # noqa: E731
    assert scaler.decide(0.0, {"d": 2}, {"d": busy(0.0)})["d"].desired == 2  # first result
    assert scaler.decide(10.0, {"d": 2}, {"d": samples(0.5, 2, 10.0)})["d"].desired == 2
    assert scaler.decide(31.0, {"d": 2}, {"d": busy(31.0)})["d"].desired == 2  # broken at 10
    assert scaler.decide(45.0, {"d": 2}, {"d": busy(45.0)})["d"].desired == 2
    assert scaler.decide(62.0, {"d": 2}, {"d": busy(62.0)})["d"].desired == 4  # held 31..62
