"""The native API's two body encodings <-> payloads (nested dicts/lists of tensors and JSON).

JSON (`application/json`)::

    {"inputs": {"image": {"dtype": "uint8", "shape": [3, 64, 64], "data": "<base64>"},
                "prompt": "a fox", "steps": 4}}

An object with exactly the keys `dtype`, `shape` and `data` is a tensor (C order, little
endian, dtypes of the wire allow-list); everything else is JSON as it stands. Answers are
`{"outputs": ...}` the same way (tuples become lists, bytes a uint8 tensor, non-finite
floats the strings "NaN", "Infinity", "-Infinity").

safetensors (`application/vnd.safetensors`): the safetensors format. The body is read
from the socket into reusable memory (gateway/upload.py) and parsed in place: tensors
view it, no further copy (the `safetensors` library writes the answers). A tensor named
`a.b` is `inputs["a"]["b"]`; every metadata entry `a.c` is `inputs["a"]["c"]`, its value
JSON text (text that is not JSON is kept as a string, so `{"format": "pt"}` from
`save_file` is harmless). Answers name list items by index (`frames.0`).

Every failure is an `InputError` whose `path` locates it (`$.inputs.image.shape[1]`).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import TensorSpec as SafeSpec
from safetensors import serialize

from disagg_runtime.wire import codec
from disagg_runtime.wire.manifest import Manifest, layout
from disagg_runtime.wire.tree import flatten

MAX_DEPTH = codec.MAX_DEPTH
TENSOR_KEYS = frozenset({"dtype", "shape", "data"})
SAFETENSORS = "application/vnd.safetensors"
# safetensors dtype names <-> ours (the wire allow-list)
_SAFE_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_NONFINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


class InputError(ValueError):
    """A request body that cannot become a payload; `path` says where (JSON path)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


# ---- JSON -------------------------------------------------------------------------------------
def loads(body: bytes) -> Any:
    """Strict JSON (no NaN, no duplicate keys); errors say line and column."""
    try:
        return codec.loads_strict(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError("$", f"body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} col {exc.colno}"
        raise InputError("$", f"invalid JSON: {exc.msg} ({where})") from None
    except codec.CodecError as exc:  # NaN/Infinity or a duplicate key
        raise InputError("$", str(exc)) from None
    except RecursionError:  # nesting deeper than the decoder's stack
        raise InputError("$", "JSON nested too deeply") from None
    except ValueError as exc:  # an integer over Python's digit limit (sys.int_info)
        raise InputError("$", f"invalid JSON: {str(exc)[:200]}") from None


def request_from_json(doc: Any) -> Any:
    """The entry payload of a native JSON request `{"inputs": ...}`."""
    if not isinstance(doc, dict):
        raise InputError("$", f"expected an object with 'inputs', got {_kind(doc)}")
    unknown = sorted(set(doc) - {"inputs"})
    if unknown:
        raise InputError(f"$.{unknown[0]}", "unknown field (the body is {'inputs': ...})")
    if "inputs" not in doc:
        raise InputError("$.inputs", "required field missing")
    return from_json(doc["inputs"], "$.inputs")


def from_json(value: Any, path: str = "$", depth: int = 0) -> Any:
    """Tensors decoded from `{"dtype", "shape", "data"}` objects; the rest kept."""
    if depth > MAX_DEPTH:
        raise InputError(path, f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        if value.keys() == TENSOR_KEYS:
            return _tensor(value, path)
        return {k: from_json(v, _key(path, k), depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    return value


def _tensor(obj: dict[str, Any], path: str) -> torch.Tensor:
    data = obj["data"]
    if not isinstance(data, str):
        raise InputError(f"{path}.data", f"expected a base64 string, got {_kind(data)}")
    try:
        meta = codec.TensorMeta.from_json(
            {"dtype": obj["dtype"], "shape": obj["shape"]}, where=path
        )
    except codec.CodecError as exc:
        where, sep, reason = str(exc).partition(": ")
        if sep and where.startswith(path):
            raise InputError(where, reason) from None
        raise InputError(path, str(exc)) from None
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"{path}.data", f"invalid base64: {exc}") from None
    if len(raw) != meta.nbytes:
        raise InputError(
            f"{path}.data",
            f"{len(raw)} bytes, but {obj['dtype']} {list(meta.shape)} needs {meta.nbytes}",
        )
    try:
        return codec.tensor_from_buffer(bytearray(raw), meta)
    except codec.CodecError as exc:
        raise InputError(f"{path}.data", str(exc)) from None


def to_json(value: Any, depth: int = 0) -> Any:
    """A payload as JSON values (tensors as base64 objects)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"result nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        meta = codec.TensorMeta.of(t)
        data = base64.b64encode(codec.tensor_bytes(t)).decode("ascii") if t.numel() else ""
        return {**meta.to_json(), "data": data}
    if isinstance(value, dict):
        return {str(k): to_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v, depth + 1) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        return {"dtype": "uint8", "shape": [len(raw)], "data": base64.b64encode(raw).decode()}
    if isinstance(value, float) and not math.isfinite(value):
        return _NONFINITE.get(value, "NaN")
    return value


def dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


# ---- safetensors ------------------------------------------------------------------------------
MAX_HEADER = 100 << 20  # the safetensors library's own bound on the JSON header


def request_from_safetensors(body: memoryview | bytes | bytearray) -> Any:
    """The entry payload of a safetensors body (see the module docstring); tensors view
    `body`, which must outlive them."""
    metadata, items = parse_safetensors(body)
    return _tree(metadata, items)


def _tree(metadata: dict[str, str], items: list[tuple[str, Any]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, tensor in items:
        _put(tree, name, tensor)
    for name, text in metadata.items():
        try:
            value: Any = codec.loads_strict(text)
        except (json.JSONDecodeError, codec.CodecError):
            value = text
        _put(tree, name, value)
    return tree


@dataclass(frozen=True)
class Span:
    """One tensor of a safetensors body: bytes [begin, end) of its data section."""

    begin: int
    end: int
    name: str
    meta: codec.TensorMeta


def header_size(prefix: memoryview | bytes | bytearray, length: int) -> int:
    """The JSON header's length, from a body's first 8 bytes (`length`: the whole body's)."""
    if length < 8 or len(prefix) < 8:
        raise InputError("$", f"not a safetensors body: {length} bytes, no header length")
    size = int.from_bytes(prefix[:8], "little")
    if size > min(MAX_HEADER, length - 8):
        raise InputError("$", f"not a safetensors body: header of {size} bytes does not fit")
    return size


def parse_header(
    header: memoryview | bytes | bytearray, data_len: int
) -> tuple[dict[str, str], list[Span]]:
    """(metadata, tensors in data order) of a safetensors JSON header, checked against a
    data section of `data_len` bytes. The format's rules, as the `safetensors` library
    checks them: a JSON object, `data_offsets` that tile the data section exactly (no
    holes, no overlap) and match each tensor's dtype and shape."""
    try:
        doc = codec.loads_strict(bytes(header).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, codec.CodecError) as exc:
        raise InputError("$", f"not a safetensors body: header is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise InputError("$", "not a safetensors body: header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError("$.__metadata__", "safetensors metadata maps names to strings")
    spans: list[Span] = []
    for name, entry in doc.items():
        where = f"$[{json.dumps(name)}]"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise InputError(where, "expected {dtype, shape, data_offsets}")
        dtype = _SAFE_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise InputError(f"{where}.dtype", f"dtype {entry['dtype']!r} is not allowed")
        try:
            meta = codec.TensorMeta.from_json(
                {"dtype": dtype, "shape": entry["shape"]}, where=where
            )
        except codec.CodecError as exc:
            raise InputError(where, str(exc)) from None
        offsets = entry["data_offsets"]
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise InputError(f"{where}.data_offsets", "expected [begin, end], 0 <= begin <= end")
        if offsets[1] - offsets[0] != meta.nbytes:
            raise InputError(
                f"{where}.data_offsets",
                f"{offsets[1] - offsets[0]} bytes, but {dtype} {list(meta.shape)} needs "
                f"{meta.nbytes}",
            )
        spans.append(Span(offsets[0], offsets[1], name, meta))
    spans.sort(key=lambda span: (span.begin, span.end))
    end = 0
    for span in spans:
        if span.begin != end:
            raise InputError(f"$[{json.dumps(span.name)}]", "data_offsets leave a hole or overlap")
        end = span.end
    if end != data_len:
        raise InputError("$", f"data section is {data_len} bytes, the tensors cover {end}")
    return metadata, spans


def parse_safetensors(
    body: memoryview | bytes | bytearray,
) -> tuple[dict[str, str], list[tuple[str, torch.Tensor]]]:
    """(metadata, [(name, tensor)]) of a safetensors buffer, tensors viewing it. The
    `safetensors` library parses only files or copies, hence this reader of memory the
    socket was read into."""
    view = memoryview(body).cast("B")
    size = header_size(view, len(view))
    metadata, spans = parse_header(view[8 : 8 + size], len(view) - 8 - size)
    data = view[8 + size :]
    items = []
    for span in spans:
        try:
            items.append(
                (span.name, codec.tensor_from_buffer(data[span.begin : span.end], span.meta))
            )
        except codec.CodecError as exc:
            raise InputError(f"$[{json.dumps(span.name)}]", str(exc)) from None
    return metadata, items


def slot_layout(metadata: dict[str, str], spans: list[Span]) -> tuple[Manifest, list[int]]:
    """The manifest of the payload a safetensors body makes (`request_from_safetensors`),
    and where in its slot each span's bytes go (in data order): the body's data section
    can then be received straight into a pool slot, with no parse of the tensors after."""
    flat, order = _order(metadata, spans)
    metas = tuple(spans[i].meta for i in order)
    offsets, nbytes = layout(metas)
    at = [0] * len(spans)
    for position, i in enumerate(order):
        at[i] = offsets[position]
    return Manifest(tree=flat, tensors=metas, offsets=offsets, nbytes=nbytes), at


def data_starts(metadata: dict[str, str], spans: list[Span]) -> list[int]:
    """Where each tensor of `slot_layout`'s manifest begins in the body's data section
    (manifest order): the bytes of a tcp transfer are sent from there as they come."""
    return [spans[i].begin for i in _order(metadata, spans)[1]]


def _order(metadata: dict[str, str], spans: list[Span]) -> tuple[Any, list[int]]:
    """The flattened tree of the payload, and which span each of its tensors is."""
    # placeholders that say which span they stand for, wherever flattening puts them
    tree = _tree(metadata, [(s.name, torch.tensor([i])) for i, s in enumerate(spans)])
    try:
        flat, placeholders = flatten(tree)
    except codec.CodecError as exc:
        raise InputError("$", str(exc)) from None
    return flat, [int(t) for t in placeholders]  # manifest position -> span


def _put(tree: dict[str, Any], name: str, value: Any) -> None:
    parts = name.split(".")
    if not all(parts) or len(parts) > MAX_DEPTH:
        raise InputError(f"$[{json.dumps(name)}]", "keys are non-empty dotted paths")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise InputError(f"$[{json.dumps(name)}]", f"{where!r} is already a value")
        node = child
    if parts[-1] in node:
        raise InputError(f"$[{json.dumps(name)}]", "given twice (as a tensor and metadata?)")
    node[parts[-1]] = value


def to_safetensors(value: Any) -> bytes:
    """A payload as a safetensors file: tensors by dotted path, the rest as JSON metadata."""
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for name, leaf in _leaves(value, ""):
        if isinstance(leaf, torch.Tensor):
            tensors[name or "value"] = leaf.detach().cpu().contiguous()
        else:
            metadata[name or "value"] = dumps(to_json(leaf)).decode()
    specs = {
        name: SafeSpec(
            dtype=codec.dtype_name(t.dtype),
            shape=list(t.shape),
            data_ptr=t.data_ptr(),
            data_len=t.numel() * t.element_size(),
        )
        for name, t in tensors.items()
    }
    return bytes(serialize(specs, metadata=metadata or None))  # tensors stay alive above


def _leaves(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, (list, tuple)) and _has_tensor(value):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, value


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _key(path: str, key: str) -> str:
    plain = key.isidentifier()
    return f"{path}.{key}" if plain else f"{path}[{json.dumps(key)}]"


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__
