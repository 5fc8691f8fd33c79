"""The ELBO of ``fit_svi``: the mean-field ELBO without the log densities it does not use, and
the error, naming the offending site, raised when the ELBO or its gradient is not finite."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pyro
import torch
from pyro import poutine
from pyro.infer import TraceMeanField_ELBO
from torch.distributions import kl_divergence

from probtransformer.inference._pyro_compat import (
    check_mean_field_requirement,
    get_importance_trace,
    is_validation_enabled,
    prune_subsample_sites,
    scale_and_mask,
)

if TYPE_CHECKING:
    from probtransformer.inference.posterior.posterior import Posterior


#: What ``NonFiniteELBOError``'s message advises (the CLI names its own option instead).
NON_FINITE_ADVICE = "try a lower lr, a smaller init_scale, or tighter priors"


class NonFiniteELBOError(FloatingPointError):
    """The ELBO or its gradient became NaN/inf during a fit.

    Attributes:
        step: the optimisation step (0-based) at which it happened.
        site: the first sample site or parameter found non-finite, or None.
        posterior: the fit with the parameters whose loss was last finite (those of step
            ``step - 1``), set by ``fit_svi``; None when raised elsewhere.
    """

    def __init__(self, message: str, *, step: int, site: str | None) -> None:
        super().__init__(message)
        self.step = step
        self.site = site
        self.posterior: Posterior | None = None


class MeanFieldELBO(TraceMeanField_ELBO):
    """``pyro.infer.TraceMeanField_ELBO`` that skips the latent sites' log densities when their
    KL term is analytic.

    Pyro's ``TraceMeanField_ELBO`` evaluates the log density of every site of the model and
    guide traces (``Trace.compute_log_prob`` / ``compute_score_parts``) and then uses only the
    observed sites' and those of latent sites without a closed-form KL divergence: for the
    Gaussian projection sites of a Transformer (tens of thousands of weights) that is wasted
    work on every step. This subclass computes the log density of the observed sites, and of a
    latent site only when ``torch.distributions.kl_divergence`` has no rule for its guide and
    prior (e.g. a transformed guide on a positive site), the estimate
    ``log p(z) - log q(z)`` then standing in for ``-KL`` exactly as in Pyro. The loss and its
    gradients equal ``TraceMeanField_ELBO``'s (tested). The validation checks of
    ``get_importance_trace`` (model/guide match, site shapes, reparametrisation) run whenever
    Pyro's validation is enabled.

    Args and shapes: as ``pyro.infer.TraceMeanField_ELBO`` (Roeder et al. 2017 and Pyro's
    docs for when the mean-field ELBO applies). It overrides the private ``_get_trace`` and
    ``_differentiable_loss_particle`` of Pyro's class (pinned in ``_pyro_compat``'s test).
    """

    def _get_trace(self, model, guide, args, kwargs):
        model_trace, guide_trace = _importance_trace_observed_only(
            self.max_plate_nesting, model, guide, args, kwargs
        )
        if is_validation_enabled():
            check_mean_field_requirement(model_trace, guide_trace)
        return model_trace, guide_trace

    def _differentiable_loss_particle(self, model_trace, guide_trace):
        elbo_particle = 0.0
        for name, model_site in model_trace.nodes.items():
            if model_site["type"] != "sample":
                continue
            if model_site["is_observed"]:
                elbo_particle = elbo_particle + model_site["log_prob_sum"]
                continue
            guide_site = guide_trace.nodes[name]
            try:
                kl = kl_divergence(guide_site["fn"], model_site["fn"])
            except NotImplementedError:  # estimate: log p(z) - log q(z) at the guide's draw
                kl = guide_site["fn"].log_prob(guide_site["value"]) - model_site["fn"].log_prob(
                    guide_site["value"]
                )
            elbo_particle = elbo_particle - _scaled_sum(kl, guide_site)
        for name, guide_site in guide_trace.nodes.items():  # auxiliary guide sites
            if guide_site["type"] == "sample" and name not in model_trace.nodes:
                log_q = guide_site["fn"].log_prob(guide_site["value"])
                elbo_particle = elbo_particle - _scaled_sum(log_q, guide_site)
        return -elbo_particle.item(), -elbo_particle


def _scaled_sum(term, site) -> object:
    return scale_and_mask(term, scale=site["scale"], mask=site["mask"]).sum()


def _importance_trace_observed_only(max_plate_nesting, model, guide, args, kwargs):
    """``pyro.infer.enum.get_importance_trace`` with log densities of observed sites only.

    With validation enabled, the full Pyro function runs instead (its checks need every
    site's log density), so the first, validated step of a fit checks everything.
    """
    if is_validation_enabled():
        return get_importance_trace("flat", max_plate_nesting, model, guide, args, kwargs)
    guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
    replayed = poutine.replay(model, trace=guide_trace)
    model_trace = poutine.trace(replayed).get_trace(*args, **kwargs)
    guide_trace = prune_subsample_sites(guide_trace)
    model_trace = prune_subsample_sites(model_trace)
    model_trace.compute_log_prob(site_filter=lambda _, site: site["is_observed"])
    return model_trace, guide_trace


def non_finite_error(
    model: torch.nn.Module,
    guide: torch.nn.Module,
    args: tuple,
    num_data: int,
    step: int,
    value: float,
) -> NonFiniteELBOError:
    """The error for a non-finite step, naming the first offending site or parameter.

    Args:
        model, guide: the fit's model and guide.
        args: the step's ``(x, y, mask)`` mini-batch.
        num_data: training-set size ``N``.
        step: the step (0-based).
        value: the step's loss (nats), NaN when the evaluation itself failed.
    """
    site = _first_non_finite_site(model, guide, args, num_data)
    what = "ELBO" if not math.isfinite(value) else "ELBO gradient"
    return NonFiniteELBOError(
        f"{what} became non-finite at step {step}"
        + (f" (first non-finite: {site})" if site else "")
        + f"; {NON_FINITE_ADVICE}",
        step=step,
        site=site,
    )


def _first_non_finite_site(model, guide, args, num_data) -> str | None:
    for name, param in list(model.named_parameters()) + list(guide.named_parameters()):
        if not torch.isfinite(param).all():
            return f"parameter {name!r}"
        if param.grad is not None and not torch.isfinite(param.grad).all():
            return f"gradient of parameter {name!r}"
    with torch.no_grad(), pyro.validation_enabled(False):
        guide_trace = poutine.trace(guide).get_trace(*args, num_data=num_data)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(
            *args, num_data=num_data
        )
        for trace in (guide_trace, model_trace):
            trace.compute_log_prob()
            for name, site in trace.nodes.items():
                if site["type"] != "sample":
                    continue
                if not torch.isfinite(site["value"]).all():
                    return f"sample site {name!r} (value)"
                if not torch.isfinite(site["log_prob_sum"]).all():
                    return f"sample site {name!r} (log density)"
    return None


__all__ = ["MeanFieldELBO", "NonFiniteELBOError", "non_finite_error"]
