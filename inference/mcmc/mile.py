"""MILE: a deep ensemble, then sampling around each member (Sommer et al., "Microcanonical
Langevin Ensembles: Advancing the Sampling of Bayesian Neural Networks", ICLR 2025).

``fit_mile`` fits (or takes) a batched deep ensemble and starts chains from each member: the
member's latent values are the chains' starting state, its point-estimate parameters stay with
its chains, and every member's chains are tuned on their own (``chain_sampling``, per start).
The kernel is MILE's unadjusted MCLMC with its warm-up (``mclmc.MILE_TUNING``), or ChEES-HMC,
Metropolis-adjusted, as the exact alternative. The chains of different members sit in different
modes and are not expected to mix: ``diagnose`` judges each member's chains on their own and
reports the spread between the modes apart (``inference.diagnostics.modes``).
"""

from __future__ import annotations

import copy
import time

import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference._runtime import seeded
from probtransformer.inference.ensembles.baselines import fit_ensemble
from probtransformer.inference.inputs import check_model, check_training_data, example_of
from probtransformer.inference.mcmc.chees import CHEES_TARGET_ACCEPT
from probtransformer.inference.mcmc.compiled import CompiledPass, check_compile
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.many_chain_runner import KernelSettings, sample_chains
from probtransformer.inference.mcmc.mclmc import MILE_TUNING, Tuning
from probtransformer.inference.mcmc.settings import check_temperature
from probtransformer.inference.mcmc.starts import check_memory
from probtransformer.inference.posterior.posterior import Posterior
from probtransformer.validation import check_int

#: The kernels ``fit_mile`` runs per member.
MILE_KERNELS = ("mclmc", "chees")


def fit_mile(
    model: torch.nn.Module,
    data: SequenceData,
    *,
    n_members: int = 8,
    chains_per_member: int = 2,
    ensemble: Posterior | None = None,
    kernel: str = "mclmc",
    num_warmup: int = 1000,
    num_samples: int = 100,
    thinning: int = 10,
    tuning: Tuning = MILE_TUNING,
    temperature: float = 1.0,
    compile: bool | None = None,
    device: str | torch.device = "auto",
    seed: int = 0,
    progress: bool = True,
    **ensemble_options,
) -> Posterior:
    """Sample around every member of a deep ensemble: MILE (Sommer et al. 2025).

    1. A deep ensemble of ``n_members`` MAP fits (``fit_ensemble``, batched, seeds ``seed``
       ... ``seed + n_members - 1``, with ``ensemble_options``), or the ensemble given.
    2. ``chains_per_member`` chains start from each member's latent values; each chain keeps
       its member's point-estimate parameters (``posterior.members``). The model runs in eval
       mode (dropout off: the target density is deterministic).
    3. Each member's chains are tuned on their own, ``num_warmup`` steps: MCLMC with MILE's
       warm-up (``tuning``: a target energy-error variance per dimension decaying 0.5 -> 0.1
       over phases of 0.8 / 0.1 / 0.1, a non-finite step rejected and the step size capped at
       0.8 of it), or ChEES (``kernel="chees"``: Metropolis-adjusted, exact; ``num_warmup``
       transitions).
    4. ``num_samples`` draws are kept per chain, one every ``thinning`` integrator steps
       (MCLMC; MILE keeps 1,000 of 10,000 steps); ChEES keeps every transition.

    MCLMC is unadjusted: its draws carry a step-size bias that MILE's large energy-error
    target accepts for speed (``record["energy_error_var_per_dim_by_start"]``; ``diagnose``
    flags a variance above 10x the target). The chains of one member explore one mode; modes
    are not expected to mix, so the posterior is an equally weighted mixture of the members'
    local posteriors, and ``diagnose`` checks convergence within each member.

    Args:
        model: a ``PyroModule`` following the model protocol (its latent parts are sampled, its
            plain parameters are each member's MAP values). With ``ensemble`` it must have the
            ensemble model's class and ``config``.
        data: training split; ``data.y`` required.
        n_members: ensemble members M (MILE: 8-12); ignored with ``ensemble``.
        chains_per_member: chains per member (>= 2 gives within-member R-hat from separate
            chains; 1 is MILE's, judged by split R-hat).
        ensemble: a ``fit_ensemble`` posterior of this model and data to start from, instead
            of fitting one (its fit seconds are counted in ``record["ensemble_seconds"]``).
        kernel: ``"mclmc"`` (MILE) or ``"chees"``.
        num_warmup: MCLMC tuning steps (>= 30) or ChEES warm-up transitions per chain.
        num_samples: kept draws per chain (>= 1).
        thinning: MCLMC integrator steps per kept draw (>= 1).
        tuning: MCLMC's ``mclmc.Tuning`` (MILE's by default; ``mclmc.BLACKJAX_TUNING`` for a
            small energy error).
        temperature: ``T > 0``; the likelihood enters as ``p(y | θ)^(1 / T)``. 1 (the default)
            samples the Bayesian posterior; any other value is recorded and shown by
            ``diagnose``.
        compile: evaluate the log density compiled (``fit_mcmc``'s rule: True, False or None).
        device: where the ensemble is fitted (``"auto"``, ``"cpu"``, ``"cuda"`` ...); the
            chains run where the ensemble lives.
        seed: seeds the ensemble and the chains.
        progress: show progress bars.
        **ensemble_options: ``fit_ensemble``'s settings (``num_steps``, ``batch_size``,
            ``lr``, ``lr_decay`` ...).

    Returns:
        A ``Posterior`` with ``samples {site: (chain, draw, *shape)}`` (chain ``k`` from member
        ``k // chains_per_member``) and ``members`` (each chain's point estimates);
        ``record``: ``method="mcmc"``, ``route="mile"``, ``init="ensemble"``, ``superchain``
        (each chain's member), the ensemble's record and seconds, every setting, the tuned step
        size and L per member, the energy-error variance per dimension per member (MCLMC),
        ``sample_stats``, ``temperature`` and ``seconds`` (ensemble included).

    Raises:
        TypeError/ValueError: bad model, data or settings (named); an ``ensemble`` that is not
            a ``fit_ensemble`` posterior of this model; a model that does not vectorize over
            chains (names the site); a non-finite initial log density.
        KeyboardInterrupt: Ctrl-C before the first kept draw (after it, the draws so far are
            returned with ``record["partial"] = True``).
    """
    check_model(model)
    check_training_data(model, data)
    if kernel not in MILE_KERNELS:
        raise ValueError(f"kernel must be one of {MILE_KERNELS}, got {kernel!r}")
    check_int("n_members", n_members, type_error=True)
    check_int("chains_per_member", chains_per_member, type_error=True)
    check_int("num_samples", num_samples, type_error=True)
    check_int("thinning", thinning, type_error=True)
    check_int("num_warmup", num_warmup, minimum=0, type_error=True)
    if kernel == "mclmc" and num_warmup < 30:
        raise ValueError(f"MCLMC tunes in num_warmup >= 30 steps, got {num_warmup}")
    if kernel == "chees" and chains_per_member < 2:
        raise ValueError(
            "kernel='chees' adapts each member's trajectory length from the spread of its "
            f"chains: chains_per_member must be >= 2, got {chains_per_member}"
        )
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning must be an mclmc.Tuning, got {type(tuning).__name__}")
    check_temperature(temperature)
    check_compile(compile)
    start = time.perf_counter()
    if ensemble is None:
        ensemble = fit_ensemble(
            model, data, n_members=n_members, batched=True, device=device, seed=seed,
            progress=progress, **ensemble_options,
        )  # fmt: skip
    elif ensemble_options:
        raise TypeError(
            f"fit_mile got ensemble= and ensemble options {sorted(ensemble_options)}: the "
            "ensemble is already fitted; leave them out"
        )
    _check_ensemble(ensemble, model)
    n_members = next(iter(ensemble.samples.values())).shape[1]
    device = ensemble.device  # the ensemble's: the chains continue its fits
    model = copy.deepcopy(ensemble.model).eval()
    train = data.to(device)
    per_chain = {
        name: value[0].to(device).repeat_interleave(chains_per_member, 0)[:, None]
        for name, value in (ensemble.members or {}).items()
    }  # (K, 1, *shape), member k // chains_per_member's
    density = VectorizedDensity(
        model, train.x, train.y, train.mask, parameters=per_chain or None, temperature=temperature
    )
    values = {s.name: ensemble.samples[s.name][0].to(device) for s in density.sites}  # (M, ...)
    z0 = density.unconstrain(values).repeat_interleave(chains_per_member, 0)  # (K, D)
    num_chains = len(z0)
    check_memory(density, num_chains, num_samples, per_chain_parameters=True)
    with seeded(seed, device):
        density.check(z0)  # K-chain values must equal single-chain ones, by site
    superchain = [k // chains_per_member for k in range(num_chains)]
    settings = KernelSettings(
        kernel=kernel,
        num_warmup=num_warmup,
        num_samples=num_samples,
        tuning=tuning,
        thinning=thinning if kernel == "mclmc" else None,
        per_start=True,
    )
    samples, stats, record = sample_chains(
        density, z0, superchain, settings, seed=seed, progress=progress,
        compiled=CompiledPass(density, progress=progress), compile=compile, start_time=start,
    )  # fmt: skip
    chains, draws = next(iter(samples.values())).shape[:2]
    kept = {
        name: value[:, 0, None].expand(chains, draws, *value.shape[2:]).cpu()
        for name, value in per_chain.items()
    } or None
    record = dict(
        method="mcmc",
        route="mile",
        kernel=kernel,
        init="ensemble",
        num_starts=n_members,
        n_members=n_members,
        chains_per_member=chains_per_member,
        num_chains=num_chains,
        num_warmup=num_warmup,
        num_samples=num_samples,
        tuning=dict(
            desired_energy_var=list(tuning.desired_energy_var),
            phases=list(tuning.phases),
            diagonal_preconditioning=tuning.diagonal_preconditioning,
            trust_in_estimate=tuning.trust_in_estimate,
            num_effective_samples=tuning.num_effective_samples,
        ),
        target_accept_prob=CHEES_TARGET_ACCEPT if kernel == "chees" else None,
        temperature=temperature,
        compile=compile,
        seed=seed,
        num_data=len(train),
        x_range=[float(train.x.min()), float(train.x.max())],
        ensemble={k: v for k, v in ensemble.record.items() if k != "members"},
        ensemble_seconds=ensemble.record["seconds"],
        point_estimates=per_chain
        and dict(method="ensemble member, per chain", parameters=list(per_chain), per_chain=True),
        **record,
        seconds=time.perf_counter() - start,
        sample_stats=stats,
    )
    return Posterior(model, samples=samples, members=kept, record=record, example=example_of(train))


def _check_ensemble(ensemble: Posterior, model: torch.nn.Module) -> None:
    """Refuse a posterior that is not a deep ensemble of ``model``'s class and config."""
    if not isinstance(ensemble, Posterior) or ensemble.record.get("method") != "ensemble":
        raise ValueError(
            "ensemble must be a fit_ensemble posterior (record['method'] == 'ensemble'), got "
            f"{ensemble.record.get('method') if isinstance(ensemble, Posterior) else ensemble!r}"
        )
    theirs = ensemble.model
    if type(theirs) is not type(model) or theirs.config != model.config:
        raise ValueError(
            f"ensemble was fitted for another model ({type(theirs).__name__} with config "
            f"{theirs.config}); fit_mile got {type(model).__name__} with config {model.config}"
        )


__all__ = ["MILE_KERNELS", "fit_mile"]
