"""Amounts as Backend.AI writes them: exact, bounded decimals and BinarySize byte counts.

A leaf module (it imports nothing from the package), shared by the scratch parser, the mock
device file and the request parser of ``simulate``.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

__all__ = ["bounded", "parse_binary_size", "parse_decimal"]

# Scales of Backend.AI's BinarySize: one letter, powers of 1024.
_SCALES = {s: 1024**i for i, s in enumerate("kmgtpezy", start=1)}
_UNIT_TAILS = ("ibytes", "ibyte", "ib", "bytes", "byte", "b")


def parse_binary_size(text: str) -> int:
    """Parse a BinarySize string (``4g``, ``1.5g``, ``512m``, ``4GiB``, ``1073741824``) into bytes.

    Mirrors ``ai.backend.common.types.BinarySize.from_str``, except that infinite sizes are
    rejected: no kernel holds infinitely many bytes.
    """
    value = text.strip().lower().replace("_", "")
    if not value:
        raise ValueError("empty size")
    for tail in _UNIT_TAILS:
        if value.endswith(tail) and len(value) > len(tail):
            value = value[: -len(tail)].rstrip()
            break
    scale = 1
    if value[-1] in _SCALES:
        scale, value = _SCALES[value[-1]], value[:-1].rstrip()
    number = parse_decimal(value)
    if scale == 1 and number != number.to_integral_value():
        raise ValueError("a fractional byte count")
    return int(bounded(number * scale, text))


def parse_decimal(text: str) -> Decimal:
    """A finite, non-negative, bounded decimal; ``ValueError`` otherwise."""
    try:
        number = Decimal(text)
    except InvalidOperation:
        raise ValueError("not a number") from None
    if not number.is_finite():
        raise ValueError("not a finite number")
    if number < 0:
        raise ValueError("a negative amount")
    return bounded(number, text)


# Amounts stay exact in Decimal's default 28-digit context only while they are bounded: at most
# 10**18 (an exabyte; far beyond any count) with at most 9 decimal places.
_MAX_AMOUNT = Decimal(10) ** 18
_MIN_EXPONENT = -9


def bounded(number: Decimal, text: str) -> Decimal:
    """``number`` when it fits the exact range; ``ValueError`` otherwise. Messages never quote
    ``text``: it comes from a kernel's file, whose content may hold secrets."""
    if number > _MAX_AMOUNT or number.as_tuple().exponent < _MIN_EXPONENT:
        raise ValueError("out of range (at most 10^18, with at most 9 decimal places)")
    return number
