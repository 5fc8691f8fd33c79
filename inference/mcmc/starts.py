"""Running K chains through the draw dim: where they start, and what is kept.

``fit_mcmc(kernel="chees" | "mclmc")`` calls ``run_many_chains``. The K chains come from M
starts (``num_starts``; K % M == 0): chain ``k`` starts at start ``k // (K / M)``, and the chains
that share a start form a *superchain* (Margossian et al. 2024, nested R-hat). Starts:

- ``"prior"``: M draws of the prior;
- ``"map"``: one MAP fit (from a prior draw) shared by every chain (M must be 1);
- ``"ensemble"``: M MAP fits from M prior draws, run as one batched optimisation through the
  draw dim (Adam on the ``(M, D)`` unconstrained states; deep-ensemble starts as in MILE,
  Sommer et al. 2025).

MAP here is the mode of the joint density of the constrained values (no log-Jacobian), the
same objective as ``fit_svi(guide="delta")``, on mini-batches of ``MAP_BATCH_SIZE`` rows shared
by the starts. ``inference.mcmc.many_chain_runner`` runs the kernels from the starts; with
``"ensemble"`` starts each superchain is tuned on its own (its own mode).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pyro
import torch
from pyro import poutine

from probtransformer._progress import progress_bar
from probtransformer.inference._runtime import pyro_scope, reinitialised_copy, seeded
from probtransformer.inference.distributed import DataParallel
from probtransformer.inference.mcmc.adaptation import check_dense_dim
from probtransformer.inference.mcmc.compiled import CompiledPass, attach
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.many_chain_runner import KernelSettings, sample_chains
from probtransformer.inference.mcmc.mclmc import BLACKJAX_TUNING, Tuning
from probtransformer.inference.model_checks import DRAWS_DIM, DRAWS_PLATE
from probtransformer.inference.posterior.prediction import activation_bytes
from probtransformer.inference.vi.schedule import lr_scheduler

#: Starting-point strategies of the many-chain kernels.
INITS = ("prior", "map", "ensemble")

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


def run_many_chains(
    model,
    train,
    *,
    kernel: str,
    num_chains: int,
    num_starts: int,
    init: str,
    num_warmup: int,
    num_samples: int,
    step_size: float,
    trajectory_length: float | None,
    target_accept_prob: float,
    map_steps: int,
    seed: int,
    progress: bool,
    parallel: DataParallel | None = None,
    full_mass: bool = False,
    compile: bool | None = None,
    tuning: Tuning = BLACKJAX_TUNING,
    thinning: int | None = None,
    temperature: float = 1.0,
) -> tuple[dict, dict | None, dict, dict]:
    """Sample ``model`` (eval mode, point estimates fixed) on ``train`` with K chains.

    With ``parallel`` the chains' log densities are sharded over its ranks
    (``VectorizedDensity.sharded``): every rank runs the starts and the sampler on all K
    states, from rank 0's starts and point estimates, and evaluates its share of the chains.
    Every rank returns the same draws, those of one process.

    ``compile`` (True, False, or None: where it repays, ``inference.mcmc.compiled.attach``) runs the
    MAP starts and the sampler on the compiled density (``inference.mcmc.compiled.CompiledPass``);
    ``record["density_path"]`` says which path ran, ``record["compile_seconds"]`` its cost.

    With ``"map"``/``"ensemble"`` starts the model's plain parameters are fitted per start
    (start ``m`` from the model re-initialised with ``seed + m``) and each chain keeps its
    start's values while sampling.

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
    density = VectorizedDensity(model, train.x, train.y, train.mask, temperature=temperature)
    if full_mass:  # before any MAP fit
        check_dense_dim(density.dim)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    per_start = bool(names) and init in ("map", "ensemble")
    check_memory(density, num_chains, num_samples, per_start)
    device = train.x.device
    compiled = CompiledPass(density, progress=progress)
    with seeded(seed, device):
        probe = prior_states(density, max(2, num_starts))
        density.check(probe[:2])  # K-chain values must equal single-chain ones, by site
        starts = probe[:num_starts]
        if per_start:
            density.parameters = _initial_parameters(model, names, num_starts, seed, device)
            density.check(starts)  # ... and with a plain-parameter value per start
        if init in ("map", "ensemble"):
            local = any(site.local for site in density.sites)
            rows = torch.arange(min(MAP_BATCH_SIZE, density.num_rows), device=device)
            rows = None if local or len(rows) == density.num_rows else rows
            attach(
                compiled,
                compile,
                map_steps,
                lambda: density.log_density(starts, rows=rows, jacobian=False),
            )
            starts, _ = map_fit(density, starts, map_steps, progress=progress)
    per_chain = num_chains // num_starts
    if per_start:  # each chain keeps its start's fitted values
        density.parameters = {
            name: value.detach().repeat_interleave(per_chain, dim=0)
            for name, value in density.parameters.items()
        }
    z0 = starts.repeat_interleave(per_chain, dim=0)
    superchain = [k // per_chain for k in range(num_chains)]
    settings = KernelSettings(
        kernel=kernel,
        num_warmup=num_warmup,
        num_samples=num_samples,
        step_size=step_size,
        trajectory_length=trajectory_length,
        target_accept_prob=target_accept_prob,
        full_mass=full_mass,
        tuning=tuning,
        thinning=thinning,
        # MCLMC tunes each member's chains apart; ChEES needs 2+ chains per member to centre
        per_start=init == "ensemble" and num_starts > 1 and (kernel == "mclmc" or per_chain > 1),
    )
    samples, stats, record = sample_chains(
        density, z0, superchain, settings, seed=seed, progress=progress, compiled=compiled,
        compile=compile, parallel=parallel, start_time=start_time,
    )  # fmt: skip
    record.update(num_starts=num_starts, init=init)
    members = None
    record["point_estimates"] = None
    if per_start:
        chains, draws = next(iter(samples.values())).shape[:2]
        members = {
            name: value[:, 0, None].expand(chains, draws, *value.shape[2:]).cpu()
            for name, value in density.parameters.items()
        }
        record["point_estimates"] = dict(
            method="map, per start", parameters=names, num_steps=map_steps, per_chain=True
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
    "INITS",
    "MAX_DRAW_BYTES",
    "check_memory",
    "draw_bytes",
    "map_fit",
    "prior_states",
    "run_many_chains",
]
