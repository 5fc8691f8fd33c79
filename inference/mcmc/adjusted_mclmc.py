"""Metropolis-adjusted microcanonical HMC (MAMS; Robnik, Cohn-Gordon & Seljak, "Metropolis
Adjusted Microcanonical Hamiltonian Monte Carlo", 2025): the isokinetic (ESH) dynamics of MCLMC
(``inference.mcmc.mclmc``) with a full velocity refresh before each proposal, a random number of
integration steps, and a Metropolis accept/reject per chain on the energy error, the potential
energy's change plus the kinetic-energy change of the isokinetic velocity map. Exact: the
stationary distribution is the posterior at every step size, where unadjusted MCLMC carries a
step-size bias.

- ``AdjustedMCLMC``: the settings, ``fit_mcmc(kernel=AdjustedMCLMC(...))``.
- ``AdjustedMCLMCSampler``: one run over K chains, every integration step one vectorized
  gradient of K chains (the chains step together; a chain whose trajectory is done waits).

Warm-up follows BlackJAX's ``adjusted_mclmc_find_L_and_step_size`` (with its
``adjusted_mclmc_dynamic`` kernel), every tuning group (the chains of one start with
``per_start``, else all chains) on its own: (1) dual averaging of the step size ε on the
group's mean acceptance probability, ``L`` scaled with ε (the steps per proposal ``L / ε`` held);
(2) fixed ε and L while the positions' variance is measured (within start groups: chains from
different starts may sit in different modes); then ``L <- 1.3 sqrt(sum of the variances)`` (at
most doubled, ε scaled alike) or, with ``diagonal_preconditioning``, the preconditioner σ = the
sds, ε searched afresh and ``L = sqrt(D)``; (3) dual averaging again, L fixed (ε at most
``L / 1.1``); (4) ``L <- 0.4 L mean(draws / ESS)`` from the bulk ESS of the phase's draws
(``mclmc_adaptation.steps_per_effective_draw``; at most doubled); (5) dual averaging of ε, L fixed.
Differences from BlackJAX: the chains of a group share ε and L (their mean acceptance drives
the dual averaging); L from the ESS averages draws per ESS over coordinates (as our MCLMC); the
initial ε comes from a doubling/halving search (one integration step, the group's mean
acceptance crossing the target) instead of ``0.25 sqrt(D)``; the trajectory's random length is
drawn from a Halton sequence shared by the chains (as ChEES), so they wait for no longer
trajectory than their own group's; the integrator is the isokinetic velocity Verlet (one
gradient a step, MCLMC's) rather than BlackJAX's default McLachlan scheme.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from probtransformer.inference.mcmc.chees import DualAveraging
from probtransformer.inference.mcmc.kernel import (
    MAX_ENERGY_ERROR,
    STUCK_ACCEPTANCE,
    ChainRNG,
    ChainState,
    Flag,
    LogDensity,
    ManyChainKernel,
    ManyChainSampler,
    halton,
    stuck_chains_line,
)
from probtransformer.inference.mcmc.mclmc import isokinetic_velocity
from probtransformer.inference.mcmc.mclmc_adaptation import BACKOFF, steps_per_effective_draw
from probtransformer.validation import check_flag, check_int, check_positive, check_probability

#: MAMS's target acceptance probability (BlackJAX's default for adjusted MCLMC).
ADJUSTED_TARGET_ACCEPT = 0.9

#: Integration steps per proposal (``L / ε``) before ``L`` is tuned (BlackJAX's initial
#: ``L = sqrt(D)``, ``ε = 0.2 sqrt(D)``).
INITIAL_STEPS = 5.0

#: Shares of the warm-up transitions of phases 1-4 (the rest is phase 5; module docstring).
PHASES = (0.2, 0.15, 0.2, 0.2)

#: ``L`` from the variances: this factor times ``sqrt(sum of the variances)`` (BlackJAX's
#: ``tuning_factor``); from the ESS: this factor times ``L`` times the mean over coordinates of
#: draws per effective draw (BlackJAX divides by the mean ESS per draw instead).
VARIANCE_L_FACTOR, ESS_L_FACTOR = 1.3, 0.4

#: The most a tuning phase multiplies ``L`` by (BlackJAX's ``Lratio_upperbound``).
MAX_L_CHANGE = 2.0

#: The verdict warns when the mean acceptance is this far below the target.
LOW_ACCEPTANCE_MARGIN = 0.2


@dataclass(frozen=True)
class AdjustedMCLMC(ManyChainKernel):
    """Adjusted MCLMC's settings (see the module docstring), ``fit_mcmc(kernel=AdjustedMCLMC())``.

    Attributes:
        target_accept_prob: target of each tuning group's mean acceptance probability in
            (0, 1) (MAMS: 0.9).
        step_size: initial step size ε (> 0, in the preconditioned space's units); None:
            searched from 1 by doubling/halving.
        L: initial trajectory length (> 0, integration time); None: ``INITIAL_STEPS`` steps.
        diagonal_preconditioning: scale each coordinate by its sd, measured in warm-up.
        random_trajectory_length: draw each proposal's step count from ``1 .. ~2 L / ε``
            (mean ``L / ε``; MAMS), else always ``round(L / ε)``.
        max_steps: most integration steps per proposal (an int >= 1).
        temperature, compile: ``ManyChainKernel``'s.

    Raises:
        TypeError/ValueError: on construction, naming the setting and what arrived.
    """

    name: ClassVar[str] = "adjusted-mclmc"

    target_accept_prob: float = ADJUSTED_TARGET_ACCEPT
    step_size: float | None = None
    L: float | None = None
    diagonal_preconditioning: bool = True
    random_trajectory_length: bool = True
    max_steps: int = 1024

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("target_accept_prob", self.target_accept_prob)
        check_positive("step_size", self.step_size, none=True)
        check_positive("L", self.L, none=True)
        check_flag("diagonal_preconditioning", self.diagonal_preconditioning)
        check_flag("random_trajectory_length", self.random_trajectory_length)
        check_int("max_steps", self.max_steps, minimum=1, type_error=True)

    def sampler(
        self, density: LogDensity, rng: ChainRNG, *, num_warmup: int, groups, per_start: bool
    ) -> AdjustedMCLMCSampler:
        check_int("num_warmup", num_warmup, minimum=0, type_error=True)
        return AdjustedMCLMCSampler(density, rng, self, num_warmup, groups=groups,
                                    per_start=per_start)  # fmt: skip

    @classmethod
    def verdict_lines(cls, stats: Any, record: dict, flag: Flag) -> list[str]:
        """Stuck chains (mean acceptance below ``STUCK_ACCEPTANCE``), and the other chains' mean
        acceptance more than ``LOW_ACCEPTANCE_MARGIN`` below the target (the step size did not
        settle)."""
        if "acceptance_rate" not in stats:
            return []
        per_chain = stats["acceptance_rate"].mean("draw").values
        target = record.get("target_accept_prob", ADJUSTED_TARGET_ACCEPT)
        moving = per_chain[per_chain >= STUCK_ACCEPTANCE]
        mean = float(np.mean(moving)) if moving.size else 0.0
        low = mean < target - LOW_ACCEPTANCE_MARGIN
        return [
            stuck_chains_line(per_chain, flag),
            flag(
                low,
                f"mean acceptance {mean:.2f} (target {target})"
                + (": the step size did not settle; lengthen num_warmup" if low else ""),
            ),
        ]


def jitter_scale(mean_steps: torch.Tensor) -> torch.Tensor:
    """``s`` such that ``ceil(U s)``, ``U ~ Uniform(0, 1)``, has mean ``mean_steps`` (>= 1).

    With ``s = k + x`` (k an integer, 0 <= x < 1), ``E ceil(U s) = (k (k + 1) / 2 + (k + 1) x)
    / s``; ``k = floor(2 mean - 1)`` keeps x in [0, 1) (BlackJAX's ``rescale``)."""
    mu = mean_steps.clamp_min(1.0)
    k = torch.floor(2 * mu - 1)
    return k + k * (mu - 0.5 * (k + 1)) / (k + 1 - mu)


class AdjustedMCLMCSampler(ManyChainSampler):
    """Adjusted MCLMC over K chains (see the module docstring).

    Args:
        density: ``z (K, D) -> (log density (K,), gradient (K, D))``.
        rng: the chains' random streams.
        settings: the ``AdjustedMCLMC`` settings.
        num_warmup: warm-up transitions (0: sample with the initial ε and L).
        groups: ``(K,)`` long, each chain's start (0 .. M - 1).
        per_start: each start's chains tune their own ε, L and preconditioner.

    Raises:
        ValueError: (at ``init``) ``z`` not ``(K, D)``, fewer than 2 unconstrained scalars (the
            velocity lives on a sphere), or ``groups`` not a ``(K,)`` long tensor.

    Attributes:
        step_size, L: ``(G,)`` float64 per tuning group.
        sigma: ``(K, D)`` each chain's preconditioner (its group's sds).
        gradients: chain-gradients evaluated so far.
    """

    def __init__(self, density: LogDensity, rng: ChainRNG, settings: AdjustedMCLMC,
                 num_warmup: int, *, groups: torch.Tensor, per_start: bool) -> None:  # fmt: skip
        self.density, self.rng, self.settings = density, rng, settings
        self.num_warmup, self.starts, self.per_start = num_warmup, groups, per_start
        self.gradients = self.t = 0

    # -- groups ---------------------------------------------------------------------------------

    def _chains(self, per_group: torch.Tensor) -> torch.Tensor:
        """``(K, 1)`` per-chain values of ``(G,)`` per-group ones, in the state's dtype."""
        return per_group.to(self.groups.device)[self.groups][:, None].to(self.sigma.dtype)

    def _group_mean(self, per_chain: torch.Tensor) -> torch.Tensor:
        """``(G,)`` float64 means over each group's chains of ``(K,)`` values."""
        total = torch.zeros(self.num_groups, dtype=torch.float64, device=per_chain.device)
        total = total.index_add_(0, self.groups, per_chain.double()).cpu()
        return total / self.counts

    # -- init -----------------------------------------------------------------------------------

    def init(self, z: torch.Tensor) -> ChainState:
        """The state at ``z`` ``(K, D)``; searches the initial step size unless given."""
        if z.dim() != 2:
            raise ValueError(f"z must be (K, D), one row per chain, got shape {tuple(z.shape)}")
        chains, dim = z.shape
        if dim < 2:
            raise ValueError(
                f"adjusted MCLMC needs at least 2 unconstrained scalars (its velocity lives on "
                f"a sphere), got {dim}: use kernel ChEES or NUTS"
            )
        starts = self.starts
        if starts is None or starts.shape != (chains,) or starts.dtype != torch.long:
            shown = None if starts is None else f"{tuple(starts.shape)} {starts.dtype}"
            raise ValueError(f"groups must be a ({chains},) torch.long tensor, got {shown}")
        self.starts = starts.to(z.device)
        self.groups = self.starts if self.per_start else torch.zeros_like(self.starts)
        self.num_groups = int(self.groups.max()) + 1
        self.counts = torch.bincount(self.groups, minlength=self.num_groups).double().cpu()
        self.sigma = torch.ones_like(z)
        lp, grad = self.density(z)
        self.gradients += chains
        state = ChainState(z, lp, grad)
        initial = self.settings.step_size
        self.step_size = torch.full((self.num_groups,), initial or 1.0, dtype=torch.float64)
        self.step_max = torch.full_like(self.step_size, math.inf)
        if initial is None:
            self._search_step_size(state)
        L = self.settings.L
        self.L = torch.full_like(self.step_size, L) if L else INITIAL_STEPS * self.step_size
        return state

    def _search_step_size(self, state: ChainState) -> None:
        """Double or halve each group's ε until one integration step's mean acceptance crosses
        the target (Hoffman & Gelman 2014, Algorithm 4, at MAMS's target)."""
        eps = self.step_size.clone()
        direction = torch.zeros(self.num_groups, dtype=torch.long)  # 0: not yet chosen
        searching = torch.ones(self.num_groups, dtype=torch.bool)
        target = self.settings.target_accept_prob
        for _ in range(60):
            _, accept, *_ = self._transition(state, eps, eps, count=False)  # one step
            high = self._group_mean(accept) > target
            direction = torch.where(direction == 0, torch.where(high, 1, -1), direction)
            searching &= (direction == 1) == high
            if not searching.any():
                break
            eps = torch.where(searching, torch.where(direction == 1, eps * 2, eps / 2), eps)
        self.step_size = eps

    # -- one transition -------------------------------------------------------------------------

    def _steps(self, eps: torch.Tensor, L: torch.Tensor, count: bool) -> torch.Tensor:
        """``(G,)`` integration steps of the next proposal: ``ceil(u s)``, ``u`` the next Halton
        number, ``s = jitter_scale(L / ε)`` (or ``round(L / ε)``), in ``1 .. max_steps``."""
        mean = (L / eps).clamp(max=self.settings.max_steps)
        if self.settings.random_trajectory_length and count:
            self.t += 1
            steps = torch.ceil(halton(self.t) * jitter_scale(mean))
        else:
            steps = torch.round(mean)
        return steps.clamp(1, self.settings.max_steps).long()

    def _transition(self, state: ChainState, eps: torch.Tensor, L: torch.Tensor, count=True):
        """One proposal and accept/reject of every chain at its group's ε and L ``(G,)``.

        Returns ``(state, accept_prob, diverging, energy_error, steps, finite)``, each ``(K,)``
        (the energy error in nats, NaN where the trajectory left the finite numbers)."""
        per_group = self._steps(eps, L, count)
        steps = per_group.to(self.groups.device)[self.groups]  # (K,)
        dim = state.z.shape[1]
        u = self.rng.normal(dim, state.z.dtype)
        u = u / u.norm(dim=1, keepdim=True)  # a full refresh: uniform on the sphere
        e, sigma = self._chains(eps), self.sigma
        z, lp, grad = state.z, state.lp, state.grad
        kinetic = torch.zeros_like(lp)
        longest = int(steps.max())
        for i in range(longest):
            moving = i < steps
            u1, k1 = isokinetic_velocity(u, grad * sigma, 0.5 * e)
            z1 = z + e * sigma * u1
            lp1, grad1 = self.density(z1)
            u2, k2 = isokinetic_velocity(u1, grad1 * sigma, 0.5 * e)
            z = torch.where(moving[:, None], z1, z)
            lp = torch.where(moving, lp1, lp)
            grad = torch.where(moving[:, None], grad1, grad)
            u = torch.where(moving[:, None], u2, u)
            kinetic = torch.where(moving, kinetic + k1 + k2, kinetic)
        self.gradients += longest * len(z)
        energy_error = kinetic - (lp - state.lp)
        finite = torch.isfinite(energy_error) & torch.isfinite(z).all(1)
        finite &= torch.isfinite(grad).all(1)
        log_accept = torch.where(finite, -energy_error, -math.inf)
        accept = log_accept.clamp(max=0.0).exp()
        diverging = ~(energy_error < MAX_ENERGY_ERROR)  # NaN too
        take = (self.rng.uniform(state.z.dtype).log() < log_accept) & ~diverging
        new = ChainState(
            torch.where(take[:, None], z, state.z),
            torch.where(take, lp, state.lp),
            torch.where(take[:, None], grad, state.grad),
        )
        energy_error = torch.where(finite, energy_error, math.nan)
        return new, accept, diverging, energy_error, steps, finite

    # -- warm-up --------------------------------------------------------------------------------

    def _adapting(self, state: ChainState, da: DualAveraging | None, *, track_L: bool, moments):
        """One transition; dual averaging of ε when ``da`` (``L`` scaled alike when
        ``track_L``, else ε at most ``L / 1.1``), a non-finite trajectory capping its group's ε
        at ``BACKOFF`` times the one that failed (BlackJAX's ``handle_nans``); positions added
        to ``moments``."""
        eps = self.step_size
        new, accept, _, _, _, finite = self._transition(state, eps, self.L)
        failed = self._group_mean((~finite).double()) > 0
        self.step_max = torch.where(failed, torch.minimum(self.step_max, BACKOFF * eps),
                                    self.step_max)  # fmt: skip
        if da is not None:
            error = self.settings.target_accept_prob - self._group_mean(accept)
            self._set_step_size(torch.exp(da.update(error)), track_L)
        if moments is not None:
            moments.add(new.z, finite)
        return new

    def _set_step_size(self, eps: torch.Tensor, track_L: bool) -> None:
        eps = torch.minimum(eps.clamp_min(1e-10), self.step_max)
        if track_L:
            self.L = self.L * eps / self.step_size
        else:
            eps = torch.minimum(eps, self.L / 1.1)
        self.step_size = eps

    def _phases(self) -> list[int]:
        n = [int(share * self.num_warmup) for share in PHASES]
        return [*n, self.num_warmup - sum(n)]

    def warmup(self, state: ChainState) -> Generator[None, None, ChainState]:
        """``num_warmup`` adapting transitions in the five phases of the module docstring,
        yielding after each."""
        n1, n2, n3, n4, n5 = self._phases()
        state = yield from self._dual_averaging(state, n1, track_L=True)
        moments = _Moments(self.starts, self.groups, self.num_groups, state.z.shape[1])
        for _ in range(n2):
            state = self._adapting(state, None, track_L=True, moments=moments)
            yield
        if n2:
            variance = moments.variance()  # (G, D)
            change = (VARIANCE_L_FACTOR * variance.sum(1).sqrt() / self.L).clamp(max=MAX_L_CHANGE)
            self.L, self.step_size = self.L * change, self.step_size * change
            self.step_max = self.step_max * change
            if self.settings.diagonal_preconditioning:
                sds = variance.sqrt().to(self.groups.device)[self.groups]
                self.sigma = sds.to(self.sigma.dtype)
                self.step_max = torch.full_like(self.step_max, math.inf)  # a new metric
                self._search_step_size(state)
                self.L = torch.full_like(self.L, math.sqrt(state.z.shape[1]))
        state = yield from self._dual_averaging(state, n3, track_L=False)
        draws = []
        for _ in range(n4):
            state = self._adapting(state, None, track_L=False, moments=None)
            draws.append(state.z)
            yield
        if n4 >= 5:
            per_effective = steps_per_effective_draw(draws, self.groups, self.num_groups)
            self.L = torch.minimum(ESS_L_FACTOR * self.L * per_effective, MAX_L_CHANGE * self.L)
        return (yield from self._dual_averaging(state, n5, track_L=False))

    def _dual_averaging(self, state: ChainState, steps: int, *, track_L: bool):
        """``steps`` transitions of dual averaging restarted at the current ε, then ε its
        average; yields after each, returns the state."""
        da = DualAveraging(mu=torch.log(10 * self.step_size))
        for _ in range(steps):
            state = self._adapting(state, da, track_L=track_L, moments=None)
            yield
        if da.t:
            self._set_step_size(torch.exp(da.log_x_avg), track_L)
        return state

    # -- sampling -------------------------------------------------------------------------------

    def sample(self, state: ChainState) -> tuple[ChainState, dict[str, torch.Tensor]]:
        """One transition with the adapted ε and L, and its per-chain ``(K,)`` statistics:
        ``diverging``, ``acceptance_rate``, ``step_size``, ``n_steps`` (integration steps),
        ``energy_error`` (nats; NaN where the trajectory was not finite) and ``lp``."""
        state, accept, diverging, energy_error, steps, _ = self._transition(
            state, self.step_size, self.L
        )
        return state, dict(
            diverging=diverging,
            acceptance_rate=accept,
            step_size=self._chains(self.step_size).squeeze(1).to(state.lp),
            n_steps=steps.to(state.lp),
            energy_error=energy_error,
            lp=state.lp,
        )

    def adapted(self) -> dict[str, Any]:
        """The adapted ε, L and mean steps per proposal ``L / ε`` (floats; lists, one per
        start, with ``per_start``)."""

        def shown(values: torch.Tensor):
            return values.tolist() if self.per_start else float(values[0])

        return dict(
            step_size=shown(self.step_size),
            L=shown(self.L),
            steps_per_proposal=shown(self.L / self.step_size),
        )


class _Moments:
    """Each tuning group's variance of the positions about each start's own mean (chains from
    different starts may sit in different modes), from sums per start."""

    def __init__(self, starts: torch.Tensor, groups: torch.Tensor, num_groups: int, dim: int):
        self.starts, self.num_groups = starts.cpu(), num_groups
        num_starts = int(self.starts.max()) + 1
        self.group_of_start = torch.zeros(num_starts, dtype=torch.long)
        self.group_of_start[self.starts] = groups.cpu()
        self.total = torch.zeros(num_starts, dim, dtype=torch.float64)
        self.squares = torch.zeros_like(self.total)
        self.weights = torch.zeros(num_starts, dtype=torch.float64)

    def add(self, z: torch.Tensor, finite: torch.Tensor) -> None:
        """Add the positions ``z`` ``(K, D)`` of the chains whose step was ``finite`` ``(K,)``."""
        w = finite.double().cpu()
        z = w[:, None] * z.detach().double().cpu().nan_to_num(0.0)
        self.total.index_add_(0, self.starts, z)
        self.squares.index_add_(0, self.starts, z * z)
        self.weights.index_add_(0, self.starts, w)

    def variance(self) -> torch.Tensor:
        """``(G, D)`` float64 variances (at least 1e-10; 1 where a group never moved)."""
        deviation = self.squares - self.total.square() / self.weights.clamp_min(1.0)[:, None]
        sums = deviation.new_zeros(self.num_groups, deviation.shape[1])
        sums.index_add_(0, self.group_of_start, deviation)
        weight = self.weights.new_zeros(self.num_groups).index_add_(0, self.group_of_start,
                                                                     self.weights)  # fmt: skip
        variance = (sums / weight.clamp_min(1.0)[:, None]).clamp_min(1e-10)
        return torch.where(weight[:, None] > 0, variance, 1.0)


__all__ = [
    "ADJUSTED_TARGET_ACCEPT",
    "AdjustedMCLMC",
    "AdjustedMCLMCSampler",
    "jitter_scale",
]
