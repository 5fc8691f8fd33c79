"""Microcanonical Langevin Monte Carlo (Robnik, De Luca, Silverstein & Seljak, JMLR
2023; Robnik & Seljak 2024): isokinetic dynamics with partial velocity refreshment, tuned as
BlackJAX's ``mclmc_find_L_and_step_size`` does (energy-error variance for the step size,
the posterior's scale for the momentum decoherence length L, then L from the ESS), with the
changes MILE makes (Sommer et al., ICLR 2025: a target energy variance that decays during
tuning, a step that gives NaN rejected and the step size capped below it). It is
**unadjusted**: no accept/reject, so its draws carry a step-size bias (see ``MCLMC``).

Its K chains are advanced together, each step one vectorized gradient of K chains, with the
random numbers of ``kernel.ChainRNG``. Chains may form groups (``groups``: the chains of one
ensemble member, a mode of their own) tuned apart: each group has its own step size, L and
preconditioner, and its statistics are pooled over its chains only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from probtransformer.inference.mcmc.kernel import ChainRNG, ChainState

#: The most coordinates whose ESS sets L (BlackJAX's ``fft_params_limit``): evenly spaced ones
#: of a larger state.
ESS_COORDINATES = 2000

#: The step size grows at most this factor per tuning step. BlackJAX's running estimate has no
#: such cap; from a mode (an ensemble member) the first steps' energy errors are near zero and
#: the estimate jumps twentyfold, throwing the chain far from the mode before it shrinks again.
MAX_GROWTH = 2.0

#: Steps from the starting state whose energy error chooses the initial step size.
PROBE_STEPS = 3

#: A step size that gives a non-finite step is capped at this fraction of itself (MILE's NaN
#: back-off).
BACKOFF = 0.8


@dataclass(frozen=True)
class Tuning:
    """How ``MCLMC.tune`` tunes (BlackJAX's and MILE's settings).

    Attributes:
        desired_energy_var: the target variance of the energy error per dimension and step,
            ``(start, end)``: it decays linearly from ``start`` to ``end`` over the first two
            phases (BlackJAX: 5e-4 throughout; MILE: 0.5 to 0.1, larger steps and more bias).
        phases: shares of the tuning steps of (1) the step size, (2) the step size and the
            positions' variance (the preconditioner, or L), (3) L from the ESS (BlackJAX 0.4,
            0.3, 0.3 by default in this library; MILE 0.8, 0.1, 0.1).
        diagonal_preconditioning: scale each coordinate by its sd from phase 2 (``L =
            sqrt(D)`` then), or keep the identity and set ``L`` from the variances (MILE).
        trust_in_estimate: how far a step's energy error may be from the target before it
            counts less (BlackJAX's weight ``exp(-0.5 (log ξ / (6 trust))^2)``).
        num_effective_samples: the memory of the step size's running average, in steps.
        L_factor: ``L = L_factor * step size * mean(steps / ESS)`` in phase 3 (0.4).
    """

    desired_energy_var: tuple[float, float] = (5e-4, 5e-4)
    phases: tuple[float, float, float] = (0.4, 0.3, 0.3)
    diagonal_preconditioning: bool = True
    trust_in_estimate: float = 1.5
    num_effective_samples: int = 150
    L_factor: float = 0.4

    def __post_init__(self) -> None:
        start, end = self.desired_energy_var
        if not (0 < start < math.inf and 0 < end < math.inf):
            raise ValueError(
                f"desired_energy_var must be (start, end), each a finite number > 0, got "
                f"{self.desired_energy_var!r}"
            )
        if len(self.phases) != 3 or min(self.phases) < 0 or not 0 < sum(self.phases) <= 1:
            raise ValueError(
                f"phases must be three shares >= 0 of the tuning steps summing to at most 1, got "
                f"{self.phases!r}"
            )


#: BlackJAX's tuning, the default: a small energy error (little bias), a diagonal preconditioner.
BLACKJAX_TUNING = Tuning()

#: MILE's tuning (its public configs: energy variance 0.5 -> 0.1, phases 0.8 / 0.1 / 0.1, no
#: preconditioner).
MILE_TUNING = Tuning(desired_energy_var=(0.5, 0.1), phases=(0.8, 0.1, 0.1),
                     diagonal_preconditioning=False, num_effective_samples=100)  # fmt: skip


class MCLMC:
    """Unadjusted microcanonical Langevin Monte Carlo over K chains (see the module docstring).

    The dynamics use a unit velocity ``u`` in the preconditioned space ``z = σ ⊙ y`` (isokinetic
    velocity-Verlet integrator, one gradient per step) with partial velocity refreshment
    ``u <- normalise(c u + sqrt(1 - c²) ξ / sqrt(D))``, ``c = exp(-ε / L)``.

    Tuning (``tune``; ``Tuning`` says how): an initial step size from a doubling search (the
    largest power-of-two multiple of 1e-3, at most ``sqrt(D)``, whose first ``PROBE_STEPS``
    steps keep the energy error within the target), then BlackJAX's three phases, each group
    on its own: (1) the step size ε so that
    the energy error per dimension has the target variance; (2) the same while the positions'
    variance is measured: the diagonal preconditioner σ with ``L = sqrt(D)`` (ε retuned), or
    ``L = sqrt(sum of the variances)``; (3) ``L = 0.4 ε mean(steps / ESS)`` from the bulk ESS
    of the phase's draws (arviz-stats). A chain whose step is not finite keeps its state, and
    its group's step size is capped at ``BACKOFF`` (0.8) times the one that failed.

    **Bias.** Without a Metropolis step the draws follow a distribution a step-size-dependent
    distance from the posterior. On the analytic linear regression of the test suite the
    benchmark measured posterior means within a few Monte Carlo standard errors and
    standard deviations a few per cent off (``benchmarks/BENCHMARKS.md``, "Many-chain
    samplers"). The record holds each group's measured energy-error variance per dimension.

    Args:
        density: ``z (K, D) -> (log density (K,), gradient (K, D))``.
        rng: the chains' random streams.
        groups: ``(K,)`` group index of each chain, 0 .. G - 1 (None: one group).
        tuning: ``Tuning`` (BlackJAX's settings by default).

    Attributes:
        step_size, L: ``(G,)`` float64, per group (after ``tune``).
        gradients: chain-gradients evaluated so far.
    """

    def __init__(
        self,
        density,
        rng: ChainRNG,
        *,
        groups: torch.Tensor | None = None,
        tuning: Tuning = BLACKJAX_TUNING,
    ) -> None:
        self.density = density
        self.rng = rng
        self.groups = groups
        self.tuning = tuning
        self.gradients = 0

    def init(self, z: torch.Tensor) -> tuple[ChainState, torch.Tensor]:
        """The state at ``z`` ``(K, D)`` and unit velocities ``(K, D)``."""
        lp, grad = self.density(z)
        chains, d = z.shape
        if self.groups is None:
            self.groups = torch.zeros(chains, dtype=torch.long, device=z.device)
        self.num_groups = int(self.groups.max()) + 1
        self.dim = d
        self.sigma = torch.ones_like(z)
        self.L = torch.full((self.num_groups,), math.sqrt(d), dtype=torch.float64)
        self.step_size = torch.full((self.num_groups,), 1e-3, dtype=torch.float64)
        u = self.rng.normal(d, z.dtype)
        return ChainState(z, lp, grad), u / u.norm(dim=1, keepdim=True)

    # -- per group / per chain ------------------------------------------------------------------

    def _chains(self, per_group: torch.Tensor) -> torch.Tensor:
        """``(K, 1)`` values of ``(G,)`` per-group ones, in the state's dtype."""
        return per_group.to(self.groups.device)[self.groups][:, None].to(self.sigma.dtype)

    def _group_sum(self, per_chain: torch.Tensor) -> torch.Tensor:
        """``(G,)`` float64 sums over each group's chains of ``(K,)`` values."""
        total = torch.zeros(self.num_groups, dtype=torch.float64, device=per_chain.device)
        return total.index_add_(0, self.groups, per_chain.double()).cpu()

    # -- dynamics -------------------------------------------------------------------------------

    def _velocity(self, u, g, eps):
        """ESH velocity update (Robnik et al. 2023, eq. 11) of unit ``u`` by ``eps`` ``(K, 1)``
        under the preconditioned gradient ``g``; returns ``(u, kinetic energy change (K,))``."""
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

    def step(self, state: ChainState, u: torch.Tensor, step_size: torch.Tensor | None = None):
        """One integrator step plus partial refreshment for every chain, each group at its own
        step size (``step_size`` ``(G,)``; None: ``self.step_size``).

        Returns ``(state, u, energy_change (K,))``; a chain whose step is not finite keeps its
        state, and its energy change is NaN.
        """
        eps = self._chains(self.step_size if step_size is None else step_size)
        sigma = self.sigma
        u1, k1 = self._velocity(u, state.grad * sigma, 0.5 * eps)
        z = state.z + eps * sigma * u1
        lp, grad = self.density(z)
        self.gradients += len(z)
        u2, k2 = self._velocity(u1, grad * sigma, 0.5 * eps)
        energy_change = k1 + k2 - lp + state.lp
        ok = torch.isfinite(energy_change) & torch.isfinite(z).all(1) & torch.isfinite(grad).all(1)
        c = torch.exp(-eps / self._chains(self.L))
        noise = self.rng.normal(self.dim, z.dtype) / math.sqrt(self.dim)
        u3 = c * u2 + torch.sqrt(1 - c * c) * noise
        u3 = u3 / u3.norm(dim=1, keepdim=True)
        new = ChainState(
            torch.where(ok[:, None], z, state.z),
            torch.where(ok, lp, state.lp),
            torch.where(ok[:, None], grad, state.grad),
        )
        u_new = torch.where(ok[:, None], u3, u)
        return new, u_new, torch.where(ok, energy_change, torch.full_like(energy_change, math.nan))

    # -- tuning ---------------------------------------------------------------------------------

    def tune(self, state: ChainState, u: torch.Tensor, tune_steps: int):
        """Tune every group in ``tune_steps`` integrator steps (>= 30; see the class
        docstring); returns ``(state, u)``."""
        steps = self.tuning_steps(state, u, tune_steps)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def tuning_steps(self, state: ChainState, u: torch.Tensor, tune_steps: int):
        """``tune`` as a generator: yields ``(None, None)`` after each tuning step (for a
        progress bar), and returns ``(state, u)``."""
        tuning = self.tuning
        share1, share2, share3 = tuning.phases
        n1 = max(10, int(share1 * tune_steps))
        n2 = max(10, int(share2 * tune_steps))
        n3 = max(10, int(share3 * tune_steps))
        state, u = self._initial_step_size(state, u)
        adapt = _StepSizeAdaptation(self, n1 + n2 + 1)
        for _ in range(n1):
            state, u = adapt.step(state, u)
            yield None, None
        moments = _Moments(self)
        for _ in range(n2):
            state, u = adapt.step(state, u, moments)
            yield None, None
        variance = moments.variance()  # (G, D)
        if tuning.diagonal_preconditioning:
            self.sigma = variance.sqrt()[self.groups.cpu()].to(self.sigma)
            self.L = torch.full_like(self.L, math.sqrt(self.dim))
            adapt.reset()  # the step size of the preconditioned dynamics
            for _ in range(max(1, n2 // 3)):
                state, u = adapt.step(state, u)
        else:
            self.L = variance.sum(1).sqrt()
        draws = []
        for _ in range(n3):
            state, u, _ = self.step(state, u)
            draws.append(state.z)
            yield None, None
        self.L = tuning.L_factor * self.step_size * self._steps_per_effective_draw(draws)
        return state, u

    def _initial_step_size(self, state, u):
        """Double every group's step size (from 1e-3, at most 30 times, at most ``sqrt(D)``)
        while ``PROBE_STEPS`` steps from the state keep the energy error's mean square per
        dimension within the first target and finite, and keep the last that did; the state
        does not move. Several steps, not one: a chain at a mode has no gradient, and its first
        step's energy error says nothing of the step size."""
        target = self.tuning.desired_energy_var[0]
        counts = PROBE_STEPS * self._group_sum(torch.ones(len(state.z), device=state.z.device))
        largest = math.sqrt(self.dim)
        growing = torch.ones(self.num_groups, dtype=torch.bool)
        doubled = torch.zeros_like(growing)
        for _ in range(30):
            probe, probe_u, squares = state, u, 0.0
            for _ in range(PROBE_STEPS):
                probe, probe_u, energy_change = self.step(probe, probe_u)
                squares = squares + energy_change.nan_to_num(math.inf, math.inf, math.inf).square()
            within = self._group_sum(squares) / (counts * self.dim) < target
            stop = growing & ~within
            self.step_size = torch.where(stop & doubled, self.step_size / 2, self.step_size)
            growing &= within & (2 * self.step_size <= largest)
            if not growing.any():
                break
            self.step_size = torch.where(growing, 2 * self.step_size, self.step_size)
            doubled |= growing
        return state, u

    def _steps_per_effective_draw(self, draws: list[torch.Tensor]) -> torch.Tensor:
        """``(G,)`` mean over (up to ``ESS_COORDINATES``) coordinates of draws per bulk ESS,
        each group's chains pooled (arviz-stats)."""
        from arviz_stats.base import array_stats

        x = torch.stack(draws, 1)  # (K, n, D)
        columns = torch.linspace(0, self.dim - 1, min(self.dim, ESS_COORDINATES)).long()
        x = x[..., columns.to(x.device)].detach().double().cpu().numpy()
        groups = self.groups.cpu().numpy()
        out = []
        for g in range(self.num_groups):
            values = x[groups == g]  # (chains, n, coordinates)
            ess = array_stats.ess(np.moveaxis(values, -1, 0), chain_axis=-2, draw_axis=-1)
            ess = ess[np.isfinite(ess) & (ess > 0)]
            draws_total = values.shape[0] * values.shape[1]
            out.append(float(np.mean(draws_total / ess)) if ess.size else float(draws_total))
        return torch.tensor(out, dtype=torch.float64)

    def settings(self) -> dict:
        """The tuned step size and L (floats; lists, one per group, for several groups) and
        how they were tuned (for the record)."""

        def shown(values: torch.Tensor):
            return values.tolist() if len(values) > 1 else float(values[0])

        return dict(
            step_size=shown(self.step_size),
            L=shown(self.L),
            desired_energy_var=list(self.tuning.desired_energy_var),
            tuning_phases=list(self.tuning.phases),
            diagonal_preconditioning=self.tuning.diagonal_preconditioning,
        )


class _StepSizeAdaptation:
    """BlackJAX's running estimate of each group's step size from ``Var[E] ∝ ε^6``, with a
    target that decays linearly over ``total`` steps and MILE's NaN back-off."""

    def __init__(self, sampler: MCLMC, total: int) -> None:
        self.sampler = sampler
        self.total = total
        self.decay = (sampler.tuning.num_effective_samples - 1.0) / (
            sampler.tuning.num_effective_samples + 1.0
        )
        self.t = 0
        self.reset()

    def reset(self) -> None:
        """Forget the running estimate and the cap (the preconditioner changed the scale)."""
        self.x_average = torch.zeros(self.sampler.num_groups, dtype=torch.float64)
        self.weight = torch.zeros_like(self.x_average)
        self.largest = torch.full_like(self.x_average, math.inf)

    def step(self, state, u, moments: _Moments | None = None):
        s = self.sampler
        start, end = s.tuning.desired_energy_var
        target = start - (start - end) * min(self.t / self.total, 1.0)
        self.t += 1
        eps = s.step_size
        new, u_new, energy_change = s.step(state, u)
        bad = ~torch.isfinite(energy_change)
        failed = s._group_sum(bad.double()) > 0
        self.largest = torch.where(failed, torch.minimum(self.largest, BACKOFF * eps), self.largest)
        # float64: xi / step_size**6 overflows float32 for badly scaled posteriors
        xi = energy_change.nan_to_num(0.0).double().square() / (s.dim * target) + 1e-8
        w = torch.exp(-0.5 * (xi.log() / (6.0 * s.tuning.trust_in_estimate)).square())
        w = torch.where(bad, torch.zeros_like(w), w)
        self.x_average = self.decay * self.x_average + s._group_sum(w * xi) / eps**6
        self.weight = self.decay * self.weight + s._group_sum(w)
        estimate = (self.x_average / self.weight.clamp_min(1e-300)) ** (-1 / 6)
        estimate = torch.where(self.weight > 0, estimate, eps)
        s.step_size = torch.minimum(torch.minimum(estimate, MAX_GROWTH * eps), self.largest)
        if not torch.isfinite(s.step_size).all() or (s.step_size <= 0).any():
            raise ValueError(
                "MCLMC's step-size tuning collapsed (energy errors too large at every step size "
                "tried): the posterior is badly scaled; standardise the inputs, or use "
                "kernel='chees'"
            )
        if moments is not None:
            moments.add(new.z, (~bad).double() * s._chains(eps).squeeze(1).double())
        return new, u_new


class _Moments:
    """Each group's step-size-weighted mean and mean square of the positions (phase 2)."""

    def __init__(self, sampler: MCLMC) -> None:
        self.sampler = sampler
        self.total = torch.zeros(sampler.num_groups, sampler.dim, dtype=torch.float64)
        self.squares = torch.zeros_like(self.total)
        self.weights = torch.zeros(sampler.num_groups, dtype=torch.float64)

    def add(self, z: torch.Tensor, weights: torch.Tensor) -> None:
        groups = self.sampler.groups.cpu()
        z, weights = z.detach().double().cpu(), weights.cpu()
        self.total.index_add_(0, groups, weights[:, None] * z)
        self.squares.index_add_(0, groups, weights[:, None] * z * z)
        self.weights.index_add_(0, groups, weights)

    def variance(self) -> torch.Tensor:
        """``(G, D)`` variances, at least 1e-8 (every coordinate of a group that never moved: 1)."""
        weights = self.weights[:, None]
        moved = weights > 0
        mean = self.total / weights.clamp_min(1e-300)
        variance = self.squares / weights.clamp_min(1e-300) - mean.square()
        return torch.where(moved, variance, torch.ones_like(variance)).clamp_min(1e-8)


__all__ = ["BLACKJAX_TUNING", "MCLMC", "MILE_TUNING", "Tuning"]
