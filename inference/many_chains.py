"""Running K chains through the draw dim: starts, the sampling loop, and what is kept.

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
by the starts.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable

import pyro
import torch
from pyro import poutine
from tqdm.auto import tqdm

from probtransformer.inference._runtime import pyro_scope, reinitialised_copy, seeded
from probtransformer.inference.compiled import CompiledPass, attach
from probtransformer.inference.distributed import DataParallel, broadcast_state
from probtransformer.inference.engine import activation_bytes
from probtransformer.inference.mclmc import MCLMC
from probtransformer.inference.model_checks import DRAWS_DIM, DRAWS_PLATE
from probtransformer.inference.samplers import ChainRNG, ChEES, check_dense_dim
from probtransformer.inference.schedule import lr_scheduler
from probtransformer.inference.vectorized import VectorizedDensity

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

#: Gradients per ChEES transition or kept MCLMC draw, as the compile rule counts them (ChEES's
#: initial trajectory is 10 leapfrog steps).
GRADIENTS_PER_TRANSITION = 10

#: Most integrator steps per kept MCLMC draw.
MAX_MCLMC_STEPS_PER_DRAW = 256


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
) -> tuple[dict, dict | None, dict, dict]:
    """Sample ``model`` (eval mode, point estimates fixed) on ``train`` with K chains.

    With ``parallel`` the chains' log densities are sharded over its ranks
    (``VectorizedDensity.sharded``): every rank runs the starts and the sampler on all K
    states, from rank 0's starts and point estimates, and evaluates its share of the chains.
    Every rank returns the same draws, those of one process.

    ``compile`` (True, False, or None: where it repays, ``inference.compiled.attach``) runs the
    MAP starts and the sampler on the compiled density (``inference.compiled.CompiledPass``);
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
    density = VectorizedDensity(model, train.x, train.y, train.mask)
    if full_mass:  # before any MAP fit
        check_dense_dim(density.dim)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    per_start = bool(names) and init in ("map", "ensemble")
    # per-start plain parameters are kept with every draw of their chains (posterior.members)
    plain = sum(p.numel() for p in model.parameters() if p.requires_grad) if per_start else 0
    kept = draw_bytes(num_chains, num_samples, density.dim + plain)
    working = draw_bytes(num_chains, WORKING_COPIES, density.dim + plain)
    working += 3 * activation_bytes(model, train.x[:1]) * num_chains  # a one-row pass, fwd + bwd
    if kept + working > MAX_DRAW_BYTES:
        raise ValueError(
            f"{num_chains} chains x {num_samples} draws x {density.dim + plain} scalars "
            f"({density.dim} latent, {plain} per-chain point estimates) would keep "
            f"{kept / 2**30:.1f} GiB of draws and hold {working / 2**30:.1f} GiB of sampler "
            f"state (limit {MAX_DRAW_BYTES / 2**30:.2g} GiB): use fewer chains or draws"
        )
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
    if per_start:  # each chain keeps its start's fitted values
        density.parameters = {
            name: value.detach().repeat_interleave(num_chains // num_starts, dim=0)
            for name, value in density.parameters.items()
        }
    z0 = starts.repeat_interleave(num_chains // num_starts, dim=0)
    log_density = density.log_density
    if parallel is not None:  # rank 0's starts and point estimates on every rank
        shared = [z0, *model.parameters(), *(density.parameters or {}).values()]
        broadcast_state(parallel, shared)
        log_density = density.sharded(parallel)
    _check_finite(density, z0)
    # ChEES: about GRADIENTS_PER_TRANSITION leapfrog steps per transition; MCLMC: per kept draw
    steps = max(30, num_warmup) if kernel == "mclmc" else num_warmup
    calls = (steps + num_samples) * GRADIENTS_PER_TRANSITION
    attach(compiled, compile, calls, lambda: log_density(z0))
    superchain = [k // (num_chains // num_starts) for k in range(num_chains)]
    start_seconds = time.perf_counter() - start_time

    rng = ChainRNG(seed, num_chains, device)
    if kernel == "chees":
        sampler = ChEES(
            log_density,
            rng,
            num_warmup,
            step_size=step_size,
            trajectory_length=trajectory_length,
            target_accept_prob=target_accept_prob,
            superchain=torch.tensor(superchain, device=device),
            dense=full_mass,
        )
        draws = _chees_draws(sampler, z0, num_warmup, num_samples)
    else:
        sampler = MCLMC(log_density, rng)
        draws = _mclmc_draws(sampler, z0, num_warmup, num_samples)
    kept, stats, partial = [], {}, False
    clock = {"warmup": time.perf_counter()}
    path = "compiled" if density.compiled is not None else "eager"
    with tqdm(
        total=num_warmup + num_samples, disable=not progress, desc=f"{kernel} ({path})", leave=False
    ) as bar:
        try:
            for z, draw_stats in draws:  # each warm-up step yields None
                bar.update(1)
                if z is None:
                    clock["sampling"] = time.perf_counter()  # after the last warm-up step
                    bar.set_postfix(step=f"{sampler.step_size:.3g}", refresh=False)
                    continue
                kept.append(z.detach().cpu())
                _append(stats, **draw_stats)
                bar.set_postfix(step=f"{sampler.step_size:.3g}", L=int(draw_stats["n_steps"][0]))
        except KeyboardInterrupt:
            if parallel is not None and not parallel.is_main:  # rank 0 keeps the run
                raise KeyboardInterrupt(
                    f"sampling interrupted on rank {parallel.rank}; rank 0 writes the draws "
                    "kept so far if it was interrupted too"
                ) from None
            partial = True
    if not kept:
        raise KeyboardInterrupt("fit_mcmc was interrupted before the first draw was kept")
    end = time.perf_counter()
    sampling_start = clock.get("sampling", clock["warmup"])
    z = torch.stack(kept, dim=1)  # (K, S, D)
    chains, draws = z.shape[:2]
    values = density.constrain(z.flatten(0, 1).to(torch.get_default_dtype()))
    samples = {k: v.reshape(chains, draws, *v.shape[1:]) for k, v in values.items()}
    record = dict(
        num_starts=num_starts,
        init=init,
        superchain=superchain,
        partial=partial,
        chain_gradients=sampler.gradients,
        start_seconds=start_seconds,
        warmup_seconds=sampling_start - clock["warmup"],
        sampling_seconds=end - sampling_start,
        **{f"adapted_{k}": v for k, v in sampler.settings().items()},
        **compiled.record(),
    )
    density.compiled = None
    if kernel == "mclmc":
        record.update(unadjusted=True, energy_error_var_per_dim=_energy_var(stats, density.dim))
    members = None
    record["point_estimates"] = None
    if per_start:
        members = {
            name: value[:, 0, None].expand(chains, draws, *value.shape[2:]).cpu()
            for name, value in density.parameters.items()
        }
        record["point_estimates"] = dict(
            method="map, per start", parameters=names, num_steps=map_steps, per_chain=True
        )
    return samples, members, _columns(stats), record


def _chees_draws(sampler: ChEES, z0, num_warmup: int, num_samples: int):
    """Yield ``(None, None)`` per warm-up transition, then ``(z (K, D), per-chain stats)`` per
    kept transition."""
    state = sampler.init(z0)
    for t in range(num_warmup + num_samples):
        state, move = sampler.step(state, adapt=t < num_warmup)
        if t < num_warmup:
            yield None, None
            continue
        yield (
            state.z,
            dict(
                diverging=move.diverging,
                acceptance_rate=move.accept_prob,
                step_size=torch.full_like(state.lp, move.step_size),
                n_steps=torch.full_like(state.lp, move.n_steps),
                energy=move.energy,
                lp=state.lp,
            ),
        )


def _mclmc_draws(sampler: MCLMC, z0, num_warmup: int, num_samples: int):
    """Tune in ``max(30, num_warmup)`` integrator steps (yielding ``(None, None)`` for each of
    ``num_warmup`` parts), then yield ``(z, per-chain stats)`` every ``ceil(L / step size)``
    steps (at most ``MAX_MCLMC_STEPS_PER_DRAW``)."""
    state, u = sampler.init(z0)
    state, u = sampler.tune(state, u, max(30, num_warmup))
    for _ in range(num_warmup):
        yield None, None
    steps = min(MAX_MCLMC_STEPS_PER_DRAW, max(1, math.ceil(sampler.L / sampler.step_size)))
    for _ in range(num_samples):
        errors = []
        for _ in range(steps):
            state, u, energy_change = sampler.step(state, u, sampler.step_size)
            errors.append(energy_change)
        errors = torch.stack(errors)
        yield (
            state.z,
            dict(
                diverging=~torch.isfinite(errors).all(0),
                step_size=torch.full_like(state.lp, sampler.step_size),
                n_steps=torch.full_like(state.lp, steps),
                energy_error=errors.square().mean(0).sqrt(),  # RMS per step, nats
                lp=state.lp,
            ),
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
    for step in tqdm(range(steps), disable=not progress, desc=desc, leave=False):
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


def _check_finite(density: VectorizedDensity, z0: torch.Tensor) -> None:
    """Name the first chain and site whose initial log density is not finite."""
    sites = density.site_log_densities(z0)
    bad = ~torch.stack([torch.isfinite(value) for value in sites.values()])  # (sites, K)
    if bad.any():  # the first chain, then its first site (no Python loop over K chains)
        k = int(bad.any(0).nonzero()[0])
        name = list(sites)[int(bad[:, k].nonzero()[0])]
        raise ValueError(
            f"the log density of chain {k} is not finite at its initial state: site "
            f"{name!r} gives {float(sites[name][k])}; check its prior and likelihood parameters "
            "(and the data) for NaN/inf, or use another init"
        )


def _append(stats: dict, **values: torch.Tensor) -> None:
    for name, value in values.items():
        stats.setdefault(name, []).append(value.detach().cpu())


def _columns(stats: dict) -> dict:
    """``{stat: [[value per draw] per chain]}`` of the per-draw ``(K,)`` tensors."""
    out = {}
    for name, values in stats.items():
        table = torch.stack(values, dim=1)  # (K, S)
        out[name] = table.bool().tolist() if name == "diverging" else table.double().tolist()
    return out


def _energy_var(stats: dict, dim: int) -> float:
    """Mean square energy error of one integrator step, per dimension (MCLMC's tuning target:
    5e-4); NaN steps (kept states) left out."""
    errors = torch.stack(stats["energy_error"]).double()
    errors = errors[torch.isfinite(errors)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(errors.square().mean() / dim) if errors.numel() else math.nan


__all__ = ["INITS", "MAX_DRAW_BYTES", "draw_bytes", "map_fit", "prior_states", "run_many_chains"]
