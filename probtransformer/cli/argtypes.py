"""argparse value types of the CLI: checked numbers, with one-line errors naming what arrived."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_in(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer >= ``minimum`` (and <= ``maximum`` when given)."""

    expected = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(_plain(text))
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected an integer {expected}, got {text!r}")
        return value

    return parse


def _plain(text: str) -> str:
    """``text``, refused when it holds Python's digit separator (``int("1_0")`` is 10)."""
    if "_" in text:
        raise ValueError(text)
    return text


positive_int = int_in(1)
non_negative_int = int_in(0)


def float_in(
    minimum: float, maximum: float, *, above: bool = False, below: bool = False
) -> Callable[[str], float]:
    """argparse type: a finite number in ``[minimum, maximum]`` (``above``: ``minimum``
    excluded; ``below``: ``maximum`` excluded; ``maximum`` may be ``math.inf``)."""
    interval = f"in {'(' if above else '['}{minimum:g}, {maximum:g}{')' if below else ']'}"
    if maximum == math.inf:
        interval = f"{'>' if above else '>='} {minimum:g}, finite"

    def parse(text: str) -> float:
        try:
            value = float(_plain(text))
        except ValueError:
            value = math.nan
        low_ok = value > minimum if above else value >= minimum
        high_ok = value < maximum if below else value <= maximum
        if not (math.isfinite(value) and low_ok and high_ok):
            raise argparse.ArgumentTypeError(f"expected a number {interval}, got {text!r}")
        return value

    return parse


def prior_precision(text: str) -> str | float:
    """argparse type of ``--prior-precision``: ``marglik``, ``prior`` or a finite number > 0
    (a precision, 1/scale^2), as ``fit_laplace``'s ``prior_precision`` takes it."""
    if text in ("marglik", "prior"):
        return text
    try:
        return float_in(0, math.inf, above=True)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected marglik, prior or a number > 0, finite, got {text!r}"
        ) from None


#: argparse type: a probability in [0, 1), such as dropout.
probability_below_one = float_in(0, 1, below=True)
#: argparse type: a seed of torch's and numpy's generators, in [0, 2**32).
seed = int_in(0, 2**32 - 1)
