"""Whole payloads as self-contained ZMQ messages, ``[header, *tensor buffers]``: the message
format of the benchmarks' naive baselines (bench/transport.py, bench/peer.py), built from
the wire's parts (wire/codec.py: header frame, dtypes; wire/tree.py: trees). Relays never
send it: they write tensors into pool slots and send a manifest.

    frame 0       {"v": 1, "tree": <the payload, tensor i as {"t": i}>,
                   "tensors": [{"dtype": "bfloat16", "shape": [2, 3]}, ...]}
    frame 1..N    raw bytes of tensor i = frame - 1 (C-contiguous, native byte order)

``encode`` hands out memoryviews of the tensors' own memory and ``decode`` builds tensors
that view the received frames (no copies). Frame count, every tensor meta, every frame size
and the whole tree are checked before any tensor is built; every failure is a CodecError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from disagg_runtime.wire.codec import (
    FORMAT_VERSION,
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    CodecError,
    TensorMeta,
    byte_view,
    check_keys,
    decode_header,
    dtype_name,
    encode_header,
    tensor_bytes,
    tensor_from_buffer,
)
from disagg_runtime.wire.tree import check_tree, flatten, unflatten

_HEADER_KEYS = frozenset({"v", "tree", "tensors"})


def payload_header(tree: Any, metas: Sequence[TensorMeta]) -> bytes:
    """Frame 0 of a flattened payload; CodecError when it is over MAX_HEADER_BYTES (the
    sender fails rather than the receiver)."""
    header = encode_header(
        {"v": FORMAT_VERSION, "tree": tree, "tensors": [meta.to_json() for meta in metas]}
    )
    if len(header) > MAX_HEADER_BYTES:
        raise CodecError(
            f"header would be {len(header)} bytes, over the limit of {MAX_HEADER_BYTES}; "
            "move large values into tensors"
        )
    return header


def encode(payload: Any) -> list[memoryview | bytes]:
    """``[header, *tensor buffers]``; the buffers view the tensors' memory (no copies)."""
    tree, tensors = flatten(payload)
    header = payload_header(tree, [TensorMeta.of(t) for t in tensors])
    frames: list[memoryview | bytes] = [header]
    frames.extend(tensor_bytes(t) for t in tensors)
    return frames


def decode(
    frames: Sequence[Any],
    *,
    copy: bool = False,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """Inverse of :func:`encode` for bytes / memoryview / ``zmq.Frame`` frames.

    Frame count, every tensor meta, every frame size and the whole tree are checked
    before any tensor is built. Tensors view the frames unless ``copy`` is true.
    """
    if len(frames) == 0:
        raise CodecError("message has no frames; expected at least a header frame")
    header = decode_header(frames[0], max_bytes=max_header_bytes)
    check_keys(header, _HEADER_KEYS, _HEADER_KEYS, "header")
    specs = header["tensors"]
    if type(specs) is not list:
        raise CodecError(f"header 'tensors' must be a list, got {type(specs).__name__}")
    if len(frames) != 1 + len(specs):
        raise CodecError(
            f"header describes {len(specs)} tensor(s), so the message needs "
            f"{1 + len(specs)} frames; got {len(frames)}"
        )
    metas = [TensorMeta.from_json(spec, where=f"tensors[{i}]") for i, spec in enumerate(specs)]
    views: list[memoryview] = []
    for i, meta in enumerate(metas):
        view = byte_view(frames[i + 1], f"frame {i + 1}")
        if view.nbytes != meta.nbytes:
            raise CodecError(
                f"frame {i + 1} holds {view.nbytes} bytes, but tensors[{i}] "
                f"({dtype_name(meta.dtype)} {list(meta.shape)}) needs {meta.nbytes}"
            )
        views.append(view)
    tree = header["tree"]
    check_tree(tree, len(metas), max_depth=max_depth)  # before building any tensor
    tensors = [tensor_from_buffer(v, m, copy=copy) for v, m in zip(views, metas, strict=True)]
    return unflatten(tree, tensors, max_depth=max_depth)
