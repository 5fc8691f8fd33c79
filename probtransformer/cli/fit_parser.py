"""The ``fit`` command's parser: its options in their groups (your own data, svi and the MAP
fits, checkpoints, ensemble, mile, laplace, mcmc, model), the bounds they are checked against
and the names ``--dataset`` and ``--model`` accept. Which options apply to which inference method is
checked after parsing (``cli.options.check_applicable``)."""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Iterator

from probtransformer.cli import fit as fit_command
from probtransformer.cli.argtypes import (
    float_in,
    int_in,
    non_negative_int,
    positive_int,
    prior_precision,
    probability_below_one,
    seed,
)
from probtransformer.cli.help import LibraryDefaultsFormatter
from probtransformer.cli.library_defaults import DATASET_NAMES as DATASET_NAMES_TABLE
from probtransformer.cli.options import (
    HESSIANS,
    INFERENCES,
    INITS,
    KERNELS,
    LAPLACE_SUBSETS,
    LR_SCHEDULES,
    PREDICTIVES,
    SVI_METHODS,
)
from probtransformer.rundir import (
    ATTENTION_FILE,
    INFERENCE_DATA_FILE,
    METRICS_FILE,
    POSTERIOR_DIR,
)
from probtransformer.tasks import TASKS
from probtransformer.tasks.classification import RELIABILITY_FILE
from probtransformer.tasks.forecasting import FORECAST_FILE, PREDICTIONS_FILE
from probtransformer.tasks.language_modeling import SAMPLES_FILE

#: ``--threads`` at most (torch crashes on absurd thread counts; no machine has more cores).
MAX_THREADS = 1024
#: ``--num-layers`` at most: ten times the deepest GPT-3; building 100,000 blocks took minutes
#: of Python before any check on memory could run.
MAX_LAYERS = 1024

#: --model: "auto" (each task's own model) and the variants some tasks offer.
MODELS = tuple(dict.fromkeys(model for task in TASKS.values() for model in task.models))


class _DatasetNames:
    """``choices`` for ``--dataset``: the names of ``datasets.available()``, in any case.

    Listing them from the registry imports torch; ``library_defaults.DATASET_NAMES`` names
    them without (and is tested to be the registry's).
    """

    _names = DATASET_NAMES_TABLE

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def canonical(self, text: str) -> str:
        """``text`` in any case -> the registered spelling (unknown names pass through)."""
        return {name.lower(): name for name in self._names}.get(text.lower(), text)


DATASET_NAMES = _DatasetNames()


def _parts(text: str) -> tuple[str, ...]:
    """argparse type: a comma-separated list such as ``attention,head`` ('' for none)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


#: --trajectory-length at most: HMC's leapfrog steps are the length over the step size, 10^5
#: steps at a step size of 0.01 (Pyro's default length is 2π).
MAX_TRAJECTORY_LENGTH = 1000


def add_fit_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``fit`` command to ``commands`` (``build_parser``'s sub-commands): its options,
    with help that shows the library defaults unset options take (and ``mcmc: ...``, what
    ``--inference mcmc``'s preset uses instead).

    Returns:
        The ``fit`` parser, whose handler is ``cli.fit.run``.
    """
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
        "'mcmc: ...' shows what --inference mcmc uses instead (mcmc_preset: the quality "
        "benchmark's classifier, every part Bayesian, on the full training split; ChEES-HMC "
        "with 4 chains from 2 MAP starts, about 8 minutes for digits on one CPU thread).",
        formatter_class=functools.partial(
            LibraryDefaultsFormatter,
            sources=("model", "fit", "predict", "mcmc", "ensemble", "mile", "laplace"),
            mcmc=True,
        ),
    )
    fit.set_defaults(handler=fit_command.run)
    fit.add_argument(
        "--dataset",
        type=lambda text: DATASET_NAMES.canonical(text.strip()),
        choices=DATASET_NAMES,
        metavar="NAME",
        help="dataset, one of: %(choices)s (default: digits, unless --data)",
    )
    table = fit.add_argument_group(
        "your own data",
        "--data FILE fits a .csv or .parquet table instead of --dataset: long (a row per step, "
        "--id and --time) or wide (a row per sequence). Splits as the built-in datasets: 25% "
        "of the sequences test, 10% of the rest val, stratified by class; classes, vocabulary "
        "and feature scaling learned on train and saved in the run, so predict reads files of "
        "the same layout.",
    )
    table.add_argument("--data", metavar="FILE", help="a .csv or .parquet table of sequences")
    table.add_argument("--target", metavar="COL", help="the target column (with --data)")
    table.add_argument("--id", metavar="COL", help="long layout: the sequence id column")
    table.add_argument("--time", metavar="COL", help="long layout: the time column")
    table.add_argument(
        "--features",
        metavar="COLS",
        type=lambda text: [c.strip() for c in text.split(",") if c.strip()],
        help="comma-separated feature columns (default: every other column)",
    )
    table.add_argument(
        "--task",
        choices=("classification", "tagging", "forecasting"),
        help="classification: a target per sequence; tagging: per step (default: inferred); "
        "forecasting: one series (no --id), windows of --context steps -> --horizon steps",
    )
    table.add_argument("--context", type=positive_int, metavar="L", help="--task forecasting")
    table.add_argument("--horizon", type=positive_int, metavar="H", help="--task forecasting")
    fit.add_argument(
        "--inference",
        default="svi",
        choices=INFERENCES,
        help="svi; map: a point estimate, fit_map (fit_svi with guide delta); mcmc: fit_mcmc "
        "(--kernel chees, mclmc, adjusted-mclmc, nuts or hmc); "
        "mc-dropout: MAP with dropout kept on at prediction (fit_mc_dropout, needs --dropout > "
        "0); ensemble: a deep ensemble of MAP fits (fit_ensemble); mile: the ensemble, then "
        "MCLMC (or --kernel chees, adjusted-mclmc) chains around each member, tuned per member "
        "(fit_mile, "
        "Sommer et al. 2025); laplace: a MAP fit, then a Gaussian around it with the prior "
        "precision the evidence chooses (fit_laplace); mola: the ensemble, then one Laplace "
        "approximation per member, a mixture (fit_mola, Eschenhagen et al. 2021) "
        "(default: %(default)s)",
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
        type=positive_int,
        metavar="N",
        help="fit on the first N rows of the training split: shuffled and stratified for "
        "classification, the first N 64-character windows for text, the N earliest origins for "
        f"forecasting; bounds the fit and the training log-likelihood of {INFERENCE_DATA_FILE}",
    )
    fit.add_argument(
        "--num-samples", type=positive_int, metavar="S", help="posterior draws for predictions"
    )
    fit.add_argument(
        "--seed",
        type=seed,
        default=0,
        help="seeds the data split, the fit and the draws (default: %(default)s)",
    )
    fit.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where to fit")
    fit.add_argument(
        "--threads",
        type=int_in(1, MAX_THREADS),
        metavar="N",
        help=f"intra-op CPU threads of torch, at most {MAX_THREADS:,}",
    )
    fit.add_argument(
        "--out",
        metavar="DIR",
        help="run directory (default: runs/<dataset>-<inference>, or -2, -3, ... when that "
        "holds a run)",
    )
    fit.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run that --out holds (without it, fit refuses to)",
    )
    fit.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="hide the progress bar (and the line on threads before it)",
    )
    svi = fit.add_argument_group(f"{SVI_METHODS} only")
    svi.add_argument(
        "--guide", choices=("normal", "lowrank", "mvn", "delta"), help="SVI variational family"
    )
    svi.add_argument("--num-steps", type=positive_int, metavar="N", help="optimisation steps")
    svi.add_argument("--batch-size", type=positive_int, metavar="N", help="sequences per step")
    svi.add_argument(
        "--lr", type=float_in(0, 10, above=True), help="initial Adam learning rate, in (0, 10]"
    )
    svi.add_argument(
        "--lr-decay",
        type=float_in(0, 1),
        metavar="F",
        help="final learning rate as a fraction of --lr, in (0, 1] ([0, 1] with --lr-schedule "
        "cosine); 1 holds it constant",
    )
    svi.add_argument(
        "--lr-warmup",
        type=probability_below_one,
        metavar="F",
        help="fraction of the steps over which the learning rate rises linearly to --lr, in [0, 1)",
    )
    svi.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        help="how the learning rate decays after the warm-up, from --lr to --lr x --lr-decay",
    )
    svi.add_argument(
        "--init-scale",
        type=float_in(0, 10, above=True),
        metavar="S",
        help="svi only: initial sd of the guide, in (0, 10]; Adam grows it by about --lr per "
        "step, so from 1e-3 a fit shorter than the default keeps almost none (diagnose WARNs) "
        "and 0.1 lets it reach the ELBO's optimum",
    )
    checkpoints = fit.add_argument_group("svi and map only: checkpoints (fit_svi)")
    checkpoints.add_argument(
        "--checkpoint-every",
        type=positive_int,
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
    ensemble = fit.add_argument_group("ensemble, mile and mola")
    ensemble.add_argument(
        "--n-members",
        type=positive_int,
        metavar="K",
        help="ensemble members, fitted with seeds seed, seed+1, ...",
    )
    mile = fit.add_argument_group(
        "mile only",
        "--inference mile also takes --kernel (mclmc or chees), --num-warmup, --num-draws, "
        "--compile and --temperature, and the SVI options for its ensemble",
    )
    mile.add_argument(
        "--chains-per-member",
        type=positive_int,
        metavar="N",
        help="chains started from each member (chees: at least 2)",
    )
    mile.add_argument(
        "--thinning",
        type=positive_int,
        metavar="N",
        help="mclmc: integrator steps per kept draw",
    )
    _add_laplace_options(fit)
    mcmc = fit.add_argument_group("mcmc only")
    mcmc.add_argument(
        "--kernel",
        choices=KERNELS,
        help="MCMC kernel: chees (ChEES-HMC), mclmc (unadjusted microcanonical Langevin) and "
        "adjusted-mclmc (its Metropolis-adjusted, exact version) run every chain in one "
        "vectorized pass; nuts and hmc are Pyro's, one chain at a time",
    )
    mcmc.add_argument("--num-chains", type=positive_int, metavar="N", help="independent chains")
    mcmc.add_argument(
        "--num-starts",
        type=positive_int,
        metavar="M",
        help="the many-chain kernels only: starting points, --num-chains / M chains each (a "
        "superchain, for nested R-hat); M must divide --num-chains; unset with --num-chains "
        "or --init given: one per chain (one for --init map)",
    )
    mcmc.add_argument(
        "--init",
        choices=INITS,
        help="the many-chain kernels only: start from prior draws, one MAP fit (--num-starts 1) "
        "or an ensemble of M MAP fits",
    )
    mcmc.add_argument(
        "--num-warmup",
        type=non_negative_int,
        metavar="N",
        help="adaptation transitions per chain, discarded (mclmc: tuning integrator steps)",
    )
    mcmc.add_argument("--num-draws", type=positive_int, metavar="N", help="kept draws per chain")
    mcmc.add_argument(
        "--target-accept-prob",
        type=float_in(0, 1, above=True, below=True),
        metavar="P",
        help="nuts, hmc, chees and adjusted-mclmc: acceptance probability in (0, 1) the step "
        "size is adapted to (chees: the harmonic mean over chains)",
    )
    mcmc.add_argument(
        "--max-tree-depth",
        type=positive_int,
        metavar="N",
        help="NUTS only: at most 2**N - 1 leapfrog steps per transition",
    )
    mcmc.add_argument(
        "--trajectory-length",
        type=float_in(0, MAX_TRAJECTORY_LENGTH, above=True),
        metavar="L",
        help="hmc: integration time per transition (leapfrog steps: L / step size); chees: "
        "the initial one, then adapted",
    )
    mcmc.add_argument(
        "--jit-compile",
        action=argparse.BooleanOptionalAction,
        help="nuts and hmc only: trace the log density with the PyTorch JIT",
    )
    mcmc.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="the many-chain kernels only: evaluate the K-chain log density as a torch.compile'd "
        "graph, checked against the eager one (compiling takes 15-60 s)",
    )
    mcmc.add_argument(
        "--temperature",
        type=float_in(0, math.inf, above=True),
        metavar="T",
        help="the many-chain kernels and mile: the likelihood enters as p(y | θ)^(1/T), a "
        "tempered "
        "posterior; recorded and shown by diagnose (1: the Bayesian posterior)",
    )
    mcmc.add_argument(
        "--map-steps",
        type=non_negative_int,
        metavar="N",
        help="Adam steps of the MAP fits: --init map or ensemble starts, and the parts left "
        "out of --bayesian",
    )
    model = fit.add_argument_group("model")
    model.add_argument("--d-model", type=positive_int, metavar="N", help="model width")
    model.add_argument("--num-heads", type=positive_int, metavar="N", help="heads per layer")
    model.add_argument(
        "--num-layers",
        type=int_in(1, MAX_LAYERS),
        metavar="N",
        help=f"Transformer blocks, at most {MAX_LAYERS:,}",
    )
    model.add_argument("--d-ff", type=positive_int, metavar="N", help="feed-forward width")
    model.add_argument(
        "--dropout", type=probability_below_one, metavar="P", help="dropout probability, in [0, 1)"
    )
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
        type=int_in(0),
        metavar="W",
        help="guidance prior: attention near |i - j| <= W (priors.AttentionLogitPrior with "
        "local_window(W, outside=0.01), strength 1)",
    )
    return fit


def _add_laplace_options(fit: argparse.ArgumentParser) -> None:
    """The options of ``fit_laplace``'s own settings (``--inference laplace`` and ``mola``)."""
    laplace = fit.add_argument_group(
        "laplace and mola only",
        "the Laplace approximation around the MAP fit (laplace) or every ensemble member "
        "(mola); the mode is fitted with the SVI options (mola: and --n-members)",
    )
    laplace.add_argument(
        "--laplace-subset",
        choices=LAPLACE_SUBSETS,
        help="the latents that get the Gaussian: head (the output layer), attention (the "
        "attention projections) or all (every latent with real support); the rest stay at "
        "the mode",
    )
    laplace.add_argument(
        "--hessian",
        choices=HESSIANS,
        help="the generalized Gauss-Newton curvature: full (refused above 1 GiB) or its "
        "diagonal (any subset size)",
    )
    laplace.add_argument(
        "--prior-precision",
        type=prior_precision,
        metavar="P",
        help="marglik: one precision per latent site that maximizes the Laplace evidence; "
        "prior: the model's own prior; or one number > 0 (1/scale^2) for every site",
    )
    laplace.add_argument(
        "--predictive",
        choices=PREDICTIVES,
        help="glm: the network linearized around each draw's mode (Immer et al. 2021); nn: "
        "the network at the drawn weights",
    )
