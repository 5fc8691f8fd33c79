"""The likelihood's natural output, and the likelihood at a network linearized in its weights.

``natural_output`` reads the output ``f`` of the network that a likelihood is built from
(logits, or a location) with the Fisher weight the GGN gives it (``inference.laplace``);
``with_output`` rebuilds the likelihood with another ``f``: the GLM predictive of a Laplace
posterior evaluates it at ``f(x, theta*) + J(x) (theta - theta*)`` (Immer, Korzepa & Bauer
2021, "Improving predictions of Bayesian neural nets via local linearization").
"""

from __future__ import annotations

from dataclasses import dataclass

import pyro.distributions as dist
import torch


@dataclass(frozen=True)
class Output:
    """The likelihood's natural output and what the GGN weighs it with.

    Attributes:
        f: ``(*batch, K)`` logits (``K = C``) or ``(*batch, 1)`` locations.
        kind: ``"categorical"``, or ``"location"`` for a Normal or Student-t.
        weight: ``(*batch, 1)`` Fisher weight of a location (``1/sigma^2`` or the Student-t
            one); None for a categorical.
        mask: ``(*batch)`` 0/1 of the positions the likelihood counts.
    """

    f: torch.Tensor
    kind: str
    weight: torch.Tensor | None
    mask: torch.Tensor


def natural_output(fn) -> Output:
    """The ``Output`` of a likelihood distribution ``fn``, through ``.to_event``/``.mask``.

    Raises:
        ValueError: a likelihood other than Categorical, Normal or Student-t.
    """
    masks = []
    inner = fn
    while isinstance(inner, (torch.distributions.Independent, dist.MaskedDistribution)):
        if isinstance(inner, dist.MaskedDistribution):
            masks.append(inner._mask)  # a bool tensor, or a Python bool
        inner = inner.base_dist

    def counted(f: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        out = torch.ones(shape, dtype=f.dtype, device=f.device)
        for mask in masks:
            out = out * torch.as_tensor(mask, device=f.device).to(f.dtype)
        return out

    if isinstance(inner, torch.distributions.Categorical):
        f = inner.logits
        return Output(f, "categorical", None, counted(f, f.shape[:-1]))
    if isinstance(inner, (torch.distributions.Normal, torch.distributions.StudentT)):
        f = inner.loc
        weight = inner.scale.pow(-2).expand(f.shape)
        if isinstance(inner, torch.distributions.StudentT):
            weight = weight * (inner.df + 1) / (inner.df + 3)
        return Output(f[..., None], "location", weight[..., None], counted(f, f.shape))
    raise ValueError(
        f"the Laplace approximation's GGN needs a Categorical, Normal or Student-t likelihood, "
        f"got {type(inner).__name__}"
    )


def with_output(fn, f: torch.Tensor):
    """``fn`` with its natural output replaced by ``f`` (shaped as ``natural_output(fn).f``),
    wrappers kept: the linearized predictive's likelihood."""
    if isinstance(fn, torch.distributions.Independent):
        return with_output(fn.base_dist, f).to_event(fn.reinterpreted_batch_ndims)
    if isinstance(fn, dist.MaskedDistribution):
        return with_output(fn.base_dist, f).mask(fn._mask)
    if isinstance(fn, torch.distributions.Categorical):
        return dist.Categorical(logits=f)
    if isinstance(fn, torch.distributions.StudentT):
        return dist.StudentT(fn.df, f[..., 0], fn.scale)
    return dist.Normal(f[..., 0], fn.scale)


__all__ = ["Output", "natural_output", "with_output"]
