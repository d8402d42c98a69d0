"""Hypothesis strategies for payloads (any tree of containers, scalars, bytes and small
tensors of every dtype), shared by the codec and planner property tests."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st

from disagg_runtime.wire.codec import DTYPES


@st.composite
def small_tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of any allowed dtype with up to 3 dims of up to 3, random bytes (a bool's
    0 or 1), sometimes transposed (strided)."""
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    nbytes = math.prod(shape) * dtype.itemsize
    data = bytearray(draw(st.binary(min_size=nbytes, max_size=nbytes)))
    raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw & 1
    t = raw.view(dtype).reshape(shape)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # strided
    return t


def payloads(
    *, max_leaves: int, text: int = 8, binary: int = 16, keys: int = 5
) -> st.SearchStrategy[Any]:
    """Nested lists, tuples and str-keyed dicts (up to 4 items each) of None, bools, ints,
    floats (NaN and infinities too), strings, bytes and small tensors."""
    leaves = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=text)
        | st.binary(max_size=binary)
        | small_tensors()
    )
    return st.recursive(
        leaves,
        lambda children: (
            st.lists(children, max_size=4)
            | st.lists(children, max_size=4).map(tuple)
            | st.dictionaries(st.text(max_size=keys), children, max_size=4)
        ),
        max_leaves=max_leaves,
    )
