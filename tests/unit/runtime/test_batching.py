"""Batching: the pure cut policy, then the batcher thread with real threads and clocks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from disagg_runtime.role.batching import BatchCancelled, Batcher, BatchTimeout, Ticket, plan


def _t(arrived: float, deadline: float = 100.0, *, cancelled: bool = False) -> Ticket:
    return Ticket(None, arrived=arrived, deadline=deadline, cancelled=lambda: cancelled)


def test_waits_for_the_oldest_to_age_then_cuts() -> None:
    pending = [_t(0.0), _t(0.001)]
    waiting = plan(pending, now=0.002, max_size=8, max_wait=0.010)
    assert waiting.take == () and waiting.wait == pytest.approx(0.008)
    assert plan(pending, now=0.010, max_size=8, max_wait=0.010).take == (0, 1)


def test_cuts_at_once_when_full_and_keeps_arrival_order() -> None:
    pending = [_t(0.0 + i / 1000) for i in range(5)]
    assert plan(pending, now=0.0, max_size=3, max_wait=1.0).take == (0, 1, 2)


def test_drops_cancelled_and_expired_before_they_join() -> None:
    pending = [_t(0.0, cancelled=True), _t(0.0, deadline=0.5), _t(0.1), _t(0.2)]
    decision = plan(pending, now=1.0, max_size=8, max_wait=0.5)
    assert decision.cancelled == (0,) and decision.expired == (1,)
    assert decision.take == (2, 3)


def test_wakes_for_the_soonest_deadline() -> None:
    pending = [_t(0.0, deadline=0.003)]
    assert plan(pending, now=0.0, max_size=8, max_wait=1.0).wait == pytest.approx(0.003)


def test_nothing_pending_waits_for_arrivals() -> None:
    assert plan([], now=5.0, max_size=4, max_wait=0.1) == plan([], now=0, max_size=1, max_wait=0)
    assert plan([], now=5.0, max_size=4, max_wait=0.1).wait is None


def test_batch_of_one_never_waits() -> None:
    assert plan([_t(1.0)], now=1.0, max_size=1, max_wait=10.0).take == (0,)


def test_batches_gather_concurrent_requests_and_map_outputs_back() -> None:
    calls: list[list[int]] = []

    def double(items: list[int]) -> list[int]:
        calls.append(items)
        time.sleep(0.02)
        return [2 * i for i in items]

    batcher = Batcher(double, max_size=8, max_wait_s=0.05)
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: batcher.submit(i, timeout=10), range(32)))
    finally:
        batcher.close()
    assert results == [2 * i for i in range(32)]
    assert len(calls) < 32 and max(len(c) for c in calls) <= 8
    assert sorted(i for c in calls for i in c) == list(range(32))


def test_an_exception_output_fails_only_its_request() -> None:
    def check(items: list[int]) -> list[object]:
        return [ValueError(f"bad {i}") if i == 3 else i for i in items]

    batcher = Batcher(check, max_size=8, max_wait_s=0.05)
    try:
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(batcher.submit, i, timeout=10) for i in range(6)]
        with pytest.raises(ValueError, match="bad 3"):
            futures[3].result()
        assert [f.result() for i, f in enumerate(futures) if i != 3] == [0, 1, 2, 4, 5]
    finally:
        batcher.close()


def test_a_raising_batch_fails_its_requests_and_the_batcher_goes_on() -> None:
    def flaky(items: list[str]) -> list[str]:
        if "boom" in items:
            raise RuntimeError("model crashed")
        return items

    batcher = Batcher(flaky, max_size=4, max_wait_s=0.0)
    try:
        with pytest.raises(RuntimeError, match="model crashed"):
            batcher.submit("boom", timeout=5)
        assert batcher.submit("fine", timeout=5) == "fine"
        wrong = Batcher(lambda items: [], max_size=2, max_wait_s=0.0)
        with pytest.raises(ValueError, match="0 outputs for 1 inputs"):
            wrong.submit("x", timeout=5)
        wrong.close()
    finally:
        batcher.close()


def test_a_request_times_out_alone_while_its_batch_runs() -> None:
    release = threading.Event()

    def slow(items: list[float]) -> list[float]:
        release.wait(5)
        return items

    batcher = Batcher(slow, max_size=2, max_wait_s=0.0)
    try:
        with pytest.raises(BatchTimeout):
            batcher.submit(1.0, timeout=0.1)
        release.set()
        assert batcher.submit(2.0, timeout=5) == 2.0
    finally:
        batcher.close()


def test_an_aborted_request_never_reaches_the_handler() -> None:
    seen: list[str] = []
    gate = threading.Event()

    def record(items: list[str]) -> list[str]:
        seen.extend(items)
        gate.wait(5)
        return items

    batcher = Batcher(record, max_size=1, max_wait_s=0.0)
    aborted = threading.Event()
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(batcher.submit, "first", timeout=5)
            time.sleep(0.1)  # "first" runs and holds the batcher
            second = pool.submit(batcher.submit, "second", timeout=5, cancelled=aborted.is_set)
            time.sleep(0.05)
            aborted.set()
            gate.set()
            assert first.result() == "first"
            with pytest.raises(BatchCancelled):
                second.result()
        assert seen == ["first"]
    finally:
        batcher.close()


def test_close_fails_waiting_requests() -> None:
    batcher = Batcher(lambda items: items, max_size=8, max_wait_s=30.0)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(batcher.submit, "x", timeout=60)
        time.sleep(0.1)
        batcher.close()
        with pytest.raises(BatchCancelled):
            waiting.result(timeout=5)
    with pytest.raises(BatchCancelled):
        batcher.submit("late", timeout=1)
