"""Your own table as train/val/test splits (``from_table``), carved as the built-in datasets
are; sequences (not rows) are split.

The table itself: ``probtransformer.data.table_files`` reads a file (``read_table``,
``file_sha256``), ``probtransformer.data.table_schema`` holds ``TableSchema`` (the layouts, long
and wide, and the encoding learned on the training rows), ``table_series`` the forecasting
tables (``read_series``). Their public names are importable from here as before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from probtransformer.data import DatasetSplits
from probtransformer.data.table_files import MAX_TABLE_BYTES, file_sha256, read_table
from probtransformer.data.table_schema import TableSchema
from probtransformer.datasets._splits import TEST_FRACTION, tail_count
from probtransformer.datasets.table_series import _forecast_table, read_series


def from_table(
    table: pd.DataFrame | str | Path,
    *,
    target: str,
    id: str | None = None,
    time: str | None = None,
    features: list[str] | None = None,
    task: str | None = None,
    scale: bool = True,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = TEST_FRACTION,
    max_bytes: int = MAX_TABLE_BYTES,
    context: int | None = None,
    horizon: int | None = None,
) -> DatasetSplits:
    """Train/val/test splits of your own table, carved as the built-in datasets are.

    Sequences (not rows) are split: test = ``test_fraction`` of them, val =
    ``val_fraction`` of the rest, both stratified by class for classification and seeded by
    ``seed``. The schema (classes, vocabulary, scaling) is learned on the train split only and
    applied to all three.

    Args:
        table: a DataFrame, or the path of a ``.csv`` / ``.parquet`` file.
        target, id, time, features, task, scale: as ``TableSchema.learn``.
        seed: the random state of the splits.
        val_fraction: share of the non-test sequences used for validation, in [0, 1).
        test_fraction: share of the sequences held out for test, in (0, 1).
        max_bytes: the largest file read (``read_table``).
        context, horizon: ``task="forecasting"``: one series (a row per time step, no
            ``id``), cut into rolling-origin windows of ``context`` steps of the features
            (default: every column but ``time``, the target included) followed by
            ``horizon`` steps of the target, as the built-in forecasting datasets: the last
            ``test_fraction`` of the origins are test, val the last ``val_fraction`` of the
            rest, no target step shared between splits. The model standardizes inside
            (meta ``x_loc``, ``x_scale``, ``y_loc``, ``y_scale``), so inputs stay in the
            file's units.

    Returns:
        ``DatasetSplits`` whose meta holds name (the file name, or "DataFrame"), task,
        max_len, in_features, num_classes and class_names or vocab, x_loc/x_scale, seed,
        val_fraction, holdout_classes ``()``, ood None, and ``table``: the schema's
        ``to_dict()``.

    Raises:
        ValueError: every check of ``read_table`` and ``TableSchema``; a class with too few
            sequences to appear in train, val and test; fractions out of range.
        TypeError: ``table`` is neither a DataFrame nor a path.
    """
    if isinstance(table, (str, Path)):
        source = str(table)
        frame = read_table(table, max_bytes=max_bytes, text_columns=(id,) if id else ())
    elif isinstance(table, pd.DataFrame):
        source, frame = "DataFrame", table
        if frame.empty:
            raise ValueError("the DataFrame is empty: expected one row per step or sequence")
    else:
        raise TypeError(f"table must be a DataFrame or a file path, got {type(table).__name__}")
    if not 0 < test_fraction < 1 or not 0 <= val_fraction < 1:
        raise ValueError(
            f"test_fraction must lie in (0, 1) and val_fraction in [0, 1), got "
            f"{test_fraction} and {val_fraction}"
        )
    if task == "forecasting":
        if id is not None:
            raise ValueError(f"{source}: forecasting reads one series: leave out id, got {id!r}")
        return _forecast_table(
            frame, source, target, time, features, context, horizon, seed, val_fraction,
            test_fraction,
        )  # fmt: skip
    if context is not None or horizon is not None:
        raise ValueError(
            f"context and horizon window one series for task='forecasting' (--task "
            f"forecasting), got task={task!r}"
        )
    probe = TableSchema.learn(
        frame, target=target, id=id, time=time, features=features, task=task, scale=False,
        source=source,
    )  # fmt: skip
    ids = frame[id] if id is not None else pd.Series(np.arange(len(frame)))
    codes, _ = pd.factorize(ids, sort=False)
    whole = probe.encode(frame)  # every check over the whole table, before any split
    strata = whole.y.numpy() if probe.task == "classification" else None
    parts = _split(len(whole), strata, probe, seed, val_fraction, test_fraction)
    rows = {name: np.isin(codes, part) for name, part in parts.items()}
    schema = TableSchema.learn(
        frame[rows["train"]], target=target, id=id, time=time, features=probe.features,
        task=probe.task, scale=scale, source=source,
    )  # fmt: skip
    schema.max_len = probe.max_len  # the longest sequence of any split: the model's T
    if schema.class_names is not None and schema.class_names != probe.class_names:
        missing = sorted(set(probe.class_names) - set(schema.class_names))
        raise ValueError(
            f"{source}: column {target!r}: class {missing[0]!r} has no sequence in the training "
            "split"
        )
    data = {name: schema.encode(frame[r]) for name, r in rows.items()}
    meta = {
        "name": Path(source).name,
        "source": source,
        **schema.meta,
        "seed": seed,
        "val_fraction": val_fraction,
        "holdout_classes": (),
        "ood": None,
        "table": schema.to_dict(),
    }
    return DatasetSplits(data["train"], data["val"], data["test"], meta)


def _split(n, strata, schema, seed, val_fraction, test_fraction) -> dict[str, np.ndarray]:
    """Sequence indices of train, val and test (stratified where ``strata`` is given)."""
    from sklearn.model_selection import train_test_split

    if strata is not None:
        counts = np.bincount(strata)
        rare = int(np.argmin(counts))
        need = 3 if val_fraction > 0 else 2
        if counts[rare] < need:
            raise ValueError(
                f"{schema.source}: column {schema.target!r}: class "
                f"{schema.class_names[rare]!r} has {counts[rare]} sequence(s); each class needs "
                f"at least {need} to appear in train, {'val, ' if need == 3 else ''}and test"
            )
    index = np.arange(n)
    classes = 0 if strata is None else len(np.unique(strata))  # a stratified part holds each
    n_test = max(tail_count(test_fraction, n), classes)
    if n_test >= n:
        raise ValueError(f"{schema.source}: {n} sequences are too few to split off a test part")
    stratify = None if strata is None else strata
    try:
        rest, test = train_test_split(index, test_size=n_test, stratify=stratify, random_state=seed)
        val = rest[:0]
        if val_fraction > 0:
            rest, val = train_test_split(
                rest,
                test_size=max(1, classes, tail_count(val_fraction, len(rest))),
                stratify=None if strata is None else strata[rest],
                random_state=seed,
            )
    except ValueError as e:  # too few sequences per class for the stratified shares
        raise ValueError(f"{schema.source}: {n} sequences cannot be split: {e}") from None
    return {"train": np.sort(rest), "val": np.sort(val), "test": np.sort(test)}


__all__ = [
    "MAX_TABLE_BYTES",
    "TableSchema",
    "file_sha256",
    "from_table",
    "read_series",
    "read_table",
]
