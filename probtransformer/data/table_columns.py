"""Checks and readings of one table column, shared by ``TableSchema`` and the forecasting
tables: numbers or text, finite numbers, times in order, missing cells. Every message names
the source (file or "DataFrame"), the column and the row (0-based; in a CSV file, line = row +
2), and shows a CSV cell as the file holds it."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pandas as pd


def _show(value: Any) -> str:
    """``repr`` of a table value, numpy scalars as Python ones."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def _require(frame: pd.DataFrame, columns: list, source: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(
            f"{source} has no column {missing[0]!r}; its columns: {list(map(str, frame.columns))}"
        )


def _row(source: str, row: int) -> str:
    """A row's name in messages: its 0-based position, and its line in a CSV file."""
    line = f" (line {int(row) + 2})" if source.lower().endswith(".csv") else ""
    return f"row {int(row)}{line}"


def _column_kind(frame: pd.DataFrame, column: str, source: str) -> str:
    """ "numbers" or "text"; a column holding both is refused, naming a row of each."""
    values = frame[column]
    if pd.api.types.is_bool_dtype(values) or pd.api.types.is_numeric_dtype(values):
        return "numbers"
    present = values.dropna()
    numeric = pd.to_numeric(present, errors="coerce").notna().to_numpy()
    is_str = np.asarray([isinstance(v, str) for v in present.to_numpy()])
    if numeric.all() and not is_str.any():
        return "numbers"
    if numeric.any() and (~numeric).any():
        first_number = present.index[np.flatnonzero(numeric)[0]]
        first_text = present.index[np.flatnonzero(~numeric)[0]]
        raise ValueError(
            f"{source}: column {column!r} mixes types: {_show(values.loc[first_number])} at "
            f"{_row(source, frame.index.get_loc(first_number))} is a number, "
            f"{_show(values.loc[first_text])} at {_row(source, frame.index.get_loc(first_text))} "
            "is not (a column holds numbers or text)"
        )
    return "text"


def _numbers(values: pd.Series, column: str, source: str, rows=None) -> np.ndarray:
    """A numeric column as float64, refusing NaN and inf with the first such row."""
    if not (pd.api.types.is_numeric_dtype(values) or pd.api.types.is_bool_dtype(values)):
        values = pd.to_numeric(values, errors="coerce")  # _column_kind checked it is numeric
    numbers = values.to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(numbers)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        row = i if rows is None else rows[i]
        written = _as_written(source, column, row) if np.isnan(numbers[i]) else None
        shown = numbers[i] if written is None else _show_written(written)
        raise ValueError(
            f"{source}: column {column!r}, {_row(source, row)}: {shown} (features and "
            "targets must be finite numbers; fill or drop missing steps first)"
        )
    return numbers


def _as_written(source: str, column: str, row: int) -> str | None:
    """The text of a cell of a CSV file as the file holds it, for messages: pandas reads
    "n/a", "NA", "-nan" ... as NaN, which the message should not show as "nan". None when
    ``source`` is not a CSV file (a DataFrame's NaN is what its owner wrote) or cannot be read
    again. Called on the way to an error only: it reads the column again."""
    if not source.lower().endswith((".csv", ".csv.gz")):
        return None
    try:
        raw = pd.read_csv(source, dtype=str, keep_default_na=False, usecols=[column])
        return str(raw[column].iloc[int(row)])
    except (ValueError, OSError, IndexError, KeyError):
        return None


def _show_written(text: str) -> str:
    """A cell's text in a message: quoted, an empty one said so."""
    return repr(text) if text.strip() else "an empty cell"


def _times(values: pd.Series, column: str, source: str) -> np.ndarray:
    """A time column as values that order as time does: numbers as they are; text as the
    numbers or the dates it spells (``pandas.to_datetime``: "12/25/2023" before
    "01/01/2024", not after as text).

    Raises:
        ValueError: text that is neither all numbers nor all dates, naming the first value
            that is not.
    """
    if pd.api.types.is_numeric_dtype(values) or pd.api.types.is_datetime64_any_dtype(values):
        return values.to_numpy()
    numbers = pd.to_numeric(values, errors="coerce")
    if numbers.notna().all():
        return numbers.to_numpy()
    text = values.astype(str)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # pandas' "inferring the format"
            dates = pd.to_datetime(text, errors="coerce")
    except (ValueError, TypeError, OverflowError):
        dates = pd.Series(pd.NaT, index=values.index)
    if dates.notna().all():
        return dates.to_numpy()
    bad = int(np.flatnonzero((numbers.isna() & dates.isna()).to_numpy())[0])
    raise ValueError(
        f"{source}: column {column!r}, {_row(source, bad)}: time {_show(values.iloc[bad])} is "
        "neither a number nor a date (times are ordered by their value: numbers, or dates "
        "pandas can read)"
    )


def _no_missing(values: pd.Series, column: str, source: str) -> None:
    missing = values.isna().to_numpy()
    if missing.any():
        row = int(np.flatnonzero(missing)[0])
        written = _as_written(source, column, row)
        shown = "" if written is None else f" ({_show_written(written)})"
        raise ValueError(f"{source}: column {column!r}, {_row(source, row)}: missing value{shown}")


def _tokens(values: pd.Series, layout: str) -> list[set[str]]:
    """The token sets of a text column: one token per cell (long) or its characters (wide)."""
    texts = [str(v) for v in values.dropna().to_numpy()]
    return [set(texts)] if layout == "long" else [set(s) for s in texts] or [set()]


def _natural(name: str):
    """Sort key of class names: numbers by value ("2" before "10"), then text."""
    try:
        return (0, float(name), "")
    except ValueError:
        return (1, math.inf, name)
