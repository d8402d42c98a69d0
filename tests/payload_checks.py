"""Assertions on payloads shared by the pool, relay and role tests."""

from __future__ import annotations

from typing import Any

import torch


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (bit-exact comparison: NaN payloads, -0.0, bf16 and fp8 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(got: Any, want: Any, where: str = "payload") -> None:
    """Same containers, same scalars, tensors with the same dtype, shape and bytes."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(raw_bytes(got), raw_bytes(want)), f"{where}: bytes differ"
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_bit_exact(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bit_exact(g, w, f"{where}[{index}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """Every tensor of a payload, depth first."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_of(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_of(v)]
    return []
