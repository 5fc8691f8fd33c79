"""The verdict lines of an SVI fit: has its ELBO stopped moving, and has its guide kept any
spread?

Both read what the fit leaves behind (the ELBO trace of ``record["elbo"]``, the fitted guide);
``diagnostics.diagnose`` prints them."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch.distributions import biject_to

#: Tolerance of the ELBO's move between the last two tenths of the steps, nats per observation.
ELBO_CHANGE_PER_OBS_MAX = 0.01
#: How many standard errors of its Monte Carlo noise the move must exceed to count as a trend.
ELBO_NOISE_SIGMAS = 3.0
#: Below this median ratio of guide sd to prior sd (unconstrained space) the posterior has
#: collapsed towards a point. Measured on digits (``benchmarks/BENCHMARKS.md``, issue 44): the
#: main job's early-stopped fit 0.087, fits run to near convergence 0.8-0.9; from
#: ``init_scale=1e-3``, the estimator's 1,000 steps 0.006 and the README's old 300 steps 0.002.
SCALE_RATIO_MIN = 0.05
#: Prior draws that estimate each latent's prior sd.
_PRIOR_DRAWS = 256


def elbo_change_per_obs(elbo: list[float], num_data: int) -> float:
    """``|mean(last tenth) - mean(previous tenth)| / num_data`` of an ELBO trace, in nats.

    Per observation rather than relative to the ELBO, which can be near zero.
    """
    window = max(1, len(elbo) // 10)
    last = float(np.mean(elbo[-window:]))
    previous = float(np.mean(elbo[-2 * window : -window] or elbo[-window:]))
    return abs(last - previous) / num_data


def elbo_noise_per_obs(elbo: list[float], num_data: int) -> float:
    """Standard error of ``elbo_change_per_obs`` from the step-to-step scatter, in nats.

    Each step's ELBO is a Monte Carlo estimate (one mini-batch, the guide's draws); within
    each of the last two tenths (``w`` steps) the scatter ``s`` is the sd of the residuals of
    a fitted line (so a trend does not count as noise), and the standard error of the
    difference of the two means is ``sqrt(s_1**2 / w + s_2**2 / w) / num_data``. NaN for
    fewer than 3 steps per tenth.
    """
    window = len(elbo) // 10
    if window < 3:
        return math.nan
    values = np.asarray(elbo, dtype=float)
    t = np.arange(window)
    variances = []
    for part in (values[-2 * window : -window], values[-window:]):
        residuals = part - np.polyval(np.polyfit(t, part, 1), t)
        variances.append(np.var(residuals, ddof=2) / window)
    return math.sqrt(sum(variances)) / num_data


def elbo_line(elbo: list[float], num_data: int, flag: Callable[[bool, str], str]) -> str:
    """The verdict line of an ELBO trace (nats, full-data scale, one value per step).

    Flags a move between the last two tenths of the steps above ``ELBO_CHANGE_PER_OBS_MAX``
    nats per observation that is also more than ``ELBO_NOISE_SIGMAS`` standard errors of its
    Monte Carlo noise (``elbo_noise_per_obs``): a trend, not noise. A move within the noise
    but above the tolerance is not flagged; the line gives both figures.
    """
    change = elbo_change_per_obs(elbo, num_data)
    noise = elbo_noise_per_obs(elbo, num_data)
    trend = change > ELBO_CHANGE_PER_OBS_MAX and not change <= ELBO_NOISE_SIGMAS * noise
    noise_text = (
        f"Monte Carlo noise ± {noise:.2g}"
        if math.isfinite(noise)
        else "its Monte Carlo noise unknown (fewer than 30 steps)"
    )
    return flag(
        trend,
        f"ELBO {np.mean(elbo[-max(1, len(elbo) // 10) :]):.1f} nats; it moved {change:.3g} nats "
        f"per observation over the last tenth of the steps, {noise_text} (flag > "
        f"{ELBO_CHANGE_PER_OBS_MAX} and > {ELBO_NOISE_SIGMAS:g}x the noise: not converged, the "
        "guide is still moving; fit longer or from a larger init_scale to converge, or keep it "
        "as an early-stopped fit chosen on validation, as probtransformer fit's default is)",
    )


def guide_scale_ratio(posterior, num_samples: int = 100, *, seed: int = 0) -> float:
    """Median over the latent scalars of the guide's sd over the prior's sd.

    Both sds are taken in the unconstrained space the guide works in (``biject_to`` of each
    prior's support: a LogNormal scale's log, a Normal weight itself): the guide's from
    ``posterior.draws(num_samples, seed=seed)`` (the fit's own parameters, never the global
    param store's), the prior's from ``_PRIOR_DRAWS`` draws of the priors the guide recorded
    in its ``prototype_trace``; the caller's RNG is left as it was.

    Args:
        posterior: an SVI ``Posterior`` (``AutoNormal``, ``AutoLowRankMultivariateNormal``,
            ``AutoMultivariateNormal``, or an ``AmortizedGuide``'s global guide).
        num_samples: guide draws, at least 2.
        seed: seeds both sets of draws.

    Returns:
        The ratio (1: the prior's spread; near 0: a point), NaN when the guide has no
        prototype trace or no global latent with a positive prior sd.
    """
    guide = posterior.guide
    trace = getattr(getattr(guide, "global_guide", guide), "prototype_trace", None)
    if trace is None:
        return math.nan
    draws = posterior.draws(max(2, num_samples), seed=seed)  # {site: (1, draw, *shape)}
    ratios = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for name, site in trace.nodes.items():
            if site["type"] != "sample" or site["is_observed"] or name not in draws:
                continue
            prior = site["fn"]
            to_unconstrained = biject_to(prior.support).inv
            guided = to_unconstrained(draws[name].flatten(0, 1)).std(0).cpu()
            spread = to_unconstrained(prior.sample((_PRIOR_DRAWS,))).std(0).cpu()
            if guided.shape != spread.shape:  # a latent kept per row, say: no prior to match
                continue
            ratios.append((guided / spread)[spread > 0].flatten())
    values = torch.cat(ratios) if ratios else torch.zeros(0)
    return float(values.median()) if values.numel() else math.nan


def collapse_line(ratio: float, init_scale: float | None, flag: Callable[[bool, str], str]) -> str:
    """The verdict line of ``guide_scale_ratio``: flagged below ``SCALE_RATIO_MIN``.

    Args:
        ratio: ``guide_scale_ratio`` of the fit.
        init_scale: the fit's ``init_scale`` (named in the advice), or None.
        flag: ``diagnostics._flag``.
    """
    start = f" (they started at init_scale {init_scale:g})" if init_scale is not None else ""
    return flag(
        ratio < SCALE_RATIO_MIN,
        f"guide sd / prior sd {ratio:.3g}, median over the latents (flag < {SCALE_RATIO_MIN}: "
        "the posterior has collapsed towards a point; its epistemic uncertainty, "
        "predict_uncertainty and abstention mean little, since the scales are where the "
        f"optimiser left them{start}; fit with more steps or a larger init_scale, or read "
        "it as a MAP fit)",
    )
