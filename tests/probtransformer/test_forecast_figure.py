"""The forecasting task's fan chart and its interval verdict lines."""

import numpy as np
import pandas as pd
import pytest
import torch

from probtransformer.inference import RegressionPrediction
from probtransformer.tasks.forecasting import forecast_figure, forecast_frame, interval_lines


class _Test:
    """A test split of ``n`` forecasts of ``horizon`` steps (only ``y`` and ``len`` are read)."""

    def __init__(self, y: torch.Tensor) -> None:
        self.y = y

    def __len__(self) -> int:
        return self.y.shape[0]


@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_fan_chart_of_yearly_series_has_whole_year_ticks(dtype):
    """Years read from a CSV are floats (1871.0): the ticks were 1952.5 and the like."""
    years = np.arange(1871, 1971).astype(dtype)
    series = pd.Series(np.linspace(900, 1100, 100), index=pd.Index(years, name="year"))
    n, horizon = 6, 5
    origins = np.arange(80, 80 + n)  # positions of each forecast's first period
    y = torch.tensor(series.to_numpy()[origins[:, None] + np.arange(horizon)], dtype=torch.float32)
    loc = y[None] + torch.randn(3, n, horizon)  # (S=3, N, H)
    pred = RegressionPrediction(samples=loc, loc=loc, variance=torch.full_like(loc, 100.0))
    meta = {"series": series, "origins": {"test": origins}}
    frame = forecast_frame(pred, _Test(y), meta)
    assert frame.shape == (n * horizon, 7)
    fig = forecast_figure(frame, meta)
    fig.canvas.draw()
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        ticks = ax.get_xticks()
        assert np.all(ticks == ticks.round()), ticks
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert labels and all(label.lstrip("−-").isdigit() for label in labels), labels


def test_interval_lines_flag_coverage_far_from_nominal():
    """The Nile forecast covered 0.39 of 95 points with a 90% interval, and nothing said so."""
    bad = interval_lines({"interval_coverage": 0.39, "num_test_forecasts": 95, "num_samples": 100})
    assert len(bad) == 1 and bad[0].startswith("WARN  90% predictive interval covers 0.390")
    assert "[0.80, 0.99]" in bad[0] and "too narrow" in bad[0]
    good = interval_lines({"interval_coverage": 0.86, "num_test_forecasts": 95})
    assert good[0].startswith("ok    ")
    wide = interval_lines({"interval_coverage": 1.0, "num_test_forecasts": 1000})
    assert wide[0].startswith("WARN") and "wider" in wide[0]
    point = interval_lines({"interval_coverage": 0.85, "num_test_forecasts": 95, "num_samples": 1})
    assert point[1].startswith("info  one posterior draw") and "no epistemic part" in point[1]
