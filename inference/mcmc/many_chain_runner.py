"""The sampling loop of the many-chain kernels: K chains from their starting states, kept draws,
per-draw statistics and the record.

``starts.run_many_chains`` (``fit_mcmc`` with a ``ManyChainKernel``) calls ``sample_chains``
once the starts are fitted; the loop knows no kernel by name (``kernel.ManyChainSampler``).
Chains that share a start form a *superchain*; with ``per_start=True`` the kernels tune each
superchain on its own (a step size, and for MCLMC an L and a preconditioner, per start), as
MILE tunes each ensemble member's chain (Sommer et al. 2025): chains started in different
modes share no tuning statistics.
"""

from __future__ import annotations

import time

import torch

from probtransformer._progress import progress_bar
from probtransformer.inference.distributed import DataParallel, broadcast_state
from probtransformer.inference.mcmc.compiled import CompiledPass, attach
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.kernel import ChainRNG, ManyChainKernel, ManyChainSampler

#: Gradients per warm-up step or kept draw, as the compile rule counts them (ChEES's initial
#: trajectory is 10 leapfrog steps; an MCLMC draw about L / step size steps).
GRADIENTS_PER_TRANSITION = 10


def sample_chains(
    density: VectorizedDensity,
    z0: torch.Tensor,
    superchain: list[int],
    kernel: ManyChainKernel,
    *,
    num_warmup: int,
    num_samples: int,
    per_start: bool,
    seed: int,
    progress: bool,
    compiled: CompiledPass,
    parallel: DataParallel | None = None,
    start_time: float | None = None,
) -> tuple[dict, dict, dict]:
    """Run ``kernel`` from ``z0`` ``(K, D)`` (every chain's start), chain ``k`` in superchain
    ``superchain[k]`` (tuned apart with ``per_start``); ``num_warmup`` as the kernel counts it
    (``kernel.warmup_steps``), ``num_samples`` kept draws per chain; ``density.parameters``
    holds each chain's plain parameters or None.
    ``start_time`` (``time.perf_counter()`` when the fit began) sets ``start_seconds``: the
    time up to the first warm-up step (the starts, the checks and compiling).

    Returns:
        ``(samples {site: (chain, draw, *shape)}, stats {stat: [[...] per draw] per chain},
        record)``; the record holds ``superchain``, ``partial`` (True after a Ctrl-C),
        ``chain_gradients``, ``warmup_seconds``/``sampling_seconds``, the adapted settings
        (``adapted_*``; per superchain for ``per_start``), the compiled path's summary and the
        sampler's own entries (``ManyChainSampler.record``).

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
    steps = kernel.warmup_steps(num_warmup)
    calls = (steps + num_samples) * GRADIENTS_PER_TRANSITION
    attach(compiled, kernel.compile, calls, lambda: log_density(z0))
    groups = torch.tensor(superchain, device=device)
    rng = ChainRNG(seed, num_chains, device)
    sampler = kernel.sampler(
        log_density, rng, num_warmup=num_warmup, groups=groups, per_start=per_start
    )
    draws = _draws(sampler, z0, num_samples)
    kept, stats, partial = [], {}, False
    clock = {"warmup": time.perf_counter()}
    path = "compiled" if density.compiled is not None else "eager"
    total = steps + num_samples
    desc = f"{kernel.name} ({path})"
    bar = progress_bar(total=total, progress=progress, desc=desc, unit="transitions", leave=False)
    with bar:
        try:
            for draw in draws:  # each warm-up transition or tuning step yields None
                bar.update(1)
                if draw is None:
                    clock["sampling"] = time.perf_counter()  # after the last warm-up step
                    bar.set_postfix(step=_shown(sampler.step_size), refresh=False)
                    continue
                z, draw_stats = draw
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
        per_start_tuning=per_start,
        chain_gradients=sampler.gradients,
        start_seconds=0.0 if start_time is None else clock["warmup"] - start_time,
        warmup_seconds=sampling_start - clock["warmup"],
        sampling_seconds=end - sampling_start,
        **{f"adapted_{k}": v for k, v in sampler.adapted().items()},
        **compiled.record(),
        **sampler.record(stats, density.dim),
    )
    density.compiled = None
    return samples, columns(stats), record


def _shown(step_size) -> str:
    """A step size (float, or one per superchain) for the progress bar."""
    if isinstance(step_size, torch.Tensor):
        low, high = float(step_size.min()), float(step_size.max())
        return f"{low:.3g}" if low == high else f"{low:.3g}-{high:.3g}"
    return f"{step_size:.3g}"


def _draws(sampler: ManyChainSampler, z0: torch.Tensor, num_samples: int):
    """Yield None per warm-up step, then ``(z (K, D), per-chain stats)`` per kept draw."""
    state = yield from sampler.warmup(sampler.init(z0))
    for _ in range(num_samples):
        state, stats = sampler.sample(state)
        yield state.z, stats


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


__all__ = ["check_finite", "columns", "sample_chains"]
