"""reconcile.refresh: the backoff (pure), and the scheduler's coalescing, retries, rechecks
and tasks, with refreshes that record what they were asked (no API)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from disagg_operator.k8s import client as kube
from disagg_operator.reconcile import refresh
from disagg_operator.reconcile.cache import Key

KEY: Key = ("ns", "p")


def test_the_retry_ceiling_doubles_from_one_second_up_to_the_cap() -> None:
    ceilings = [refresh.retry_ceiling(n) for n in range(1, 10)]
    assert ceilings == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


def test_the_retry_delay_lies_between_half_the_ceiling_and_the_ceiling() -> None:
    asked: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        asked.append((low, high))
        return high

    assert refresh.retry_delay(3, uniform) == 4.0
    assert refresh.retry_delay(20, uniform) == 60.0
    assert asked == [(2.0, 4.0), (30.0, 60.0)]
    for failures in range(1, 12):  # the real jitter stays in the same bounds
        ceiling = refresh.retry_ceiling(failures)
        assert ceiling / 2 <= refresh.retry_delay(failures) <= ceiling


class Pipelines:
    """A scheduler over tracked pipelines whose refreshes fail while `failing` > 0."""

    def __init__(self) -> None:
        self.tracked: dict[Key, refresh.Timers] = {KEY: refresh.Timers()}
        self.refreshed: list[Key] = []
        self.reconciled: list[Key] = []
        self.backoffs: list[int] = []
        self.failing = 0
        self.scheduler = refresh.Scheduler(
            refresh=self.refreshing,
            reconcile=self.reconciling,
            timers=self.tracked.get,
            coalesce=0.01,
            backoff=self.backoff,
        )

    async def refreshing(self, key: Key) -> None:
        self.refreshed.append(key)
        if self.failing:
            self.failing -= 1
            raise kube.ApiError(503, "ServiceUnavailable", "down")

    async def reconciling(self, key: Key) -> None:
        self.reconciled.append(key)
        raise RuntimeError("boom")  # logged, not raised out of the task

    def backoff(self, failures: int) -> float:
        self.backoffs.append(failures)
        return 0.01

    @property
    def timers(self) -> refresh.Timers:
        return self.tracked[KEY]


async def until(condition: Callable[[], object], deadline: float = 10.0) -> None:
    """Poll `condition()` (generous deadline: a loaded machine is slow, never wrong)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while not condition():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.005)


async def settled(p: Pipelines) -> None:
    """No refresh due and no task running."""
    await until(lambda: p.timers.due is None and not p.scheduler._tasks)


@pytest.mark.asyncio
async def test_requests_within_the_window_give_one_refresh() -> None:
    p = Pipelines()
    for _ in range(5):
        p.scheduler.request(KEY, p.timers)
    assert p.timers.due is not None
    await until(lambda: p.refreshed)
    await settled(p)
    assert p.refreshed == [KEY]
    p.scheduler.request(KEY, p.timers)  # a later event: a refresh of its own
    await until(lambda: len(p.refreshed) == 2)
    await settled(p)
    assert p.refreshed == [KEY, KEY]


@pytest.mark.asyncio
async def test_a_failed_refresh_is_tried_again_with_growing_backoff_until_it_succeeds() -> None:
    p = Pipelines()
    p.failing = 3
    p.scheduler.spawn_refresh(KEY)
    await until(lambda: len(p.refreshed) == 4)
    await settled(p)
    assert p.backoffs == [1, 2, 3]  # failures in a row, each asked of the backoff
    assert p.timers.failures == 0  # the success resets them
    assert p.refreshed == [KEY] * 4


@pytest.mark.asyncio
async def test_a_forgotten_pipeline_is_not_tried_again() -> None:
    p = Pipelines()
    p.failing = 1
    del p.tracked[KEY]
    p.scheduler.spawn_refresh(KEY)
    await until(lambda: p.refreshed and not p.scheduler._tasks)
    assert p.backoffs == []
    assert p.refreshed == [KEY]


@pytest.mark.asyncio
async def test_a_recheck_replaces_the_one_before_and_none_cancels_it() -> None:
    p = Pipelines()
    p.scheduler.recheck(KEY, p.timers, 3600.0)
    first = p.timers.recheck
    assert first is not None
    p.scheduler.recheck(KEY, p.timers, 3600.0)
    assert first.cancelled() and p.timers.recheck is not first
    p.scheduler.recheck(KEY, p.timers, None)
    assert p.timers.recheck is None
    p.scheduler.recheck(KEY, p.timers, 0.0)  # due now: a refresh
    await until(lambda: p.refreshed == [KEY])


@pytest.mark.asyncio
async def test_a_failed_rollout_step_is_logged_and_the_tasks_end_on_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = Pipelines()
    p.scheduler.spawn_reconcile(KEY)
    await until(lambda: not p.scheduler._tasks)
    assert p.reconciled == [KEY]
    assert "rollout step of ns/p failed" in caplog.text

    started = asyncio.Event()

    async def hangs(key: Key) -> None:
        started.set()
        await asyncio.sleep(3600)

    p.scheduler.refresh = hangs
    p.scheduler.spawn_refresh(KEY)
    await asyncio.wait_for(started.wait(), 10)
    await p.scheduler.close()
    assert not p.scheduler._tasks


def test_cancelling_the_timers_cancels_every_one() -> None:
    loop = asyncio.new_event_loop()
    try:
        timers = refresh.Timers(
            due=loop.call_later(3600, lambda: None),
            recheck=loop.call_later(3600, lambda: None),
            step=loop.call_later(3600, lambda: None),
        )
        timers.cancel()
        assert timers.due is not None and timers.due.cancelled()
        assert timers.recheck is not None and timers.recheck.cancelled()
        assert timers.step is not None and timers.step.cancelled()
        refresh.Timers().cancel()  # none scheduled: nothing to do
    finally:
        loop.close()


@pytest.mark.asyncio
async def test_the_step_recheck_is_a_timer_of_its_own_beside_the_progress_recheck() -> None:
    p = Pipelines()
    p.scheduler.recheck(KEY, p.timers, 3600.0)
    progress = p.timers.recheck
    p.scheduler.recheck_step(KEY, p.timers, 3600.0)
    first = p.timers.step
    assert first is not None and progress is not None and not progress.cancelled()
    p.scheduler.recheck_step(KEY, p.timers, None)
    assert first.cancelled() and p.timers.step is None
    assert p.timers.recheck is progress and not progress.cancelled()
    p.scheduler.recheck_step(KEY, p.timers, 0.0)  # due now: a refresh
    await until(lambda: p.refreshed == [KEY])
    p.timers.cancel()
