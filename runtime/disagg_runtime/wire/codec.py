"""Payload codec: dtypes, tensor metas and buffers, and the strict JSON of headers.

Wire format -- one message is ``1 + N`` frames::

    frame 0       UTF-8 JSON header (strict: no NaN/Infinity, no duplicate keys)
                  {"v": 1,
                   "tree": <the payload, each tensor replaced by {"t": i}>,
                   "tensors": [{"dtype": "bfloat16", "shape": [2, 3]}, ...]}
    frame 1..N    raw bytes of tensor i = frame - 1: C-contiguous, native byte order,
                  exactly prod(shape) * itemsize bytes

The tree (frame 0's "tree") is wire/tree.py's: `flatten` and `unflatten`.

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
_META_KEYS = frozenset({"dtype", "shape"})


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


def short(value: object) -> str:
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
            f"unsupported dtype {short(dtype)}; allowed: {', '.join(DTYPES)}"
        ) from None


def dtype_from_name(name: object) -> torch.dtype:
    """The allowed dtype called ``name``; anything else (incl. non-strings) is an error."""
    if type(name) is str:
        dtype = DTYPES.get(name)
        if dtype is not None:
            return dtype
    raise CodecError(f"unsupported dtype {short(name)}; allowed: {', '.join(DTYPES)}")


def _check_shape(dtype: torch.dtype, shape: Sequence[object], where: str) -> None:
    if len(shape) > MAX_NDIM:
        raise CodecError(f"{where}: {len(shape)} dimensions, more than the limit of {MAX_NDIM}")
    span = dtype.itemsize
    for i, dim in enumerate(shape):
        if type(dim) is not int:
            raise CodecError(f"{where}: shape[{i}] is {short(dim)}, not an int")
        if dim < 0:
            raise CodecError(f"{where}: shape[{i}] is negative ({dim})")
        # Bounding the product of all non-zero dims also bounds strides and numel.
        span *= max(dim, 1)
        if span > _MAX_TENSOR_BYTES:
            raise CodecError(
                f"{where}: shape {short(list(shape))} of {dtype_name(dtype)} "
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
        raise CodecError(f"{where}: unknown key(s) {short(sorted(unknown))}")


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
                raise CodecError(f"header JSON repeats the key {short(key)}")
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
            f"unsupported format version {short(version)}; this codec reads {FORMAT_VERSION}"
        )
    return obj
