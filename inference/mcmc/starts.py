"""Where the K chains of a many-chain kernel start, and running them through the draw dim.

``fit_mcmc(kernel=ChEES() | MCLMC() ..., starts=...)`` calls ``run_many_chains``. The K chains
come from M starts (K % M == 0): chain ``k`` starts at start ``k // (K / M)``, and the chains
that share a start form a *superchain* (Margossian et al. 2024, nested R-hat). The start
strategies are settings objects:

- ``PriorStarts(num_starts)``: M draws of the prior;
- ``MAPStarts()``: one MAP fit (from a prior draw) shared by every chain;
- ``EnsembleStarts(num_starts)``: M MAP fits from M prior draws, run as one batched
  optimisation through the draw dim (Adam on the ``(M, D)`` unconstrained states; deep-ensemble
  starts as in MILE, Sommer et al. 2025), or the members of a fitted ``fit_ensemble``
  posterior (``EnsembleStarts(ensemble=...)``); each member's chains are tuned on their own.

MAP here is the mode of the joint density of the constrained values (no log-Jacobian), the
same objective as ``fit_svi(guide="delta")``, on mini-batches of ``MAP_BATCH_SIZE`` rows shared
by the starts; ``fit_ensemble(batched=True)`` runs the same ``map_fit``.
"""

from __future__ import annotations

import math
import time
from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import pyro
import torch
from pyro import poutine

from probtransformer._progress import progress_bar
from probtransformer.inference._runtime import pyro_scope, reinitialised_copy, seeded
from probtransformer.inference.distributed import DataParallel
from probtransformer.inference.mcmc.adaptation import check_dense_dim
from probtransformer.inference.mcmc.compiled import CompiledPass, attach
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.kernel import ManyChainKernel
from probtransformer.inference.mcmc.many_chain_runner import sample_chains
from probtransformer.inference.model_checks import DRAWS_DIM, DRAWS_PLATE
from probtransformer.inference.posterior.prediction import activation_bytes
from probtransformer.inference.vi.schedule import lr_scheduler
from probtransformer.validation import check_int, described

if TYPE_CHECKING:
    from probtransformer.inference.posterior.posterior import Posterior

#: Rows per step of the batched MAP fits of ``init="map"``/``"ensemble"``.
MAP_BATCH_SIZE = 128

#: Adam's learning rate of those fits, decaying exponentially to ``MAP_LR * MAP_LR_DECAY`` at
#: the last step (the quality benchmark's ensemble settings: 1e-2 to 1e-3).
MAP_LR, MAP_LR_DECAY = 1e-2, 0.1

#: Bytes the kept draws and the samplers' working state may take together (float32; 2 GiB).
MAX_DRAW_BYTES = 2**31

#: ``(K, D)`` copies the samplers hold at once: position, gradient, momentum, the proposal's
#: position and gradient, velocity, the mass matrix's running sums (float64: two each).
WORKING_COPIES = 10


def draw_bytes(num_chains: int, num_samples: int, dim: int) -> int:
    """Bytes of ``num_chains * num_samples`` kept draws of ``dim`` float32 scalars."""
    return 4 * num_chains * num_samples * dim


@dataclass(frozen=True)
class Starts(ABC):
    """Base of the start strategies of the many-chain kernels (frozen, validated on
    construction).

    Attributes:
        name: ClassVar, the CLI spelling (``--init``) and ``record["init"]``.
        fits_map: ClassVar, the starts are MAP fits (they need ``map_steps > 0`` and fit the
            model's plain parameters per start).
        tune_apart: ClassVar, each start's chains are tuned on their own (they sit in modes of
            their own).
    """

    name: ClassVar[str]
    fits_map: ClassVar[bool] = False
    tune_apart: ClassVar[bool] = False

    def count(self, num_chains: int) -> int:
        """M, the number of starts for ``num_chains`` chains (one per chain by default).

        Raises:
            ValueError: ``num_chains`` not a multiple of M.
        """
        num_starts = getattr(self, "num_starts", None) or num_chains
        if num_chains % num_starts:
            raise ValueError(
                f"num_chains must be a multiple of num_starts (each start runs the same number "
                f"of chains), got num_chains={num_chains} and num_starts={num_starts}"
            )
        return num_starts

    def record(self, num_chains: int) -> dict[str, Any]:
        """``init`` and ``num_starts`` as the run records them."""
        return dict(init=self.name, num_starts=self.count(num_chains))


@dataclass(frozen=True)
class PriorStarts(Starts):
    """M draws of the prior, ``num_starts`` of them (None: one per chain)."""

    name: ClassVar[str] = "prior"
    num_starts: int | None = None

    def __post_init__(self) -> None:
        if self.num_starts is not None:
            check_int("num_starts", self.num_starts, type_error=True)


@dataclass(frozen=True)
class MAPStarts(Starts):
    """One MAP fit, from a prior draw, that every chain starts from."""

    name: ClassVar[str] = "map"
    fits_map: ClassVar[bool] = True

    def count(self, num_chains: int) -> int:
        return 1


@dataclass(frozen=True)
class EnsembleStarts(Starts):
    """A deep ensemble's members: ``num_starts`` MAP fits (None: one per chain) run as one
    batched optimisation, or the members of ``ensemble``, a fitted ``fit_ensemble`` posterior of
    the same model (no fits run; the chains continue on its device). Each member's chains are
    tuned on their own where the kernel can (MILE, Sommer et al. 2025).

    Raises:
        TypeError/ValueError: a bad ``num_starts``; an ``ensemble`` that is not a
            ``fit_ensemble`` posterior, or given with ``num_starts`` other than its members.
    """

    name: ClassVar[str] = "ensemble"
    fits_map: ClassVar[bool] = True
    tune_apart: ClassVar[bool] = True
    num_starts: int | None = None
    ensemble: Posterior | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_starts is not None:
            check_int("num_starts", self.num_starts, type_error=True)
        if self.ensemble is None:
            return
        method = getattr(self.ensemble, "record", {}).get("method")
        if method != "ensemble":
            raise ValueError(
                "ensemble must be a fit_ensemble posterior (record['method'] == 'ensemble'), "
                f"got {described(self.ensemble) if method is None else method!r}"
            )
        members = next(iter(self.ensemble.samples.values())).shape[1]
        if self.num_starts not in (None, members):
            raise ValueError(
                f"num_starts={self.num_starts} but the ensemble has {members} members: leave "
                "num_starts out"
            )
        object.__setattr__(self, "num_starts", members)

    def record(self, num_chains: int) -> dict[str, Any]:
        out = super().record(num_chains)
        if self.ensemble is not None:
            record = self.ensemble.record
            out["ensemble"] = {k: v for k, v in record.items() if k != "members"}
            out["ensemble_seconds"] = record["seconds"]
        return out


def run_many_chains(
    model,
    train,
    *,
    kernel: ManyChainKernel,
    starts: Starts,
    num_chains: int,
    num_warmup: int,
    num_samples: int,
    map_steps: int,
    seed: int,
    progress: bool,
    parallel: DataParallel | None = None,
) -> tuple[dict, dict | None, dict, dict]:
    """Sample ``model`` (eval mode, point estimates fixed) on ``train`` with K chains.

    With ``parallel`` the chains' log densities are sharded over its ranks
    (``VectorizedDensity.sharded``): every rank runs the starts and the sampler on all K
    states, from rank 0's starts and point estimates, and evaluates its share of the chains.
    Every rank returns the same draws, those of one process.

    ``kernel.compile`` (True, False, or None: where it repays, ``compiled.attach``) runs the
    MAP starts and the sampler on the compiled density (``inference.mcmc.compiled``);
    ``record["density_path"]`` says which path ran, ``record["compile_seconds"]`` its cost.

    With MAP or ensemble starts the model's plain parameters are fitted per start (start ``m``
    from the model re-initialised with ``seed + m``; a given ensemble's members' values) and
    each chain keeps its start's values while sampling.

    Returns:
        ``(samples {site: (chain, draw, *shape)}, members {name: (chain, draw, *shape)} of the
        per-chain plain parameters or None, sample_stats {stat: [[...] per draw] per chain},
        record)``; ``record["partial"]`` is True after a Ctrl-C, ``record["point_estimates"]``
        describes the per-start fit of the plain parameters (None without one).

    Raises:
        ValueError: the kept draws would exceed ``MAX_DRAW_BYTES`` (gives the estimate); the
            model does not vectorize over chains (names the site); a non-finite initial log
            density (names the chain and the site).
        KeyboardInterrupt: Ctrl-C before the first kept draw.
    """
    start_time = time.perf_counter()
    num_starts = starts.count(num_chains)
    density = VectorizedDensity(model, train.x, train.y, train.mask, temperature=kernel.temperature)
    if getattr(kernel, "full_mass", False):  # before any MAP fit
        check_dense_dim(density.dim)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    per_start = bool(names) and starts.fits_map
    check_memory(density, num_chains, num_samples, per_start)
    device = train.x.device
    compiled = CompiledPass(density, progress=progress)
    fitted = getattr(starts, "ensemble", None)
    with seeded(seed, device):
        probe = prior_states(density, max(2, num_starts))
        density.check(probe[:2])  # K-chain values must equal single-chain ones, by site
        z = probe[:num_starts]
        if fitted is not None:  # the members' values: no fits
            z = density.unconstrain(
                {s.name: fitted.samples[s.name][0].to(device) for s in density.sites}
            )
            density.parameters = {
                name: (fitted.members or {})[name][0].to(device)[:, None] for name in names
            }
            density.check(z)
        elif per_start:
            density.parameters = _initial_parameters(model, names, num_starts, seed, device)
            density.check(z)  # ... and with a plain-parameter value per start
        if starts.fits_map and fitted is None:
            local = any(site.local for site in density.sites)
            rows = torch.arange(min(MAP_BATCH_SIZE, density.num_rows), device=device)
            rows = None if local or len(rows) == density.num_rows else rows
            attach(
                compiled,
                kernel.compile,
                map_steps,
                lambda: density.log_density(z, rows=rows, jacobian=False),
            )
            z, _ = map_fit(density, z, map_steps, progress=progress)
    per_chain = num_chains // num_starts
    if per_start:  # each chain keeps its start's fitted values
        density.parameters = {
            name: value.detach().repeat_interleave(per_chain, dim=0)
            for name, value in density.parameters.items()
        }
    z0 = z.repeat_interleave(per_chain, dim=0)
    superchain = [k // per_chain for k in range(num_chains)]
    tune_apart = starts.tune_apart and num_starts > 1 and per_chain >= kernel.min_chains_per_start
    samples, stats, record = sample_chains(
        density, z0, superchain, kernel, num_warmup=num_warmup, num_samples=num_samples,
        per_start=tune_apart, seed=seed, progress=progress, compiled=compiled,
        parallel=parallel, start_time=start_time,
    )  # fmt: skip
    record.update(starts.record(num_chains))
    members = None
    record["point_estimates"] = None
    if per_start:
        chains, draws = next(iter(samples.values())).shape[:2]
        members = {
            name: value[:, 0, None].expand(chains, draws, *value.shape[2:]).cpu()
            for name, value in density.parameters.items()
        }
        record["point_estimates"] = (
            dict(method="map, per start", parameters=names, num_steps=map_steps, per_chain=True)
            if fitted is None
            else dict(method="ensemble member, per chain", parameters=names, per_chain=True)
        )
    return samples, members, stats, record


def check_memory(
    density: VectorizedDensity, num_chains: int, num_samples: int, per_chain_parameters: bool
) -> None:
    """Refuse a run whose kept draws and sampler state would pass ``MAX_DRAW_BYTES``.

    Raises:
        ValueError: with the estimate and the limit.
    """
    model = density.model
    plain = 0
    if per_chain_parameters:  # kept with every draw of their chains (posterior.members)
        plain = sum(p.numel() for p in model.parameters() if p.requires_grad)
    kept = draw_bytes(num_chains, num_samples, density.dim + plain)
    working = draw_bytes(num_chains, WORKING_COPIES, density.dim + plain)
    working += 3 * activation_bytes(model, density.x[:1]) * num_chains  # one row, fwd + bwd
    if kept + working > MAX_DRAW_BYTES:
        raise ValueError(
            f"{num_chains} chains x {num_samples} draws x {density.dim + plain} scalars "
            f"({density.dim} latent, {plain} per-chain point estimates) would keep "
            f"{kept / 2**30:.1f} GiB of draws and hold {working / 2**30:.1f} GiB of sampler "
            f"state (limit {MAX_DRAW_BYTES / 2**30:.2g} GiB): use fewer chains or draws"
        )


def prior_states(density: VectorizedDensity, num: int) -> torch.Tensor:
    """``(num, D)`` unconstrained prior draws of every latent (local ones on the training
    rows), from one vectorized trace of the model under the torch RNG."""
    model = density.model
    with pyro_scope(), torch.no_grad(), poutine.block():
        with pyro.plate(DRAWS_PLATE, num, dim=DRAWS_DIM):
            trace = poutine.trace(model).get_trace(density.x, density.y, density.mask)
    values = {s.name: trace.nodes[s.name]["value"].reshape(num, *s.shape) for s in density.sites}
    return density.unconstrain(values)


def _initial_parameters(model, names: list[str], num_starts: int, seed: int, device) -> dict:
    """``{name: (M, 1, *shape)}`` plain parameters, start ``m``'s from the model re-initialised
    with ``seed + m`` (leaf tensors that require grad)."""
    states = [
        dict(reinitialised_copy(model, seed + m, device).named_parameters())
        for m in range(num_starts)
    ]
    return {
        name: torch.stack([state[name].detach() for state in states])[:, None].requires_grad_(True)
        for name in names
    }


def map_fit(
    density: VectorizedDensity,
    starts: torch.Tensor,
    steps: int,
    *,
    progress: bool,
    lr: float = MAP_LR,
    lr_decay: float = MAP_LR_DECAY,
    lr_warmup: float = 0.0,
    lr_schedule: str = "exponential",
    batch_size: int = MAP_BATCH_SIZE,
    check: Callable[[torch.Tensor, list[torch.Tensor], int], None] | None = None,
    desc: str = "MAP starts",
) -> tuple[torch.Tensor, torch.Tensor]:
    """MAP fits of every start at once: Adam (``lr`` on ``fit_svi``'s schedule: warm-up, then
    decaying to ``lr * lr_decay``) on the ``(M, D)`` states, and on ``density.parameters`` when
    it holds per-start plain parameters (updated in place), mini-batches of ``batch_size`` rows
    (every row when the model has local latents).

    Each start's gradient depends only on its own values (the starts are the draw dim), and
    Adam is elementwise, so the M fits equal M separate ones on the same mini-batches. A start
    whose objective is not finite gets a zero gradient for that step, unless ``check(lp (M,),
    leaves, step)``, called after each backward pass, raises instead (``fit_ensemble``).

    Returns:
        ``(z (M, D), lp (M,))``: the fitted states and the last step's log joint densities.
    """
    z = starts.clone().requires_grad_(True)
    leaves = [z, *(density.parameters or {}).values()]
    optimizer = torch.optim.Adam(leaves, lr=lr)
    scheduler = lr_scheduler(optimizer, steps, lr_decay, lr_warmup, lr_schedule)
    n = density.num_rows
    local = any(s.local for s in density.sites)
    size = n if local else min(n, batch_size)
    order = torch.randperm(n, device=z.device)
    position = 0
    lp = torch.full((len(z),), math.nan, device=z.device)
    for step in progress_bar(range(steps), progress=progress, desc=desc, leave=False):
        if position + size > n:
            order, position = torch.randperm(n, device=z.device), 0
        rows = None if size == n else order[position : position + size]
        position += size
        optimizer.zero_grad()
        lp = density.log_joint(z, rows, jacobian=False)
        (-lp.nan_to_num(0.0, 0.0, 0.0).sum()).backward()
        if check is not None:
            check(lp, leaves, step)
        for leaf in leaves:
            leaf.grad.nan_to_num_(0.0, 0.0, 0.0)
        optimizer.step()
        scheduler.step()
    return z.detach(), lp.detach()


__all__ = [
    "MAX_DRAW_BYTES",
    "EnsembleStarts",
    "MAPStarts",
    "PriorStarts",
    "Starts",
    "check_memory",
    "draw_bytes",
    "map_fit",
    "prior_states",
    "run_many_chains",
]
