"""Command-line interface: ``probtransformer fit | diagnose | predict | report | generate``.

Commands:
    fit       Fit the model of the dataset's task (``datasets.load(name).meta["task"]``) by SVI,
              MAP, MCMC (NUTS/HMC), MC dropout or a deep ensemble and write a run directory
              (default ``runs/<dataset>-<inference>``):

              - classification (digits, digits-patches, the UCR/UEA sets): ``SequenceClassifier``
                (2-D patch positions for digits-patches; the mask of ragged sets);
              - tagging (pydoc-wordseg): ``TokenTagger`` over character ids;
              - language-modeling (pydoc-text): ``CausalLM`` over characters;
              - forecasting (sunspots, co2, macrodata): ``SequenceRegressor`` (last-step
                pooling, the dataset's standardisation), or ``Seq2Seq`` with ``--model seq2seq``.

              Every run directory holds::

                  metrics.json        test-split metrics of the task (below), sizes, fit seconds,
                                      settings (mcmc: sampler settings, ``num_draws`` requested
                                      and ``chains_kept`` x ``draws_per_chain`` kept per chain,
                                      divergences, ``partial``), ``task`` and ``model``
                  inference_data.nc   ArviZ InferenceData (posterior, log_likelihood of the
                                      training data, predictions for the test split; mcmc:
                                      sample_stats per draw; tagging and language models: the
                                      first 500 training and test sequences,
                                      ``inference_data_rows``)
                  posterior/          the fitted posterior (``load_posterior``)
                  attention.png       posterior mean and std of the attention of test example 0

              and by task:

              - classification: accuracy, nll, ece (15 equal-width bins), brier,
                mean_epistemic; ``reliability.png``;
              - tagging, over the real (unpadded) test characters: token accuracy, nll
                (nats/token), ece, boundary_f1 (scikit-learn ``f1_score``, positive class 1 =
                word boundary), mean_epistemic; ``reliability.png`` over those characters;
              - language-modeling, over every test token: perplexity, nll (nats/token),
                next-token accuracy, mean_epistemic; ``samples.json``: greedy continuations of
                3 test prompts with their mean per-token entropy (``generate``);
              - forecasting, in the data's units over every (origin, step) of the test split:
                rmse and mae of the predictive mean, interval_coverage and interval_width of
                the 90% predictive interval, crps (from the predictive samples);
                ``predictions.csv`` (origin, step, period, mean, lower, upper, y) and
                ``forecast.png`` (fan chart of a few test forecasts).

              Token-level predictions are made 32 sequences at a time (``TOKEN_BATCH``): their
              probabilities are (draws, sequences, steps, vocabulary).
              The run is written to a temporary directory next to the target and renamed at the
              end, so an interrupted or failed run never leaves a half-written directory; an
              existing run directory is replaced only after success. Ctrl-C during MCMC sampling
              keeps the draws so far: the run is written and marked partial.
    diagnose  Reload a run's posterior and training data and print the aggregated diagnostics
              table, the verdict and a PSIS-LOO line.
    predict   Posterior predictive of a run for new inputs, as CSV. Classification and
              forecasting runs read ``.npy`` of shape (N, T, F), or ``.csv`` with one flattened
              sequence of T*F values per row; classification writes ``prob_<class>``,
              ``predicted``, ``entropy``, ``aleatoric``, ``epistemic`` (nats), forecasting
              ``mean``, ``std``, ``aleatoric``, ``epistemic`` (variances), ``lower``, ``upper``
              (90% predictive interval) per horizon step. Tagging and language-model runs read
              a ``.npy`` of int token ids (N, T) or a ``.txt`` file with one sequence per line
              (tagging: whitespace removed, as in training) and write one row per (sequence,
              step).
    report    Write ``report.html`` into a run directory: one self-contained page (inline CSS,
              figures as base64 PNGs) with the metrics, the figures that apply to the task
              (reliability, risk-coverage, forecast fan chart, generated samples), posterior
              attention, head importance and diagnostics
              (``probtransformer.report.write_report``). A later ``fit --out`` over the same
              directory replaces the whole run, report included.
    generate  Text from a language-model run (``models.generate``): the prompt and its
              continuation, then each generated token's entropy split into aleatoric and
              epistemic parts (nats), as a table or a CSV file.

Model and fit options left unset take the library defaults (the task's model, ``fit_svi``,
``fit_mcmc``), so tuning the library tunes the CLI; ``probtransformer fit --help`` shows them.
``--inference mcmc`` is the exception where those defaults would run for hours: it fits a small
fully Bayesian model on the first 200 training rows with short chains unless told otherwise
(``mcmc_preset``). Options of the other inference method, and of another task, are refused.

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
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from probtransformer._io import replace_directory
from probtransformer._rundir import (
    METRICS_FILE,
    POSTERIOR_DIR,
    TASKS,
    diagnostic_rows,
    is_run_dir,
    model_task,
    read_run,
    real_steps,
    run_data,
    run_splits,
    token_predictions,
)

PROG = "probtransformer"
INFERENCE_DATA_FILE = "inference_data.nc"
#: Token-level tasks export the log-likelihood (for LOO) and predictive draws of the first
#: this-many training and test sequences only (recorded as ``inference_data_rows``).
TOKEN_INFERENCE_DATA_ROWS = 500
TOKEN_TASKS = ("tagging", "language-modeling")
ATTENTION_FILE = "attention.png"
RELIABILITY_FILE = "reliability.png"
REPORT_FILE = "report.html"  # written by ``probtransformer report``, not by fit
SAMPLES_FILE = "samples.json"  # language-modeling runs: generated test continuations
PREDICTIONS_FILE = "predictions.csv"  # forecasting runs: every test forecast
FORECAST_FILE = "forecast.png"  # forecasting runs: fan chart of a few test forecasts
#: Everything a run directory may hold (``fit --out`` replaces such a directory, nothing else).
RUN_FILES = (
    METRICS_FILE,
    INFERENCE_DATA_FILE,
    POSTERIOR_DIR,
    ATTENTION_FILE,
    RELIABILITY_FILE,
    REPORT_FILE,
    SAMPLES_FILE,
    PREDICTIONS_FILE,
    FORECAST_FILE,
)
ECE_BINS = 15  # equal-width bins of the reported ECE and the reliability diagram
INTERVAL_PROB = 0.9  # forecasting: the predictive interval of coverage, width and the CSV
#: language-modeling runs: greedy continuations of SAMPLE_TOKENS tokens after the first
#: SAMPLE_PROMPT_LEN characters of SAMPLE_PROMPTS evenly spaced test windows
SAMPLE_PROMPTS, SAMPLE_PROMPT_LEN, SAMPLE_TOKENS = 3, 32, 80
MODELS = ("auto", "seq2seq")  # --model; auto: the task's model
#: Options that apply to some tasks only: dest -> (tasks, the value that means "not given").
TASK_OPTIONS = {"model": (("forecasting",), "auto")}
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

    def canonical(self, text: str) -> str:
        """``text`` in any case -> the registered spelling (unknown names pass through)."""
        return {name.lower(): name for name in self._names}.get(text.lower(), text)


DATASET_NAMES = _DatasetNames()


def _library_functions() -> dict[str, Callable[..., Any]]:
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
        help="fit a Bayesian Transformer to a dataset and write a run directory",
        description="Fit the model of the dataset's task, built from its meta: classification "
        "SequenceClassifier, tagging TokenTagger, language-modeling CausalLM, forecasting "
        "SequenceRegressor (or Seq2Seq with --model seq2seq). Writes "
        f"{METRICS_FILE}, {INFERENCE_DATA_FILE}, {POSTERIOR_DIR}/ and {ATTENTION_FILE} to "
        f"--out, plus {RELIABILITY_FILE} (classification, tagging), {SAMPLES_FILE} (generated "
        f"text, language-modeling) or {PREDICTIONS_FILE} and {FORECAST_FILE} (forecasting). "
        "Metrics are computed on the test split: classification accuracy, NLL, ECE, Brier; "
        "tagging token accuracy, NLL per token, ECE, boundary F1; language-modeling "
        "perplexity, NLL per token, next-token accuracy; forecasting RMSE, MAE, 90% interval "
        "coverage and width, CRPS. Options left unset take the library defaults; "
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
        type=lambda text: DATASET_NAMES.canonical(text.strip()),
        choices=DATASET_NAMES,
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
        "--model",
        default="auto",
        choices=MODELS,
        help="auto: the task's model; seq2seq: the encoder-decoder Seq2Seq (forecasting only) "
        "(default: %(default)s)",
    )
    fit.add_argument(
        "--num-train",
        type=_positive_int,
        metavar="N",
        help="fit on the first N rows of the training split: shuffled and stratified for "
        "classification, the first N 64-character windows for text, the N earliest origins for "
        f"forecasting; bounds the fit and the training log-likelihood of {INFERENCE_DATA_FILE}",
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
    checkpoints = fit.add_argument_group("svi and map only: checkpoints (fit_svi)")
    checkpoints.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        metavar="N",
        help="write the fit's state every N steps (and on Ctrl-C) to --checkpoint-dir",
    )
    checkpoints.add_argument(
        "--checkpoint-dir", metavar="DIR", help="checkpoint directory (default: OUT.checkpoint)"
    )
    checkpoints.add_argument(
        "--resume-from",
        metavar="DIR",
        help="continue the fit saved in this checkpoint directory (same dataset, model and "
        "settings) to the numbers an uninterrupted fit gives",
    )
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
        description="Predict with a run's posterior. Classification and forecasting runs: "
        "--input is a .npy array of shape (N, T, F) or a .csv file with one flattened sequence "
        "(T*F values, step by step) per row, optionally under a header row (non-numeric, or "
        "pandas' 0,1,...,T*F-1); one CSV row per sequence. Tagging and language-model runs: "
        "--input is a .npy array of int token ids of shape (N, T) or a .txt file with one "
        "sequence of characters per line (tagging: whitespace removed, as in training; "
        "characters outside the vocabulary map to <unk> with a warning); one CSV row per "
        "(sequence, step) with the token, the predicted tag (tagging, with its probabilities) "
        "or next token (language model, with its probability), and the entropy split into "
        "aleatoric and epistemic parts (nats).",
        formatter_class=functools.partial(_LibraryDefaultsFormatter, sources=("predict",)),
    )
    predict.set_defaults(handler=_predict)
    predict.add_argument("run_dir", metavar="DIR", help="run directory written by fit")
    predict.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help=".npy or .csv inputs (tagging and language-model runs: .npy or .txt)",
    )
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

    generate = commands.add_parser(
        "generate",
        help="generate text from a language-model run, with per-token uncertainty",
        description="Continue --prompt with a language-model run's posterior "
        "(probtransformer.models.generate) and print the prompt and its continuation, then "
        "each generated token's total entropy, aleatoric and epistemic parts in nats (a table, "
        "or a CSV file with --output). Prompt characters outside the vocabulary map to <unk> "
        "with a warning.",
        formatter_class=functools.partial(_LibraryDefaultsFormatter, sources=("generate",)),
    )
    generate.set_defaults(handler=_generate)
    generate.add_argument("run_dir", metavar="DIR", help="run directory of a language model")
    generate.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    generate.add_argument("--max-new-tokens", type=int, metavar="N", help="tokens to generate")
    generate.add_argument(
        "--strategy", choices=("greedy", "sample"), help="most probable token, or sample one"
    )
    generate.add_argument(
        "--temperature", type=float, metavar="T", help="> 0; below 1 sharpens, above 1 flattens"
    )
    generate.add_argument(
        "--top-k", type=int, metavar="K", help="keep the K most probable tokens (>= 1)"
    )
    generate.add_argument(
        "--top-p", type=float, metavar="P", help="keep the nucleus of probability mass P, in (0, 1]"
    )
    generate.add_argument(
        "--thompson",
        action="store_true",
        help="decode with one posterior draw chosen at the start (bayes_average=False) instead "
        "of the posterior predictive average",
    )
    generate.add_argument("--num-samples", type=int, metavar="S", help="posterior draws")
    generate.add_argument("--seed", type=int, metavar="N", help="seeds the draws and sampling")
    generate.add_argument(
        "--output", metavar="CSV", help="write the per-token table to this CSV file instead"
    )
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
    task = _dataset_task(args.dataset)
    _check_applicable(args, task)
    guide = INFERENCE_GUIDES.get(args.inference)
    if guide is not None and args.guide not in (None, guide):
        raise CLIError(
            f"--inference {args.inference} fits guide {guide!r}; got --guide {args.guide}"
        )
    name = args.dataset + ("-seq2seq" if args.model == "seq2seq" else "")
    target = Path(args.out or Path("runs") / f"{name}-{args.inference}")
    _check_out(target)
    num_train = args.num_train  # the user's; the mcmc preset's is capped at the split's size
    if args.inference == "mcmc":
        args = _with_mcmc_preset(args)

    import torch

    from probtransformer import datasets

    splits = datasets.load(args.dataset, seed=args.seed)
    meta = splits.meta
    if args.num_train is not None:
        if num_train is not None and num_train > len(splits.train):
            raise CLIError(
                f"--num-train {args.num_train} exceeds the {len(splits.train)} rows of the "
                f"{args.dataset} training split"
            )
        splits = dataclasses.replace(splits, train=splits.train[: args.num_train])
    model = _build_model(task, meta, args)
    with _intra_op_threads(args.threads):
        start = time.perf_counter()
        if args.inference == "mcmc":
            post = _fit_mcmc(model, splits.train, args)
        else:  # svi and the MAP-based fits
            post = _fit_svi(model, splits.train, args, guide, target)
        seconds = time.perf_counter() - start

        draws = _given(num_samples=_prediction_draws(post, args.num_samples), seed=args.seed)
        evaluation = EVALUATIONS[task](post, splits, draws, args)
        record = dict(
            **evaluation.metrics,
            num_train=len(splits.train),
            num_test=len(splits.test),
            **evaluation.sizes,
            seconds=seconds,
            dataset=args.dataset,
            task=task,
            model=type(model).__name__,
            val_fraction=meta["val_fraction"],
            inference=args.inference,
            **_fit_settings(post),
            num_samples=evaluation.num_samples,
            seed=args.seed,
            device=str(post.device),
            threads=torch.get_num_threads(),
        )
        if "class_names" in meta:
            record["class_names"] = meta["class_names"]
        _write_run(target, post, splits, record, draws, evaluation)
    _print_metrics(target, record, evaluation)


def _dataset_task(name: str) -> str:
    """The task of dataset ``name`` (``datasets.available()``), without loading it."""
    from probtransformer import datasets

    table = datasets.available()
    task = dict(zip(table["name"], table["task"], strict=True))[name]
    if task not in TASKS:
        raise CLIError(f"dataset {name} has task {task!r}, which {PROG} fit does not handle")
    return task


def _build_model(task: str, meta: dict, args: argparse.Namespace):
    """The model of ``task`` from the dataset's ``meta`` and the model options that were set."""
    from probtransformer.models import (
        CausalLM,
        Seq2Seq,
        SequenceClassifier,
        SequenceRegressor,
        TokenTagger,
    )

    options = _given(
        d_model=args.d_model,
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        d_ff=args.d_ff,
        dropout=args.dropout,
        bayesian=args.bayesian,
        **_attention_priors(args),
    )
    if task == "classification":
        if meta.get("grid") is not None:  # image patches: 2-D positions
            options["grid"] = tuple(meta["grid"])
        return SequenceClassifier(
            meta["in_features"], meta["num_classes"], meta["max_len"], **options
        )
    if task == "tagging":
        vocab_size = len(meta["vocab"])
        return TokenTagger(
            None, meta["num_classes"], meta["max_len"], vocab_size=vocab_size, **options
        )
    if task == "language-modeling":
        return CausalLM(meta["vocab"], meta["max_len"], **options)
    scales = {key: meta[key] for key in ("x_loc", "x_scale", "y_loc", "y_scale")}
    if args.model == "seq2seq":
        return Seq2Seq(meta["in_features"], meta["max_len"], meta["horizon"], **scales, **options)
    return SequenceRegressor(
        meta["in_features"],
        meta["max_len"],
        horizon=meta["horizon"],
        pooling="last",
        **scales,
        **options,
    )


@dataclasses.dataclass
class _Evaluation:
    """What ``fit`` measured on the test split, and how it writes its task's files.

    Attributes:
        metrics: the metrics, first in metrics.json.
        sizes: counts recorded after ``num_test`` (tokens, forecasts).
        num_samples: posterior draws the predictions used.
        write: ``write(staging, record)`` writes the task's files into the run directory.
        label: appended to the title of the attention figure of test example 0.
        lines: printed after the metrics.
    """

    metrics: dict[str, Any]
    sizes: dict[str, Any]
    num_samples: int
    write: Callable[[Path, dict], None]
    label: str = ""
    lines: list[str] = dataclasses.field(default_factory=list)


def _evaluate_classification(post, splits, draws: dict, args) -> _Evaluation:
    from probtransformer import metrics

    test = splits.test
    pred = post.predict(test.x, test.mask, **draws)
    probs = pred.mean  # (N, C)
    values = dict(
        accuracy=metrics.accuracy(probs, test.y),
        nll=metrics.nll(probs, test.y),
        ece=metrics.ece(probs, test.y, n_bins=ECE_BINS, strategy="uniform"),
        ece_bins=ECE_BINS,
        brier=metrics.brier(probs, test.y),
        mean_epistemic=float(pred.epistemic.mean()),
    )

    def write(staging: Path, record: dict) -> None:
        _write_reliability(staging, probs, test.y, f"{record['dataset']} test, {args.inference}")

    label = f" (label {int(test.y[0])})"
    return _Evaluation(values, {}, pred.probs.shape[0], write, label)


def _evaluate_tagging(post, splits, draws: dict, args) -> _Evaluation:
    """Token accuracy, NLL, ECE, F1 and epistemic uncertainty over the real test steps."""
    import torch
    from sklearn.metrics import f1_score

    from probtransformer import metrics

    probs, labels, epistemic, num_samples = [], [], [], 0
    for rows, pred in token_predictions(post, splits.test, draws):
        probs.append(real_steps(rows, pred.mean))  # (M, C)
        labels.append(real_steps(rows, rows.y))
        epistemic.append(real_steps(rows, pred.epistemic))
        num_samples = pred.probs.shape[0]
    probs, labels = torch.cat(probs), torch.cat(labels)
    predicted = probs.argmax(-1)
    if probs.shape[-1] == 2:  # positive class 1: a word boundary follows
        f1 = {"boundary_f1": float(f1_score(labels, predicted, pos_label=1, zero_division=0.0))}
    else:
        f1 = {"macro_f1": float(f1_score(labels, predicted, average="macro", zero_division=0.0))}
    values = dict(
        accuracy=metrics.accuracy(probs, labels),
        nll=metrics.nll(probs, labels),
        ece=metrics.ece(probs, labels, n_bins=ECE_BINS, strategy="uniform"),
        ece_bins=ECE_BINS,
        **f1,
        mean_epistemic=float(torch.cat(epistemic).mean()),
    )

    def write(staging: Path, record: dict) -> None:
        title = f"{record['dataset']} test characters, {args.inference}"
        _write_reliability(staging, probs, labels, title)

    return _Evaluation(values, {"num_test_tokens": len(labels)}, num_samples, write)


def _evaluate_language_model(post, splits, draws: dict, args) -> _Evaluation:
    """Perplexity, NLL per token and next-token accuracy, accumulated batch by batch (never
    every token's probabilities at once), and greedy samples from a few test prompts."""
    from probtransformer import metrics

    total_nll, correct, epistemic, count, num_samples = 0.0, 0, 0.0, 0, 0
    for rows, pred in token_predictions(post, splits.test, draws):
        probs, labels = metrics.token_level(pred.mean, rows.y, rows.mask)  # (M, V), (M,)
        total_nll += metrics.nll(probs, labels) * len(labels)
        correct += int((probs.argmax(-1) == labels).sum())
        epistemic += float(real_steps(rows, pred.epistemic).double().sum())
        count += len(labels)
        num_samples = pred.probs.shape[0]
    nll = total_nll / count
    values = dict(
        perplexity=math.exp(nll),
        nll=nll,
        accuracy=correct / count,
        mean_epistemic=epistemic / count,
    )
    samples = _language_model_samples(post, splits.test, draws)

    def write(staging: Path, record: dict) -> None:
        (staging / SAMPLES_FILE).write_text(json.dumps(samples, indent=1) + "\n")

    lines = []
    for i, sample in enumerate(samples["samples"], start=1):
        lines.append(
            f"  sample {i}: {_clip(sample['prompt'])} -> {_clip(sample['continuation'])} "
            f"(entropy {sample['mean_entropy']:.2f}, epistemic {sample['mean_epistemic']:.3f} "
            "nats/token)"
        )
    return _Evaluation(values, {"num_test_tokens": count}, num_samples, write, lines=lines)


def _language_model_samples(post, test, draws: dict) -> dict[str, Any]:
    """Greedy continuations of the first characters of a few evenly spaced test windows."""
    from probtransformer.datasets import decode_text
    from probtransformer.models import generate

    rows = sorted(set(np.linspace(0, len(test) - 1, SAMPLE_PROMPTS).round().astype(int).tolist()))
    options = dict(max_new_tokens=SAMPLE_TOKENS, strategy="greedy", seed=draws.get("seed", 0))
    if "num_samples" in draws:
        options["num_samples"] = draws["num_samples"]
    samples = []
    for row in rows:
        ids = test.x[row, :SAMPLE_PROMPT_LEN]
        if test.mask is not None:
            ids = ids[test.mask[row, :SAMPLE_PROMPT_LEN]]
        generation = generate(post, ids, **options)
        samples.append(
            dict(
                test_row=row,
                prompt=decode_text(ids, post.model.vocab),
                continuation=generation.text,
                mean_entropy=float(generation.entropy.mean()),
                mean_aleatoric=float(generation.aleatoric.mean()),
                mean_epistemic=float(generation.epistemic.mean()),
            )
        )
    return dict(options, samples=samples)


def _clip(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[: width - 1] + "…")


def _evaluate_forecasting(post, splits, draws: dict, args) -> _Evaluation:
    """RMSE, MAE, interval coverage and width, CRPS in the data's units, over every (origin,
    step) of the test split; the predictions CSV and the fan chart."""
    from probtransformer import metrics
    from probtransformer.report import forecast_figure, forecast_frame

    test = splits.test
    pred = post.predict(test.x, test.mask, **draws)
    lower, upper = pred.predictive_interval(INTERVAL_PROB)
    error = (pred.mean - test.y).double()
    values = dict(
        rmse=float(error.pow(2).mean().sqrt()),
        mae=float(error.abs().mean()),
        interval_coverage=metrics.interval_coverage(lower, upper, test.y),
        interval_prob=INTERVAL_PROB,
        interval_width=float((upper - lower).double().mean()),
        crps=metrics.crps_samples(pred.samples, test.y),
    )
    frame = forecast_frame(pred, test, splits.meta, prob=INTERVAL_PROB)

    def write(staging: Path, record: dict) -> None:
        from probtransformer import plots

        frame.to_csv(staging / PREDICTIONS_FILE, index=False)
        title = f"{record['dataset']} test forecasts, {record['model']}, {args.inference}"
        figure = forecast_figure(frame, splits.meta, prob=INTERVAL_PROB, title=title)
        plots.save_figure(figure, staging / FORECAST_FILE)

    sizes = dict(horizon=splits.meta.get("horizon"), num_test_forecasts=int(test.y.numel()))
    return _Evaluation(values, sizes, pred.samples.shape[0], write)


EVALUATIONS = {
    "classification": _evaluate_classification,
    "tagging": _evaluate_tagging,
    "language-modeling": _evaluate_language_model,
    "forecasting": _evaluate_forecasting,
}


def _write_reliability(staging: Path, probs, labels, title: str) -> None:
    from probtransformer import plots

    figure = plots.reliability_figure(probs, labels, n_bins=ECE_BINS, title=title)
    plots.save_figure(figure, staging / RELIABILITY_FILE)


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


def _check_applicable(args: argparse.Namespace, task: str) -> None:
    """Refuse settings of another task (``TASK_OPTIONS``), of the other inference method, or of
    the other MCMC kernel.

    Raises:
        CLIError: naming the options that were given but do not apply.
    """
    for dest, (tasks, unset) in TASK_OPTIONS.items():
        value = getattr(args, dest)
        if value is not None and value != unset and task not in tasks:
            raise CLIError(
                f"{_option(dest)} {value} applies to {' and '.join(tasks)} datasets, not "
                f"{args.dataset} ({task})"
            )
    if args.inference == "mcmc":
        given = [_option(d) for d in SVI_OPTIONS if getattr(args, d) is not None]
        applies_to = "--inference svi, map, mc-dropout and ensemble"
    else:
        given = [_option(d) for d in MCMC_OPTIONS if getattr(args, d) is not None]
        applies_to = "--inference mcmc"
    if not given and args.inference not in ("svi", "map"):
        given = [_option(d) for d in CHECKPOINT_OPTIONS if getattr(args, d) is not None]
        applies_to = "--inference svi and map"
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


def _fit_svi(model, train, args: argparse.Namespace, guide: str | None, target: Path):
    """svi: ``fit_svi``; map, mc-dropout, ensemble: their ``MAP_FITS`` function (fit_svi's
    settings without ``guide``; ensemble: ``n_members`` too)."""
    from probtransformer import inference

    if args.inference in MAP_FITS:
        fit, specific = getattr(inference, MAP_FITS[args.inference]), dict(n_members=args.n_members)
    else:
        fit, specific = inference.fit_svi, dict(guide=guide or args.guide)
    checkpoint_dir = args.checkpoint_dir
    if args.checkpoint_every is not None and checkpoint_dir is None:
        checkpoint_dir = target.absolute().with_name(f"{target.name}.checkpoint")
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
            checkpoint_every=args.checkpoint_every,
            checkpoint_dir=checkpoint_dir,
            resume_from=args.resume_from,
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


def _write_run(
    target: Path, post, splits, record: dict, draws: dict, evaluation: _Evaluation
) -> None:
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
        train = splits.train
        if record.get("task") in TOKEN_TASKS:  # 100 draws x 5,000 windows of 64 steps: ~30 min
            train, test = train[:TOKEN_INFERENCE_DATA_ROWS], test[:TOKEN_INFERENCE_DATA_ROWS]
            record["inference_data_rows"] = {"train": len(train), "test": len(test)}
        idata = post.to_inference_data(train, test=test, **draws)
        idata.to_netcdf(str(staging / INFERENCE_DATA_FILE))
        post.save(staging / POSTERIOR_DIR)
        first = test[:1]
        attention = post.attention(first.x, first.mask, **draws)
        title = f"posterior attention, {record['dataset']} test example 0{evaluation.label}"
        plots.save_figure(attention.plot(0, title=title), staging / ATTENTION_FILE)
        evaluation.write(staging, record)
        (staging / METRICS_FILE).write_text(json.dumps(record, indent=1) + "\n")
        replace_directory(staging, target)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise CLIError(f"cannot write --out {target}: {e.strerror or e}") from e
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


#: The metrics ``fit`` prints, by task: (metrics.json key, unit).
PRINTED_METRICS = {
    "classification": (
        ("accuracy", ""),
        ("nll", " nats"),
        ("ece", f" ({ECE_BINS} bins)"),
        ("brier", ""),
        ("mean_epistemic", " nats"),
    ),
    "tagging": (
        ("accuracy", " (per character)"),
        ("nll", " nats/character"),
        ("ece", f" ({ECE_BINS} bins)"),
        ("boundary_f1", ""),
        ("macro_f1", ""),
        ("mean_epistemic", " nats"),
    ),
    "language-modeling": (
        ("perplexity", ""),
        ("nll", " nats/token"),
        ("accuracy", " (next token)"),
        ("mean_epistemic", " nats/token"),
    ),
    "forecasting": (
        ("rmse", ""),
        ("mae", ""),
        ("interval_coverage", f" ({INTERVAL_PROB:.0%} predictive interval)"),
        ("interval_width", ""),
        ("crps", ""),
    ),
}


def _print_metrics(target: Path, record: dict, evaluation: _Evaluation | None = None) -> None:
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
    task = record.get("task", "classification")
    what = record["dataset"]
    if task != "classification":
        what += f" ({record['model']})"
    print(
        f"{what} · {record['inference']} ({how}) · "
        f"{record['num_train']} train / {record['num_test']} test · {record['seconds']:.1f} s fit"
    )
    if record.get("partial"):
        print(
            f"PARTIAL: sampling was interrupted; the run holds the {record['chains_kept']} x "
            f"{record['draws_per_chain']} draws kept of {record['num_chains']} x "
            f"{record['num_draws']} requested"
        )
    printed = [(key, unit) for key, unit in PRINTED_METRICS[task] if key in record]
    width = max(15, *(len(key) + 1 for key, _ in printed))
    for key, unit in printed:
        print(f"  {key:<{width}}{record[key]:.4f}{unit}")
    for line in evaluation.lines if evaluation else ():
        print(line)
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
    train = diagnostic_rows(record, run_splits(record, args.run_dir)[1])
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
    suffix = path.suffix.lower()
    if suffix not in (".npy", ".csv", ".txt"):
        raise CLIError(f"--input must be a .npy, .csv or .txt file, got {args.input!r}")
    if not path.is_file():
        raise CLIError(f"--input {args.input} does not exist or is not a file")
    record, post = read_run(args.run_dir)
    task = model_task(post.model)
    draws = _given(num_samples=args.num_samples, seed=args.seed)
    if task in TOKEN_TASKS:
        frame = _predict_tokens(path, record, post, task, draws, args.run_dir)
    else:
        if suffix == ".txt":
            raise CLIError(
                f"--input must be a .npy or .csv file for a {task} run, got {args.input!r}"
            )
        max_len, in_features = post.model.config["max_len"], post.model.config["in_features"]
        if suffix == ".npy":
            x = _read_npy(path, in_features)
        else:
            x = _read_csv(path, max_len, in_features)
        pred = post.predict(x, **draws)
        if task == "classification":
            frame = pred.to_dataframe(record.get("class_names"))
        else:
            frame = pred.to_dataframe()
    _write_csv(frame, args.output)


def _write_csv(frame, output: str | None) -> None:
    """``frame`` as CSV to ``output`` (--output), or to stdout."""
    if output is None:
        frame.to_csv(sys.stdout, index=False)
        return
    try:
        frame.to_csv(output, index=False)
    except OSError as e:
        raise CLIError(f"cannot write --output {output}: {e.strerror or e}") from e


def _predict_tokens(path: Path, record: dict, post, task: str, draws: dict, run_dir: str):
    """One row per real (sequence, step) of a tagging or language-model run's predictions."""
    import pandas as pd
    import torch

    from probtransformer.datasets import SequenceData

    if path.suffix.lower() == ".npy":
        x, mask = _read_token_npy(path, task), None
        vocab = _run_vocab(record, post, run_dir, required=False)
    elif path.suffix.lower() == ".txt":
        vocab = _run_vocab(record, post, run_dir)
        x, mask = _read_text(path, vocab, post.model.max_len, task)
    else:
        raise CLIError(
            f"--input must be a .npy of int token ids (N, T) or a .txt file for a {task} run, "
            f"got {str(path)!r}"
        )
    names = (lambda ids: [vocab[i] for i in ids]) if vocab else (lambda ids: list(map(str, ids)))
    data = SequenceData(torch.from_numpy(x), None, None if mask is None else torch.from_numpy(mask))
    frames, offset = [], 0
    for rows, pred in token_predictions(post, data, draws):
        n, steps = rows.x.shape
        keep = np.ones((n, steps), bool) if rows.mask is None else rows.mask.numpy()
        index = {
            "sequence": np.repeat(np.arange(offset, offset + n), steps),
            "step": np.tile(np.arange(steps), n),
            "token": names(rows.x.reshape(-1).tolist()),
        }
        if task == "tagging":
            tags = pred.to_dataframe(record.get("class_names")).drop(columns=["sequence", "step"])
            frame = pd.concat([pd.DataFrame(index), tags], axis=1)
        else:
            top = pred.mean.max(-1)  # (n, T): the most probable next token and its probability
            frame = pd.DataFrame(
                {
                    **index,
                    "predicted": names(top.indices.reshape(-1).tolist()),
                    "prob_predicted": top.values.reshape(-1).numpy(),
                    "entropy": pred.entropy.reshape(-1).numpy(),
                    "aleatoric": pred.aleatoric.reshape(-1).numpy(),
                    "epistemic": pred.epistemic.reshape(-1).numpy(),
                }
            )
        frames.append(frame[keep.reshape(-1)])
        offset += n
    return pd.concat(frames, ignore_index=True)


def _run_vocab(record: dict, post, run_dir: str, *, required: bool = True) -> list[str] | None:
    """The character vocabulary of a token run: the CausalLM's own, or the dataset's."""
    vocab = getattr(post.model, "vocab", None)
    if vocab is None and "dataset" in record and "seed" in record:
        try:
            vocab = run_data(record, run_dir)[2].get("vocab")
        except (ValueError, TypeError, ImportError):
            vocab = None
    if vocab is None and required:
        raise CLIError(
            "this run has no character vocabulary: give --input as a .npy of int token ids"
        )
    return vocab


def _read_token_npy(path: Path, task: str) -> np.ndarray:
    """Read int64 token ids of shape (N, T) from a .npy file (T may be below max_len).

    Raises:
        CLIError: not an integer .npy array, another shape, or no rows.
    """
    try:
        x = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise CLIError(f"cannot read {path} as a .npy array: {e}") from None
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "iu":
        raise CLIError(
            f"{path} must hold integer token ids for a {task} run, got dtype "
            f"{getattr(x, 'dtype', type(x).__name__)}"
        )
    if x.ndim != 2 or 0 in x.shape:
        raise CLIError(f"{path} must hold token ids of shape (N, T) with N, T >= 1, got {x.shape}")
    return x.astype(np.int64)


def _read_text(
    path: Path, vocab: list[str], max_len: int, task: str
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (N, T) and mask of a text file with one sequence per line (tagging:
    whitespace removed, as the training text was); a warning on stderr for characters outside
    the vocabulary (mapped to <unk>).

    Raises:
        CLIError: not UTF-8 text, a blank line, a line longer than ``max_len`` characters, or
            no sequence.
    """
    from probtransformer.datasets import encode_text

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise CLIError(f"{path} is not UTF-8 text: {e.reason}") from None
    sequences, unknown = [], 0
    for number, line in enumerate(lines, start=1):
        text = "".join(line.split()) if task == "tagging" else line
        if not text.strip():  # rows must keep the file's line numbers: refuse, do not skip
            raise CLIError(
                f"{path} line {number} is blank: give one sequence per line, without blank lines"
            )
        if len(text) > max_len:
            raise CLIError(
                f"{path} line {number}: {len(text)} characters, but the model reads at most "
                f"{max_len}; split the line"
            )
        ids, missing = encode_text(text, vocab)
        sequences.append(ids.numpy())
        unknown += missing
    if not sequences:
        raise CLIError(f"{path} holds no text")
    if unknown:
        _warn(f"{unknown} character(s) of {path} are outside the vocabulary; read as <unk>")
    steps = max(map(len, sequences))
    x = np.zeros((len(sequences), steps), dtype=np.int64)
    mask = np.zeros((len(sequences), steps), dtype=bool)
    for i, ids in enumerate(sequences):
        x[i, : len(ids)], mask[i, : len(ids)] = ids, True
    return x, mask


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {' '.join(message.split())}", file=sys.stderr)


# -- generate -----------------------------------------------------------------------------------


def _generate(args: argparse.Namespace) -> None:
    """``probtransformer generate``: continue a prompt with a language-model run."""
    record, post = read_run(args.run_dir)
    from probtransformer.models import CausalLM, generate

    if not isinstance(post.model, CausalLM):
        raise CLIError(
            f"{args.run_dir} is a {model_task(post.model)} run ({type(post.model).__name__}); "
            "generate needs a language-model run (fit --dataset pydoc-text)"
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generation = generate(
            post,
            args.prompt,
            bayes_average=not args.thompson,
            **_given(
                max_new_tokens=args.max_new_tokens,
                strategy=args.strategy,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                num_samples=args.num_samples,
                seed=args.seed,
            ),
        )
    for message in dict.fromkeys(str(w.message) for w in caught if w.category is UserWarning):
        _warn(message)
    print(args.prompt + (generation.text or ""))
    print()
    frame = generation.to_dataframe()
    if args.output is not None:
        _write_csv(frame, args.output)
        print(f"wrote {args.output}")
    else:
        print(f"{'step':>4}  {'token':<8}{'entropy':>9}{'aleatoric':>11}{'epistemic':>11}")
        for step, row in enumerate(frame.itertuples(index=False), start=1):
            print(
                f"{step:>4}  {row.token!r:<8}{row.entropy:>9.4f}{row.aleatoric:>11.4f}"
                f"{row.epistemic:>11.4f}"
            )
    print(
        f"mean over {len(generation)} tokens: entropy {float(generation.entropy.mean()):.4f}, "
        f"aleatoric {float(generation.aleatoric.mean()):.4f}, "
        f"epistemic {float(generation.epistemic.mean()):.4f} nats"
    )


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
