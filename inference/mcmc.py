"""Hamiltonian Monte Carlo (HMC, NUTS) on Pyro's kernels, with per-draw sampler statistics."""

from __future__ import annotations

import math
import time
import warnings

import pyro
import torch
from pyro import poutine
from pyro.infer.autoguide.initialization import InitMessenger, init_to_uniform
from pyro.infer.mcmc import HMC, MCMC, NUTS
from pyro.infer.reparam import LocScaleReparam

from probtransformer.attention import LOCAL_LATENT, BayesMultiheadAttention
from probtransformer.datasets import SequenceData
from probtransformer.inference._pyro_compat import (
    ChainRecorder,
    MomentumHook,
    TreeHook,
    doubling_summary,
    initialize_model,
    kinetic_energy,
    mean_accept_prob,
    num_divergences,
    num_transitions,
    num_warmup_transitions,
    potential_energy,
    runs_in_worker_processes,
    stop_workers,
)
from probtransformer.inference._runtime import (
    pyro_scope,
    reinitialised_copy,
    resolve_device,
    seeded,
)
from probtransformer.inference.guides import has_local_latents
from probtransformer.inference.inputs import (
    check_model,
    check_training_data,
    example_of,
    rows_digest,
)
from probtransformer.inference.model_checks import check_sampled_sites, latent_sites
from probtransformer.inference.posterior import Posterior
from probtransformer.inference.svi import fit_svi
from probtransformer.validation import check_int

#: Kernels accepted by ``fit_mcmc(kernel=...)``.
KERNELS = ("nuts", "hmc")

#: Warm-up lengths below this get a warning: adaptation has too few windows to settle.
MIN_WARMUP = 50

#: Most sequences ``fit_mcmc`` accepts for a model with local latents (stochastic attention).
MAX_LOCAL_SEQUENCES = 50

#: Per-draw statistics under ArviZ's ``sample_stats`` names.
SAMPLE_STATS = (
    "diverging",
    "acceptance_rate",
    "step_size",
    "tree_depth",
    "n_steps",
    "energy",
    "lp",
)


class _SampleStats(MomentumHook):
    """Mixin for Pyro's ``HMC``/``NUTS`` that records one set of statistics per kept draw.

    Pyro keeps the energy, tree depth and per-transition acceptance probability in locals of
    ``sample``; they are recovered here from the kernel's hooks (``on_momentum`` at the start of
    each transition, ``on_doubling`` at every top-level doubling; see ``_pyro_compat``) and
    returned by ``diagnostics()`` under ``"sample_stats"``, which Pyro sends back from worker
    processes too.

    ``energy`` is the Hamiltonian at the start of the transition (after the momentum refresh),
    the quantity E-BFMI is defined on (Betancourt 2016); ``lp`` is minus the potential energy of
    the kept draw (log density in the unconstrained space, Jacobians included, as Stan's lp__).
    """

    def setup(self, warmup_steps, *args, **kwargs):
        self.draw_stats: list[dict] = []
        super().setup(warmup_steps, *args, **kwargs)

    def on_momentum(self, r_unscaled: dict) -> None:
        energy = potential_energy(self)
        if energy is not None:
            self.transition_energy = float(kinetic_energy(self, r_unscaled) + energy)

    def sample(self, params):
        previous_mean = mean_accept_prob(self)
        divergences = num_divergences(self)
        step_size = float(self.step_size)
        self.transition_energy = math.nan
        self.transition_trees: list = []
        z = super().sample(params)
        t, warmup = num_transitions(self), num_warmup_transitions(self)
        n = t - warmup if t > warmup else t
        # Pyro keeps a running mean of the acceptance probability; invert one update of it.
        accept = mean_accept_prob(self) * n - previous_mean * (n - 1)
        energy = potential_energy(self)
        if self.transition_trees:  # NUTS: the doubling loop's tree_depth and leapfrog count
            depth, n_steps = doubling_summary(self.transition_trees)
        else:  # HMC: a fixed trajectory
            depth, n_steps = 0, int(self.num_steps)
        if t > warmup:
            self.draw_stats.append(
                dict(
                    diverging=num_divergences(self) > divergences,
                    acceptance_rate=min(max(accept, 0.0), 1.0),
                    step_size=step_size,
                    tree_depth=depth,
                    n_steps=n_steps,
                    energy=self.transition_energy,
                    lp=-float(energy) if energy is not None else math.nan,
                )
            )
        return z

    def diagnostics(self):
        return {**super().diagnostics(), "sample_stats": _columns(self.draw_stats)}


def _columns(draw_stats: list[dict]) -> dict[str, list]:
    return {k: [d[k] for d in draw_stats] for k in SAMPLE_STATS}


class RecordingHMC(_SampleStats, HMC):
    """Pyro's ``HMC`` that also reports per-draw ``sample_stats`` (see ``_SampleStats``)."""


class RecordingNUTS(_SampleStats, TreeHook, NUTS):
    """Pyro's ``NUTS`` that also reports per-draw ``sample_stats`` (see ``_SampleStats``)."""

    def on_doubling(self, tree) -> None:
        self.transition_trees.append(tree)


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
    target_accept_prob: float = 0.8,
    max_tree_depth: int = 10,
    step_size: float = 1.0,
    trajectory_length: float = 2 * math.pi,
    full_mass: bool = False,
    jit_compile: bool = False,
    map_steps: int = 1000,
    device: str | torch.device = "auto",
    seed: int = 0,
    progress: bool = True,
) -> Posterior:
    """Sample the posterior of ``model`` given ``data`` by HMC or NUTS (Pyro's kernels).

    NUTS (Hoffman & Gelman 2014) with multinomial sampling and Stan-style windowed adaptation of
    the step size (dual averaging to ``target_accept_prob``) and of a diagonal (or, with
    ``full_mass``, dense) mass matrix during ``num_warmup``; HMC (Neal 2011) integrates for a fixed
    ``trajectory_length`` per transition. Chains start from
    independent uniform draws in (-2, 2) of the unconstrained space (Stan's default). They run
    in parallel processes when the machine has more than ``num_chains`` cores (Pyro keeps one for
    the main process) and one after another otherwise; CUDA chains use a ``spawn`` context.

    The model runs in eval mode (dropout off: the target density must be deterministic) on the
    full data set. Its point-estimate parameters (plain ``nn.Parameter``s, the parts that are not
    Bayesian) are first fitted by MAP (``fit_svi(guide="delta")`` for ``map_steps`` steps), then
    held fixed while sampling; ``record["point_estimates"]`` says which and how. Ctrl-C stops
    sampling and returns the draws so far as a Posterior with ``record["partial"] = True``
    (chains cut to a common length; chains in worker processes lose their per-draw statistics).

    Local latents of a user's model (sampled inside ``pyro.plate("data")``, one value per row,
    e.g. the school effects of eight schools) are kept: ``samples[site]`` is
    ``(chain, draw, N, *per_row)``; a pass over exactly the training data (``log_likelihood``,
    ``to_inference_data``) is conditioned on them, other inputs draw them from the model. The
    sites the sampler will return are checked against those the Posterior keeps before the
    first transition. Stochastic attention's local latents (``priors.StochasticAttentionPrior``:
    one latent per attention logit of every sequence) are sampled jointly with the weights,
    non-centred (``LocScaleReparam``), and only for small data: at most
    ``MAX_LOCAL_SEQUENCES`` (50) short sequences. Their draws are not kept; predictions for any
    inputs draw them from their contextual prior given each weight draw.

    Cost: one gradient of the full-data log density per leapfrog step, up to
    ``2**max_tree_depth - 1`` steps per NUTS transition; neural-network posteriors ask for long
    trajectories, so keep models and data small. Small models run fastest on one torch thread
    (``torch.set_num_threads(1)``; worker processes keep torch's default). ``jit_compile``
    saved about a third of the time per gradient on the small classifier.

    Args:
        model: a ``PyroModule`` following the model protocol (``docs/protocol.md``).
        data: training split; ``data.y`` required.
        kernel: ``"nuts"`` or ``"hmc"``.
        num_chains: independent chains (>= 1; R-hat needs >= 2).
        num_warmup: adaptation transitions per chain, discarded (>= 0).
        num_samples: kept draws per chain (>= 1).
        target_accept_prob: step-size adaptation target in (0, 1).
        max_tree_depth: NUTS doublings per transition at most.
        step_size: initial step size (adapted during warmup).
        trajectory_length: HMC integration time per transition; the leapfrog steps are
            ``trajectory_length / step_size`` and change as the step size adapts.
        full_mass: adapt a dense mass matrix instead of a diagonal one.
        jit_compile: trace the potential energy with the PyTorch JIT.
        map_steps: MAP steps for the point-estimate parameters (unused when there are none).
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` ...; CPU data is moved there.
        seed: seeds initialisation, MAP and sampling; same seed, same draws on one machine.
        progress: show Pyro's progress bar per chain.

    Returns:
        A ``Posterior`` holding ``samples = {site: (chain, draw, *shape)}`` (local latents
        ``(chain, draw, N, *per_row)``, with ``record["training_data_sha256"]``); ``record``
        holds the settings, ``seconds``, ``sample_stats`` (``diverging``, ``acceptance_rate``,
        ``step_size``, ``tree_depth``, ``n_steps``, ``energy``, ``lp`` per chain and draw;
        ArviZ's names) and ``partial``.

    Raises:
        TypeError/ValueError: bad model, data or settings; data on a device other than
            ``device``; initial parameters with a non-finite log density (names the site); more
            than ``MAX_LOCAL_SEQUENCES`` sequences for a model with local latents; a model with
            ``hard_attention=True`` (its log density is piecewise constant in the query and key
            weights, so HMC's gradient is wrong: fit it with ``fit_svi`` or ``fit_map``); latent
            sites the Posterior could not keep (before sampling; see ``check_sampled_sites``).
    """
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
    if not (isinstance(trajectory_length, (int, float)) and 0 < trajectory_length < math.inf):
        raise ValueError(
            f"trajectory_length must be a finite number > 0, got {trajectory_length!r}"
        )
    if not (isinstance(target_accept_prob, float) and 0 < target_accept_prob < 1):
        raise ValueError(
            f"target_accept_prob must be a float in (0, 1), got {target_accept_prob!r}"
        )
    if not isinstance(full_mass, bool):
        raise TypeError(f"full_mass must be a bool, got {type(full_mass).__name__}")
    if 0 < num_warmup < MIN_WARMUP:
        warnings.warn(
            f"num_warmup={num_warmup} is short for adapting the step size and mass matrix "
            f"(Stan's default is 1000; use >= {MIN_WARMUP}): chains may stick; run diagnose",
            UserWarning,
            stacklevel=2,
        )
    if not (isinstance(step_size, (int, float)) and math.isfinite(step_size) and step_size > 0):
        raise ValueError(f"step_size must be a finite number > 0, got {step_size!r}")
    device = resolve_device(device)
    if data.x.device.type != "cpu" and data.x.device != device:
        raise ValueError(
            f"data is on {data.x.device} but device={str(device)!r} was requested: move the data "
            "to the CPU (or to that device) first"
        )

    start = time.perf_counter()
    model = reinitialised_copy(model, seed, device)
    example = example_of(data).to(device)
    with pyro_scope(), seeded(seed, device):  # fail fast, before any MAP fit
        _, *sampled = _check_initial_density(model, (example.x, example.y, example.mask))
    kept = latent_sites(model, example)  # what the Posterior accepts: checked before sampling
    check_sampled_sites(*sampled, *kept, len(example))
    if has_local_latents(model) and len(data) > MAX_LOCAL_SEQUENCES:
        raise ValueError(
            f"stochastic attention under MCMC samples one latent per attention logit of every "
            f"sequence; it is supported for at most {MAX_LOCAL_SEQUENCES} short sequences, got "
            f"{len(data)}: subsample the data, or fit it with fit_svi (amortized guide)"
        )
    point_estimates = _fit_point_estimates(model, data, map_steps, device, seed, progress)
    if point_estimates is not None:
        model = point_estimates.pop("model")
    model.eval()  # dropout off: HMC needs a deterministic density
    train = data.to(device)
    args = (train.x, train.y, train.mask)
    density = _non_centred(model)

    with pyro_scope(), seeded(seed, device):
        transforms, *sampled = _check_initial_density(density, args)
        check_sampled_sites(*sampled, *kept, len(train))  # uses no random numbers
        common = dict(
            step_size=step_size,
            adapt_step_size=True,
            adapt_mass_matrix=True,
            full_mass=full_mass,
            target_accept_prob=target_accept_prob,
            jit_compile=jit_compile,
            ignore_jit_warnings=True,
            init_strategy=init_to_uniform,
        )
        if kernel == "nuts":
            sampler = RecordingNUTS(density, max_tree_depth=max_tree_depth, **common)
        else:
            sampler = RecordingHMC(density, trajectory_length=trajectory_length, **common)
        partial = False
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="num_chains=.*Chains will be drawn")
            mcmc = MCMC(
                sampler,
                num_samples=num_samples,
                warmup_steps=num_warmup,
                num_chains=num_chains,
                mp_context="spawn" if device.type == "cuda" else None,
                disable_progbar=not progress,
            )
            received = ChainRecorder(mcmc)
            try:
                mcmc.run(*args)
            except KeyboardInterrupt:
                partial = True
                stop_workers(mcmc)
    samples, stats = _collect(received, sampler, transforms)
    # stochastic attention's per-logit draws are not part of the Posterior
    local = _local_sites(model, example)
    samples = {k: v for k, v in samples.items() if k not in local}
    if not samples:
        raise KeyboardInterrupt("fit_mcmc was interrupted before the first draw was kept")
    record = dict(
        method="mcmc",
        kernel=kernel,
        num_chains=num_chains,
        num_warmup=num_warmup,
        num_samples=num_samples,
        target_accept_prob=target_accept_prob,
        max_tree_depth=max_tree_depth if kernel == "nuts" else None,
        trajectory_length=trajectory_length if kernel == "hmc" else None,
        full_mass=full_mass,
        jit_compile=jit_compile,
        parallel=runs_in_worker_processes(mcmc),
        seed=seed,
        num_data=len(train),
        x_range=[float(train.x.min()), float(train.x.max())],
        point_estimates=point_estimates,
        partial=partial,
        seconds=time.perf_counter() - start,
        sample_stats=stats,
    )
    if kept[1]:  # local latents kept: a pass over exactly these rows is conditioned on them
        record["training_data_sha256"] = rows_digest(train.x, train.y, train.mask)
    return Posterior(model, samples=samples, record=record, example=example_of(train))


def _non_centred(model):
    """``model`` with its local latents (stochastic attention) sampled non-centred,
    ``z = loc + scale · ε`` with ``ε ~ N(0, 1)`` (``LocScaleReparam``): the centred form gives HMC
    a funnel between the noise scales and the logits (Betancourt & Girolami 2015)."""
    if not has_local_latents(model):
        return model
    return poutine.reparam(
        model, config=lambda msg: LocScaleReparam(0.0) if msg["infer"].get(LOCAL_LATENT) else None
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


def _check_initial_density(model, args) -> tuple[dict, dict, poutine.Trace]:
    """``(transforms, initial, trace)``: the unconstrained-space transforms of the model's
    latents, their initial unconstrained values (the sites the sampler returns) and Pyro's
    prototype trace. Raises when the model has no latents, or naming the site when uniform
    initial values give a non-finite log density (Pyro itself only says it gave up)."""
    try:
        initial, _, transforms, trace = initialize_model(
            model, model_args=args, init_strategy=init_to_uniform
        )
    except (RuntimeError, ValueError) as e:
        site = _first_non_finite_site(model, args)
        if site is None:
            raise
        raise ValueError(
            f"the model's log density is not finite at its initial parameters: site {site!r}; "
            "check its prior and likelihood parameters (and the data) for NaN/inf"
        ) from e
    if not initial:
        raise ValueError(
            f"{type(model).__name__} has no latent sample sites: there is nothing for HMC to "
            "sample; make some parts Bayesian, or fit a point estimate with "
            "fit_svi(guide='delta')"
        )
    return transforms, initial, trace


def _first_non_finite_site(model, args) -> str | None:
    with torch.no_grad(), pyro.validation_enabled(False):
        trace = poutine.trace(InitMessenger(init_to_uniform)(model)).get_trace(*args)
        for name, site in trace.nodes.items():
            if site["type"] != "sample":
                continue
            value = site["value"]
            log_prob = site["fn"].log_prob(value)
            if not (torch.isfinite(value).all() and torch.isfinite(log_prob).all()):
                return name
    return None


def _collect(received: ChainRecorder, kernel, transforms) -> tuple[dict, dict]:
    """``({site: (chain, draw, ...)}, sample_stats)`` of what the chains sent, constrained;
    chains cut to a common length."""
    chains = sorted(c for c, draws in received.draws.items() if draws)
    if not chains or received.structure is None:
        return {}, {}
    length = min(len(received.draws[c]) for c in chains)
    samples = received.unflatten(chains, length)
    for name, value in samples.items():
        if name in transforms:
            samples[name] = transforms[name].inv(value)
    per_chain = []
    for c in chains:
        if c in received.diagnostics:
            per_chain.append(received.diagnostics[c]["sample_stats"])
        elif len(getattr(kernel, "draw_stats", ())) >= length:  # interrupted, in-process
            per_chain.append(_columns(kernel.draw_stats))
        else:
            per_chain = None  # interrupted in a worker process: its statistics are lost
            break
    stats = {}
    if per_chain is not None:
        stats = {k: [chain[k][:length] for chain in per_chain] for k in SAMPLE_STATS}
    return samples, stats


__all__ = ["KERNELS", "RecordingHMC", "RecordingNUTS", "SAMPLE_STATS", "fit_mcmc"]
