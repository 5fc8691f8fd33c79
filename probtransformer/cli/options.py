"""Which ``fit`` options belong to which inference method (and the check that the given ones
apply), the library functions whose defaults unset options take, and the presets that fill the
unset ones."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from probtransformer.cli._common import CLIError
from probtransformer.cli.library_defaults import (
    KERNEL_DEFAULTS,
    LAPLACE_CHOICES,
    MANY_CHAIN_KERNELS,
    START_NAMES,
)
from probtransformer.methods import LAPLACE_BASED, MAP_BASED, METHODS

INFERENCES = tuple(METHODS)
#: None: the guide is --guide's (or fit_svi's); the baselines (and the ensembles of MILE and
#: MoLA, and the mode of laplace) are MAP fits (AutoDelta)
INFERENCE_GUIDES = {
    "svi": None, "map": "delta", "mc-dropout": "delta", "ensemble": "delta", "mile": "delta",
    "laplace": "delta", "mola": "delta",
}  # fmt: skip
#: The methods that read the SVI options (every one but mcmc), as error messages name them.
SVI_METHODS = "svi, map, mc-dropout, ensemble, mile, laplace and mola"
#: fit_svi settings: every inference method but mcmc
SVI_OPTIONS = ("guide", "num_steps", "batch_size", "lr", "lr_decay", "lr_warmup", "lr_schedule")
#: ``fit_svi``'s learning-rate schedules (``inference.vi.schedule.LR_SCHEDULES``; named here so
#: ``--help`` imports no torch).
LR_SCHEDULES = ("exponential", "cosine")
CHECKPOINT_OPTIONS = ("checkpoint_every", "checkpoint_dir", "resume_from")  # svi and map only
GUIDE_OPTIONS = ("init_scale",)  # the guide's settings: svi only (MAP's AutoDelta has none)
ENSEMBLE_OPTIONS = ("n_members",)  # fit_ensemble settings: ensemble, mile and mola
#: The methods that fit an ensemble of MAP members and read ``ENSEMBLE_OPTIONS``.
ENSEMBLE_METHODS = ("ensemble", "mile", "mola")
#: fit_laplace's own settings: laplace and mola only (``--laplace-subset`` sets ``subset``)
LAPLACE_OPTIONS = ("laplace_subset", "hessian", "prior_precision", "predictive")
#: The choices of ``--laplace-subset``, ``--hessian`` and ``--predictive``
#: (``inference.laplace.fit``'s, through the generated ``library_defaults``: no torch).
LAPLACE_SUBSETS = LAPLACE_CHOICES["subset"]
HESSIANS = LAPLACE_CHOICES["hessian"]
PREDICTIVES = LAPLACE_CHOICES["predictive"]
#: fit_mile's own settings: mile only
MILE_OPTIONS = ("chains_per_member", "thinning")
#: The MCMC options that --inference mile takes too (for the sampling around each member)
MILE_MCMC_OPTIONS = ("kernel", "num_warmup", "num_draws", "compile", "temperature")
#: The inference methods that ``torchrun`` runs data-parallel: those built on ``fit_svi`` (and
#: mcmc with a many-chain kernel, its chains sharded).
DISTRIBUTED_INFERENCE = ("svi", "map", "mc-dropout")
#: The MAP-based fits of ``probtransformer.inference.ensembles.baselines``, by --inference.
MAP_FITS = {name: METHODS[name] for name in MAP_BASED}
#: The Laplace fits of ``probtransformer.inference.laplace``, by --inference.
LAPLACE_FITS = {name: METHODS[name] for name in LAPLACE_BASED}
#: ``fit_mcmc``'s kernels (``inference.mcmc.registry.KERNELS``, through the generated
#: ``library_defaults`` so that ``--help`` imports no torch).
KERNELS = tuple(KERNEL_DEFAULTS)
#: The kernels fit_mile runs: the many-chain ones.
MILE_KERNELS = MANY_CHAIN_KERNELS
#: ``--init``: where the many-chain kernels start (``inference.mcmc.registry.STARTS``).
INITS = START_NAMES
MCMC_OPTIONS = (  # fit_mcmc settings: mcmc only
    "kernel",
    "num_chains",
    "num_starts",
    "init",
    "num_warmup",
    "num_draws",
    "target_accept_prob",
    "max_tree_depth",
    "trajectory_length",
    "jit_compile",
    "compile",
    "temperature",
    "map_steps",
)
#: The MCMC options that apply to some kernels only: the kernels they apply to (the starts'
#: to the many-chain kernels, a kernel setting to the kernels whose settings object has it).
KERNEL_OPTIONS = {
    "num_starts": MANY_CHAIN_KERNELS,
    "init": MANY_CHAIN_KERNELS,
    **{
        option: tuple(k for k, settings in KERNEL_DEFAULTS.items() if option in settings)
        for option in MCMC_OPTIONS
        if any(option in settings for settings in KERNEL_DEFAULTS.values())
    },
}
#: CLI options named differently from the library parameter they set: (source, parameter).
LIBRARY_NAMES = {"num_draws": ("mcmc", "num_samples"), "laplace_subset": ("laplace", "subset")}
#: How unset options that are not library parameters read in --help.
UNSET_HELP = {
    "num_train": "all",
    "threads": "1, or one per idle core for large models and batches (cli.threads)",
}
UNSET_MCMC_HELP = {"num_samples": "every kept draw"}
#: How MCMC options whose kernel default is None (chosen while sampling) read in --help.
UNSET_KERNEL_HELP = {
    "trajectory_length": "10 leapfrog steps",  # ChEES's initial one, then adapted
    "compile": "where it repays",
}


def applies(dest: str, kernel: str) -> bool:
    """Whether the MCMC option ``dest`` applies to ``kernel`` (``KERNEL_OPTIONS``)."""
    return kernel in KERNEL_OPTIONS.get(dest, KERNELS)


def kernel_default(dest: str, kernel: str) -> str | None:
    """What the kernel setting ``dest`` of ``kernel`` is when unset, as --help shows it (None:
    not a kernel setting)."""
    value = KERNEL_DEFAULTS[kernel].get(dest)
    return UNSET_KERNEL_HELP.get(dest, value) if value == "None" else value


def mcmc_preset(kernel: str = "chees") -> dict[str, Any]:
    """What ``fit --inference mcmc --kernel KERNEL`` uses for the options left unset.

    Every kernel fits the classifier of the quality benchmark (``benchmarks/quality.py``,
    ``MODEL``: d_model 32, 4 heads, 1 layer, d_ff 64), every part Bayesian (9,230 latent
    scalars on digits; no MAP stage for point estimates), without dropout (MCMC evaluates the
    model in eval mode anyway), on the full training split (1,212 digits), on one CPU thread.
    Only the settings that apply to ``kernel`` are returned (``KERNEL_OPTIONS``).

    ``"chees"`` (the default; ChEES-HMC, Hoffman, Radul & Sountsov 2021): 4 chains from 2
    ``"ensemble"`` starts (MAP fits; 2 superchains of 2 chains, the fewest for nested R-hat),
    50 warm-up + 25 kept transitions per chain (100 draws). Measured on this machine (2 CPU
    cores shared with other work, load average about 3): ``time probtransformer fit --inference
    mcmc`` took 481 s wall, of which the fit 432 s (MAP starts 28 s, warm-up 331 s, sampling
    73 s; 6,460 chain-gradients, about 63 ms each) and the rest loading, predictions and the
    run directory. ChEES took about 27 leapfrog steps per warm-up transition (step-size
    searches included; the step size is small until the mass matrix adapts) and 11 per kept
    transition. Test accuracy 0.976, NLL 0.132 nats, ECE 0.065, 0 divergences; the ``diagnose``
    verdict WARNs (max weight-space R-hat 4.6, min bulk ESS 6; R-hat of ``lp`` 3.3, nested
    R-hat 1.18): chains from different MAP modes do not mix in 75 transitions, and with fewer
    than ``diagnostics.MANY_CHAINS`` chains the verdict reads weight-space R-hat. More chains
    did not fit 10 minutes: 8 chains (4 starts) of 50 + 25 transitions took 898 s to fit, 16
    chains of 30 + 5 took 739 s; the cost grows about linearly in chains x leapfrog steps.
    ``"mclmc"`` takes the same counts (each kept draw is about one decoherence length of
    integrator steps, at most 256; not timed at these sizes).

    ``"nuts"``/``"hmc"`` (Pyro's kernels, one chain after another on 2 cores): 2 chains (the
    fewest for R-hat) of 50 + 50 transitions, NUTS with at most 2**6 - 1 leapfrog steps per
    transition, HMC integrating for ``trajectory_length`` 0.5 instead of 2π, the log density
    JIT-traced. A 12-transition NUTS pilot hit the depth cap on every transition at about 40 ms
    per gradient, so 200 transitions take about 200 x 63 x 40 ms, 8.5 minutes, plus the
    predictions.

    Args:
        kernel: one of ``KERNELS``.

    Returns:
        ``{option: value}`` under the ``fit`` options' ``dest`` names.

    Raises:
        ValueError: ``kernel`` is not one of ``KERNELS``.
    """
    from probtransformer.cli.library_defaults import BAYESIAN_PARTS  # block's, without torch

    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    preset: dict[str, Any] = dict(
        d_model=32,
        num_heads=4,
        num_layers=1,
        d_ff=64,
        dropout=0.0,  # MCMC evaluates the model in eval mode anyway
        bayesian=BAYESIAN_PARTS,  # every part latent: no MAP stage for point estimates
        kernel=kernel,
        threads=1,  # 2 shared cores: two threads ran 2.5x slower on the d_model-8 model
    )
    if kernel in MANY_CHAIN_KERNELS:
        preset.update(num_chains=4, num_starts=2, init="ensemble", num_warmup=50, num_draws=25)
    else:
        preset.update(
            num_chains=2,  # the fewest for R-hat
            num_warmup=50,
            num_draws=50,
            max_tree_depth=6,
            trajectory_length=0.5,
            jit_compile=True,
        )
    return {dest: value for dest, value in preset.items() if applies(dest, kernel)}


def mile_preset() -> dict[str, Any]:
    """What ``fit --inference mile`` uses for the options left unset: the quality benchmark's
    ``mile`` row (``benchmarks/quality.py``).

    The classifier of the quality benchmark (d_model 32, 4 heads, 1 layer, d_ff 64, dropout
    0.1 while the ensemble trains; attention and head latent, the library default), a batched
    ensemble of 5 members trained as the benchmark trains it (1,000 Adam steps of 128 rows at
    lr 1e-2 decaying to 1e-3), then one MCLMC chain per member, MILE's warm-up in 2,000
    steps, 100 draws kept one every 10 steps, on one CPU thread.

    Returns:
        ``{option: value}`` under the ``fit`` options' ``dest`` names.
    """
    return dict(
        d_model=32,
        num_heads=4,
        num_layers=1,
        d_ff=64,
        dropout=0.1,
        num_steps=1000,
        batch_size=128,
        lr=1e-2,
        lr_decay=0.1,
        n_members=5,
        chains_per_member=1,
        kernel="mclmc",
        num_warmup=2000,
        num_draws=100,
        thinning=10,
        threads=1,
    )


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_applicable(args: argparse.Namespace, task, tasks: dict) -> None:
    """Refuse a --model of other tasks, settings of the other inference method, or of other
    MCMC kernels (``KERNEL_OPTIONS``; the kernel left unset is the preset's).

    Raises:
        CLIError: naming the options that were given but do not apply.
    """
    if args.model not in task.models:
        offering = [name for name, other in tasks.items() if args.model in other.models]
        raise CLIError(
            f"--model {args.model} applies to {' and '.join(offering)} datasets, not "
            f"{args.dataset} ({task.name})"
        )
    if args.inference == "mcmc":
        options = [_flag(d) for d in SVI_OPTIONS if getattr(args, d) is not None]
        applies_to = f"--inference {SVI_METHODS}"
    else:
        taken = MILE_MCMC_OPTIONS if args.inference == "mile" else ()
        options = [
            _flag(d) for d in MCMC_OPTIONS if d not in taken and getattr(args, d) is not None
        ]
        applies_to = "--inference mcmc"
    if not options and args.inference not in ("svi", "map"):
        options = [_flag(d) for d in CHECKPOINT_OPTIONS if getattr(args, d) is not None]
        applies_to = "--inference svi and map"
    if not options and args.inference != "svi":
        options = [_flag(d) for d in GUIDE_OPTIONS if getattr(args, d) is not None]
        applies_to = "--inference svi"
    if not options and args.inference not in ENSEMBLE_METHODS:
        options = [_flag(d) for d in ENSEMBLE_OPTIONS if getattr(args, d) is not None]
        applies_to = "--inference ensemble, mile and mola"
    if not options and args.inference != "mile":
        options = [_flag(d) for d in MILE_OPTIONS if getattr(args, d) is not None]
        applies_to = "--inference mile"
    if not options and args.inference not in LAPLACE_BASED:
        options = [_flag(d) for d in LAPLACE_OPTIONS if getattr(args, d) is not None]
        applies_to = "--inference laplace and mola"
    if options:
        verb = "applies" if len(options) == 1 else "apply"
        raise CLIError(f"{', '.join(options)} {verb} to {applies_to}, not {args.inference}")
    if args.inference == "mile":
        if args.kernel is not None and args.kernel not in MILE_KERNELS:
            raise CLIError(
                f"--inference mile runs --kernel {' or '.join(MILE_KERNELS)}, not {args.kernel}"
            )
        return
    kernel = args.kernel or mcmc_preset()["kernel"]
    for dest, kernels in KERNEL_OPTIONS.items():
        if getattr(args, dest) is not None and not applies(dest, kernel):
            names = (
                ", ".join(kernels[:-1]) + f" and {kernels[-1]}" if len(kernels) > 1 else kernels[0]
            )
            raise CLIError(f"{_flag(dest)} applies to --kernel {names}, not {kernel}")


def with_mcmc_preset(args: argparse.Namespace, *, jit: bool = True) -> argparse.Namespace:
    """``args`` with the options left unset taken from ``mcmc_preset`` of ``--kernel`` (unset:
    the preset's kernel), except ``--num-starts`` when ``--num-chains`` or ``--init`` is given.
    ``jit=False`` (token models: PyTorch's JIT cannot run their traced density under Pyro's
    kernels) leaves NUTS and HMC uncompiled unless ``--jit-compile`` is given."""
    # the preset's starts fit its own chains and init; with either changed, the library's
    # default (one start per chain, one for "map") fits the user's
    preset = mcmc_preset(args.kernel or mcmc_preset()["kernel"])
    if args.num_chains is not None or args.init is not None:
        preset.pop("num_starts", None)
    if not jit and "jit_compile" in preset:
        preset["jit_compile"] = False
    args = with_preset(args, preset)
    check_starts(args)
    return args


def check_starts(args: argparse.Namespace) -> None:
    """Refuse ``--num-starts`` that does not divide ``--num-chains``, or several ``--init map``
    starts, naming the options rather than ``fit_mcmc``'s parameters (after the preset).

    Raises:
        CLIError: naming both options and their values.
    """
    if args.num_starts is None:  # fit_mcmc's default fits every kernel, init and K
        return
    if args.num_chains % args.num_starts:
        raise CLIError(
            f"--num-chains must be a multiple of --num-starts (each start runs the same number "
            f"of chains), got --num-chains {args.num_chains} and --num-starts {args.num_starts}"
        )
    if args.init == "map" and args.num_starts != 1:
        raise CLIError(
            f"--init map starts every chain from one MAP fit, so --num-starts must be 1, got "
            f"{args.num_starts}; use --init ensemble for {args.num_starts} MAP fits"
        )


def with_preset(args: argparse.Namespace, preset: dict[str, Any]) -> argparse.Namespace:
    """``args`` with the options left unset taken from ``preset`` (a task's ``fit_preset``, or
    the MCMC preset)."""
    args = argparse.Namespace(**vars(args))
    for dest, value in preset.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    return args


def with_mile_preset(args: argparse.Namespace, task_preset: dict[str, Any]) -> argparse.Namespace:
    """``args`` with the options left unset taken from ``mile_preset``, then from the task's
    ``fit_preset`` (the ensemble's schedule), then checked as ``with_svi_preset`` checks."""
    return with_svi_preset(with_preset(args, mile_preset()), task_preset)


def with_svi_preset(args: argparse.Namespace, preset: dict[str, Any]) -> argparse.Namespace:
    """``with_preset`` for a task's ``fit_preset``, then ``check_schedule_options``. The
    preset's ``lr_decay`` belongs to its schedule: when ``--lr-schedule`` names another, the
    library's default decay applies instead (the tagger's decay to 0 with an exponential
    schedule would be refused for an option the user never gave)."""
    preset = dict(preset)
    if args.lr_schedule not in (None, preset.get("lr_schedule", "exponential")):
        preset.pop("lr_decay", None)
    args = with_preset(args, preset)
    check_schedule_options(args)
    return args


def check_schedule_options(args: argparse.Namespace) -> None:
    """Refuse ``--lr-decay 0`` without a cosine schedule (after the presets filled the unset
    options), naming the options rather than ``fit_svi``'s parameters.

    Raises:
        CLIError: an exponential decay to 0.
    """
    if args.lr_decay == 0 and args.lr_schedule != "cosine":
        schedule = args.lr_schedule or "exponential, the default"
        raise CLIError(
            f"--lr-decay 0 needs --lr-schedule cosine (an exponential decay never reaches 0); "
            f"the schedule is {schedule}"
        )


def library_functions() -> dict[str, Callable[..., Any]]:
    """The library callables whose defaults unset options take (imported on demand)."""
    from probtransformer.inference import (
        Posterior,
        fit_ensemble,
        fit_laplace,
        fit_mcmc,
        fit_mile,
        fit_svi,
    )
    from probtransformer.models import SequenceClassifier, generate

    return {
        "model": SequenceClassifier.__init__,  # text models differ: help shows their own too
        "fit": fit_svi,
        "mcmc": fit_mcmc,
        "mile": fit_mile,
        "ensemble": fit_ensemble,
        "laplace": fit_laplace,
        "predict": Posterior.predict,
        "diagnose": Posterior.diagnose,
        "generate": generate,
    }
