"""The binary header of an inline payload on the lane: fixed fields packed, not one JSON object.

Why: an inline message's JSON header cost both ends ~15-20 us of Python per message (encode;
strict decode, which checks every object for repeated keys; the manifest's validation), most
of it for the part that repeats from message to message: the tensors' dtypes, shapes and
offsets. An ingress that reads this header says so in its welcome (`inline_wire: 1`); its
senders then write an inline lane frame's header as (integers little-endian)

    kind u8 = 1 | version u8 = 1 | rid u16 | layout u32 | tree u32 | meta u32   (16 B)
    rid: UTF-8 | layout: strict JSON | tree: strict JSON | meta: strict JSON object or nothing

The fixed part gives each part's length, and the parts fill the header exactly. `layout` is
the manifest without its tree (manifest.py: version, nbytes, tensors); `tree` is the
payload's tree (codec.py), decoded and checked on every message since it carries the
payload's changing values. A lane keeps the few layouts it saw last, validated, keyed on
their exact bytes (`LayoutCache`): a repeated one skips its decode and validation, and
its result is what validating those bytes again would give. A JSON header starts with `{`,
so the first byte tells the two apart; anything malformed is a ProtocolError (the message is
rejected; the lane stays open, as for a bad JSON header). Over ZMQ, inline headers stay JSON.

A staged shm payload's `commit` on the lane has the same form where the welcome offers
`commit_wire: 1` (its JSON header with the manifest cost both ends ~25 us of Python per
payload, about a fifth of a 1 MiB hand-off): the fixed part grows by the commit's integers,

    kind u8 = 2 | version u8 = 1 | rid u16 | layout u32 | tree u32 | meta u32
    | xid u64 | offset u64 | next xid u64 | next nbytes u64                      (48 B)

then the same four parts. `next nbytes` 0 means the commit asks for no spare (an ask is
never for 0 B). The receiver checks the layout's `nbytes` against the granted slot on
every commit (`LayoutCache(slot_size)` bounds what it caches; the slot may be smaller).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from disagg_runtime.memory.layout import SlotReader
from disagg_runtime.relay.lane import PREFIX
from disagg_runtime.relay.protocol import MAX_CONTROL_BYTES, MAX_INLINE_MESSAGE_BYTES, ProtocolError
from disagg_runtime.wire.codec import CodecError, decode_json, encode_json
from disagg_runtime.wire.manifest import Manifest

KIND_INLINE = 1
KIND_COMMIT = 2
WIRE_VERSION = 1
FIXED = struct.Struct("<BBHIII")
COMMIT_FIXED = struct.Struct("<BBHIIIQQQQ")
_FRAMED = struct.Struct("<II" + FIXED.format[1:])  # the lane's frame prefix, then FIXED
assert _FRAMED.size == PREFIX.size + FIXED.size
MAX_U64 = (1 << 64) - 1
MAX_RID_BYTES = 0xFFFF
LAYOUT_CACHE_ENTRIES = 32  # per lane: the layouts a sender's payloads take turns in
MAX_CACHED_LAYOUT_BYTES = 4096  # larger layouts are validated every time (bounded memory)


def layout_bytes(manifest: Manifest) -> bytes:
    """A manifest's layout part (everything but the tree), as the wire carries it."""
    return manifest.layout_json()


def frame(
    rid: str, layout: bytes, tree: Any, meta: Mapping[str, Any] | None, data_bytes: int
) -> tuple[bytearray, int]:
    """An inline payload's whole lane frame (relay/lane.py: prefix, this header, data) in one
    buffer, with room for the slot's `data_bytes` bytes, which the caller writes from the
    returned offset on: one allocation and one copy of the header, where `pack` and
    `lane.frame_buffer` take two. CodecError as for `pack`."""
    rid_bytes, tree_bytes, meta_bytes = _encode(rid, tree, meta)
    lengths = (len(rid_bytes), len(layout), len(tree_bytes), len(meta_bytes))
    header_bytes = FIXED.size + sum(lengths)
    _check_limit(header_bytes, "inline")
    at = _FRAMED.size + header_bytes - FIXED.size
    buffer = bytearray(at + data_bytes)
    _FRAMED.pack_into(buffer, 0, header_bytes, data_bytes, KIND_INLINE, WIRE_VERSION, *lengths)
    buffer[_FRAMED.size : at] = b"".join((rid_bytes, layout, tree_bytes, meta_bytes))
    return buffer, at


def pack(rid: str, layout: bytes, tree: Any, meta: Mapping[str, Any] | None) -> bytes:
    """The header of an inline payload; CodecError when a part is not strict JSON, the rid is
    too long, or the header is over MAX_CONTROL_BYTES (the sender fails, not the receiver)."""
    return _pack(FIXED, (KIND_INLINE, WIRE_VERSION), (), "inline", rid, layout, tree, meta)


def pack_commit(
    rid: str,
    xid: int,
    offset: int,
    layout: bytes,
    tree: Any,
    meta: Mapping[str, Any] | None,
    ask: Mapping[str, int] | None = None,
) -> bytes:
    """The header of a staged payload's commit (`ask`: the spare it asks for, `next {xid,
    nbytes}`); CodecError as for `pack`, or when a number does not fit its field."""
    numbers = (xid, offset, *((ask["xid"], ask["nbytes"]) if ask else (0, 0)))
    if min(numbers) < 0 or max(numbers) > MAX_U64 or (ask and not ask["nbytes"]):
        raise CodecError(f"relay commit: a field of {numbers} does not fit its u64 (or asks 0 B)")
    head = (KIND_COMMIT, WIRE_VERSION)
    return _pack(COMMIT_FIXED, head, numbers, "commit", rid, layout, tree, meta)


def _pack(
    fixed: struct.Struct,
    head: tuple[int, int],
    numbers: tuple[int, ...],
    what: str,
    rid: str,
    layout: bytes,
    tree: Any,
    meta: Mapping[str, Any] | None,
) -> bytes:
    rid_bytes, tree_bytes, meta_bytes = _encode(rid, tree, meta)
    lengths = (len(rid_bytes), len(layout), len(tree_bytes), len(meta_bytes))
    header = b"".join(
        (fixed.pack(*head, *lengths, *numbers), rid_bytes, layout, tree_bytes, meta_bytes)
    )
    _check_limit(len(header), what)
    return header


def _encode(rid: str, tree: Any, meta: Mapping[str, Any] | None) -> tuple[bytes, bytes, bytes]:
    """The request id, tree and meta parts as the header carries them."""
    rid_bytes = rid.encode("utf-8", "surrogatepass")
    if len(rid_bytes) > MAX_RID_BYTES:
        raise CodecError(f"request id of {len(rid_bytes)} B is over {MAX_RID_BYTES} B")
    return rid_bytes, encode_json(tree), b"" if meta is None else encode_json(meta)


def _check_limit(header_bytes: int, what: str) -> None:
    if header_bytes > MAX_CONTROL_BYTES:
        raise CodecError(
            f"relay {what} header would be {header_bytes} bytes, over the limit of "
            f"{MAX_CONTROL_BYTES}; move large values into tensors"
        )


class Inline:
    """A parsed header: the request id, the layout's bytes, the tree and meta decoded."""

    __slots__ = ("layout", "meta", "rid", "tree")

    def __init__(self, rid: str, layout: bytes, tree: Any, meta: dict[str, Any] | None) -> None:
        self.rid = rid
        self.layout = layout
        self.tree = tree
        self.meta = meta


def unpack(header: memoryview) -> Inline:
    """Parse a binary inline header; ProtocolError naming what is wrong."""
    if not FIXED.size <= header.nbytes <= MAX_CONTROL_BYTES:
        _check_size(header, FIXED, "inline")
    kind, version, *lengths = FIXED.unpack_from(header)
    if kind != KIND_INLINE or version != WIRE_VERSION:
        _check_kind(kind, version, KIND_INLINE, "inline")
    return _parts(header, FIXED.size, lengths, "inline")


class Commit:
    """A parsed commit header: `head` (as `unpack` gives), the transfer's `xid` and slot
    `offset`, and the spare it asks for (`ask`, `next {xid, nbytes}`), or None."""

    __slots__ = ("ask", "head", "offset", "xid")

    def __init__(self, head: Inline, xid: int, offset: int, ask: dict[str, int] | None) -> None:
        self.head = head
        self.xid = xid
        self.offset = offset
        self.ask = ask


def unpack_commit(header: memoryview) -> Commit:
    """Parse a binary commit header; ProtocolError naming what is wrong."""
    _check_size(header, COMMIT_FIXED, "commit")
    kind, version, *fields = COMMIT_FIXED.unpack_from(header)
    _check_kind(kind, version, KIND_COMMIT, "commit")
    xid, offset, next_xid, next_nbytes = fields[4:]
    head = _parts(header, COMMIT_FIXED.size, fields[:4], "commit")
    ask = {"xid": next_xid, "nbytes": next_nbytes} if next_nbytes else None
    return Commit(head, xid, offset, ask)


def _check_size(header: memoryview, fixed: struct.Struct, what: str) -> None:
    if header.nbytes < fixed.size:
        raise ProtocolError(f"{what} header of {header.nbytes} B is shorter than {fixed.size} B")
    if header.nbytes > MAX_CONTROL_BYTES:
        raise ProtocolError(f"{what} header of {header.nbytes} B is over {MAX_CONTROL_BYTES} B")


def _check_kind(kind: int, version: int, expected: int, what: str) -> None:
    if kind != expected:
        raise ProtocolError(f"unknown binary header kind {kind}")
    if version != WIRE_VERSION:
        raise ProtocolError(f"unsupported {what} header version {version}")


_TREE = {"inline": "inline tree", "commit": "commit tree"}  # what errors name
_META = {"inline": "inline meta", "commit": "commit meta"}


def _parts(header: memoryview, at: int, lengths: list[int], what: str) -> Inline:
    n_rid, n_layout, n_tree, n_meta = lengths
    end = at + n_rid + n_layout + n_tree + n_meta
    if end != header.nbytes:
        raise ProtocolError(
            f"{what} header parts add up to {end} B, the header holds {header.nbytes} B"
        )
    try:
        rid = str(header[at : at + n_rid], "utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} header: the request id is not UTF-8") from None
    at += n_rid
    layout = bytes(header[at : at + n_layout])
    at += n_layout
    try:
        tree = decode_json(header[at : at + n_tree], _TREE[what])
        meta = decode_json(header[at + n_tree :], _META[what]) if n_meta else None
    except CodecError as exc:
        raise ProtocolError(str(exc)) from None
    if meta is not None and type(meta) is not dict:
        raise ProtocolError("relay message: 'meta' must be an object")
    return Inline(rid, layout, tree, meta)


class Layout:
    """One validated layout: its `manifest` (no tree), `nbytes`, and the `reader` that views
    its tensors in a slot's bytes (layout.py `SlotReader`), both worked out once."""

    __slots__ = ("manifest", "nbytes", "reader")

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.nbytes = manifest.nbytes
        self.reader = SlotReader(manifest)

    def with_tree(self, tree: Any) -> Manifest:
        """The whole manifest of a message that carries this layout with `tree`."""
        m = self.manifest
        return Manifest(tree, m.tensors, m.offsets, m.nbytes)


class LayoutCache:
    """The last few layouts a lane validated, by their exact bytes (bounded: at most
    LAYOUT_CACHE_ENTRIES of at most MAX_CACHED_LAYOUT_BYTES each), for slots of at most
    `slot_size` bytes (an inline message's largest, unless told)."""

    def __init__(self, slot_size: int = MAX_INLINE_MESSAGE_BYTES) -> None:
        self.slot_size = slot_size
        self._layouts: dict[bytes, Layout] = {}

    def __len__(self) -> int:
        return len(self._layouts)

    def layout(self, layout: bytes) -> Layout:
        """`layout` validated as `Manifest.from_json` does for a slot of `slot_size` bytes
        (the caller checks its nbytes against the slot it has: an inline message's data, a
        commit's granted slot); CodecError naming what is wrong."""
        known = self._layouts.get(layout)
        if known is None:
            doc = decode_json(memoryview(layout), "inline layout")
            if type(doc) is not dict or "tree" in doc:
                raise CodecError("inline layout: expected an object without a tree")
            known = Layout(Manifest.from_json(doc, slot_size=self.slot_size))
            if len(layout) <= MAX_CACHED_LAYOUT_BYTES:
                if len(self._layouts) >= LAYOUT_CACHE_ENTRIES:
                    del self._layouts[next(iter(self._layouts))]  # the oldest
                self._layouts[layout] = known
        return known
