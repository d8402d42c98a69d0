"""The binary inline header (relay/inline_wire.py): round trips, the layout cache's bounds,
and every way a malformed header is refused (a ProtocolError or CodecError, never a crash)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from disagg_runtime.memory.layout import buffer_tensors, plan, slot_image
from disagg_runtime.relay import inline_wire as wire
from disagg_runtime.relay import lane
from disagg_runtime.relay.protocol import MAX_CONTROL_BYTES, ProtocolError
from disagg_runtime.wire.codec import CodecError
from disagg_runtime.wire.manifest import Manifest


def planned(n: int = 16, dtype: torch.dtype = torch.uint8) -> Manifest:
    manifest, _ = plan({"x": torch.zeros(n, dtype=dtype), "sent": 1.25, "tag": ("a", [1, None])})
    return manifest


def header(
    rid: bytes = b"r1",
    layout: bytes | None = None,
    tree: bytes = b'{"t":0}',
    meta: bytes = b"",
    *,
    kind: int = wire.KIND_INLINE,
    version: int = wire.WIRE_VERSION,
    lengths: tuple[int, int, int, int] | None = None,
) -> memoryview:
    """A header built by hand, so that each field can be wrong on its own."""
    if layout is None:
        layout = b'{"v":1,"nbytes":16,"tensors":[{"dtype":"uint8","shape":[16],"offset":0}]}'
    n = lengths or (len(rid), len(layout), len(tree), len(meta))
    return memoryview(wire.FIXED.pack(kind, version, *n) + rid + layout + tree + meta)


def parse(head: memoryview, cache: wire.LayoutCache | None = None) -> Manifest:
    inline = wire.unpack(head)
    return (
        (cache if cache is not None else wire.LayoutCache())
        .layout(inline.layout)
        .with_tree(inline.tree)
    )


def test_a_header_round_trips_with_its_tree_meta_and_request_id() -> None:
    manifest = planned()
    meta = {"route": "decode", "n": [1, 2.5]}
    head = wire.unpack(
        memoryview(wire.pack("réq-7", wire.layout_bytes(manifest), manifest.tree, meta))
    )
    assert head.rid == "réq-7"
    assert head.meta == meta
    assert wire.LayoutCache().layout(head.layout).with_tree(head.tree) == manifest


def test_no_meta_travels_as_nothing_and_reads_as_none() -> None:
    manifest = planned()
    packed = wire.pack("r", wire.layout_bytes(manifest), manifest.tree, None)
    assert wire.FIXED.unpack_from(packed)[5] == 0
    assert wire.unpack(memoryview(packed)).meta is None


def test_a_repeated_layout_is_taken_from_the_cache_with_this_message_s_tree() -> None:
    cache = wire.LayoutCache()
    first = parse(header(tree=b'{"t":0}'), cache)
    again = parse(header(tree=b'{"d":{"x":{"t":0},"s":2}}'), cache)
    assert len(cache) == 1
    assert again.tree == {"d": {"x": {"t": 0}, "s": 2}}
    assert (again.tensors, again.offsets, again.nbytes) == (
        first.tensors,
        first.offsets,
        first.nbytes,
    )


def test_the_cache_keeps_a_bounded_number_of_small_layouts() -> None:
    cache = wire.LayoutCache()
    for n in range(1, wire.LAYOUT_CACHE_ENTRIES + 10):
        manifest = planned(n)
        cache.layout(wire.layout_bytes(manifest)).with_tree(manifest.tree)
    assert len(cache) == wire.LAYOUT_CACHE_ENTRIES
    big, _ = plan([torch.zeros(1, dtype=torch.uint8) for _ in range(200)])
    layout = wire.layout_bytes(big)
    assert len(layout) > wire.MAX_CACHED_LAYOUT_BYTES
    fresh = wire.LayoutCache()
    assert fresh.layout(layout).with_tree(big.tree) == big  # validated, not kept
    assert len(fresh) == 0


def test_a_refused_layout_is_not_cached() -> None:
    cache = wire.LayoutCache()
    bad = b'{"v":1,"nbytes":8,"tensors":[{"dtype":"uint8","shape":[16],"offset":0}]}'
    for _ in range(2):
        with pytest.raises(CodecError, match="exceed 8"):
            cache.layout(bad).with_tree({"t": 0})
    assert len(cache) == 0


@pytest.mark.parametrize(
    ("head", "match"),
    [
        (memoryview(b""), "shorter than 16"),
        (header()[:10], "shorter than 16"),  # truncated in the fixed part
        (header()[:-1], "add up to"),  # truncated in a part
        (header(lengths=(2, 70, 7, 5)), "add up to"),  # lengths that say more than there is
        (memoryview(bytes(header()) + b" "), "add up to"),  # trailing bytes
        (header(kind=2), "unknown binary header kind 2"),
        (header(kind=ord("x")), "unknown binary header kind"),
        (header(version=2), "unsupported inline header version 2"),
        (header(rid=b"\xff\xfe"), "request id is not UTF-8"),
        (header(tree=b"{nope"), "inline tree is not valid JSON"),
        (header(tree=b'{"t":0,"t":0}'), "repeats the key"),
        (header(tree=b"NaN"), "NaN"),
        (header(meta=b"[1]"), "'meta' must be an object"),
        (header(meta=b'{"a":1,"a":2}'), "repeats the key"),
    ],
)
def test_malformed_headers_are_refused(head: memoryview, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.unpack(head)


def test_a_header_over_the_control_limit_is_refused_before_parsing() -> None:
    fixed = wire.FIXED.pack(wire.KIND_INLINE, wire.WIRE_VERSION, 0, 0, MAX_CONTROL_BYTES, 0)
    with pytest.raises(ProtocolError, match="over"):
        wire.unpack(memoryview(fixed + b" " * MAX_CONTROL_BYTES))


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        (b"[]", "expected an object without a tree"),
        (b'{"v":1,"tree":{"t":0},"nbytes":0,"tensors":[]}', "without a tree"),
        (b'{"v":2,"nbytes":0,"tensors":[]}', "unsupported version"),
        (b'{"v":1,"nbytes":16,"tensors":[{"dtype":"pickle","shape":[16],"offset":0}]}', "dtype"),
        (
            b'{"v":1,"nbytes":16,"tensors":[{"dtype":"uint8","shape":[16],"offset":3}]}',
            "misaligned",
        ),
        (b'{"v":1,"nbytes":99999999999,"tensors":[]}', "does not fit"),
        (b"\xff", "not UTF-8"),
    ],
)
def test_malformed_layouts_are_refused(layout: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        parse(header(layout=layout))


@pytest.mark.parametrize("build", ["pack", "frame"])
def test_the_sender_refuses_what_it_cannot_send(build: str) -> None:
    manifest = planned()
    layout = wire.layout_bytes(manifest)

    def make(rid: str, meta: dict[str, Any] | None) -> object:
        if build == "pack":
            return wire.pack(rid, layout, manifest.tree, meta)
        return wire.frame(rid, layout, manifest.tree, meta, manifest.nbytes)

    with pytest.raises(CodecError, match="request id"):
        make("x" * (wire.MAX_RID_BYTES + 1), None)
    with pytest.raises(CodecError, match="not strict JSON"):
        make("r", {"bad": float("nan")})
    with pytest.raises(CodecError, match="over the limit"):
        make("r", {"big": "x" * MAX_CONTROL_BYTES})


@pytest.mark.parametrize("meta", [None, {"seq": 1}])
def test_an_inline_frame_is_the_lane_prefix_the_header_and_room_for_the_slot(meta: Any) -> None:
    manifest = planned(100)
    layout = wire.layout_bytes(manifest)
    frame, at = wire.frame("r7", layout, manifest.tree, meta, manifest.nbytes)
    header = wire.pack("r7", layout, manifest.tree, meta)
    assert bytes(frame[:at]) == lane.frame_prefix(header, manifest.nbytes) + header
    assert len(frame) == at + manifest.nbytes and not any(frame[at:])


def test_a_json_header_and_a_binary_one_differ_in_their_first_byte() -> None:
    manifest = planned()
    packed = wire.pack("r", wire.layout_bytes(manifest), manifest.tree, None)
    assert packed[0] == wire.KIND_INLINE != ord("{")


# ---- the binary commit header (kind 2) -------------------------------------------------------


def commit_header(**fixed: int) -> memoryview:
    """A commit header from pack_commit, with fields of its fixed part overridden."""
    manifest = planned()
    packed = wire.pack_commit("c1", 7, 1 << 20, wire.layout_bytes(manifest), manifest.tree, None)
    fields = list(wire.COMMIT_FIXED.unpack_from(packed))
    names = ("kind", "version", "rid", "layout", "tree", "meta", "xid", "offset")
    for name, value in fixed.items():
        fields[names.index(name)] = value
    return memoryview(wire.COMMIT_FIXED.pack(*fields) + packed[wire.COMMIT_FIXED.size :])


@pytest.mark.parametrize("ask", [None, {"xid": 8, "nbytes": 3 << 20}])
def test_a_commit_header_round_trips_with_its_numbers_and_ask(ask: dict[str, int] | None) -> None:
    manifest = planned(64, torch.float32)
    layout = wire.layout_bytes(manifest)
    packed = wire.pack_commit("rid-é", 2**40, 4 << 20, layout, manifest.tree, {"a": [1]}, ask)
    assert packed[0] == wire.KIND_COMMIT
    commit = wire.unpack_commit(memoryview(packed))
    assert (commit.xid, commit.offset, commit.ask) == (2**40, 4 << 20, ask)
    assert (commit.head.rid, commit.head.layout, commit.head.meta) == ("rid-é", layout, {"a": [1]})
    assert wire.LayoutCache(1 << 30).layout(layout).with_tree(commit.head.tree) == manifest


@pytest.mark.parametrize(
    ("head", "match"),
    [
        (commit_header()[:40], "shorter than 48"),
        (commit_header()[:-1], "add up to"),
        (commit_header(kind=wire.KIND_INLINE), "unknown binary header kind 1"),
        (commit_header(version=2), "unsupported commit header version 2"),
        (commit_header(rid=40), "add up to"),
    ],
)
def test_malformed_commit_headers_are_refused(head: memoryview, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.unpack_commit(head)


def test_an_inline_parser_refuses_a_commit_header() -> None:
    with pytest.raises(ProtocolError, match="unknown binary header kind 2"):
        wire.unpack(commit_header())


def test_the_sender_refuses_a_commit_it_cannot_encode() -> None:
    manifest = planned()
    layout = wire.layout_bytes(manifest)
    with pytest.raises(CodecError, match="does not fit"):
        wire.pack_commit("r", 2**64, 0, layout, manifest.tree, None)
    with pytest.raises(CodecError, match="does not fit"):
        wire.pack_commit("r", 1, -1, layout, manifest.tree, None)
    with pytest.raises(CodecError, match="asks 0 B"):
        wire.pack_commit("r", 1, 0, layout, manifest.tree, None, {"xid": 2, "nbytes": 0})


def test_a_layout_cache_refuses_layouts_larger_than_its_slots() -> None:
    manifest = planned(4096)
    layout = wire.layout_bytes(manifest)
    with pytest.raises(CodecError, match="does not fit a slot of 4095 B"):
        wire.LayoutCache(4095).layout(layout).with_tree(manifest.tree)
    assert wire.LayoutCache(4096).layout(layout).with_tree(manifest.tree) == manifest


def test_a_cached_layout_reads_the_tensors_buffer_tensors_reads() -> None:
    """The layout's reader (worked out once) views the same values, dtypes and shapes."""
    payload = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([True, False, True]),
        "c": torch.tensor(7, dtype=torch.int64),  # 0-d
        "d": torch.empty(0, 5, dtype=torch.bfloat16),  # no bytes
        "e": torch.arange(5, dtype=torch.int16),
    }
    manifest, tensors = plan(payload)
    data = memoryview(slot_image(manifest, tensors))
    known = wire.LayoutCache().layout(wire.layout_bytes(manifest))
    assert known.nbytes == manifest.nbytes
    got = known.reader.tensors(data)
    want = buffer_tensors(data, manifest)
    assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    got[0][0, 0] = 42.0  # views, not copies
    assert want[0][0, 0] == 42.0


def test_a_cached_layout_refuses_a_buffer_of_another_size_or_bad_bool_bytes() -> None:
    manifest, tensors = plan({"m": torch.tensor([True, False])})
    image = slot_image(manifest, tensors)
    known = wire.LayoutCache().layout(wire.layout_bytes(manifest))
    with pytest.raises(CodecError, match="holds 1 bytes"):
        known.reader.tensors(memoryview(image)[:1])
    image[1] = 2
    with pytest.raises(CodecError, match="other than 0 and 1"):
        known.reader.tensors(memoryview(image))
