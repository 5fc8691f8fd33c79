"""Warm starts of SVI: a fit that begins where an earlier fit of the same model ended
(``fit_svi(init_from=...)``, e.g. from ``fit_map``)."""

from __future__ import annotations

import torch

from probtransformer.inference.posterior.draws import DEFAULT_NUM_SAMPLES
from probtransformer.inference.posterior.posterior import Posterior
from probtransformer.inference.vi.guides import has_local_latents


def warm_start(model: torch.nn.Module, init_from: Posterior, device) -> dict[str, torch.Tensor]:
    """Copy ``init_from``'s point-estimate parameters into ``model`` (in place) and return its
    posterior mean of each global latent site ``{site: (*shape)}``, where the guide starts.

    Raises:
        TypeError: ``init_from`` is not a ``Posterior``.
        ValueError: ``init_from`` is of a model of another class or config, of an ensemble (one
            parameter set per member), or of a model with local latents (stochastic attention,
            whose amortized guide has no per-site locations).
    """
    if not isinstance(init_from, Posterior):
        raise TypeError(
            "init_from must be a fitted Posterior (e.g. of fit_map), got "
            f"{type(init_from).__name__}"
        )
    source = init_from.model
    if type(source) is not type(model):
        raise ValueError(
            f"init_from is a posterior of {type(source).__name__}, this fit's model is a "
            f"{type(model).__name__}: warm-start from a fit of the same model"
        )
    ours, theirs = getattr(model, "config", {}), getattr(source, "config", {})
    differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    if differ:
        raise ValueError(
            f"init_from's model differs from this fit's in {differ} (e.g. {differ[0]}: "
            f"{theirs.get(differ[0])!r:.60} against {ours.get(differ[0])!r:.60}): warm-start "
            "from a fit of the same model"
        )
    if init_from.members is not None:
        raise ValueError(
            "init_from is an ensemble, with one set of parameters per member: warm-start from "
            "one fit (fit_map)"
        )
    if has_local_latents(model):
        raise ValueError(
            "init_from cannot start a model with stochastic attention: its amortized guide has "
            "no per-site locations to start"
        )
    with torch.no_grad():
        parameters = dict(model.named_parameters())
        for name, value in source.named_parameters():
            parameters[name].copy_(value.to(device))
    draws = init_from.draws(None if init_from.samples is not None else DEFAULT_NUM_SAMPLES)
    return {k: v.flatten(0, 1).mean(0).to(device) for k, v in draws.items()}
