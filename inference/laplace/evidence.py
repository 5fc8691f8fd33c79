"""The Gaussian of a Laplace approximation and its marginal likelihood (MacKay 1992).

Around a mode ``theta*`` with prior ``N(m, diag(1/delta))`` and GGN ``G`` of the
log-likelihood, the posterior is ``N(theta*, (G + diag(delta))^-1)`` and the log evidence is

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


@dataclass
class Gaussian:
    """``N(mean, precision^-1)`` over the flat subset ``theta`` (float64).

    Attributes:
        mean: ``(d,)`` the mode.
        ggn: ``(d, d)`` or ``(d,)``: the likelihood's curvature.
        prior_precision: ``(d,)`` ``delta``.
    """

    mean: torch.Tensor
    ggn: torch.Tensor
    prior_precision: torch.Tensor

    @property
    def full(self) -> bool:
        return self.ggn.dim() == 2

    def precision(self) -> torch.Tensor:
        """``G + diag(delta)``: ``(d, d)`` full, ``(d,)`` diagonal."""
        if self.full:
            return self.ggn + torch.diag(self.prior_precision)
        return self.ggn + self.prior_precision

    def covariance(self) -> torch.Tensor:
        """``(d, d)`` (full) or ``(d,)`` (diagonal) covariance."""
        precision = self.precision()
        return (
            torch.cholesky_inverse(torch.linalg.cholesky(precision)) if self.full else 1 / precision
        )

    def sample(self, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(num, d)`` draws: ``mean + L^-T eps`` with ``precision = L L^T``."""
        eps = torch.randn(num, len(self.mean), dtype=torch.float64, generator=generator)
        precision = self.precision()
        if not self.full:
            return self.mean + eps / precision.sqrt()
        chol = torch.linalg.cholesky(precision)
        return self.mean + torch.linalg.solve_triangular(chol.mT, eps.mT, upper=True).mT

    def condition_number(self) -> float:
        """Largest over smallest eigenvalue of the posterior precision."""
        precision = self.precision()
        values = torch.linalg.eigvalsh(precision) if self.full else precision
        return float(values.max() / values.min())


def log_evidence(
    log_likelihood: float,
    offset: torch.Tensor,
    ggn: torch.Tensor,
    prior_precision: torch.Tensor,
) -> torch.Tensor:
    """``log Z`` (nats) of the module docstring; ``offset = theta* - m`` ``(d,)``,
    ``prior_precision`` ``(d,)``, differentiable in it."""
    if ggn.dim() == 2:
        logdet = 2 * torch.linalg.cholesky(ggn + torch.diag(prior_precision)).diagonal().log().sum()
    else:
        logdet = (ggn + prior_precision).log().sum()
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
    ggn: torch.Tensor,
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
        value = -log_evidence(log_likelihood, offset, ggn, log_delta.clamp(low, high).exp()[groups])
        value.backward()
        return value

    optimizer.step(closure)
    with torch.no_grad():
        log_delta.clamp_(low, high)
    value = log_evidence(log_likelihood, offset, ggn, log_delta.exp()[groups])
    (grad,) = torch.autograd.grad(value, log_delta)
    value = value.detach()  # float() of a tensor that requires grad warns
    free = (log_delta > low) & (log_delta < high)
    gradient = float(grad[free].abs().max()) if free.any() else 0.0
    return Evidence(
        precision=log_delta.detach().exp(),
        log_evidence=float(value),
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
