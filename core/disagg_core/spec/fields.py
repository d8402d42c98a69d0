"""Typed field readers that collect problems instead of stopping at the first one.

A user who runs `disagg validate` wants every mistake in one pass, each located by a field
path (`spec.roles[1].replicas`). So the readers never raise: they record a `Problem` in a
`Collector` and return None, and the parser carries on with a fallback. Later checks ask the
collector whether a path is already `flawed` so that one mistake is not reported twice.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from disagg_core import quantity
from disagg_core.spec import limits
from disagg_core.spec.model import IntOrPercent

ROOT = "<document>"  # how a problem about the whole document shows its path
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
Choice = TypeVar("Choice", bound=str)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a document: where (a field path, "" for the whole file) and why."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path or ROOT}: {self.reason}"


class SpecError(ValueError):
    """An invalid pipeline document; `problems` lists everything found, in document order."""

    def __init__(self, problems: Sequence[Problem], *, source: str | None = None) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "".join(f"\n  {problem}" for problem in self.problems)
        super().__init__(f"invalid DisaggregatedPipeline{where}:{lines}")


@dataclass
class Collector:
    problems: list[Problem] = field(default_factory=list)

    def add(self, path: str, reason: str) -> None:
        self.problems.append(Problem(path, reason))

    def flawed(self, path: str) -> bool:
        """Whether a problem was recorded at `path` or inside it."""
        return any(
            problem.path == path or problem.path.startswith((f"{path}.", f"{path}["))
            for problem in self.problems
        )


def child(path: str, key: str) -> str:
    if not _PLAIN_KEY.fullmatch(key):
        return f"{path}[{json.dumps(key)}]"
    return f"{path}.{key}" if path else key


def kind_of(value: object) -> str:
    """`value`'s type as a reader would say it: "a string", "a list", "null"..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }
    return names.get(type(value), type(value).__name__)


def fields(
    out: Collector,
    value: object,
    path: str,
    *,
    known: Collection[str],
    required: Collection[str] = (),
) -> dict[str, object] | None:
    """`value` as a mapping with only `known` keys and all `required` ones, else None."""
    if not isinstance(value, dict):
        out.add(path, f"expected a mapping, got {kind_of(value)}")
        return None
    for key in value:
        if not isinstance(key, str):
            out.add(path, f"field names must be strings, got {key!r}")
        elif key not in known:
            out.add(child(path, key), f"unknown field{_suggestion(key, known)}")
    for key in required:
        if key not in value:
            out.add(child(path, key), "required field missing")
    return {key: item for key, item in value.items() if isinstance(key, str) and key in known}


def _suggestion(key: str, known: Collection[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def text(out: Collector, m: dict[str, object], key: str, path: str) -> str | None:
    """A non-empty string field; None when absent or invalid."""
    if key not in m:
        return None
    value = m[key]
    if not isinstance(value, str):
        out.add(child(path, key), f"expected a string, got {kind_of(value)}")
        return None
    if not value:
        out.add(child(path, key), "must not be empty")
        return None
    longest = limits.max_length(child(path, key))
    if longest is not None and len(value) > longest:
        out.add(child(path, key), f"at most {longest} characters, got {len(value)}")
        return None
    return value


def integer(
    out: Collector,
    m: dict[str, object],
    key: str,
    path: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int | None:
    """An integer field (booleans are not integers here); None when absent or invalid."""
    if key not in m:
        return None
    value = m[key]
    if isinstance(value, bool) or not isinstance(value, int):
        out.add(child(path, key), f"expected an integer, got {kind_of(value)}")
        return None
    if minimum is not None and value < minimum:
        out.add(child(path, key), f"must be at least {minimum}, got {value}")
        return None
    if maximum is not None and value > maximum:
        out.add(child(path, key), f"must be at most {maximum}, got {value}")
        return None
    return value


_PERCENT = re.compile(r"(0|[1-9][0-9]*)%")


def int_or_percent(
    out: Collector,
    m: dict[str, object],
    key: str,
    path: str,
    *,
    minimum: int = 0,
    max_percent: int | None = None,
) -> IntOrPercent | None:
    """An int-or-percent field (`2` or `"25%"`, as a Deployment's maxUnavailable): at least
    `minimum` (count or percentage), a percentage at most `max_percent`; None when absent or
    invalid."""
    if key not in m:
        return None
    value = m[key]
    if isinstance(value, int) and not isinstance(value, bool):
        amount = IntOrPercent(value)
    elif isinstance(value, str) and (match := _PERCENT.fullmatch(value)):
        amount = IntOrPercent(int(match.group(1)), percent=True)
    else:
        shown = repr(value) if isinstance(value, str) else kind_of(value)
        out.add(child(path, key), f'expected an integer or a percentage ("25%"), got {shown}')
        return None
    if amount.value < minimum:
        out.add(child(path, key), f"must be at least {minimum}, got {value}")
        return None
    if amount.percent and max_percent is not None and amount.value > max_percent:
        out.add(child(path, key), f"must be at most {max_percent}%, got {value}")
        return None
    return amount


def boolean(out: Collector, m: dict[str, object], key: str, path: str) -> bool | None:
    """A true/false field; None when absent or invalid."""
    if key not in m:
        return None
    value = m[key]
    if not isinstance(value, bool):
        out.add(child(path, key), f"expected true or false, got {kind_of(value)}")
        return None
    return value


def number(out: Collector, m: dict[str, object], key: str, path: str) -> float | None:
    """A finite number field (int or float); None when absent or invalid."""
    if key not in m:
        return None
    value = m[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        out.add(child(path, key), f"expected a number, got {kind_of(value)}")
        return None
    if not math.isfinite(value):
        out.add(child(path, key), f"must be a finite number, got {value}")
        return None
    return float(value)


def choice(
    out: Collector, m: dict[str, object], key: str, path: str, options: Sequence[Choice]
) -> Choice | None:
    """One of `options`; None when absent or invalid."""
    value = text(out, m, key, path)
    if value is None:
        return None
    for option in options:
        if value == option:
            return option
    out.add(child(path, key), f"must be one of {', '.join(options)}; got {value!r}")
    return None


def size(out: Collector, m: dict[str, object], key: str, path: str) -> int | None:
    """A byte size given as a quantity; None when absent or invalid."""
    if key not in m:
        return None
    try:
        return quantity.parse_bytes(m[key])
    except quantity.QuantityError as error:
        out.add(child(path, key), error.reason)
        return None


def items(
    out: Collector, m: dict[str, object], key: str, path: str
) -> Iterator[tuple[str, object]]:
    """The (path, item) pairs of a list field; nothing when absent or not a list."""
    if key not in m:
        return
    value = m[key]
    if not isinstance(value, list):
        out.add(child(path, key), f"expected a list, got {kind_of(value)}")
        return
    most = limits.max_items(child(path, key))
    if most is not None and len(value) > most:
        out.add(child(path, key), f"at most {most} items, got {len(value)}")
        value = value[:most]  # the rest is not read: the work stays bounded
    for index, item in enumerate(value):
        yield f"{child(path, key)}[{index}]", item


def texts(out: Collector, m: dict[str, object], key: str, path: str) -> tuple[str, ...] | None:
    """A list of strings (empty strings allowed: they are valid arguments)."""
    if key not in m:
        return None
    result: list[str] = []
    for item_path, item in items(out, m, key, path):
        if isinstance(item, str):
            result.append(item)
        else:
            out.add(item_path, f"expected a string, got {kind_of(item)}")
    return tuple(result) if isinstance(m[key], list) else None


def string_map(out: Collector, m: dict[str, object], key: str, path: str) -> dict[str, str]:
    """A mapping of strings to strings (labels, annotations); {} when absent or invalid."""
    if key not in m:
        return {}
    value = m[key]
    if not isinstance(value, dict):
        out.add(child(path, key), f"expected a mapping, got {kind_of(value)}")
        return {}
    result: dict[str, str] = {}
    for name, item in value.items():
        if not isinstance(name, str) or not isinstance(item, str):
            out.add(child(path, key), f"expected string keys and values, got {name!r}: {item!r}")
        else:
            result[name] = item
    return result


def free_mapping(
    out: Collector, m: dict[str, object], key: str, path: str
) -> dict[str, object] | None:
    """A free-form mapping with string keys (an escape hatch kept as given)."""
    if key not in m:
        return None
    value = m[key]
    if not isinstance(value, dict) or not all(isinstance(name, str) for name in value):
        out.add(child(path, key), f"expected a mapping with string keys, got {kind_of(value)}")
        return None
    too_deep = limits.deeper_than(value)
    if too_deep is not None:
        where = child(path, key)
        for part in too_deep[: limits.MAX_FREE_DEPTH + 1]:
            where = f"{where}{part}" if part.startswith("[") else child(where, part)
        out.add(where, f"nested deeper than {limits.MAX_FREE_DEPTH} levels")
        return None
    return value
