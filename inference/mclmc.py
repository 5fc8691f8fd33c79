"""Microcanonical Langevin Monte Carlo (Robnik, De Luca, Silverstein & Seljak, JMLR
2023; Robnik & Seljak 2024): isokinetic dynamics with partial velocity refreshment, tuned as
BlackJAX's ``mclmc_find_L_and_step_size`` does (energy-error variance for the step size,
the posterior's scale for the momentum decoherence length L, then L from the ESS), which is
the tuning MILE (Sommer et al., ICLR 2025) runs after deep-ensemble starts. It is
**unadjusted**: no accept/reject, so its draws carry a step-size bias (see ``MCLMC``).

Its K chains are advanced together, each step one vectorized gradient of K chains, with the
random numbers of ``samplers.ChainRNG``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from probtransformer.inference.samplers import ChainRNG, ChainState


class MCLMC:
    """Unadjusted microcanonical Langevin Monte Carlo over K chains (see the module docstring).

    The dynamics use a unit velocity ``u`` in the preconditioned space ``z = σ ⊙ y`` (isokinetic
    velocity-Verlet integrator, one gradient per step) with partial velocity refreshment
    ``u <- normalise(c u + sqrt(1 - c²) ξ / sqrt(D))``, ``c = exp(-ε / L)``.

    Tuning (BlackJAX's three stages, statistics pooled over chains, in ``tune_steps``
    integrator steps): (1) the step size ε so that the energy error per dimension has variance
    ``desired_energy_var`` (5e-4); (2) the diagonal preconditioner σ from the positions'
    variance, ``L = sqrt(D)``, ε retuned; (3) ``L = 0.4 ε · steps / ESS`` from the bulk ESS of
    the tuning draws (arviz-stats).

    **Bias.** Without a Metropolis step the draws follow a distribution a step-size-dependent
    distance from the posterior. On the analytic linear regression of the test suite the
    benchmark measured posterior means within a few Monte Carlo standard errors and
    standard deviations a few per cent off (``benchmarks/BENCHMARKS.md``, "Many-chain
    samplers"). The record holds each run's measured energy-error variance per dimension.
    """

    def __init__(
        self,
        density,
        rng: ChainRNG,
        *,
        desired_energy_var: float = 5e-4,
        trust_in_estimate: float = 1.5,
        num_effective_samples: int = 150,
    ) -> None:
        self.density = density
        self.rng = rng
        self.desired_energy_var = desired_energy_var
        self.trust_in_estimate = trust_in_estimate
        self.num_effective_samples = num_effective_samples
        self.gradients = 0

    def init(self, z: torch.Tensor) -> tuple[ChainState, torch.Tensor]:
        lp, grad = self.density(z)
        d = z.shape[1]
        self.dim = d
        self.sigma = torch.ones(d, device=z.device, dtype=z.dtype)
        self.L = math.sqrt(d)
        self.step_size = math.sqrt(d) * 0.25
        u = self.rng.normal(d, z.dtype)
        return ChainState(z, lp, grad), u / u.norm(dim=1, keepdim=True)

    def _velocity(self, u, g, eps):
        """ESH velocity update (Robnik et al. 2023, eq. 11) of unit ``u`` by ``eps`` under the
        preconditioned gradient ``g``; returns ``(u, kinetic energy change)``."""
        d = self.dim
        g_norm = g.norm(dim=1, keepdim=True).clamp_min(1e-30)
        e = g / g_norm
        ue = (u * e).sum(1, keepdim=True)
        delta = eps * g_norm / (d - 1)
        zeta = torch.exp(-delta)
        new = e * (1 - zeta) * (1 + zeta + ue * (1 - zeta)) + 2 * zeta * u
        new = new / new.norm(dim=1, keepdim=True)
        kinetic = delta - math.log(2) + torch.log(1 + ue + (1 - ue) * zeta**2)
        return new, (kinetic * (d - 1)).squeeze(1)

    def step(self, state: ChainState, u: torch.Tensor, eps: float):
        """One integrator step plus partial refreshment for every chain.

        Returns ``(state, u, energy_change (K,))``; a chain whose step is not finite keeps its
        state, and its energy change is NaN.
        """
        sigma = self.sigma
        u1, k1 = self._velocity(u, state.grad * sigma, 0.5 * eps)
        z = state.z + eps * sigma * u1
        lp, grad = self.density(z)
        self.gradients += len(z)
        u2, k2 = self._velocity(u1, grad * sigma, 0.5 * eps)
        energy_change = k1 + k2 - lp + state.lp
        ok = torch.isfinite(energy_change) & torch.isfinite(z).all(1)
        c = math.exp(-eps / self.L)
        noise = self.rng.normal(self.dim, z.dtype) / math.sqrt(self.dim)
        u3 = c * u2 + math.sqrt(1 - c * c) * noise
        u3 = u3 / u3.norm(dim=1, keepdim=True)
        new = ChainState(
            torch.where(ok[:, None], z, state.z),
            torch.where(ok, lp, state.lp),
            torch.where(ok[:, None], grad, state.grad),
        )
        u_new = torch.where(ok[:, None], u3, u)
        return new, u_new, torch.where(ok, energy_change, torch.full_like(energy_change, math.nan))

    def tune(self, state: ChainState, u: torch.Tensor, tune_steps: int, progress=None):
        """Three-stage tuning in ``tune_steps`` integrator steps (>= 30); returns the state."""
        n1 = max(10, int(0.4 * tune_steps))
        n2 = max(10, int(0.3 * tune_steps))
        n3 = max(10, tune_steps - n1 - n2)
        state, u = self._tune_step_size(state, u, n1, progress)
        # stage 2: the preconditioner from the positions, then retune the step size
        moments = []
        state, u = self._tune_step_size(state, u, n2, progress, collect=moments)
        positions = torch.cat(moments)
        self.sigma = positions.var(dim=0).clamp_min(1e-8).sqrt()
        self.L = math.sqrt(self.dim)
        state, u = self._tune_step_size(state, u, max(10, n2 // 2), progress)
        # stage 3: L from the ESS of the tuning draws (bulk ESS, arviz-stats)
        draws = []
        for _ in range(n3):
            state, u, _ = self.step(state, u, self.step_size)
            draws.append(state.z)
            _tick(progress)
        ess = _mean_ess(torch.stack(draws, 1))  # pooled over the K chains
        self.L = 0.4 * self.step_size * n3 * len(state.z) / ess
        return state, u

    def _tune_step_size(self, state, u, steps, progress, collect=None):
        decay = (self.num_effective_samples - 1.0) / (self.num_effective_samples + 1.0)
        x_avg = w_sum = 0.0
        for _ in range(steps):
            new, u_new, energy_change = self.step(state, u, self.step_size)
            bad = ~torch.isfinite(energy_change)
            if bad.all():
                self.step_size *= 0.8
                _tick(progress)
                continue
            state, u = new, u_new
            # float64: xi / step_size**6 overflows float32 for badly scaled posteriors
            xi = energy_change[~bad].double().square() / (self.dim * self.desired_energy_var)
            xi = xi + 1e-8
            w = torch.exp(-0.5 * (xi.log() / (6.0 * self.trust_in_estimate)).square())
            x_avg = decay * x_avg + float((w * xi / self.step_size**6).sum())
            w_sum = decay * w_sum + float(w.sum())
            self.step_size = (x_avg / w_sum) ** (-1 / 6)
            if not (math.isfinite(self.step_size) and self.step_size > 0):
                raise ValueError(
                    "MCLMC's step-size tuning collapsed (energy errors too large at every step "
                    "size tried): the posterior is badly scaled; standardise the inputs, or use "
                    "kernel='chees'"
                )
            if bad.any():
                self.step_size *= 0.8
            if collect is not None:
                collect.append(state.z)
            _tick(progress)
        return state, u

    def settings(self) -> dict:
        return dict(step_size=self.step_size, L=self.L)


def _mean_ess(draws: torch.Tensor) -> float:
    """Mean bulk ESS over (up to 2,000) coordinates of ``(K, n, D)`` draws (arviz-stats)."""
    from arviz_stats.base import array_stats

    cols = draws[..., : min(draws.shape[-1], 2000)].detach().cpu().double().numpy()
    ess = array_stats.ess(np.moveaxis(cols, -1, 0), chain_axis=-2, draw_axis=-1)
    ess = ess[np.isfinite(ess)]
    return float(max(ess.mean(), 1.0)) if ess.size else 1.0


def _tick(progress) -> None:
    if progress is not None:
        progress.update(1)


__all__ = ["MCLMC"]
