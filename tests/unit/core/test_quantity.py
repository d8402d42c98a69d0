"""Kubernetes quantities: exact values, byte sizes, canonical formatting."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg_core import quantity
from disagg_core.quantity import QuantityError, format_bytes, parse_bytes, parse_quantity


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", Fraction(0)),
        ("64Mi", Fraction(64 * 2**20)),
        ("1Gi", Fraction(2**30)),
        ("1.5Gi", Fraction(3 * 2**29)),
        ("500M", Fraction(500 * 10**6)),
        ("1e3", Fraction(1000)),
        ("1E3", Fraction(1000)),
        ("1e-3", Fraction(1, 1000)),
        ("1E", Fraction(10**18)),
        ("2Ei", Fraction(2 * 2**60)),
        ("100m", Fraction(1, 10)),
        ("250u", Fraction(1, 4000)),
        ("5n", Fraction(5, 10**9)),
        ("12k", Fraction(12000)),
        ("1.", Fraction(1)),
        (".5", Fraction(1, 2)),
        ("+3", Fraction(3)),
        ("-2Ki", Fraction(-2048)),
        ("1.1Gi", Fraction(11 * 2**30, 10)),
    ],
)
def test_parse_quantity_is_exact(text: str, expected: Fraction) -> None:
    assert parse_quantity(text) == expected


def test_numbers_are_quantities_too() -> None:
    assert parse_quantity(1073741824) == 2**30
    assert parse_quantity(0.1) == Fraction(1, 10)  # the number as written, not its binary image
    assert parse_quantity(1.5e9) == 1_500_000_000


@pytest.mark.parametrize(
    "value",
    [
        "",
        " 1Gi",
        "1Gi ",
        "1 Gi",
        "1gi",
        "1GB",
        "1KiB",
        "Mi",
        "1e",
        "1e3Mi",
        "1..2",
        "--1",
        "0x10",
        "1_000",
    ],
)
def test_malformed_quantities_are_rejected(value: str) -> None:
    with pytest.raises(QuantityError, match="expected a quantity"):
        parse_quantity(value)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (True, "boolean"),
        (None, "NoneType"),
        ([1], "list"),
        (float("inf"), "inf"),
        (float("nan"), "nan"),
    ],
)
def test_non_quantity_types_are_rejected(value: object, reason: str) -> None:
    with pytest.raises(QuantityError, match=reason):
        parse_quantity(value)


def test_huge_exponents_and_long_strings_are_refused_quickly() -> None:
    with pytest.raises(QuantityError, match="exponent"):
        parse_quantity("1e1000000000")
    with pytest.raises(QuantityError, match="longer than"):
        parse_quantity("1" * (quantity.MAX_QUANTITY_CHARS + 1))


def test_parse_bytes() -> None:
    assert parse_bytes("256Mi") == 256 * 2**20
    assert parse_bytes(4096) == 4096
    assert parse_bytes("1.5Ki") == 1536
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes("0") == 0


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("-1Mi", "negative"),
        (-5, "negative"),
        ("100m", "whole number of bytes"),
        ("1.5", "whole number of bytes"),
        ("0.1Ki", "whole number of bytes"),
        ("lots", "expected a quantity"),
        (False, "boolean"),
    ],
)
def test_parse_bytes_rejects(value: object, reason: str) -> None:
    with pytest.raises(QuantityError, match=reason) as caught:
        parse_bytes(value, where="spec.transport.poolSize")
    assert caught.value.where == "spec.transport.poolSize"
    assert str(caught.value).startswith("spec.transport.poolSize: ")
    assert reason in caught.value.reason


def test_quantity_error_is_a_value_error() -> None:
    assert issubclass(QuantityError, ValueError)
    assert str(QuantityError("bad")) == "bad"


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0"),
        (1, "1"),
        (1024, "1Ki"),
        (1536, "1536"),
        (256 * 2**20, "256Mi"),
        (3 * 2**30, "3Gi"),
        (2**60, "1Ei"),
        (1000 * 2**10, "1000Ki"),
        (500 * 10**6, "500M"),
        (10**9, "1G"),
        (1001, "1001"),
    ],
)
def test_format_bytes(size: int, text: str) -> None:
    assert format_bytes(size) == text


@pytest.mark.parametrize("size", [-1, True, 1.0])
def test_format_bytes_rejects_non_sizes(size: object) -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        format_bytes(size)  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=2**70))
def test_format_then_parse_round_trips(size: int) -> None:
    assert parse_bytes(format_bytes(size)) == size


@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(sorted(quantity.BINARY_SUFFIXES)),
)
def test_binary_suffixes_multiply_exactly(number: int, suffix: str) -> None:
    assert parse_bytes(f"{number}{suffix}") == number * quantity.BINARY_SUFFIXES[suffix]


@given(st.decimals(min_value=-(10**6), max_value=10**6, allow_nan=False, places=3))
def test_decimal_text_parses_to_its_exact_value(value: object) -> None:
    text = format(value, "f")
    assert parse_quantity(text) == Fraction(text)


@given(st.integers() | st.floats(allow_nan=False, allow_infinity=False))
def test_a_number_parses_like_the_text_it_prints_as(value: float) -> None:
    try:
        expected = parse_quantity(repr(value))
    except QuantityError:
        with pytest.raises(QuantityError):
            parse_quantity(value)
    else:
        assert parse_quantity(value) == expected
