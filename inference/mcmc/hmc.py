"""The settings of Pyro's kernels, ``fit_mcmc(kernel=NUTS(...))`` and ``HMC(...)``, run by
``mcmc.pyro_runner`` (chains as processes or one after another).

- ``NUTS``: the No-U-Turn sampler (Hoffman & Gelman, JMLR 2014) with multinomial sampling;
- ``HMC``: Hamiltonian Monte Carlo (Neal 2011) with a fixed integration time per transition.

Both adapt the step size by dual averaging towards ``target_accept_prob`` and a diagonal (or,
with ``full_mass``, dense) mass matrix in Stan's windows during warm-up (Pyro's
``pyro.infer.mcmc.NUTS``/``HMC``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from pyro.infer.autoguide.initialization import init_to_uniform

from probtransformer.inference.mcmc.kernel import (
    Flag,
    PyroKernel,
)
from probtransformer.inference.mcmc.pyro_runner import RecordingHMC, RecordingNUTS
from probtransformer.validation import check_flag, check_int, check_positive, check_probability


@dataclass(frozen=True)
class _PyroHMC(PyroKernel):
    """What NUTS and HMC share (see ``NUTS``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("target_accept_prob", self.target_accept_prob)
        check_positive("step_size", self.step_size)
        check_flag("full_mass", self.full_mass)

    def _common(self) -> dict[str, Any]:
        """Pyro's settings that NUTS and HMC share: windowed adaptation from uniform starts."""
        return dict(
            step_size=self.step_size,
            adapt_step_size=True,
            adapt_mass_matrix=True,
            full_mass=self.full_mass,
            target_accept_prob=self.target_accept_prob,
            jit_compile=self.jit_compile,
            ignore_jit_warnings=True,
            init_strategy=init_to_uniform,
        )


@dataclass(frozen=True)
class NUTS(_PyroHMC):
    """NUTS's settings (Hoffman & Gelman 2014; Pyro's ``NUTS``).

    Attributes:
        target_accept_prob: the step-size adaptation's target acceptance in (0, 1).
        max_tree_depth: doublings per transition at most (>= 1; Stan's and Pyro's 10): at most
            ``2**max_tree_depth - 1`` leapfrog steps, one gradient each.
        step_size: the initial step size (> 0), adapted during warm-up.
        full_mass: adapt a dense mass matrix instead of a diagonal one.
        jit_compile: trace the potential energy with the PyTorch JIT (keyword-only).

    Raises:
        TypeError/ValueError: on construction, naming the setting and what arrived.
    """

    name: ClassVar[str] = "nuts"

    target_accept_prob: float = 0.8
    max_tree_depth: int = 10
    step_size: float = 1.0
    full_mass: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("max_tree_depth", self.max_tree_depth, type_error=True)

    def pyro_kernel(self, model) -> RecordingNUTS:
        return RecordingNUTS(model, max_tree_depth=self.max_tree_depth, **self._common())

    @classmethod
    def verdict_lines(cls, stats: Any, record: dict, flag: Flag) -> list[str]:
        """Transitions that reached ``max_tree_depth`` (their trajectories were cut short)."""
        if "tree_depth" not in stats:
            return []
        limit = record.get("max_tree_depth")
        saturated = int((stats["tree_depth"] >= limit).sum())
        return [
            flag(
                saturated > 0,
                f"transitions at max_tree_depth={limit}: {saturated}"
                + ("; trajectories were cut short: raise max_tree_depth" if saturated else ""),
            )
        ]


@dataclass(frozen=True)
class HMC(_PyroHMC):
    """HMC's settings (Neal 2011; Pyro's ``HMC``).

    Attributes:
        target_accept_prob: the step-size adaptation's target acceptance in (0, 1).
        trajectory_length: integration time per transition (> 0); the leapfrog steps are
            ``trajectory_length / step_size`` and change as the step size adapts.
        step_size: the initial step size (> 0), adapted during warm-up.
        full_mass: adapt a dense mass matrix instead of a diagonal one.
        jit_compile: trace the potential energy with the PyTorch JIT (keyword-only).

    Raises:
        TypeError/ValueError: on construction, naming the setting and what arrived.
    """

    name: ClassVar[str] = "hmc"

    target_accept_prob: float = 0.8
    trajectory_length: float = 2 * math.pi
    step_size: float = 1.0
    full_mass: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("trajectory_length", self.trajectory_length)

    def pyro_kernel(self, model) -> RecordingHMC:
        return RecordingHMC(model, trajectory_length=self.trajectory_length, **self._common())


__all__ = ["HMC", "NUTS"]
