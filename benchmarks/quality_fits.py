"""The quality benchmark's fits (``benchmarks.quality``): each data set's optimiser settings,
the run sizes, and the fit of every method sized to the row's time budget.

Budget: each row keeps its fit to ``FIT_SHARE`` of ``ctx.budget_s`` (runner default
``BUDGET_S``). Optimised fits time a ``PILOT_STEPS``-step pilot of the same fit (one member for
the ensemble; after a one-step fit that absorbs the process's start-up costs) and cut the steps
when the planned ones would not fit. NUTS times a pilot chain of ``PILOT_TRANSITIONS`` warm-up
transitions and one draw, and cuts the kept draws (to ``MIN_NUTS_DRAWS`` at least) when every
transition at the depth cap would not fit. ChEES plans ``CHEES_PLAN_SHARE`` of its allowance
(the trajectory length adapts during warm-up, so the leapfrog steps per transition,
``CHEES_STEPS_PER_TRANSITION``, are a guess): the MAP starts at most ``CHEES_MAP_SHARE`` of it,
the transitions the rest at the timed K-chain gradient seconds. ``budget_cut`` marks such rows;
the pilots' set-up and tracing costs count as step cost, on the safe side.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from arviz_stats.base import array_stats

from benchmarks._pyro_gradients import count_gradients
from benchmarks._suite import Context, budgeted_steps
from probtransformer.datasets import SequenceData
from probtransformer.inference import (
    NUTS,
    ChEES,
    EnsembleStarts,
    Posterior,
    fit_ensemble,
    fit_map,
    fit_mc_dropout,
    fit_mcmc,
    fit_svi,
)
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.starts import MAP_BATCH_SIZE

SEEDS = (0, 1, 2)
ENSEMBLE_MEMBERS = 5
#: Optimised fits: the function and its method-specific settings.
FITS = {
    "svi-meanfield": (fit_svi, {"guide": "normal"}),
    "svi-lowrank": (fit_svi, {"guide": "lowrank"}),
    "svi-stochastic": (fit_svi, {"guide": "normal"}),
    "map": (fit_map, {}),
    "mc-dropout": (fit_mc_dropout, {}),
    "ensemble": (fit_ensemble, {"n_members": ENSEMBLE_MEMBERS, "batched": False}),
    "ensemble-batched": (fit_ensemble, {"n_members": ENSEMBLE_MEMBERS, "batched": True}),
}
NUTS_TRAIN = 200  # training rows of NUTS at most
NUTS_MAX_TREE_DEPTH = 6  # 2**6 - 1 leapfrog steps per transition at most
FIT_SHARE = 0.8  # of ctx.budget_s for the fit; the rest for the pilot and the predictions
PILOT_STEPS = 50
PILOT_TRANSITIONS = 10  # warm-up transitions of the NUTS pilot chain (plus one draw)
MIN_NUTS_DRAWS = 10  # kept draws however tight the budget
#: ChEES's fit may take this many times the ensemble's fit seconds (the issue's goal) ...
CHEES_COST_RATIO = 5.0
#: ... of which it plans this share: the trajectory length adapts during warm-up, so the
#: planned leapfrog steps are a guess (``CHEES_STEPS_PER_TRANSITION``).
CHEES_PLAN_SHARE = 0.8
#: Leapfrog steps per transition assumed when planning: the largest warm-up mean of the first
#: four rows (digits seed 0: 15.3; JapaneseVowels 8.9; ArrowHead 6.0 and 4.7). Those rows,
#: planned with 21 steps and a share of 0.6, used 0.7-1.9x the ensemble's seconds of the 5x
#: allowed, and warmed up for only 13-17 transitions on digits and JapaneseVowels.
CHEES_STEPS_PER_TRANSITION = 15
CHEES_MAP_SHARE = 0.4  # of the planned seconds for the MAP starts at most
MIN_CHEES_WARMUP = 10  # warm-up transitions however tight the budget
MIN_CHEES_DRAWS = 5  # kept draws per chain however tight the budget
#: The MILE rows' goal: at most this many times the batched ensemble's fit seconds (the
#: ensemble's own seconds included). They run fixed sizes (``Sizes.mile_*``), never cut.
MILE_COST_RATIO = 10.0


@dataclass(frozen=True)
class Setup:
    """A data set's held-out classes and the optimiser settings of all its non-NUTS methods.

    Attributes:
        holdout: label numbers held out of training (the OOD classes).
        num_steps: Adam steps.
        lr: initial learning rate.
        lr_decay: final learning rate as a fraction of ``lr`` (exponential decay).
        batch_size: sequences per step; None: the whole training split.
    """

    holdout: tuple[int, ...]
    num_steps: int = 1000
    lr: float = 1e-2
    lr_decay: float = 0.1
    batch_size: int | None = None


SETUPS = {
    "digits": Setup((8, 9), batch_size=128),
    "ArrowHead": Setup((2,)),
    "JapaneseVowels": Setup((7, 8), batch_size=64),
}


@dataclass(frozen=True)
class Sizes:
    """How big a run is; ``QUICK`` shrinks everything for a smoke run.

    Attributes:
        datasets: the data sets measured.
        seeds: the seeds measured.
        num_steps: optimiser steps (None: each ``Setup``'s).
        draws: predictive draws of SVI and MC dropout.
        rows: None, or a stratified subsample of this many rows of each split.
        nuts_train: training rows of NUTS at most (a stratified subsample).
        nuts_warmup: NUTS warm-up transitions.
        nuts_draws: NUTS kept transitions (its predictive draws).
        max_tree_depth: NUTS doublings per transition at most.
        chees_chains: ChEES chains K.
        chees_starts: ChEES starts M (MAP fits; superchains of K / M chains).
        chees_map_steps: Adam steps of the MAP starts at most.
        chees_warmup: ChEES warm-up transitions at most.
        chees_draws: ChEES kept draws per chain at most.
        mile_members: ensemble members of the MILE rows (``fit_mile``).
        mile_chains: MCLMC chains per member (MILE runs one; within-member R-hat then splits
            each chain in halves).
        mile_warmup: MCLMC tuning steps per chain (``mile``, ``mile-circuits``).
        mile_draws: kept draws per chain.
        mile_thinning: MCLMC integrator steps per kept draw.
        permember_chains: ChEES chains per member (``chees-permember``; at least 2: ChEES
            adapts each member's trajectory from the spread of its chains).
        permember_warmup: ChEES warm-up transitions per chain.
        permember_draws: ChEES kept draws per chain.
    """

    datasets: tuple[str, ...] = tuple(SETUPS)
    seeds: tuple[int, ...] = SEEDS
    num_steps: int | None = None
    draws: int = 100
    rows: int | None = None
    nuts_train: int = NUTS_TRAIN
    nuts_warmup: int = 100
    nuts_draws: int = 100
    max_tree_depth: int = NUTS_MAX_TREE_DEPTH
    chees_chains: int = 10
    chees_starts: int = 5
    chees_map_steps: int = 1000
    chees_warmup: int = 60
    chees_draws: int = 20
    mile_members: int = ENSEMBLE_MEMBERS
    mile_chains: int = 1
    mile_warmup: int = 2000
    mile_draws: int = 100
    mile_thinning: int = 10
    permember_chains: int = 2
    permember_warmup: int = 60
    permember_draws: int = 30


FULL = Sizes()
QUICK = Sizes(
    datasets=("digits", "ArrowHead"),
    seeds=SEEDS[:1],
    num_steps=5,
    draws=10,
    rows=40,
    nuts_train=40,
    nuts_warmup=3,
    nuts_draws=3,
    max_tree_depth=3,
    chees_chains=4,
    chees_starts=2,
    chees_map_steps=5,
    chees_warmup=3,
    chees_draws=3,
    mile_members=2,
    mile_chains=2,
    mile_warmup=30,
    mile_draws=3,
    mile_thinning=2,
    permember_warmup=3,
    permember_draws=3,
)


def optimised_settings(train: SequenceData, setup: Setup, seed: int, ctx: Context) -> dict:
    """``fit_svi``/``fit_map``/... keyword arguments shared by the optimised methods."""
    return dict(
        batch_size=setup.batch_size or len(train),
        lr=setup.lr,
        lr_decay=setup.lr_decay,
        device=ctx.device,
        seed=seed,
        progress=False,
    )


def pilot_step_seconds(method: str, model, train: SequenceData, settings: dict) -> float:
    """Seconds per step of ``method``'s whole fit (all ensemble members) from a timed
    ``PILOT_STEPS``-step fit (one member), after a one-step fit that absorbs the process's
    start-up costs; the pilot's per-fit set-up counts as step cost."""
    fit, specific = FITS[method]
    sequential = method == "ensemble"  # one member's pilot, times the members
    members = specific["n_members"] if sequential else 1
    pilot = {**specific, "n_members": 1} if sequential else specific
    fit(model, train, num_steps=1, **pilot, **settings)
    start = time.perf_counter()
    fit(model, train, num_steps=PILOT_STEPS, **pilot, **settings)
    return members * (time.perf_counter() - start) / PILOT_STEPS


def fit_optimised(
    method: str, model, train: SequenceData, setup: Setup, sizes: Sizes, seed: int, ctx: Context
) -> tuple[Posterior, dict]:
    """SVI, MAP, MC dropout or the ensemble; steps cut by a timed pilot to fit the budget."""
    fit, specific = FITS[method]
    settings = optimised_settings(train, setup, seed, ctx)
    planned = sizes.num_steps or setup.num_steps
    num_steps, step_seconds = planned, None
    if planned > PILOT_STEPS:
        step_seconds = pilot_step_seconds(method, model, train, settings)
        num_steps = budgeted_steps(
            step_seconds, FIT_SHARE * ctx.budget_s, max_steps=planned, min_steps=1
        )
    start = time.perf_counter()
    post = fit(model, train, num_steps=num_steps, **specific, **settings)
    fit_seconds = time.perf_counter() - start
    elbo = post.record.get("elbo")  # the ensemble keeps its members' final losses instead
    tenth = None if elbo is None else elbo[-max(len(elbo) // 10, 1) :]
    return post, {
        "fit_seconds": fit_seconds,
        "num_steps": num_steps,
        "planned_steps": planned,
        "budget_cut": num_steps < planned,
        "pilot_step_seconds": step_seconds,
        "objective_last_tenth": None if tenth is None else float(np.mean(tenth)),
        "settings": {**specific, **settings, "num_steps": num_steps},
    }


def recorded(settings: dict, num_chains: int) -> dict:
    """``fit_mcmc``'s settings as a row records them: the kernel's and the starts' settings
    objects flattened into their recorded fields (``kernel``, ``max_tree_depth`` ...)."""
    out = {k: v for k, v in settings.items() if k not in ("kernel", "starts")}
    out.update(settings["kernel"].record())
    if settings.get("starts") is not None:
        out.update(settings["starts"].record(num_chains))
    return out


def fit_nuts(
    model, train: SequenceData, sizes: Sizes, seed: int, ctx: Context
) -> tuple[Posterior, dict]:
    """NUTS on the small fully Bayesian model; kept draws cut by a timed pilot chain so that
    every transition at the depth cap would fit the budget."""
    settings = dict(
        kernel=NUTS(max_tree_depth=sizes.max_tree_depth, jit_compile=True),
        num_chains=1,
        device=ctx.device,
        seed=seed,
        progress=False,
    )
    with warnings.catch_warnings():  # the pilot and quick runs warm up briefly, on purpose
        warnings.filterwarnings("ignore", message="num_warmup=.* is short")
        start = time.perf_counter()
        with count_gradients() as gradients:
            fit_mcmc(model, train, num_warmup=PILOT_TRANSITIONS, num_samples=1, **settings)
        gradient_seconds = (time.perf_counter() - start) / gradients[0]  # tracing included
        worst_transition = gradient_seconds * (2**sizes.max_tree_depth - 1)
        transitions = budgeted_steps(
            worst_transition,
            FIT_SHARE * ctx.budget_s,
            max_steps=sizes.nuts_warmup + sizes.nuts_draws,
            min_steps=sizes.nuts_warmup + min(sizes.nuts_draws, MIN_NUTS_DRAWS),
        )
        num_draws = transitions - sizes.nuts_warmup
        start = time.perf_counter()
        post = fit_mcmc(
            model, train, num_warmup=sizes.nuts_warmup, num_samples=num_draws, **settings
        )
    fit_seconds = time.perf_counter() - start
    stats = {k: np.asarray(v) for k, v in post.record["sample_stats"].items()}
    return post, {
        "fit_seconds": fit_seconds,
        "num_draws": num_draws,
        "planned_draws": sizes.nuts_draws,
        "budget_cut": num_draws < sizes.nuts_draws,
        "pilot_gradient_seconds": gradient_seconds,
        "divergences": int(stats["diverging"].sum()),
        "mean_tree_depth": float(stats["tree_depth"].mean()),
        "share_at_max_depth": float((stats["tree_depth"] >= sizes.max_tree_depth).mean()),
        "leapfrog_steps_sampling": int(stats["n_steps"].sum()),
        "mean_acceptance": float(stats["acceptance_rate"].mean()),
        "step_size": float(stats["step_size"].mean()),
        "settings": {
            **recorded(settings, num_chains=1),
            "num_warmup": sizes.nuts_warmup,
            "num_samples": num_draws,
        },
    }


def _chees_gradient_seconds(
    model, train: SequenceData, chains: int, starts: int
) -> tuple[float, float]:
    """Seconds of one ``chains``-chain gradient of the full-data log density and of one
    ``starts``-start gradient on ``MAP_BATCH_SIZE`` rows (the MAP starts' step), each timed
    after one untimed call."""
    density = VectorizedDensity(copy.deepcopy(model).eval(), train.x, train.y, train.mask)
    rows = torch.arange(min(MAP_BATCH_SIZE, len(train)))
    timed = []
    for z, batch in (
        (torch.zeros(chains, density.dim), None),
        (torch.zeros(starts, density.dim), rows),
    ):
        density.log_density(z, rows=batch, jacobian=batch is None)
        start = time.perf_counter()
        density.log_density(z, rows=batch, jacobian=batch is None)
        timed.append(time.perf_counter() - start)
    return timed[0], timed[1]


def plan_chees(
    budget_s: float, gradient_seconds: float, map_step_seconds: float, sizes: Sizes
) -> dict:
    """MAP steps, warm-up transitions and kept draws per chain that fit ``budget_s``.

    A transition is assumed to take ``CHEES_STEPS_PER_TRANSITION`` leapfrog steps of
    ``gradient_seconds`` each (one K-chain gradient of the full-data log density). The MAP
    starts (``map_step_seconds`` per step) get at most ``CHEES_MAP_SHARE`` of the budget, less
    when the fewest transitions (``MIN_CHEES_WARMUP`` + ``MIN_CHEES_DRAWS``) would not fit
    beside them; the transitions the rest, cut (warm-up and draws in proportion) to no fewer
    than those. A budget too small for the fewest transitions gets them and one MAP step.

    Args:
        budget_s: seconds the fit should take.
        gradient_seconds: seconds of one K-chain full-data gradient.
        map_step_seconds: seconds of one step of the M MAP starts.
        sizes: the most steps, warm-up transitions and draws (``Sizes.chees_*``).

    Returns:
        ``{"map_steps", "num_warmup", "num_samples"}`` for ``fit_mcmc``.
    """
    planned = sizes.chees_warmup + sizes.chees_draws
    min_warmup = min(MIN_CHEES_WARMUP, sizes.chees_warmup)
    min_draws = min(MIN_CHEES_DRAWS, sizes.chees_draws)
    transition_seconds = CHEES_STEPS_PER_TRANSITION * gradient_seconds
    map_budget = min(
        CHEES_MAP_SHARE * budget_s, budget_s - (min_warmup + min_draws) * transition_seconds
    )
    map_steps = budgeted_steps(
        map_step_seconds, max(map_budget, 0.0), max_steps=sizes.chees_map_steps, min_steps=1
    )
    transitions = budgeted_steps(
        transition_seconds,
        budget_s - map_steps * map_step_seconds,
        max_steps=planned,
        min_steps=min_warmup + min_draws,
    )
    warmup = max(min_warmup, round(transitions * sizes.chees_warmup / planned))
    warmup = min(warmup, transitions - min_draws)
    return {"map_steps": map_steps, "num_warmup": warmup, "num_samples": transitions - warmup}


def fit_chees(
    model,
    train: SequenceData,
    ensemble_seconds: float,
    sizes: Sizes,
    seed: int,
    ctx: Context,
) -> tuple[Posterior, dict]:
    """ChEES-HMC (``fit_mcmc(kernel=ChEES(), starts=EnsembleStarts(M))``) sized to
    ``CHEES_PLAN_SHARE`` x ``CHEES_COST_RATIO`` x ``ensemble_seconds`` (``plan_chees``, from
    timed gradients); the row records whether the fit kept to ``CHEES_COST_RATIO`` x."""
    chains, starts = sizes.chees_chains, sizes.chees_starts
    gradient_seconds, map_step_seconds = _chees_gradient_seconds(model, train, chains, starts)
    budget_s = CHEES_PLAN_SHARE * CHEES_COST_RATIO * ensemble_seconds
    plan = plan_chees(budget_s, gradient_seconds, map_step_seconds, sizes)
    settings = dict(
        kernel=ChEES(),
        starts=EnsembleStarts(starts),
        num_chains=chains,
        **plan,
        device=ctx.device,
        seed=seed,
        progress=False,
    )
    with warnings.catch_warnings():  # budget-cut and quick runs warm up briefly, on purpose
        warnings.filterwarnings("ignore", message="num_warmup=.* is short")
        start = time.perf_counter()
        post = fit_mcmc(model, train, **settings)
    fit_seconds = time.perf_counter() - start
    record = post.record
    stats = {k: np.asarray(v) for k, v in record["sample_stats"].items()}  # (chain, draw)
    superchain = np.asarray(record["superchain"])
    kept_steps = stats["n_steps"][0]  # shared by the chains
    warmup_steps = record["chain_gradients"] / chains - kept_steps.sum()
    return post, {
        "fit_seconds": fit_seconds,
        "ensemble_seconds": ensemble_seconds,
        "ensemble_ratio": fit_seconds / ensemble_seconds,
        "within_cost_ratio": fit_seconds <= CHEES_COST_RATIO * ensemble_seconds,
        "planned_seconds": budget_s,
        "pilot_gradient_seconds": gradient_seconds,
        "pilot_map_step_seconds": map_step_seconds,
        "num_chains": chains,
        "num_starts": starts,
        "num_draws": plan["num_samples"],
        "planned_draws": sizes.chees_draws,
        "budget_cut": plan["num_samples"] < sizes.chees_draws
        or plan["map_steps"] < sizes.chees_map_steps,
        "chain_gradients": record["chain_gradients"],
        "start_seconds": record["start_seconds"],
        "warmup_seconds": record["warmup_seconds"],
        "sampling_seconds": record["sampling_seconds"],
        "divergences": int(stats["diverging"].sum()),
        "mean_acceptance": float(stats["acceptance_rate"].mean()),
        "adapted_step_size": record["adapted_step_size"],
        "adapted_trajectory_length": record["adapted_trajectory_length"],
        "mean_leapfrog_steps_warmup": float(warmup_steps / max(plan["num_warmup"], 1)),
        "mean_leapfrog_steps_sampling": float(kept_steps.mean()),
        "nested_rhat_lp": float(array_stats.rhat_nested(stats["lp"], superchain)),
        "settings": recorded(settings, num_chains=chains),
    }


def fit_route(
    method: str,
    model,
    train: SequenceData,
    setup: Setup,
    ensemble: Posterior | None,
    sizes: Sizes,
    seed: int,
    ctx: Context,
    *,
    reference_seconds: float | None = None,
) -> tuple[Posterior, dict]:
    """A MILE row: ``fit_mile`` from ``ensemble`` (the batched ensemble row's posterior of the
    same data and seed) or, without one, from a batched ensemble it fits with the optimised
    methods' settings; MCLMC (``mile``, ``mile-circuits``) or ChEES (``chees-permember``). Its
    fit seconds count the ensemble's; the row records them against the batched ensemble's
    (``ensemble_ratio``; goal ``MILE_COST_RATIO``), the within-mode R-hat and bulk ESS of the
    log density (``inference.diagnostics.modes``, worst over the members), the tuning per member
    and the
    spread between members. ``reference_seconds``: the batched ensemble row's fit seconds, the
    ratio's denominator (None: this row's own ensemble's)."""
    from probtransformer.inference import fit_ensemble, fit_mile
    from probtransformer.inference.diagnostics import modes
    from probtransformer.inference.diagnostics._arviz import az

    optimised = optimised_settings(train, setup, seed, ctx)
    ensemble_options = dict(
        num_steps=sizes.num_steps or setup.num_steps, batch_size=optimised["batch_size"],
        lr=setup.lr, lr_decay=setup.lr_decay,
    )  # fmt: skip
    if ensemble is None:
        start = time.perf_counter()
        ensemble = fit_ensemble(
            model, train, n_members=sizes.mile_members, seed=seed, progress=False,
            device=ctx.device, **ensemble_options,
        )  # fmt: skip
        ensemble_seconds = time.perf_counter() - start
        basis = "fitted by this row"
    else:
        ensemble_seconds = ensemble.record["seconds"]
        basis = "the ensemble-batched row's, this process"
    chees = method == "chees-permember"
    settings = dict(
        kernel="chees" if chees else "mclmc",
        chains_per_member=sizes.permember_chains if chees else sizes.mile_chains,
        num_warmup=sizes.permember_warmup if chees else sizes.mile_warmup,
        num_samples=sizes.permember_draws if chees else sizes.mile_draws,
        thinning=sizes.mile_thinning,
        seed=seed,
        progress=False,
    )
    with warnings.catch_warnings():  # quick runs warm up briefly, on purpose
        warnings.filterwarnings("ignore", message="num_warmup=.* is short")
        start = time.perf_counter()
        post = fit_mile(model, train, ensemble=ensemble, **settings)
    sampling_seconds = time.perf_counter() - start
    record = post.record
    stats = {k: np.asarray(v) for k, v in record["sample_stats"].items()}  # (chain, draw)
    superchain = np.asarray(record["superchain"])
    within = modes.within_modes(az.from_dict(sample_stats={"lp": stats["lp"]}), superchain, "y")
    fit_seconds = ensemble_seconds + sampling_seconds
    ratio = fit_seconds / (reference_seconds or ensemble_seconds)
    return post, {
        "fit_seconds": fit_seconds,
        "ensemble_seconds": ensemble_seconds,
        "ensemble_basis": basis,
        "sampling_seconds": sampling_seconds,
        "ensemble_ratio": ratio,
        "within_cost_ratio": ratio <= MILE_COST_RATIO,
        "budget_cut": False,
        "num_chains": record["num_chains"],
        "num_draws": settings["num_samples"],
        "chain_gradients": record["chain_gradients"],
        "density_path": record["density_path"],
        "compile_seconds": record["compile_seconds"],
        "divergences": int(stats["diverging"].sum()),
        "adapted_step_size": record["adapted_step_size"],
        "energy_error_var_per_dim": record.get("energy_error_var_per_dim_by_start"),
        "mean_acceptance": float(stats["acceptance_rate"].mean()) if chees else None,
        "within_mode_r_hat_lp": within["lp"]["r_hat"],
        "within_mode_ess_lp": within["lp"]["ess_bulk"],
        "settings": {**settings, **ensemble_options, "members": record["n_members"]},
    }
