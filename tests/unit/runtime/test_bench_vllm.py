"""`disagg bench vllm`'s pure parts: percentiles, TTFT/ITL from chunk arrival times, the
hand-off histograms from Prometheus text, the table, the answer check, and the baseline
proxy's request rewriting (vLLM's toy_proxy_server protocol). No engine."""

from __future__ import annotations

import math

import pytest

from disagg_runtime.bench.vllm import load, proxy
from disagg_runtime.bench.vllm.stats import (
    Histogram,
    Timing,
    histograms,
    level_summary,
    mismatches,
    percentile,
    table,
    with_ratios,
)


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


def test_ttft_and_itls_come_from_the_arrivals() -> None:
    t = Timing(prompt=0, sent=10.0, arrivals=[10.5, 10.6, 10.8, 11.1])
    assert t.ttft == pytest.approx(0.5)
    assert t.itls == pytest.approx([0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="streamed no token"):
        _ = Timing(prompt=3, sent=1.0).ttft


def test_a_level_pools_itls_over_requests_and_counts_usage_tokens() -> None:
    a = Timing(prompt=0, sent=0.0, arrivals=[0.1, 0.2, 0.3], tokens=3)
    b = Timing(prompt=1, sent=0.0, arrivals=[0.3, 0.7], tokens=0)  # no usage: its chunks
    row = level_summary([a, b], concurrency=2, wall_s=1.0)
    assert row["requests"] == 2 and row["tokens"] == 5 and row["chunks"] == 5
    assert row["tokens_per_s"] == 5.0
    assert row["ttft_p50_ms"] == pytest.approx(200.0)  # of 100 and 300 ms
    assert row["itl_p50_ms"] == pytest.approx(100.0)  # of 100, 100, 400 ms
    assert row["itl_p99_ms"] == pytest.approx(394.0)
    one_token = level_summary([Timing(prompt=0, sent=0.0, arrivals=[0.1])], 1, 0.1)
    assert one_token["itl_p50_ms"] is None


PAGE = """\
# HELP vllm:disagg_kv_send_seconds Per request
# TYPE vllm:disagg_kv_send_seconds histogram
vllm:disagg_kv_send_seconds_bucket{engine="0",le="0.001",model_name="m"} 1.0
vllm:disagg_kv_send_seconds_bucket{engine="0",le="0.01",model_name="m"} 3.0
vllm:disagg_kv_send_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
vllm:disagg_kv_send_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:disagg_kv_send_seconds_count{engine="0",model_name="m"} 4.0
vllm:disagg_kv_send_seconds_sum{engine="0",model_name="m"} 0.05
vllm:disagg_kv_send_seconds_bucket{engine="1",le="0.001",model_name="m"} 0.0
vllm:disagg_kv_send_seconds_bucket{engine="1",le="0.01",model_name="m"} 0.0
vllm:disagg_kv_send_seconds_bucket{engine="1",le="0.1",model_name="m"} 0.0
vllm:disagg_kv_send_seconds_bucket{engine="1",le="+Inf",model_name="m"} 0.0
vllm:disagg_kv_send_seconds_count{engine="1",model_name="m"} 0.0
vllm:disagg_kv_send_seconds_sum{engine="1",model_name="m"} 0.0
vllm:disagg_kv_send_seconds_created{engine="0",model_name="m"} 1.7e9
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def test_histograms_sum_label_sets_and_ignore_other_metrics() -> None:
    got = histograms(PAGE, ["vllm:disagg_kv_send_seconds", "vllm:nixl_xfer_time_seconds"])
    h = got["vllm:disagg_kv_send_seconds"]
    assert h.count == 4 and h.total == pytest.approx(0.05)
    assert h.buckets == ((0.001, 1.0), (0.01, 3.0), (0.1, 4.0), (math.inf, 4.0))
    assert got["vllm:nixl_xfer_time_seconds"].count == 0  # absent: empty


def test_quantiles_interpolate_inside_buckets_as_prometheus_does() -> None:
    h = histograms(PAGE, ["vllm:disagg_kv_send_seconds"])["vllm:disagg_kv_send_seconds"]
    assert h.quantile(0.25) == pytest.approx(0.001)  # rank 1: the first bucket's top
    assert h.quantile(0.5) == pytest.approx(0.001 + 0.009 * 0.5)  # rank 2 of (1, 3]
    assert h.quantile(0.99) == pytest.approx(0.01 + 0.09 * 0.96)
    report = h.report()
    assert report["count"] == 4 and report["mean"] == pytest.approx(12.5)
    assert report["p50_est"] == pytest.approx(5.5)
    beyond = Histogram(((1.0, 0.0), (math.inf, 2.0)), 2.0, 10.0)
    assert beyond.quantile(0.5) == 1.0  # in +Inf: the last finite bound
    assert Histogram((), 0.0, 0.0).quantile(0.5) is None


def test_a_level_is_the_difference_of_two_scrapes() -> None:
    before = Histogram(((0.01, 2.0), (math.inf, 2.0)), 2.0, 0.01)
    after = Histogram(((0.01, 3.0), (math.inf, 5.0)), 5.0, 1.01)
    level = after.minus(before)
    assert level.count == 3 and level.total == pytest.approx(1.0)
    assert level.buckets == ((0.01, 1.0), (math.inf, 3.0))


def test_mismatches_name_the_prompt_and_both_answers() -> None:
    prompts = ["hello", "world"]
    ok = Timing(prompt=0, sent=0.0, text="a b")
    bad = Timing(prompt=1, sent=0.0, text="x")
    found = mismatches({0: "a b", 1: "y"}, [ok, bad], prompts)
    assert len(found) == 1 and "prompt 1" in found[0] and "'x'" in found[0] and "'y'" in found[0]


def test_the_table_has_a_row_per_level_and_ratios_to_the_baseline() -> None:
    rows = with_ratios(
        [
            {"setup": "single", "concurrency": 1, "requests": 4, "tokens_per_s": 200.0},
            {"setup": "disagg", "concurrency": 1, "requests": 4, "tokens_per_s": 150.0},
            {"setup": "disagg", "concurrency": 8, "requests": 8, "tokens_per_s": 900.0},
        ],
        "single",
    )
    assert [r["vs_single"] for r in rows] == [1.0, 0.75, None]
    text = table(rows).splitlines()
    assert len(text) == 2 + 3
    assert text[0].split()[:2] == ["setup", "conc"]
    assert text[3].split()[:3] == ["disagg", "1", "4"] and "0.75" in text[3]
    assert text[4].split()[-1] == "-"  # no hand-off measured


def test_the_proxy_asks_prefill_for_one_token_and_its_kv() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 32,
        "max_completion_tokens": 32,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pre = proxy.prefill_request(body)
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert pre["stream"] is False and "stream_options" not in pre
    assert pre["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert body["max_tokens"] == 32 and "kv_transfer_params" not in body  # not changed


def test_the_proxy_sends_decode_the_original_request_with_prefills_params() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 32, "stream": True}
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2]}
    dec = proxy.decode_request(body, {"choices": [], "kv_transfer_params": params})
    assert dec == {**body, "kv_transfer_params": params}
    assert proxy.decode_request(body, {"choices": []}) == body  # no params: as asked
    assert "kv_transfer_params" not in body


def test_stream_events_become_arrivals_text_and_tokens() -> None:
    t = Timing(prompt=0, sent=0.0)
    load.record_event(t, '{"choices": [{"text": "a"}]}', 1.0)
    load.record_event(t, '{"choices": [{"text": ""}]}', 2.0)  # a token with no text yet
    load.record_event(t, '{"choices": [], "usage": {"completion_tokens": 2}}', 3.0)
    load.record_event(t, "[DONE]", 4.0)
    assert t.arrivals == [1.0, 2.0] and t.text == "a" and t.tokens == 2
    with pytest.raises(RuntimeError, match="stream error"):
        load.record_event(t, '{"error": {"message": "boom"}}', 5.0)


def test_the_levels_and_counts_are_comma_lists_of_positive_integers() -> None:
    import argparse

    from disagg_runtime.bench.vllm import flags

    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args(["--concurrency", "1,4", "--requests", "2,8"])
    assert args.concurrency == [1, 4] and args.requests == [2, 8]
    defaults = parser.parse_args([])
    assert defaults.concurrency == [1, 8, 32] and len(defaults.requests) == 3
    for bad in ("0,8", "1,x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="integers"):
            flags._ints(bad)


def test_the_report_fails_on_a_differing_answer_or_a_failed_setup() -> None:
    import argparse

    from disagg_runtime.bench.vllm import run

    args = argparse.Namespace(max_tokens=4)
    row = {"concurrency": 1, "requests": 1, "tokens_per_s": 10.0}
    same = {
        "single": {
            "answers": {0: "a"},
            "levels": [{"setup": "single", **row}],
            "timings": [Timing(prompt=0, sent=0.0, text="a")],
            "failed": "",
        },
        "disagg": {
            "answers": {},
            "levels": [{"setup": "disagg", **row}],
            "timings": [Timing(prompt=0, sent=0.0, text="a")],
            "failed": "",
        },
    }
    good = run.report(same, "m", args)
    assert good["outputs_equal"] and not good["failed"] and good["rows"][1]["vs_single"] == 1.0
    same["disagg"]["timings"] = [Timing(prompt=0, sent=0.0, text="b")]
    same["disagg"]["failed"] = "c=8: RuntimeError: boom"
    bad = run.report(same, "m", args)
    assert not bad["outputs_equal"] and len(bad["mismatches"]["disagg"]) == 1
    assert bad["failed"] == {"disagg": "c=8: RuntimeError: boom"}
    assert not run.report({"disagg": same["disagg"]}, "m", args)["outputs_equal"]  # no baseline
