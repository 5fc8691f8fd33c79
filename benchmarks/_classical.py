"""Classical baselines for the task-family benchmark (``benchmarks/studies/task_families.py``).

- ``BigramLM``: character bigram language model with add-k (Lidstone) smoothing, or the ML
  bigram interpolated with an add-one unigram (Jelinek & Mercer 1980); ``k`` / the weight are
  chosen on the validation split by perplexity.
- ``window_features`` + ``fit_window_logreg``: word-boundary tagging by scikit-learn's
  ``LogisticRegression`` on a one-hot (sparse) window of the characters at offsets
  ``-w..+w`` around each position.
- ``seasonal_naive``: the value one season ago, with a Normal forecast distribution whose sd
  per horizon step comes from the training residuals of the same rule.
- ``fit_arima`` / ``arima_forecasts``: statsmodels ``SARIMAX`` fitted once on the training part
  of a series, then applied (same parameters, no refit) to the series up to each forecast
  origin; the forecast distribution is Normal (``get_forecast``).

All probabilities are returned as numpy arrays; forecast distributions as ``(mean, sd)``
arrays of shape ``(origins, H)`` in the units of the series.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import OneHotEncoder

# ---------------------------------------------------------------------------------------------
# Character bigram language model
# ---------------------------------------------------------------------------------------------


@dataclass
class BigramLM:
    """Character bigram model ``P(y | x)`` over ``V`` token ids, fitted from (context, next) pairs.

    ``k`` given: add-k smoothing, ``P(y | x) = (c(x, y) + k) / (c(x) + k V)``.
    ``lam`` given: ``lam * c(x, y) / c(x) + (1 - lam) * P_1(y)`` with the add-one unigram
    ``P_1`` (the ML bigram term is 0 for an unseen context).
    """

    counts: np.ndarray  # (V, V) bigram counts c(x, y)
    unigram: np.ndarray  # (V,) add-one unigram probabilities of the next token
    k: float | None = None
    lam: float | None = None

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, vocab_size: int, **smoothing) -> BigramLM:
        """Count the pairs ``(x[i], y[i])`` (any shapes, flattened) of the training split."""
        pairs = np.asarray(x).ravel() * vocab_size + np.asarray(y).ravel()
        counts = np.bincount(pairs, minlength=vocab_size**2).reshape(vocab_size, vocab_size)
        uni = np.bincount(np.asarray(y).ravel(), minlength=vocab_size) + 1.0
        return cls(counts.astype(np.float64), uni / uni.sum(), **smoothing)

    def with_smoothing(self, **smoothing) -> BigramLM:
        """The same counts with other smoothing (``k=`` or ``lam=``)."""
        return BigramLM(self.counts, self.unigram, **smoothing)

    def table(self) -> np.ndarray:
        """``(V, V)`` conditional probabilities, row = context token."""
        row = self.counts.sum(1, keepdims=True)
        if self.k is not None:
            return (self.counts + self.k) / (row + self.k * self.counts.shape[1])
        ml = np.divide(self.counts, row, out=np.zeros_like(self.counts), where=row > 0)
        return self.lam * ml + (1 - self.lam) * self.unigram

    def log_prob(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``log P(y | x)`` per pair, nats, shape of ``x``."""
        return np.log(self.table()[np.asarray(x), np.asarray(y)])

    def perplexity(self, x: np.ndarray, y: np.ndarray) -> float:
        """``exp`` of the mean per-token NLL over all pairs."""
        return float(np.exp(-self.log_prob(x, y).mean()))


def choose_bigram(train, val, vocab_size: int) -> tuple[BigramLM, list[dict]]:
    """Fit bigram counts on ``train`` and choose the smoothing on ``val`` by perplexity.

    Candidates: add-k with ``k`` in {1e-3, ..., 3} and interpolation weights ``lam`` in
    {0.5, ..., 0.99}. Returns the best model and the validation table (one dict per candidate).
    """
    base = BigramLM.fit(train.x.numpy(), train.y.numpy(), vocab_size)
    candidates = [{"k": k} for k in (1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)]
    candidates += [{"lam": lam} for lam in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)]
    table = []
    for smoothing in candidates:
        model = base.with_smoothing(**smoothing)
        table.append(
            {**smoothing, "val_perplexity": model.perplexity(val.x.numpy(), val.y.numpy())}
        )
    best = min(range(len(table)), key=lambda i: table[i]["val_perplexity"])
    return base.with_smoothing(**candidates[best]), table


# ---------------------------------------------------------------------------------------------
# Word segmentation: logistic regression on a character window
# ---------------------------------------------------------------------------------------------


def window_features(x: np.ndarray, mask: np.ndarray, width: int = 2) -> np.ndarray:
    """Character ids at offsets ``-width..+width`` of every real position, ``(M, 2 width + 1)``.

    Positions outside the sequence or on padding get the id ``-1`` (its own one-hot column).
    Rows are the real positions in row-major order (as ``x[mask]``).
    """
    n, t = x.shape
    padded = np.full((n, t + 2 * width), -1, dtype=np.int64)
    padded[:, width : width + t] = np.where(mask, x, -1)
    cols = [padded[:, width + o : width + o + t][mask] for o in range(-width, width + 1)]
    return np.stack(cols, axis=1)


@dataclass
class WindowLogReg:
    """One-hot window encoder plus ``LogisticRegression``; ``predict_proba`` on (N, T) ids."""

    encoder: OneHotEncoder
    model: LogisticRegression
    width: int

    def predict_proba(self, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """``(M, 2)`` class probabilities of the real positions (row-major, as ``y[mask]``)."""
        features = self.encoder.transform(window_features(x, mask, self.width))
        return self.model.predict_proba(sparse.csr_matrix(features))


def fit_window_logreg(
    x: np.ndarray, y: np.ndarray, mask: np.ndarray, *, width: int = 2, C: float = 1.0
) -> WindowLogReg:
    """Fit ``LogisticRegression(C)`` (lbfgs) on the one-hot windows of the real positions."""
    encoder = OneHotEncoder(handle_unknown="ignore", dtype=np.float64)
    features = encoder.fit_transform(window_features(x, mask, width))
    model = LogisticRegression(C=C, max_iter=2000)
    model.fit(features, y[mask])
    return WindowLogReg(encoder, model, width)


# ---------------------------------------------------------------------------------------------
# Forecasting: seasonal naive and (S)ARIMA
# ---------------------------------------------------------------------------------------------


def seasonal_naive(
    series: np.ndarray, origins: np.ndarray, horizon: int, season: int, train_origins: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Forecast ``series[t + h]`` by ``series[t + h - season]`` (needs ``horizon <= season``).

    The sd of step ``h`` is the root mean square of the rule's residuals at the training
    origins (``series[t + h] - series[t + h - season]``), so the forecast distribution is
    ``Normal(mean, sd[h])``.

    Returns:
        ``(mean, sd)``, each ``(len(origins), horizon)``.
    """
    if horizon > season:
        raise ValueError(f"seasonal naive needs horizon <= season, got {horizon} > {season}")
    steps = np.arange(horizon)

    def rule(ts: np.ndarray) -> np.ndarray:
        return series[ts[:, None] + steps - season]

    resid = series[train_origins[:, None] + steps] - rule(train_origins)  # (n_train, H)
    sd = np.sqrt((resid**2).mean(axis=0))  # (H,)
    mean = rule(origins)
    return mean, np.broadcast_to(sd, mean.shape).copy()


def fit_arima(endog: np.ndarray, order: tuple, seasonal_order: tuple = (0, 0, 0, 0), trend=None):
    """Fit statsmodels ``SARIMAX(order, seasonal_order, trend)`` by maximum likelihood."""
    from statsmodels.tsa.statespace.sarimax import SARIMAX

    model = SARIMAX(endog, order=order, seasonal_order=seasonal_order, trend=trend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence chatter of the optimiser
        return model.fit(disp=False, maxiter=200)


def arima_forecasts(
    result, series: np.ndarray, origins: np.ndarray, horizon: int
) -> tuple[np.ndarray, np.ndarray]:
    """Normal forecasts of ``series[t:t + horizon]`` from ``series[:t]`` for each origin ``t``.

    The fitted parameters of ``result`` are applied to each prefix (``result.apply``, no refit):
    the Kalman filter is re-run on the data up to the origin and ``get_forecast`` gives the
    forecast mean and standard error.

    Returns:
        ``(mean, sd)``, each ``(len(origins), horizon)``.
    """
    means, sds = [], []
    for t in origins:
        forecast = result.apply(series[:t]).get_forecast(horizon)
        means.append(np.asarray(forecast.predicted_mean))
        sds.append(np.asarray(forecast.se_mean))
    return np.stack(means), np.stack(sds)


def normal_samples(mean: np.ndarray, sd: np.ndarray, num: int, seed: int = 0) -> np.ndarray:
    """``(num, *mean.shape)`` draws of ``Normal(mean, sd)``, for ``metrics.crps_samples``."""
    rng = np.random.default_rng(seed)
    return mean + sd * rng.standard_normal((num, *mean.shape))
