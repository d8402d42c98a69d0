"""The vLLM connector's pure parts: layouts, kv_transfer_params, the scheduler's orders."""

from __future__ import annotations

import pathlib
import re

import pytest

from disagg_runtime.engines.vllm import params as kvp
from disagg_runtime.engines.vllm import stats
from disagg_runtime.engines.vllm.layout import (
    KvLayout,
    LayoutError,
    blocks_for,
    mismatch,
    pair_runs,
    runs,
)
from disagg_runtime.engines.vllm.peers import DecodePeers
from disagg_runtime.engines.vllm.scheduling import SchedulerSide

LAYOUT = KvLayout(
    "float32", 32, (2, 32, 128), ("model.layers.0.attn", "model.layers.1.attn"), "cpu:auto"
)
DECODE = "tcp://127.0.0.1:7600"
PEERS = DecodePeers(frozenset({DECODE}), open_=False)


def test_runs_group_consecutive_ids_in_order() -> None:
    assert runs([]) == []
    assert runs([5]) == [(5, 1)]
    assert runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]


@pytest.mark.parametrize(("tokens", "blocks"), [(1, 1), (31, 1), (32, 1), (33, 2), (65, 3)])
def test_blocks_for_counts_the_partly_filled_last_block(tokens: int, blocks: int) -> None:
    assert blocks_for(tokens, 32) == blocks


def test_layout_round_trips_and_knows_its_block_bytes() -> None:
    assert KvLayout.from_json(LAYOUT.to_json()) == LAYOUT
    assert LAYOUT.block_bytes == 2 * 32 * 128 * 4


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("dtype", "int64", "layout.dtype"),
        ("block_size", 0, "layout.block_size"),
        ("block_size", True, "layout.block_size"),
        ("block_shape", [2, -1], "layout.block_shape[1]"),
        ("block_shape", "2x32", "layout.block_shape"),
        ("layers", [], "layout.layers"),
        ("backend", 7, "layout.backend"),
    ],
)
def test_malformed_layouts_are_refused_naming_the_field(
    field: str, value: object, named: str
) -> None:
    doc = LAYOUT.to_json() | {field: value}
    with pytest.raises(LayoutError, match="^" + re.escape(named)):
        KvLayout.from_json(doc)


def test_mismatch_names_what_differs() -> None:
    assert mismatch(LAYOUT, LAYOUT) is None
    other = KvLayout("bfloat16", 32, LAYOUT.block_shape, LAYOUT.layers, LAYOUT.backend)
    assert "dtype" in (mismatch(LAYOUT, other) or "")
    bigger = KvLayout("float32", 16, (2, 16, 128), LAYOUT.layers, LAYOUT.backend)
    assert "block_size" in (mismatch(LAYOUT, bigger) or "")
    fewer = KvLayout("float32", 32, LAYOUT.block_shape, LAYOUT.layers[:1], LAYOUT.backend)
    assert "layers" in (mismatch(LAYOUT, fewer) or "")


def test_send_and_load_params_parse_and_refuse_naming_the_field() -> None:
    assert kvp.send_to(None) is None and kvp.send_to({"do_remote_decode": False}) is None
    order = kvp.send_to({"do_remote_decode": True, "transfer": "t-1", "decode": DECODE})
    assert order == kvp.SendTo("t-1", DECODE, "tcp")
    back = kvp.decode_params(order, 70, "eng")
    assert kvp.load_from(back) == kvp.LoadFrom("t-1", 70, "eng")
    bad = [
        ({"do_remote_decode": True, "transfer": "t", "decode": "http://x:1"}, "decode"),
        ({"do_remote_decode": True, "transfer": "t", "decode": DECODE, "relay": "nixl"}, "relay"),
        ({"do_remote_decode": True, "transfer": "a b", "decode": DECODE}, "transfer"),
        ({"do_remote_prefill": True, "transfer": "t", "tokens": 0}, "tokens"),
        ({"do_remote_prefill": True, "transfer": "t", "tokens": "9"}, "tokens"),
    ]
    for doc, field in bad:
        parse = kvp.send_to if "do_remote_decode" in doc else kvp.load_from
        with pytest.raises(kvp.ParamsError, match=f"kv_transfer_params.{field}"):
            parse(doc)


def test_prefill_delays_the_free_until_the_send_is_reported() -> None:
    side = SchedulerSide("eng-p", 32, PEERS)
    params = {"do_remote_decode": True, "transfer": "t-1", "decode": DECODE, "relay": "shm"}
    delay, out = side.finished("r1", params, 70, [4, 5, 6, 7], aborted=False)
    assert delay is True
    assert out == {"do_remote_prefill": True, "transfer": "t-1", "tokens": 70, "engine": "eng-p"}
    assert side.pending_push
    orders = side.take()
    assert [(s.req_id, s.block_ids, s.tokens) for s in orders.sends] == [("r1", (4, 5, 6), 70)]
    assert side.take().sends == []  # each order once
    side.sent({"r1"})
    assert not side.pending_push


def test_prefill_frees_at_once_when_aborted_or_not_a_pd_request() -> None:
    side = SchedulerSide("eng-p", 32, PEERS)
    params = {"do_remote_decode": True, "transfer": "t-1", "decode": DECODE}
    assert side.finished("r1", params, 70, [1, 2, 3], aborted=True) == (False, None)
    assert side.finished("r2", None, 70, [1, 2, 3], aborted=False) == (False, None)
    delay, out = side.finished("r3", params | {"decode": "nowhere"}, 70, [1, 2, 3], False)
    assert delay is False and out is not None
    assert out["do_remote_prefill"] is False and "kv_transfer_params.decode" in out["error"]
    delay, out = side.finished("r4", params, 70, [1, 2], False)  # fewer blocks than the prompt
    assert delay is False and out is not None and "only 2 blocks" in out["error"]
    assert side.take().sends == [] and not side.pending_push


def test_prefill_sends_only_to_the_decode_engines_it_was_given() -> None:
    side = SchedulerSide("eng-p", 32, PEERS)
    params = {"do_remote_decode": True, "transfer": "t-1", "decode": "tcp://10.0.0.9:7600"}
    delay, out = side.finished("r1", params, 70, [1, 2, 3], aborted=False)
    assert delay is False and out is not None
    assert out["error"].startswith("kv_transfer_params.decode tcp://10.0.0.9:7600 is not one")
    assert side.finished("r2", params | {"decode": DECODE}, 70, [1, 2, 3], False)[0] is True
    assert [s.order.decode for s in side.take().sends] == [DECODE]


def test_a_prefill_engine_without_configured_decodes_sends_nowhere() -> None:
    """The safe default: no `decodes` means no connection to any endpoint a request names."""
    side = SchedulerSide("eng-p", 32, DecodePeers.from_config({}))
    params = {"do_remote_decode": True, "transfer": "t-1", "decode": DECODE}
    delay, out = side.finished("r1", params, 70, [1, 2, 3], aborted=False)
    assert delay is False and out is not None
    assert "no decode engines configured" in out["error"] and "decodes" in out["error"]
    assert side.take().sends == [] and not side.pending_push
    anyone = SchedulerSide("eng-p", 32, DecodePeers.from_config({"decodes": "any"}))
    assert anyone.finished("r1", params | {"decode": "tcp://10.9.9.9:1"}, 70, [1, 2, 3], False)[0]


def test_decodes_config_is_checked_naming_the_key() -> None:
    with pytest.raises(kvp.ParamsError, match=r"^kv_connector_extra_config.decodes\[1\]"):
        DecodePeers.from_config({"decodes": [DECODE, "http://x:1"]})
    with pytest.raises(kvp.ParamsError, match=r"^kv_connector_extra_config\.decodes:"):
        DecodePeers.from_config({"decodes": "some"})
    with pytest.raises(kvp.ParamsError, match=r"^kv_connector_extra_config\.decodes_file"):
        DecodePeers.from_config({"decodes_file": 7})


def test_malformed_prefill_params_are_a_request_error() -> None:
    side = SchedulerSide("eng-p", 32, PEERS)
    bad = {"do_remote_decode": True, "transfer": "a b", "decode": DECODE}
    delay, out = side.finished("r1", bad, 70, [1, 2, 3], aborted=False)
    assert delay is False and out == {
        "do_remote_prefill": False,
        "error": "kv_transfer_params.transfer: expected 1-128 characters of [A-Za-z0-9._:-], "
        "got 'a b'",
    }


def test_a_peers_file_is_read_and_re_read_when_it_changes(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "decodes"
    other = "tcp://10.0.0.2:7600"
    path.write_text(f"# decode replicas\n{DECODE}\n\n")
    peers = DecodePeers.from_config({"decodes_file": str(path), "decodes": [other]})
    assert peers.check(DECODE).ok and peers.check(other).ok  # the union of both
    assert not peers.check("tcp://10.0.0.3:7600").ok
    path.write_text("tcp://10.0.0.3:7600  # a new replica\n")
    assert peers.check("tcp://10.0.0.3:7600").ok and not peers.check(DECODE).ok
    path.write_text("tcp://bad\n")
    assert not peers.check(other + "0").ok
    assert peers.check(other).ok  # the fixed list still holds
    path.unlink()
    alone = DecodePeers.from_config({"decodes_file": str(path)})
    why = alone.check(DECODE).reason or ""
    assert "decodes_file" in why and "No such file" in why


def test_decode_loads_the_prompt_past_its_cached_prefix() -> None:
    side = SchedulerSide("eng-d", 32)
    params = {"do_remote_prefill": True, "transfer": "t-1", "tokens": 70, "engine": "eng-p"}
    assert side.matched("r1", params, 70, 32) == (38, True)  # one block cached here
    side.allocated("r1", params, [9, 10, 11, 12], 38)
    (load,) = side.take().loads
    assert (load.block_ids, load.skip, load.order.transfer) == ((10, 11), 1, "t-1")
    assert params["do_remote_prefill"] is False  # not loaded again when rescheduled
    assert side.matched("r1", params, 70, 0) == (0, False)


def test_decode_refuses_a_transfer_for_another_prompt_length() -> None:
    side = SchedulerSide("eng-d", 32)
    params = {"do_remote_prefill": True, "transfer": "t-1", "tokens": 69}
    assert side.matched("r1", params, 70, 0) == (0, False)
    assert side.matched(
        "r2", {"do_remote_prefill": True, "transfer": "t", "tokens": -1}, 70, 0
    ) == (
        0,
        False,
    )


def test_pair_runs_fills_destination_runs_from_sent_runs_past_the_skip() -> None:
    # sent as runs of 2 and 3 blocks; the first block is cached at the destination
    plan = pair_runs([2, 3], 1, [(10, 3), (20, 1)])
    assert plan == [(0, 1, 10, 1), (1, 0, 11, 2), (1, 2, 20, 1)]
    assert pair_runs([4], 0, [(0, 4)]) == [(0, 0, 0, 4)]
    assert pair_runs([1, 1], 2, []) == []
    with pytest.raises(LayoutError, match="fewer blocks"):
        pair_runs([2], 0, [(0, 3)])


def test_the_tiny_vllm_model_has_head_dim_64(tmp_path: pathlib.Path) -> None:
    """vLLM's CPU attention kernels refuse the tiny llm's head_dim 16."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    from disagg_runtime.models import tiny

    config = AutoConfig.from_pretrained(tiny.vllm_llm(tmp_path / "m"))
    assert config.hidden_size // config.num_attention_heads == 64
    assert (config.num_hidden_layers, config.num_key_value_heads) == (2, 2)


def test_transfer_stats_record_take_merge_and_summarize() -> None:
    rec = stats.Recorder()
    assert rec.take() is None
    rec.send(0.002, 3 * 65536, 3, ok=True)
    rec.send(0.004, 65536, 1, ok=True)
    rec.send(0.0, 0, 2, ok=False)
    data = rec.take()
    assert data is not None and rec.take() is None  # taken once
    assert data["send_bytes"] == [3 * 65536, 65536] and data["send_failed"] == [1]
    other = stats.Recorder()
    other.load(0.01, 65536, 1, ok=True)
    merged = stats.merge(data, other.take() or {})
    s = stats.summary(merged)
    assert s["sends"] == 2 and s["send failed"] == 1 and s["send blocks"] == 4
    assert s["send avg ms"] == 3.0 and s["send MiB"] == 0.25
    assert s["loads"] == 1 and s["load p90 ms"] == 10.0
    assert stats.is_empty(stats.empty()) and not stats.is_empty(merged)


def test_decode_orders_the_worker_to_forget_a_load_whose_request_went() -> None:
    side = SchedulerSide("eng-d", 32)
    params = {"do_remote_prefill": True, "transfer": "t-1", "tokens": 70, "engine": "eng-p"}
    assert side.matched("r1", params, 70, 0) == (70, True)
    side.allocated("r1", params, [1, 2, 3], 70)
    side.gone("r1")  # aborted while its KV was on the way
    orders = side.take()
    assert [ld.req_id for ld in orders.loads] == ["r1"] and orders.aborts == ["r1"]
    side.gone("r1")
    assert side.take().aborts == []  # once
    params2 = dict(params, transfer="t-2")
    side.matched("r2", params2, 70, 0)
    side.allocated("r2", params2, [4, 5, 6], 70)
    side.loaded({"r2"})
    side.gone("r2")  # finished normally after its load: nothing to forget
    assert side.take().aborts == []
