"""``fit_mcmc``, the one MCMC driver: a kernel settings object chooses the runner (as NumPyro's
one ``MCMC`` takes a kernel), Pyro's chains as processes for ``NUTS``/``HMC``
(``mcmc.pyro_runner``), K chains through the model's draw dim for the many-chain kernels
(``ChEES``, ``MCLMC`` ...; ``mcmc.starts``, ``mcmc.many_chain_runner``).
"""

from __future__ import annotations

import copy
import math
import time
import warnings

import torch
from pyro import poutine

from probtransformer.attention import LOCAL_LATENT, BayesMultiheadAttention
from probtransformer.data import SequenceData
from probtransformer.inference._runtime import (
    pyro_scope,
    reinitialised_copy,
    resolve_device,
    seeded,
)
from probtransformer.inference.distributed import (
    DataParallel,
    check_same_fit,
    data_parallel,
    joined,
    together,
)
from probtransformer.inference.inputs import (
    check_model,
    check_training_data,
    example_of,
    rows_digest,
)
from probtransformer.inference.mcmc.hmc import NUTS
from probtransformer.inference.mcmc.kernel import Kernel, ManyChainKernel
from probtransformer.inference.mcmc.legacy import from_strings
from probtransformer.inference.mcmc.pyro_runner import check_initial_density, run_pyro_kernel
from probtransformer.inference.mcmc.starts import (
    MAX_DRAW_BYTES,
    PriorStarts,
    Starts,
    draw_bytes,
    run_many_chains,
)
from probtransformer.inference.model_checks import check_sampled_sites, latent_sites
from probtransformer.inference.posterior.posterior import Posterior
from probtransformer.inference.vi.guides import has_local_latents
from probtransformer.inference.vi.svi import fit_svi
from probtransformer.validation import check_int, described

#: ``fit_mcmc``'s kernel unless one is given.
DEFAULT_KERNEL = NUTS()

#: Most sequences ``fit_mcmc`` accepts for a model with local latents (stochastic attention).
MAX_LOCAL_SEQUENCES = 50


def _refuse_hard_attention(model: torch.nn.Module) -> None:
    hard = [
        n for n, m in model.named_modules() if isinstance(m, BayesMultiheadAttention) and m.hard
    ]
    if hard:
        raise ValueError(
            f"fit_mcmc cannot sample a model with hard attention ({hard[0]}: hard_attention=True):"
            " its log density is piecewise constant in the query and key weights and the "
            "straight-through gradient is not its gradient, so HMC/NUTS would be invalid; use "
            "fit_svi or fit_map"
        )


def fit_mcmc(
    model: torch.nn.Module,
    data: SequenceData,
    *,
    kernel: Kernel | str = DEFAULT_KERNEL,
    num_chains: int = 4,
    num_warmup: int = 200,
    num_samples: int = 200,
    starts: Starts | None = None,
    map_steps: int = 1000,
    device: str | torch.device = "auto",
    seed: int = 0,
    progress: bool = True,
    distributed: bool = False,
    **deprecated,
) -> Posterior:
    """Sample the posterior of ``model`` given ``data`` with an MCMC ``kernel``.

    The kernel is a settings object; its type chooses how the chains run:

    - ``NUTS()`` (the default) and ``HMC()`` (``inference.mcmc.hmc``): Pyro's kernels. NUTS
      (Hoffman & Gelman 2014) with multinomial sampling and Stan-style windowed adaptation of
      the step size (dual averaging to ``target_accept_prob``) and of a diagonal (or, with
      ``full_mass``, dense) mass matrix during ``num_warmup``; HMC (Neal 2011) integrates for a
      fixed ``trajectory_length`` per transition. Chains start from independent uniform draws
      in (-2, 2) of the unconstrained space (Stan's default). They run in parallel processes
      when the machine has more than ``num_chains`` cores (Pyro keeps one for the main process)
      and one after another otherwise; CUDA chains use a ``spawn`` context.
    - The many-chain kernels (``ManyChainKernel``: ``ChEES()``, ``MCLMC()`` ... ;
      ``inference.mcmc.registry`` lists them) run the K chains together as the model's draw
      dim: each step is one vectorized gradient of all chains (``inference.mcmc.density``), so
      on a GPU K chains cost about one. Before sampling, the K-chain log density is checked
      against single-chain evaluations site by site. Chains start from M points (``starts``:
      ``PriorStarts``, ``MAPStarts`` or ``EnsembleStarts``; ``inference.mcmc.starts``), K / M
      chains per start (a *superchain*, ``record["superchain"]``); each ensemble member's
      chains are tuned on their own. ChEES-HMC (Hoffman, Radul & Sountsov 2021) is
      Metropolis-adjusted per chain (exact); MCLMC (Robnik et al. 2023) is **unadjusted**: its
      draws carry a step-size bias (``record["energy_error_var_per_dim"]``; ``diagnose``
      flags it), and ``inference.mcmc.mile`` runs MILE's recipe with it.

    The model runs in eval mode (dropout off: the target density must be deterministic) on the
    full data set. Its point-estimate parameters (plain ``nn.Parameter``s, the parts that are not
    Bayesian) are first fitted by MAP (``fit_svi(guide="delta")`` for ``map_steps`` steps), then
    held fixed, shared by every chain, while sampling. Exception: MAP and ensemble starts fit
    them in each start's MAP fit (from the model re-initialised with ``seed + m`` for start
    ``m``; a given ensemble's members' values), and every chain keeps its start's values
    (``posterior.members``, ``(chain, draw, *shape)``): a deep ensemble's features with the
    Bayesian parts sampled around each member. ``record["point_estimates"]`` says which
    and how. Ctrl-C stops sampling and returns the draws so far as a Posterior with
    ``record["partial"] = True`` (chains cut to a common length; NUTS/HMC chains in worker
    processes lose their per-draw statistics).

    Local latents of a user's model (sampled inside ``pyro.plate("data")``, one value per row,
    e.g. the school effects of eight schools) are kept: ``samples[site]`` is
    ``(chain, draw, N, *per_row)``; a pass over exactly the training data (``log_likelihood``,
    ``to_inference_data``) is conditioned on them, other inputs draw them from the model. The
    sites the sampler will return are checked against those the Posterior keeps before the
    first transition. Stochastic attention's local latents (``priors.StochasticAttentionPrior``:
    one latent per attention logit of every sequence) are sampled jointly with the weights,
    non-centred (``LocScaleReparam``), only by NUTS/HMC and only for small data: at most
    ``MAX_LOCAL_SEQUENCES`` (50) short sequences. Their draws are not kept; predictions for any
    inputs draw them from their contextual prior given each weight draw.

    Cost: one gradient of the full-data log density per leapfrog step, up to
    ``2**max_tree_depth - 1`` steps per NUTS transition; neural-network posteriors ask for long
    trajectories, so keep models and data small. Small models run fastest on one torch thread
    (``torch.set_num_threads(1)``; worker processes keep torch's default). ``jit_compile``
    saved about a third of the time per gradient on the small classifier (NUTS/HMC only). The
    many-chain kernels pay one K-chain gradient per step; ``benchmarks/BENCHMARKS.md`` has the
    chain-gradients per second against NumPyro.

    Args:
        model: a ``PyroModule`` following the model protocol (``docs/protocol.md``).
        data: training split; ``data.y`` required.
        kernel: the kernel's settings (``NUTS``, ``HMC``, ``ChEES``, ``MCLMC`` ...), each
            validated on construction. The string form (``kernel="chees"`` with the settings
            as keyword arguments: ``init``, ``num_starts``, ``target_accept_prob``,
            ``max_tree_depth``, ``step_size``, ``trajectory_length``, ``full_mass``,
            ``jit_compile``, ``compile``, ``temperature``) still works for one release and
            warns (``DeprecationWarning``).
        num_chains: chains K (>= 1; R-hat needs >= 2; nested R-hat >= 2 starts).
        num_warmup: adaptation transitions per chain, discarded (>= 0; MCLMC: tuning
            integrator steps, ``max(30, num_warmup)`` of them). Below the kernel's
            ``min_warmup`` (50 for the adaptive HMC kernels) it warns.
        num_samples: kept draws per chain (>= 1).
        starts: where the many-chain kernels' chains start (None: ``PriorStarts()``, one prior
            draw per chain); NUTS/HMC take none.
        map_steps: MAP steps for the point-estimate parameters and of MAP/ensemble starts.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` ...; CPU data is moved there (a given
            ensemble's chains run on its device).
        seed: seeds initialisation, MAP and sampling; same seed, same draws on one machine.
        progress: show a progress bar (Pyro's per chain for NUTS/HMC).
        distributed: shard the K chains of a many-chain kernel over the ranks of the
            initialised ``torch.distributed`` process group (``torchrun``; gloo on CPU, NCCL on
            GPUs). Every rank calls ``fit_mcmc`` with the same model, data and settings; each
            evaluates the log density of its contiguous share of the chains, and the values
            and gradients are all-gathered in chain order, so the adaptation (step size,
            trajectory length, mass matrix) reduces the same numbers in chain order on every
            rank, and every rank returns the one ``Posterior`` of K chains that one process
            gives (the same draws). Starts and point estimates are rank 0's. Only rank 0
            shows progress. ``num_chains`` must be at least the world size.

    Returns:
        A ``Posterior`` holding ``samples = {site: (chain, draw, *shape)}`` (local latents
        ``(chain, draw, N, *per_row)``, with ``record["training_data_sha256"]``); ``record``
        holds the kernel's settings (``kernel``: its name), ``seconds``, ``sample_stats``
        (``diverging``, ``acceptance_rate``, ``step_size``, ``tree_depth``, ``n_steps``,
        ``energy``, ``lp`` per chain and draw; ArviZ's names; ChEES has no ``tree_depth``,
        MCLMC no ``acceptance_rate`` or ``energy`` but ``energy_error``) and ``partial``.
        Many-chain kernels add ``superchain`` (each chain's start), ``num_starts``, ``init``,
        ``chain_gradients``, the adapted settings and
        ``start_seconds``/``warmup_seconds``/``sampling_seconds``.

    Raises:
        TypeError/ValueError: bad model, data or settings; a kernel or starts that are not
            settings objects; starts for NUTS/HMC; data on a device other than ``device``;
            initial parameters with a non-finite log density (names the site); more than
            ``MAX_LOCAL_SEQUENCES`` sequences for a model with local latents; a model with
            ``hard_attention=True`` (its log density is piecewise constant in the query and key
            weights, so HMC's gradient is wrong: fit it with ``fit_svi`` or ``fit_map``); latent
            sites the Posterior could not keep (before sampling; see ``check_sampled_sites``);
            K not a multiple of M; kept draws over ``starts.MAX_DRAW_BYTES`` (with the
            estimate); a model whose K-chain log density differs from single-chain evaluations
            (names the site); a non-finite initial log density (names the chain and site);
            ``distributed=True`` without a process group, with NUTS/HMC, with fewer chains
            than ranks, or on ranks with different data, model or settings (naming the rank).
        distributed.RankLostError: a peer rank died or stopped answering in time (naming it).
    """
    if deprecated and kernel is DEFAULT_KERNEL:  # fit_mcmc(..., max_tree_depth=6): NUTS's
        kernel = DEFAULT_KERNEL.name
    if isinstance(kernel, str):
        kernel, legacy_starts = from_strings(kernel, **deprecated)
        starts = legacy_starts if starts is None else starts
    elif deprecated:
        raise TypeError(
            f"fit_mcmc() got unexpected keyword arguments {sorted(deprecated)}: with a kernel "
            f"object the settings are the kernel's ({type(kernel).__name__}(...)) and the "
            "starts' (starts=EnsembleStarts(num_starts=...))"
        )
    with together(joined(distributed), "fit_mcmc's argument checks"):
        check_model(model)
        _refuse_hard_attention(model)
        check_training_data(model, data)
        many = _check_kernel(kernel, starts)
        if many and starts is None:
            starts = PriorStarts()
        check_int("num_chains", num_chains, type_error=True)
        check_int("num_samples", num_samples, type_error=True)
        check_int("num_warmup", num_warmup, minimum=0, type_error=True)
        check_int("map_steps", map_steps, minimum=0, type_error=True)
        if many:
            starts.count(num_chains)  # K % M, before any fit
        if many and starts.fits_map and map_steps == 0:
            raise ValueError(
                f"init={starts.name!r} needs MAP fits ({type(starts).__name__}): give "
                "map_steps > 0, got 0"
            )
        if 0 < num_warmup < kernel.min_warmup:
            warnings.warn(
                f"num_warmup={num_warmup} is short for adapting the step size and mass matrix "
                f"(Stan's default is 1000; use >= {kernel.min_warmup}): chains may stick; run "
                "diagnose",
                UserWarning,
                stacklevel=2,
            )
        fitted = getattr(starts, "ensemble", None)
        if fitted is not None:
            _check_ensemble_model(fitted, model)
            device = fitted.device  # the chains continue its fits
        device = resolve_device(device)
        parallel = sharding(distributed, many, num_chains, device)
        if parallel is not None and not parallel.is_main:
            progress = False
        if data.x.device.type != "cpu" and data.x.device != device:
            raise ValueError(
                f"data is on {data.x.device} but device={str(device)!r} was requested: move the "
                "data to the CPU (or to that device) first"
            )

    start = time.perf_counter()
    if fitted is not None:
        model = copy.deepcopy(fitted.model).to(device)
    else:
        model = reinitialised_copy(model, seed, device)
    settings = dict(
        **kernel.record(),
        num_chains=num_chains,
        num_warmup=num_warmup,
        num_samples=num_samples,
        **(starts.record(num_chains) if many else {}),
    )
    if parallel is not None:
        check_same_fit(parallel, model, data, {**settings, "map_steps": map_steps, "seed": seed})
    example = example_of(data).to(device)
    with pyro_scope(), seeded(seed, device):  # fail fast, before any MAP fit
        _, *sampled = check_initial_density(model, (example.x, example.y, example.mask))
    kept = latent_sites(model, example)  # what the Posterior accepts: checked before sampling
    check_sampled_sites(*sampled, *kept, len(example))
    if not many:  # the many-chain kernels check their draws and working state themselves
        dim = sum(math.prod(s) for s in kept[0].values())
        dim += len(data) * sum(math.prod(s) for s in kept[1].values())
        need = draw_bytes(num_chains, num_samples, dim)
        if need > MAX_DRAW_BYTES:
            raise ValueError(
                f"{num_chains} chains x {num_samples} draws x {dim} latent scalars would keep "
                f"{need / 2**30:.1f} GiB of draws (limit {MAX_DRAW_BYTES / 2**30:.2g} GiB): use "
                "fewer chains or draws"
            )
    if has_local_latents(model) and many:
        raise ValueError(
            f"{type(kernel).__name__} samples a fixed-size state, but stochastic attention draws "
            "one latent per attention logit of every sequence: use kernel=NUTS() (at most "
            f"{MAX_LOCAL_SEQUENCES} sequences) or fit_svi"
        )
    if has_local_latents(model) and len(data) > MAX_LOCAL_SEQUENCES:
        raise ValueError(
            f"stochastic attention under MCMC samples one latent per attention logit of every "
            f"sequence; it is supported for at most {MAX_LOCAL_SEQUENCES} short sequences, got "
            f"{len(data)}: subsample the data, or fit it with fit_svi (amortized guide)"
        )
    point_estimates = None
    if not (many and starts.fits_map):  # MAP and ensemble starts fit them per start
        point_estimates = _fit_point_estimates(model, data, map_steps, device, seed, progress)
    if point_estimates is not None:
        model = point_estimates.pop("model")
    model.eval()  # dropout off: HMC needs a deterministic density
    train = data.to(device)
    if many:
        samples, members, stats, extra = run_many_chains(
            model, train, kernel=kernel, starts=starts, num_chains=num_chains,
            num_warmup=num_warmup, num_samples=num_samples, map_steps=map_steps, seed=seed,
            progress=progress, parallel=parallel,
        )  # fmt: skip
        extra["parallel"] = False
        if parallel is not None:
            extra["world_size"] = parallel.world_size
        point_estimates = extra.pop("point_estimates")
    else:
        members = None
        samples, stats, extra = run_pyro_kernel(
            model, train, kept, kernel, num_chains=num_chains, num_warmup=num_warmup,
            num_samples=num_samples, seed=seed, progress=progress,
        )  # fmt: skip
        samples = {k: v for k, v in samples.items() if k not in _local_sites(model, example)}
        if not samples:
            raise KeyboardInterrupt("fit_mcmc was interrupted before the first draw was kept")
    record = {
        "method": "mcmc",
        "temperature": 1.0,  # the Pyro kernels sample the Bayesian posterior
        **settings,
        "seed": seed,
        "num_data": len(train),
        "x_range": [float(train.x.min()), float(train.x.max())],
        "point_estimates": point_estimates,
        **extra,
        "seconds": time.perf_counter() - start,
        "sample_stats": stats,
    }
    if kept[1]:  # local latents kept: a pass over exactly these rows is conditioned on them
        record["training_data_sha256"] = rows_digest(train.x, train.y, train.mask)
    return Posterior(
        model, samples=samples, members=members, record=record, example=example_of(train)
    )


def sharding(distributed: object, many: bool, num_chains: int, device) -> DataParallel | None:
    """The process group the chains are sharded over (``distributed=True``), checked."""
    if not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True or False, got {described(distributed)}")
    if not distributed:
        return None
    if not many:
        raise ValueError(
            "distributed=True shards the chains of the many-chain kernels (ChEES, MCLMC ...); "
            "NUTS and HMC run Pyro's chains, as processes of one machine"
        )
    parallel = data_parallel(device)
    if num_chains < parallel.world_size:
        raise ValueError(
            f"num_chains must be at least the world size {parallel.world_size} (every rank "
            f"evaluates a share of the chains), got {num_chains}"
        )
    return parallel


def _check_kernel(kernel: object, starts: object) -> bool:
    """Whether ``kernel`` runs many chains through the draw dim (``starts`` checked with it).

    Raises:
        TypeError: a kernel or starts that are not settings objects.
        ValueError: starts for a Pyro kernel.
    """
    if not isinstance(kernel, Kernel):
        raise TypeError(
            "kernel must be a kernel settings object (NUTS(), HMC(), ChEES(), MCLMC() ...), got "
            f"{described(kernel)}"
        )
    many = isinstance(kernel, ManyChainKernel)
    if starts is not None and not isinstance(starts, Starts):
        raise TypeError(
            "starts must be PriorStarts(...), MAPStarts() or EnsembleStarts(...), got "
            f"{described(starts)}"
        )
    if starts is not None and not many:
        raise ValueError(
            f"starts apply to the many-chain kernels; {type(kernel).__name__} starts each "
            "chain from a uniform draw in (-2, 2) of the unconstrained space: leave starts out"
        )
    return many


def _check_ensemble_model(ensemble: Posterior, model: torch.nn.Module) -> None:
    """Refuse an ensemble fitted for another model class or config."""
    theirs = ensemble.model
    if type(theirs) is not type(model) or theirs.config != model.config:
        raise ValueError(
            f"the starts' ensemble was fitted for another model ({type(theirs).__name__} with "
            f"config {theirs.config}); got {type(model).__name__} with config {model.config}"
        )


def _local_sites(model, example) -> set[str]:
    """Names of the local latent sites and of their non-centred ``_decentered`` versions."""
    if not has_local_latents(model):
        return set()
    with pyro_scope(), torch.no_grad(), poutine.block():
        trace = poutine.trace(model).get_trace(example.x, example.y, example.mask)
    names = {name for name, site in trace.nodes.items() if site.get("infer", {}).get(LOCAL_LATENT)}
    return names | {f"{name}_decentered" for name in names}


def _fit_point_estimates(model, data, map_steps, device, seed, progress) -> dict | None:
    """MAP-fit the model's plain parameters (the non-Bayesian parts); None when it has none."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    if not names:
        return None
    if map_steps == 0:
        raise ValueError(
            f"the model has point-estimate parameters ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}) and map_steps=0: HMC would leave them at "
            "their random initialisation; give map_steps > 0 or make every part Bayesian"
        )
    fitted = fit_svi(
        model,
        data,
        guide="delta",
        num_steps=map_steps,
        device=device,
        seed=seed,
        progress=progress,
    )
    elbo = fitted.record["elbo"]
    return dict(
        model=fitted.model,
        method="map",
        parameters=names,
        num_steps=map_steps,
        final_log_joint=float(sum(elbo[-10:]) / len(elbo[-10:])),
    )


__all__ = ["fit_mcmc"]
