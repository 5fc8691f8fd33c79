"""The kernel interface of ``fit_mcmc``: a kernel is a frozen settings object, and the many-chain
kernels hand the runner a sampler that advances K chains together.

Two families, chosen by the settings object's type (as NumPyro's one ``MCMC`` driver takes a
kernel object, and BlackJAX keeps one module per kernel with its adaptation apart):

- ``PyroKernel`` (``NUTS``, ``HMC``): Pyro's kernels, chains as processes or one after another
  (``mcmc.pyro_runner``);
- ``ManyChainKernel`` (``ChEES``, ``MCLMC``, ``AdjustedMCLMC``): K chains through the model's
  draw dim, every step one vectorized gradient of K chains (``mcmc.many_chain_runner``). The
  settings object builds a ``ManyChainSampler`` for one run; the runner knows no kernel by name.

Adding a many-chain kernel means one file: a ``ManyChainKernel`` subclass (its settings,
validated in ``__post_init__``; its ``name``, the CLI spelling and ``record["kernel"]``; its
verdict lines) and the ``ManyChainSampler`` it builds, registered in ``mcmc.registry``.

Shared here: every chain's random stream (``ChainRNG``), the chains' state (``ChainState``),
the Halton jitter and the divergence threshold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from probtransformer.validation import check_flag, check_positive

#: An energy error above this many nats is a divergent transition (Stan, Pyro).
MAX_ENERGY_ERROR = 1000.0

#: A chain whose mean acceptance probability over the kept draws is below this is stuck
#: (``diagnose``).
STUCK_ACCEPTANCE = 0.05

#: ``z (K, D) -> (log density (K,), gradient (K, D))``: the K-chain density a sampler moves on.
LogDensity = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

#: ``flag(bad, text) -> line``: how ``diagnose`` marks a verdict line (WARN or ok).
Flag = Callable[[bool, str], str]


def stuck_chains_line(per_chain: np.ndarray, flag: Flag) -> str:
    """The verdict line of a Metropolis-adjusted kernel's stuck chains: those whose mean
    acceptance ``per_chain`` ``(K,)`` is below ``STUCK_ACCEPTANCE``."""
    stuck = [int(c) for c in np.flatnonzero(per_chain < STUCK_ACCEPTANCE)]
    return flag(
        bool(stuck),
        f"stuck chains (mean acceptance < {STUCK_ACCEPTANCE}): {len(stuck)} of {len(per_chain)}"
        + (f" (chains {stuck[:10]}): start them elsewhere (init=)" if stuck else ""),
    )


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
class ChainState:
    """Positions ``z`` ``(K, D)`` in the unconstrained space, their log densities ``lp`` ``(K,)``
    and gradients ``grad`` ``(K, D)``."""

    z: torch.Tensor
    lp: torch.Tensor
    grad: torch.Tensor


@dataclass(frozen=True)
class Kernel(ABC):
    """Base of every kernel's settings: frozen, validated on construction (``__post_init__``
    raises ``TypeError``/``ValueError`` naming the setting), naming only what it reads.

    Attributes:
        name: ClassVar, the CLI spelling and ``record["kernel"]`` (``"nuts"``, ``"chees"`` ...).
        min_warmup: ClassVar, warm-up lengths ``0 < num_warmup <`` this get a warning (too few
            adaptation windows to settle; 0: never).
        divergence_remedy: ClassVar, what ``diagnose`` suggests after divergent transitions.
    """

    name: ClassVar[str]
    min_warmup: ClassVar[int] = 50
    divergence_remedy: ClassVar[str] = "raise target_accept_prob or reparameterise"

    def record(self) -> dict[str, Any]:
        """The settings as the run records them (JSON-safe)."""
        return dict(kernel=self.name, **asdict(self))

    @classmethod
    def verdict_lines(cls, stats: Any, record: dict, flag: Flag) -> list[str]:
        """This kernel's own verdict lines from its ``sample_stats`` (an xarray Dataset with
        ``(chain, draw)`` variables) and the run's ``record``; none by default."""
        return []


@dataclass(frozen=True)
class PyroKernel(Kernel):
    """A kernel that Pyro runs (chains as processes; ``mcmc.pyro_runner``).

    Attributes:
        jit_compile: trace the potential energy with the PyTorch JIT.
    """

    jit_compile: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        check_flag("jit_compile", self.jit_compile)

    @abstractmethod
    def pyro_kernel(self, model: Callable) -> Any:
        """Pyro's kernel (a ``pyro.infer.mcmc.MCMCKernel`` that records per-draw statistics)
        on ``model``, with these settings."""


@dataclass(frozen=True)
class ManyChainKernel(Kernel):
    """A kernel that runs K chains together through the model's draw dim.

    Attributes:
        temperature: ``T > 0``; the likelihood enters as ``p(y | θ)^(1 / T)`` (1: the Bayesian
            posterior).
        compile: evaluate the K-chain log density as one ``torch.compile``d graph (True,
            False, or None: where it repays; ``mcmc.compiled``).

    Both are keyword-only (after a subclass's own settings).
    """

    temperature: float = field(default=1.0, kw_only=True)
    compile: bool | None = field(default=None, kw_only=True)

    #: Chains every start needs when each start's chains are tuned apart (``per_start``).
    min_chains_per_start: ClassVar[int] = 1

    def __post_init__(self) -> None:
        check_positive("temperature", self.temperature)
        check_flag("compile", self.compile, none=True)

    @abstractmethod
    def sampler(
        self,
        density: LogDensity,
        rng: ChainRNG,
        *,
        num_warmup: int,
        groups: torch.Tensor,
        per_start: bool,
    ) -> ManyChainSampler:
        """A sampler for one run: ``groups`` ``(K,)`` long is each chain's start (0 .. M - 1;
        the chains of one start form a group, Margossian et al. 2024's superchain);
        ``per_start`` tunes every group apart (its own step size ...), else all chains share
        one tuning (a kernel may still centre moments within groups)."""

    def warmup_steps(self, num_warmup: int) -> int:
        """Gradient-bearing warm-up steps the sampler takes for ``num_warmup`` (progress and
        the compile rule count them)."""
        return num_warmup


class ManyChainSampler(ABC):
    """One run of a many-chain kernel over K chains (built by ``ManyChainKernel.sampler``).

    The runner calls ``init`` once, drives ``warmup`` (a generator that yields once per
    warm-up step and returns the warmed-up state), then calls ``sample`` once per kept draw.

    Attributes:
        gradients: chain-gradients evaluated so far (steps times chains).
        step_size: ``(G,)`` the current step size per tuning group (the progress bar shows it).
    """

    gradients: int = 0
    step_size: torch.Tensor

    @abstractmethod
    def init(self, z: torch.Tensor) -> ChainState:
        """The state at ``z`` ``(K, D)``."""

    @abstractmethod
    def warmup(self, state: ChainState) -> Generator[None, None, ChainState]:
        """Adapt; yield after each warm-up step; return the state to sample from."""

    @abstractmethod
    def sample(self, state: ChainState) -> tuple[ChainState, dict[str, torch.Tensor]]:
        """One kept draw of every chain: the new state (its ``z`` is the draw) and per-chain
        ``(K,)`` statistics under ArviZ's names (``diverging``, ``step_size``, ``n_steps``,
        ``lp``, and ``acceptance_rate``/``energy`` where the kernel has them)."""

    @abstractmethod
    def adapted(self) -> dict[str, Any]:
        """The adapted settings (floats, or lists per tuning group), recorded as
        ``adapted_<name>``."""

    def record(self, stats: dict[str, list[torch.Tensor]], dim: int) -> dict[str, Any]:
        """Extra record entries from the kept draws' statistics (per-draw ``(K,)`` tensors);
        none by default."""
        return {}


__all__ = [
    "MAX_ENERGY_ERROR",
    "STUCK_ACCEPTANCE",
    "ChainRNG",
    "ChainState",
    "Flag",
    "Kernel",
    "LogDensity",
    "ManyChainKernel",
    "ManyChainSampler",
    "PyroKernel",
    "halton",
    "stuck_chains_line",
]
