"""Many-chain kernels: K chains advanced together, each step one vectorized gradient of K chains.

- ``ChEES`` (the settings, ``fit_mcmc(kernel=ChEES(...))``) and ``ChEESSampler`` (one run):
  ChEES-HMC (Hoffman, Radul & Sountsov, "An Adaptive-MCMC Scheme for Setting
  Trajectory Lengths in Hamiltonian Monte Carlo", AISTATS 2021): HMC with a jittered trajectory
  length shared by the chains, Metropolis-adjusted per chain (exact). Warm-up adapts the step
  size by dual averaging (Hoffman & Gelman 2014) on the harmonic mean of the chains'
  acceptance probabilities, the trajectory length by Adam on the ChEES criterion, and a
  diagonal (or dense) mass matrix from the moments pooled over chains and window draws (Stan's
  windows; ``inference.mcmc.adaptation``). Both use moments within start groups (chains sharing
  a start): chains from different MAP starts sit in different modes, and centring them on one
  mean measures the distance between the modes, not the posterior's scale around each. With
  ``per_start`` every start's chains adapt their own step size, trajectory length and mass
  matrix, as each ensemble member's chains do in MILE (Sommer et al. 2025).
  References: BlackJAX ``chees_adaptation``, TFP ``GradientBasedTrajectoryLengthAdaptation``.
- ``MCLMC`` (``inference.mcmc.mclmc``), the unadjusted microcanonical kernel, shares ``ChainRNG``
  and ``ChainState``.

Every chain draws its random numbers from its own ``torch.Generator`` (``ChainRNG``), seeded
from ``(seed, chain)``; the jitter of the trajectory length is a Halton sequence shared by the
chains, as in BlackJAX. Cross-chain statistics (adaptation) are reduced in chain order.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from probtransformer.inference.mcmc.adaptation import (
    centered,
    check_dense_dim,
    regularized_covariance,
    regularized_variance,
    warmup_windows,
)
from probtransformer.inference.mcmc.kernel import (
    MAX_ENERGY_ERROR,
    ChainRNG,
    ChainState,
    Flag,
    LogDensity,
    ManyChainKernel,
    ManyChainSampler,
    halton,
    stuck_chains_line,
)
from probtransformer.validation import check_flag, check_positive, check_probability

#: The ChEES target of the harmonic-mean acceptance probability (Beskos et al. 2013's optimum,
#: BlackJAX's default).
CHEES_TARGET_ACCEPT = 0.651

#: Chains whose mean acceptance probability over a mass-matrix window is below this are left
#: out of its variance (they are stuck, not exploring).
MOVING_ACCEPTANCE = 0.05


@dataclass(frozen=True)
class ChEES(ManyChainKernel):
    """ChEES-HMC's settings (see the module docstring), ``fit_mcmc(kernel=ChEES(...))``.

    Attributes:
        target_accept_prob: target of the chains' harmonic-mean acceptance in (0, 1).
        step_size: initial step size (> 0; searched by doubling/halving, then dual averaging).
        trajectory_length: initial trajectory length (> 0; None: 10 of the searched steps).
        full_mass: adapt a dense mass matrix (at most ``adaptation.MAX_DENSE_DIM`` scalars).
        temperature, compile: ``ManyChainKernel``'s.

    Raises:
        TypeError/ValueError: on construction, naming the setting and what arrived.
    """

    name: ClassVar[str] = "chees"
    #: The criterion centres each start's chains on their mean: two or more to tune apart.
    min_chains_per_start: ClassVar[int] = 2

    target_accept_prob: float = CHEES_TARGET_ACCEPT
    step_size: float = 0.1
    trajectory_length: float | None = None
    full_mass: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("target_accept_prob", self.target_accept_prob)
        check_positive("step_size", self.step_size)
        check_positive("trajectory_length", self.trajectory_length, none=True)
        check_flag("full_mass", self.full_mass)

    def sampler(
        self, density: LogDensity, rng: ChainRNG, *, num_warmup: int, groups, per_start: bool
    ) -> ChEESSampler:
        return ChEESSampler(
            density,
            rng,
            num_warmup,
            step_size=self.step_size,
            trajectory_length=self.trajectory_length,
            target_accept_prob=self.target_accept_prob,
            groups=groups,
            dense=self.full_mass,
            per_start=per_start,
        )

    @classmethod
    def verdict_lines(cls, stats: Any, record: dict, flag: Flag) -> list[str]:
        """Stuck chains: mean acceptance below ``STUCK_ACCEPTANCE``."""
        if "acceptance_rate" not in stats:
            return []
        return [stuck_chains_line(stats["acceptance_rate"].mean("draw").values, flag)]


@dataclass
class DualAveraging:
    """Nesterov dual averaging of ``log x`` towards a target statistic (Hoffman & Gelman 2014,
    §3.2, with Stan's constants ``gamma=0.05, t0=10, kappa=0.75``); ``mu`` and the errors may
    be ``(G,)`` tensors, one average per group."""

    mu: float | torch.Tensor
    gamma: float = 0.05
    t0: float = 10.0
    kappa: float = 0.75
    t: int = 0
    error_sum: float = 0.0
    log_x_avg: float = 0.0

    def update(self, error):
        """Take ``error = target - statistic``; return the new ``log x``."""
        self.t += 1
        self.error_sum += error
        log_x = self.mu - math.sqrt(self.t) / self.gamma * self.error_sum / (self.t + self.t0)
        weight = self.t**-self.kappa
        self.log_x_avg = weight * log_x + (1 - weight) * self.log_x_avg
        return log_x


@dataclass
class Transition:
    """What one many-chain transition gives, per chain ``(K,)``: acceptance probability,
    divergence, initial energy, leapfrog steps and step size."""

    accept_prob: torch.Tensor
    diverging: torch.Tensor
    energy: torch.Tensor
    n_steps: torch.Tensor
    step_size: torch.Tensor


class ChEESSampler(ManyChainSampler):
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
        groups: ``(K,)`` index of each chain's start; the ChEES criterion and the mass matrix
            use moments within start groups when each has two chains or more. None: all
            chains are one.
        dense: adapt a dense mass matrix (``metric.regularized_covariance`` of each window's
            draws) instead of a diagonal one: for posteriors whose narrow directions are not
            along the axes (weight symmetries, a softmax head's shift), where a diagonal metric
            forces the step size down to the narrowest of them. At most
            ``metric.MAX_DENSE_DIM`` unconstrained scalars. A window with fewer than twice as
            many draws (chains x transitions) as scalars adapts the diagonal instead: its
            covariance would be rank-deficient and freeze the directions it missed.
        per_start: each start's chains adapt their own step size, trajectory length and mass
            matrix from their own chains (at least two each); the groups' trajectories run
            together, those with fewer leapfrog steps waiting for the longest. False: one
            adaptation for all chains.

    Raises:
        ValueError: ``dense`` for a density of more than ``metric.MAX_DENSE_DIM`` scalars (at
            ``init``); ``per_start`` with a start of one chain.

    Attributes:
        step_size: ``(G,)`` float64, per start (one value without ``per_start``).
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
        groups: torch.Tensor | None = None,
        dense: bool = False,
        per_start: bool = False,
    ) -> None:
        self.density = density
        self.rng = rng
        self.num_warmup = num_warmup
        self.initial_step_size = step_size
        self.trajectory_length = trajectory_length
        self.target_accept_prob = target_accept_prob
        self.max_leapfrog_steps = max_leapfrog_steps
        self.learning_rate = learning_rate
        if per_start and (groups is None or int(torch.bincount(groups).min()) < 2):
            raise ValueError(
                "per_start adaptation needs two or more chains from every start (the ChEES "
                "criterion centres each start's chains on their mean)"
            )
        if groups is not None and int(torch.bincount(groups).min()) < 2:
            groups = None  # a lone chain has no spread around its start group's mean
        self.starts = groups
        self.per_start = per_start
        self.dense = dense
        self.t = 0
        self.gradients = 0

    # -- groups: the starts adapted apart (one group without per_start) ------------------------

    def _chains(self, per_group: torch.Tensor, dtype) -> torch.Tensor:
        """``(K, 1)`` per-chain values of ``(G,)`` per-group ones."""
        return per_group.to(self.groups.device)[self.groups][:, None].to(dtype)

    def _harmonic_means(self, accept: torch.Tensor, diverging: torch.Tensor) -> torch.Tensor:
        """``(G,)`` harmonic mean acceptance of each group's chains that did not diverge (0
        where every one diverged)."""
        return torch.tensor(
            [
                _harmonic_mean(accept[self.groups == g], diverging[self.groups == g])
                for g in range(self.num_groups)
            ],
            dtype=torch.float64,
        )

    def init(self, z: torch.Tensor) -> ChainState:
        """The state at ``z`` ``(K, D)``; searches a reasonable initial step size."""
        if self.dense:
            check_dense_dim(z.shape[1])
        chains = len(z)
        if self.per_start:
            self.groups = self.starts
        else:
            self.groups = torch.zeros(chains, dtype=torch.long, device=z.device)
        self.num_groups = int(self.groups.max()) + 1
        lp, grad = self.density(z)
        state = ChainState(z, lp, grad)
        self.inv_mass = torch.ones_like(z)  # (K, D): each chain its group's
        self.covariance = self._cholesky = None  # the dense metric, (G, D, D), once adapted
        self._windows = warmup_windows(self.num_warmup)
        self._sums = None
        self.step_size = torch.full(
            (self.num_groups,), float(self.initial_step_size), dtype=torch.float64
        )
        self._restart_step_size(state)
        if self.trajectory_length is None:  # 10 of the searched steps
            self.log_T = torch.log(10 * self.step_size)
        else:
            self.log_T = torch.full_like(self.step_size, math.log(self.trajectory_length))
        self.log_T_avg = self.log_T.clone()
        self._adam_v = torch.zeros(self.num_groups, dtype=torch.float64)
        return state

    def _restart_step_size(self, state: ChainState) -> None:
        """Double or halve each group's step size until one leapfrog step's harmonic-mean
        acceptance crosses 0.5 (Hoffman & Gelman 2014, Algorithm 4), then restart dual
        averaging."""
        eps = self.step_size.clone()
        direction = torch.zeros(self.num_groups, dtype=torch.long)  # 0: not yet chosen
        searching = torch.ones(self.num_groups, dtype=torch.bool)
        one = torch.ones(len(state.z), dtype=torch.long, device=state.z.device)
        for _ in range(50):
            accept, log_accept, *_ = self._trajectory(state, self._momentum(state), eps, one)
            high = self._harmonic_means(accept, ~(log_accept > -MAX_ENERGY_ERROR)) > 0.5
            direction = torch.where(direction == 0, torch.where(high, 1, -1), direction)
            searching &= (direction == 1) == high
            if not searching.any():
                break
            eps = torch.where(searching, torch.where(direction == 1, eps * 2, eps / 2), eps)
        self.step_size = eps
        self._da = DualAveraging(mu=torch.log(10 * eps))

    def _momentum(self, state: ChainState) -> torch.Tensor:
        """Fresh momenta ``(K, D)`` ~ N(0, M), M the inverse of the metric (the posterior
        covariance estimate ``L L^T``: ``p = L^{-T} xi``)."""
        xi = self.rng.normal(state.z.shape[1], state.z.dtype)
        if self._cholesky is None:
            return xi / self.inv_mass.sqrt()
        p = torch.empty_like(xi)
        for g in range(self.num_groups):
            rows = self.groups == g
            p[rows] = torch.linalg.solve_triangular(
                self._cholesky[g], xi[rows], upper=False, left=False
            )
        return p

    def _velocity(self, p: torch.Tensor) -> torch.Tensor:
        """``M^{-1} p`` of each chain's momentum."""
        if self.covariance is None:
            return self.inv_mass * p
        velocity = torch.empty_like(p)
        for g in range(self.num_groups):
            rows = self.groups == g
            velocity[rows] = p[rows] @ self.covariance[g]
        return velocity

    def _trajectory(self, state: ChainState, p: torch.Tensor, eps, steps: torch.Tensor):
        """Leapfrog ``steps`` ``(K,)`` steps of each chain at its group's step size ``eps``
        ``(G,)`` (the chains step together; one that has taken its steps waits); ``(accept_prob,
        log_accept, energy0, proposal, final velocity)``, the energies in nats."""
        eps = self._chains(eps, state.z.dtype)  # (K, 1)
        energy0 = -state.lp + 0.5 * (p * self._velocity(p)).sum(1)
        z, lp, grad = state.z, state.lp, state.grad
        p = p + 0.5 * eps * grad
        longest = int(steps.max())
        for i in range(longest):
            moving = (i < steps)[:, None]
            z_new = z + eps * self._velocity(p)
            lp_new, grad_new = self.density(z_new)
            kick = torch.where(i < steps - 1, 1.0, 0.5)[:, None].to(eps.dtype) * eps
            p = torch.where(moving, p + kick * grad_new, p)
            z = torch.where(moving, z_new, z)
            lp = torch.where(moving[:, 0], lp_new, lp)
            grad = torch.where(moving, grad_new, grad)
        self.gradients += longest * len(z)
        velocity = self._velocity(p)
        log_accept = energy0 - (-lp + 0.5 * (p * velocity).sum(1))
        log_accept = torch.where(torch.isfinite(log_accept), log_accept, -math.inf)
        accept = log_accept.clamp(max=0.0).exp()
        return accept, log_accept, energy0, ChainState(z, lp, grad), velocity

    def step(self, state: ChainState, *, adapt: bool) -> tuple[ChainState, Transition]:
        """One transition of every chain (jittered trajectory, Metropolis correction per
        chain); adapts the step size, trajectory length and mass matrix when ``adapt``."""
        self.t += 1
        T = torch.exp(self.log_T if adapt else self.log_T_avg)
        eps = self.step_size
        jitter = halton(self.t)
        # capped before ceil: a huge trajectory length over a small step overflows int
        per_group = torch.ceil((jitter * T / eps).clamp(max=self.max_leapfrog_steps)).clamp(min=1)
        steps = per_group.long().to(self.groups.device)[self.groups]  # (K,)
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
                self.step_size = torch.exp(self._da.log_x_avg)
        move = Transition(
            accept, diverging, energy0, steps, self._chains(eps, torch.float64).squeeze(1)
        )
        return new, move

    def _adapt(self, state, proposal, velocity, accept, diverging, jitter) -> None:
        # the step size: dual averaging on each group's harmonic-mean acceptance of the chains
        # that did not diverge (as BlackJAX): one stuck chain would otherwise drive it to 0
        hm = self._harmonic_means(accept, diverging)
        self.step_size = torch.exp(self._da.update(self.target_accept_prob - hm))
        # the trajectory length: Adam ascent of the ChEES criterion, acceptance-weighted
        ok = ~diverging & torch.isfinite(proposal.z).all(1) & torch.isfinite(velocity).all(1)
        groups = self.starts
        c0, c1 = centered(state.z, groups), centered(proposal.z, groups)
        T = torch.exp(self.log_T).to(self.groups.device)[self.groups].to(accept.dtype)
        per_chain = (c1.square().sum(1) - c0.square().sum(1)) * (c1 * velocity).sum(1)
        weighted = torch.where(ok, accept * jitter * T * per_chain, 0.0).double()
        weights = torch.where(ok, accept, 0.0).double()
        for g in range(self.num_groups):
            rows = (self.groups == g) & ok
            if rows.sum() < 2 or float(weights[rows].sum()) <= 0:
                continue
            gradient = float(weighted[rows].sum() / weights[rows].sum())  # d ChEES / d log T
            if not math.isfinite(gradient):
                continue
            self._adam_v[g] = 0.5 * self._adam_v[g] + 0.5 * gradient**2
            change = self.learning_rate * gradient / (math.sqrt(self._adam_v[g]) + 1e-12)
            self.log_T[g] = min(
                float(self.log_T[g]) + max(-0.35, min(0.35, change)),
                math.log(self.max_leapfrog_steps * float(self.step_size[g])),
            )
            self.log_T_avg[g] = 0.9 * self.log_T_avg[g] + 0.1 * self.log_T[g]

    def _adapt_mass(self, state: ChainState, accept: torch.Tensor) -> None:
        """Sum every chain's positions over the current window; at its end, set each group's
        inverse mass matrix to the regularised variance within start groups, pooled over the
        group's chains that moved (mean acceptance >= ``MOVING_ACCEPTANCE``; all of them if
        fewer than two did), and restart the step-size adaptation. A stuck chain would add its
        distance from the others."""
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
            dim = state.z.shape[1]
            dense = []
            for g in range(self.num_groups):
                rows = self.groups == g
                moving = rows & (accepted / n >= MOVING_ACCEPTANCE)
                if moving.sum() < 2:
                    moving = rows
                groups = None if self.starts is None else self.starts[moving]
                pooled = regularized_variance(total[moving], squares[moving], n, groups)
                self.inv_mass[rows] = pooled.to(state.z.dtype)
                # a dense estimate needs more window draws than dimensions; below that it is
                # rank-deficient and would freeze the unexplored directions: keep the diagonal
                if self.dense and n * int(moving.sum()) > 2 * dim:
                    dense.append(regularized_covariance(torch.stack(window)[:, moving], groups))
            if len(dense) == self.num_groups:
                covariance = torch.stack(dense)  # (G, D, D)
                self._cholesky = torch.linalg.cholesky(covariance).to(state.z.dtype)
                self.covariance = covariance.to(state.z.dtype)
            else:
                self.covariance = self._cholesky = None
            self._windows.pop(0)
            self._sums = None
            self._restart_step_size(state)

    def warmup(self, state: ChainState) -> Generator[None, None, ChainState]:
        """``num_warmup`` adapting transitions, yielding after each."""
        for _ in range(self.num_warmup):
            state, _ = self.step(state, adapt=True)
            yield
        return state

    def sample(self, state: ChainState) -> tuple[ChainState, dict[str, torch.Tensor]]:
        """One transition with the adapted settings, and its per-chain statistics."""
        state, move = self.step(state, adapt=False)
        return state, dict(
            diverging=move.diverging,
            acceptance_rate=move.accept_prob,
            step_size=move.step_size.to(state.lp),
            n_steps=move.n_steps.to(state.lp),
            energy=move.energy,
            lp=state.lp,
        )

    def adapted(self) -> dict:
        """The adapted step size and trajectory length (floats; lists, one per start, when
        they adapt apart), for the record."""

        def shown(values: torch.Tensor):
            return values.tolist() if self.per_start else float(values[0])

        return dict(
            step_size=shown(self.step_size), trajectory_length=shown(torch.exp(self.log_T_avg))
        )


def _harmonic_mean(accept: torch.Tensor, diverging: torch.Tensor) -> float:
    """Harmonic mean of the acceptance probabilities of the chains that did not diverge; 0
    when every chain diverged."""
    kept = accept[~diverging]
    if not len(kept):
        return 0.0
    return float(1.0 / (1.0 / kept.clamp_min(1e-10)).mean())


__all__ = ["CHEES_TARGET_ACCEPT", "ChEES", "ChEESSampler", "Transition"]
