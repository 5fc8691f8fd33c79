"""Forecasting tables: one series (a row per time step) read and checked, and cut into the
rolling-origin windows of the built-in forecasting datasets (``from_table(task="forecasting")``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from probtransformer.data import DatasetSplits
from probtransformer.data.table_columns import (
    _column_kind,
    _no_missing,
    _numbers,
    _require,
    _row,
    _show,
    _times,
)
from probtransformer.datasets._splits import tail_count


def read_series(
    frame: pd.DataFrame,
    source: str,
    *,
    target: str,
    time: str | None,
    features: list[str] | None = None,
) -> tuple[pd.Series, pd.DataFrame]:
    """One series of a forecasting table, checked: the ``target`` series and the feature
    table ``(T, F)`` (by default every column but ``time``, the target included), both
    indexed by ``time``.

    Raises:
        ValueError: no time column, a missing column, time steps missing, duplicated or out of
            order, text in a number column, or NaN/inf (each names the column and row).
    """
    if time is None:
        raise ValueError(
            f"{source}: forecasting needs the time column that orders the series: "
            "time='COL' (--time COL)"
        )
    _require(frame, [target, time, *(features or [])], source)
    features = features or [str(c) for c in frame.columns if c != time]
    _no_missing(frame[time], time, source)
    order = _times(frame[time], time, source)
    back = ~(order[1:] > order[:-1])
    times = frame[time].to_numpy()
    if back.any():
        k = int(np.flatnonzero(back)[0])
        what = "duplicated" if order[k + 1] == order[k] else "out of order"
        raise ValueError(
            f"{source}: column {time!r}: time {_show(times[k + 1])} at {_row(source, k + 1)} "
            f"after {_show(times[k])} at {_row(source, k)}: time steps {what} (one row per "
            "step, in time order)"
        )
    for c in [target, *features]:
        if _column_kind(frame, c, source) != "numbers":
            raise ValueError(f"{source}: forecasting reads numbers; column {c!r} holds text")
    values = {c: _numbers(frame[c], c, source) for c in dict.fromkeys([target, *features])}
    index = pd.Index(times, name=time)
    series = pd.Series(values[target], index=index, name=target)
    return series, pd.DataFrame({c: values[c] for c in features}, index=index)


def _forecast_table(
    frame, source, target, time, features, context, horizon, seed, val_fraction, test_fraction
) -> DatasetSplits:
    """``from_table`` of one series: the built-in forecasting windows (``forecasting``)."""
    from probtransformer.datasets.forecasting import _Forecast, _forecast_splits

    for name, value in (("context", context), ("horizon", horizon)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"forecasting needs {name} as a positive int, got {value!r}")
    series, table = read_series(frame, source, target=target, time=time, features=features)
    origins = len(frame) - context - horizon + 1
    test_origins = tail_count(test_fraction, max(origins, 0))
    if origins < 2 or origins - test_origins < horizon + 1:
        raise ValueError(
            f"{source}: {len(frame)} time steps are too few for windows of context {context} "
            f"and horizon {horizon} with a test part ({origins} origins)"
        )
    spec = _Forecast(context, horizon, 1, test_origins, "", None, "", source)
    meta = {
        "name": Path(source).name,
        "task": "forecasting",
        "max_len": context,
        "context": context,
        "horizon": horizon,
        "in_features": table.shape[1],
        "season": 1,
        "frequency": "",
        "source": source,
        "holdout_classes": (),
        "ood": None,
    }
    return _forecast_splits(series, table, spec, meta, seed, val_fraction)
