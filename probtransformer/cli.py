"""Command-line interface: ``probtransformer fit | diagnose | predict | report``.

Commands:
    fit       Fit a ``SequenceClassifier`` to a dataset by SVI, MAP, MCMC (NUTS/HMC), MC dropout
              or a deep ensemble and write a run directory (default
              ``runs/<dataset>-<inference>``)::

                  metrics.json        test-split accuracy, nll, ece (15 equal-width bins),
                                      brier, mean_epistemic, sizes, fit seconds, settings
                                      (mcmc: sampler settings, ``num_draws`` requested and
                                      ``chains_kept`` x ``draws_per_chain`` kept per chain,
                                      divergences, ``partial``)
                  inference_data.nc   ArviZ InferenceData (posterior, log_likelihood of the
                                      training data, predictions for the test split; mcmc:
                                      sample_stats per draw)
                  posterior/          the fitted posterior (``load_posterior``)
                  attention.png       posterior mean and std of the attention of test example 0
                  reliability.png     reliability diagram of the test predictive mean

              The run is written to a temporary directory next to the target and renamed at the
              end, so an interrupted or failed run never leaves a half-written directory; an
              existing run directory is replaced only after success. Ctrl-C during MCMC sampling
              keeps the draws so far: the run is written and marked partial.
    diagnose  Reload a run's posterior and training data and print the aggregated diagnostics
              table, the verdict and a PSIS-LOO line.
    predict   Posterior predictive of a run for new sequences (``.npy`` of shape (N, T, F), or
              ``.csv`` with one flattened sequence of T*F values per row) as CSV with columns
              ``prob_<class>``, ``predicted``, ``entropy``, ``aleatoric``, ``epistemic`` (nats).
    report    Write ``report.html`` into a run directory: one self-contained page (inline CSS,
              figures as base64 PNGs) with the metrics, reliability diagram, risk-coverage
              curves, posterior attention, head importance and diagnostics
              (``probtransformer.report.write_report``). A later ``fit --out`` over the same
              directory replaces the whole run, report included.

Model and fit options left unset take the library defaults (``SequenceClassifier``,
``fit_svi``, ``fit_mcmc``), so tuning the library tunes the CLI; ``probtransformer fit --help``
shows them. ``--inference mcmc`` is the exception where those defaults would run for hours: it
fits a small fully Bayesian model on the first 200 training rows with short chains unless told
otherwise (``mcmc_preset``). Options of the other inference method are refused.

Exit status: 0 on success; 2 on bad arguments or input files, with one line on stderr starting
``probtransformer: error:``; 1 when the fit diverges (``NonFiniteELBOError``); 130 on Ctrl-C
(outside MCMC sampling, or before its first kept draw).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import inspect
import json
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from probtransformer._io import replace_directory
from probtransformer._rundir import METRICS_FILE, POSTERIOR_DIR, is_run_dir, read_run, run_splits

PROG = "probtransformer"
INFERENCE_DATA_FILE = "inference_data.nc"
ATTENTION_FILE = "attention.png"
RELIABILITY_FILE = "reliability.png"
REPORT_FILE = "report.html"  # written by ``probtransformer report``, not by fit
#: Everything a run directory may hold (``fit --out`` replaces such a directory, nothing else).
RUN_FILES = (
    METRICS_FILE,
    INFERENCE_DATA_FILE,
    POSTERIOR_DIR,
    ATTENTION_FILE,
    RELIABILITY_FILE,
    REPORT_FILE,
)
ECE_BINS = 15  # equal-width bins of the reported ECE and the reliability diagram
INFERENCES = ("svi", "map", "mcmc", "mc-dropout", "ensemble")
#: None: the guide is --guide's (or fit_svi's); the baselines are MAP fits (AutoDelta)
INFERENCE_GUIDES = {"svi": None, "map": "delta", "mc-dropout": "delta", "ensemble": "delta"}
SVI_OPTIONS = ("guide", "num_steps", "batch_size", "lr")  # fit_svi settings: all but mcmc
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


class CLIError(Exception):
    """A bad argument or input file found by the CLI itself (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one stderr line, like every other error of the CLI."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


class _DatasetNames:
    """Lazy ``choices`` for ``--dataset``: the names of ``datasets.available()``.

    Listing them imports torch, so it happens only when a dataset name is checked or the
    ``fit`` help is printed, never for ``probtransformer --help``.
    """

    @functools.cached_property
    def _names(self) -> list[str]:
        from probtransformer import datasets

        return datasets.available()["name"].tolist()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)


def _library_functions() -> dict[str, Callable[..., Any]]:
    """The library callables whose defaults unset options take (imported on demand)."""
    from probtransformer.inference import Posterior, fit_ensemble, fit_mcmc, fit_svi
    from probtransformer.models import SequenceClassifier

    return {
        "model": SequenceClassifier.__init__,
        "fit": fit_svi,
        "mcmc": fit_mcmc,
        "ensemble": fit_ensemble,
        "predict": Posterior.predict,
        "diagnose": Posterior.diagnose,
    }


def _help_value(value: object) -> str:
    if isinstance(value, tuple | list):
        value = ",".join(map(str, value))
    return str(value).replace("%", "%%")


class _LibraryDefaultsFormatter(argparse.HelpFormatter):
    """Help formatter that appends the default of every option left unset (None).

    The defaults are read from the signatures of the library functions named in ``sources``
    (keys of ``_library_functions``; the first that has the parameter) when help is printed, so
    they are always the ones a run uses. With ``mcmc=True`` the ``mcmc_preset`` values are shown
    too: as the default of MCMC-only options, as ``mcmc: ...`` next to the default of others.
    """

    def __init__(self, prog: str, *, sources: Sequence[str], mcmc: bool = False) -> None:
        super().__init__(prog, max_help_position=30)
        self._sources = sources
        self._mcmc = mcmc

    def _library_default(self, dest: str) -> str | None:
        functions = _library_functions()
        sources, name = self._sources, dest
        if dest in LIBRARY_NAMES:
            source, name = LIBRARY_NAMES[dest]
            sources = (source,)
        for source in sources:
            parameter = inspect.signature(functions[source]).parameters.get(name)
            if parameter is not None and parameter.default is not inspect.Parameter.empty:
                return _help_value(parameter.default)
        return UNSET_HELP.get(dest)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is not None or not action.option_strings:
            return text
        preset = mcmc_preset() if self._mcmc else {}
        default = self._library_default(action.dest)
        if action.dest in preset and action.dest in MCMC_OPTIONS:
            default = _help_value(preset[action.dest])
        parts = [] if default is None else [f"default: {default}"]
        if action.dest in preset and action.dest not in MCMC_OPTIONS:
            parts.append(f"mcmc: {_help_value(preset[action.dest])}")
        elif self._mcmc and action.dest in UNSET_MCMC_HELP:
            parts.append(f"mcmc: {UNSET_MCMC_HELP[action.dest]}")
        return f"{text} ({'; '.join(parts)})" if parts else text


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _parts(text: str) -> tuple[str, ...]:
    """argparse type: a comma-separated list such as ``attention,head`` ('' for none)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``probtransformer`` with its sub-commands.

    Returns:
        An ``ArgumentParser`` whose errors print one line and exit with status 2.
    """
    parser = _Parser(
        prog=PROG,
        description="Bayesian Transformers in Pyro: fit, diagnose, predict and report from the "
        "shell.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    fit = commands.add_parser(
        "fit",
        help="fit a Bayesian Transformer classifier and write a run directory",
        description="Fit a SequenceClassifier built from the dataset's meta (in_features, "
        f"num_classes, max_len) and write {METRICS_FILE}, {INFERENCE_DATA_FILE}, "
        f"{POSTERIOR_DIR}/, {ATTENTION_FILE} and {RELIABILITY_FILE} to --out. "
        "Metrics are computed on the test split. Options left unset take the library defaults; "
        "'mcmc: ...' shows what --inference mcmc uses instead (a small model and short chains, "
        "a few minutes on 2 CPU cores).",
        formatter_class=functools.partial(
            _LibraryDefaultsFormatter,
            sources=("model", "fit", "predict", "mcmc", "ensemble"),
            mcmc=True,
        ),
    )
    fit.set_defaults(handler=_fit)
    fit.add_argument(
        "--dataset",
        default="digits",
        choices=_DatasetNames(),
        metavar="NAME",
        help="dataset, one of: %(choices)s (default: %(default)s)",
    )
    fit.add_argument(
        "--inference",
        default="svi",
        choices=INFERENCES,
        help="svi; map: a point estimate, fit_map (fit_svi with guide delta); mcmc: fit_mcmc, "
        "HMC or NUTS; "
        "mc-dropout: MAP with dropout kept on at prediction (fit_mc_dropout, needs --dropout > "
        "0); ensemble: a deep ensemble of MAP fits (fit_ensemble) (default: %(default)s)",
    )
    fit.add_argument(
        "--num-train",
        type=_positive_int,
        metavar="N",
        help="fit on the first N rows of the shuffled, stratified training split",
    )
    fit.add_argument(
        "--num-samples", type=_positive_int, metavar="S", help="posterior draws for predictions"
    )
    fit.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the data split, the fit and the draws (default: %(default)s)",
    )
    fit.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where to fit")
    fit.add_argument(
        "--threads", type=_positive_int, metavar="N", help="intra-op CPU threads of torch"
    )
    fit.add_argument(
        "--out", metavar="DIR", help="run directory (default: runs/<dataset>-<inference>)"
    )
    fit.add_argument(
        "--no-progress", dest="progress", action="store_false", help="hide the progress bar"
    )
    svi = fit.add_argument_group("svi, map, mc-dropout and ensemble only")
    svi.add_argument(
        "--guide", choices=("normal", "lowrank", "mvn", "delta"), help="SVI variational family"
    )
    svi.add_argument("--num-steps", type=_positive_int, metavar="N", help="optimisation steps")
    svi.add_argument("--batch-size", type=_positive_int, metavar="N", help="sequences per step")
    svi.add_argument("--lr", type=float, help="initial Adam learning rate")
    ensemble = fit.add_argument_group("ensemble only")
    ensemble.add_argument(
        "--n-members",
        type=_positive_int,
        metavar="K",
        help="ensemble members, fitted with seeds seed, seed+1, ...",
    )
    mcmc = fit.add_argument_group("mcmc only")
    mcmc.add_argument("--kernel", choices=("nuts", "hmc"), help="MCMC kernel")
    mcmc.add_argument("--num-chains", type=_positive_int, metavar="N", help="independent chains")
    mcmc.add_argument(
        "--num-warmup",
        type=_non_negative_int,
        metavar="N",
        help="adaptation transitions per chain, discarded",
    )
    mcmc.add_argument("--num-draws", type=_positive_int, metavar="N", help="kept draws per chain")
    mcmc.add_argument(
        "--target-accept-prob",
        type=float,
        metavar="P",
        help="acceptance probability the step size is adapted to",
    )
    mcmc.add_argument(
        "--max-tree-depth",
        type=_positive_int,
        metavar="N",
        help="NUTS only: at most 2**N - 1 leapfrog steps per transition",
    )
    mcmc.add_argument(
        "--trajectory-length",
        type=float,
        metavar="L",
        help="HMC only: integration time per transition (leapfrog steps: L / step size)",
    )
    mcmc.add_argument(
        "--jit-compile",
        action=argparse.BooleanOptionalAction,
        help="trace the log density with the PyTorch JIT",
    )
    model = fit.add_argument_group("model")
    model.add_argument("--d-model", type=_positive_int, metavar="N", help="model width")
    model.add_argument("--num-heads", type=_positive_int, metavar="N", help="heads per layer")
    model.add_argument("--num-layers", type=_positive_int, metavar="N", help="Transformer blocks")
    model.add_argument("--d-ff", type=_positive_int, metavar="N", help="feed-forward width")
    model.add_argument("--dropout", type=float, metavar="P", help="dropout probability")
    model.add_argument(
        "--bayesian",
        type=_parts,
        metavar="PARTS",
        help="comma-separated latent parts among embedding,attention,ffn,norm,head ('' for none)",
    )
    model.add_argument(
        "--head-gates",
        action="store_true",
        default=None,
        help="horseshoe gates on the heads (priors.HeadGatePrior); the report shows their "
        "posterior importance",
    )
    model.add_argument(
        "--stochastic-attention",
        action="store_true",
        default=None,
        help="attention logits as local latents (priors.StochasticAttentionPrior, amortized "
        "guide); with mcmc at most 50 training sequences",
    )
    model.add_argument(
        "--local-window",
        type=_int_at_least(0),
        metavar="W",
        help="guidance prior: attention near |i - j| <= W (priors.AttentionLogitPrior with "
        "local_window(W, outside=0.01), strength 1)",
    )

    diagnose = commands.add_parser(
        "diagnose",
        help="print convergence diagnostics and PSIS-LOO of a run",
        description="Reload a run's posterior and its training data (dataset and seed from "
        f"{METRICS_FILE}) and print the aggregated diagnostics table, the verdict and LOO.",
        formatter_class=functools.partial(_LibraryDefaultsFormatter, sources=("diagnose",)),
    )
    diagnose.set_defaults(handler=_diagnose)
    diagnose.add_argument("run_dir", metavar="DIR", help="run directory written by fit")
    diagnose.add_argument(
        "--num-samples", type=_positive_int, metavar="S", help="posterior draws to summarise"
    )

    predict = commands.add_parser(
        "predict",
        help="posterior predictive of a run for new sequences, as CSV",
        description="Predict with a run's posterior. --input is a .npy array of shape "
        "(N, T, F) or a .csv file with one flattened sequence (T*F values, step by step) per "
        "row, optionally under a header row (non-numeric, or pandas' 0,1,...,T*F-1).",
        formatter_class=functools.partial(_LibraryDefaultsFormatter, sources=("predict",)),
    )
    predict.set_defaults(handler=_predict)
    predict.add_argument("run_dir", metavar="DIR", help="run directory written by fit")
    predict.add_argument("--input", required=True, metavar="FILE", help=".npy or .csv inputs")
    predict.add_argument("--output", metavar="FILE", help="CSV to write (default: stdout)")
    predict.add_argument("--num-samples", type=_positive_int, metavar="S", help="posterior draws")
    predict.add_argument("--seed", type=int, help="seeds the draws")

    report = commands.add_parser(
        "report",
        help=f"write a self-contained {REPORT_FILE} into a run directory",
        description=f"Write DIR/{REPORT_FILE}: one HTML file with inline CSS and every figure "
        "embedded as a PNG, with sections metrics, reliability, risk-coverage (by total entropy "
        "and by epistemic uncertainty, with AURC), attention (posterior mean and sd per layer "
        "and head), head-importance and diagnostics. The test and training rows are reloaded "
        f"from the dataset and seed in {METRICS_FILE}.",
    )
    report.set_defaults(handler=_report)
    report.add_argument("run_dir", metavar="DIR", help="run directory written by fit")
    report.add_argument(
        "--num-samples",
        type=_positive_int,
        metavar="S",
        help=f"posterior draws (default: the run's, from {METRICS_FILE})",
    )
    report.add_argument("--seed", type=int, help="seeds the draws (default: the run's seed)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        Exit status: 0 on success, 2 on bad arguments or files (one line on stderr), 1 when the
        fit diverges, 130 when interrupted (Ctrl-C) with nothing written.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or an argument error already reported on one line
        return e.code if isinstance(e.code, int) else 2
    try:
        args.handler(args)
    except (CLIError, ValueError, TypeError, OSError) as e:
        return _fail(e, 2)
    except FloatingPointError as e:  # NonFiniteELBOError: the fit diverged
        return _fail(e, 1)
    except KeyboardInterrupt as e:
        return _fail(KeyboardInterrupt(str(e) or "interrupted; nothing was written"), 130)
    return 0


def _fail(error: Exception, status: int) -> int:
    message = " ".join(str(error).split()) or type(error).__name__
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


def _given(**kwargs: Any) -> dict[str, Any]:
    """The keyword arguments that were set; unset (None) ones keep the library defaults."""
    return {name: value for name, value in kwargs.items() if value is not None}


# -- fit ------------------------------------------------------------------------------------


def _fit(args: argparse.Namespace) -> None:
    """``probtransformer fit``: fit, evaluate on the test split, write the run directory."""
    _check_applicable(args)
    guide = INFERENCE_GUIDES.get(args.inference)
    if guide is not None and args.guide not in (None, guide):
        raise CLIError(
            f"--inference {args.inference} fits guide {guide!r}; got --guide {args.guide}"
        )
    target = Path(args.out or Path("runs") / f"{args.dataset}-{args.inference}")
    _check_out(target)
    if args.inference == "mcmc":
        args = _with_mcmc_preset(args)

    import torch

    from probtransformer import datasets, metrics
    from probtransformer.models import SequenceClassifier

    splits = datasets.load(args.dataset, seed=args.seed)
    meta = splits.meta
    if args.num_train is not None:
        if args.num_train > len(splits.train):
            raise CLIError(
                f"--num-train {args.num_train} exceeds the {len(splits.train)} rows of the "
                f"{args.dataset} training split"
            )
        splits = dataclasses.replace(splits, train=splits.train[: args.num_train])
    model = SequenceClassifier(
        meta["in_features"],
        meta["num_classes"],
        meta["max_len"],
        **_given(
            d_model=args.d_model,
            num_heads=args.num_heads,
            num_layers=args.num_layers,
            d_ff=args.d_ff,
            dropout=args.dropout,
            bayesian=args.bayesian,
            **_attention_priors(args),
        ),
    )
    with _intra_op_threads(args.threads):
        start = time.perf_counter()
        if args.inference == "mcmc":
            post = _fit_mcmc(model, splits.train, args)
        else:  # svi and the MAP-based fits
            post = _fit_svi(model, splits.train, args, guide)
        seconds = time.perf_counter() - start

        draws = _given(num_samples=_prediction_draws(post, args.num_samples), seed=args.seed)
        test = splits.test
        pred = post.predict(test.x, test.mask, **draws)
        probs = pred.mean  # (N, C)
        record = dict(
            accuracy=metrics.accuracy(probs, test.y),
            nll=metrics.nll(probs, test.y),
            ece=metrics.ece(probs, test.y, n_bins=ECE_BINS, strategy="uniform"),
            ece_bins=ECE_BINS,
            brier=metrics.brier(probs, test.y),
            mean_epistemic=float(pred.epistemic.mean()),
            num_train=len(splits.train),
            num_test=len(test),
            seconds=seconds,
            dataset=args.dataset,
            val_fraction=meta["val_fraction"],
            inference=args.inference,
            **_fit_settings(post),
            num_samples=pred.probs.shape[0],
            seed=args.seed,
            device=str(post.device),
            threads=torch.get_num_threads(),
            class_names=meta.get("class_names"),
        )
        _write_run(target, post, splits, probs, record, draws)
    _print_metrics(target, record)


def _attention_priors(args: argparse.Namespace) -> dict[str, Any]:
    """``attention_prior``/``head_prior`` of the model from the --head-gates,
    --stochastic-attention and --local-window flags (nothing when none is given)."""
    from probtransformer import priors

    specs = []
    if args.stochastic_attention:
        specs.append(priors.StochasticAttentionPrior())
    if args.local_window is not None:
        specs.append(
            priors.AttentionLogitPrior(priors.local_window(args.local_window, outside=0.01))
        )
    kwargs: dict[str, Any] = {}
    if specs:
        kwargs["attention_prior"] = (priors.LogitScalePrior(), *specs)
    if args.head_gates:
        kwargs["head_prior"] = priors.HeadGatePrior()
    return kwargs


def _prediction_draws(post, num_samples: int | None) -> int | None:
    """``--num-samples``; unset: every kept draw of a sampled posterior, None (the library
    default) for SVI."""
    if num_samples is None and post.samples is not None:
        return math.prod(next(iter(post.samples.values())).shape[:2])  # chains x draws
    return num_samples


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_applicable(args: argparse.Namespace) -> None:
    """Refuse settings of the other inference method (or of the other MCMC kernel).

    Raises:
        CLIError: naming the options that were given but do not apply.
    """
    if args.inference == "mcmc":
        given = [_option(d) for d in SVI_OPTIONS if getattr(args, d) is not None]
        applies_to = "--inference svi, map, mc-dropout and ensemble"
    else:
        given = [_option(d) for d in MCMC_OPTIONS if getattr(args, d) is not None]
        applies_to = "--inference mcmc"
    if not given and args.inference != "ensemble":
        given = [_option(d) for d in ENSEMBLE_OPTIONS if getattr(args, d) is not None]
        applies_to = "--inference ensemble"
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        raise CLIError(f"{', '.join(given)} {verb} to {applies_to}, not {args.inference}")
    kernel = args.kernel or _library_default("mcmc", "kernel")
    for dest, only in KERNEL_OPTIONS.items():
        if getattr(args, dest) is not None and kernel != only:
            raise CLIError(f"{_option(dest)} applies to --kernel {only}, not {kernel}")


def _library_default(source: str, parameter: str) -> Any:
    return inspect.signature(_library_functions()[source]).parameters[parameter].default


def _with_mcmc_preset(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the options left unset taken from ``mcmc_preset``."""
    args = argparse.Namespace(**vars(args))
    for dest, value in mcmc_preset().items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    return args


@contextlib.contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)`` (None: leave it), then restore."""
    if threads is None:
        yield
        return
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _fit_svi(model, train, args: argparse.Namespace, guide: str | None):
    """svi: ``fit_svi``; map, mc-dropout, ensemble: their ``MAP_FITS`` function (fit_svi's
    settings without ``guide``; ensemble: ``n_members`` too)."""
    from probtransformer import inference

    if args.inference in MAP_FITS:
        fit, specific = getattr(inference, MAP_FITS[args.inference]), dict(n_members=args.n_members)
    else:
        fit, specific = inference.fit_svi, dict(guide=guide or args.guide)
    return fit(
        model,
        train,
        seed=args.seed,
        progress=args.progress,
        **_given(
            **specific,
            num_steps=args.num_steps,
            batch_size=args.batch_size,
            lr=args.lr,
            device=args.device,
        ),
    )


def _fit_mcmc(model, train, args: argparse.Namespace):
    from probtransformer.inference import fit_mcmc

    kernel = args.kernel or _library_default("mcmc", "kernel")
    return fit_mcmc(
        model,
        train,
        seed=args.seed,
        progress=args.progress,
        **_given(
            kernel=args.kernel,
            num_chains=args.num_chains,
            num_warmup=args.num_warmup,
            num_samples=args.num_draws,
            target_accept_prob=args.target_accept_prob,
            max_tree_depth=args.max_tree_depth if kernel == "nuts" else None,
            trajectory_length=args.trajectory_length if kernel == "hmc" else None,
            jit_compile=args.jit_compile,
            device=args.device,
        ),
    )


def _fit_settings(post) -> dict[str, Any]:
    """What metrics.json records of the fit itself, from the posterior's record."""
    record = post.record
    if record["method"] == "mc-dropout":
        return dict(guide=record["guide"], num_steps=record["num_steps"], dropout=record["dropout"])
    if record["method"] == "ensemble":
        return dict(
            guide=record["guide"],
            num_steps=record["num_steps"],
            n_members=record["n_members"],
            member_seeds=[member["seed"] for member in record["members"]],
            member_final_losses=[member["final_loss"] for member in record["members"]],
        )
    if record["method"] != "mcmc":
        return dict(guide=record["guide"], num_steps=record["num_steps"])
    chains, kept = next(iter(post.samples.values())).shape[:2]
    # no sample_stats: an interrupted worker process took them along (recorded as None)
    diverging = (record.get("sample_stats") or {}).get("diverging")
    settings = dict(
        kernel=record["kernel"],
        num_chains=record["num_chains"],
        num_warmup=record["num_warmup"],
        num_draws=record["num_samples"],
        target_accept_prob=record["target_accept_prob"],
    )
    if record["kernel"] == "nuts":
        settings["max_tree_depth"] = record["max_tree_depth"]
    else:
        settings["trajectory_length"] = record["trajectory_length"]
    return dict(
        **settings,
        jit_compile=record["jit_compile"],
        partial=record["partial"],
        chains_kept=chains,
        draws_per_chain=kept,
        divergences=None if diverging is None else int(sum(map(sum, diverging))),
    )


def _check_out(target: Path) -> None:
    """Fail before fitting when ``target`` cannot become the run directory.

    Raises:
        CLIError: ``target`` is a file, a non-empty directory that is not a run directory, or a
            run directory holding other files (never replaced); or its nearest existing parent
            is not a writable directory.
    """
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise CLIError(f"--out {target} exists and is not a directory")
        names = {p.name for p in target.iterdir()}
        if names and not is_run_dir(target):
            raise CLIError(
                f"--out {target} exists and is not a {PROG} run directory; refusing to replace it"
            )
        others = sorted(names - set(RUN_FILES))
        if others:
            raise CLIError(
                f"--out {target} holds files that {PROG} did not write ({', '.join(others[:3])})"
                "; move them or choose another --out"
            )
    ancestor = target.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise CLIError(f"cannot create --out {target}: {ancestor} is not a writable directory")


def _write_run(target: Path, post, splits, probs, record: dict, draws: dict) -> None:
    """Write every file of the run to a staging directory, then move it to ``target``."""
    from probtransformer import plots

    target = target.absolute()
    staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()  # not mkdtemp: the run directory gets the usual (umask) permissions
    except OSError as e:
        raise CLIError(f"cannot write --out {target}: {e.strerror or e}") from e
    try:
        test = splits.test
        idata = post.to_inference_data(splits.train, test=test, **draws)
        idata.to_netcdf(str(staging / INFERENCE_DATA_FILE))
        post.save(staging / POSTERIOR_DIR)
        first = test[:1]
        attention = post.attention(first.x, first.mask, **draws)
        title = f"posterior attention, {record['dataset']} test example 0 (label {int(first.y)})"
        plots.save_figure(attention.plot(0, title=title), staging / ATTENTION_FILE)
        reliability = plots.reliability_figure(
            probs, test.y, n_bins=ECE_BINS, title=f"{record['dataset']} test, {record['inference']}"
        )
        plots.save_figure(reliability, staging / RELIABILITY_FILE)
        (staging / METRICS_FILE).write_text(json.dumps(record, indent=1) + "\n")
        replace_directory(staging, target)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise CLIError(f"cannot write --out {target}: {e.strerror or e}") from e
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _print_metrics(target: Path, record: dict) -> None:
    if record["inference"] == "mcmc":
        how = (
            f"{record['kernel']}, {record['chains_kept']} chain(s) x {record['draws_per_chain']} "
            f"draws after {record['num_warmup']} warmup"
        )
    elif record["inference"] == "ensemble":
        how = f"{record['n_members']} MAP members"
    elif record["inference"] == "mc-dropout":
        how = f"MAP, dropout {', '.join(map(str, record['dropout']))} kept on"
    else:
        how = f"guide {record['guide']}"
    print(
        f"{record['dataset']} · {record['inference']} ({how}) · "
        f"{record['num_train']} train / {record['num_test']} test · {record['seconds']:.1f} s fit"
    )
    if record.get("partial"):
        print(
            f"PARTIAL: sampling was interrupted; the run holds the {record['chains_kept']} x "
            f"{record['draws_per_chain']} draws kept of {record['num_chains']} x "
            f"{record['num_draws']} requested"
        )
    for key, unit in (
        ("accuracy", ""),
        ("nll", " nats"),
        ("ece", f" ({ECE_BINS} bins)"),
        ("brier", ""),
        ("mean_epistemic", " nats"),
    ):
        print(f"  {key:<15}{record[key]:.4f}{unit}")
    if record["inference"] == "mcmc":
        divergences = record["divergences"]
        total = record["chains_kept"] * record["draws_per_chain"]
        print(f"  {'divergences':<15}{'?' if divergences is None else divergences} of {total}")
    print(f"wrote {target}")
    if record["inference"] == "mcmc":
        print(f"convergence (R-hat, ESS, E-BFMI): {PROG} diagnose {target}")


# -- diagnose and predict -----------------------------------------------------------------------


def _diagnose(args: argparse.Namespace) -> None:
    """``probtransformer diagnose``: diagnostics table, verdict and LOO on the training data."""
    record, post = read_run(args.run_dir)
    train = run_splits(record, args.run_dir)[1]
    from probtransformer.inference.diagnostics import format_table

    table = post.diagnose(train, verbose=False, **_given(num_samples=args.num_samples))
    print(format_table(table))
    print("\n".join(table.attrs["verdict"]))


def _report(args: argparse.Namespace) -> None:
    """``probtransformer report``: write ``report.html`` into the run directory."""
    from probtransformer.report import write_report

    path = write_report(args.run_dir, **_given(num_samples=args.num_samples, seed=args.seed))
    print(f"wrote {path}")


def _predict(args: argparse.Namespace) -> None:
    """``probtransformer predict``: predictive probabilities and uncertainties as CSV."""
    path = Path(args.input)
    if path.suffix.lower() not in (".npy", ".csv"):
        raise CLIError(f"--input must be a .npy or .csv file, got {args.input!r}")
    if not path.is_file():
        raise CLIError(f"--input {args.input} does not exist or is not a file")
    record, post = read_run(args.run_dir)
    max_len, in_features = post.model.config["max_len"], post.model.config["in_features"]
    if path.suffix.lower() == ".npy":
        x = _read_npy(path, in_features)
    else:
        x = _read_csv(path, max_len, in_features)
    pred = post.predict(x, **_given(num_samples=args.num_samples, seed=args.seed))
    frame = pred.to_dataframe(record.get("class_names"))
    if args.output is None:
        frame.to_csv(sys.stdout, index=False)
        return
    try:
        frame.to_csv(args.output, index=False)
    except OSError as e:
        raise CLIError(f"cannot write --output {args.output}: {e.strerror or e}") from e


def _read_npy(path: Path, in_features: int) -> np.ndarray:
    """Read float32 inputs of shape (N, T, F) from a .npy file (T may be below max_len).

    Raises:
        CLIError: not a numeric .npy array, another shape, no rows, or NaN/inf values.
    """
    try:
        x = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise CLIError(f"cannot read {path} as a .npy array: {e}") from None
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
        raise CLIError(
            f"{path} must hold floating-point features (as the model was trained on), got dtype "
            f"{getattr(x, 'dtype', type(x).__name__)}"
        )
    if x.ndim != 3 or x.shape[2] != in_features or 0 in x.shape:
        raise CLIError(
            f"{path} must hold an array of shape (N, T, F={in_features}) with N, T >= 1, "
            f"got {x.shape}"
        )
    return _finite(x.astype(np.float32), path)


def _read_csv(path: Path, max_len: int, in_features: int) -> np.ndarray:
    """Read inputs from a CSV file with one flattened sequence of T*F values per row.

    Values run step by step (row-major over (T, F)); T is the model's max_len. A first row
    with no numeric cell, or with pandas' default column names ``0,1,...,T*F-1`` (what
    ``DataFrame.to_csv(index=False)`` writes), is a header and skipped; blank lines are skipped.

    Returns:
        float32 array of shape (N, max_len, in_features).

    Raises:
        CLIError: a row with another number of columns, a missing or non-numeric value, no
            rows, or NaN/inf values.
    """
    width = max_len * in_features
    rows: list[list[float]] = []
    with path.open(newline="") as f:
        for line, cells in enumerate(csv.reader(f), start=1):
            if not any(cell.strip() for cell in cells):
                continue
            if line == 1 and _is_header(cells):
                continue
            if len(cells) != width:
                raise CLIError(
                    f"{path} line {line}: expected {width} columns (T*F = {max_len}*{in_features})"
                    f", got {len(cells)}"
                )
            rows.append([_cell(value, path, line, column) for column, value in enumerate(cells)])
    if not rows:
        raise CLIError(f"{path} holds no data rows")
    x = np.asarray(rows, dtype=np.float32).reshape(len(rows), max_len, in_features)
    return _finite(x, path)


def _is_header(cells: list[str]) -> bool:
    """A first row with no number, or pandas' default column names ``0,1,...,W-1``."""
    if not any(_is_number(cell) for cell in cells):
        return True
    return [cell.strip() for cell in cells] == [str(i) for i in range(len(cells))]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _cell(text: str, path: Path, line: int, column: int) -> float:
    if not text.strip():
        raise CLIError(f"{path} line {line}, column {column + 1}: missing value")
    try:
        return float(text)
    except ValueError:
        raise CLIError(f"{path} line {line}, column {column + 1}: not a number: {text!r}") from None


def _finite(x: np.ndarray, path: Path) -> np.ndarray:
    bad = int((~np.isfinite(x)).sum())
    if bad:
        raise CLIError(f"{path} holds {bad} NaN/inf values")
    return x


if __name__ == "__main__":
    sys.exit(main())
