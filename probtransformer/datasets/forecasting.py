"""Forecasting windows of statsmodels' bundled series: sunspots, co2, macrodata (optional extra).

Needs `pip install 'probtransformer[datasets]'`; statsmodels is imported only when one of these
series is loaded. Each series is cut into rolling-origin windows (context L -> horizon H).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd
import torch

from probtransformer.data import DatasetSplits, SequenceData
from probtransformer.datasets._registry import EXTRA, entry_of, missing_extra, register
from probtransformer.datasets._splits import tail_count

#: A reader takes `statsmodels.datasets` and returns the target series (with its time index),
#: the feature frame (same index, one column per feature) and dataset-specific meta.
_Reader = Callable[[ModuleType], tuple[pd.Series, pd.DataFrame, dict[str, Any]]]


@dataclass(frozen=True)
class _Forecast:
    context: int  # L, steps of a window's input
    horizon: int  # H, steps of a window's target
    season: int  # steps of one seasonal cycle
    test_origins: int  # K, the last K origins are test
    frequency: str
    read: _Reader
    shape: str
    source: str


def _read_sunspots(sm_datasets: ModuleType) -> tuple[pd.Series, pd.DataFrame, dict[str, Any]]:
    """Yearly sunspot numbers, one feature (the target itself)."""
    raw = sm_datasets.sunspots.load_pandas().data
    series = pd.Series(
        raw["SUNACTIVITY"].to_numpy(dtype=np.float64),
        index=pd.Index(raw["YEAR"].to_numpy().astype(np.int64), name="year"),
        name="SUNACTIVITY",
    )
    return series, series.to_frame(), {}


def _read_co2(sm_datasets: ModuleType) -> tuple[pd.Series, pd.DataFrame, dict[str, Any]]:
    """Weekly CO2 as monthly means, months with no observed week linearly interpolated."""
    weekly = sm_datasets.co2.load_pandas().data["co2"].astype(np.float64)
    monthly = weekly.resample("MS").mean()  # mean of the weeks present in each month
    gaps = monthly.isna()
    series = monthly.interpolate(method="linear")  # months with no observed week
    series.index.name = "month"
    extra_meta = {
        "weeks_missing": int(weekly.isna().sum()),
        "months_interpolated": int(gaps.sum()),
    }
    return series, series.to_frame(), extra_meta


def _read_macrodata(sm_datasets: ModuleType) -> tuple[pd.Series, pd.DataFrame, dict[str, Any]]:
    """Quarterly growth of realgdp, realcons, realinv (400*diff(log)) and infl; target realgdp."""
    raw = sm_datasets.macrodata.load_pandas().data
    index = pd.period_range(
        f"{int(raw['year'].iloc[0])}Q{int(raw['quarter'].iloc[0])}", periods=len(raw), freq="Q"
    )
    if not (
        (index.year == raw["year"].to_numpy()).all()
        and (index.quarter == raw["quarter"].to_numpy()).all()
    ):
        raise ValueError("macrodata: the quarters are not contiguous")
    growth = {
        f"{col}_growth": 400.0 * np.diff(np.log(raw[col].to_numpy(dtype=np.float64)))
        for col in ("realgdp", "realcons", "realinv")
    }
    features = pd.DataFrame(
        {**growth, "infl": raw["infl"].to_numpy(dtype=np.float64)[1:]},
        index=pd.PeriodIndex(index[1:], name="quarter"),
    )
    return features["realgdp_growth"].copy(), features, {}


_FORECASTS = {
    "sunspots": _Forecast(
        context=32,
        horizon=4,
        season=11,
        test_origins=60,
        frequency="yearly",
        read=_read_sunspots,
        shape="(N, 32, 1) -> (N, 4)",
        source="statsmodels datasets.sunspots: yearly mean sunspot numbers 1700-2008 (NOAA "
        "National Geophysical Data Center, ngdc.noaa.gov/stp/solar/solarda3.html)",
    ),
    "co2": _Forecast(
        context=36,
        horizon=6,
        season=12,
        test_origins=48,
        frequency="monthly",
        read=_read_co2,
        shape="(N, 36, 1) -> (N, 6)",
        source="statsmodels datasets.co2: weekly Mauna Loa CO2 (ppm) 1958-2001 (Keeling & "
        "Whorf 2004, SIO flask network, CDIAC), resampled to monthly means",
    ),
    "macrodata": _Forecast(
        context=16,
        horizon=2,
        season=4,
        test_origins=40,
        frequency="quarterly",
        read=_read_macrodata,
        shape="(N, 16, 4) -> (N, 2)",
        source="statsmodels datasets.macrodata: US quarterly macroeconomic data 1959Q1-2009Q3 "
        "(FRED, Federal Reserve Bank of St. Louis; Bureau of Labor Statistics)",
    ),
}


def _load_forecast(
    name: str, *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    """Read series `name` with its spec's reader and cut it into rolling-origin windows."""
    try:
        import statsmodels.datasets as sm_datasets
    except ImportError as err:
        raise missing_extra(name) from err
    spec = _FORECASTS[name]
    series, features, extra_meta = spec.read(sm_datasets)
    meta = {
        "name": name,
        "task": "forecasting",
        "max_len": spec.context,
        "context": spec.context,
        "horizon": spec.horizon,
        "in_features": features.shape[1],
        "season": spec.season,
        "frequency": spec.frequency,
        "source": entry_of(name).source,
        **extra_meta,
    }
    return _forecast_splits(series, features, spec, meta, seed, val_fraction)


def _forecast_splits(
    series: pd.Series,
    features: pd.DataFrame,
    spec: _Forecast,
    meta: dict[str, Any],
    seed: int,
    val_fraction: float,
) -> DatasetSplits:
    """Rolling-origin windows: chronological train / val / test origins without shared targets."""
    context, horizon = spec.context, spec.horizon
    origins = np.arange(context, len(series) - horizon + 1)
    test = origins[-spec.test_origins :]
    trainval = origins[origins + horizon <= test[0]]
    n_val = tail_count(val_fraction, len(trainval))
    val = trainval[len(trainval) - n_val :]
    train = trainval[trainval + horizon <= val[0]] if n_val else trainval
    if len(train) == 0:
        raise ValueError(
            f"val_fraction={val_fraction} leaves no training window in {meta['name']} "
            f"({len(trainval)} origins before the test part, horizon {horizon})"
        )
    fx = features.to_numpy(dtype=np.float64)
    fy = series.to_numpy(dtype=np.float64)

    def windows(ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = fx[ts[:, None] + np.arange(-context, 0)]  # (n, L, F)
        y = fy[ts[:, None] + np.arange(horizon)]  # (n, H)
        return x, y

    parts = {"train": train, "val": val, "test": test}
    data = {part: windows(ts) for part, ts in parts.items()}
    x_train, y_train = data["train"]
    flat = x_train.reshape(-1, fx.shape[1])
    meta = {
        **meta,
        "series": series,
        "features": features,
        "origins": {part: ts.astype(np.int64) for part, ts in parts.items()},
        "x_loc": flat.mean(axis=0).tolist(),
        "x_scale": flat.std(axis=0).tolist(),
        "y_loc": float(y_train.mean()),
        "y_scale": float(y_train.std()),
        "seed": seed,
        "val_fraction": val_fraction,
    }
    splits = {
        part: SequenceData(
            torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32))
        )
        for part, (x, y) in data.items()
    }
    return DatasetSplits(splits["train"], splits["val"], splits["test"], meta)


for _name, _spec in _FORECASTS.items():
    register(_name, task="forecasting", shape=_spec.shape, source=_spec.source, extra=EXTRA)(
        functools.partial(_load_forecast, _name)
    )
