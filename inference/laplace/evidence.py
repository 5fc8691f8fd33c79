"""The Gaussian of a Laplace approximation and its marginal likelihood (MacKay 1992).

Around a mode ``theta*`` with prior ``N(m, diag(1/delta))`` and GGN ``G`` of the
log-likelihood (in diagonal blocks, ``inference.laplace.blocks``), the posterior is
``N(theta*, (G + diag(delta))^-1)`` and the log evidence is

    log Z(delta) = log p(D | theta*) - 1/2 sum_i delta_i (theta*_i - m_i)^2
                   + 1/2 sum_i log delta_i - 1/2 log det(G + diag(delta)),

the ``(d/2) log 2 pi`` of prior and Gaussian cancelling (Immer et al. 2021, "Scalable marginal
likelihood estimation for model selection in deep learning", eq. 3). With a Gaussian
likelihood linear in ``theta`` both are exact. ``delta`` is one precision per weight group
(per latent site), chosen by maximizing ``log Z`` over ``log delta`` with L-BFGS: the post-hoc
type-II maximum likelihood of ``laplace-torch``'s ``optimize_prior_precision(method="marglik")``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: ``max |d log Z / d log delta_g|`` (nats) below which the evidence counts as maximized.
GRADIENT_TOLERANCE = 1e-3
#: Bounds of ``log delta``: precisions beyond them mean the data say nothing about the group.
LOG_PRECISION_BOUNDS = (-20.0, 20.0)


def _slices(blocks: list) -> list[slice]:
    out, start = [], 0
    for block in blocks:
        out.append(slice(start, start + block.size))
        start += block.size
    return out


@dataclass
class Gaussian:
    """``N(mean, (G + diag(delta))^-1)`` over the flat subset ``theta`` (float64), ``G`` in
    diagonal blocks (``inference.laplace.blocks``).

    Attributes:
        mean: ``(d,)`` the mode.
        blocks: the GGN's blocks, in the order of ``theta``.
        prior_precision: ``(d,)`` ``delta``.
    """

    mean: torch.Tensor
    blocks: list
    prior_precision: torch.Tensor

    def sample(self, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(num, d)`` draws."""
        eps = torch.randn(num, len(self.mean), dtype=torch.float64, generator=generator)
        parts = [
            block.sample(eps[:, part], self.prior_precision[part])
            for block, part in zip(self.blocks, _slices(self.blocks), strict=True)
        ]
        return self.mean + torch.cat(parts, -1)

    def condition_number(self) -> float:
        """Largest over smallest eigenvalue of the posterior precision."""
        values = torch.cat(
            [
                block.eigenvalues(self.prior_precision[part])
                for block, part in zip(self.blocks, _slices(self.blocks), strict=True)
            ]
        )
        return float(values.max() / values.min())


def log_evidence(
    log_likelihood: float,
    offset: torch.Tensor,
    blocks: list,
    prior_precision: torch.Tensor,
) -> torch.Tensor:
    """``log Z`` (nats) of the module docstring; ``offset = theta* - m`` ``(d,)``,
    ``prior_precision`` ``(d,)``, differentiable in it."""
    logdet = sum(
        block.logdet(prior_precision[part])
        for block, part in zip(blocks, _slices(blocks), strict=True)
    )
    return (
        log_likelihood
        - 0.5 * (prior_precision * offset**2).sum()
        + 0.5 * prior_precision.log().sum()
        - 0.5 * logdet
    )


@dataclass
class Evidence:
    """The maximized evidence.

    Attributes:
        precision: ``(groups,)`` ``delta`` per weight group.
        log_evidence: ``log Z`` at it, nats.
        gradient: ``max |d log Z / d log delta_g|`` there (0 at an interior maximum).
        converged: ``gradient <= GRADIENT_TOLERANCE`` or every group at a bound.
        iterations: L-BFGS function evaluations.
    """

    precision: torch.Tensor
    log_evidence: float
    gradient: float
    converged: bool
    iterations: int


def maximize_evidence(
    log_likelihood: float,
    offset: torch.Tensor,
    blocks: list,
    groups: torch.Tensor,
    initial: torch.Tensor,
    *,
    max_iter: int = 200,
) -> Evidence:
    """``delta`` per group (``groups (d,)`` indexes ``initial (groups,)``) maximizing
    ``log_evidence``, by L-BFGS with a strong-Wolfe line search over ``log delta``, clamped to
    ``LOG_PRECISION_BOUNDS``."""
    low, high = LOG_PRECISION_BOUNDS
    log_delta = initial.double().log().clamp(low, high).clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [log_delta], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe",
        tolerance_grad=GRADIENT_TOLERANCE / 10, tolerance_change=1e-12,
    )  # fmt: skip
    calls = 0

    def closure():
        nonlocal calls
        calls += 1
        optimizer.zero_grad()
        value = -log_evidence(
            log_likelihood, offset, blocks, log_delta.clamp(low, high).exp()[groups]
        )
        value.backward()
        return value

    optimizer.step(closure)
    with torch.no_grad():
        log_delta.clamp_(low, high)
    value = log_evidence(log_likelihood, offset, blocks, log_delta.exp()[groups])
    (grad,) = torch.autograd.grad(value, log_delta)
    value = value.detach()  # float() of a tensor that requires grad warns
    free = (log_delta > low) & (log_delta < high)
    gradient = float(grad[free].abs().max()) if free.any() else 0.0
    return Evidence(
        precision=log_delta.detach().exp(),
        log_evidence=float(value.detach()),
        gradient=gradient,
        converged=math.isfinite(float(value)) and gradient <= GRADIENT_TOLERANCE,
        iterations=calls,
    )


__all__ = [
    "Evidence",
    "GRADIENT_TOLERANCE",
    "Gaussian",
    "LOG_PRECISION_BOUNDS",
    "log_evidence",
    "maximize_evidence",
]
