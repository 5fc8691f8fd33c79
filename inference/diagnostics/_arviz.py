"""Every ArviZ call of the package goes through this module: ArviZ 0.x (arviz>=0.21,<1) for
InferenceData, HDI, LOO and PSIS; arviz-stats' array interface (``arviz_stats.base.array_stats``,
arviz-stats>=0.8,<0.9) for R-hat, nested R-hat and ESS on ``(chain, draw, ...)`` arrays."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from arviz_stats.base import array_stats

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # ArviZ 0.2x announces its 1.0 refactor
    import arviz as az

#: Tail ESS is the smaller ESS of the 5% and 95% quantiles (Vehtari et al. 2021; ArviZ's default).
TAIL_PROBS = (0.05, 0.95)


def hdi(samples: torch.Tensor, prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HDI over the (chain, draw) dims of ``samples (chain, draw, *shape)`` -> two ``shape``."""
    dataset = az.convert_to_dataset(samples.detach().cpu().numpy())
    interval = az.hdi(dataset, hdi_prob=prob)["x"].values  # (*shape, 2)
    lower = torch.from_numpy(np.ascontiguousarray(interval[..., 0]))
    upper = torch.from_numpy(np.ascontiguousarray(interval[..., 1]))
    return lower, upper


def pareto_khat(log_weights: torch.Tensor) -> float:
    """Pareto k̂ of the tail of importance weights (PSIS, Vehtari et al. 2024), via ArviZ."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ArviZ warns when k̂ > 0.7; the caller reports it
        _, k_hat = az.psislw(log_weights.detach().cpu().double().numpy())
    return float(k_hat)


def rhat(values: np.ndarray) -> np.ndarray:
    """Rank-normalised split R-hat (Vehtari et al. 2021) of ``values (chain, draw, *shape)``.

    Returns:
        ``shape`` array; NaN where there are fewer than 2 chains or 4 draws, or the draws are
        constant.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constant draws: 0/0, reported as NaN
        return np.asarray(array_stats.rhat(values, chain_axis=0, draw_axis=1, method="rank"))


def rhat_nested(values: np.ndarray, superchain: np.ndarray) -> np.ndarray:
    """Rank-normalised split nested R-hat of ``values (chain, draw, *shape)``.

    Chains that share a start form a superchain; nested R-hat compares the superchains'
    means with the variance within them, so it applies to many short chains (Margossian et al.
    2024, "Nested R-hat: assessing the convergence of Markov chain Monte Carlo when running
    many short chains").

    Args:
        values: ``(chain, draw, *shape)`` draws.
        superchain: ``(chain,)`` superchain label of each chain (any hashable ints).

    Returns:
        ``shape`` array; NaN where there are fewer than 4 draws or the draws are constant.

    Raises:
        ValueError: ``superchain`` not of length ``chain``, fewer than 2 superchains, or
            superchains of different numbers of chains.
    """
    labels = np.asarray(superchain)
    if labels.shape != values.shape[:1]:
        raise ValueError(
            f"superchain must give one label per chain, shape ({values.shape[0]},), got "
            f"{labels.shape}"
        )
    _, ids, counts = np.unique(labels, return_inverse=True, return_counts=True)
    if len(counts) < 2 or counts.min() != counts.max():
        raise ValueError(
            "nested R-hat needs 2 or more superchains of equal numbers of chains, got "
            f"superchain sizes {counts.tolist()}"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(
            array_stats.rhat_nested(values, ids, method="rank", chain_axis=0, draw_axis=1)
        )


def ess(values: np.ndarray, method: str) -> np.ndarray:
    """Bulk or tail ESS (Vehtari et al. 2021) of ``values (chain, draw, *shape)``, pooled over
    the chains, in draws.

    Args:
        values: ``(chain, draw, *shape)`` draws.
        method: ``"bulk"`` (rank-normalised) or ``"tail"`` (the smaller of the 5% and 95%
            quantile ESS).

    Returns:
        ``shape`` array; NaN where there are fewer than 4 draws per chain.

    Raises:
        ValueError: another ``method``.
    """
    if method not in ("bulk", "tail"):
        raise ValueError(f"method must be 'bulk' or 'tail', got {method!r}")
    prob = TAIL_PROBS if method == "tail" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(
            array_stats.ess(values, chain_axis=0, draw_axis=1, method=method, prob=prob)
        )
