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

import time
from dataclasses import fields

import torch

from probtransformer.data import SequenceData
from probtransformer.inference.ensembles.baselines import fit_ensemble
from probtransformer.inference.inputs import check_model, check_training_data
from probtransformer.inference.mcmc.driver import fit_mcmc
from probtransformer.inference.mcmc.kernel import ManyChainKernel
from probtransformer.inference.mcmc.mclmc import MILE_TUNING, Tuning
from probtransformer.inference.mcmc.registry import MANY_CHAIN_KERNELS, kernel_class
from probtransformer.inference.mcmc.starts import EnsembleStarts
from probtransformer.inference.posterior.posterior import Posterior
from probtransformer.validation import check_int


def fit_mile(
    model: torch.nn.Module,
    data: SequenceData,
    *,
    n_members: int = 8,
    chains_per_member: int = 2,
    ensemble: Posterior | None = None,
    kernel: str | ManyChainKernel = "mclmc",
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
    """Sample around every member of a deep ensemble: MILE (Sommer et al. 2025), as
    ``fit_mcmc(kernel=MCLMC(tuning=MILE_TUNING, thinning=thinning),
    starts=EnsembleStarts(ensemble=fit_ensemble(...)))``.

    A batched deep ensemble of ``n_members`` MAP fits (seeds ``seed`` ... ``seed + n_members -
    1``, ``ensemble_options``), or the ``ensemble`` given; ``chains_per_member`` chains start
    from each member's latent values and keep its point-estimate parameters
    (``posterior.members``); each member's chains are tuned on their own in ``num_warmup``
    steps, MILE's warm-up by default (an energy-error target decaying 0.5 -> 0.1 per dimension,
    a non-finite step rejected and the step size capped at 0.8 of it), then ``num_samples``
    draws are kept, one every ``thinning`` integrator steps. MCLMC is unadjusted: MILE's large
    energy-error target buys speed with a step-size bias that ``diagnose`` flags above 10x the
    target; ``kernel="chees"`` or ``"adjusted-mclmc"`` are Metropolis-adjusted (exact). Modes
    are not expected to mix: the posterior is an equally weighted mixture of the members'
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
        kernel: a many-chain kernel's name (``"mclmc"``, MILE's; ``"chees"`` ...) built with
            ``tuning``, ``thinning``, ``temperature`` and ``compile`` where it reads them, or
            its settings object (then those four are its own).
        num_warmup: warm-up steps per chain (MCLMC: tuning integrator steps, >= 30).
        num_samples: kept draws per chain (>= 1).
        thinning: MCLMC integrator steps per kept draw (>= 1).
        tuning: MCLMC's ``Tuning`` (MILE's; ``BLACKJAX_TUNING`` for a small energy error).
        temperature: ``T > 0``; the likelihood enters as ``p(y | θ)^(1 / T)`` (1: Bayesian).
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
        size and L per member, ``sample_stats`` and ``seconds`` (ensemble included).

    Raises:
        TypeError/ValueError: bad model, data or settings (named); an ``ensemble`` that is not
            a ``fit_ensemble`` posterior of this model; a model that does not vectorize over
            chains (names the site); a non-finite initial log density.
        KeyboardInterrupt: Ctrl-C before the first kept draw (after it, the draws so far are
            returned with ``record["partial"] = True``).
    """
    check_model(model)
    check_training_data(model, data)
    check_int("n_members", n_members, type_error=True)
    check_int("chains_per_member", chains_per_member, type_error=True)
    kernel = _kernel(kernel, tuning, thinning, temperature, compile)
    check_int("num_warmup", num_warmup, minimum=0, type_error=True)
    if kernel.warmup_steps(num_warmup) != num_warmup:
        raise ValueError(
            f"{type(kernel).__name__} warms up in num_warmup >= {kernel.warmup_steps(0)} steps, "
            f"got {num_warmup}"
        )
    if chains_per_member < kernel.min_chains_per_start:
        raise ValueError(
            f"{type(kernel).__name__} tunes each member's chains from their spread: "
            f"chains_per_member must be >= {kernel.min_chains_per_start}, got {chains_per_member}"
        )
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
    starts = EnsembleStarts(ensemble=ensemble)
    posterior = fit_mcmc(
        model, data, kernel=kernel, starts=starts,
        num_chains=starts.num_starts * chains_per_member, num_warmup=num_warmup,
        num_samples=num_samples, seed=seed, progress=progress,
    )  # fmt: skip
    posterior.record.update(
        route="mile",
        n_members=starts.num_starts,
        chains_per_member=chains_per_member,
        seconds=time.perf_counter() - start,
    )
    return posterior


def _kernel(kernel, tuning, thinning, temperature, compile) -> ManyChainKernel:
    """``fit_mile``'s kernel: the object given (its own settings: the four others must be left
    at their defaults), or the named many-chain kernel built with those it reads."""
    if isinstance(kernel, ManyChainKernel):
        given = dict(tuning=tuning is not MILE_TUNING, thinning=thinning != 10,
                     temperature=temperature != 1.0, compile=compile is not None)  # fmt: skip
        if any(given.values()):
            raise TypeError(
                f"fit_mile got kernel={type(kernel).__name__}(...) and "
                f"{[k for k, v in given.items() if v]}: with a kernel object these are its own "
                "settings; give them to it"
            )
    else:
        if kernel not in MANY_CHAIN_KERNELS:
            raise ValueError(f"kernel must be one of {MANY_CHAIN_KERNELS}, got {kernel!r}")
        cls, local = kernel_class(kernel), dict(tuning=tuning, thinning=thinning)
        own = {f.name: local[f.name] for f in fields(cls) if f.name in local}
        kernel = cls(**own, temperature=temperature, compile=compile)
    return kernel


__all__ = ["fit_mile"]
