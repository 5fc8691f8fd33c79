"""forecast(): direct multi-step forecasts with predictive intervals for one series."""

import numpy as np
import pandas as pd
import pytest
import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_svi
from probtransformer.models import SequenceClassifier, SequenceRegressor, forecast

TINY = dict(d_model=8, num_heads=2, num_layers=1, d_ff=8)


@pytest.fixture(scope="module")
def posterior():
    t = torch.arange(200, dtype=torch.float32)
    series = torch.sin(t / 3)
    x = torch.stack([series[i : i + 12] for i in range(180)])[..., None]  # (180, 12, 1)
    y = torch.stack([series[i + 12 : i + 15] for i in range(180)])  # (180, 3)
    model = SequenceRegressor(1, 12, horizon=3, pooling="last", **TINY)
    return fit_svi(model, SequenceData(x, y), num_steps=300, lr=0.02, progress=False), series


def test_forecast_gives_intervals_around_the_continuation(posterior):
    post, series = posterior
    frame = forecast(post, pd.Series(series[:150].numpy()), prob=0.9)
    assert list(frame.columns) == ["step", "mean", "std", "lower", "upper"]
    assert frame["step"].tolist() == [1, 2, 3]
    assert (frame["lower"] < frame["mean"]).all() and (frame["mean"] < frame["upper"]).all()
    truth = series[150:153].numpy()
    assert np.abs(frame["mean"].to_numpy() - truth).max() < 0.5
    # the last max_len steps are what the model reads
    assert frame.equals(forecast(post, series[138:150].numpy()))
    assert len(forecast(post, series[:150], horizon=2)) == 2


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(horizon=4), ValueError, "longer than the 3 steps"),
        (dict(horizon=0), ValueError, "horizon must be an integer >= 1"),
        (dict(history=np.array([0.1, np.nan, 0.3])), ValueError, "drop or impute"),
        (dict(history=np.zeros((5, 2))), ValueError, "(T, F=1)"),
        (dict(history=np.zeros(0)), ValueError, "T >= 1"),
    ],
)
def test_bad_forecast_requests_are_named(posterior, kwargs, error, words):
    post, series = posterior
    kwargs = {"history": series[:20].numpy(), **kwargs}
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        forecast(post, **kwargs)


def test_forecast_needs_a_multi_step_regressor(small_posterior):
    with pytest.raises(TypeError, match="SequenceRegressor with a horizon"):
        forecast(small_posterior, np.zeros(8))
    assert isinstance(small_posterior.model, SequenceClassifier)
