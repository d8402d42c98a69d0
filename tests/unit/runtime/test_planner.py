"""A sender's Planner: a payload shaped like a recent one reuses its placement, and what it
sends is byte for byte what laying the payload out afresh gives (the frame an inline payload
travels in, a staged payload's commit header), whatever the payload."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg_runtime.memory.layout import (
    MAX_PLANNED_TENSORS,
    PLANNED_SIGNATURES,
    Planner,
    plan,
    slot_image,
)
from disagg_runtime.relay import inline_wire, lane
from disagg_runtime.wire.codec import CodecError
from tests.payload_strategies import payloads as payload_strategies


def fresh_frame(payload: Any, rid: str, meta: dict[str, Any] | None) -> bytes:
    """An inline lane frame as laid out from scratch: plan, the layout's JSON, the header,
    the slot image (the path without a Planner)."""
    manifest, tensors = plan(payload)
    header = inline_wire.pack(rid, inline_wire.layout_bytes(manifest), manifest.tree, meta)
    return lane.frame_prefix(header, manifest.nbytes) + header + slot_image(manifest, tensors)


def planned_frame(planner: Planner, payload: Any, rid: str, meta: dict[str, Any] | None) -> bytes:
    """The same frame as a sender builds it with its Planner."""
    tree, tensors, placed = planner.plan(payload)
    frame, at = inline_wire.frame(rid, placed.layout_json(), tree, meta, placed.nbytes)
    placed.fill(frame, at, tensors)
    return bytes(frame)


def commits(planner: Planner, payload: Any) -> tuple[bytes, bytes]:
    """A staged payload's binary commit header, planned and from scratch."""
    manifest, _ = plan(payload)
    tree, _, placed = planner.plan(payload)
    ask = {"xid": 9, "nbytes": 1 << 20}
    fresh = inline_wire.pack_commit(
        "c", 7, 4096, inline_wire.layout_bytes(manifest), manifest.tree, None, ask
    )
    planned = inline_wire.pack_commit("c", 7, 4096, placed.layout_json(), tree, None, ask)
    return planned, fresh


def strided(n: int) -> torch.Tensor:
    return torch.arange(2 * n, dtype=torch.float32).view(n, 2)[:, 0]  # not contiguous


SHAPES: list[Any] = [
    {"x": torch.ones(4096, dtype=torch.uint8), "sent": 1.25},
    {"x": torch.ones(4096, dtype=torch.uint8), "sent": 2.5},  # same shape, another value
    {"y": torch.ones(4096, dtype=torch.uint8), "sent": 1.25},  # another key
    {"x": torch.ones(4096, dtype=torch.int8), "sent": 1.25},  # another dtype
    {"x": torch.ones(4095, dtype=torch.uint8), "sent": 1.25},  # another shape
    {"x": torch.ones(64, 64, dtype=torch.uint8)},  # as many bytes, another shape
    {"x": strided(100), "s": "tëxt", "n": None, "b": True, "i": -(2**70), "f": math.inf},
    [torch.zeros(3, dtype=torch.bfloat16), (torch.ones(2, 5), {"k": [1, 2.5, None]})],
    ({"deep": [[{"t": torch.arange(7)}]]}, b"raw bytes"),
    {
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
        "cplx": torch.ones(3).to(torch.complex64),
    },
    {},
    "just a string",
    torch.arange(12, dtype=torch.int16).reshape(3, 4).t(),  # a bare strided tensor
    {"nan": math.nan, "x": torch.ones(1, dtype=torch.bool)},
]


@pytest.mark.parametrize("meta", [None, {"seq": 3, "reply": {"endpoint": "tcp://h:1"}}])
def test_planned_frames_and_commits_are_byte_identical_to_fresh_ones(meta: Any) -> None:
    planner = Planner()
    for _ in range(2):  # first laid out, then from the planner's placements
        for i, payload in enumerate(SHAPES):
            assert planned_frame(planner, payload, f"r{i}", meta) == fresh_frame(
                payload, f"r{i}", meta
            )
            planned, fresh = commits(planner, payload)
            assert planned == fresh


def test_a_placement_is_reused_only_for_the_same_dtypes_and_shapes_in_order() -> None:
    planner = Planner()
    base = {"x": torch.ones(16, dtype=torch.uint8), "y": torch.zeros(2, 3), "s": 1}
    _, _, first = planner.plan(base)
    for same in (
        {"x": torch.full((16,), 7, dtype=torch.uint8), "y": torch.ones(2, 3), "s": 2},  # values
        {"a": torch.ones(16, dtype=torch.uint8), "b": torch.zeros(2, 3)},  # keys, no scalar
        [torch.ones(16, dtype=torch.uint8), {"z": torch.zeros(2, 3).t().t()}],  # nesting
    ):
        tree, _, placed = planner.plan(same)
        assert placed is first
        assert placed.manifest(tree) == plan(same)[0]
    for other in (
        {"x": torch.ones(16, dtype=torch.int8), "y": torch.zeros(2, 3)},  # a dtype
        {"x": torch.ones(16, dtype=torch.uint8), "y": torch.zeros(3, 2)},  # a shape
        {"y": torch.zeros(2, 3), "x": torch.ones(16, dtype=torch.uint8)},  # the order
        {"x": torch.ones(16, dtype=torch.uint8)},  # one tensor fewer
        {"x": torch.ones(16, dtype=torch.uint8), "y": torch.zeros(2, 3), "z": torch.ones(0)},
    ):
        tree, _, placed = planner.plan(other)
        assert placed is not first
        assert placed.manifest(tree) == plan(other)[0]


def test_the_planner_keeps_a_bounded_number_of_placements() -> None:
    planner = Planner()
    for n in range(PLANNED_SIGNATURES + 10):
        planner.plan({"x": torch.ones(n)})
    assert len(planner) == PLANNED_SIGNATURES
    _, _, placed = planner.plan({"x": torch.ones(PLANNED_SIGNATURES + 9)})  # the newest, kept
    assert planner.plan({"x": torch.ones(PLANNED_SIGNATURES + 9)})[2] is placed
    many = [torch.ones(1) for _ in range(MAX_PLANNED_TENSORS + 1)]
    fresh = Planner()
    tree, _, placed = fresh.plan(many)
    assert placed.manifest(tree) == plan(many)[0]
    assert len(fresh) == 0  # laid out, not kept


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({"k": torch.zeros(2, device="meta")}, r"payload\['k'\]: a meta tensor"),
        ({"k": [torch.zeros(2, dtype=torch.uint16)]}, r"payload\['k'\]\[0\]: unsupported dtype"),
        ({"x": torch.zeros([1] * 33)}, r"33 dimensions"),
        ({1: torch.zeros(2)}, r"dict key 1 is int"),
    ],
)
def test_bad_payloads_fail_on_the_sender_and_leave_nothing_behind(payload: Any, match: str) -> None:
    planner = Planner()
    for _ in range(2):
        with pytest.raises(CodecError, match=match):
            planner.plan(payload)
    assert len(planner) == 0


def test_a_strided_tensor_s_host_copy_lives_until_the_slot_image_has_it() -> None:
    """slot_image copies a strided (or GPU) tensor through a contiguous host copy; that copy
    was freed before it was read, and the image held freed memory's bytes."""
    for n in (16, 1024, 1 << 18):
        t = strided(n)
        manifest, _ = plan({"x": t})
        assert bytes(slot_image(manifest, [t])) == t.contiguous().numpy().tobytes()


# -- any payload -------------------------------------------------------------------------


payloads = payload_strategies(max_leaves=12, text=6, binary=8, keys=4)
SHARED = Planner()  # across examples: payloads of one signature meet in it


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads, st.none() | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
def test_any_payload_s_planned_frame_is_its_fresh_frame(payload: Any, meta: Any) -> None:
    for _ in range(2):
        assert planned_frame(SHARED, payload, "r", meta) == fresh_frame(payload, "r", meta)
    planned, fresh = commits(SHARED, payload)
    assert planned == fresh
