"""MCMC: HMC and NUTS on Pyro's kernels, and many-chain ChEES-HMC and MCLMC through the draw dim.

``fit_mcmc`` is the one entry point. ``kernel="nuts"``/``"hmc"`` run Pyro's kernels (chains as
processes or one after another) with per-draw sampler statistics; ``kernel="chees"``/
``"mclmc"`` run K chains together as the model's draw dim (``inference.mcmc.density``,
``inference.mcmc.chees``, ``inference.mcmc.starts``).
"""

from __future__ import annotations

import math
import time
import warnings

import torch
from pyro import poutine

from probtransformer.attention import LOCAL_LATENT, BayesMultiheadAttention
from probtransformer.datasets import SequenceData
from probtransformer.inference._runtime import (
    pyro_scope,
    reinitialised_copy,
    resolve_device,
    seeded,
)
from probtransformer.inference.distributed import check_same_fit, joined, together
from probtransformer.inference.inputs import (
    check_model,
    check_training_data,
    example_of,
    rows_digest,
)
from probtransformer.inference.mcmc.chees import CHEES_TARGET_ACCEPT
from probtransformer.inference.mcmc.compiled import check_compile
from probtransformer.inference.mcmc.pyro_runner import check_initial_density, run_pyro_kernel
from probtransformer.inference.mcmc.settings import (
    DEFAULT_MAX_TREE_DEPTH,
    KERNELS,
    MANY_CHAIN_KERNELS,
    check_kernel_settings,
    check_starts,
    check_temperature,
    sharding,
)
from probtransformer.inference.mcmc.starts import MAX_DRAW_BYTES, draw_bytes, run_many_chains
from probtransformer.inference.model_checks import check_sampled_sites, latent_sites
from probtransformer.inference.posterior.posterior import Posterior
from probtransformer.inference.vi.guides import has_local_latents
from probtransformer.inference.vi.svi import fit_svi
from probtransformer.validation import check_int

#: Warm-up lengths below this get a warning: adaptation has too few windows to settle.
MIN_WARMUP = 50

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
    kernel: str = "nuts",
    num_chains: int = 4,
    num_warmup: int = 200,
    num_samples: int = 200,
    init: str = "prior",
    num_starts: int | None = None,
    target_accept_prob: float | None = None,
    max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH,
    step_size: float | None = None,
    trajectory_length: float | None = None,
    full_mass: bool = False,
    jit_compile: bool = False,
    compile: bool | None = None,
    temperature: float = 1.0,
    map_steps: int = 1000,
    device: str | torch.device = "auto",
    seed: int = 0,
    progress: bool = True,
    distributed: bool = False,
) -> Posterior:
    """Sample the posterior of ``model`` given ``data`` by NUTS, HMC, ChEES-HMC or MCLMC.

    ``"nuts"`` (the default) and ``"hmc"`` run Pyro's kernels. NUTS (Hoffman & Gelman 2014) with
    multinomial sampling and Stan-style windowed adaptation of the step size (dual averaging to
    ``target_accept_prob``, default 0.8) and of a diagonal (or, with ``full_mass``, dense) mass
    matrix during ``num_warmup``; HMC (Neal 2011) integrates for a fixed ``trajectory_length``
    (default 2π) per transition. Chains start from independent uniform draws in (-2, 2) of the
    unconstrained space (Stan's default). They run in parallel processes when the machine has
    more than ``num_chains`` cores (Pyro keeps one for the main process) and one after another
    otherwise; CUDA chains use a ``spawn`` context.

    ``"chees"`` and ``"mclmc"`` run the K chains together as the model's draw dim: each
    leapfrog step is one vectorized gradient of all chains (``inference.mcmc.density``), so on a
    GPU K chains cost about one. Before sampling, the K-chain log density is checked against
    single-chain evaluations site by site. Chains start from ``num_starts`` points (``init``:
    ``"prior"`` draws, one ``"map"`` fit, or an ``"ensemble"`` of MAP fits run as one batched
    optimisation; ``inference.mcmc.starts``), K / M chains per start (a *superchain*,
    ``record["superchain"]``).

    - ``"chees"``: ChEES-HMC (Hoffman, Radul & Sountsov 2021), Metropolis-adjusted per chain
      (exact): a jittered trajectory length adapted by the ChEES criterion, the step size by
      dual averaging on the harmonic-mean acceptance (``target_accept_prob``, default 0.651),
      a diagonal mass matrix from the moments pooled over chains (``inference.mcmc.chees.ChEES``).
    - ``"mclmc"``: microcanonical Langevin Monte Carlo (Robnik et al. 2023) with BlackJAX's
      tuning as MILE runs it (Sommer et al. 2025) in ``num_warmup`` integrator steps; each kept
      draw is about one decoherence length ``L`` of steps. It is **unadjusted** (no
      accept/reject): its draws carry a step-size bias. On the analytic linear regression the
      benchmark measured it in standard errors (``benchmarks/BENCHMARKS.md``, "Many-chain
      samplers"); ``record["energy_error_var_per_dim"]`` holds each run's energy-error
      variance per dimension (tuned towards 5e-4; much larger values mean more bias), and a
      step whose energy error passes 1000 nats (kept: there is no rejection) counts as a
      divergent transition. With ``"ensemble"`` starts each start's chains are tuned on
      their own (``inference.mcmc.mile`` runs MILE's recipe from a deep ensemble).

    The model runs in eval mode (dropout off: the target density must be deterministic) on the
    full data set. Its point-estimate parameters (plain ``nn.Parameter``s, the parts that are not
    Bayesian) are first fitted by MAP (``fit_svi(guide="delta")`` for ``map_steps`` steps), then
    held fixed, shared by every chain, while sampling. Exception: the many-chain kernels with
    ``"map"`` or ``"ensemble"`` starts fit them in each start's MAP fit (from the model
    re-initialised with ``seed + m`` for start ``m``), and every chain keeps its start's values
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
        kernel: ``"nuts"``, ``"hmc"``, ``"chees"`` or ``"mclmc"``.
        num_chains: chains K (>= 1; R-hat needs >= 2; nested R-hat >= 2 starts).
        num_warmup: adaptation transitions per chain, discarded (>= 0; MCLMC: tuning
            integrator steps, ``max(30, num_warmup)`` of them).
        num_samples: kept draws per chain (>= 1).
        init: ``"prior"``, ``"map"`` or ``"ensemble"`` (many-chain kernels only; NUTS/HMC
            start from uniform draws).
        num_starts: M starting points, K % M == 0 (many-chain kernels only); None: one per
            chain for ``"prior"`` and ``"ensemble"``, 1 for ``"map"``.
        target_accept_prob: step-size adaptation target in (0, 1); None: 0.8 for NUTS/HMC,
            0.651 (of the harmonic mean over chains) for ChEES.
        max_tree_depth: NUTS doublings per transition at most.
        step_size: initial step size (adapted during warmup); None: 1.0 for NUTS/HMC, 0.1 for
            ChEES (then searched).
        trajectory_length: HMC integration time per transition (the leapfrog steps are
            ``trajectory_length / step_size`` and change as the step size adapts; None: 2π);
            ChEES's initial trajectory length (None: 10 steps).
        full_mass: adapt a dense mass matrix instead of a diagonal one (NUTS, HMC, ChEES;
            ChEES: at most ``metric.MAX_DENSE_DIM`` unconstrained scalars).
        jit_compile: trace the potential energy with the PyTorch JIT (NUTS, HMC).
        compile: ChEES, MCLMC: evaluate the K-chain log density and its gradient as one
            ``torch.compile``d graph traced from the model (``inference.mcmc.compiled``; CUDA
            graphs on a GPU), checked against the eager pass; True: always, False: never,
            None: for the MAP starts and the sampling each where their gradients would take
            at least ``compiled.PAYBACK_SECONDS`` (120 s) eager and the compiled gradient
            then times faster than eager. A model that does not trace or compile runs eager
            with a warning. ``record["density_path"]`` says which ran,
            ``record["compile_seconds"]`` what compiling took.
        temperature: ChEES, MCLMC: ``T > 0``; the likelihood enters as ``p(y | θ)^(1 / T)``
            (a tempered posterior; ``record["temperature"]``, shown by ``diagnose``). 1, the
            default, is the Bayesian posterior.
        map_steps: MAP steps for the point-estimate parameters (unused when there are none).
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` ...; CPU data is moved there.
        seed: seeds initialisation, MAP and sampling; same seed, same draws on one machine.
        progress: show a progress bar (Pyro's per chain for NUTS/HMC).
        distributed: shard the K chains of ``"chees"``/``"mclmc"`` over the ranks of the
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
        holds the settings, ``seconds``, ``sample_stats`` (``diverging``, ``acceptance_rate``,
        ``step_size``, ``tree_depth``, ``n_steps``, ``energy``, ``lp`` per chain and draw;
        ArviZ's names; ChEES has no ``tree_depth``, MCLMC no ``acceptance_rate`` or
        ``energy`` but ``energy_error``) and ``partial``. Many-chain kernels add ``superchain``
        (each chain's start), ``num_starts``, ``init``, ``chain_gradients``, the adapted
        settings and ``start_seconds``/``warmup_seconds``/``sampling_seconds``.

    Raises:
        TypeError/ValueError: bad model, data or settings; data on a device other than
            ``device``; initial parameters with a non-finite log density (names the site); more
            than ``MAX_LOCAL_SEQUENCES`` sequences for a model with local latents; a model with
            ``hard_attention=True`` (its log density is piecewise constant in the query and key
            weights, so HMC's gradient is wrong: fit it with ``fit_svi`` or ``fit_map``); latent
            sites the Posterior could not keep (before sampling; see ``check_sampled_sites``);
            K not a multiple of M; kept draws over ``many_chains.MAX_DRAW_BYTES`` (with the
            estimate); a model whose K-chain log density differs from single-chain evaluations
            (names the site); a non-finite initial log density (names the chain and site);
            ``distributed=True`` without a process group, with NUTS/HMC, with fewer chains
            than ranks, or on ranks with different data, model or settings (naming the rank).
        distributed.RankLostError: a peer rank died or stopped answering in time (naming it).
    """
    with together(joined(distributed), "fit_mcmc's argument checks"):
        check_model(model)
        _refuse_hard_attention(model)
        check_training_data(model, data)
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        check_int("num_chains", num_chains, type_error=True)
        check_int("num_samples", num_samples, type_error=True)
        check_int("max_tree_depth", max_tree_depth, type_error=True)
        if isinstance(num_warmup, bool) or not isinstance(num_warmup, int) or num_warmup < 0:
            raise ValueError(f"num_warmup must be an integer >= 0, got {num_warmup!r}")
        if isinstance(map_steps, bool) or not isinstance(map_steps, int) or map_steps < 0:
            raise ValueError(f"map_steps must be an integer >= 0, got {map_steps!r}")
        many = kernel in MANY_CHAIN_KERNELS
        check_kernel_settings(
            kernel,
            target_accept_prob=target_accept_prob is not None,
            max_tree_depth=max_tree_depth != DEFAULT_MAX_TREE_DEPTH,
            trajectory_length=trajectory_length is not None,
            jit_compile=jit_compile,
            compile=compile is not None,
            full_mass=full_mass,
            temperature=temperature != 1,
        )
        check_compile(compile)
        check_temperature(temperature)
        if trajectory_length is None and kernel == "hmc":
            trajectory_length = 2 * math.pi
        if target_accept_prob is None:
            target_accept_prob = CHEES_TARGET_ACCEPT if kernel == "chees" else 0.8
        if step_size is None:
            step_size = 0.1 if many else 1.0
        if trajectory_length is not None and not (
            isinstance(trajectory_length, (int, float)) and 0 < trajectory_length < math.inf
        ):
            raise ValueError(
                f"trajectory_length must be a finite number > 0, got {trajectory_length!r}"
            )
        if not (isinstance(target_accept_prob, float) and 0 < target_accept_prob < 1):
            raise ValueError(
                f"target_accept_prob must be a float in (0, 1), got {target_accept_prob!r}"
            )
        if num_starts is None:
            num_starts = 1 if (init == "map" or not many) else num_chains
        check_starts(kernel, init, num_starts, num_chains)
        if many and init in ("map", "ensemble") and map_steps == 0:
            raise ValueError(f"init={init!r} needs MAP fits: give map_steps > 0, got 0")
        if not isinstance(full_mass, bool):
            raise TypeError(f"full_mass must be a Python bool, got {full_mass!r}")  # np.True_ too
        if 0 < num_warmup < MIN_WARMUP and kernel != "mclmc":
            warnings.warn(
                f"num_warmup={num_warmup} is short for adapting the step size and mass matrix "
                f"(Stan's default is 1000; use >= {MIN_WARMUP}): chains may stick; run diagnose",
                UserWarning,
                stacklevel=2,
            )
        if not (isinstance(step_size, (int, float)) and math.isfinite(step_size) and step_size > 0):
            raise ValueError(f"step_size must be a finite number > 0, got {step_size!r}")
        device = resolve_device(device)
        parallel = sharding(distributed, kernel, num_chains, device)
        if parallel is not None and not parallel.is_main:
            progress = False
        if data.x.device.type != "cpu" and data.x.device != device:
            raise ValueError(
                f"data is on {data.x.device} but device={str(device)!r} was requested: move the "
                "data to the CPU (or to that device) first"
            )

    start = time.perf_counter()
    model = reinitialised_copy(model, seed, device)
    if parallel is not None:
        check_same_fit(
            parallel,
            model,
            data,
            dict(
                kernel=kernel,
                num_chains=num_chains,
                num_warmup=num_warmup,
                num_samples=num_samples,
                init=init,
                num_starts=num_starts,
                target_accept_prob=target_accept_prob,
                step_size=step_size,
                trajectory_length=trajectory_length,
                map_steps=map_steps,
                seed=seed,
            ),
        )
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
            f"kernel={kernel!r} samples a fixed-size state, but stochastic attention draws one "
            "latent per attention logit of every sequence: use kernel='nuts' (at most "
            f"{MAX_LOCAL_SEQUENCES} sequences) or fit_svi"
        )
    if has_local_latents(model) and len(data) > MAX_LOCAL_SEQUENCES:
        raise ValueError(
            f"stochastic attention under MCMC samples one latent per attention logit of every "
            f"sequence; it is supported for at most {MAX_LOCAL_SEQUENCES} short sequences, got "
            f"{len(data)}: subsample the data, or fit it with fit_svi (amortized guide)"
        )
    per_start = many and init in ("map", "ensemble")  # the MAP starts fit them per start
    point_estimates = None
    if not per_start:
        point_estimates = _fit_point_estimates(model, data, map_steps, device, seed, progress)
    if point_estimates is not None:
        model = point_estimates.pop("model")
    model.eval()  # dropout off: HMC needs a deterministic density
    train = data.to(device)
    settings = dict(
        kernel=kernel,
        num_chains=num_chains,
        num_warmup=num_warmup,
        num_samples=num_samples,
        target_accept_prob=target_accept_prob if kernel != "mclmc" else None,
        max_tree_depth=max_tree_depth if kernel == "nuts" else None,
        trajectory_length=trajectory_length if kernel in ("hmc", "chees") else None,
        full_mass=full_mass,
        jit_compile=jit_compile,
        compile=compile,
        temperature=temperature,
    )
    if many:
        samples, members, stats, extra = run_many_chains(
            model,
            train,
            kernel=kernel,
            num_chains=num_chains,
            num_starts=num_starts,
            init=init,
            num_warmup=num_warmup,
            num_samples=num_samples,
            step_size=step_size,
            trajectory_length=trajectory_length,
            target_accept_prob=target_accept_prob,
            map_steps=map_steps,
            seed=seed,
            progress=progress,
            parallel=parallel,
            full_mass=full_mass,
            compile=compile,
            temperature=temperature,
        )
        extra["parallel"] = False
        if parallel is not None:
            extra["world_size"] = parallel.world_size
        point_estimates = extra.pop("point_estimates")
    else:
        members = None
        samples, stats, extra = run_pyro_kernel(
            model, train, kept, settings, step_size, seed, progress
        )
        samples = {k: v for k, v in samples.items() if k not in _local_sites(model, example)}
        if not samples:
            raise KeyboardInterrupt("fit_mcmc was interrupted before the first draw was kept")
    record = dict(
        method="mcmc",
        **settings,
        seed=seed,
        num_data=len(train),
        x_range=[float(train.x.min()), float(train.x.max())],
        point_estimates=point_estimates,
        **extra,
        seconds=time.perf_counter() - start,
        sample_stats=stats,
    )
    if kept[1]:  # local latents kept: a pass over exactly these rows is conditioned on them
        record["training_data_sha256"] = rows_digest(train.x, train.y, train.mask)
    return Posterior(
        model, samples=samples, members=members, record=record, example=example_of(train)
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


__all__ = ["KERNELS", "MANY_CHAIN_KERNELS", "fit_mcmc"]
