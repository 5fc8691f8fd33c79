"""Variational families for SVI, all Pyro autoguides."""

from __future__ import annotations

from pyro.infer.autoguide import (
    AutoDelta,
    AutoGuide,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
    init_to_sample,
)
from torch import nn

#: Guide names accepted by ``fit_svi(guide=...)``.
GUIDES = ("normal", "lowrank", "mvn", "delta")


def build_guide(kind: str, model: nn.Module, *, init_scale: float = 1e-3) -> AutoGuide:
    """The autoguide ``kind`` for ``model``.

    ``normal``: mean-field ``AutoNormal``; ``lowrank``: ``AutoLowRankMultivariateNormal``;
    ``mvn``: full-rank ``AutoMultivariateNormal``; ``delta``: ``AutoDelta`` (MAP). Locations start
    at a prior draw (``init_to_sample``), which breaks the symmetry between heads and units that a
    zero start would keep; scales start at ``init_scale``.

    Raises:
        ValueError: unknown ``kind`` or non-positive ``init_scale``.
    """
    if not init_scale > 0:
        raise ValueError(f"init_scale must be > 0, got {init_scale}")
    if kind == "normal":
        return AutoNormal(model, init_loc_fn=init_to_sample, init_scale=init_scale)
    if kind == "lowrank":
        return AutoLowRankMultivariateNormal(
            model, init_loc_fn=init_to_sample, init_scale=init_scale
        )
    if kind == "mvn":
        return AutoMultivariateNormal(model, init_loc_fn=init_to_sample, init_scale=init_scale)
    if kind == "delta":
        return AutoDelta(model, init_loc_fn=init_to_sample)
    raise ValueError(f"guide must be one of {GUIDES}, got {kind!r}")
