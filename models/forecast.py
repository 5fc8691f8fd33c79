"""Forecasts from a fitted ``SequenceRegressor``/``Seq2Seq`` posterior for one series."""

from __future__ import annotations

import numbers
import warnings

import numpy as np
import pandas as pd
import torch

from probtransformer.models.regression import _RegressionModel


def forecast(
    posterior,
    history,
    *,
    horizon: int | None = None,
    prob: float = 0.9,
    num_samples: int = 100,
    seed: int = 0,
) -> pd.DataFrame:
    """Forecast the next ``horizon`` steps after ``history`` with predictive intervals.

    The model reads the last ``max_len`` steps of ``history`` (in the data's units, as in
    training) and gives the posterior predictive of the next ``H`` values it was built for.

    Args:
        posterior: ``Posterior`` of a ``SequenceRegressor`` with a ``horizon`` or a ``Seq2Seq``.
        history: the past, oldest first: ``(T,)`` for one feature or ``(T, F)``; numpy, torch or
            pandas (a Series or DataFrame; its values are used).
        horizon: steps to return, ``1 <= horizon <= H`` (default ``H``).
        prob: probability of the predictive interval, in (0, 1).
        num_samples: posterior draws.
        seed: seeds the draws.

    Returns:
        DataFrame with one row per step ``1..horizon``: ``step``, ``mean``, ``std``, ``lower``,
        ``upper`` (the ``prob`` predictive interval, noise included), in the data's units.

    Warns:
        UserWarning: ``history`` shorter than the ``max_len`` steps the model was trained on.

    Raises:
        TypeError: ``posterior`` not of a multi-step regression model.
        ValueError: a horizon longer than the model was built for, history with NaN/inf (drop
            or impute first), shorter than 1 step, or with the wrong number of features.
    """
    model = getattr(posterior, "model", None)
    if not isinstance(model, _RegressionModel) or model.horizon is None:
        raise TypeError(
            "forecast needs the Posterior of a SequenceRegressor with a horizon or a Seq2Seq, "
            f"got one of {type(model).__name__}"
        )
    horizon = model.horizon if horizon is None else horizon
    if isinstance(horizon, bool) or not isinstance(horizon, numbers.Integral) or horizon < 1:
        raise ValueError(f"horizon must be an integer >= 1, got {horizon!r}")
    if horizon > model.horizon:
        raise ValueError(
            f"horizon {horizon} is longer than the {model.horizon} steps the model was built "
            "for: fit a model with a longer horizon (forecasts are direct, not iterated)"
        )
    values = history.to_numpy() if isinstance(history, pd.Series | pd.DataFrame) else history
    x = torch.as_tensor(np.asarray(values, dtype=np.float32))
    if x.dim() == 1:
        x = x[:, None]
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != model.in_features:
        raise ValueError(
            f"history must be (T,) or (T, F={model.in_features}) with T >= 1, got shape "
            f"{tuple(x.shape)}"
        )
    if not torch.isfinite(x).all():
        raise ValueError(
            f"history holds {int((~torch.isfinite(x)).sum())} NaN/inf values: the model cannot "
            "take gaps; drop or impute them (e.g. pandas interpolate) first"
        )
    if x.shape[0] < model.max_len:
        warnings.warn(
            f"history has {x.shape[0]} steps but the model was trained on {model.max_len}: "
            "forecasts from a shorter context may be poor",
            stacklevel=2,
        )
    pred = posterior.predict(x[-model.max_len :][None], num_samples=num_samples, seed=seed)
    lower, upper = pred.predictive_interval(prob)
    return pd.DataFrame(
        {
            "step": np.arange(1, horizon + 1),
            "mean": pred.mean[0, :horizon].numpy(),
            "std": pred.std[0, :horizon].numpy(),
            "lower": lower[0, :horizon].numpy(),
            "upper": upper[0, :horizon].numpy(),
        }
    )
