"""The engine replica chooser (gateway/capacity.py): free capacity from vLLM's metrics."""

from __future__ import annotations

import pytest

from disagg_runtime.gateway import capacity as c

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 100.0
"""


def test_parse_load() -> None:
    load = c.parse_load(METRICS, at=5.0)
    assert load == c.Load(waiting=2.0, running=3.0, kv_usage=0.25, at=5.0)


def test_parse_load_refuses_other_texts() -> None:
    with pytest.raises(ValueError, match="no vllm:num_requests_waiting"):
        c.parse_load("# TYPE x gauge\nx 1\n", at=0)
    with pytest.raises(ValueError):
        c.parse_load("vllm:num_requests_running{ 1\n", at=0)


def test_the_freest_replica_wins() -> None:
    loads = {
        "a": c.Load(waiting=0, running=4, kv_usage=0.1, at=10),
        "b": c.Load(waiting=0, running=1, kv_usage=0.1, at=10),
    }
    assert c.choose(["a", "b"], loads, {}, now=10.5) == "b"
    # waiting requests weigh more than running ones
    loads["b"] = c.Load(waiting=2, running=1, kv_usage=0.1, at=10)
    assert c.choose(["a", "b"], loads, {}, now=10.5) == "a"


def test_our_own_inflight_count_is_fresher_than_a_scrape() -> None:
    loads = {"a": c.Load(0, 0, 0, at=10), "b": c.Load(0, 1, 0, at=10)}
    assert c.choose(["a", "b"], loads, {"a": 3}, now=10.1) == "b"


def test_a_stale_scrape_is_not_trusted() -> None:
    loads = {"a": c.Load(waiting=9, running=9, kv_usage=0.9, at=0)}
    assert c.score(loads["a"], 1, now=10.0, stale_s=2.0) == 1.0
    assert c.choose(["a", "b"], loads, {"b": 2}, now=10.0, stale_s=2.0) == "a"


def test_a_full_kv_cache_is_avoided() -> None:
    loads = {"a": c.Load(0, 0, kv_usage=0.97, at=0), "b": c.Load(0, 8, kv_usage=0.5, at=0)}
    assert c.choose(["a", "b"], loads, {}, now=0.5) == "b"


def test_ties_go_round_robin() -> None:
    picks = [c.choose(["a", "b", "c"], {}, {}, now=0, turn=t) for t in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_no_replica() -> None:
    with pytest.raises(ValueError, match="no replica"):
        c.choose([], {}, {}, now=0)
