"""The sampling loop of the many-chain kernels: K chains from their starting states, kept draws,
per-draw statistics and the record.

``many_chains.run_many_chains`` (``fit_mcmc(kernel="chees" | "mclmc")``) and ``mile.fit_mile``
call ``sample_chains`` once their starts are fitted. Chains that share a start form a
*superchain*; with ``per_start=True`` the kernels tune each superchain on its own (a step size,
and for MCLMC an L and a preconditioner, per start), as MILE tunes each ensemble member's chain
(Sommer et al. 2025): chains started in different modes share no tuning statistics.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import torch

from probtransformer._progress import progress_bar
from probtransformer.inference.distributed import DataParallel, broadcast_state
from probtransformer.inference.mcmc.chees import (
    CHEES_TARGET_ACCEPT,
    MAX_ENERGY_ERROR,
    ChainRNG,
    ChEES,
)
from probtransformer.inference.mcmc.compiled import CompiledPass, attach
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.mclmc import BLACKJAX_TUNING, MCLMC, Tuning

#: Gradients per ChEES transition or kept MCLMC draw, as the compile rule counts them (ChEES's
#: initial trajectory is 10 leapfrog steps).
GRADIENTS_PER_TRANSITION = 10

#: Most integrator steps per kept MCLMC draw when ``thinning`` is not given.
MAX_MCLMC_STEPS_PER_DRAW = 256


@dataclass(frozen=True)
class KernelSettings:
    """What ``sample_chains`` runs.

    Attributes:
        kernel: ``"chees"`` or ``"mclmc"``.
        num_warmup: ChEES: adaptation transitions; MCLMC: tuning integrator steps
            (``max(30, num_warmup)``).
        num_samples: kept draws per chain.
        step_size, trajectory_length, target_accept_prob, full_mass: ChEES's (see ``ChEES``).
        tuning: MCLMC's ``Tuning``.
        thinning: MCLMC's integrator steps per kept draw (None: ``ceil(L / step size)`` of the
            slowest group, at most ``MAX_MCLMC_STEPS_PER_DRAW``).
        per_start: tune each superchain on its own.
    """

    kernel: str
    num_warmup: int
    num_samples: int
    step_size: float = 0.1
    trajectory_length: float | None = None
    target_accept_prob: float = CHEES_TARGET_ACCEPT
    full_mass: bool = False
    tuning: Tuning = BLACKJAX_TUNING
    thinning: int | None = None
    per_start: bool = False


def sample_chains(
    density: VectorizedDensity,
    z0: torch.Tensor,
    superchain: list[int],
    settings: KernelSettings,
    *,
    seed: int,
    progress: bool,
    compiled: CompiledPass,
    compile: bool | None = None,
    parallel: DataParallel | None = None,
    start_time: float | None = None,
) -> tuple[dict, dict, dict]:
    """Run the kernel from ``z0`` ``(K, D)`` (every chain's start), chain ``k`` in superchain
    ``superchain[k]``; ``density.parameters`` holds each chain's plain parameters or None.
    ``start_time`` (``time.perf_counter()`` when the fit began) sets ``start_seconds``: the
    time up to the first warm-up step (the starts, the checks and compiling).

    Returns:
        ``(samples {site: (chain, draw, *shape)}, stats {stat: [[...] per draw] per chain},
        record)``; the record holds ``superchain``, ``partial`` (True after a Ctrl-C),
        ``chain_gradients``, ``warmup_seconds``/``sampling_seconds``, the adapted settings
        (``adapted_*``; per superchain for ``per_start``), the compiled path's summary and, for
        MCLMC, ``unadjusted`` and the energy-error variance per dimension (overall and per
        superchain).

    Raises:
        ValueError: a non-finite initial log density (names the chain and the site).
        KeyboardInterrupt: Ctrl-C before the first kept draw.
    """
    num_chains = len(z0)
    device = z0.device
    log_density = density.log_density
    if parallel is not None:  # rank 0's starts and point estimates on every rank
        shared = [z0, *density.model.parameters(), *(density.parameters or {}).values()]
        broadcast_state(parallel, shared)
        log_density = density.sharded(parallel)
    check_finite(density, z0)
    kernel = settings.kernel
    # ChEES: about GRADIENTS_PER_TRANSITION leapfrog steps per transition; MCLMC: per kept draw
    steps = max(30, settings.num_warmup) if kernel == "mclmc" else settings.num_warmup
    calls = (steps + settings.num_samples) * GRADIENTS_PER_TRANSITION
    attach(compiled, compile, calls, lambda: log_density(z0))
    groups = torch.tensor(superchain, device=device)
    rng = ChainRNG(seed, num_chains, device)
    if kernel == "chees":
        sampler = ChEES(
            log_density,
            rng,
            settings.num_warmup,
            step_size=settings.step_size,
            trajectory_length=settings.trajectory_length,
            target_accept_prob=settings.target_accept_prob,
            superchain=groups,
            dense=settings.full_mass,
            per_superchain=settings.per_start,
        )
        draws = _chees_draws(sampler, z0, settings.num_warmup, settings.num_samples)
    else:
        sampler = MCLMC(
            log_density, rng, groups=groups if settings.per_start else None, tuning=settings.tuning
        )
        draws = _mclmc_draws(sampler, z0, settings)
    kept, stats, partial = [], {}, False
    clock = {"warmup": time.perf_counter()}
    path = "compiled" if density.compiled is not None else "eager"
    total = settings.num_warmup + settings.num_samples
    desc = f"{kernel} ({path})"
    bar = progress_bar(total=total, progress=progress, desc=desc, unit="transitions", leave=False)
    with bar:
        try:
            for z, draw_stats in draws:  # each warm-up transition or tuning step yields None
                bar.update(1)
                if z is None:
                    clock["sampling"] = time.perf_counter()  # after the last warm-up step
                    bar.set_postfix(step=_shown(sampler.step_size), refresh=False)
                    continue
                kept.append(z.detach().cpu())
                _append(stats, **draw_stats)
                bar.set_postfix(step=_shown(sampler.step_size), L=int(draw_stats["n_steps"][0]))
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
    chains, num_draws = z.shape[:2]
    values = density.constrain(z.flatten(0, 1).to(torch.get_default_dtype()))
    samples = {k: v.reshape(chains, num_draws, *v.shape[1:]) for k, v in values.items()}
    record = dict(
        superchain=superchain,
        partial=partial,
        per_start_tuning=settings.per_start,
        chain_gradients=sampler.gradients,
        start_seconds=0.0 if start_time is None else clock["warmup"] - start_time,
        warmup_seconds=sampling_start - clock["warmup"],
        sampling_seconds=end - sampling_start,
        **{f"adapted_{k}": v for k, v in sampler.settings().items()},
        **compiled.record(),
    )
    density.compiled = None
    if kernel == "mclmc":
        record.update(
            unadjusted=True,
            thinning=int(stats["n_steps"][0][0]),
            energy_error_var_per_dim=_energy_var(stats["energy_error"], density.dim),
            energy_error_var_per_dim_by_start=[
                _energy_var([e[groups.cpu() == g] for e in stats["energy_error"]], density.dim)
                for g in range(int(groups.max()) + 1)
            ],
        )
    return samples, columns(stats), record


def _shown(step_size) -> str:
    """A step size (float, or one per superchain) for the progress bar."""
    if isinstance(step_size, torch.Tensor):
        low, high = float(step_size.min()), float(step_size.max())
        return f"{low:.3g}" if low == high else f"{low:.3g}-{high:.3g}"
    return f"{step_size:.3g}"


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
                step_size=move.step_size.to(state.lp),
                n_steps=move.n_steps.to(state.lp),
                energy=move.energy,
                lp=state.lp,
            ),
        )


def _mclmc_draws(sampler: MCLMC, z0, settings: KernelSettings):
    """Tune in ``max(30, num_warmup)`` integrator steps, yielding ``(None, None)`` after each
    (about ``num_warmup`` in all), then yield ``(z, per-chain stats)`` every ``thinning``
    steps."""
    state, u = sampler.init(z0)
    state, u = yield from sampler.tuning_steps(state, u, max(30, settings.num_warmup))
    steps = settings.thinning
    if steps is None:
        slowest = float((sampler.L / sampler.step_size).max())
        steps = min(MAX_MCLMC_STEPS_PER_DRAW, max(1, math.ceil(slowest)))
    step_size = sampler._chains(sampler.step_size).squeeze(1)
    for _ in range(settings.num_samples):
        errors = []
        for _ in range(steps):
            state, u, energy_change = sampler.step(state, u)
            errors.append(energy_change)
        errors = torch.stack(errors)
        # a step whose energy error is not finite or above MAX_ENERGY_ERROR nats (Stan's and
        # Pyro's threshold for HMC) is divergent: unadjusted, MCLMC keeps such a jump
        divergent = ~(errors.abs() <= MAX_ENERGY_ERROR).all(0)
        yield (
            state.z,
            dict(
                diverging=divergent,
                step_size=step_size,
                n_steps=torch.full_like(state.lp, steps),
                energy_error=errors.square().mean(0).sqrt(),  # RMS per step, nats
                lp=state.lp,
            ),
        )


def check_finite(density: VectorizedDensity, z0: torch.Tensor) -> None:
    """Name the first chain and site whose initial log density is not finite.

    Raises:
        ValueError: naming them, with the value.
    """
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


def columns(stats: dict) -> dict:
    """``{stat: [[value per draw] per chain]}`` of the per-draw ``(K,)`` tensors."""
    out = {}
    for name, values in stats.items():
        table = torch.stack(values, dim=1)  # (K, S)
        out[name] = table.bool().tolist() if name == "diverging" else table.double().tolist()
    return out


def _energy_var(errors: list[torch.Tensor], dim: int) -> float:
    """Mean square energy error of one integrator step, per dimension, of per-draw ``(K,)``
    RMS errors; NaN steps (kept states) left out."""
    errors = torch.stack(errors).double()
    errors = errors[torch.isfinite(errors)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(errors.square().mean() / dim) if errors.numel() else math.nan


__all__ = ["KernelSettings", "check_finite", "columns", "sample_chains"]
