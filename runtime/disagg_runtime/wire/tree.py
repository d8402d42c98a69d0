"""Payload trees: nested Python values holding tensors <-> a JSON-able tree and the tensors
it references, in order (`flatten`, `unflatten`). What every relay's manifest and the
baselines' whole messages (bench/frames.py) carry; the codec (wire/codec.py) has the
dtypes, tensor metas and buffers and the strict JSON around it.

JSON null / bool / int / str and finite floats stand for themselves; everything else is
an object with exactly one tag key::

    {"t": i}  tensor i          {"d": {...}}  dict (str keys)
    {"l": [...]}  list          {"u": [...]}  tuple
    {"b": "<base64>"}  small bytes (<= MAX_BYTES_VALUE)
    {"f": "nan" | "inf" | "-inf"}  non-finite float

Every tensor is referenced exactly once; nesting is bounded (`max_depth`); every failure
is a CodecError naming the path (`payload["a"][2]: ...`).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from disagg_runtime.wire.codec import (
    DTYPES,
    MAX_BYTES_VALUE,
    MAX_DEPTH,
    CodecError,
    short,
)

_ALLOWED = frozenset(DTYPES.values())
_MAX_BYTES_VALUE_B64 = 4 * ((MAX_BYTES_VALUE + 2) // 3)
_SPECIAL_FLOATS: Mapping[str, float] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class _NodeError(Exception):
    """Internal: a failure deep in a tree; keys are collected while unwinding (zero-cost path)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg
        self.keys: list[object] = []

    def codec_error(self) -> CodecError:
        path = "payload" + "".join(f"[{short(k)}]" for k in reversed(self.keys))
        return CodecError(f"{path}: {self.msg}")


def _wire_tensor(t: torch.Tensor, keep_device: bool) -> torch.Tensor:
    """``t`` as a detached, contiguous CPU tensor, copying only when it must (with
    ``keep_device``, a GPU tensor is returned detached but otherwise as it is)."""
    if t.layout != torch.strided:
        raise _NodeError(f"unsupported tensor layout {t.layout}")
    if t.dtype not in _ALLOWED:
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
                    f"dict key {short(key)} is {type(key).__name__}; only str keys are allowed"
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
            f"bad tree node {short(node)}: expected a JSON scalar or an object with one tag"
        )
    ((tag, body),) = node.items()
    if tag == "t":
        if type(body) is not int:
            raise _NodeError(f"tensor index {short(body)} is not an int")
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
            raise _NodeError(f"'b' node holds invalid base64 {short(body)}") from None
    if tag == "f":
        value = _SPECIAL_FLOATS.get(body) if type(body) is str else None
        if value is None:
            raise _NodeError(f"'f' node holds {short(body)}, expected 'nan', 'inf' or '-inf'")
        return value
    raise _NodeError(f"unknown tree tag {short(tag)}")


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
        raise CodecError(f"payload: tree never references tensor(s) {short(unused)}")
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
