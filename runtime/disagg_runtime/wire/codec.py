"""Payload codec: nested Python values holding tensors <-> ``[header, *buffers]`` frames.

Wire format -- one message is ``1 + N`` frames::

    frame 0       UTF-8 JSON header (strict: no NaN/Infinity, no duplicate keys)
                  {"v": 1,
                   "tree": <the payload, each tensor replaced by {"t": i}>,
                   "tensors": [{"dtype": "bfloat16", "shape": [2, 3]}, ...]}
    frame 1..N    raw bytes of tensor i = frame - 1: C-contiguous, native byte order,
                  exactly prod(shape) * itemsize bytes

Tree encoding: JSON null / bool / int / str and finite floats stand for themselves;
everything else is an object with exactly one tag key::

    {"t": i}  tensor i          {"d": {...}}  dict (str keys)
    {"l": [...]}  list          {"u": [...]}  tuple
    {"b": "<base64>"}  small bytes (<= MAX_BYTES_VALUE)
    {"f": "nan" | "inf" | "-inf"}  non-finite float

Why this shape: tensor bytes never pass through a serializer. ``tensor_bytes`` hands out
memoryviews of the tensors' own memory and ``tensor_from_buffer`` builds tensors that view
the received frames, so a transport can move them without copies. The header is data,
never code -- no pickle, no ``torch.load``, no ``eval`` -- dtypes come from a fixed
allow-list, and every frame count, size, shape and tensor index is checked against the
header before any tensor is built. Every failure is a :class:`CodecError`.

Relays do not send this whole format: they write tensors into pool slots and send a
manifest (manifest.py) in their control header, with the tree of ``flatten``; the header
frame, dtypes and tree rules here are what they share. ``encode``/``decode`` of whole
messages are the benchmarks' naive baselines' (bench/frames.py).
"""

from __future__ import annotations

import base64
import json
import math
import reprlib
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

FORMAT_VERSION: int = 1
MAX_HEADER_BYTES: int = 1 << 20
MAX_DEPTH: int = 64
MAX_NDIM: int = 32
MAX_BYTES_VALUE: int = 64 * 1024

_MAX_TENSOR_BYTES = 1 << 48
_MAX_BYTES_VALUE_B64 = 4 * ((MAX_BYTES_VALUE + 2) // 3)
_META_KEYS = frozenset({"dtype", "shape"})
_SPECIAL_FLOATS: Mapping[str, float] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class CodecError(ValueError):
    """A payload or message that cannot be encoded or decoded; the message says what and where."""


DTYPES: Mapping[str, torch.dtype] = types.MappingProxyType(
    {
        "bool": torch.bool,
        "uint8": torch.uint8,
        "int8": torch.int8,
        "int16": torch.int16,
        "int32": torch.int32,
        "int64": torch.int64,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float64": torch.float64,
        "complex64": torch.complex64,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
    }
)
_NAMES: Mapping[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlist = _repr.maxdict = 6
_repr.maxlevel = 3


def _short(value: object) -> str:
    """A bounded ``repr`` for error messages (attacker-sized values stay short)."""
    try:
        return _repr.repr(value)
    except Exception:  # e.g. ints too long to print
        return f"<{type(value).__name__}>"


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of an allowed dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        raise CodecError(
            f"unsupported dtype {_short(dtype)}; allowed: {', '.join(DTYPES)}"
        ) from None


def dtype_from_name(name: object) -> torch.dtype:
    """The allowed dtype called ``name``; anything else (incl. non-strings) is an error."""
    if type(name) is str:
        dtype = DTYPES.get(name)
        if dtype is not None:
            return dtype
    raise CodecError(f"unsupported dtype {_short(name)}; allowed: {', '.join(DTYPES)}")


def _check_shape(dtype: torch.dtype, shape: Sequence[object], where: str) -> None:
    if len(shape) > MAX_NDIM:
        raise CodecError(f"{where}: {len(shape)} dimensions, more than the limit of {MAX_NDIM}")
    span = dtype.itemsize
    for i, dim in enumerate(shape):
        if type(dim) is not int:
            raise CodecError(f"{where}: shape[{i}] is {_short(dim)}, not an int")
        if dim < 0:
            raise CodecError(f"{where}: shape[{i}] is negative ({dim})")
        # Bounding the product of all non-zero dims also bounds strides and numel.
        span *= max(dim, 1)
        if span > _MAX_TENSOR_BYTES:
            raise CodecError(
                f"{where}: shape {_short(list(shape))} of {dtype_name(dtype)} "
                f"spans more than 2**48 bytes"
            )


def check_keys(
    obj: Mapping[str, Any], required: frozenset[str], allowed: frozenset[str], where: str
) -> None:
    missing = required - obj.keys()
    if missing:
        raise CodecError(f"{where}: missing key(s) {sorted(missing)}")
    unknown = obj.keys() - allowed
    if unknown:
        raise CodecError(f"{where}: unknown key(s) {_short(sorted(unknown))}")


@dataclass(frozen=True)
class TensorMeta:
    """What the header says about one tensor: its dtype and shape (validated on creation)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        if type(self.shape) is not tuple:
            raise CodecError(f"TensorMeta: shape must be a tuple, got {type(self.shape).__name__}")
        _check_shape(self.dtype, self.shape, "TensorMeta")

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        """``{"dtype": "bfloat16", "shape": [2, 3]}``."""
        return {"dtype": dtype_name(self.dtype), "shape": list(self.shape)}

    @classmethod
    def _checked(cls, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorMeta:
        """Build one whose fields were validated already (skips ``__post_init__``)."""
        meta = object.__new__(cls)
        object.__setattr__(meta, "dtype", dtype)
        object.__setattr__(meta, "shape", shape)
        return meta

    @classmethod
    def from_json(
        cls, obj: object, *, where: str = "tensor", keys: frozenset[str] = _META_KEYS
    ) -> TensorMeta:
        """Parse and validate a header entry; errors name ``where`` and the problem.
        ``keys``: the keys the entry may have (dtype and shape, plus a container's own)."""
        if type(obj) is not dict:
            raise CodecError(
                f"{where}: expected an object with 'dtype' and 'shape', got {type(obj).__name__}"
            )
        if obj.keys() != keys:
            check_keys(obj, _META_KEYS, keys, where)
        try:
            dtype = dtype_from_name(obj["dtype"])
        except CodecError as exc:
            raise CodecError(f"{where}.dtype: {exc}") from None
        shape = obj["shape"]
        if type(shape) is not list:
            raise CodecError(f"{where}.shape: expected a list of ints, got {type(shape).__name__}")
        _check_shape(dtype, shape, f"{where}.shape")
        return cls._checked(dtype, tuple(shape))

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        """The meta of an existing tensor (its dtype must be allowed)."""
        shape = tuple(t.shape)  # a real tensor's sizes are ints within memory's bounds
        if t.dtype not in _NAMES or len(shape) > MAX_NDIM:
            return cls(t.dtype, shape)  # the validating constructor says what is wrong
        return cls._checked(t.dtype, shape)


class _NodeError(Exception):
    """Internal: a failure deep in a tree; keys are collected while unwinding (zero-cost path)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg
        self.keys: list[object] = []

    def codec_error(self) -> CodecError:
        path = "payload" + "".join(f"[{_short(k)}]" for k in reversed(self.keys))
        return CodecError(f"{path}: {self.msg}")


def _wire_tensor(t: torch.Tensor, keep_device: bool) -> torch.Tensor:
    """``t`` as a detached, contiguous CPU tensor, copying only when it must (with
    ``keep_device``, a GPU tensor is returned detached but otherwise as it is)."""
    if t.layout != torch.strided:
        raise _NodeError(f"unsupported tensor layout {t.layout}")
    if t.dtype not in _NAMES:
        raise _NodeError(f"unsupported dtype {t.dtype}; allowed: {', '.join(DTYPES)}")
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        if t.is_meta:
            raise _NodeError("a meta tensor has no data to send")
        if keep_device and t.is_cuda:
            return t
        t = t.contiguous().cpu()  # compact on the device, then one device-to-host copy
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


# leaves that stand for themselves in a tree, exactly as `_flatten` returns them (their
# subclasses, and non-finite floats, take the general path): a container takes these
# and plain tensors without a call per item, the most of a small payload's flattening
_PLAIN = frozenset({str, int, bool, type(None)})


def _leaf(obj: Any, tensors: list[torch.Tensor], keep_device: bool) -> Any:
    """The tree node of anything but a container (a dict, list or tuple)."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        return {"f": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, torch.Tensor):
        tensors.append(_wire_tensor(obj, keep_device))
        return {"t": len(tensors) - 1}
    if isinstance(obj, bytes):
        if len(obj) > MAX_BYTES_VALUE:
            raise _NodeError(
                f"bytes value of {len(obj)} bytes is over the limit of "
                f"{MAX_BYTES_VALUE}; send it as a uint8 tensor"
            )
        return {"b": base64.b64encode(obj).decode("ascii")}
    raise _NodeError(f"unsupported type {type(obj).__name__}")


_CONTAINERS = frozenset({dict, list, tuple})


def _flatten(
    obj: Any, depth: int, max_depth: int, tensors: list[torch.Tensor], keep_device: bool
) -> Any:
    # a container (a payload is one, most often) skips the leaf checks; no type is both
    if type(obj) not in _CONTAINERS and not isinstance(obj, (dict, list, tuple)):
        return _leaf(obj, tensors, keep_device)
    if depth >= max_depth:
        raise _NodeError(f"nested deeper than the limit of {max_depth} containers")
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise _NodeError(
                    f"dict key {_short(key)} is {type(key).__name__}; only str keys are allowed"
                )
            kind = type(value)
            if kind in _PLAIN or (kind is float and math.isfinite(value)):
                out[key] = value
                continue
            try:
                if kind is torch.Tensor:
                    tensors.append(_wire_tensor(value, keep_device))
                    out[key] = {"t": len(tensors) - 1}
                else:
                    out[key] = _flatten(value, depth + 1, max_depth, tensors, keep_device)
            except _NodeError as exc:
                exc.keys.append(key)
                raise
        return {"d": out}
    items: list[Any] = []
    for i, value in enumerate(obj):
        kind = type(value)
        if kind in _PLAIN or (kind is float and math.isfinite(value)):
            items.append(value)
            continue
        try:
            if kind is torch.Tensor:
                tensors.append(_wire_tensor(value, keep_device))
                items.append({"t": len(tensors) - 1})
            else:
                items.append(_flatten(value, depth + 1, max_depth, tensors, keep_device))
        except _NodeError as exc:
            exc.keys.append(i)
            raise
    return {"u" if isinstance(obj, tuple) else "l": items}


def flatten(
    payload: Any, *, max_depth: int = MAX_DEPTH, keep_device: bool = False
) -> tuple[Any, list[torch.Tensor]]:
    """Split ``payload`` into a JSON-able tree and the tensors it references, in order.

    Contiguous CPU tensors are returned as is (zero copy); others are made contiguous /
    moved to the CPU once, except that ``keep_device`` leaves GPU tensors where (and as
    strided as) they are, for callers that copy them once straight to their destination.
    ``max_depth`` bounds how many containers may nest.
    """
    tensors: list[torch.Tensor] = []
    try:
        tree = _flatten(payload, 0, max_depth, tensors, keep_device)
    except _NodeError as exc:
        raise exc.codec_error() from None
    except RecursionError:
        raise CodecError("payload: nested too deeply for the Python stack") from None
    return tree, tensors


_SCALARS = frozenset({bool, int, float, str})  # tree leaves that stand for themselves


def _unflatten(
    node: Any, depth: int, max_depth: int, used: bytearray, leaf: Callable[[int], Any]
) -> Any:
    if node is None or type(node) in _SCALARS:
        return node
    if type(node) is not dict or len(node) != 1:
        raise _NodeError(
            f"bad tree node {_short(node)}: expected a JSON scalar or an object with one tag"
        )
    ((tag, body),) = node.items()
    if tag == "t":
        if type(body) is not int:
            raise _NodeError(f"tensor index {_short(body)} is not an int")
        if not 0 <= body < len(used):
            raise _NodeError(f"tensor index {body} out of range (message has {len(used)})")
        if used[body]:
            raise _NodeError(f"tensor index {body} used more than once")
        used[body] = 1
        return leaf(body)
    if tag in ("d", "l", "u"):
        if depth >= max_depth:
            raise _NodeError(f"nested deeper than the limit of {max_depth} containers")
        if tag == "d":
            if type(body) is not dict:
                raise _NodeError(f"'d' node holds {type(body).__name__}, expected an object")
            out: dict[str, Any] = {}
            for key, value in body.items():
                try:
                    out[key] = _unflatten(value, depth + 1, max_depth, used, leaf)
                except _NodeError as exc:
                    exc.keys.append(key)
                    raise
            return out
        if type(body) is not list:
            raise _NodeError(f"{tag!r} node holds {type(body).__name__}, expected a list")
        items: list[Any] = []
        for i, value in enumerate(body):
            try:
                items.append(_unflatten(value, depth + 1, max_depth, used, leaf))
            except _NodeError as exc:
                exc.keys.append(i)
                raise
        return tuple(items) if tag == "u" else items
    if tag == "b":
        if type(body) is not str:
            raise _NodeError(f"'b' node holds {type(body).__name__}, expected a base64 string")
        if len(body) > _MAX_BYTES_VALUE_B64:
            raise _NodeError(f"bytes value is over the limit of {MAX_BYTES_VALUE} bytes")
        try:
            return base64.b64decode(body, validate=True)
        except ValueError:  # binascii.Error, or non-ASCII text
            raise _NodeError(f"'b' node holds invalid base64 {_short(body)}") from None
    if tag == "f":
        value = _SPECIAL_FLOATS.get(body) if type(body) is str else None
        if value is None:
            raise _NodeError(f"'f' node holds {_short(body)}, expected 'nan', 'inf' or '-inf'")
        return value
    raise _NodeError(f"unknown tree tag {_short(tag)}")


def _rebuild(tree: Any, count: int, leaf: Callable[[int], Any], max_depth: int) -> Any:
    used = bytearray(count)
    try:
        result = _unflatten(tree, 0, max_depth, used, leaf)
    except _NodeError as exc:
        raise exc.codec_error() from None
    except RecursionError:
        raise CodecError("payload: nested too deeply for the Python stack") from None
    if count and not all(used):
        unused = [i for i, flag in enumerate(used) if not flag]
        raise CodecError(f"payload: tree never references tensor(s) {_short(unused)}")
    return result


def check_tree(tree: Any, count: int, *, max_depth: int = MAX_DEPTH) -> None:
    """Validate a tree for `count` tensors (as `unflatten` does) before any tensor exists."""
    _rebuild(tree, count, lambda i: None, max_depth)


def unflatten(tree: Any, tensors: Sequence[torch.Tensor], *, max_depth: int = MAX_DEPTH) -> Any:
    """Inverse of :func:`flatten`; validates the whole tree (tags, types, indices, depth).

    Each tensor must be referenced exactly once. Tuples come back as tuples.
    """
    if (
        max_depth > 0
        and type(tree) is dict
        and len(tree) == 1
        and type(body := tree.get("d")) is dict
    ):
        # the common payload, a dict of tensors and JSON scalars, in one loop (no call per
        # value): what _rebuild returns for it; anything else, or wrong, goes to _rebuild
        out: dict[str, Any] = {}
        count = len(tensors)
        used = 0  # a bit per tensor referenced
        for key, value in body.items():
            if value is None or type(value) in _SCALARS:
                out[key] = value
                continue
            index = value.get("t") if type(value) is dict and len(value) == 1 else None
            if type(index) is not int or not 0 <= index < count or used >> index & 1:
                break
            used |= 1 << index
            out[key] = tensors[index]
        else:
            if used == (1 << count) - 1:
                return out
    return _rebuild(tree, len(tensors), tensors.__getitem__, max_depth)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy flat byte view (format ``'B'``) of a contiguous CPU tensor's memory.

    The view keeps the tensor's storage alive.
    """
    if t.layout != torch.strided or t.device.type != "cpu":
        raise CodecError(f"tensor_bytes needs a strided CPU tensor, got {t.layout} on {t.device}")
    if not t.is_contiguous():
        raise CodecError("tensor_bytes needs a contiguous tensor; call .contiguous() first")
    if t.is_conj() or t.is_neg():
        raise CodecError("tensor_bytes: tensor has a lazy conj/neg bit; resolve it first")
    flat = t.detach().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def byte_view(buf: Any, where: str) -> memoryview:
    """A flat ``'B'`` memoryview of a buffer-protocol object or a ``zmq.Frame``."""
    if not isinstance(buf, (bytes, bytearray, memoryview)) and hasattr(buf, "buffer"):
        buf = buf.buffer  # zmq.Frame
    try:
        view = memoryview(buf)
    except TypeError:
        raise CodecError(f"{where}: {type(buf).__name__} is not a bytes-like buffer") from None
    if not view.c_contiguous:
        raise CodecError(f"{where}: buffer is not C-contiguous")
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except (TypeError, ValueError):
            raise CodecError(f"{where}: cannot view the buffer as bytes") from None
    return view


_readonly_warning_seen = False


def tensor_from_buffer(buf: Any, meta: TensorMeta, *, copy: bool = False) -> torch.Tensor:
    """A tensor of ``meta``'s dtype and shape that views ``buf`` (copies only if ``copy``).

    The buffer must hold exactly ``meta.nbytes`` bytes. A tensor viewing a read-only
    buffer must not be written to.
    """
    view = byte_view(buf, "buffer")
    if view.nbytes != meta.nbytes:
        raise CodecError(
            f"buffer holds {view.nbytes} bytes, but {dtype_name(meta.dtype)} "
            f"{list(meta.shape)} needs {meta.nbytes}"
        )
    if meta.nbytes == 0:
        return torch.empty(meta.shape, dtype=meta.dtype)
    global _readonly_warning_seen
    if view.readonly and not _readonly_warning_seen:
        # torch warns about read-only buffers once per process (TORCH_WARN_ONCE): swallow
        # that one warning, then skip the costly catch_warnings on the hot path
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable", category=UserWarning)
            flat = torch.frombuffer(view, dtype=meta.dtype)
        _readonly_warning_seen = True
    else:
        flat = torch.frombuffer(view, dtype=meta.dtype)
    if meta.dtype == torch.bool and bool((flat.view(torch.uint8) > 1).any()):
        raise CodecError("bool tensor data holds bytes other than 0 and 1")
    t = flat if len(meta.shape) == 1 else flat.view(meta.shape)  # 1-D: already that shape
    return t.clone() if copy else t


def _reject_constant(name: str) -> Any:
    raise CodecError(f"header JSON contains {name}, which strict JSON does not allow")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise CodecError(f"header JSON repeats the key {_short(key)}")
            seen.add(key)
    return out


# built once: json.dumps / json.loads with options build a new coder on every call (and
# JSONEncoder.encode its C encoder): headers are on the latency path of every message
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=True)
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
_SCAN: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]
_make_c_encoder = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODE: Callable[[Any, int], tuple[str, ...]] | None = (
    # no cycle markers: a cyclic header ends in RecursionError, reported like other errors
    _make_c_encoder(
        None,
        _ENCODER.default,
        json.encoder.encode_basestring_ascii,
        None,
        ":",
        ",",
        False,
        False,
        False,
    )
    if _make_c_encoder is not None
    else None
)


def encode_header(obj: Mapping[str, Any]) -> bytes:
    """Compact strict JSON (no NaN/Infinity), UTF-8 (in fact ASCII: non-ASCII is escaped)."""
    return encode_json(obj if type(obj) is dict else dict(obj), "header")


def encode_json(value: Any, what: str = "value") -> bytes:
    """Any JSON value as compact strict JSON, ASCII; CodecError naming `what` if it is not."""
    try:
        text = "".join(_C_ENCODE(value, 0)) if _C_ENCODE else _ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise CodecError(f"{what} is not strict JSON: {exc}") from None
    return text.encode("ascii")


def decode_json(view: memoryview, what: str) -> Any:
    """Strict JSON (UTF-8, no NaN/Infinity, no repeated keys) -> any JSON value;
    CodecError naming `what`. The caller bounds the size."""
    try:
        text = str(view, "utf-8")
    except UnicodeDecodeError as exc:
        raise CodecError(f"{what} is not UTF-8: {exc.reason} at byte {exc.start}") from None
    try:  # the scanner alone (C) when the text is one value, no whitespace around it
        value, end = _SCAN(text, 0)
        if end == len(text):
            return value
    except Exception:  # decoded again below, which says what is wrong
        pass
    try:
        return _DECODER.decode(text)
    except CodecError:
        raise
    except RecursionError:
        raise CodecError(f"{what} JSON is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an int with too many digits
        raise CodecError(f"{what} is not valid JSON: {exc}") from None


def loads_strict(text: str) -> Any:
    """Strict JSON text -> any value, for callers that report where text is wrong (the
    gateway's request bodies): json.JSONDecodeError (with line and column) for bad syntax,
    CodecError for NaN/Infinity or a repeated key. `decode_json` is the wire's version."""
    return _DECODER.decode(text)


def payload_nbytes(value: Any) -> int:
    """Tensor bytes in a payload tree (anything with `numel` and `element_size` counts)."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.numel() * value.element_size())
    if isinstance(value, dict):
        return sum(payload_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_nbytes(v) for v in value)
    return 0


def decode_header(frame: Any, *, max_bytes: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    """Parse a header frame: size limit checked first, then UTF-8, JSON object, version."""
    view = byte_view(frame, "header frame")
    if view.nbytes > max_bytes:
        raise CodecError(f"header frame is {view.nbytes} bytes, over the limit of {max_bytes}")
    obj = decode_json(view, "header frame")
    if type(obj) is not dict:
        raise CodecError(f"header must be a JSON object, got {type(obj).__name__}")
    if "v" not in obj:
        raise CodecError("unsupported format version: header has no 'v'")
    version = obj["v"]
    if type(version) is not int or version != FORMAT_VERSION:
        raise CodecError(
            f"unsupported format version {_short(version)}; this codec reads {FORMAT_VERSION}"
        )
    return obj
