"""argparse value types of the CLI: checked numbers, with one-line errors naming what arrived."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from probtransformer.validation import check_int


def int_in(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer >= ``minimum`` (and <= ``maximum`` when given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
            check_int("value", value, minimum=minimum)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}, got {text!r}"
            ) from None
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected an integer <= {maximum}, got {text!r}")
        return value

    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)


def float_in(minimum: float, maximum: float) -> Callable[[str], float]:
    """argparse type: a finite number in ``[minimum, maximum]``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and minimum <= value <= maximum):
            raise argparse.ArgumentTypeError(
                f"expected a number in [{minimum:g}, {maximum:g}], got {text!r}"
            )
        return value

    return parse


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value
