"""`disagg up --autoscale` on the shipped examples, real processes: the backlog signals of
issue 16 scale the slow role up under load and back down after it, at payload sizes where
pool occupancy alone would never move (DISAGG_DEMO_SCALE=0.1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.support import EXAMPLES


def disagg() -> list[str]:
    return [sys.executable, "-m", "disagg_runtime.cli"]


def run_up(example: str, *args: str, scale: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, DISAGG_DEMO_SCALE=scale)
    proc = subprocess.run(
        [*disagg(), "up", str(EXAMPLES / example), "--autoscale", "--json", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads(proc.stdout)
    return summary


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scale", ["1", "0.1"])
def test_slow_denoiser_scales_up_under_load_and_down_after_it(scale: str) -> None:
    s = run_up(
        "slow-denoiser.yaml",
        *("--duration", "15", "--concurrency", "8", "--cooldown", "20"),
        scale=scale,
        timeout=280,
    )
    line = (
        f"slow-denoiser scale {scale}: {s['completed']}/{s['requests']} ok, p50 {s['p50_ms']} ms, "
        f"denoiser {s['roles']['denoiser']} events "
        f"{[(e['from'], e['to'], e['signal']) for e in s['scale_events']]}"
    )
    print(line)
    assert s["failed"] == 0 and s["completed"] == s["requests"] > 0, line
    denoiser = s["roles"]["denoiser"]
    assert denoiser["replicas_initial"] == 1
    assert denoiser["replicas_max"] >= 3, line
    events = [e for e in s["scale_events"] if e["role"] == "denoiser"]
    assert all(e["signal"] in ("occupancy", "queue", "ratio-lock") for e in events)
    ups = [e for e in events if e["to"] > e["from"]]
    downs = [e for e in events if e["to"] < e["from"]]
    assert ups and downs, line
    assert max(e["time_s"] for e in downs) > max(e["time_s"] for e in ups)
    if scale == "0.1":  # small payloads: the pool stays nearly empty, the queue drives
        assert ups[0]["signal"] == "queue", line


@pytest.mark.timeout(300)
def test_llm_example_scales_decode_at_concurrency_64() -> None:
    """Decode scales up under the load, and the replicas it adds take requests. They once
    seemed not to (by_replica {0: 490, 1: 447, 2: 0, 3: 0}): the scale-up came late in a
    12 s run and its replicas were ready after the load had ended (a new replica is
    published once its /readyz answers, `done_s`), so the load now lasts 25 s and a new
    replica ready 3 s before its end must have served (one ready later is not checked: on a
    slow machine all may be)."""
    duration = 25.0
    s = run_up(
        "llm-prefill-decode.yaml",
        *("--duration", str(duration), "--concurrency", "64"),
        scale="0.1",
        timeout=280,
    )
    decode = s["roles"]["decode"]
    ups = [e for e in s["scale_events"] if e["role"] == "decode" and e["to"] > e["from"]]
    events = [(e["from"], e["to"], e["signal"], e["time_s"], e["done_s"]) for e in ups]
    line = f"llm decode {decode}, scale-ups (from, to, signal, at s, ready s) {events}"
    print(line)
    assert s["failed"] == 0, line
    assert decode["replicas_max"] > decode["replicas_initial"], line
    # a scale-up ready 3 s before the load ended must have served. How soon new replicas
    # are ready depends on the machine (2 -> 6 took 25 s on a CI machine under this load),
    # so one that came later is not asked to: the check holds where it applies
    in_time = [e for e in ups if e["done_s"] < duration - 3.0]
    joined = {str(r) for e in in_time for r in range(e["from"], e["to"])}
    idle = sorted(r for r in joined if decode["by_replica"].get(r, 0) == 0)
    assert not idle, f"decode replicas {idle} joined under load and served nothing: {line}"
