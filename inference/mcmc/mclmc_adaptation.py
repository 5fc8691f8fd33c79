"""How MCLMC tunes (``inference.mcmc.mclmc``), apart from its dynamics as BlackJAX keeps
``mclmc_find_L_and_step_size`` apart from the kernel: the settings (``Tuning``, BlackJAX's and
MILE's presets), the running step-size estimate from the energy error (BlackJAX's, with MILE's
NaN back-off), the positions' moments for the preconditioner and L, and L from the ESS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from probtransformer.validation import check_flag, check_int, check_positive, described

#: The most coordinates whose ESS sets L (BlackJAX's ``fft_params_limit``): evenly spaced ones
#: of a larger state.
ESS_COORDINATES = 2000

#: The step size grows at most this factor per tuning step. BlackJAX's running estimate has no
#: such cap; from a mode (an ensemble member) the first steps' energy errors are near zero and
#: the estimate jumps twentyfold, throwing the chain far from the mode before it shrinks again.
MAX_GROWTH = 2.0

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
        energy, phases = self.desired_energy_var, self.phases
        if not (_numbers(energy, 2) and all(0 < v < math.inf for v in energy)):
            raise ValueError(
                f"desired_energy_var must be (start, end), each a finite number > 0, got "
                f"{described(energy)}"
            )
        if not (_numbers(phases, 3) and min(phases) >= 0 and 0 < sum(phases) <= 1):
            raise ValueError(
                f"phases must be three shares >= 0 of the tuning steps summing to at most 1, got "
                f"{described(phases)}"
            )
        check_flag("diagonal_preconditioning", self.diagonal_preconditioning)
        check_positive("trust_in_estimate", self.trust_in_estimate)
        check_positive("L_factor", self.L_factor)
        check_int("num_effective_samples", self.num_effective_samples, type_error=True)


def _numbers(values: object, n: int) -> bool:
    """``values`` is a tuple or list of ``n`` real numbers (not bools)."""
    return (
        isinstance(values, tuple | list)
        and len(values) == n
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    )


#: BlackJAX's tuning, the default: a small energy error (little bias), a diagonal preconditioner.
BLACKJAX_TUNING = Tuning()

#: MILE's tuning (its public configs: energy variance 0.5 -> 0.1, phases 0.8 / 0.1 / 0.1, no
#: preconditioner).
MILE_TUNING = Tuning(desired_energy_var=(0.5, 0.1), phases=(0.8, 0.1, 0.1),
                     diagonal_preconditioning=False, num_effective_samples=100)  # fmt: skip


def steps_per_effective_draw(
    draws: list[torch.Tensor], groups: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """``(G,)`` mean over (up to ``ESS_COORDINATES``) coordinates of draws per bulk ESS,
    each group's chains pooled (arviz-stats)."""
    from arviz_stats.base import array_stats

    x = torch.stack(draws, 1)  # (K, n, D)
    columns = torch.linspace(0, x.shape[-1] - 1, min(x.shape[-1], ESS_COORDINATES)).long()
    x = x[..., columns.to(x.device)].detach().double().cpu().numpy()
    groups = groups.cpu().numpy()
    out = []
    for g in range(num_groups):
        values = x[groups == g]  # (chains, n, coordinates)
        ess = array_stats.ess(np.moveaxis(values, -1, 0), chain_axis=-2, draw_axis=-1)
        ess = ess[np.isfinite(ess) & (ess > 0)]
        draws_total = values.shape[0] * values.shape[1]
        out.append(float(np.mean(draws_total / ess)) if ess.size else float(draws_total))
    return torch.tensor(out, dtype=torch.float64)


class StepSizeAdaptation:
    """BlackJAX's running estimate of each group's step size from ``Var[E] ∝ ε^6``, with a
    target that decays linearly over ``total`` steps and MILE's NaN back-off."""

    def __init__(self, sampler, total: int) -> None:
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

    def step(self, state, u, moments: Moments | None = None):
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
                "kernel=ChEES()"
            )
        if moments is not None:
            moments.add(new.z, (~bad).double() * s._chains(eps).squeeze(1).double())
        return new, u_new


class Moments:
    """Each group's step-size-weighted mean and mean square of the positions (phase 2)."""

    def __init__(self, sampler) -> None:
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


__all__ = [
    "BLACKJAX_TUNING",
    "MILE_TUNING",
    "Moments",
    "StepSizeAdaptation",
    "Tuning",
    "steps_per_effective_draw",
]
