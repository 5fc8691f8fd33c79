"""The argument parser of ``probtransformer``: its sub-commands, errors on one line, and the
options of the commands that read a run directory (diagnose, predict, report, generate, serve);
``fit``'s options are in ``cli.fit_parser``, the help formatter in ``cli.help``."""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable
from typing import NoReturn

from probtransformer.cli import diagnose as diagnose_command
from probtransformer.cli import generate as generate_command
from probtransformer.cli import predict as predict_command
from probtransformer.cli import report as report_command
from probtransformer.cli import serve as serve_command
from probtransformer.cli._common import PROG
from probtransformer.cli.argtypes import float_in, positive_int, seed
from probtransformer.cli.fit_parser import add_fit_parser
from probtransformer.cli.help import LibraryDefaultsFormatter
from probtransformer.rundir import METRICS_FILE, REPORT_FILE


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one stderr line, like every other error of the CLI."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


#: DIR of the commands that also read the posterior fit keeps when its evaluation stops.
KEPT_TOO = "run directory written by fit, or the OUT.posterior it keeps when evaluating fails"


def _run_command(
    commands: argparse._SubParsersAction,
    handler: Callable[[argparse.Namespace], int],
    name: str,
    *,
    run_dir_help: str = "run directory written by fit",
    library_defaults: bool = False,
    **parser_options,
) -> argparse.ArgumentParser:
    """The parser of command ``name``, which reads a run directory: calls ``handler`` and takes
    the directory as its first argument ``DIR``; with ``library_defaults`` its help shows the
    defaults of the library function behind each option."""
    if library_defaults:
        parser_options["formatter_class"] = functools.partial(
            LibraryDefaultsFormatter, sources=(name,)
        )
    parser = commands.add_parser(name, **parser_options)
    parser.set_defaults(handler=handler)
    parser.add_argument("run_dir", metavar="DIR", help=run_dir_help)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``probtransformer`` with its sub-commands.

    Returns:
        An ``ArgumentParser`` whose errors print one line and exit with status 2.
    """
    parser = _Parser(
        prog=PROG,
        description="Bayesian Transformers in Pyro: fit, diagnose, predict, report, generate and "
        "serve from the shell.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_fit_parser(commands)

    diagnose = _run_command(
        commands,
        diagnose_command.run,
        "diagnose",
        run_dir_help=KEPT_TOO,
        help="print convergence diagnostics and PSIS-LOO of a run",
        description="Reload a run's posterior and its training data (dataset and seed from "
        f"{METRICS_FILE}) and print the aggregated diagnostics table, the verdict and LOO.",
        library_defaults=True,
    )
    diagnose.add_argument(
        "--num-samples", type=positive_int, metavar="S", help="posterior draws to summarise"
    )

    predict = _run_command(
        commands,
        predict_command.run,
        "predict",
        run_dir_help=KEPT_TOO,
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
        library_defaults=True,
    )
    predict.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help=".npy or .csv inputs (tagging and language-model runs: .npy or .txt)",
    )
    predict.add_argument("--output", metavar="FILE", help="CSV to write (default: stdout)")
    predict.add_argument(
        "--num-samples",
        type=positive_int,
        metavar="S",
        help="posterior draws (an MCMC run: the same number from each chain, rounded up, at "
        "most every kept draw)",
    )
    predict.add_argument("--seed", type=seed, help="seeds the draws")

    report = _run_command(
        commands,
        report_command.run,
        "report",
        help=f"write a self-contained {REPORT_FILE} into a run directory",
        description=f"Write DIR/{REPORT_FILE}: one HTML file with inline CSS and every figure "
        "embedded as a PNG, with sections metrics, reliability, risk-coverage (by total entropy "
        "and by epistemic uncertainty, with AURC), attention (posterior mean and sd per layer "
        "and head), head-importance and diagnostics. The test and training rows are reloaded "
        f"from the dataset and seed in {METRICS_FILE}.",
    )
    report.add_argument(
        "--num-samples",
        type=positive_int,
        metavar="S",
        help=f"posterior draws (default: the run's, from {METRICS_FILE})",
    )
    report.add_argument("--seed", type=seed, help="seeds the draws (default: the run's seed)")

    generate = _run_command(
        commands,
        generate_command.run,
        "generate",
        run_dir_help="run directory of a language model",
        help="generate text from a language-model run, with per-token uncertainty",
        description="Continue --prompt with a language-model run's posterior "
        "(probtransformer.models.generate) and print the prompt and its continuation, then "
        "each generated token's total entropy, aleatoric and epistemic parts in nats (a table, "
        "or a CSV file with --output). Prompt characters outside the vocabulary map to <unk> "
        "with a warning.",
        library_defaults=True,
    )
    generate.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    generate.add_argument(
        "--max-new-tokens", type=positive_int, metavar="N", help="tokens to generate"
    )
    generate.add_argument(
        "--strategy", choices=("greedy", "sample"), help="most probable token, or sample one"
    )
    generate.add_argument(
        "--temperature",
        type=float_in(0, math.inf, above=True),
        metavar="T",
        help="> 0; below 1 sharpens, above 1 flattens",
    )
    generate.add_argument(
        "--top-k", type=positive_int, metavar="K", help="keep the K most probable tokens (>= 1)"
    )
    generate.add_argument(
        "--top-p",
        type=float_in(0, 1, above=True),
        metavar="P",
        help="keep the nucleus of probability mass P, in (0, 1]",
    )
    generate.add_argument(
        "--thompson",
        action="store_true",
        help="decode with one posterior draw chosen at the start (bayes_average=False) instead "
        "of the posterior predictive average",
    )
    generate.add_argument("--num-samples", type=positive_int, metavar="S", help="posterior draws")
    generate.add_argument("--seed", type=seed, metavar="N", help="seeds the draws and sampling")
    generate.add_argument(
        "--output", metavar="CSV", help="write the per-token table to this CSV file instead"
    )

    serve = _run_command(
        commands,
        serve_command.run,
        "serve",
        run_dir_help=KEPT_TOO,
        help="serve a run's uncertainty-aware predictions over HTTP",
        description="Serve a run over HTTP (FastAPI and uvicorn: pip install "
        "'probtransformer[serve]'): POST /predict (probabilities or predictive mean, entropy "
        "split into aleatoric and epistemic parts, intervals, attention, per-draw values), "
        "POST /generate (language-model runs, server-sent events), GET /health, GET "
        "/metadata; OpenAPI at /docs. Concurrent /predict requests with the same seed, "
        "num_samples, attention flag and sequence length are merged into one vectorized pass. "
        "SIGTERM or Ctrl-C stop taking connections and answer the requests in flight first.",
    )
    serve_command.add_arguments(serve)
    return parser
