"""Tasks whose models read float features ``(N, T, F)`` (classification, forecasting), and their
``predict`` input files: ``.npy`` arrays and ``.csv`` files of flattened sequences."""

from __future__ import annotations

import abc
import csv
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from probtransformer.tasks._base import Task, read_table_data, table_scaling


class FeatureTask(Task):
    """A task whose ``predict`` reads a ``.npy`` of shape (N, T, F) or a ``.csv`` with one
    flattened sequence of T*F values per row, and writes one CSV row per sequence."""

    @abc.abstractmethod
    def prediction_frame(self, pred: Any, record: dict) -> Any:
        """The CSV rows of ``pred`` (one per sequence) as a pandas DataFrame."""

    def predict_frame(
        self, path: Path, run: Any, draws: dict, *, warn: Callable[[str], None]
    ) -> Any:
        """See ``Task.predict_frame``; ``.npy`` or ``.csv`` inputs, ``.txt`` refused. A run
        fitted on ``--data`` reads ``.csv`` or ``.parquet`` tables of the same layout instead,
        encoded with the run's schema, one output row per sequence led by its id."""
        if "table" in run.record:
            return self._predict_table(path, run, draws, warn)
        suffix = path.suffix.lower()
        if suffix not in (".npy", ".csv"):
            raise ValueError(
                f"--input must be a .npy or .csv file for a {self.name} run, got {str(path)!r}"
            )
        config = run.posterior.model.config
        max_len, in_features = config["max_len"], config["in_features"]
        if suffix == ".npy":
            x = read_npy(path, in_features)
        else:
            x = read_csv(path, max_len, in_features)
        return self.prediction_frame(run.posterior.predict(x, **draws), run.record)

    def _predict_table(self, path: Path, run: Any, draws: dict, warn: Callable[[str], None]) -> Any:
        """``predict_frame`` of a ``fit --data`` run: the table encoded by its schema; features
        far outside the training range are named in the file's units."""
        from probtransformer.inference.inputs import InputRangeWarning, out_of_range_message

        data, ids, id_column = read_table_data(path, run)
        post, scaling = run.posterior, table_scaling(run.record)
        with warnings.catch_warnings():
            if scaling is not None:  # said here in the file's units, not in the model's
                real = data.x if data.mask is None else data.x[data.mask]
                message = out_of_range_message(real, post.record.get("x_range"), **scaling)
                if message is not None:
                    warn(message)
                warnings.simplefilter("ignore", InputRangeWarning)
            pred = post.predict(data.x, data.mask, **draws)
        out = self.prediction_frame(pred, run.record)
        if ids is not None:
            out.insert(0, id_column, ids)
        return out


def read_npy(path: Path, in_features: int) -> np.ndarray:
    """Read float32 inputs of shape (N, T, F) from a .npy file (T may be below max_len).

    Raises:
        ValueError: not a numeric .npy array, another shape, no rows, or NaN/inf values.
    """
    x = load_npy(path)
    if x.dtype.kind != "f":
        raise ValueError(
            f"{path} must hold floating-point features (as the model was trained on), got dtype "
            f"{x.dtype}"
        )
    if x.ndim != 3 or x.shape[2] != in_features or 0 in x.shape:
        raise ValueError(
            f"{path} must hold an array of shape (N, T, F={in_features}) with N, T >= 1, "
            f"got {x.shape}"
        )
    return _finite(x.astype(np.float32), path)


#: The first bytes of every .npy file, and of a zip archive such as a .npz.
NPY_MAGIC, ZIP_MAGIC = b"\x93NUMPY", b"PK\x03\x04"


def load_npy(path: Path) -> np.ndarray:
    """The array of a .npy file, read as .npy only and never unpickled (``numpy.load`` would
    also open a .npz archive, and try pickle on any other file).

    Raises:
        ValueError: not a .npy file (a .npz archive is named as one), a truncated file, or an
            array of Python objects.
    """
    try:
        with path.open("rb") as f:
            magic = f.read(len(NPY_MAGIC))
            if magic == NPY_MAGIC:
                f.seek(0)
                try:
                    return np.lib.format.read_array(f, allow_pickle=False)
                except (ValueError, EOFError) as e:  # truncated, or Python objects
                    raise ValueError(f"cannot read {path} as a .npy array: {e}") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    if not magic:
        raise ValueError(f"{path} is empty (0 bytes): save one array with numpy.save")
    what = "a .npz archive" if magic.startswith(ZIP_MAGIC) else "not a .npy file"
    raise ValueError(
        f"{path} is {what} (it does not start with numpy's {NPY_MAGIC!r}): save one array "
        "with numpy.save"
    )


def read_csv(path: Path, max_len: int, in_features: int) -> np.ndarray:
    """Read inputs from a CSV file with one flattened sequence of T*F values per row.

    Values run step by step (row-major over (T, F)); T is the model's max_len. A first row
    with no numeric cell, or with pandas' default column names ``0,1,...,T*F-1`` (what
    ``DataFrame.to_csv(index=False)`` writes), is a header and skipped; blank lines are skipped.

    Returns:
        float32 array of shape (N, max_len, in_features).

    Raises:
        ValueError: a row with another number of columns or separated by another character
            than commas, a missing or non-numeric value, no rows, or NaN/inf values.
    """
    width = max_len * in_features
    rows: list[list[float]] = []
    header = None
    with path.open(newline="", encoding="utf-8-sig") as f:  # a byte-order mark (Excel) dropped
        for line, cells in enumerate(csv.reader(f), start=1):
            if not any(cell.strip() for cell in cells):
                continue
            if len(cells) == 1 and width > 1 and (other := _other_delimiter(cells[0])):
                raise ValueError(
                    f"{path} line {line}: numbers separated by {other!r}; separate the {width} "
                    "values of a row with commas"
                )
            if line == 1 and _is_header(cells):
                header = cells
                continue
            if len(cells) != width:
                raise ValueError(
                    f"{path} line {line}: expected {width} columns (T*F = {max_len}*{in_features})"
                    f", got {len(cells)}"
                )
            rows.append([_cell(value, path, line, column) for column, value in enumerate(cells)])
    if not rows:
        why = "" if header is None else f" (its first line, {','.join(header)[:60]!r}, is a header)"
        raise ValueError(
            f"{path} holds no data rows{why}: expected rows of {width} numbers "
            f"(T*F = {max_len}*{in_features})"
        )
    x = np.asarray(rows, dtype=np.float32).reshape(len(rows), max_len, in_features)
    return _finite(x, path)


def _is_header(cells: list[str]) -> bool:
    """A first row with no number, or pandas' default column names ``0,1,...,W-1``."""
    if not any(_is_number(cell) for cell in cells):
        return True
    return [cell.strip() for cell in cells] == [str(i) for i in range(len(cells))]


def _other_delimiter(text: str) -> str | None:
    """The separator, other than a comma, of a line that holds only numbers, if any."""
    for delimiter in (";", "\t", " "):
        values = text.strip().split(delimiter)
        if len(values) > 1 and all(_is_number(value) for value in values if value):
            return delimiter
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _cell(text: str, path: Path, line: int, column: int) -> float:
    if not text.strip():
        raise ValueError(f"{path} line {line}, column {column + 1}: missing value")
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"{path} line {line}, column {column + 1}: not a number: {text!r}"
        ) from None


def _finite(x: np.ndarray, path: Path) -> np.ndarray:
    bad = ~np.isfinite(x)
    if bad.any():
        n, t, f = np.argwhere(bad)[0]
        count = int(bad.sum())
        raise ValueError(
            f"{path} holds {count} NaN/inf value{'s' if count > 1 else ''}, the first at "
            f"sequence {n}, step {t}, feature {f} (from 0): {x[n, t, f]}"
        )
    return x
