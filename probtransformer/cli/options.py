"""Which ``fit`` options belong to which inference method, the library functions whose defaults
unset options take, and the MCMC preset."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

INFERENCES = ("svi", "map", "mcmc", "mc-dropout", "ensemble")
#: None: the guide is --guide's (or fit_svi's); the baselines are MAP fits (AutoDelta)
INFERENCE_GUIDES = {"svi": None, "map": "delta", "mc-dropout": "delta", "ensemble": "delta"}
SVI_OPTIONS = ("guide", "num_steps", "batch_size", "lr")  # fit_svi settings: all but mcmc
CHECKPOINT_OPTIONS = ("checkpoint_every", "checkpoint_dir", "resume_from")  # svi and map only
ENSEMBLE_OPTIONS = ("n_members",)  # fit_ensemble settings: ensemble only
#: The MAP-based fits of ``probtransformer.inference.baselines``, by --inference.
MAP_FITS = {"map": "fit_map", "mc-dropout": "fit_mc_dropout", "ensemble": "fit_ensemble"}
MCMC_OPTIONS = (  # fit_mcmc settings: mcmc only
    "kernel",
    "num_chains",
    "num_warmup",
    "num_draws",
    "target_accept_prob",
    "max_tree_depth",
    "trajectory_length",
    "jit_compile",
)
KERNEL_OPTIONS = {"max_tree_depth": "nuts", "trajectory_length": "hmc"}  # kernel-specific
#: CLI options named differently from the library parameter they set: (source, parameter).
LIBRARY_NAMES = {"num_draws": ("mcmc", "num_samples")}
#: How unset options that are not library parameters read in --help.
UNSET_HELP = {"num_train": "all", "threads": "torch's"}
UNSET_MCMC_HELP = {"num_samples": "every kept draw"}


def mcmc_preset() -> dict[str, Any]:
    """What ``fit --inference mcmc`` uses for the options left unset.

    NUTS pays one gradient of the full-data log density per leapfrog step, several milliseconds
    even for a tiny Transformer, and this posterior asks for long trajectories (about 500
    leapfrog steps per transition at the library's ``max_tree_depth`` 10, measured). The library
    defaults (a d_model-64 model on all 1,212 training digits, 4 chains of 200 + 200
    transitions) would run for many hours. This preset fits the fully Bayesian d_model-8
    classifier (780 latent scalars) on 200 digits with 2 chains of 100 + 100 transitions of at
    most 2**6 - 1 leapfrog steps, the log density JIT-traced (about 1.5x faster) on one CPU
    thread (two threads on such small operations ran 2.5x slower): about 3 to 4 minutes on 2
    CPU cores. HMC integrates for ``trajectory_length`` 0.5 instead of 2π: about 50 leapfrog
    steps at the step size adapted here (~0.01), where 2π would take ~600 per transition.
    """
    from probtransformer.block import BAYESIAN_PARTS

    return dict(
        d_model=8,
        num_heads=2,
        num_layers=1,
        d_ff=16,
        dropout=0.0,  # HMC evaluates the model in eval mode anyway
        bayesian=BAYESIAN_PARTS,  # every part latent: no MAP stage for point estimates
        num_train=200,
        num_chains=2,  # the fewest for R-hat
        num_warmup=100,
        num_draws=100,
        max_tree_depth=6,
        trajectory_length=0.5,
        jit_compile=True,
        threads=1,
    )


def library_functions() -> dict[str, Callable[..., Any]]:
    """The library callables whose defaults unset options take (imported on demand)."""
    from probtransformer.inference import Posterior, fit_ensemble, fit_mcmc, fit_svi
    from probtransformer.models import SequenceClassifier, generate

    return {
        "model": SequenceClassifier.__init__,  # every task's model has the same defaults
        "fit": fit_svi,
        "mcmc": fit_mcmc,
        "ensemble": fit_ensemble,
        "predict": Posterior.predict,
        "diagnose": Posterior.diagnose,
        "generate": generate,
    }


def library_default(source: str, parameter: str) -> Any:
    """The default of ``parameter`` of the library function ``source`` (``library_functions``)."""
    return inspect.signature(library_functions()[source]).parameters[parameter].default
