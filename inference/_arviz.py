"""Every ArviZ call of the package goes through this module (ArviZ 0.x API, arviz>=0.21,<1)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # ArviZ 0.2x announces its 1.0 refactor
    import arviz as az


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
