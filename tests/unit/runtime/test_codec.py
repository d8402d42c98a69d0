"""Tests for the payload codec: exact round trips, zero-copy proofs, and hostile input."""

from __future__ import annotations

import ast
import gc
import json
import math
import pathlib
import sys
import warnings
import weakref
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg_runtime.bench import frames as bench_frames
from disagg_runtime.bench.frames import decode, encode
from disagg_runtime.wire import codec
from disagg_runtime.wire import tree as wire_tree
from disagg_runtime.wire.codec import (
    DTYPES,
    FORMAT_VERSION,
    MAX_BYTES_VALUE,
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    CodecError,
    TensorMeta,
    decode_header,
    dtype_from_name,
    dtype_name,
    encode_header,
    tensor_bytes,
    tensor_from_buffer,
)
from disagg_runtime.wire.tree import flatten, unflatten
from tests.payload_strategies import payloads as payload_strategies

ALL_DTYPES = sorted(DTYPES)
SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 4, 5)]


# ---------------------------------------------------------------- helpers


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs, infs, subnormals included); bools stay 0/1."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = math.prod(shape) * dtype.itemsize
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def assert_same(a: Any, b: Any) -> None:
    """Structural, type-exact, bit-exact equality (NaN == NaN, -0.0 != 0.0)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert_same_tensor(a, b)
    elif isinstance(a, float):
        if math.isnan(a):
            assert math.isnan(b)
        else:
            assert a == b
            assert math.copysign(1.0, a) == math.copysign(1.0, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def wire(frames: list[memoryview | bytes]) -> list[bytes]:
    """What a receiver would see: independent byte strings."""
    return [bytes(f) for f in frames]


def address(buf: Any) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def header_of(payload: Any) -> dict[str, Any]:
    return json.loads(bytes(encode(payload)[0]))  # type: ignore[no-any-return]


def frames_with(header: dict[str, Any], *buffers: bytes) -> list[bytes]:
    return [json.dumps(header).encode(), *buffers]


# ---------------------------------------------------------------- dtypes / meta


def test_allow_list_is_exact() -> None:
    assert set(DTYPES) == {
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "float8_e4m3fn",
        "float8_e5m2",
    }
    for name, dtype in DTYPES.items():
        assert dtype_name(dtype) == name
        assert dtype_from_name(name) is dtype
        assert str(dtype) == f"torch.{name}"
    with pytest.raises(TypeError):
        DTYPES["object"] = torch.float32  # type: ignore[index]


@pytest.mark.parametrize(
    "bad", ["object", "float8_e4m3fnuz", "__class__", "complex128", "", 5, None]
)
def test_dtype_from_name_rejects(bad: object) -> None:
    with pytest.raises(CodecError, match="unsupported dtype"):
        dtype_from_name(bad)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.uint16, torch.float8_e4m3fnuz])
def test_dtype_name_rejects(dtype: torch.dtype) -> None:
    with pytest.raises(CodecError, match="unsupported dtype"):
        dtype_name(dtype)


def test_tensor_meta_json_round_trip() -> None:
    meta = TensorMeta(torch.bfloat16, (2, 3))
    assert meta.to_json() == {"dtype": "bfloat16", "shape": [2, 3]}
    assert TensorMeta.from_json(meta.to_json()) == meta
    assert meta.nbytes == 12
    assert TensorMeta.of(torch.zeros(4, 5, dtype=torch.float8_e5m2)) == TensorMeta(
        torch.float8_e5m2, (4, 5)
    )
    assert TensorMeta.from_json({"dtype": "float32", "shape": []}).nbytes == 4
    assert TensorMeta.from_json({"dtype": "float32", "shape": [0, 2**40]}).nbytes == 0


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ([1], r"where\W.*expected an object"),
        ({"dtype": "float32"}, r"where: missing key\(s\) \['shape'\]"),
        ({"dtype": "float32", "shape": [1], "x": 1}, r"where: unknown key"),
        ({"dtype": "object", "shape": [1]}, r"where\.dtype: unsupported dtype 'object'"),
        ({"dtype": "float32", "shape": "12"}, r"where\.shape: expected a list"),
        ({"dtype": "float32", "shape": [2, -1]}, r"where\.shape: shape\[1\] is negative"),
        ({"dtype": "float32", "shape": [True]}, r"shape\[0\] is True, not an int"),
        ({"dtype": "float32", "shape": [2.0]}, r"shape\[0\] is 2\.0, not an int"),
        ({"dtype": "float32", "shape": [2**40, 2**40]}, r"more than 2\*\*48 bytes"),
        ({"dtype": "uint8", "shape": [2**49]}, r"more than 2\*\*48 bytes"),
        ({"dtype": "uint8", "shape": [0, 2**40, 2**40]}, r"more than 2\*\*48 bytes"),
        ({"dtype": "uint8", "shape": [1] * (MAX_NDIM + 1)}, r"33 dimensions"),
    ],
)
def test_tensor_meta_from_json_rejects(obj: object, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        TensorMeta.from_json(obj, where="where")


def test_tensor_meta_constructor_validates() -> None:
    with pytest.raises(CodecError):
        TensorMeta(torch.float32, (-1,))
    with pytest.raises(CodecError):
        TensorMeta(torch.complex128, (1,))
    with pytest.raises(CodecError):
        TensorMeta(torch.float32, [1])  # type: ignore[arg-type]


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", ALL_DTYPES)
def test_round_trip_every_dtype_and_shape(name: str, shape: tuple[int, ...]) -> None:
    t = make_tensor(DTYPES[name], shape, seed=len(shape))
    for frames in (encode(t), wire(encode(t))):
        out = decode(frames)
        assert_same_tensor(out, t)
        assert_same_tensor(decode(frames, copy=True), t)
    frames = encode({"x": [t, (t,)]})
    assert len(frames) == 3
    out = decode(wire(frames))
    assert_same_tensor(out["x"][0], t)
    assert_same_tensor(out["x"][1][0], t)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24.0).reshape(4, 6).t(),
        lambda: torch.arange(40, dtype=torch.int16)[::3],
        lambda: torch.arange(60.0).reshape(3, 4, 5)[:, 1::2, ::2],
        lambda: torch.tensor([1.0, 2.0]).expand(3, 2),
        lambda: make_tensor(torch.bfloat16, (4, 4)).t(),
        lambda: make_tensor(torch.float8_e4m3fn, (6, 2))[::2],
        lambda: torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
        lambda: torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),
        lambda: torch.ones(3, requires_grad=True) * 2,
    ],
)
def test_non_contiguous_and_lazy_tensors(make: Any) -> None:
    t = make()
    tree, tensors = flatten(t)
    assert tree == {"t": 0}
    assert tensors[0].is_contiguous()
    assert not tensors[0].requires_grad
    out = decode(wire(encode(t)))
    assert out.is_contiguous()
    assert out.shape == t.shape
    assert torch.equal(out, t.detach().resolve_conj())


def test_nested_scalars_round_trip() -> None:
    payload: dict[str, Any] = {
        "none": None,
        "bools": [True, False],
        "ints": [0, -1, 2**63, -(2**100), 10**30],
        "floats": [0.0, -0.0, 1.5, 1e308, 5e-324, math.nan, math.inf, -math.inf, 1.0],
        "strs": ["", "héllo", "日本", "\ud800", '{"t": 0}', "nan"],
        "bytes": [b"", b"\x00\xff" * 10, bytes(MAX_BYTES_VALUE)],
        "tuple": (1, (2, (3,)), [()], {}),
        "empty": [[], {}, ()],
        "tagged-looking": {"t": 1, "d": {}, "l": [], "b": "x", "f": "inf"},
        "tensor": torch.arange(5),
    }
    out = decode(wire(encode(payload)))
    assert_same(out, payload)
    assert isinstance(out["tuple"], tuple)
    assert isinstance(out["tuple"][1][1], tuple)
    assert math.copysign(1.0, out["floats"][1]) == -1.0
    scalars: list[Any] = [None, True, 3, -0.0, math.nan, "s", b"b", (), [], {}]
    for scalar in scalars:
        assert_same(decode(wire(encode(scalar))), scalar)


def test_header_is_strict_compact_json() -> None:
    header = bytes(encode({"x": [math.nan, math.inf, "é"], "t": torch.zeros(2, 3)})[0])
    assert b" " not in header
    obj = json.loads(header, parse_constant=lambda c: pytest.fail(f"non-strict constant {c}"))
    assert obj["v"] == FORMAT_VERSION
    assert obj["tensors"] == [{"dtype": "float32", "shape": [2, 3]}]
    header.decode("ascii")


def test_flatten_unflatten_directly() -> None:
    a, b = torch.zeros(2), torch.ones(3)
    payload = {"x": (a, [b, 1])}
    tree, tensors = flatten(payload)
    assert tree == {"d": {"x": {"u": [{"t": 0}, {"l": [{"t": 1}, 1]}]}}}
    assert tensors[0] is a
    assert tensors[1] is b
    assert_same(unflatten(tree, tensors), payload)


def test_subclasses_normalise() -> None:
    from collections import OrderedDict
    from enum import IntEnum

    class Color(IntEnum):
        RED = 3

    out = decode(
        encode(OrderedDict(a=Color.RED, b=np.float64(2.5), p=torch.nn.Parameter(torch.ones(2))))
    )
    assert type(out) is dict
    assert type(out["a"]) is int
    assert out["a"] == 3
    assert type(out["b"]) is float
    assert type(out["p"]) is torch.Tensor


def test_zmq_frames_decode() -> None:
    t = make_tensor(torch.bfloat16, (3, 4))
    frames = [zmq.Frame(bytes(f)) for f in encode({"t": t, "s": "x"})]
    out = decode(frames)
    assert_same_tensor(out["t"], t)
    assert out["s"] == "x"


def test_read_only_buffers_do_not_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch warns about read-only buffers once per process (TORCH_WARN_ONCE); this process
    # may have used up that warning already, so emulate a fresh one: warn on the first
    # read-only buffer only. The codec must swallow that warning, and stay quiet after.
    real = torch.frombuffer
    fired: list[bool] = []

    def frombuffer(buffer: Any, **kwargs: Any) -> torch.Tensor:
        if memoryview(buffer).readonly and not fired:
            fired.append(True)
            warnings.warn(
                "The given buffer is not writable, and PyTorch ...", UserWarning, stacklevel=2
            )
        return real(buffer, **kwargs)

    monkeypatch.setattr(torch, "frombuffer", frombuffer)
    monkeypatch.setattr(codec, "_readonly_warning_seen", False)
    header, body = wire(encode(torch.arange(4.0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            out = decode([header, body])
            assert_same_tensor(out, torch.arange(4.0))
    assert fired == [True]  # the emulation did fire, inside the codec


def test_tensor_from_buffer_odd_offsets_and_readonly() -> None:
    t = make_tensor(torch.float64, (3, 2))
    raw = bytes(tensor_bytes(t))
    meta = TensorMeta.of(t)
    for offset in range(9):
        blob = bytearray(offset) + raw + b"tail"
        view = memoryview(blob)[offset : offset + len(raw)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = tensor_from_buffer(view, meta)
            ro = tensor_from_buffer(memoryview(bytes(blob))[offset : offset + len(raw)], meta)
        assert_same_tensor(out, t)
        assert_same_tensor(ro, t)
        assert out.data_ptr() == address(view)
    # non-byte formats are reinterpreted as bytes
    as_floats = np.frombuffer(raw, dtype=np.float64).copy().data  # format 'd', not 'B'
    assert as_floats.format == "d"
    assert_same_tensor(tensor_from_buffer(as_floats, meta), t)
    empty = tensor_from_buffer(b"", TensorMeta(torch.bfloat16, (3, 0)))
    assert empty.shape == (3, 0)
    assert empty.dtype == torch.bfloat16


# ---------------------------------------------------------------- zero copy


def test_encode_is_zero_copy_and_keeps_storage_alive() -> None:
    base = torch.arange(100, dtype=torch.float32)
    t = base[10:40]  # contiguous view with a storage offset
    frames = encode({"t": t})
    frame = frames[1]
    assert isinstance(frame, memoryview)
    assert frame.format == "B"
    assert frame.ndim == 1
    assert frame.nbytes == t.nbytes
    assert address(frame) == t.data_ptr()
    assert torch.frombuffer(frame, dtype=torch.uint8).data_ptr() == t.data_ptr()

    storage = base.untyped_storage()
    ref = weakref.ref(storage)
    ptr = t.data_ptr()
    del base, t, storage, frames
    gc.collect()
    assert ref() is not None, "the frame must keep the tensor's storage alive"
    assert address(frame) == ptr
    assert np.frombuffer(frame, dtype=np.float32).tolist() == [float(i) for i in range(10, 40)]
    del frame
    gc.collect()
    assert ref() is None, "nothing else should hold the storage"


def test_tensor_bytes_refcount_and_every_dtype() -> None:
    t = torch.zeros(4, 4)
    ptr = t.data_ptr()
    view = tensor_bytes(t)
    assert address(view) == ptr
    del t
    gc.collect()
    # ownership chain: memoryview -> ndarray -> uint8 tensor view -> the original storage
    owner = view.obj.base  # type: ignore[attr-defined]
    assert isinstance(owner, torch.Tensor)
    assert owner.data_ptr() == ptr
    assert sys.getrefcount(owner) > 2  # held by the ndarray, not only by this frame
    for name in ALL_DTYPES:
        for shape in SHAPES:
            x = make_tensor(DTYPES[name], shape)
            mv = tensor_bytes(x)
            assert mv.format == "B"
            assert mv.ndim == 1
            assert len(mv) == x.nbytes
            if x.nbytes:
                assert address(mv) == x.data_ptr()


def test_flatten_contiguous_cpu_tensor_is_not_copied() -> None:
    t = torch.arange(6).reshape(2, 3)
    _, tensors = flatten([t, t[1]])
    assert tensors[0] is t
    assert tensors[1].data_ptr() == t[1].data_ptr()
    transposed = t.t()
    _, copied = flatten(transposed)
    assert copied[0].data_ptr() != t.data_ptr()


def test_decode_views_frames_unless_copy() -> None:
    t = torch.arange(8, dtype=torch.int32)
    header, body = encode({"t": t})
    frame = bytearray(body)
    out = decode([header, frame])["t"]
    assert out.data_ptr() == address(frame)
    assert_same_tensor(out, t)
    frame[0:4] = (12345).to_bytes(4, sys.byteorder)
    assert out[0].item() == 12345, "the decoded tensor must see writes to the frame"

    frame2 = bytearray(body)
    copied = decode([header, frame2], copy=True)["t"]
    assert copied.data_ptr() != address(frame2)
    frame2[0:4] = (777).to_bytes(4, sys.byteorder)
    assert copied[0].item() == 0

    # the decoded tensor keeps a received bytes frame alive
    ro = decode([header, bytes(body)])["t"]
    gc.collect()
    assert_same_tensor(ro, t)


# ---------------------------------------------------------------- property tests


payloads = payload_strategies(max_leaves=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads)
def test_property_round_trip(payload: Any) -> None:
    assert_same(decode(wire(encode(payload))), payload)
    assert_same(decode(encode(payload), copy=True), payload)


json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=8,
)
tags = st.sampled_from(["t", "d", "l", "u", "b", "f", "x", ""])
trees = st.recursive(
    json_scalars | st.builds(lambda i: {"t": i}, st.integers(-1, 3)),
    lambda children: (
        st.dictionaries(tags, children | st.lists(children, max_size=3), min_size=1, max_size=2)
        | st.builds(lambda xs: {"l": xs}, st.lists(children, max_size=3))
        | st.builds(lambda d: {"d": d}, st.dictionaries(st.text(max_size=3), children, max_size=3))
    ),
    max_leaves=10,
)
metas = (
    st.fixed_dictionaries(
        {
            "dtype": st.sampled_from([*ALL_DTYPES, "object", "float8_e4m3fnuz", "__class__"])
            | json_values,
            "shape": st.lists(
                st.integers(-2, 4) | st.sampled_from([2**40, 2**62, True]), max_size=4
            )
            | json_values,
        }
    )
    | json_values
)


def _check_only_codec_errors(frames: list[Any]) -> None:
    try:
        decode(frames, max_header_bytes=4096)
    except CodecError as exc:
        assert isinstance(exc, ValueError)
        assert str(exc)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=48), max_size=4))
def test_fuzz_arbitrary_frames(frames: list[bytes]) -> None:
    _check_only_codec_errors(frames)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_structured_headers(data: st.DataObject) -> None:
    header = {
        "v": data.draw(st.just(FORMAT_VERSION) | json_values),
        "tree": data.draw(trees),
        "tensors": data.draw(st.lists(metas, max_size=3)),
    }
    if data.draw(st.booleans()):
        header[data.draw(st.sampled_from(["v", "tree", "tensors"]))] = data.draw(json_values)
    buffers = []
    for spec in header["tensors"] if isinstance(header["tensors"], list) else []:
        try:
            size = TensorMeta.from_json(spec).nbytes
        except CodecError:
            size = 4
        size = min(size, 64) + data.draw(st.sampled_from([0, 0, 0, 1, -1]))
        buffers.append(data.draw(st.binary(min_size=max(size, 0), max_size=max(size, 0))))
    frames: list[Any] = [json.dumps(header).encode(), *buffers]
    if data.draw(st.integers(0, 9)) == 0:
        frames = frames[:-1] if data.draw(st.booleans()) else [*frames, b""]
    _check_only_codec_errors(frames)


_valid = encode({"a": [torch.arange(3, dtype=torch.int16), (1.5, math.nan)], "b": b"xy"})
_valid_header = bytes(_valid[0])
_valid_bodies = [bytes(f) for f in _valid[1:]]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, len(_valid_header) - 1), st.integers(0, 255)),
        min_size=1,
        max_size=4,
    )
)
def test_fuzz_mutated_header_bytes(edits: list[tuple[int, int]]) -> None:
    header = bytearray(_valid_header)
    for pos, value in edits:
        header[pos] = value
    _check_only_codec_errors([bytes(header), *_valid_bodies])


# ---------------------------------------------------------------- bad input


def test_frame_count_errors() -> None:
    frames = wire(encode({"a": torch.zeros(2), "b": torch.ones(3)}))
    with pytest.raises(CodecError, match=r"needs 3 frames; got 2"):
        decode(frames[:-1])
    with pytest.raises(CodecError, match=r"needs 3 frames; got 4"):
        decode([*frames, b""])
    with pytest.raises(CodecError, match=r"no frames"):
        decode([])
    with pytest.raises(CodecError, match=r"needs 1 frames; got 2"):
        decode([wire(encode(1))[0], b"x"])


def test_frame_size_errors() -> None:
    header, body = wire(encode(torch.zeros(2, 3, dtype=torch.bfloat16)))
    with pytest.raises(
        CodecError, match=r"frame 1 holds 11 bytes, but tensors\[0\] \(bfloat16 \[2, 3\]\) needs 12"
    ):
        decode([header, body[:-1]])
    with pytest.raises(CodecError, match=r"frame 1 holds 13 bytes"):
        decode([header, body + b"x"])
    with pytest.raises(CodecError, match=r"buffer holds 11 bytes"):
        tensor_from_buffer(body[:-1], TensorMeta(torch.bfloat16, (2, 3)))
    with pytest.raises(CodecError, match=r"not a bytes-like buffer"):
        decode([header, 12])
    with pytest.raises(CodecError, match=r"not a bytes-like buffer"):
        tensor_from_buffer("abc", TensorMeta(torch.uint8, (3,)))
    strided = memoryview(bytes(24))[::2]
    with pytest.raises(CodecError, match=r"not C-contiguous"):
        tensor_from_buffer(strided, TensorMeta(torch.uint8, (12,)))


def test_bool_data_must_be_zero_or_one() -> None:
    header, _ = wire(encode(torch.zeros(3, dtype=torch.bool)))
    with pytest.raises(CodecError, match=r"bool tensor"):
        decode([header, b"\x00\x02\x01"])


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b"{not json", r"not valid JSON"),
        (b"", r"not valid JSON"),
        (b"\xff\xfe{}", r"not UTF-8"),
        (b"[1, 2]", r"must be a JSON object, got list"),
        (b'"v"', r"must be a JSON object, got str"),
        (b"{}", r"unsupported format version: header has no 'v'"),
        (b'{"v": 2, "tree": null, "tensors": []}', r"unsupported format version 2"),
        (b'{"v": true, "tree": null, "tensors": []}', r"unsupported format version True"),
        (b'{"v": "1", "tree": null, "tensors": []}', r"unsupported format version '1'"),
        (b'{"v": 1.0, "tree": null, "tensors": []}', r"unsupported format version 1\.0"),
        (b'{"v": 1, "tensors": []}', r"missing key\(s\) \['tree'\]"),
        (b'{"v": 1, "tree": null}', r"missing key\(s\) \['tensors'\]"),
        (b'{"v": 1, "tree": null, "tensors": [], "x": 0}', r"unknown key\(s\) \['x'\]"),
        (b'{"v": 1, "tree": null, "tensors": {}}', r"'tensors' must be a list"),
        (b'{"v": 1, "tree": NaN, "tensors": []}', r"contains NaN"),
        (b'{"v": 1, "tree": -Infinity, "tensors": []}', r"contains -Infinity"),
        (b'{"v": 1, "v": 1, "tree": null, "tensors": []}', r"repeats the key 'v'"),
        (b'{"v": 1, "tree": ' + b"9" * 5000 + b', "tensors": []}', r"not valid JSON"),
        (b"[" * 100_000, r"nested too deeply"),
        (b'{"v": 1, "tree": null, "tensors": []} x', r"not valid JSON: Extra data"),
        (b'{"v": 1, "tree": {"d": {"a": 1, "a": 2}}, "tensors": []}', r"repeats the key 'a'"),
    ],
)
def test_bad_headers(header: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=match) as info:
        decode([header])
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"dtype": "object", "shape": [1]}, r"tensors\[0\]\.dtype: unsupported dtype 'object'"),
        ({"dtype": "float8_e4m3fnuz", "shape": [1]}, r"unsupported dtype 'float8_e4m3fnuz'"),
        ({"dtype": "__class__", "shape": [1]}, r"unsupported dtype '__class__'"),
        ({"dtype": ["float32"], "shape": [1]}, r"unsupported dtype \['float32'\]"),
        ({"dtype": "float32", "shape": [-1]}, r"tensors\[0\]\.shape: shape\[0\] is negative"),
        ({"dtype": "float32", "shape": [2**40, 2**40]}, r"more than 2\*\*48 bytes"),
        ({"dtype": "float32", "shape": [1] * 33}, r"33 dimensions, more than the limit of 32"),
        ({"dtype": "float32"}, r"tensors\[0\]: missing key"),
        ("float32", r"tensors\[0\]: expected an object"),
    ],
)
def test_bad_tensor_specs(spec: object, match: str) -> None:
    header = {"v": 1, "tree": {"t": 0}, "tensors": [spec]}
    with pytest.raises(CodecError, match=match):
        decode(frames_with(header, b"\x00" * 4))


def test_header_limit_checked_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    huge = b'{"v": 1, "tree": "' + b"x" * MAX_HEADER_BYTES + b'", "tensors": []}'

    def boom(*args: object, **kwargs: object) -> object:
        raise AssertionError("header was parsed before its size was checked")

    monkeypatch.setattr(json, "loads", boom)  # the codec uses the json module's loads
    with pytest.raises(CodecError, match=r"over the limit of 1048576"):
        decode([huge])
    with pytest.raises(CodecError, match=r"over the limit of 10"):
        decode_header(b'{"v": 1, "x": 12345}', max_bytes=10)
    monkeypatch.undo()
    assert decode_header(b'{"v":1,"x":1}', max_bytes=13) == {"v": 1, "x": 1}
    with pytest.raises(CodecError, match=r"header would be \d+ bytes"):
        encode({"s": "x" * MAX_HEADER_BYTES})


def nested_list(depth: int, leaf: Any = 0) -> Any:
    out = leaf
    for _ in range(depth):
        out = [out]
    return out


def test_depth_limit_on_encode() -> None:
    assert decode(encode(nested_list(MAX_DEPTH))) == nested_list(MAX_DEPTH)
    with pytest.raises(CodecError, match=r"payload\[0\]\[0\].*nested deeper than the limit of 64"):
        encode(nested_list(MAX_DEPTH + 1))
    with pytest.raises(CodecError, match=r"payload\['a'\]\[0\]: nested deeper than the limit of 2"):
        flatten({"a": [[1]]}, max_depth=2)
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(CodecError, match=r"nested deeper"):
        encode(cyclic)


def test_depth_limit_on_decode() -> None:
    tree: Any = 0
    for _ in range(MAX_DEPTH + 1):
        tree = {"l": [tree]}
    frames = frames_with({"v": 1, "tree": tree, "tensors": []})
    with pytest.raises(CodecError, match=r"nested deeper than the limit of 64"):
        decode(frames)
    assert decode(frames, max_depth=MAX_DEPTH + 1) == nested_list(MAX_DEPTH + 1)
    with pytest.raises(CodecError, match=r"limit of 3"):
        decode(wire(encode(nested_list(4))), max_depth=3)
    with pytest.raises(CodecError, match=r"limit of 1"):
        unflatten({"d": {"a": {"u": []}}}, [], max_depth=1)


@pytest.mark.parametrize(
    ("tree", "count", "match"),
    [
        ({"x": 1}, 0, r"payload: unknown tree tag 'x'"),
        ({"t": 0, "l": []}, 1, r"bad tree node"),
        ({}, 0, r"bad tree node"),
        ([1, 2], 0, r"bad tree node \[1, 2\]"),
        ({"t": "0"}, 1, r"tensor index '0' is not an int"),
        ({"t": True}, 1, r"tensor index True is not an int"),
        ({"t": 0.0}, 1, r"tensor index 0\.0 is not an int"),
        ({"t": 1}, 1, r"tensor index 1 out of range"),
        ({"t": -1}, 1, r"tensor index -1 out of range"),
        ({"l": [{"t": 0}, {"t": 0}]}, 1, r"payload\[1\]: tensor index 0 used more than once"),
        ({"l": [{"t": 0}]}, 2, r"never references tensor\(s\) \[1\]"),
        (None, 1, r"never references tensor\(s\) \[0\]"),
        ({"d": {"a": {"l": [1, {"q": 0}]}}}, 0, r"payload\['a'\]\[1\]: unknown tree tag 'q'"),
        ({"d": []}, 0, r"'d' node holds list"),
        ({"l": {}}, 0, r"'l' node holds dict"),
        ({"u": "ab"}, 0, r"'u' node holds str"),
        ({"b": "!!"}, 0, r"invalid base64"),
        ({"b": "ab"}, 0, r"invalid base64"),
        ({"b": "é"}, 0, r"invalid base64"),
        ({"b": 5}, 0, r"'b' node holds int"),
        ({"b": "A" * (4 * MAX_BYTES_VALUE)}, 0, r"over the limit of"),
        ({"f": "NaN"}, 0, r"'f' node holds 'NaN'"),
        ({"f": 1.0}, 0, r"'f' node holds 1\.0"),
        # a flat dict (unflatten's one-loop path) says what is wrong as the walk does
        ({"d": {"a": {"t": 0}, "b": {"t": 0}}}, 1, r"payload\['b'\]: tensor index 0 used more"),
        ({"d": {"a": {"t": 1}}}, 1, r"payload\['a'\]: tensor index 1 out of range"),
        ({"d": {"a": {"t": True}}}, 1, r"payload\['a'\]: tensor index True is not an int"),
        ({"d": {"a": {"t": 0}}}, 2, r"never references tensor\(s\) \[1\]"),
        ({"d": {"a": {"x": 0}}}, 0, r"payload\['a'\]: unknown tree tag 'x'"),
        ({"d": {"a": {"t": 0, "l": []}}}, 1, r"payload\['a'\]: bad tree node"),
        ({"d": {"a": [1]}}, 0, r"payload\['a'\]: bad tree node"),
    ],
)
def test_bad_trees(tree: Any, count: int, match: str) -> None:
    tensors = [torch.zeros(1, dtype=torch.uint8)] * count
    with pytest.raises(CodecError, match=match):
        unflatten(tree, tensors)
    header = {"v": 1, "tree": tree, "tensors": [{"dtype": "uint8", "shape": [1]}] * count}
    with pytest.raises(CodecError, match=match):
        decode(frames_with(header, *[b"\x00"] * count))


def test_whitespace_around_a_header_is_allowed() -> None:
    """Strict JSON allows it: the decoder's fast path (the scanner alone) hands it on."""
    assert decode_header(b' \n{"v": 1, "tree": null, "tensors": []}\t ')["v"] == 1


def test_a_flat_dict_comes_back_as_the_tree_walk_builds_it() -> None:
    """unflatten's one-loop path for a dict of tensors and scalars: the same dict, in order."""
    tensors = [torch.zeros(1), torch.ones(2)]
    tree = {"d": {"b": {"t": 1}, "n": None, "t": True, "i": 3, "f": 0.5, "s": "x", "a": {"t": 0}}}
    out = unflatten(tree, tensors)
    assert list(out) == ["b", "n", "t", "i", "f", "s", "a"]
    assert out["b"] is tensors[1] and out["a"] is tensors[0]
    assert [out[k] for k in "ntifs"] == [None, True, 3, 0.5, "x"]
    assert unflatten({"d": {}}, []) == {}
    with pytest.raises(CodecError, match=r"limit of 0"):
        unflatten({"d": {"a": 1}}, [], max_depth=0)


class Custom:
    pass


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({1: "a"}, r"payload: dict key 1 is int; only str keys are allowed"),
        ({"a": {None: 1}}, r"payload\['a'\]: dict key None is NoneType"),
        ({"a": [0, 1, 2, {(1,): 0}]}, r"payload\['a'\]\[3\]: dict key \(1,\) is tuple"),
        (object(), r"payload: unsupported type object"),
        ({"a": [0, {1, 2}]}, r"payload\['a'\]\[1\]: unsupported type set"),
        ([Custom()], r"payload\[0\]: unsupported type Custom"),
        ([bytearray(b"x")], r"unsupported type bytearray"),
        ({"n": np.int64(3)}, r"payload\['n'\]: unsupported type int64"),
        ({"b": bytes(MAX_BYTES_VALUE + 1)}, r"payload\['b'\]: bytes value of 65537 bytes"),
        (
            [torch.zeros(2, dtype=torch.complex128)],
            r"payload\[0\]: unsupported dtype torch\.complex128",
        ),
        ([torch.zeros(2, dtype=torch.uint16)], r"unsupported dtype torch\.uint16"),
        (
            [torch.zeros(2, dtype=torch.float8_e4m3fnuz)],
            r"unsupported dtype torch\.float8_e4m3fnuz",
        ),
        ([torch.zeros(2, 2).to_sparse()], r"unsupported tensor layout"),
        ([torch.zeros(2, device="meta")], r"meta tensor"),
        ({"k": torch.zeros(2, device="meta")}, r"payload\['k'\]: a meta tensor"),
        ({"k": (1, torch.zeros(2).to_sparse())}, r"payload\['k'\]\[1\]: unsupported tensor layout"),
    ],
)
def test_unencodable_payloads(payload: Any, match: str) -> None:
    with pytest.raises(CodecError, match=match) as info:
        encode(payload)
    assert isinstance(info.value, ValueError)


def test_misc_api_errors() -> None:
    with pytest.raises(CodecError, match=r"contiguous"):
        tensor_bytes(torch.zeros(3, 4).t())
    with pytest.raises(CodecError, match=r"conj/neg"):
        tensor_bytes(torch.zeros(2, dtype=torch.complex64).conj())
    with pytest.raises(CodecError, match=r"not strict JSON"):
        encode_header({"x": math.nan})
    with pytest.raises(CodecError, match=r"not strict JSON"):
        encode_header({"x": object()})
    assert encode_header({"v": 1, "s": "é"}) == b'{"v":1,"s":"\\u00e9"}'
    assert decode_header(memoryview(b'{"v":1}')) == {"v": 1}


# ---------------------------------------------------------------- hygiene


@pytest.mark.parametrize("module", [codec, wire_tree, bench_frames], ids=lambda m: m.__name__)
def test_codec_source_has_no_unsafe_deserialisation(module: Any) -> None:
    source = pathlib.Path(module.__file__).read_text()
    tree = ast.parse(source)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Name):
            assert node.id not in {"eval", "exec", "pickle", "__import__"}, node.id
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert (node.value.id, node.attr) != ("torch", "load")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and node.args
        ):
            assert not (isinstance(node.args[0], ast.Name) and node.args[0].id == "torch")
    assert not imported & {
        "pickle",
        "cPickle",
        "_pickle",
        "dill",
        "marshal",
        "shelve",
        "cloudpickle",
    }
    assert "import pickle" not in source
    assert "pickle" not in sys.modules or "pickle" not in vars(module)
