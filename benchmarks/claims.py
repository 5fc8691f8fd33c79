"""The source material's claims about attention design, tested on our tasks.

Claims (the source material's figures, from other models and data sets):

- full attention distribution vs hard selection of the top key: +2.3% accuracy in sequence
  labeling;
- 8 heads vs 1 head: 1.8 BLEU better on WMT14 En-De (we compare on our tasks' metrics);
- removing the feed-forward sublayer (FFN): perplexity +12% in language modelling;
- Transformer vs an LSTM of similar parameter count: attention's direct access to every step
  beats recurrence's sequential bottleneck;
- removing LayerNorm: LayerNorm gives 40% more stable training and 30% faster convergence.

Tasks: ``digits`` (``SequenceClassifier``: 8 rows of 8 pixels; test accuracy, NLL, ECE on the
450 test digits), ``wordseg`` (pydoc-wordseg, ``TokenTagger``: boundary F1 and token accuracy
over the real characters of the first 200 test rows, with their NLL and ECE) and ``lm``
(pydoc-text character ``CausalLM``: perplexity, NLL and top-label ECE of the posterior
predictive mean of the next character on the first 200 test rows, 12,800 characters). The
metric functions are ``benchmarks.studies.task_families``'.

Variants of each task: ``base`` (d_model 32, 8 heads so d_head 4, 2 layers, d_ff 128, soft
attention, pre-norm LayerNorm, dropout 0), ``hard`` (``hard_attention=True``), ``heads1``
(``num_heads=1``), ``noffn`` (``d_ff=0``), ``noln`` (``layer_norm=False``), ``noattn`` (text tasks
only: every attention head switched off, so the model learns with its convolutions and feed-forward
layers alone), ``before`` (text tasks only: the text models' defaults before issue 16's recipe,
``BEFORE_RECIPE``, fitted at lr 1e-2 decaying tenfold as they were), ``decay0.1`` (text tasks only:
the recipe at lr 3e-2 decaying tenfold), ``constant`` (word segmentation only: at 3e-2 held
constant, the tagger's rate before its warm-up and cosine decay), ``cosine`` (LM only: at the
tagger's rate, which the LM does not ship), all in ``VARIANT_FIT``, and ``lstm``
(``benchmarks/_lstm.py``: the same embedding, head and likelihood around a deterministic 2-layer
``nn.LSTM``, bidirectional for digits and wordseg, unidirectional for the causal LM; its hidden
size is the one whose parameter count, deterministic plus latent scalars, is closest to the base
Transformer's). Dropout is 0 everywhere: the LSTM has no counterpart of attention-weight dropout,
and these short fits are far from over-fitting.

Every row (``task/variant/seed``, seeds 0-2) is one ``fit_svi`` (mean-field guide, lr 1e-2 decaying
tenfold: ``task_families`` found the library's 3e-3 too slow for text models; the text tasks'
Transformers take the text recipe of issue 16 instead: the ``TokenTagger`` and ``CausalLM``
defaults, the tasks' ``fit_preset`` learning rate (word segmentation: 6e-2 after a warm-up over the
first 10% of the steps, decaying to 0 along a cosine; LM: 3e-2 held), and ``TEXT_SIZES``), then the
task's evaluation with ``Posterior.predict`` (20 draws). Steps and batch are fixed per task, the
same for all its variants, sized by timed pilots on 2 busy CPU cores (one thread) so a row takes
about a minute: digits 1,500 steps of 128 (0.97 accuracy for base), wordseg 1,000 of 32 and lm
1,200 of 32 (in pilots, batches of 32 scored better than batches of 64 in the same fitting time).
The fit seed is ``ctx.seed + seed``; the data split is always ``ctx.seed``'s. Timed pilot fits
(``pilot``: seconds per step and set-up) cut the steps only when the fit would overrun 80% of the
row budget (``BUDGET_S`` unless ``--budget``): ``budget_cut`` in the row, counted in the settings
lines. A fit whose ELBO turns non-finite is evaluated at its last finite parameters and marked
``diverged_at``. Each row stores the metrics, fit and evaluation seconds, parameter counts
(deterministic and latent scalars) and the training-loss trace: the per-observation negative ELBO
(``-ELBO / N_train``, nats per training sequence, KL included) averaged over ``TRACE_POINTS`` equal
blocks of steps.

Definitions used by ``markdown``:

- smoothed loss: the trailing mean of ``SMOOTH_BLOCKS`` trace points (5% of the steps);
  final loss: its last value (the mean loss of the last 5% of the steps);
- a difference of means is *within noise* when it is smaller than the larger of the two
  variants' sample sds over seeds;
- stability: the sd over seeds of the final loss; LayerNorm's gain is ``1 - sd(base) /
  sd(noln)`` (claim 40%) over the fits that did not diverge; the ratio of the two variances
  is within noise unless a two-sided F test with (n-1, n-1) degrees of freedom rejects
  equality at 5%; more diverged fits without LayerNorm than with it count as agreement;
- convergence: steps for the smoothed loss to first reach the threshold ``max(median final
  loss of base, median final loss of noln)``, so the median seed of both reaches it; the
  saving is ``1 - median steps(base) / median steps(noln)`` (claim 30%).

Run (72 rows of 20-180 s: about 1.5 hours on 2 busy CPU cores; ``--quick``: 24 tiny rows of
seed 0, in seconds)::

    python -m benchmarks.run --only claims
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from scipy import stats

from benchmarks import _suite
from benchmarks._lstm import LSTMLM, LSTMClassifier, LSTMTagger
from benchmarks._suite import Context, fmt, mean_spread
from benchmarks.studies.task_families import _classification, _lm_scores, _tagging_scores
from probtransformer import datasets, metrics, priors
from probtransformer.datasets import SequenceData
from probtransformer.inference import NonFiniteELBOError, fit_svi
from probtransformer.inference._runtime import pyro_scope, seeded
from probtransformer.models import CausalLM, SequenceClassifier, TokenTagger
from probtransformer.tasks.language_modeling import LanguageModelingTask
from probtransformer.tasks.tagging import TaggingTask

NAME = "claims"
TITLE = "Claims about attention design, tested on our tasks"

#: Seconds per row unless ``--budget`` says otherwise: a safety cap, not a target. Rows take
#: 20-80 s on 2 busy cores (about a minute on average); the cap cuts steps only where a row
#: would take about three times that, so every variant of a task normally runs the same steps.
BUDGET_S = 180.0
SEEDS = (0, 1, 2)
#: Transformer sizes shared by every variant; a variant overrides one of them.
BASE = dict(d_model=32, num_heads=8, num_layers=2, d_ff=128, dropout=0.0)
LSTM_LAYERS = 2
LR = 1e-2
#: The text models' defaults before issue 16's recipe (sinusoidal positions, the per-head
#: logit-scale prior, no convolution, d_ff 128), which the old text rows measured at lr ``LR``.
BEFORE_RECIPE = dict(
    positions="sinusoidal",
    attention_prior=priors.LogitScalePrior(),
    conv_kernel=0,
    d_ff=BASE["d_ff"],
)
#: Transformer keyword overrides per variant; ``lstm`` is the LSTM counterpart instead.
VARIANTS = {
    "base": {},
    "hard": {"hard_attention": True},
    "heads1": {"num_heads": 1},
    "noffn": {"d_ff": 0},
    "noln": {"layer_norm": False},
    "noattn": {"attention": False},
    "before": BEFORE_RECIPE,
    "decay0.1": {},
    "constant": {},
    "cosine": {},
    "lstm": None,
}
#: ``fit_svi`` overrides of the task's learning-rate settings per variant: the LSTM and the old
#: text rows keep ``LR`` decaying tenfold; ``decay0.1`` and ``constant`` are the recipe's rates
#: before text_recipe's rounds 3 (lr 3e-2 decaying tenfold) and 4 (3e-2 held constant);
#: ``cosine`` is the tagger's rate (``TAGGER_FIT``), tried on the LM.
OLD_FIT = {"lr": LR, "lr_decay": 0.1, "lr_warmup": 0.0, "lr_schedule": "exponential"}
VARIANT_FIT = {
    "lstm": OLD_FIT,
    "before": OLD_FIT,
    "decay0.1": {**OLD_FIT, "lr": 3e-2},
    "constant": {**OLD_FIT, "lr": 3e-2, "lr_decay": 1.0},
    "cosine": {"lr": 6e-2, "lr_warmup": 0.1, "lr_schedule": "cosine", "lr_decay": 0.0},
}
#: Variants run on some tasks only: attention ablated, to show what attention adds to the text
#: recipe's convolutions and feed-forward layers; the text models before the recipe.
VARIANT_TASKS = {
    **{v: ("wordseg", "lm") for v in ("noattn", "before", "decay0.1")},
    "constant": ("wordseg",),
    "cosine": ("lm",),
}
#: ``BASE`` overrides of the text recipe, so that its convolutions keep the parameter count
#: within 2% of the LSTM rows' (kept from before the recipe).
TEXT_SIZES = {"wordseg": {"d_ff": 124}, "lm": {}}
PILOT_STEPS = 10
FIT_SHARE = 0.8  # of ctx.budget_s for the fit; the rest for the pilot and the evaluation
TRACE_POINTS = 100
SMOOTH_BLOCKS = 5
QUICK_VARIANTS = tuple(VARIANTS)
#: ``fit_svi`` settings copied from the posterior's record into each row.
FIT_SETTINGS = (
    "guide", "num_steps", "batch_size", "lr", "lr_decay", "lr_warmup", "lr_schedule",
    "init_scale", "seed",
)  # fmt: skip
#: The learning-rate settings of ``fit_svi``, which a task's ``fit_preset`` may set.
RATE_SETTINGS = ("lr", "lr_decay", "lr_warmup", "lr_schedule")


@dataclass(frozen=True)
class Task:
    """One task of the section: data, fit sizes and metrics, the same for all its variants.

    Attributes:
        dataset: ``datasets.load`` name.
        num_steps: SVI steps of every variant (unless the budget cuts a row).
        batch_size: sequences per step.
        test_rows: the first this many test rows are scored (None: all).
        train_rows: the first this many training rows are fitted (None: all; quick runs).
        draws: posterior draws of the evaluation.
        metrics: ``{metric: True if higher is better}``, all in the per-task table
            (``HEADLINE`` names those the claims are judged on).
        rates: the learning-rate settings of the Transformer variants (``RATE_SETTINGS``; the
            LSTM's are ``OLD_FIT``).
        sizes: the task's overrides of ``BASE`` for every Transformer variant.
    """

    dataset: str
    num_steps: int
    batch_size: int
    test_rows: int | None
    metrics: dict[str, bool]
    train_rows: int | None = None
    draws: int = 20
    rates: dict = field(default_factory=lambda: dict(OLD_FIT))
    sizes: dict = field(default_factory=dict)


TASKS = {
    "digits": Task("digits", 1500, 128, None, {"accuracy": True, "nll": False, "ece": False}),
    # the text tasks' Transformers take the text recipe (the models' defaults and the CLI's
    # fit_preset learning rate; benchmarks/studies/text_recipe.py); the LSTM rows keep LR,
    # the tenfold decay and the hidden size matched to the base Transformer before the recipe
    "wordseg": Task(
        "pydoc-wordseg",
        1000,
        32,
        200,
        {"boundary_f1": True, "token_accuracy": True, "nll": False, "ece": False},
        rates={k: v for k, v in TaggingTask.fit_preset.items() if k in RATE_SETTINGS},
        sizes=TEXT_SIZES["wordseg"],
    ),
    "lm": Task(
        "pydoc-text",
        1200,
        32,
        200,
        {"perplexity": False, "nll": False, "ece": False},
        rates={k: v for k, v in LanguageModelingTask.fit_preset.items() if k in RATE_SETTINGS},
        sizes=TEXT_SIZES["lm"],
    ),
}
#: The metrics a claim is judged on, per task (the rest are shown in the per-task table).
HEADLINE = {
    "digits": ("accuracy",),
    "wordseg": ("token_accuracy", "boundary_f1"),
    "lm": ("perplexity",),
}
QUICK_SIZES = dict(num_steps=5, train_rows=64, test_rows=16, draws=4)


@dataclass(frozen=True)
class Claim:
    """A claim that ``variant`` does worse than ``base``.

    ``home``: ``(task, metric, claimed change in %)`` where the claim gives a figure for a
    setting of ours: the relative change of the variant's metric vs base's.
    """

    variant: str
    text: str
    home: tuple[str, str, float] | None = None


CLAIMS = (
    Claim(
        "hard",
        "full attention vs hard top-1 selection: +2.3% accuracy (sequence labeling)",
        ("wordseg", "token_accuracy", -2.3),
    ),
    Claim("heads1", "8 heads vs 1 head: +1.8 BLEU (WMT14 En-De)"),
    Claim(
        "noffn",
        "removing the FFN: perplexity +12% (language modelling)",
        ("lm", "perplexity", 12.0),
    ),
    Claim("lstm", "Transformer vs LSTM of similar parameter count: attention beats recurrence"),
)


def task_of(key: str, ctx: Context) -> tuple[str, str, int, Task]:
    """``"wordseg/noln/1"`` -> ``("wordseg", "noln", 1, Task)`` (quick sizes with ctx.quick)."""
    name, variant, seed = key.split("/")
    task = TASKS[name]
    return name, variant, int(seed), replace(task, **QUICK_SIZES) if ctx.quick else task


def row_keys(ctx: Context) -> list[str]:
    """``task/variant/seed`` for every task, variant and seed (quick: seed 0)."""
    variants, seeds = (QUICK_VARIANTS, SEEDS[:1]) if ctx.quick else (tuple(VARIANTS), SEEDS)
    return [
        f"{t}/{v}/{s}"
        for t in TASKS
        for v in variants
        if t in VARIANT_TASKS.get(v, TASKS)
        for s in seeds
    ]


# ---------------------------------------------------------------------------------------------
# models and data
# ---------------------------------------------------------------------------------------------


def load_data(task: Task, seed: int) -> tuple[SequenceData, SequenceData, dict]:
    """Training rows and the scored test rows of ``task`` (split by ``seed``), and ``meta``."""
    splits = datasets.load(task.dataset, seed=seed)
    train, test = splits.train, splits.test
    if task.train_rows is not None:
        train = train[: task.train_rows]
    if task.test_rows is not None:
        test = test[: task.test_rows]
    return train, test, splits.meta


def transformer(name: str, meta: dict, *, attention: bool = True, **options) -> torch.nn.Module:
    """The task's Transformer with ``BASE`` sizes updated by ``options``; ``attention=False``
    switches every head off (``head_active``), leaving each attention sublayer its output bias:
    the model learns without attention."""
    model = _transformer(name, meta, **{**BASE, **TASKS[name].sizes, **options})
    if not attention:
        for modules in model.attention_modules.values():
            for module in modules:
                module.head_active.zero_()
    return model


def _transformer(name: str, meta: dict, **sizes) -> torch.nn.Module:
    if name == "digits":
        return SequenceClassifier(
            meta["in_features"], meta["num_classes"], meta["max_len"], **sizes
        )
    if name == "wordseg":
        vocab = len(meta["vocab"])
        return TokenTagger(None, meta["num_classes"], meta["max_len"], vocab_size=vocab, **sizes)
    return CausalLM(meta["vocab"], meta["max_len"], **sizes)


def lstm(name: str, meta: dict, hidden_size: int) -> torch.nn.Module:
    """The task's LSTM counterpart (``benchmarks/_lstm.py``) with ``hidden_size`` per direction."""
    sizes = dict(d_model=BASE["d_model"], hidden_size=hidden_size, num_layers=LSTM_LAYERS)
    if name == "digits":
        return LSTMClassifier(meta["in_features"], meta["num_classes"], meta["max_len"], **sizes)
    if name == "wordseg":
        vocab = len(meta["vocab"])
        return LSTMTagger(None, meta["num_classes"], meta["max_len"], vocab_size=vocab, **sizes)
    return LSTMLM(len(meta["vocab"]), meta["max_len"], **sizes)


def parameter_counts(model: torch.nn.Module, data: SequenceData) -> dict[str, int]:
    """Scalars of ``model``: deterministic (``nn.Parameter``s) and latent (unobserved sample
    sites, the data plate's subsample aside, of one trace on the first rows of ``data``)."""
    rows = data[:2]
    with pyro_scope(), torch.no_grad(), seeded(0, torch.device("cpu")):
        trace = poutine.trace(model).get_trace(rows.x, rows.y, rows.mask)
    latent = sum(
        site["value"].numel()
        for site in trace.nodes.values()
        if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)
    )
    deterministic = sum(p.numel() for p in model.parameters())
    return {"deterministic": deterministic, "latent": latent, "total": deterministic + latent}


def matching_hidden_size(
    build: Callable[[int], torch.nn.Module], target: int, data: SequenceData
) -> int:
    """The hidden size whose model ``build(h)`` has the total parameter count closest to
    ``target`` (counts grow with ``h``: bisection)."""

    def total(h: int) -> int:
        return parameter_counts(build(h), data)["total"]

    low, high = 1, 1
    while total(high) < target:
        low, high = high, 2 * high
    while high - low > 1:  # total(low) < target <= total(high), or low == high == 1
        mid = (low + high) // 2
        low, high = (mid, high) if total(mid) < target else (low, mid)
    return min((low, high), key=lambda h: abs(total(h) - target))


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------


def evaluate(name: str, post, test: SequenceData, draws: int, seed: int) -> dict[str, float]:
    """The task's test metrics (``benchmarks.studies.task_families``' definitions)."""
    if name == "lm":
        return _lm_scores(post, test, draws, seed)
    pred = post.predict(test.x, test.mask, num_samples=draws, seed=seed, batch_size=64)
    if name == "digits":
        return _classification(pred.mean, test.y)
    return _tagging_scores(*metrics.token_level(pred.mean, test.y, test.mask))


def loss_trace(elbo: list[float], num_data: int) -> tuple[list[float], list[int]]:
    """Per-observation negative ELBO averaged over ``TRACE_POINTS`` equal blocks of steps, and
    the step count at the end of each block."""
    loss = -np.asarray(elbo, dtype=np.float64) / num_data
    blocks = np.array_split(loss, min(TRACE_POINTS, len(loss))) if len(loss) else []
    ends = np.cumsum([len(b) for b in blocks])
    return [float(b.mean()) for b in blocks], [int(e) for e in ends]


def _fit(model, train: SequenceData, **svi) -> tuple[object, float, int | None]:
    """``fit_svi``; the posterior, seconds, and the step where the ELBO turned non-finite."""
    start = time.perf_counter()
    try:
        post, diverged_at = fit_svi(model, train, progress=False, **svi), None
    except NonFiniteELBOError as e:
        post, diverged_at = e.posterior, e.step
    return post, time.perf_counter() - start, diverged_at


def pilot(model, train: SequenceData, **svi) -> tuple[float, float]:
    """Seconds per step and set-up seconds of a fit: the difference of a 2-step and a
    ``PILOT_STEPS + 2``-step fit over ``PILOT_STEPS`` (a negative difference, from noise on a
    busy machine, falls back to the longer fit's mean step, set-up included)."""
    _, short, _ = _fit(model, train, num_steps=2, **svi)
    _, long, _ = _fit(model, train, num_steps=PILOT_STEPS + 2, **svi)
    step = (long - short) / PILOT_STEPS
    if step <= 0:
        step = long / (PILOT_STEPS + 2)
    return step, max(short - 2 * step, 0.0)


def run_row(key: str, ctx: Context) -> dict:
    """Fit one variant of one task with one seed and score it (see the module docstring)."""
    name, variant, seed, task = task_of(key, ctx)
    train, test, meta = load_data(task, ctx.seed)
    base = transformer(name, meta)
    base_counts = parameter_counts(base, train)
    hidden_size = None
    if variant == "lstm":
        hidden_size = matching_hidden_size(
            lambda h: lstm(name, meta, h), base_counts["total"], train
        )
        model = lstm(name, meta, hidden_size)
    else:
        model = transformer(name, meta, **VARIANTS[variant])
    fit_seed = ctx.seed + seed
    svi = dict(batch_size=task.batch_size, **task.rates, device=ctx.device)
    svi |= dict(seed=fit_seed, **VARIANT_FIT.get(variant, {}))
    step_seconds, setup_seconds, num_steps = None, None, task.num_steps
    if task.num_steps > PILOT_STEPS:
        step_seconds, setup_seconds = pilot(model, train, **svi)
        num_steps = _suite.budgeted_steps(
            step_seconds,
            FIT_SHARE * ctx.budget_s - setup_seconds,
            max_steps=task.num_steps,
            min_steps=1,
        )
    post, fit_seconds, diverged_at = _fit(model, train, num_steps=num_steps, **svi)
    start = time.perf_counter()
    scores = evaluate(name, post, test, task.draws, fit_seed)
    eval_seconds = time.perf_counter() - start
    trace, trace_steps = loss_trace(post.record["elbo"], len(train))
    return {
        "task": name,
        "variant": variant,
        "seed": seed,
        "fit_seed": fit_seed,
        **scores,
        "model": type(model).__name__,
        "config": model.config,
        "parameters": parameter_counts(model, train),
        "base_parameters": base_counts,
        "lstm_hidden_size": hidden_size,
        "num_steps": num_steps,
        "planned_steps": task.num_steps,
        "budget_cut": num_steps < task.num_steps,
        "diverged_at": diverged_at,
        "pilot_step_seconds": step_seconds,
        "pilot_setup_seconds": setup_seconds,
        "fit_seconds": fit_seconds,
        "eval_seconds": eval_seconds,
        "loss_trace": trace,
        "loss_trace_steps": trace_steps,
        "settings": {
            **{k: post.record[k] for k in FIT_SETTINGS},
            "device": ctx.device,
            "num_train": len(train),
            "num_test": len(test),
            "draws": task.draws,
            "data_seed": ctx.seed,
        },
    }


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------


def _by_variant(rows: dict[str, dict]) -> dict[tuple[str, str], list[dict]]:
    """Rows grouped by ``(task, variant)``, in seed order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in sorted(rows.values(), key=lambda r: r["seed"]):
        groups.setdefault((row["task"], row["variant"]), []).append(row)
    return groups


def smoothed(row: dict) -> np.ndarray:
    """Trailing mean of ``SMOOTH_BLOCKS`` points of the row's loss trace."""
    trace = np.asarray(row["loss_trace"], dtype=np.float64)
    cumulative = np.concatenate([[0.0], np.cumsum(trace)])
    ends = np.arange(1, len(trace) + 1)
    starts = np.maximum(ends - SMOOTH_BLOCKS, 0)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def final_loss(row: dict) -> float | None:
    """Last smoothed loss (the mean of the last 5% of the steps); None for a diverged fit."""
    return None if row["diverged_at"] is not None else float(smoothed(row)[-1])


def steps_to_reach(row: dict, threshold: float) -> int | None:
    """Steps until the smoothed loss is first at or below ``threshold`` (None: never)."""
    below = np.flatnonzero(smoothed(row) <= threshold)
    return int(row["loss_trace_steps"][below[0]]) if len(below) else None


def _sd(values: list[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else math.nan


def _median_steps(steps: list[int | None]) -> float:
    """Median over seeds, a seed that never reached the threshold counting as infinite."""
    return float(np.median([math.inf if s is None else s for s in steps]))


def compare(base: list[float], variant: list[float], higher_is_better: bool) -> dict:
    """Means, the relative change of ``variant`` vs ``base`` in %, and whether the variant is
    worse than base: ``"yes"``, ``"no"``, or ``"within noise"`` when the difference of means is
    smaller than the larger sd over seeds (``"one seed"`` without a spread)."""
    mb, mv = float(np.mean(base)), float(np.mean(variant))
    change = 100.0 * (mv - mb) / abs(mb) if mb else math.nan
    spread = max(_sd(base), _sd(variant))
    if math.isnan(spread):
        verdict = "one seed"
    elif abs(mv - mb) < spread:
        verdict = "within noise"
    else:
        verdict = "yes" if (mv < mb) == higher_is_better else "no"
    return {"base": mb, "variant": mv, "change_pct": change, "verdict": verdict}


def _claims_table(groups, figures: dict[str, dict]) -> tuple[list[str], list[dict]]:
    lines = [
        "| claim | task | our comparison (variant vs base, mean ± sd over seeds) | agrees? |",
        "|---|---|---|---|",
    ]
    outcomes = []
    for claim in CLAIMS:
        text = claim.text  # on the claim's first row only
        for name, task in TASKS.items():
            base, variant = groups.get((name, "base")), groups.get((name, claim.variant))
            if not base or not variant:
                continue
            for metric in HEADLINE[name]:
                b, v = [r[metric] for r in base], [r[metric] for r in variant]
                outcome = compare(b, v, task.metrics[metric])
                outcomes.append({**outcome, "claim": claim, "task": name, "metric": metric})
                verdict = outcome["verdict"]
                if claim.home and claim.home[:2] == (name, metric):
                    verdict += f" ({outcome['change_pct']:+.1f}% vs claimed {claim.home[2]:+.1f}%)"
                lines.append(
                    f"| {text} | {name} | {metric}: {claim.variant} {mean_spread(v)} vs "
                    f"base {mean_spread(b)} ({outcome['change_pct']:+.1f}%) | {verdict} |"
                )
                text = ""
    for claim, cell in (
        ("removing LayerNorm: LayerNorm gives 40% more stable training", _stability_cell),
        ("removing LayerNorm: LayerNorm gives 30% faster convergence", _convergence_cell),
    ):
        for name, f in figures.items():
            comparison, verdict = cell(f)
            lines.append(f"| {claim} | {name} | {comparison} | {verdict} |")
            claim = ""
    return lines, outcomes


def _stability_cell(f: dict) -> tuple[str, str]:
    return (
        f"sd of the final training loss over seeds: noln {fmt(f['sd_noln'], 4)} vs base "
        f"{fmt(f['sd_base'], 4)} (LayerNorm's gain {f['stability_gain_pct']:+.0f}%)",
        f["stability_verdict"],
    )


def _convergence_cell(f: dict) -> tuple[str, str]:
    if "threshold" not in f:
        return "", f["convergence_verdict"]
    steps = [
        f"{m:,.0f}" if math.isfinite(m) else "never"
        for m in (f["median_steps_noln"], f["median_steps_base"])
    ]
    return (
        f"median steps to the loss threshold: noln {steps[0]} vs base {steps[1]} "
        f"(LayerNorm's saving {f['convergence_saving_pct']:+.0f}%)",
        f["convergence_verdict"],
    )


def _task_tables(groups) -> list[str]:
    lines = []
    for name, task in TASKS.items():
        present = [v for v in VARIANTS if (name, v) in groups]
        if not present:
            continue
        cols = list(task.metrics)
        lines += [
            f"| {name} | " + " | ".join(cols) + " | final train loss | parameters "
            "(latent) | fit s | seeds |",
            "|---|" + "---:|" * (len(cols) + 4),
        ]
        for variant in present:
            rs = groups[name, variant]
            finals = [final_loss(r) for r in rs]
            params = rs[0]["parameters"]
            diverged = sum(r["diverged_at"] is not None for r in rs)
            seeds = f"{len(rs)}" + (f" ({diverged} diverged)" if diverged else "")
            cells = [mean_spread([r[m] for r in rs], 4) for m in cols]
            lines.append(
                f"| {variant} | " + " | ".join(cells) + f" | {mean_spread(finals)} | "
                f"{fmt(params['total'])} ({fmt(params['latent'])}) | "
                f"{np.mean([r['fit_seconds'] for r in rs]):.0f} | {seeds} |"
            )
        lines.append("")
    return lines


def layer_norm_figures(base: list[dict], noln: list[dict]) -> dict:
    """Stability and convergence of ``base`` vs ``noln`` (definitions: module docstring)."""
    fb = [f for f in map(final_loss, base) if f is not None]
    fn = [f for f in map(final_loss, noln) if f is not None]
    diverged = len(noln) - len(fn), len(base) - len(fb)
    out = {"sd_base": _sd(fb), "sd_noln": _sd(fn), "diverged_noln": diverged[0]}
    out["diverged_base"] = diverged[1]
    spreads = out["sd_base"], out["sd_noln"]
    positive = all(sd > 0 for sd in spreads)  # False for nan (one seed) too
    out["stability_gain_pct"] = 100.0 * (1.0 - spreads[0] / spreads[1]) if positive else math.nan
    if positive:
        ratio = (spreads[1] / spreads[0]) ** 2
        f = stats.f(len(fn) - 1, len(fb) - 1)
        out["f_test_p"] = float(min(1.0, 2 * min(f.cdf(ratio), f.sf(ratio))))
    else:
        out["f_test_p"] = math.nan
    if diverged[0] > diverged[1]:
        out["stability_verdict"] = f"yes (noln diverged in {diverged[0]} of {len(noln)} seeds)"
    elif math.isnan(out["f_test_p"]):
        out["stability_verdict"] = "no spread to compare"
    elif out["f_test_p"] >= 0.05:
        out["stability_verdict"] = "within noise"
    else:
        out["stability_verdict"] = "yes" if out["sd_base"] < out["sd_noln"] else "no"
    if not fb or not fn:
        return {**out, "convergence_verdict": "no finished fit"}
    threshold = max(float(np.median(fb)), float(np.median(fn)))
    steps_b = [steps_to_reach(r, threshold) for r in base]
    steps_n = [steps_to_reach(r, threshold) for r in noln]
    mb, mn = _median_steps(steps_b), _median_steps(steps_n)
    spread = max(_sd([s for s in steps if s is not None]) for steps in (steps_b, steps_n))
    base_start = min(float(smoothed(r)[0]) for r in base)
    if float(np.median(fn)) >= base_start:  # both "reach" it at their first recorded step
        verdict = (
            f"yes (noln's median final loss {float(np.median(fn)):,.1f} is above base's "
            f"first recorded loss {base_start:,.1f}: noln did not learn)"
        )
    elif math.isinf(mb) or math.isinf(mn):
        verdict = "yes" if mb < mn else "no" if mn < mb else "neither reached"
    elif math.isnan(spread):
        verdict = "too few seeds"
    elif abs(mb - mn) < spread:
        verdict = "within noise"
    else:
        verdict = "yes" if mb < mn else "no"
    return {
        **out,
        "threshold": threshold,
        "steps_base": steps_b,
        "steps_noln": steps_n,
        "median_steps_base": mb,
        "median_steps_noln": mn,
        "convergence_saving_pct": 100.0 * (1.0 - mb / mn) if math.isfinite(mn) else math.nan,
        "convergence_verdict": verdict,
    }


def _steps_cell(steps: list[int | None], median: float) -> str:
    each = ", ".join("never" if s is None else f"{s:,}" for s in steps)
    return f"{f'{median:,.0f}' if math.isfinite(median) else 'never'} ({each})"


def _layer_norm_figures(groups) -> dict[str, dict]:
    """``layer_norm_figures`` of every task with base and noln rows."""
    return {
        name: layer_norm_figures(groups[name, "base"], groups[name, "noln"])
        for name in TASKS
        if (name, "base") in groups and (name, "noln") in groups
    }


def _layer_norm_table(figures: dict[str, dict]) -> list[str]:
    lines = [
        "| task | final loss sd: base / noln | LayerNorm stability gain (claim 40%) | "
        "F-test p | agrees? | threshold | median steps: base (seeds) | noln (seeds) | "
        "LayerNorm saving (claim 30%) | agrees? |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for name, f in figures.items():
        convergence = ["", "", "", ""]
        if "threshold" in f:
            convergence = [
                fmt(f["threshold"]),
                _steps_cell(f["steps_base"], f["median_steps_base"]),
                _steps_cell(f["steps_noln"], f["median_steps_noln"]),
                f"{fmt(f['convergence_saving_pct'], 0)}%",
            ]
        lines.append(
            f"| {name} | {fmt(f['sd_base'], 4)} / {fmt(f['sd_noln'], 4)} | "
            f"{fmt(f['stability_gain_pct'], 0)}% | {fmt(f['f_test_p'], 2)} | "
            f"{f['stability_verdict']} | " + " | ".join(convergence) + " | "
            f"{f['convergence_verdict']} |"
        )
    return lines


def _settings_lines(groups) -> list[str]:
    lines = []
    for name in TASKS:
        rows = [r for (t, _), rs in groups.items() if t == name for r in rs]
        if not rows:
            continue
        s = rows[0]["settings"]
        base = rows[0]["base_parameters"]
        lstm_rows = groups.get((name, "lstm"))
        lstm_text = ""
        if lstm_rows:
            p = lstm_rows[0]["parameters"]
            lstm_text = (
                f"; LSTM hidden {lstm_rows[0]['lstm_hidden_size']} per direction: "
                f"{fmt(p['total'])} ({fmt(p['deterministic'])} + {fmt(p['latent'])})"
            )
        steps = sorted({r["num_steps"] for r in rows})
        cut = sum(r["budget_cut"] for r in rows)
        lines.append(
            f"- {name}: {' / '.join(f'{n:,}' for n in steps)} steps"
            + (f" ({cut} rows cut by the budget)" if cut else "")
            + f", batch {s['batch_size']}, {_rate_text(s)}, "
            f"{s['num_train']:,} training / {s['num_test']:,} test rows, {s['draws']} draws; base "
            f"Transformer {fmt(base['total'])} parameters ({fmt(base['deterministic'])} "
            f"deterministic + {fmt(base['latent'])} latent){lstm_text}."
        )
    return lines


def _rate_text(settings: dict) -> str:
    """The learning rate of a row's settings in words (rows before the warm-up lack it)."""
    lr, final = settings["lr"], settings["lr"] * settings["lr_decay"]
    warmup = settings.get("lr_warmup", 0.0)
    text = f"lr {lr:g}" + (f" after a warm-up over {warmup:.0%} of the steps" if warmup else "")
    shape = settings.get("lr_schedule", "exponential")
    if final == lr:
        return text + " held constant"
    return text + f" decaying to {final:g}" + (" along a cosine" if shape == "cosine" else "")


def _reading(outcomes: list[dict], figures: dict[str, dict], groups) -> list[str]:
    counts = {v: sum(o["verdict"] == v for o in outcomes) for v in ("yes", "within noise", "no")}
    lines = [
        f"- Of {len(outcomes)} comparisons of a claimed-worse variant with base, "
        f"{counts['yes']} agree beyond the seed spread, {counts['within noise']} are within "
        f"noise and {counts['no']} go the other way."
    ]
    for claim in CLAIMS:
        if not claim.home:
            continue
        name, metric, claimed = claim.home
        hit = [
            o
            for o in outcomes
            if o["claim"] is claim and (o["task"], o["metric"]) == (name, metric)
        ]
        if hit:
            o = hit[0]
            sizes = [groups[name, v][0]["parameters"]["total"] for v in ("base", claim.variant)]
            fewer = 100.0 * (1.0 - sizes[1] / sizes[0])
            lines.append(
                f"- {claim.variant} on {name}: {metric} {o['change_pct']:+.1f}% vs base "
                f"(claimed {claimed:+.1f}%): {o['verdict']}"
                + (f"; the variant has {fewer:.0f}% fewer parameters." if fewer > 10 else ".")
            )
    lstm_outcomes = [o for o in outcomes if o["claim"].variant == "lstm"]
    if lstm_outcomes:
        better = [f"{o['task']} {o['metric']}" for o in lstm_outcomes if o["verdict"] == "no"]
        lines.append(
            "- The parameter-matched LSTM is worse than base beyond noise on "
            f"{sum(o['verdict'] == 'yes' for o in lstm_outcomes)} of {len(lstm_outcomes)} "
            "metrics" + (f", better on {', '.join(better)}" if better else "") + "; its "
            "recurrent weights are point estimates, where the Transformer's attention "
            "projections are mean-field latents."
        )
    if figures:
        parts = [
            f"{name}: stability {f['stability_verdict']}, convergence {f['convergence_verdict']}"
            for name, f in figures.items()
        ]
        lines.append("- LayerNorm (base vs noln): " + "; ".join(parts) + ".")
    steps = sorted({r["num_steps"] for rs in groups.values() for r in rs})
    seeds = max(len(rs) for rs in groups.values())
    span = f"{steps[0]:,}" if len(steps) == 1 else f"{steps[0]:,} to {steps[-1]:,}"
    lines.append(
        f"- Scope: d_model-32 models, {span} SVI steps, {seeds} seed(s); the source's figures "
        "come from full-size models trained to convergence, so a difference here holds for "
        "these sizes and this training length."
    )
    return lines


def markdown(rows: dict[str, dict], ctx: Context) -> str:
    """Settings, the claims table, per-task tables, LayerNorm figures and a generated reading."""
    expected = row_keys(ctx)
    missing = [k for k in expected if k not in rows]
    rows = {k: rows[k] for k in expected if k in rows}
    if not rows:
        return "No rows yet: run `python -m benchmarks.run --only claims`.\n"
    groups = _by_variant(rows)
    figures = _layer_norm_figures(groups)
    claims, outcomes = _claims_table(groups, figures)
    out = ["Settings (every variant of a task alike):", "", *_settings_lines(groups), ""]
    if missing:
        out += [f"{len(missing)} of {len(expected)} rows missing: {', '.join(missing)}.", ""]
    out += [*claims, ""]
    out += [
        "Every variant per task (mean ± sd over seeds; final train loss: per-sequence negative "
        "ELBO over the last 5% of the steps):",
        "",
        *_task_tables(groups),
    ]
    out += [
        "LayerNorm: stability = sd over seeds of the final training loss; convergence = steps "
        "for the smoothed loss (trailing mean over 5% of the steps) to reach the larger of the "
        "two variants' median final losses:",
        "",
        *_layer_norm_table(figures),
        "",
        *_reading(outcomes, figures, groups),
    ]
    return "\n".join(out) + "\n"


def plot(rows: dict[str, dict], ctx: Context) -> list[Path]:
    """Smoothed training-loss curves of every variant per task (mean over seeds; base and noln
    with their min-max band over seeds), saved as ``<cache stem>_loss.png``."""
    from matplotlib.figure import Figure

    groups = _by_variant(rows)
    names = [n for n in TASKS if any(t == n for t, _ in groups)]
    if not names:
        return []
    fig = Figure(figsize=(5 * len(names), 4), layout="constrained")
    for ax, name in zip(fig.subplots(1, len(names), squeeze=False)[0], names, strict=True):
        for variant in VARIANTS:
            rs = groups.get((name, variant))
            if not rs:
                continue
            length = min(len(r["loss_trace"]) for r in rs)
            curves = np.stack([smoothed(r)[:length] for r in rs])
            steps = rs[0]["loss_trace_steps"][:length]
            emphasis = variant in ("base", "noln")
            line = ax.plot(steps, curves.mean(0), lw=2 if emphasis else 1, label=variant)[0]
            if emphasis and len(rs) > 1:
                ax.fill_between(
                    steps, curves.min(0), curves.max(0), color=line.get_color(), alpha=0.2
                )
        ax.set(title=name, xlabel="SVI step", ylabel="-ELBO / N (smoothed)", yscale="log")
        ax.legend(fontsize="small")
    cache = ctx.cache(NAME)
    path = cache.with_name(f"{cache.stem}_loss.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return [path]
