"""argparse ``type=`` functions for the ``opgrad`` command's numeric options.

A bad value then fails in argparse, before any work starts, with argparse's usual
``opgrad train: error: argument --lr: expected a positive finite number, got 'inf'`` and exit
status 2, naming the option, the value given and what is expected.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["fraction", "int_range", "non_negative_float", "non_negative_int", "positive_float", "positive_int"]


def _integer(text: str, expected: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _integer(text, "a positive integer (1, 2, ...)")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1, 2, ...), got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _integer(text, "a non-negative integer (0, 1, ...)")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer (0, 1, ...), got {text!r}")
    return value


def int_range(low: int, high: int, why: str = "") -> Callable[[str], int]:
    """A ``type=`` for an integer from ``low`` to ``high`` inclusive; ``why`` explains the bound."""
    expected = f"an integer from {low} to {high}" + (f" ({why})" if why else "")

    def parse(text: str) -> int:
        value = _integer(text, expected)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = f"int_range({low}, {high})"
    return parse


def _number(text: str, expected: str, ok: Callable[[float], bool]) -> float:
    """``text`` as a float for which ``ok`` holds, or argparse's error saying what was ``expected``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (``inf`` and ``nan`` are refused)."""
    return _number(text, "a positive finite number such as 0.001 or 1e-3", lambda v: math.isfinite(v) and v > 0)


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    return _number(text, "a finite number >= 0 such as 0 or 1e-4", lambda v: math.isfinite(v) and v >= 0)


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    return _number(text, "a number in (0, 1] such as 0.1", lambda v: 0.0 < v <= 1.0)


def float_range(low: float, high: float, what: str = "a number") -> Callable[[str], float]:
    """A ``type=`` for a finite number from ``low`` to ``high`` inclusive."""
    expected = f"{what} from {low:g} to {high:g}"

    def parse(text: str) -> float:
        return _number(text, expected, lambda v: math.isfinite(v) and low <= v <= high)

    parse.__name__ = f"float_range({low:g}, {high:g})"
    return parse
