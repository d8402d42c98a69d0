"""routing/migration.decide and routing/inflight.InFlight: which lost requests move."""

from __future__ import annotations

import time

import pytest

from disagg_runtime.routing import migration
from disagg_runtime.routing.inflight import InFlight, Sent
from disagg_runtime.routing.migration import HANDED_BACK, LOST, Policy, Seen
from disagg_runtime.wire.envelope import Meta, Reply

EXITS = ("decoder",)


def _decide(**kw: object) -> tuple[str, str]:
    args: dict[str, object] = {
        "reason": LOST,
        "role": "denoiser",
        "exits": EXITS,
        "seen": Seen(),
        "moved": 0,
        "remaining_s": 10.0,
        "kept": True,
    }
    args.update(kw)
    return migration.decide(Policy(max_attempts=3), **args)  # type: ignore[arg-type]


def test_a_role_not_idempotent_bars_moves_of_what_may_have_run_there() -> None:
    """encoder -> denoiser -> decoder with the denoiser not idempotent: a request the
    decoder hands back may have run at the denoiser (fails, naming it); one the denoiser
    hands back had not run there (moves); one lost with a replica may have run anywhere."""
    policy = Policy(
        max_attempts=3,
        not_idempotent=frozenset({"denoiser"}),
        unsafe_before={"decoder": frozenset({"denoiser"})},
    )

    def decide(reason: str, role: str) -> tuple[str, str]:
        return migration.decide(
            policy, reason=reason, role=role, exits=EXITS, seen=Seen(), moved=0,
            remaining_s=10.0, kept=True,
        )  # fmt: skip

    verdict, why = decide(HANDED_BACK, "decoder")
    assert verdict == "fail" and "may have run at denoiser (not idempotent)" in why
    assert decide(HANDED_BACK, "denoiser")[0] == "move"
    assert decide(HANDED_BACK, "encoder")[0] == "move"
    assert decide(LOST, "encoder")[0] == "fail"
    assert Policy().ran_unsafe(LOST, "x") == frozenset()  # every role idempotent


def test_the_policy_of_a_topology() -> None:
    from disagg_core.contract import Topology
    from disagg_core.spec import load_pipeline_file
    from tests.support import EXAMPLES

    pipeline = load_pipeline_file(EXAMPLES / "text-to-video.yaml")
    policy = Policy.of(Topology.from_pipeline(pipeline))
    assert policy.max_attempts == pipeline.transport.migration_attempts
    assert policy.not_idempotent == frozenset() and dict(policy.unsafe_before) == {}


def test_a_request_nothing_came_back_of_moves() -> None:
    assert _decide()[0] == "move"
    assert _decide(reason=HANDED_BACK)[0] == "move"
    assert "handed it back" in _decide(reason=HANDED_BACK)[1]


@pytest.mark.parametrize(
    ("kw", "verdict", "why"),
    [
        ({"moved": 3}, "fail", "moved 3 times already"),
        ({"remaining_s": 0.1}, "fail", "0.10 s of its deadline left"),
        ({"kept": False}, "fail", "written in place"),
        # the exit role streaming it died midway: it cannot be taken back
        (
            {"role": "decoder", "seen": Seen(frozenset({"decoder"}))},
            "fail",
            "role decoder lost it after output of it had reached the client",
        ),
        # a middle role "lost" after output came: it had passed it on; the stream goes on
        ({"seen": Seen(frozenset({"decoder"}))}, "ignore", "passed it on"),
        # an exit whose stream ended is not the one streaming it
        (
            {"role": "decoder", "seen": Seen(frozenset({"decoder"}), frozenset({"decoder"}))},
            "ignore",
            "passed it on",
        ),
        ({"reason": HANDED_BACK, "seen": Seen(frozenset({"decoder"}))}, "fail", "handed it back"),
    ],
)
def test_what_does_not_move(kw: dict[str, object], verdict: str, why: str) -> None:
    got, message = _decide(**kw)
    assert got == verdict and why in message, message


def test_no_attempts_means_never() -> None:
    verdict, why = migration.decide(
        Policy(max_attempts=0),
        reason=LOST,
        role="r",
        exits=EXITS,
        seen=Seen(),
        moved=0,
        remaining_s=10.0,
        kept=False,  # as the client has it: with no attempts it keeps no payload
    )
    assert verdict == "fail" and "request migration is off" in why, why


def _meta(rid: str, ttl: float = 30.0) -> Meta:
    return Meta(rid, "data", "client", time.time() + ttl, Reply("tcp://127.0.0.1:1", "tcp"))


def test_inflight_reports_what_went_to_a_lost_replica_once() -> None:
    table = InFlight(limit=4)
    table.add(Sent(_meta("a"), "d", "tcp", "tcp://x:1"))
    table.add(Sent(_meta("b"), "d", "tcp", "tcp://x:2"))
    table.add(Sent(_meta("c"), "d", "tcp", "tcp://x:1"))
    table.add(Sent(_meta("gone", ttl=-1.0), "d", "tcp", "tcp://x:1"))  # past its deadline
    assert table.replicas() == {("tcp", "tcp://x:1"), ("tcp", "tcp://x:2")}
    lost = table.lost("tcp", "tcp://x:1", but="c")
    assert [s.meta.rid for s in lost] == ["a"]  # c is being resent by its sender itself
    assert [s.meta.rid for s in table.lost("tcp", "tcp://x:1")] == ["c"]  # a: reported once
    assert table.forget("b", "d") is not None and len(table) == 0


def test_inflight_is_bounded() -> None:
    table = InFlight(limit=3)
    for i in range(10):
        table.add(Sent(_meta(f"r{i}"), "d", "tcp", "tcp://x:1"))
    assert len(table) == 3
    assert [s.meta.rid for s in table.lost("tcp", "tcp://x:1")] == ["r7", "r8", "r9"]
