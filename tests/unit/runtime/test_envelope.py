"""Envelopes are checked on arrival; tensor-reference paths come out and go back in."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from disagg_runtime.wire import envelope
from disagg_runtime.wire.envelope import EnvelopeError, Meta, Reply


def meta(**changes):
    base = Meta("r1", "data", "encoder", 1e12, Reply("tcp://127.0.0.1:1", "tcp"))
    return base.with_(**changes)


@pytest.mark.parametrize(
    "m",
    [
        meta(),
        meta(kind="chunk", seq=3),
        meta(kind="end", count=4),
        meta(kind="ref", path="a.b[0]"),
        meta(kind="error", error={"role": "x", "message": "boom"}),
        meta(kind="abort"),
    ],
)
def test_to_json_parse_round_trip(m):
    assert envelope.parse(json.loads(json.dumps(m.to_json()))) == m


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([], "expected an object"),
        (None, "expected an object"),
        ({}, "kind"),
        ({**meta().to_json(), "kind": "steal"}, "unknown 'steal'"),
        ({**meta().to_json(), "rid": 5}, "rid"),
        ({**meta().to_json(), "deadline": "soon"}, "deadline"),
        ({**meta().to_json(), "deadline": True}, "deadline"),
        ({**meta().to_json(), "reply": {"endpoint": "x", "relay": "ftp"}}, "relay"),
        ({**meta().to_json(), "reply": "tcp://x"}, "reply"),
        ({**meta().to_json(), "error": {"a": 1}}, "error"),
        ({**meta().to_json(), "deadline": float("inf")}, "finite"),
        ({**meta().to_json(), "deadline": float("nan")}, "finite"),
        ({**meta().to_json(), "deadline": 10**400}, "finite"),  # no OverflowError
    ],
)
def test_malformed_envelopes_raise(obj, message):
    with pytest.raises(EnvelopeError, match=message):
        envelope.parse(obj)


def test_deadlines_are_clamped_to_a_limit_from_now():
    now = time.time()
    far = meta(deadline=now + 1e9).clamped(30.0)
    assert now + 29 < far.deadline <= time.time() + 30.0
    near = meta(deadline=now + 5.0)
    assert near.clamped(30.0) is near  # an earlier deadline stays as it is


def test_expired():
    assert meta(deadline=0.0).expired
    assert not meta().expired


def test_extract_and_insert_are_inverse_and_do_not_mutate():
    emb = torch.ones(3)
    payload: dict[str, Any] = {"a": {"b": [emb, 2]}, "keep": 1}
    rest, value = envelope.extract(payload, "a.b[0]")
    assert value is emb
    assert rest == {"a": {"b": [None, 2]}, "keep": 1}
    assert payload["a"]["b"][0] is emb  # the original is untouched
    back = envelope.insert(rest, "a.b[0]", value)
    assert back["a"]["b"][0] is emb and back["keep"] == 1


def test_extract_top_level_key_removes_it():
    rest, value = envelope.extract({"latents": 1, "text_embedding": 2}, "text_embedding")
    assert rest == {"latents": 1} and value == 2
    assert envelope.insert(rest, "text_embedding", value) == {"latents": 1, "text_embedding": 2}


def test_insert_creates_missing_dicts_and_keeps_tuples():
    assert envelope.insert({}, "a.b", 1) == {"a": {"b": 1}}
    assert envelope.insert((0, {"k": 1}), "[1].k", 5) == (0, {"k": 5})


@pytest.mark.parametrize("path", ["missing", "a.zz", "a.b[5]"])
def test_extract_missing_path_raises_key_error(path):
    with pytest.raises(KeyError, match="not in the payload"):
        envelope.extract({"a": {"b": [1]}}, path)


def test_insert_through_a_non_container_raises():
    with pytest.raises(KeyError, match="cannot put"):
        envelope.insert({"a": 3}, "a.b", 1)
