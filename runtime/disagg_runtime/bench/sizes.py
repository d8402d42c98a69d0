"""Sizes as people write them ('64MiB', '4KiB') and as the benchmarks print them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "ki": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "mi": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "gi": 2**30,
}


def parse_size(text: str) -> int:
    """'64MiB', '64Mi', '4KiB', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}; use e.g. 4KiB, 64MiB, 1GiB")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"
