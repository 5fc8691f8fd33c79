"""Quantiles of the posterior predictive of a regression: the equal-weight mixture of the ``S``
per-draw likelihoods ``p(y | x, data) ~= (1/S) sum_s p(y | x, theta_s)``.

Each draw's likelihood is a location-scale Student-t, ``loc_s + scale_s * t_df`` (``df = inf``:
a Normal). The mixture has no closed-form quantile, but its CDF is the mean of the draws' CDFs
and increases in ``y``, so each quantile is found by bisection between the smallest and the
largest of the draws' own quantiles (the mixture CDF is at most ``q`` at the first and at least
``q`` at the second). This replaces the quantiles of one sampled ``y`` per draw, which give an
interval of zero width for one draw and a noisy one for a few.
"""

from __future__ import annotations

import math

import torch

#: Most bisection steps: the bracket shrinks by 2**-60, below float64 resolution of any bracket
#: (it stops earlier once every bracket is narrower than 1e-12 of the values' magnitude).
BISECTION_STEPS = 60


def _standard_cdf(z: torch.Tensor, df: float) -> torch.Tensor:
    """CDF of the standard Normal (``df = inf``) or Student-t with ``df`` degrees of freedom."""
    if math.isinf(df):
        return torch.special.ndtr(z)
    from scipy.special import stdtr

    return torch.as_tensor(stdtr(df, z.numpy()), dtype=torch.float64)


def standard_quantile(q: torch.Tensor, df: float) -> torch.Tensor:
    """Quantiles ``q`` (float64, any shape, in (0, 1)) of the standard Normal (``df = inf``) or
    Student-t with ``df`` degrees of freedom."""
    if math.isinf(df):
        return torch.special.ndtri(q)
    from scipy.special import stdtrit

    return torch.as_tensor(stdtrit(df, q.numpy()), dtype=torch.float64)


def mixture_quantile(loc: torch.Tensor, scale: torch.Tensor, q: float, *, df: float = math.inf):
    """Quantile ``q`` of the equal-weight mixture of ``S`` location-scale Student-t's, per entry.

    The mixture of entry ``i`` is ``(1/S) sum_s StudentT(df, loc[s, i], scale[s, i])``
    (``df = inf``: Normal), the posterior predictive of a regression from ``S`` draws when each
    draw's likelihood is that distribution. A draw of scale 0 is a point mass at its ``loc``.

    Args:
        loc: ``(S, ...)`` each draw's location.
        scale: ``(S, ...)`` each draw's scale (>= 0), same shape as ``loc``.
        q: probability in (0, 1).
        df: degrees of freedom > 0 (``math.inf``: Normal).

    Returns:
        ``(...)`` float64 quantiles ``x`` with ``mean_s CDF_s(x) = q`` (to float64 resolution);
        for one draw, that draw's own quantile ``loc + scale * t_df(q)``.

    Raises:
        ValueError: shapes that differ or no draws, a negative or non-finite scale, ``q`` not in
            (0, 1), ``df`` not > 0.
    """
    if loc.shape != scale.shape or loc.dim() == 0 or loc.shape[0] == 0:
        raise ValueError(
            f"loc and scale must both have shape (S, ...) with S >= 1, got {tuple(loc.shape)} "
            f"and {tuple(scale.shape)}"
        )
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), got {q!r}")
    if not df > 0:
        raise ValueError(f"df must be > 0 (math.inf for a Normal), got {df!r}")
    loc, scale = loc.detach().cpu().double(), scale.detach().cpu().double()
    if not (torch.isfinite(scale).all() and (scale >= 0).all()):
        raise ValueError("scale must be finite and >= 0 everywhere")
    own = loc + scale * float(standard_quantile(torch.tensor(q, dtype=torch.float64), df))
    # (S, ...) each draw's own quantile
    lower, upper = own.min(0).values, own.max(0).values  # (...) mixture CDF <= q, >= q
    if loc.shape[0] == 1:
        return lower
    point = scale == 0
    safe = torch.where(point, 1.0, scale)
    tolerance = 1e-12 * float(own.abs().max() + scale.max())  # float64 resolution, y's units
    for _ in range(BISECTION_STEPS):
        if float((upper - lower).max()) <= tolerance:
            break
        middle = (lower + upper) / 2
        z = (middle - loc) / safe  # (S, ...)
        cdf = torch.where(point, (middle >= loc).double(), _standard_cdf(z, df)).mean(0)
        below = cdf < q
        lower = torch.where(below, middle, lower)
        upper = torch.where(below, upper, middle)
    return (lower + upper) / 2
