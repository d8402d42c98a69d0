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
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from disagg_runtime.codec import CodecError, decode_json, encode_json
from disagg_runtime.manifest import Manifest
from disagg_runtime.relay.protocol import MAX_CONTROL_BYTES, MAX_INLINE_MESSAGE_BYTES, ProtocolError

KIND_INLINE = 1
WIRE_VERSION = 1
FIXED = struct.Struct("<BBHIII")
MAX_RID_BYTES = 0xFFFF
LAYOUT_CACHE_ENTRIES = 32  # per lane: the layouts a sender's payloads take turns in
MAX_CACHED_LAYOUT_BYTES = 4096  # larger layouts are validated every time (bounded memory)


def layout_bytes(manifest: Manifest) -> bytes:
    """A manifest's layout part (everything but the tree), as the wire carries it."""
    doc = manifest.to_json()
    del doc["tree"]
    return encode_json(doc)


def pack(rid: str, layout: bytes, tree: Any, meta: Mapping[str, Any] | None) -> bytes:
    """The header of an inline payload; CodecError when a part is not strict JSON, the rid is
    too long, or the header is over MAX_CONTROL_BYTES (the sender fails, not the receiver)."""
    rid_bytes = rid.encode("utf-8", "surrogatepass")
    if len(rid_bytes) > MAX_RID_BYTES:
        raise CodecError(f"request id of {len(rid_bytes)} B is over {MAX_RID_BYTES} B")
    tree_bytes = encode_json(tree)
    meta_bytes = b"" if meta is None else encode_json(meta)
    fixed = FIXED.pack(
        KIND_INLINE, WIRE_VERSION, len(rid_bytes), len(layout), len(tree_bytes), len(meta_bytes)
    )
    header = b"".join((fixed, rid_bytes, layout, tree_bytes, meta_bytes))
    if len(header) > MAX_CONTROL_BYTES:
        raise CodecError(
            f"relay inline header would be {len(header)} bytes, over the limit of "
            f"{MAX_CONTROL_BYTES}; move large values into tensors"
        )
    return header


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
    if header.nbytes < FIXED.size:
        raise ProtocolError(f"inline header of {header.nbytes} B is shorter than {FIXED.size} B")
    if header.nbytes > MAX_CONTROL_BYTES:
        raise ProtocolError(f"inline header of {header.nbytes} B is over {MAX_CONTROL_BYTES} B")
    kind, version, n_rid, n_layout, n_tree, n_meta = FIXED.unpack_from(header)
    if kind != KIND_INLINE:
        raise ProtocolError(f"unknown binary header kind {kind}")
    if version != WIRE_VERSION:
        raise ProtocolError(f"unsupported inline header version {version}")
    end = FIXED.size + n_rid + n_layout + n_tree + n_meta
    if end != header.nbytes:
        raise ProtocolError(
            f"inline header parts add up to {end} B, the header holds {header.nbytes} B"
        )
    at = FIXED.size
    try:
        rid = str(header[at : at + n_rid], "utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("inline header: the request id is not UTF-8") from None
    at += n_rid
    layout = bytes(header[at : at + n_layout])
    at += n_layout
    try:
        tree = decode_json(header[at : at + n_tree], "inline tree")
        meta = decode_json(header[at + n_tree :], "inline meta") if n_meta else None
    except CodecError as exc:
        raise ProtocolError(str(exc)) from None
    if meta is not None and type(meta) is not dict:
        raise ProtocolError("relay message: 'meta' must be an object")
    return Inline(rid, layout, tree, meta)


class LayoutCache:
    """The last few layouts a lane validated, by their exact bytes (bounded: at most
    LAYOUT_CACHE_ENTRIES of at most MAX_CACHED_LAYOUT_BYTES each)."""

    def __init__(self) -> None:
        self._layouts: dict[bytes, Manifest] = {}

    def __len__(self) -> int:
        return len(self._layouts)

    def manifest(self, layout: bytes, tree: Any) -> Manifest:
        """The manifest of `layout` with `tree`: validated as `Manifest.from_json` does for
        any inline slot (the caller checks the data's length against its nbytes)."""
        known = self._layouts.get(layout)
        if known is None:
            doc = decode_json(memoryview(layout), "inline layout")
            if type(doc) is not dict or "tree" in doc:
                raise CodecError("inline layout: expected an object without a tree")
            known = Manifest.from_json(doc, slot_size=MAX_INLINE_MESSAGE_BYTES)
            if len(layout) <= MAX_CACHED_LAYOUT_BYTES:
                if len(self._layouts) >= LAYOUT_CACHE_ENTRIES:
                    del self._layouts[next(iter(self._layouts))]  # the oldest
                self._layouts[layout] = known
        return Manifest(tree, known.tensors, known.offsets, known.nbytes)
