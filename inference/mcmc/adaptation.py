"""The metric of the many-chain HMC kernel (ChEES): Stan's warm-up windows and its regularised
diagonal and dense mass-matrix estimates, taken within groups of chains (superchains: chains
that share a start sit in one mode, and the distance between modes is not the posterior's scale
around each)."""

from __future__ import annotations

import torch

#: The most unconstrained scalars a dense mass matrix is adapted for: it holds D x D float64
#: numbers and each leapfrog step multiplies the K chains' momenta by it.
MAX_DENSE_DIM = 4096


def warmup_windows(num_warmup: int) -> list[tuple[int, int]]:
    """``(start, end)`` transitions (1-based, start exclusive) of the mass-matrix windows:
    Stan's schedule (initial buffer 75, windows 25, 50, 100, ..., final buffer 50), scaled to
    15% / 65% / 20% of a short warm-up (the step size settles in the final buffer); none below
    20 transitions."""
    if num_warmup < 20:
        return []
    start, end = 75, num_warmup - 50
    if start + 25 > end:
        start, end = int(0.15 * num_warmup), int(0.8 * num_warmup)
    windows, size = [], 25
    while start < end:
        stop = start + size
        if stop + 2 * size > end:  # the last window runs to the end buffer
            stop = end
        windows.append((start, stop))
        start, size = stop, 2 * size
    return windows


def regularized_variance(
    total: torch.Tensor, squares: torch.Tensor, n: int, groups: torch.Tensor | None = None
) -> torch.Tensor:
    """Stan's regularised diagonal metric ``n/(n+5) var + 1e-3 * 5/(n+5)`` from per-chain sums
    of ``n`` draws each and of their squares (``(K, D)`` each, float64).

    ``var`` is the variance within the ``groups`` (``(K,)`` superchain indices; None: one
    group), pooled over them: chains of different superchains may sit in different modes, and
    the distance between modes is not the posterior's scale within one."""
    if groups is None:
        groups = torch.zeros(len(total), dtype=torch.long, device=total.device)
    counts = torch.bincount(groups).to(total.dtype)
    group_total = total.new_zeros(len(counts), total.shape[1]).index_add_(0, groups, total)
    used = counts > 0
    between = (group_total[used].square() / (n * counts[used, None])).sum(0)
    squared_deviation = squares.sum(0) - between
    draws = n * len(total)
    var = squared_deviation / max(draws - int(used.sum()), 1)
    return (draws / (draws + 5.0) * var + 1e-3 * 5.0 / (draws + 5.0)).clamp_min(1e-8)


def check_dense_dim(dim: int) -> None:
    """Refuse a dense metric for more than ``MAX_DENSE_DIM`` unconstrained scalars.

    Raises:
        ValueError: ``dim > MAX_DENSE_DIM``, with the metric's size.
    """
    if dim > MAX_DENSE_DIM:
        raise ValueError(
            f"a dense mass matrix is adapted for at most {MAX_DENSE_DIM} unconstrained "
            f"scalars; this posterior has {dim} (its metric would take "
            f"{dim**2 * 8 / 2**20:.0f} MiB): use the diagonal one (full_mass=False)"
        )


def regularized_covariance(draws: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """Stan's regularised dense metric ``n/(n+5) Σ + 1e-3 * 5/(n+5) I`` from window ``draws``
    ``(n, K, D)``, ``Σ`` the covariance within the ``groups`` (``(K,)`` superchain indices;
    None: one group) pooled over them. ``(D, D)`` float64.

    No shrinkage towards the diagonal: it would add the long directions' variance to the narrow
    ones, the directions a dense metric is for (a ridge of sds 10 and 0.1 would get a metric
    several times too wide across it, and a step size to match). Directions a window has not
    explored get a small variance, which slows them but keeps the leapfrog stable."""
    n, chains, dim = draws.shape
    x = draws.double()
    chain_means = x.mean(0)
    x = (x - (chain_means - centered(chain_means, groups))).reshape(n * chains, dim)
    num_groups = 1 if groups is None else len(torch.unique(groups))
    total = n * chains
    covariance = x.T @ x / max(total - num_groups, 1)
    eye = torch.eye(dim, dtype=covariance.dtype, device=covariance.device)
    return total / (total + 5.0) * covariance + 1e-3 * 5.0 / (total + 5.0) * eye


def centered(x: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``(K, D)`` less the mean of its row's group (``(K,)`` indices; None: of all rows)."""
    if groups is None:
        return x - x.mean(0)
    counts = torch.bincount(groups).clamp_min(1).to(x.dtype)
    means = x.new_zeros(len(counts), x.shape[1]).index_add_(0, groups, x) / counts[:, None]
    return x - means[groups]


__all__ = [
    "MAX_DENSE_DIM",
    "centered",
    "check_dense_dim",
    "regularized_covariance",
    "regularized_variance",
    "warmup_windows",
]
