"""Payload paths (`latents`, `a.b[0]`): where a tensor reference points in a payload."""

from __future__ import annotations

import re

_PATH_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_PATH_INDEX = re.compile(r"\[(0|[1-9][0-9]*)\]")
PathStep = str | int


def parse_payload_path(path: str) -> tuple[PathStep, ...]:
    """Split a payload path such as `latents`, `a.b[0]` or `[1].kv` into keys and indexes.

    Raises ValueError when the path is malformed. Keys are identifier-like (letters, digits,
    `_`, `-`, not starting with a digit); indexes are non-negative integers in brackets.
    """
    steps: list[PathStep] = []
    position = 0
    while position < len(path):
        index = _PATH_INDEX.match(path, position)
        if index is not None:
            steps.append(int(index[1]))
            position = index.end()
            continue
        if steps:
            if path[position] != ".":
                raise ValueError(f"expected '.' or '[' at offset {position} of {path!r}")
            position += 1
        key = _PATH_KEY.match(path, position)
        if key is None:
            raise ValueError(f"expected a key at offset {position} of {path!r}")
        steps.append(key[0])
        position = key.end()
    if not steps:
        raise ValueError("a payload path must not be empty")
    return tuple(steps)
