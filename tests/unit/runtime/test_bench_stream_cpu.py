"""bench/stream_cpu.py's per-message figures and its ratios to the references (pure)."""

from __future__ import annotations

import pytest

from disagg_runtime.bench import stream_cpu


def test_row_derives_cpu_per_message_and_messages_per_core():
    r = stream_cpu.row("shm", 4096, 10_000, 0.12, 0.08, 0.5)
    assert r.cpu_us_per_message == pytest.approx(20.0)
    assert r.messages_per_core_s == pytest.approx(50_000)
    idle = stream_cpu.row("shm", 4096, 10, 0.0, 0.0, 0.1)  # a clock too coarse: no division
    assert idle.messages_per_core_s == 0.0


def test_relate_gives_each_relay_its_cpu_over_each_reference_of_its_size():
    rows = stream_cpu.relate(
        [
            stream_cpu.row("raw_unix", 4096, 100, 0.0005, 0.0005, 1),  # 10 us
            stream_cpu.row("py_unix", 4096, 100, 0.001, 0.001, 1),  # 20 us
            stream_cpu.row("shm", 4096, 100, 0.002, 0.002, 1),  # 40 us
            stream_cpu.row("tcp", 1024, 100, 0.002, 0.002, 1),  # no reference at 1 KiB
        ]
    )
    raw, py, shm, tcp = rows
    assert raw.over == {} and py.over == {}
    assert shm.over == pytest.approx({"raw_unix": 4.0, "py_unix": 2.0})
    assert tcp.over == {}


def test_measure_refuses_an_unknown_method():
    with pytest.raises(ValueError, match="unknown method 'memcpy'"):
        stream_cpu.measure("memcpy", 4096, 10)
