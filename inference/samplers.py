"""Many-chain kernels: K chains advanced together, each step one vectorized gradient of K chains.

- ``ChEES``: ChEES-HMC (Hoffman, Radul & Sountsov, "An Adaptive-MCMC Scheme for Setting
  Trajectory Lengths in Hamiltonian Monte Carlo", AISTATS 2021): HMC with a jittered trajectory
  length shared by the chains, Metropolis-adjusted per chain (exact). Warm-up adapts the step
  size by dual averaging (Hoffman & Gelman 2014) on the harmonic mean of the chains'
  acceptance probabilities, the trajectory length by Adam on the ChEES criterion, and a
  diagonal mass matrix from the moments pooled over chains and window draws (Stan's windows).
  Both use moments within superchains (chains sharing a start): chains from different MAP
  starts sit in different modes, and centring them on one mean measures the distance between
  the modes, not the posterior's scale around each.
  References: BlackJAX ``chees_adaptation``, TFP ``GradientBasedTrajectoryLengthAdaptation``.
- ``MCLMC``: microcanonical Langevin Monte Carlo (Robnik, De Luca, Silverstein & Seljak, JMLR
  2023; Robnik & Seljak 2024): isokinetic dynamics with partial velocity refreshment, tuned as
  BlackJAX's ``mclmc_find_L_and_step_size`` does (energy-error variance for the step size,
  the posterior's scale for the momentum decoherence length L, then L from the ESS), which is
  the tuning MILE (Sommer et al., ICLR 2025) runs after deep-ensemble starts. It is
  **unadjusted**: no accept/reject, so its draws carry a step-size bias (see ``MCLMC``).

Every chain draws its random numbers from its own ``torch.Generator`` (``ChainRNG``), seeded
from ``(seed, chain)``; the jitter of the trajectory length is a Halton sequence shared by the
chains, as in BlackJAX. Cross-chain statistics (adaptation) are reduced in chain order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

#: The ChEES target of the harmonic-mean acceptance probability (Beskos et al. 2013's optimum,
#: BlackJAX's default).
CHEES_TARGET_ACCEPT = 0.651

#: Chains whose mean acceptance probability over a mass-matrix window is below this are left
#: out of its variance (they are stuck, not exploring).
MOVING_ACCEPTANCE = 0.05

#: An energy error above this many nats is a divergent transition (Stan, Pyro).
MAX_ENERGY_ERROR = 1000.0


class ChainRNG:
    """Independent random streams, one ``torch.Generator`` per chain.

    Chain ``k``'s stream is seeded from ``numpy.random.SeedSequence(seed, spawn_key=(k,))``,
    so a chain's numbers do not depend on how many chains run beside it (or on which device
    shard runs it).
    """

    def __init__(self, seed: int, chains: int, device: torch.device) -> None:
        self.device = device
        self.generators = []
        for k in range(chains):
            state = np.random.SeedSequence(seed, spawn_key=(k,)).generate_state(1, np.uint64)[0]
            generator = torch.Generator(device=device)
            generator.manual_seed(int(state) % 2**63)
            self.generators.append(generator)

    def normal(self, dim: int, dtype=torch.float32) -> torch.Tensor:
        """``(K, dim)`` standard normal draws, row ``k`` from chain ``k``'s stream."""
        device = self.device
        return torch.stack(
            [torch.randn(dim, generator=g, device=device, dtype=dtype) for g in self.generators]
        )

    def uniform(self, dtype=torch.float32) -> torch.Tensor:
        """``(K,)`` uniform draws in [0, 1)."""
        return torch.cat(
            [torch.rand(1, generator=g, device=self.device, dtype=dtype) for g in self.generators]
        )


def halton(index: int, base: int = 2) -> float:
    """The ``index``-th (>= 1) element of the van der Corput (1-D Halton) sequence in (0, 1)."""
    result, f = 0.0, 1.0
    while index > 0:
        f /= base
        result += f * (index % base)
        index //= base
    return result


@dataclass
class DualAveraging:
    """Nesterov dual averaging of ``log x`` towards a target statistic (Hoffman & Gelman 2014,
    §3.2, with Stan's constants ``gamma=0.05, t0=10, kappa=0.75``)."""

    mu: float
    gamma: float = 0.05
    t0: float = 10.0
    kappa: float = 0.75
    t: int = 0
    error_sum: float = 0.0
    log_x_avg: float = 0.0

    def update(self, error: float) -> float:
        """Take ``error = target - statistic``; return the new ``log x``."""
        self.t += 1
        self.error_sum += error
        log_x = self.mu - math.sqrt(self.t) / self.gamma * self.error_sum / (self.t + self.t0)
        weight = self.t**-self.kappa
        self.log_x_avg = weight * log_x + (1 - weight) * self.log_x_avg
        return log_x


def warmup_windows(num_warmup: int) -> list[tuple[int, int]]:
    """``(start, end)`` transitions (1-based, start exclusive) of the mass-matrix windows:
    Stan's schedule (initial buffer 75, windows 25, 50, 100, ..., final buffer 50), scaled to
    15% / 65% / 20% of a short warm-up (the step size settles in the final buffer); none below
    20 transitions."""
    if num_warmup < 20:
        return []
    start, end = 75, num_warmup - 50
    if start + 25 > end:
        start, end = int(0.15 * num_warmup), int(0.8 * num_warmup)
    windows, size = [], 25
    while start < end:
        stop = start + size
        if stop + 2 * size > end:  # the last window runs to the end buffer
            stop = end
        windows.append((start, stop))
        start, size = stop, 2 * size
    return windows


def regularized_variance(
    total: torch.Tensor, squares: torch.Tensor, n: int, groups: torch.Tensor | None = None
) -> torch.Tensor:
    """Stan's regularised diagonal metric ``n/(n+5) var + 1e-3 * 5/(n+5)`` from per-chain sums
    of ``n`` draws each and of their squares (``(K, D)`` each, float64).

    ``var`` is the variance within the ``groups`` (``(K,)`` superchain indices; None: one
    group), pooled over them: chains of different superchains may sit in different modes, and
    the distance between modes is not the posterior's scale within one."""
    if groups is None:
        groups = torch.zeros(len(total), dtype=torch.long, device=total.device)
    counts = torch.bincount(groups).to(total.dtype)
    group_total = total.new_zeros(len(counts), total.shape[1]).index_add_(0, groups, total)
    used = counts > 0
    between = (group_total[used].square() / (n * counts[used, None])).sum(0)
    squared_deviation = squares.sum(0) - between
    draws = n * len(total)
    var = squared_deviation / max(draws - int(used.sum()), 1)
    return (draws / (draws + 5.0) * var + 1e-3 * 5.0 / (draws + 5.0)).clamp_min(1e-8)


def centered(x: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``(K, D)`` less the mean of its row's group (``(K,)`` indices; None: of all rows)."""
    if groups is None:
        return x - x.mean(0)
    counts = torch.bincount(groups).clamp_min(1).to(x.dtype)
    means = x.new_zeros(len(counts), x.shape[1]).index_add_(0, groups, x) / counts[:, None]
    return x - means[groups]


@dataclass
class Transition:
    """What one many-chain transition gives, per chain ``(K,)``."""

    accept_prob: torch.Tensor
    diverging: torch.Tensor
    energy: torch.Tensor
    n_steps: int
    step_size: float


@dataclass
class ChainState:
    """Positions ``z`` ``(K, D)`` in the unconstrained space, their log densities ``lp`` ``(K,)``
    and gradients ``grad`` ``(K, D)``."""

    z: torch.Tensor
    lp: torch.Tensor
    grad: torch.Tensor


class ChEES:
    """ChEES-HMC over K chains (see the module docstring).

    Args:
        density: ``z (K, D) -> (log density (K,), gradient (K, D))``.
        rng: the chains' random streams.
        num_warmup: adaptation transitions.
        step_size: initial step size (refined by a doubling/halving search, then dual
            averaging).
        trajectory_length: initial trajectory length (integration time); None: 10 steps.
        target_accept_prob: target of the harmonic-mean acceptance probability.
        max_leapfrog_steps: most leapfrog steps per transition (BlackJAX's 1000).
        learning_rate: Adam's learning rate on ``log T`` (no momentum, squared-gradient
            average rate 0.5, as TFP's adaptation), each change clipped to ±0.35.
        superchain: ``(K,)`` index of each chain's superchain (the chains that share a
            start); the ChEES criterion and the mass matrix use moments within superchains
            when each has two chains or more. None: all chains are one.

    Attributes:
        gradients: chain-gradients evaluated so far (leapfrog steps times chains).
    """

    def __init__(
        self,
        density,
        rng: ChainRNG,
        num_warmup: int,
        *,
        step_size: float = 0.1,
        trajectory_length: float | None = None,
        target_accept_prob: float = CHEES_TARGET_ACCEPT,
        max_leapfrog_steps: int = 1000,
        learning_rate: float = 0.05,
        superchain: torch.Tensor | None = None,
    ) -> None:
        self.density = density
        self.rng = rng
        self.num_warmup = num_warmup
        self.step_size = step_size
        self.trajectory_length = trajectory_length
        self.target_accept_prob = target_accept_prob
        self.max_leapfrog_steps = max_leapfrog_steps
        self.learning_rate = learning_rate
        if superchain is not None and int(torch.bincount(superchain).min()) < 2:
            superchain = None  # a lone chain has no spread around its superchain's mean
        self.superchain = superchain
        self.t = 0
        self.gradients = 0

    def init(self, z: torch.Tensor) -> ChainState:
        """The state at ``z`` ``(K, D)``; searches a reasonable initial step size."""
        lp, grad = self.density(z)
        state = ChainState(z, lp, grad)
        self.inv_mass = torch.ones(z.shape[1], device=z.device, dtype=z.dtype)
        self._windows = warmup_windows(self.num_warmup)
        self._sums = None
        self._restart_step_size(state)
        T = self.trajectory_length or 10 * self.step_size
        self.log_T = self.log_T_avg = math.log(T)
        self._adam_v = 0.0
        return state

    def _restart_step_size(self, state: ChainState) -> None:
        """Double or halve the step size until one leapfrog step's harmonic-mean acceptance
        crosses 0.5 (Hoffman & Gelman 2014, Algorithm 4), then restart dual averaging."""
        eps, direction = self.step_size, 0
        for _ in range(50):
            p = self.rng.normal(state.z.shape[1], state.z.dtype) / self.inv_mass.sqrt()
            accept, log_accept, *_ = self._trajectory(state, p, eps, 1)
            high = _harmonic_mean(accept, ~(log_accept > -MAX_ENERGY_ERROR)) > 0.5
            if direction == 0:
                direction = 1 if high else -1
            elif (direction == 1) != high:
                break
            eps = eps * 2.0 if direction == 1 else eps / 2.0
        self.step_size = eps
        self._da = DualAveraging(mu=math.log(10 * eps))

    def _trajectory(self, state: ChainState, p: torch.Tensor, eps: float, steps: int):
        """Leapfrog ``steps`` steps for every chain; ``(accept_prob, log_accept, energy0,
        proposal, final velocity)``, the energies in nats."""
        inv_mass = self.inv_mass
        energy0 = -state.lp + 0.5 * (p * p * inv_mass).sum(1)
        z, lp, grad = state.z, state.lp, state.grad
        p = p + 0.5 * eps * grad
        for i in range(steps):
            z = z + eps * inv_mass * p
            lp, grad = self.density(z)
            p = p + (eps if i < steps - 1 else 0.5 * eps) * grad
        self.gradients += steps * len(z)
        log_accept = energy0 - (-lp + 0.5 * (p * p * inv_mass).sum(1))
        log_accept = torch.where(torch.isfinite(log_accept), log_accept, -math.inf)
        accept = log_accept.clamp(max=0.0).exp()
        return accept, log_accept, energy0, ChainState(z, lp, grad), inv_mass * p

    def step(self, state: ChainState, *, adapt: bool) -> tuple[ChainState, Transition]:
        """One transition of every chain (jittered trajectory, Metropolis correction per
        chain); adapts the step size, trajectory length and mass matrix when ``adapt``."""
        self.t += 1
        T = math.exp(self.log_T if adapt else self.log_T_avg)
        eps = self.step_size
        jitter = halton(self.t)
        steps = int(min(max(1, math.ceil(jitter * T / eps)), self.max_leapfrog_steps))
        p = self.rng.normal(state.z.shape[1], state.z.dtype) / self.inv_mass.sqrt()
        accept, log_accept, energy0, proposal, velocity = self._trajectory(state, p, eps, steps)
        diverging = ~(log_accept > -MAX_ENERGY_ERROR)
        take = (self.rng.uniform(state.z.dtype).log() < log_accept) & ~diverging
        new = ChainState(
            torch.where(take[:, None], proposal.z, state.z),
            torch.where(take, proposal.lp, state.lp),
            torch.where(take[:, None], proposal.grad, state.grad),
        )
        if adapt:
            self._adapt(state, proposal, velocity, accept, diverging, jitter)
            self._adapt_mass(new, accept)
            if self.t == self.num_warmup:
                self.step_size = math.exp(self._da.log_x_avg)
        return new, Transition(accept, diverging, energy0, steps, eps)

    def _adapt(self, state, proposal, velocity, accept, diverging, jitter) -> None:
        # the step size: dual averaging on the harmonic-mean acceptance of the chains that did
        # not diverge (as BlackJAX): one stuck chain would otherwise drive it to 0 for all
        hm = _harmonic_mean(accept, diverging)
        self.step_size = math.exp(self._da.update(self.target_accept_prob - hm))
        # the trajectory length: Adam ascent of the ChEES criterion, acceptance-weighted
        ok = ~diverging & torch.isfinite(proposal.z).all(1) & torch.isfinite(velocity).all(1)
        if ok.sum() < 2 or float(accept[ok].sum()) <= 0:
            return
        z0, z1, v1, a = state.z[ok], proposal.z[ok], velocity[ok], accept[ok]
        groups = None if self.superchain is None else self.superchain[ok]
        c0, c1 = centered(z0, groups), centered(z1, groups)
        T = math.exp(self.log_T)
        per_chain = (c1.square().sum(1) - c0.square().sum(1)) * (c1 * v1).sum(1)
        gradient = float((a * jitter * T * per_chain).sum() / a.sum())  # d ChEES / d log T
        if not math.isfinite(gradient):
            return
        self._adam_v = 0.5 * self._adam_v + 0.5 * gradient**2
        change = self.learning_rate * gradient / (math.sqrt(self._adam_v) + 1e-12)
        self.log_T = min(
            self.log_T + max(-0.35, min(0.35, change)),
            math.log(self.max_leapfrog_steps * self.step_size),
        )
        self.log_T_avg = 0.9 * self.log_T_avg + 0.1 * self.log_T

    def _adapt_mass(self, state: ChainState, accept: torch.Tensor) -> None:
        """Sum every chain's positions over the current window; at its end, set the inverse
        mass matrix to the regularised variance within superchains, pooled over the chains
        that moved (mean acceptance >= ``MOVING_ACCEPTANCE``; every chain if fewer than two
        did), and restart the step-size adaptation. A stuck chain would add its distance from
        the others."""
        if not self._windows:
            return
        start, end = self._windows[0]
        if self.t <= start:
            return
        z = state.z.double()
        if self._sums is None:
            self._sums = [torch.zeros_like(z), torch.zeros_like(z), torch.zeros_like(accept), 0]
        self._sums[0] += z
        self._sums[1] += z * z
        self._sums[2] += accept.nan_to_num(0.0)
        self._sums[3] += 1
        if self.t == end:
            total, squares, accepted, n = self._sums
            moving = accepted / n >= MOVING_ACCEPTANCE
            if moving.sum() < 2:
                moving = torch.ones_like(moving)
            groups = None if self.superchain is None else self.superchain[moving]
            pooled = regularized_variance(total[moving], squares[moving], n, groups)
            self.inv_mass = pooled.to(state.z.dtype)
            self._windows.pop(0)
            self._sums = None
            self._restart_step_size(state)

    def settings(self) -> dict:
        """The adapted step size and trajectory length (for the record)."""
        return dict(step_size=self.step_size, trajectory_length=math.exp(self.log_T_avg))


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


def _harmonic_mean(accept: torch.Tensor, diverging: torch.Tensor) -> float:
    """Harmonic mean of the acceptance probabilities of the chains that did not diverge; 0
    when every chain diverged."""
    kept = accept[~diverging]
    if not len(kept):
        return 0.0
    return float(1.0 / (1.0 / kept.clamp_min(1e-10)).mean())


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


__all__ = ["CHEES_TARGET_ACCEPT", "ChEES", "ChainRNG", "ChainState", "MCLMC", "Transition"]
