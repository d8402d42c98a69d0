"""Kubernetes resource quantities ("256Mi", "1.5Gi", "500M", "1e9", "100m"), parsed exactly.

Pool and block sizes in a pipeline are written the way Kubernetes writes memory, and they
become allocation sizes, so they are parsed into exact rationals (`fractions.Fraction`), never
floats: a float turns "1.1Gi" into a size that is off by a byte and makes equal quantities
compare unequal. The grammar is the one of k8s.io/apimachinery `resource.Quantity`:

    quantity ::= sign? number suffix?
    number   ::= digits | digits "." digits? | "." digits
    suffix   ::= Ki | Mi | Gi | Ti | Pi | Ei          (binary: powers of 1024)
               | n | u | m | k | M | G | T | P | E   (decimal SI)
               | ("e" | "E") sign? digits            (decimal exponent)

"1E" is exa (10**18) while "1E3" is an exponent, as in Kubernetes. Numbers (YAML `poolSize:
1073741824`) are accepted as well: Kubernetes quantities are int-or-string in JSON.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction

BINARY_SUFFIXES: dict[str, int] = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
DECIMAL_SUFFIXES: dict[str, Fraction] = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
# Bounds that keep a hostile or mistyped value from costing unbounded time and memory
# (10**10**9 is a valid-looking exponent); real quantities are far inside them.
MAX_QUANTITY_CHARS = 64
MAX_EXPONENT = 64

_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<exponent>[eE][+-]?[0-9]+)|(?P<suffix>[KMGTPE]i|[numkMGTPE]))?"
)
_HINT = 'expected a quantity such as "256Mi", "1.5Gi", "500M" or "1e9"'


class QuantityError(ValueError):
    """A value that is not a valid quantity (or not a valid byte size); `reason` says why."""

    def __init__(self, reason: str, *, where: str = "") -> None:
        super().__init__(f"{where}: {reason}" if where else reason)
        self.reason = reason
        self.where = where


def parse_quantity(value: object) -> Fraction:
    """The exact value of a quantity given as a string, an int or a (finite) float."""
    if isinstance(value, bool):
        raise QuantityError(f"{_HINT}, got a boolean")
    if isinstance(value, float) and not math.isfinite(value):
        raise QuantityError(f"{_HINT}, got {value!r}")
    if isinstance(value, int | float):
        # Through the text form, so a number obeys the same bounds as the string it prints
        # as, and a float means the decimal written (0.1), not its binary image.
        return _parse_text(repr(value))
    if not isinstance(value, str):
        raise QuantityError(f"{_HINT}, got {type(value).__name__}")
    return _parse_text(value)


def _parse_text(text: str) -> Fraction:
    if len(text) > MAX_QUANTITY_CHARS:
        raise QuantityError(f"quantity is longer than {MAX_QUANTITY_CHARS} characters")
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise QuantityError(f"{_HINT}, got {text!r}")
    number = Fraction(Decimal(match["number"]))
    if match["sign"] == "-":
        number = -number
    return number * _multiplier(match["exponent"], match["suffix"])


def _multiplier(exponent: str | None, suffix: str | None) -> Fraction:
    if exponent is not None:
        power = int(exponent[1:])
        if abs(power) > MAX_EXPONENT:
            raise QuantityError(f"exponent {power} is out of range (at most {MAX_EXPONENT})")
        return Fraction(10) ** power
    if suffix is None:
        return Fraction(1)
    if suffix in BINARY_SUFFIXES:
        return Fraction(BINARY_SUFFIXES[suffix])
    return DECIMAL_SUFFIXES[suffix]


def parse_bytes(value: object, *, where: str = "") -> int:
    """A size in bytes: a non-negative quantity that is a whole number of bytes.

    `where` (a field path such as `spec.transport.poolSize`) prefixes the error message.
    """
    try:
        amount = parse_quantity(value)
    except QuantityError as error:
        raise QuantityError(error.reason, where=where) from None
    if amount < 0:
        raise QuantityError(f"a size must not be negative, got {value!r}", where=where)
    if amount.denominator != 1:
        raise QuantityError(f"{value!r} is not a whole number of bytes", where=where)
    return amount.numerator


def format_bytes(size: int) -> str:
    """The shortest exact quantity for `size` bytes: "256Mi", "1536", "500M".

    Binary suffixes are preferred (memory is allocated in powers of two); a decimal suffix is
    used only when no binary one is exact. `parse_bytes(format_bytes(n)) == n` for all n >= 0.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"a byte size must be a non-negative integer, got {size!r}")
    if size == 0:
        return "0"
    for suffix, factor in sorted(BINARY_SUFFIXES.items(), key=lambda item: -item[1]):
        if size % factor == 0:
            return f"{size // factor}{suffix}"
    for suffix in ("E", "P", "T", "G", "M", "k"):
        factor = DECIMAL_SUFFIXES[suffix].numerator
        if size % factor == 0:
            return f"{size // factor}{suffix}"
    return str(size)


def scale_quantity(value: str, factor: int) -> str:
    """`value` times a whole `factor`, in `value`'s own unit: ("500m", 2) -> "1000m",
    ("1.5Gi", 2) -> "3Gi", ("1", 4) -> "4" (a pod of `factor` ranks asks for each one's)."""
    match = _QUANTITY.fullmatch(value)
    if match is None:
        raise QuantityError(f"{_HINT}, got {value!r}")
    number = format(Decimal(match["number"]) * factor, "f")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    unit = match["exponent"] or match["suffix"] or ""
    return f"{match['sign']}{number}{unit}"
