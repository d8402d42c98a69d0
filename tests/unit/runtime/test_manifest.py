"""Manifest tests: slot layout, JSON round trips, and every way a hostile manifest is refused."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_runtime.memory.layout import plan as pool_plan
from disagg_runtime.wire.codec import DTYPES, CodecError, TensorMeta
from disagg_runtime.wire.manifest import (
    ALIGN,
    MANIFEST_VERSION,
    Manifest,
    layout,
    tensor_alignment,
)

# -- helpers -------------------------------------------------------------------------------


def meta(dtype: torch.dtype, *shape: int) -> TensorMeta:
    return TensorMeta(dtype, tuple(shape))


def entry(dtype: str, shape: list[int], offset: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "offset": offset}


def manifest_json(tensors: list[dict[str, Any]], nbytes: int, **extra: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "v": MANIFEST_VERSION,
        "tree": {"l": [{"t": i} for i in range(len(tensors))]},
        "nbytes": nbytes,
        "tensors": tensors,
    }
    obj.update(extra)
    return obj


# A valid two-tensor manifest: 10 uint8 bytes at 0, then 4 float32 at the next cache line.
VALID = manifest_json([entry("uint8", [10], 0), entry("float32", [4], 64)], nbytes=80)


# -- layout --------------------------------------------------------------------------------


def test_alignment_is_a_cache_line_at_least_and_never_below_itemsize() -> None:
    for dtype in DTYPES.values():
        align = tensor_alignment(meta(dtype, 3))
        assert align >= ALIGN == 64
        assert align % dtype.itemsize == 0


def test_layout_packs_tensors_at_aligned_offsets() -> None:
    metas = [
        meta(torch.uint8, 3),  # 3 B at 0
        meta(torch.float32, 5),  # 20 B at 64
        meta(torch.bfloat16, 0, 7),  # zero-size: aligned offset, takes no room
        meta(torch.int64),  # 0-dim: 8 B
        meta(torch.complex64, 2, 2),  # 32 B
        meta(torch.uint8, 64),  # exactly one cache line
    ]
    offsets, total = layout(metas)
    assert offsets == (0, 64, 128, 128, 192, 256)
    assert total == 256 + 64


def test_layout_of_nothing_is_empty() -> None:
    assert layout([]) == ((), 0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(sorted(DTYPES)),
            st.lists(st.integers(min_value=0, max_value=9), max_size=3),
        ),
        max_size=8,
    )
)
def test_layout_properties(specs: list[tuple[str, list[int]]]) -> None:
    metas = [TensorMeta(DTYPES[name], tuple(shape)) for name, shape in specs]
    offsets, total = layout(metas)
    end = 0
    for m, off in zip(metas, offsets, strict=True):
        assert off % tensor_alignment(m) == 0
        assert off >= end  # no overlap
        assert off - end < tensor_alignment(m)  # no gap bigger than the padding
        end = off + m.nbytes
    assert total == end
    # Whatever layout() produces, from_json() accepts against a slot of exactly that size.
    man = Manifest(tree=None, tensors=tuple(metas), offsets=offsets, nbytes=total)
    assert Manifest.from_json(json.loads(json.dumps(man.to_json())), slot_size=total) == man


# -- plan and round trip -------------------------------------------------------------------


def test_plan_flattens_and_lays_out_a_nested_payload() -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.ones(5, dtype=torch.bfloat16)
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()  # not contiguous
    payload = {"a": a, "rest": [b, (t, "x", 2.5)], "n": None}
    man, tensors = pool_plan(payload)
    assert [m.dtype for m in man.tensors] == [torch.float32, torch.bfloat16, torch.int64]
    assert [m.shape for m in man.tensors] == [(2, 3), (5,), (4, 3)]
    assert man.offsets == (0, 64, 128)
    assert man.nbytes == 128 + 96
    assert all(x.is_contiguous() for x in tensors)
    assert tensors[0] is a  # already contiguous: handed over as is
    assert torch.equal(tensors[2], t)


def test_round_trip_through_json_text() -> None:
    payload = {
        "x": torch.zeros(3, 5, dtype=torch.float8_e4m3fn),
        "y": [torch.tensor(True), torch.empty(0, dtype=torch.complex64)],
        "z": (1, "two", None),
    }
    man, _ = pool_plan(payload)
    obj = man.to_json()
    assert obj["v"] == MANIFEST_VERSION
    assert obj["nbytes"] == man.nbytes
    assert [t["offset"] for t in obj["tensors"]] == list(man.offsets)
    back = Manifest.from_json(json.loads(json.dumps(obj)), slot_size=man.nbytes)
    assert back == man
    # A bigger slot is fine too: the manifest only has to fit.
    assert Manifest.from_json(obj, slot_size=1 << 20) == man


def test_valid_fixture_parses() -> None:
    man = Manifest.from_json(copy.deepcopy(VALID), slot_size=80)
    assert man.offsets == (0, 64)
    assert man.nbytes == 80


# -- hostile manifests ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tensors", "nbytes"),
    [
        # second tensor starts inside the first (its bytes are [0, 100))
        ([entry("uint8", [100], 0), entry("float32", [4], 64)], 256),
        # same offset twice
        ([entry("uint8", [8], 0), entry("uint8", [8], 0)], 256),
        # going backwards
        ([entry("uint8", [8], 128), entry("uint8", [8], 64)], 256),
        # negative offset
        ([entry("uint8", [8], -64)], 256),
    ],
    ids=["overlap", "same-offset", "backwards", "negative"],
)
def test_rejects_overlapping_offsets(tensors: list[dict[str, Any]], nbytes: int) -> None:
    with pytest.raises(CodecError, match="overlaps or is misaligned"):
        Manifest.from_json(manifest_json(tensors, nbytes), slot_size=1024)


@pytest.mark.parametrize("offset", [1, 8, 32, 63, 65, 100])
def test_rejects_misaligned_offsets(offset: int) -> None:
    obj = manifest_json([entry("float32", [4], offset)], nbytes=256)
    with pytest.raises(CodecError, match="misaligned"):
        Manifest.from_json(obj, slot_size=1024)


@pytest.mark.parametrize(
    ("tensors", "nbytes"),
    [
        ([entry("float32", [4], 0)], 15),  # 16 B tensor, 15 B manifest
        ([entry("uint8", [10], 0), entry("float32", [4], 64)], 79),  # VALID, one byte short
        ([entry("uint8", [1], 1024)], 1024),  # starts at the end
        ([entry("float64", [2**40], 0)], 1024),  # huge shape
    ],
)
def test_rejects_tensors_past_nbytes(tensors: list[dict[str, Any]], nbytes: int) -> None:
    with pytest.raises(CodecError, match="exceed"):
        Manifest.from_json(manifest_json(tensors, nbytes), slot_size=1024)


def test_rejects_nbytes_larger_than_the_slot() -> None:
    with pytest.raises(CodecError, match=r"manifest\.nbytes"):
        Manifest.from_json(copy.deepcopy(VALID), slot_size=79)


@pytest.mark.parametrize("version", [0, 2, "1", None, [1]])
def test_rejects_wrong_version(version: Any) -> None:
    obj = copy.deepcopy(VALID)
    obj["v"] = version
    with pytest.raises(CodecError, match="version"):
        Manifest.from_json(obj, slot_size=1024)


def test_rejects_missing_version() -> None:
    obj = copy.deepcopy(VALID)
    del obj["v"]
    with pytest.raises(CodecError, match="version"):
        Manifest.from_json(obj, slot_size=1024)


@pytest.mark.parametrize("version", [True, 1.0])
def test_rejects_version_of_the_wrong_type(version: Any) -> None:
    obj = copy.deepcopy(VALID)
    obj["v"] = version
    with pytest.raises(CodecError):
        Manifest.from_json(obj, slot_size=1024)


def _with(path: str, value: Any) -> dict[str, Any]:
    """VALID with one field replaced; `path` is `key` or `tensors.<i>.<key>`."""
    obj = copy.deepcopy(VALID)
    target: Any = obj
    *parents, last = path.split(".")
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    key: Any = int(last) if isinstance(target, list) else last
    if value is _DELETE:
        del target[key]
    else:
        target[key] = value
    return obj


_DELETE = object()


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(None, id="null"),
        pytest.param([VALID], id="list"),
        pytest.param("manifest", id="string"),
        pytest.param(_with("tensors", {"0": {}}), id="tensors-object"),
        pytest.param(_with("tensors", None), id="tensors-null"),
        pytest.param(_with("tensors", _DELETE), id="tensors-missing"),
        pytest.param(_with("nbytes", "80"), id="nbytes-str"),
        pytest.param(_with("nbytes", 80.0), id="nbytes-float"),
        pytest.param(_with("nbytes", True), id="nbytes-bool"),
        pytest.param(_with("nbytes", -1), id="nbytes-negative"),
        pytest.param(_with("nbytes", _DELETE), id="nbytes-missing"),
        pytest.param(_with("tensors.0", [0]), id="entry-list"),
        pytest.param(_with("tensors.0", "uint8"), id="entry-str"),
        pytest.param(_with("tensors.1.offset", "64"), id="offset-str"),
        pytest.param(_with("tensors.1.offset", 64.0), id="offset-float"),
        pytest.param(_with("tensors.0.offset", False), id="offset-bool"),
        pytest.param(_with("tensors.1.offset", None), id="offset-null"),
        pytest.param(_with("tensors.1.offset", _DELETE), id="offset-missing"),
        pytest.param(_with("tensors.1.dtype", "float128"), id="dtype-unknown"),
        pytest.param(_with("tensors.1.dtype", "torch.float32"), id="dtype-attr-path"),
        pytest.param(_with("tensors.1.dtype", 7), id="dtype-int"),
        pytest.param(_with("tensors.1.shape", 4), id="shape-int"),
        pytest.param(_with("tensors.1.shape", [4.0]), id="shape-float"),
        pytest.param(_with("tensors.1.shape", [-4]), id="shape-negative"),
        pytest.param(_with("tensors.1.shape", [True]), id="shape-bool"),
        pytest.param(_with("tensors.1.shape", _DELETE), id="shape-missing"),
        pytest.param(_with("tensors.1.stride", [1]), id="unknown-key"),
    ],
)
def test_rejects_bad_types(obj: Any) -> None:
    with pytest.raises(CodecError):
        Manifest.from_json(obj, slot_size=1024)


def test_errors_name_the_offending_tensor() -> None:
    with pytest.raises(CodecError, match=r"manifest\.tensors\[1\]"):
        Manifest.from_json(_with("tensors.1.offset", 65), slot_size=1024)
    with pytest.raises(CodecError, match=r"manifest\.tensors\[1\]\.dtype"):
        Manifest.from_json(_with("tensors.1.dtype", "float128"), slot_size=1024)
