"""The coordinated rollout's stepping (operator/disagg_operator/rollout/steps.py), driven by a
simulated StatefulSet controller that moves one pod at a time, as the real one does."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_core.spec.model import IntOrPercent
from disagg_operator.rollout.steps import RolloutPolicy, Step, Unit, coupled, step


def pct(value: int) -> IntOrPercent:
    return IntOrPercent(value, percent=True)


def pods(value: int) -> IntOrPercent:
    return IntOrPercent(value)


def fresh(replicas: int) -> Unit:
    """A unit whose template just changed: no pod at the new revision, partition = n."""
    return Unit(replicas=replicas, updated=0, ready=replicas, rolling=True, target=0)


def simulate(
    policy: RolloutPolicy,
    replicas: dict[str, int],
    groups: list[list[str]],
    max_steps: int = 500,
    feeds: dict[str, frozenset[str]] | None = None,
) -> tuple[list[dict[str, float]], Step]:
    """Roll to the end; return every observed {unit: updated fraction} (one pod at a time)."""
    units = {n: fresh(r) for n, r in replicas.items()}
    seen = [{n: u.fraction for n, u in units.items()}]
    for _ in range(max_steps):
        decision = step(policy, units, groups, feeds=feeds)
        if decision.complete:
            return seen, decision
        assert not decision.held, decision
        units = {
            n: Unit(u.replicas, u.updated, u.ready, u.rolling, decision.targets[n])
            for n, u in units.items()
        }
        # the controller moves one pod at a time, in any interleaving across units
        while any(u.updated < u.target for u in units.values()):
            for n, u in units.items():
                if u.updated < u.target:
                    units[n] = Unit(u.replicas, u.updated + 1, u.replicas, True, u.target)
                    seen.append({m: v.fraction for m, v in units.items()})
    raise AssertionError("the rollout did not finish")


def test_coupled_units_advance_together_within_max_skew():
    seen, last = simulate(
        RolloutPolicy(max_skew=pct(25)), {"prefill": 4, "decode": 8}, [["prefill", "decode"]]
    )
    assert last.complete and last.partitions == {"prefill": 0, "decode": 0}
    assert all(max(f.values()) - min(f.values()) <= 0.25 + 1e-9 for f in seen)
    assert seen[-1] == {"prefill": 1.0, "decode": 1.0}


def test_uncoupled_units_roll_independently():
    first = step(
        RolloutPolicy(max_skew=pct(25), max_unavailable=pods(4)), {"a": fresh(4), "b": fresh(4)}
    )
    assert first.targets == {"a": 4, "b": 4}


def test_a_skew_smaller_than_one_pod_still_progresses():
    _, last = simulate(RolloutPolicy(max_skew=pct(10)), {"a": 2, "b": 3}, [["a", "b"]])
    assert last.complete


def test_an_unfinished_step_holds_every_unit_and_stalls_after_the_deadline():
    policy = RolloutPolicy(step_deadline_s=60)
    units = {
        "a": Unit(replicas=2, updated=1, ready=1, rolling=True, target=1),  # new pod not ready
        "b": Unit(replicas=2, updated=1, ready=2, rolling=True, target=1),
    }
    held = step(policy, units, [["a", "b"]], step_age_s=10)
    assert held.held and held.waiting == ("a",) and held.stalled == ()
    assert held.partitions == {"a": 1, "b": 1}
    assert step(policy, units, [["a", "b"]], step_age_s=61).stalled == ("a",)


def test_paused_holds_and_partition_keeps_pods_back():
    units = {"a": fresh(4)}
    assert step(RolloutPolicy(paused=True), units).partitions == {"a": 4}
    _, last = simulate(RolloutPolicy(partition=pods(1), max_unavailable=pods(2)), {"a": 4}, [])
    assert last.partitions == {"a": 1} and last.complete


def test_units_without_a_new_revision_stay_as_they_are():
    units = {"a": fresh(2), "b": Unit(replicas=3, updated=3, ready=3, rolling=False, target=3)}
    decision = step(RolloutPolicy(max_skew=pct(50)), units, [["a", "b"]])
    # b has nothing to roll, so it does not hold a back: a rolls natively (partition 0)
    assert decision.partitions == {"a": 0, "b": 0}


def test_without_coupling_the_statefulset_controller_rolls_natively():
    units = {"a": fresh(4), "b": fresh(3)}
    assert step(RolloutPolicy(), units, [["a", "b"]]).partitions == {"a": 0, "b": 0}  # maxSkew 1
    assert step(RolloutPolicy(max_skew=pct(50)), units).partitions == {"a": 0, "b": 0}  # no group
    assert step(RolloutPolicy(max_skew=pct(50), partition=pods(1)), units).partitions == {
        "a": 1,
        "b": 1,
    }


def test_coupling_is_transitive():
    groups = coupled(["a", "b", "c", "d"], [["a", "b"], ["b", "c"]])
    assert sorted(sorted(g) for g in groups) == [["a", "b", "c"], ["d"]]


def test_policy_bounds():
    for bad in (
        lambda: RolloutPolicy(max_unavailable=pods(0)),
        lambda: RolloutPolicy(max_skew=pods(0)),
        lambda: RolloutPolicy(max_skew=pct(150)),
        lambda: RolloutPolicy(partition=pods(-1)),
    ):
        with pytest.raises(ValueError):
            bad()


@settings(max_examples=150, deadline=None)
@given(
    replicas=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    skew=st.sampled_from([10, 25, 34, 50, 100]),
    unavailable=st.integers(1, 3),
)
def test_any_coupled_rollout_finishes_and_never_exceeds_the_skew(replicas, skew, unavailable):
    names = [f"u{i}" for i in range(len(replicas))]
    seen, last = simulate(
        RolloutPolicy(max_skew=pct(skew), max_unavailable=pods(unavailable)),
        dict(zip(names, replicas, strict=True)),
        [names],
    )
    assert last.complete
    one_pod = max(1 / r for r in replicas)  # the documented rounding of a tiny maxSkew
    for fractions in seen:
        assert max(fractions.values()) - min(fractions.values()) <= max(skew / 100, one_pod) + 1e-9
    assert list(itertools.islice(seen, 1)) == [dict.fromkeys(names, 0.0)]


def test_senders_roll_first_so_an_old_sender_keeps_a_partner():
    """prefill -> decode pairing by compat, 2 + 2 pods, maxSkew 0.5 (the e2e_local rollout):
    decode's last old pod waits until prefill has no old pod left."""
    feeds = {"decode": frozenset({"prefill"})}
    for order in (["prefill", "decode"], ["decode", "prefill"]):
        replicas = {n: 2 for n in order}  # the simulated controller moves in this order
        seen, last = simulate(RolloutPolicy(max_skew=pct(50)), replicas, [order], feeds=feeds)
        assert last.complete
        assert all(f["decode"] < 1 or f["prefill"] == 1 for f in seen), seen
        assert all(abs(f["prefill"] - f["decode"]) <= 0.5 for f in seen)
    seen, _ = simulate(
        RolloutPolicy(max_skew=pct(50)), {"decode": 2, "prefill": 2}, [["prefill", "decode"]]
    )
    assert any(f["decode"] == 1 and f["prefill"] < 1 for f in seen)  # without feeds it may


@settings(max_examples=150, deadline=None)
@given(
    replicas=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    skew=st.sampled_from([10, 25, 34, 50, 100]),
    unavailable=st.integers(1, 3),
)
def test_senders_first_still_finishes_within_the_skew(replicas, skew, unavailable):
    names = [f"u{i}" for i in range(len(replicas))]
    feeds = {b: frozenset({a}) for a, b in itertools.pairwise(names)}  # a chain u0 -> u1 ...
    seen, last = simulate(
        RolloutPolicy(max_skew=pct(skew), max_unavailable=pods(unavailable)),
        dict(zip(names, replicas, strict=True)),
        [names],
        feeds=feeds,
    )
    assert last.complete
    one_pod = max(1 / r for r in replicas)
    for fractions in seen:
        assert max(fractions.values()) - min(fractions.values()) <= max(skew / 100, one_pod) + 1e-9


def test_feeds_only_where_both_roles_pair_by_a_declared_token():
    from disagg_core.spec import parse_pipeline
    from disagg_operator.rollout.state import feeds_of

    doc: dict[str, Any] = {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "pd"},
        "spec": {
            "image": "img:1",
            "roles": [
                {"name": "prefill", "handler": "m:p", "compat": "kv-1"},
                {"name": "decode", "handler": "m:d", "compat": "kv-1"},
                {"name": "post", "handler": "m:q"},
            ],
            "edges": [{"from": "prefill", "to": "decode"}, {"from": "decode", "to": "post"}],
        },
    }
    assert feeds_of(parse_pipeline(doc)) == {"decode": frozenset({"prefill"})}
    del doc["spec"]["roles"][0]["compat"]
    assert feeds_of(parse_pipeline(doc)) == {}


def test_percentages_resolve_per_unit_like_a_deployment():
    """maxUnavailable 50% of 4 pods is 2 (rounded down, at least 1), partition 25% of 3 pods
    keeps 1 (rounded up), a maxSkew of 1 pod is a share of each unit's replicas."""
    policy = RolloutPolicy(max_unavailable=pct(50), partition=pct(25), max_skew=pods(1))
    assert policy.unavailable(4) == 2 and policy.unavailable(1) == 1
    assert policy.kept(3) == 1 and policy.kept(0) == 0
    _, last = simulate(policy, {"a": 4, "b": 4}, [["a", "b"]])
    assert last.complete and last.partitions == {"a": 1, "b": 1}
