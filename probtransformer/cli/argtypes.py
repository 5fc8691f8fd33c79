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


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value
