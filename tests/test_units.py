"""Amounts as Backend.AI writes them: BinarySize byte counts and bounded, exact decimals."""

from __future__ import annotations

from decimal import Decimal

import pytest

from exporter.units import bounded, parse_binary_size, parse_decimal


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", 0), ("512", 512), ("1k", 1024), ("512m", 512 * 2**20), ("1.5g", 3 * 2**29), ("4GiB", 4 * 2**30),
     ("4 GiB", 4 * 2**30), ("4gb", 4 * 2**30), ("14.76g", 15848429322), ("10t", 10 * 2**40), ("1_024", 1024),
     ("536870912.000000", 536870912)],
)
def test_binary_size(text: str, expected: int) -> None:
    assert parse_binary_size(text) == expected


@pytest.mark.parametrize("text", ["1.5", "", "g", "abc", "-1g", "inf", "nang"])
def test_binary_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_binary_size(text)


@pytest.mark.parametrize(("text", "reason"), [("NaN", "not a finite number"), ("-1", "a negative amount"), ("x", "not a number"),
                                             ("1e19", "out of range"), ("0.0000000001", "out of range")])
def test_decimals_are_finite_non_negative_and_bounded(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as caught:
        parse_decimal(text)
    assert text not in str(caught.value)  # a file's value never appears in the message


def test_the_bound_keeps_sums_exact() -> None:
    assert parse_decimal("0.000000001") == Decimal("1E-9")
    assert bounded(Decimal(10) ** 18, "x") == Decimal(10) ** 18
