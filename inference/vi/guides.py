"""Variational families for SVI, all Pyro autoguides."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer.autoguide import (
    AutoDelta,
    AutoGuide,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
    init_to_sample,
)
from torch import nn

from probtransformer.attention import LOCAL_LATENT, amortized
from probtransformer.inference._pyro_compat import site_is_subsample

#: Guide names accepted by ``fit_svi(guide=...)``.
GUIDES = ("normal", "lowrank", "mvn", "delta")


def build_guide(
    kind: str,
    model: nn.Module,
    *,
    init_scale: float = 1e-3,
    init_values: dict[str, torch.Tensor] | None = None,
) -> AutoGuide:
    """The autoguide ``kind`` for ``model``.

    ``normal``: mean-field ``AutoNormal``; ``lowrank``: ``AutoLowRankMultivariateNormal``;
    ``mvn``: full-rank ``AutoMultivariateNormal``; ``delta``: ``AutoDelta`` (MAP). Locations start
    at a prior draw (``init_to_sample``), which breaks the symmetry between heads and units that a
    zero start would keep, except where a module declares ``initial_values`` (attention: guidance
    offsets at 0) and where ``init_values`` gives a site's value (a warm start, ``fit_svi``'s
    ``init_from``); scales start at ``init_scale``. A model with local latents (stochastic
    attention) gets an ``AmortizedGuide`` around the ``kind`` guide.

    Raises:
        ValueError: unknown ``kind`` or non-positive ``init_scale``.
    """
    if not init_scale > 0:
        raise ValueError(f"init_scale must be > 0, got {init_scale}")
    if has_local_latents(model):
        return AmortizedGuide(model, kind, init_scale=init_scale)
    return _global_guide(kind, model, init_scale, _init_loc_fn(model, init_values))


def _init_loc_fn(model: nn.Module, given: dict[str, torch.Tensor] | None = None):
    """``init_to_sample``, except for the sites in ``given`` (their values) and sites whose
    module declares ``initial_values`` (e.g. the guidance offsets start at 0, exactly the
    guidance, rather than at a random prior draw that a weak prior lets SVI keep)."""
    values = {
        f"{prefix}.{name}" if prefix else name: value
        for prefix, module in model.named_modules()
        for name, value in getattr(module, "initial_values", {}).items()
    }

    given = given or {}

    def init(site: dict) -> torch.Tensor:
        if site["name"] in given:
            return given[site["name"]].expand(site["fn"].shape()).clone()
        if site["name"] in values:
            shape = site["fn"].shape()
            return torch.full(shape, values[site["name"]], device=site["fn"].mean.device)
        return init_to_sample(site)

    return init


def _global_guide(kind: str, model, init_scale: float, init) -> AutoGuide:
    if kind == "normal":
        return AutoNormal(model, init_loc_fn=init, init_scale=init_scale)
    if kind == "lowrank":
        return AutoLowRankMultivariateNormal(model, init_loc_fn=init, init_scale=init_scale)
    if kind == "mvn":
        return AutoMultivariateNormal(model, init_loc_fn=init, init_scale=init_scale)
    if kind == "delta":
        return AutoDelta(model, init_loc_fn=init)
    raise ValueError(f"guide must be one of {GUIDES}, got {kind!r}")


def has_local_latents(model: nn.Module) -> bool:
    """True when a module of ``model`` samples per-sequence latents (stochastic attention)."""
    return any(getattr(module, "stochastic", False) for module in model.modules())


def _is_local(msg: dict) -> bool:
    return bool(msg["infer"].get(LOCAL_LATENT))


class AmortizedGuide(nn.Module):
    """Global autoguide plus an amortized guide for the local latents of stochastic attention.

    The global latents (weights, scales, offsets) get the autoguide ``kind``. The local latents
    (one attention-logit tensor per sequence) are not given per-sequence parameters: the guide
    runs the model's own network on the inputs, with the global values just drawn, and samples
    each layer's logits from ``N(q·k / sqrt(d_head) + prior terms, s_h)`` — the mean is the
    usual attention logit computed by the network, the scale ``s_h`` a learned per-head
    parameter. The point estimates of this inference network are therefore the model's own
    point-estimate parameters (shared with the model) and ``s_h``; the number of variational
    parameters does not grow with the data, and new sequences get a guide without refitting
    (Kingma & Welling 2014; Fan et al. 2020, Bayesian Attention Modules).

    Args:
        model: a model whose stochastic attention modules sample sites marked ``LOCAL_LATENT``.
        kind: autoguide of the global latents (see ``build_guide``).
        init_scale: initial scale of the global guide.
        init_local_scale: initial ``s_h``.
    """

    def __init__(
        self, model: nn.Module, kind: str, *, init_scale: float, init_local_scale: float = 0.1
    ) -> None:
        super().__init__()
        self._model = (model,)  # not a submodule: its parameters belong to the model
        blocked = poutine.block(model, hide_fn=_is_local)
        self.global_guide = _global_guide(kind, blocked, init_scale, _init_loc_fn(model))
        self.init_local_scale = init_local_scale
        self.local_scales = nn.ParameterDict()

    def local_scale(self, name: str, num_heads: int, device: torch.device) -> torch.Tensor:
        """``(num_heads,)`` positive guide scales of local site ``name`` (created on first use)."""
        key = name.replace(".", "__")
        if key not in self.local_scales:
            raw = math.log(math.expm1(self.init_local_scale))  # softplus^-1
            self.local_scales[key] = nn.Parameter(torch.full((num_heads,), raw, device=device))
        return F.softplus(self.local_scales[key])

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Sample the global latents, then the local ones given them; returns the global values."""
        values = self.global_guide(*args, **kwargs)
        keep = lambda msg: _is_local(msg) or site_is_subsample(msg)  # noqa: E731
        with (
            amortized(self),
            poutine.block(hide_fn=lambda msg: not keep(msg)),
            poutine.condition(data=values),
        ):
            self._model[0](*args, **kwargs)
        return values
