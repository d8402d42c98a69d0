"""`disagg bench`: the commands run end to end and report what they promise (not speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from disagg_runtime import cli
from disagg_runtime.bench import ratios
from disagg_runtime.bench.sizes import format_size, parse_size
from disagg_runtime.bench.transport import METHODS, NIXL_METHODS
from disagg_runtime.relay import registry

DISAGG = [sys.executable, "-m", "disagg_runtime.cli"]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DISAGG, *args], capture_output=True, text=True, timeout=timeout, env=os.environ.copy()
    )


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The exit code and stderr of a command refused for its arguments: in this process
    (a CLI process costs seconds of imports, and a refusal starts nothing)."""
    capsys.readouterr()
    return cli.main(list(args)), capsys.readouterr().err


def test_transport_json_has_every_method_and_size():
    proc = run("bench", "transport", "--sizes", "4KiB,2MiB", "--repeats", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    nixl = registry.backend("nixl").unavailable() is None  # its rows where it works
    methods = [*METHODS, *(NIXL_METHODS if nixl else ())]
    assert {(r["method"], r["size_bytes"]) for r in rows} == {
        (m, s) for m in methods for s in (4096, 2 << 20)
    }
    by = {(r["method"], r["size_bytes"]): r for r in rows}
    for row in rows:
        size = row["size_bytes"]
        if row["method"] in ratios.DERIVED:  # the limit is its fastest part, at each size
            parts = [by[(m, size)] for m in ratios.DERIVED[row["method"]]]
            assert row["gbps"] == max(p["gbps"] for p in parts)
            assert by[(row["best_of"], size)]["gbps"] == row["gbps"]
        if row["method"] in ratios.RELAYS:  # disagg over every limit and peer of the run
            assert set(row["peers"]) == {r for r in ratios.REFERENCES if (r, size) in by}
            for ref, ratio in row["peers"].items():
                assert ratio == pytest.approx(row["gbps"] / by[(ref, size)]["gbps"])
        else:
            assert row["peers"] == {}
        assert row["gbps"] > 0
        assert row["ratio_to_memcpy"] > 0
        if row["method"] == "memcpy":
            assert row["ratio_to_memcpy"] == pytest.approx(1.0)
        # every row has its one-way percentiles and its ratios to each limit of the run
        assert 0 < row["p50_us"] <= row["p99_us"]
        assert row["gbps"] == pytest.approx(row["size_bytes"] / row["p50_us"] / 1e3, rel=1e-6)
        assert row["ratio_to_large"] > 0
        assert row["p50_over_raw"] > 0
        if row["method"] == "raw_unix":
            assert row["p50_over_raw"] == pytest.approx(1.0)
        assert row["p50_over_py"] > 0
        if row["method"] == "py_unix":
            assert row["p50_over_py"] == pytest.approx(1.0)
        if row["method"] in ("shm", "tcp"):
            assert row["pool_bytes"] >= row["size_bytes"]
            assert row["receiver_rss_delta_bytes"] is not None


def test_transport_table_and_bad_arguments(capsys: pytest.CaptureFixture[str]):
    proc = run("bench", "transport", "--sizes", "1MiB", "--repeats", "2", "--methods", "shm")
    assert proc.returncode == 0, proc.stderr
    assert "memcpy" in proc.stdout and "shm" in proc.stdout  # the limit always comes along
    code, err = refused(capsys, "bench", "transport", "--sizes", "lots")
    assert code == 2 and "bad size 'lots'" in err
    code, err = refused(capsys, "bench", "transport", "--methods", "carrier_pigeon")
    assert code == 2 and "unknown method" in err


def test_transport_cpu_mode_reports_cpu_per_message_beside_the_references(
    capsys: pytest.CaptureFixture[str],
):
    proc = run(
        "bench", "transport", "--cpu-messages", "300", "--sizes", "4KiB,1KiB", "--json",
        "--methods", "raw_unix,py_unix,shm,tcp",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["method"], r["size_bytes"]) for r in rows] == [
        (m, s) for s in (4096, 1024) for m in ("raw_unix", "py_unix", "shm", "tcp")
    ]
    by = {(r["method"], r["size_bytes"]): r for r in rows}
    for row in rows:
        assert row["messages"] == 300
        assert row["sender_cpu_s"] > 0 and row["receiver_cpu_s"] > 0 and row["wall_s"] > 0
        total = row["sender_cpu_s"] + row["receiver_cpu_s"]
        assert row["cpu_us_per_message"] == pytest.approx(total / 300 * 1e6)
        assert row["messages_per_core_s"] == pytest.approx(300 / total)
        if row["method"] in ("raw_unix", "py_unix"):
            assert row["over"] == {}
            continue
        assert set(row["over"]) == {"raw_unix", "py_unix"}
        for ref, ratio in row["over"].items():
            reference = by[(ref, row["size_bytes"])]["cpu_us_per_message"]
            assert ratio == pytest.approx(row["cpu_us_per_message"] / reference)
    table = run("bench", "transport", "--cpu-messages", "100", "--methods", "py_unix,shm")
    assert table.returncode == 0, table.stderr
    assert "us/msg" in table.stdout and "shm" in table.stdout and "4KiB" in table.stdout
    code, err = refused(capsys, "bench", "transport", "--cpu-messages", "10", "--methods", "memcpy")
    assert code == 2 and "unknown method(s) memcpy for --cpu-messages" in err
    code, err = refused(capsys, "bench", "transport", "--cpu-messages", "-3")
    assert code == 2 and "--cpu-messages must be at least 1" in err


def test_pipeline_bench_reports_per_hop_overhead():
    proc = run("bench", "pipeline", "--size", "1MiB", "--repeats", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["size_bytes"] == 1 << 20 and result["hops"] == 2
    assert result["per_hop_ms"] > 0 and result["bare_relay_ms"] > 0
    assert result["per_hop_over_bare"] == pytest.approx(
        result["per_hop_ms"] / result["bare_relay_ms"], rel=0.01
    )


def test_faults_bench_loses_no_request_across_a_kill_a_scale_down_and_a_rollout():
    """The issue's figure: requests lost per 1,000 in each phase, 0 with migration (every
    request here streams nothing, so each one a dying, draining or leaving replica held
    must have moved to a live one)."""
    proc = run("bench", "faults", "--phase-seconds", "2", "--json", timeout=300)
    result = json.loads(proc.stdout)
    phases = {p["phase"]: p for p in result["phases"]}
    assert list(phases) == ["steady", "kill", "scale-down", "rollout"]
    assert all(p["requests"] > 20 for p in phases.values()), phases
    assert [p["lost_per_1000"] for p in phases.values()] == [0.0] * 4, (phases, proc.stderr)
    assert result["restarts"] == {"middle/1": 1}
    assert proc.returncode == 0, proc.stderr


def test_pipeline_trace_bench_puts_traced_beside_untraced():
    pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (OpenTelemetry)")
    args = ("--requests", "30", "--rounds", "2", "--concurrency", "2", "--json")
    proc = run("bench", "pipeline", "--trace", *args)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["size_bytes"] == 64 << 10 and result["roles"] == 3  # --trace's default size
    assert len(result["rounds_rps"]["off"]) == 2
    for mode in ("off", "unsampled", "default", "all"):
        assert result[f"{mode}_rps"] > 0
    # every request of the `all` rounds and the warm-up was traced in full, and exported
    assert result["spans_received"] >= result["spans_all_mode"] == (2 * 30 + 20) * 13


def test_gateway_bench_puts_the_gateway_beside_the_client():
    """One run: 4 KiB round trips both ways, a safetensors upload against memcpy and raw TCP
    (through real `disagg gateway` processes configured by their environment: one on the
    shm relay, also serving a Unix socket, and one on the tcp relay)."""
    proc = run("bench", "pipeline", "--gateway", "--size", "2MiB", "--repeats", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (result["small_bytes"], result["large_bytes"]) == (4096, 2 << 20)
    for key in (
        "client_p50_ms",
        "gateway_p50_ms",
        "memcpy_ms",
        "gateway_large_ms",
        "raw_tcp_ms",
        "client_tcp_large_ms",
        "gateway_tcp_large_ms",
        "gateway_unix_large_ms",
        "raw_unix_ms",
    ):
        assert result[key] > 0, key
    added = result["gateway_p50_ms"] - result["client_p50_ms"]
    assert result["gateway_added_p50_ms"] == pytest.approx(added, abs=0.002)
    assert result["gateway_large_vs_memcpy"] == pytest.approx(
        result["memcpy_ms"] / result["gateway_large_ms"],
        rel=0.01,
        abs=0.001,  # rounded to 3
    )


@pytest.mark.parametrize(
    ("text", "size"),
    [("4KiB", 4096), ("64MiB", 64 << 20), ("64Mi", 64 << 20), ("1GiB", 1 << 30), ("10", 10)],
)
def test_sizes_parse_and_format(text, size):
    assert parse_size(text) == size
    assert parse_size(format_size(size)) == size
