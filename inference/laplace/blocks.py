"""Diagonal blocks of a Laplace posterior's precision ``G + diag(delta)``: what the evidence
(``log det``), the draws and the conditioning need of each, in float64.

- ``FullBlock``: the exact GGN block ``(b, b)``; Cholesky.
- ``DiagBlock``: its diagonal ``(b,)``.
- ``KronBlock``: ``G ~ (F_out kron F_in) / t`` for a weight of shape ``(out, in)`` (all dims
  but the last, the last), with ``F_out = sum_r V_r V_r^T``, ``F_in = sum_r V_r^T V_r`` and
  ``t = sum_r ||V_r||_F^2`` over the rows ``V_r = (Lambda^(1/2) J)_r`` reshaped to
  ``(out, in)``: one step, from the identity, of the power iteration for the nearest Kronecker
  product of the exact block (Van Loan & Pitsianis 1993; as KPSVD, Koroko et al. 2022),
  trace-matched, and exact when each ``V_r`` has rank one (one token: K-FAC's ``g a^T``,
  Martens & Grosse 2015). With one precision ``delta`` for the block its eigenvalues are
  ``lambda_out_i lambda_in_j / t + delta``, so ``log det`` and draws cost two small
  eigendecompositions (Ritter, Botev & Barber 2018).

Each block's ``delta`` is ``(b,)``; a ``KronBlock`` uses its mean (one prior precision per site,
as the evidence chooses it).
"""

from __future__ import annotations

import torch


class FullBlock:
    def __init__(self, ggn: torch.Tensor) -> None:
        self.ggn = ggn
        self.size = ggn.shape[0]

    def _chol(self, delta: torch.Tensor) -> torch.Tensor:
        return torch.linalg.cholesky(self.ggn + torch.diag(delta))

    def logdet(self, delta: torch.Tensor) -> torch.Tensor:
        return 2 * self._chol(delta).diagonal().log().sum()

    def sample(self, eps: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``(n, b)`` draws of ``N(0, (G + diag(delta))^-1)`` from ``eps (n, b)``."""
        return torch.linalg.solve_triangular(self._chol(delta).mT, eps.mT, upper=True).mT

    def eigenvalues(self, delta: torch.Tensor) -> torch.Tensor:
        return torch.linalg.eigvalsh(self.ggn + torch.diag(delta))

    def covariance(self, delta: torch.Tensor) -> torch.Tensor:
        return torch.cholesky_inverse(self._chol(delta))


class DiagBlock:
    def __init__(self, ggn: torch.Tensor) -> None:
        self.ggn = ggn
        self.size = ggn.shape[0]

    def logdet(self, delta: torch.Tensor) -> torch.Tensor:
        return (self.ggn + delta).log().sum()

    def sample(self, eps: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return eps / (self.ggn + delta).sqrt()

    def eigenvalues(self, delta: torch.Tensor) -> torch.Tensor:
        return self.ggn + delta

    def covariance(self, delta: torch.Tensor) -> torch.Tensor:
        return torch.diag(1 / (self.ggn + delta))


class KronBlock:
    def __init__(self, out: torch.Tensor, inp: torch.Tensor, trace: torch.Tensor) -> None:
        self.lambda_out, self.q_out = torch.linalg.eigh(out)
        self.lambda_in, self.q_in = torch.linalg.eigh(inp)
        self.lambda_out.clamp_(min=0)  # round-off below 0 of a PSD factor
        self.lambda_in.clamp_(min=0)
        self.shape = (out.shape[0], inp.shape[0])
        self.size = out.shape[0] * inp.shape[0]
        scale = 1 / trace if trace > 0 else torch.zeros((), dtype=torch.float64)
        self.ggn_eigenvalues = torch.outer(self.lambda_out, self.lambda_in) * scale  # (out, in)

    def eigenvalues(self, delta: torch.Tensor) -> torch.Tensor:
        return (self.ggn_eigenvalues + delta.mean()).flatten()

    def logdet(self, delta: torch.Tensor) -> torch.Tensor:
        return self.eigenvalues(delta).log().sum()

    def sample(self, eps: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        scaled = eps.reshape(-1, *self.shape) / (self.ggn_eigenvalues + delta.mean()).sqrt()
        return (self.q_out @ scaled @ self.q_in.T).reshape(len(eps), -1)

    def covariance(self, delta: torch.Tensor) -> torch.Tensor:
        basis = torch.kron(self.q_out, self.q_in)
        return basis @ torch.diag(1 / self.eigenvalues(delta)) @ basis.T


__all__ = ["DiagBlock", "FullBlock", "KronBlock"]
