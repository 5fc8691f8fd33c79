"""Many-chain kernels: K chains advanced together, each step one vectorized gradient of K chains.

- ``ChEES``: ChEES-HMC (Hoffman, Radul & Sountsov, "An Adaptive-MCMC Scheme for Setting
  Trajectory Lengths in Hamiltonian Monte Carlo", AISTATS 2021): HMC with a jittered trajectory
  length shared by the chains, Metropolis-adjusted per chain (exact). Warm-up adapts the step
  size by dual averaging (Hoffman & Gelman 2014) on the harmonic mean of the chains'
  acceptance probabilities, the trajectory length by Adam on the ChEES criterion, and a
  diagonal (or dense) mass matrix from the moments pooled over chains and window draws (Stan's
  windows). Both use moments within superchains (chains sharing a start): chains from
  different MAP starts sit in different modes, and centring them on one mean measures the
  distance between the modes, not the posterior's scale around each.
  References: BlackJAX ``chees_adaptation``, TFP ``GradientBasedTrajectoryLengthAdaptation``.
- ``MCLMC`` (``inference.mclmc``), the unadjusted microcanonical kernel, shares ``ChainRNG``
  and ``ChainState``.

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

#: The most unconstrained scalars a dense mass matrix is adapted for: it holds D x D float64
#: numbers and each leapfrog step multiplies the K chains' momenta by it.
MAX_DENSE_DIM = 4096


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


def check_dense_dim(dim: int) -> None:
    """Refuse a dense metric for more than ``MAX_DENSE_DIM`` unconstrained scalars.

    Raises:
        ValueError: ``dim > MAX_DENSE_DIM``, with the metric's size.
    """
    if dim > MAX_DENSE_DIM:
        raise ValueError(
            f"a dense mass matrix is adapted for at most {MAX_DENSE_DIM} unconstrained "
            f"scalars; this posterior has {dim} (its metric would take "
            f"{dim**2 * 8 / 2**20:.0f} MiB): use the diagonal one (full_mass=False)"
        )


def regularized_covariance(draws: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """Stan's regularised dense metric ``n/(n+5) Σ + 1e-3 * 5/(n+5) I`` from window ``draws``
    ``(n, K, D)``, ``Σ`` the covariance within the ``groups`` (``(K,)`` superchain indices;
    None: one group) pooled over them. ``(D, D)`` float64.

    No shrinkage towards the diagonal: it would add the long directions' variance to the narrow
    ones, the directions a dense metric is for (a ridge of sds 10 and 0.1 would get a metric
    several times too wide across it, and a step size to match). Directions a window has not
    explored get a small variance, which slows them but keeps the leapfrog stable."""
    n, chains, dim = draws.shape
    x = draws.double()
    chain_means = x.mean(0)
    x = (x - (chain_means - centered(chain_means, groups))).reshape(n * chains, dim)
    num_groups = 1 if groups is None else len(torch.unique(groups))
    total = n * chains
    covariance = x.T @ x / max(total - num_groups, 1)
    eye = torch.eye(dim, dtype=covariance.dtype, device=covariance.device)
    return total / (total + 5.0) * covariance + 1e-3 * 5.0 / (total + 5.0) * eye


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
        dense: adapt a dense mass matrix (``regularized_covariance`` of each window's draws)
            instead of a diagonal one: for posteriors whose narrow directions are not along
            the axes (weight symmetries, a softmax head's shift), where a diagonal metric
            forces the step size down to the narrowest of them. At most ``MAX_DENSE_DIM``
            unconstrained scalars. A window with fewer than twice as many draws (chains x
            transitions) as scalars adapts the diagonal instead: its covariance would be
            rank-deficient and freeze the directions it missed.

    Raises:
        ValueError: ``dense`` for a density of more than ``MAX_DENSE_DIM`` scalars (at
            ``init``).

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
        dense: bool = False,
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
        self.dense = dense
        self.t = 0
        self.gradients = 0

    def init(self, z: torch.Tensor) -> ChainState:
        """The state at ``z`` ``(K, D)``; searches a reasonable initial step size."""
        if self.dense:
            check_dense_dim(z.shape[1])
        lp, grad = self.density(z)
        state = ChainState(z, lp, grad)
        self.inv_mass = torch.ones(z.shape[1], device=z.device, dtype=z.dtype)
        self.covariance = self._cholesky = None  # the dense metric, once adapted
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
            accept, log_accept, *_ = self._trajectory(state, self._momentum(state), eps, 1)
            high = _harmonic_mean(accept, ~(log_accept > -MAX_ENERGY_ERROR)) > 0.5
            if direction == 0:
                direction = 1 if high else -1
            elif (direction == 1) != high:
                break
            eps = eps * 2.0 if direction == 1 else eps / 2.0
        self.step_size = eps
        self._da = DualAveraging(mu=math.log(10 * eps))

    def _momentum(self, state: ChainState) -> torch.Tensor:
        """Fresh momenta ``(K, D)`` ~ N(0, M), M the inverse of the metric (the posterior
        covariance estimate ``L L^T``: ``p = L^{-T} xi``)."""
        xi = self.rng.normal(state.z.shape[1], state.z.dtype)
        if self._cholesky is None:
            return xi / self.inv_mass.sqrt()
        return torch.linalg.solve_triangular(self._cholesky, xi, upper=False, left=False)

    def _velocity(self, p: torch.Tensor) -> torch.Tensor:
        """``M^{-1} p`` of each chain's momentum."""
        return self.inv_mass * p if self.covariance is None else p @ self.covariance

    def _trajectory(self, state: ChainState, p: torch.Tensor, eps: float, steps: int):
        """Leapfrog ``steps`` steps for every chain; ``(accept_prob, log_accept, energy0,
        proposal, final velocity)``, the energies in nats."""
        energy0 = -state.lp + 0.5 * (p * self._velocity(p)).sum(1)
        z, lp, grad = state.z, state.lp, state.grad
        p = p + 0.5 * eps * grad
        for i in range(steps):
            z = z + eps * self._velocity(p)
            lp, grad = self.density(z)
            p = p + (eps if i < steps - 1 else 0.5 * eps) * grad
        self.gradients += steps * len(z)
        velocity = self._velocity(p)
        log_accept = energy0 - (-lp + 0.5 * (p * velocity).sum(1))
        log_accept = torch.where(torch.isfinite(log_accept), log_accept, -math.inf)
        accept = log_accept.clamp(max=0.0).exp()
        return accept, log_accept, energy0, ChainState(z, lp, grad), velocity

    def step(self, state: ChainState, *, adapt: bool) -> tuple[ChainState, Transition]:
        """One transition of every chain (jittered trajectory, Metropolis correction per
        chain); adapts the step size, trajectory length and mass matrix when ``adapt``."""
        self.t += 1
        T = math.exp(self.log_T if adapt else self.log_T_avg)
        eps = self.step_size
        jitter = halton(self.t)
        # capped before ceil: a huge trajectory length over a small step overflows int
        steps = max(1, math.ceil(min(jitter * T / eps, self.max_leapfrog_steps)))
        accept, log_accept, energy0, proposal, velocity = self._trajectory(
            state, self._momentum(state), eps, steps
        )
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
            self._sums = [torch.zeros_like(z), torch.zeros_like(z), torch.zeros_like(accept), []]
        self._sums[0] += z
        self._sums[1] += z * z
        self._sums[2] += accept.nan_to_num(0.0)
        if self.dense:
            self._sums[3].append(state.z)
        n = self.t - start
        if self.t == end:
            total, squares, accepted, window = self._sums
            moving = accepted / n >= MOVING_ACCEPTANCE
            if moving.sum() < 2:
                moving = torch.ones_like(moving)
            groups = None if self.superchain is None else self.superchain[moving]
            # a dense estimate needs more window draws than dimensions; below that it is
            # rank-deficient and would freeze the unexplored directions: keep the diagonal
            if self.dense and n * int(moving.sum()) > 2 * state.z.shape[1]:
                covariance = regularized_covariance(torch.stack(window)[:, moving], groups)
                self._cholesky = torch.linalg.cholesky(covariance).to(state.z.dtype)
                self.covariance = covariance.to(state.z.dtype)
            else:
                pooled = regularized_variance(total[moving], squares[moving], n, groups)
                self.inv_mass = pooled.to(state.z.dtype)
                self.covariance = self._cholesky = None
            self._windows.pop(0)
            self._sums = None
            self._restart_step_size(state)

    def settings(self) -> dict:
        """The adapted step size and trajectory length (for the record)."""
        return dict(step_size=self.step_size, trajectory_length=math.exp(self.log_T_avg))


def _harmonic_mean(accept: torch.Tensor, diverging: torch.Tensor) -> float:
    """Harmonic mean of the acceptance probabilities of the chains that did not diverge; 0
    when every chain diverged."""
    kept = accept[~diverging]
    if not len(kept):
        return 0.0
    return float(1.0 / (1.0 / kept.clamp_min(1e-10)).mean())


__all__ = ["CHEES_TARGET_ACCEPT", "MAX_DENSE_DIM", "ChEES", "ChainRNG", "ChainState", "Transition"]
