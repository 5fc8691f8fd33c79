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
import warnings
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from probtransformer.inference.mcmc.kernel import (
    MAX_ENERGY_ERROR,
    ChainRNG,
    ChainState,
    Flag,
    LogDensity,
    ManyChainKernel,
    ManyChainSampler,
)
from probtransformer.inference.mcmc.mclmc_adaptation import (
    BLACKJAX_TUNING,
    MILE_TUNING,
    Moments,
    StepSizeAdaptation,
    Tuning,
    steps_per_effective_draw,
)
from probtransformer.validation import check_int, described

#: Steps from the starting state whose energy error chooses the initial step size.
PROBE_STEPS = 3

#: Most integrator steps per kept draw when ``thinning`` is not given.
MAX_STEPS_PER_DRAW = 256

#: Tuning takes at least this many integrator steps (three phases of at least ten).
MIN_TUNING_STEPS = 30

#: The energy-error variance per dimension above this many times its tuning target flags the
#: step-size bias in ``diagnose``.
ENERGY_VAR_RATIO = 10


@dataclass(frozen=True)
class MCLMC(ManyChainKernel):
    """MCLMC's settings (see the module docstring), ``fit_mcmc(kernel=MCLMC(...))``.

    ``num_warmup`` counts tuning integrator steps (at least ``MIN_TUNING_STEPS``); each kept
    draw is ``thinning`` integrator steps.

    Attributes:
        tuning: how the step size, L and the preconditioner are tuned (``Tuning``; BlackJAX's
            by default, ``MILE_TUNING`` for MILE's larger energy error).
        thinning: integrator steps per kept draw (>= 1; None: ``ceil(L / step size)`` of the
            slowest tuning group, at most ``MAX_STEPS_PER_DRAW``).
        temperature, compile: ``ManyChainKernel``'s.

    Raises:
        TypeError/ValueError: on construction, naming the setting and what arrived.
    """

    name: ClassVar[str] = "mclmc"
    min_warmup: ClassVar[int] = 0  # tuning takes max(MIN_TUNING_STEPS, num_warmup) steps
    #: unadjusted, a divergence is an energy-error blow-up, not a rejected proposal
    divergence_remedy: ClassVar[str] = (
        "lower Tuning.desired_energy_var (a smaller step) or reparameterise"
    )

    tuning: Tuning = BLACKJAX_TUNING
    thinning: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.tuning, Tuning):
            raise TypeError(f"tuning must be an mclmc.Tuning, got {described(self.tuning)}")
        if self.thinning is not None:
            check_int("thinning", self.thinning, type_error=True)

    def record(self) -> dict[str, Any]:
        out = super().record()  # JSON has lists, not tuples
        out["tuning"] = {
            k: list(v) if isinstance(v, tuple) else v for k, v in out["tuning"].items()
        }
        return out

    def sampler(
        self, density: LogDensity, rng: ChainRNG, *, num_warmup: int, groups, per_start: bool
    ) -> MCLMCSampler:
        return MCLMCSampler(
            density,
            rng,
            groups=groups if per_start else None,
            tuning=self.tuning,
            tune_steps=self.warmup_steps(num_warmup),
            thinning=self.thinning,
        )

    def warmup_steps(self, num_warmup: int) -> int:
        return max(MIN_TUNING_STEPS, num_warmup)

    @classmethod
    def verdict_lines(cls, stats: Any, record: dict, flag: Flag) -> list[str]:
        """The energy-error variance per dimension against ``ENERGY_VAR_RATIO`` times its
        tuning target (the step-size bias grows with it), worst tuning group shown."""
        energy_var = record.get("energy_error_var_per_dim")
        if energy_var is None:
            return []
        by_start = record.get("energy_error_var_per_dim_by_start") or [energy_var]
        worst = max((v for v in by_start if not math.isnan(v)), default=math.nan)
        target = (record.get("adapted_desired_energy_var") or [5e-4])[-1]
        limit = ENERGY_VAR_RATIO * target
        return [
            flag(
                not worst <= limit,
                f"MCLMC is unadjusted: energy-error variance per dimension {energy_var:.2g}"
                + (f" (worst member {worst:.2g})" if len(by_start) > 1 else "")
                + f" (tuned towards {target:g}; flag > {limit:g}: the step-size bias grows "
                "with it)",
            )
        ]


class MCLMCSampler(ManyChainSampler):
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
        tune_steps: integrator steps of ``warmup`` (>= ``MIN_TUNING_STEPS``).
        thinning: integrator steps per ``sample`` (None: see ``MCLMC``).

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
        tune_steps: int = MIN_TUNING_STEPS,
        thinning: int | None = None,
    ) -> None:
        self.density = density
        self.rng = rng
        self.groups = groups
        self.tuning = tuning
        self.tune_steps = tune_steps
        self.thinning = thinning
        self.gradients = 0

    # -- the many-chain sampler interface -------------------------------------------------------

    def init(self, z: torch.Tensor) -> MCLMCState:
        """The state at ``z`` ``(K, D)`` with unit velocities ``u`` ``(K, D)``."""
        state, u = self.start(z)
        return MCLMCState(state.z, state.lp, state.grad, u)

    def warmup(self, state: MCLMCState) -> Generator[None, None, MCLMCState]:
        """Tune in ``tune_steps`` integrator steps, yielding after each."""
        chain, u = yield from self.tuning_steps(state, state.u, self.tune_steps)
        if self.thinning is None:
            slowest = float((self.L / self.step_size).max())
            self.thinning = min(MAX_STEPS_PER_DRAW, max(1, math.ceil(slowest)))
        return MCLMCState(chain.z, chain.lp, chain.grad, u)

    def sample(self, state: MCLMCState) -> tuple[MCLMCState, dict[str, torch.Tensor]]:
        """``thinning`` integrator steps; a step whose energy error is not finite or above
        ``MAX_ENERGY_ERROR`` nats (Stan's and Pyro's threshold for HMC) is divergent:
        unadjusted, MCLMC keeps such a jump. ``energy_error`` is the RMS per step, nats."""
        u, errors = state.u, []
        for _ in range(self.thinning):
            state, u, energy_change = self.step(state, u)
            errors.append(energy_change)
        errors = torch.stack(errors)
        state = MCLMCState(state.z, state.lp, state.grad, u)
        return state, dict(
            diverging=~(errors.abs() <= MAX_ENERGY_ERROR).all(0),
            step_size=self._chains(self.step_size).squeeze(1),
            n_steps=torch.full_like(state.lp, self.thinning),
            energy_error=errors.square().mean(0).sqrt(),
            lp=state.lp,
        )

    def adapted(self) -> dict:
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

    def record(self, stats: dict[str, list[torch.Tensor]], dim: int) -> dict[str, Any]:
        """``unadjusted``, ``thinning`` and the energy-error variance per dimension, overall
        and per tuning group (NaN steps, kept states, left out)."""
        errors = stats["energy_error"]
        groups = self.groups.cpu()
        return dict(
            unadjusted=True,
            thinning=self.thinning,
            energy_error_var_per_dim=_energy_var(errors, dim),
            energy_error_var_per_dim_by_start=[
                _energy_var([e[groups == g] for e in errors], dim) for g in range(self.num_groups)
            ],
        )

    def start(self, z: torch.Tensor) -> tuple[ChainState, torch.Tensor]:
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

    def step(self, state: ChainState, u: torch.Tensor, step_size: torch.Tensor | None = None):
        """One integrator step plus partial refreshment for every chain, each group at its own
        step size (``step_size`` ``(G,)``; None: ``self.step_size``).

        Returns ``(state, u, energy_change (K,))``; a chain whose step is not finite keeps its
        state, and its energy change is NaN.
        """
        eps = self._chains(self.step_size if step_size is None else step_size)
        sigma = self.sigma
        u1, k1 = isokinetic_velocity(u, state.grad * sigma, 0.5 * eps)
        z = state.z + eps * sigma * u1
        lp, grad = self.density(z)
        self.gradients += len(z)
        u2, k2 = isokinetic_velocity(u1, grad * sigma, 0.5 * eps)
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
        """``tune`` as a generator: yields None after each tuning step (for a
        progress bar), and returns ``(state, u)``."""
        tuning = self.tuning
        share1, share2, share3 = tuning.phases
        n1 = max(10, int(share1 * tune_steps))
        n2 = max(10, int(share2 * tune_steps))
        n3 = max(10, int(share3 * tune_steps))
        state, u = self._initial_step_size(state, u)
        adapt = StepSizeAdaptation(self, n1 + n2 + 1)
        for _ in range(n1):
            state, u = adapt.step(state, u)
            yield
        moments = Moments(self)
        for _ in range(n2):
            state, u = adapt.step(state, u, moments)
            yield
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
            yield
        self.L = (
            tuning.L_factor
            * self.step_size
            * steps_per_effective_draw(draws, self.groups, self.num_groups)
        )
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


def isokinetic_velocity(
    u: torch.Tensor, g: torch.Tensor, eps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact ESH velocity update (Robnik et al., JMLR 2023, eq. 11; BlackJAX
    ``esh_dynamics_momentum_update_one_step``) of unit velocities ``u`` ``(K, D)`` (D >= 2)
    under the log density's gradient ``g`` ``(K, D)`` for times ``eps`` ``(K, 1)``.

    Returns:
        ``(u (K, D), kinetic-energy change (K,))``, the latter in nats: ``(D - 1)`` times the
        log-Jacobian of the map on the sphere, which the Metropolis step adds to the potential's
        change.
    """
    d = u.shape[1]
    g_norm = g.norm(dim=1, keepdim=True).clamp_min(1e-30)
    e = g / g_norm
    ue = (u * e).sum(1, keepdim=True)
    delta = eps * g_norm / (d - 1)
    zeta = torch.exp(-delta)
    new = e * (1 - zeta) * (1 + zeta + ue * (1 - zeta)) + 2 * zeta * u
    kinetic = delta - math.log(2) + torch.log(1 + ue + (1 - ue) * zeta**2)
    return new / new.norm(dim=1, keepdim=True), (kinetic * (d - 1)).squeeze(1)


@dataclass
class MCLMCState(ChainState):
    """``ChainState`` with the chains' unit velocities ``u`` ``(K, D)``."""

    u: torch.Tensor


def _energy_var(errors: list[torch.Tensor], dim: int) -> float:
    """Mean square energy error of one integrator step, per dimension, of per-draw ``(K,)``
    RMS errors; NaN steps (kept states) left out."""
    errors = torch.stack(errors).double()
    errors = errors[torch.isfinite(errors)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(errors.square().mean() / dim) if errors.numel() else math.nan


__all__ = [
    "BLACKJAX_TUNING",
    "MCLMC",
    "MILE_TUNING",
    "MCLMCSampler",
    "MCLMCState",
    "Tuning",
    "isokinetic_velocity",
]
