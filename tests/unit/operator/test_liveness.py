"""liveness: when the operator counts as stuck (pure parts: `problems`, `Progress`)."""

from __future__ import annotations

import logging

import kopf

from disagg_operator.app import liveness
from disagg_operator.reconcile.progress import Progress

WATCHED = ("disaggregatedpipelines", "statefulsets")


def check(now: float, heard: dict[str, float] | None, stalled: float = 0.0) -> list[str]:
    return liveness.problems(
        now,
        started=0.0,
        watched=WATCHED,
        heard=heard,
        work_stalled_for=stalled,
        stall_after=300.0,
    )


def test_recently_heard_watches_and_idle_work_are_alive():
    assert check(1000.0, {"disaggregatedpipelines": 900.0, "statefulsets": 990.0}) == []


def test_a_silent_watch_is_stuck_and_named():
    found = check(1000.0, {"disaggregatedpipelines": 990.0, "statefulsets": 650.0})
    assert found == ["the watch of statefulsets has been silent for 350 s"]


def test_a_watch_never_heard_counts_from_the_start():
    assert check(200.0, {}) == []  # still starting
    assert len(check(400.0, {})) == 2


def test_unobservable_watches_are_not_judged():
    assert check(10_000.0, None) == []


def test_work_waiting_too_long_is_stuck():
    assert check(1000.0, None, stalled=299.0) == []
    assert check(1000.0, None, stalled=301.0) == ["reconciles have waited 301 s without one ending"]


def test_progress_counts_from_the_last_work_that_ended():
    now = [0.0]
    progress = Progress(clock=lambda: now[0])
    assert progress.stalled_for(100.0) == 0.0  # idle
    with progress.working():
        now[0] = 10.0
        with progress.working():
            now[0] = 50.0
        # one ended at 50: the other has waited since then
        assert progress.stalled_for(80.0) == 30.0
    assert progress.pending == 0 and progress.stalled_for(500.0) == 0.0


def test_progress_starts_counting_when_work_arrives():
    now = [0.0]
    progress = Progress(clock=lambda: now[0])
    now[0] = 1000.0  # idle until now
    with progress.working():
        assert progress.stalled_for(1010.0) == 10.0


def _record(error: BaseException | None) -> logging.LogRecord:
    exc_info = None if error is None else (type(error), error, error.__traceback__)
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "x", (), exc_info)


def test_a_failed_probe_logs_no_traceback_but_other_request_errors_do():
    quiet = liveness.ProbeFailureLogged()
    try:
        try:
            raise kopf.PermanentError("stuck: reconciles have waited")
        except kopf.PermanentError as reason:
            raise RuntimeError("One or more handlers failed.") from reason  # as kopf does
    except RuntimeError as probe_failed:
        assert not quiet.filter(_record(probe_failed))
    assert quiet.filter(_record(ValueError("a bug in a request handler")))
    assert quiet.filter(_record(None))
