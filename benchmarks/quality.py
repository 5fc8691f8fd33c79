"""Uncertainty quality: are the Bayesian fits' uncertainties better than the cheap alternatives?

Three classification data sets, each with classes held out of training as out-of-distribution
(OOD) inputs, built by ``datasets.load(name, val_fraction=0, holdout_classes=...)`` (training
rows of the held-out classes are dropped, the test split keeps the other classes, and
``meta["ood"]`` holds every row of the held-out classes, from the training and the test part;
labels keep their numbers, so the model still has an output per class, held-out ones included):

- ``digits``: scikit-learn's 8x8 digits (8 steps of 8 pixels, the library's stratified 75/25
  split), digits 8 and 9 held out;
- ``ArrowHead`` (UCR: 251 steps, the archive's train/test split), class ``"2"`` held out, 2 of
  3 classes left; series are cut into patches of ``ceil(251 / 50) = 6`` consecutive values (42
  tokens) by ``benchmarks.studies.task_families._patch``, so attention runs over at most 50 steps;
- ``JapaneseVowels`` (UEA: 12 channels, 7-29 steps, ragged with a mask; 9 speakers), speakers
  8 and 9 (labels 7 and 8) held out, 7 left.

Methods, one row per data set x method x seed (seeds 0, 1, 2; the fit seed is ``ctx.seed +
seed``, the data split always ``ctx.seed``'s, so the seeds vary initialisation, mini-batches
and predictive draws only):

- ``svi-meanfield``: ``fit_svi(guide="normal")``; ``svi-lowrank``: ``guide="lowrank"``;
- ``svi-stochastic``: mean-field SVI with stochastic attention, ``attention_prior=
  (LogitScalePrior(), StochasticAttentionPrior(kl_weight=0.01))`` (amortized guide of the
  logits; ``kl_weight`` 0.01 as in BENCHMARKS.md, the exact ELBO under-fits);
- ``map``: ``fit_map``; ``mc-dropout``: ``fit_mc_dropout`` (the model's dropout 0.1 kept on at
  prediction); ``ensemble``: ``fit_ensemble(batched=False)`` with 5 MAP members, each
  ``fit_map(seed=seed + k)``; ``ensemble-batched``: the same 5 starts fitted as one batched
  optimisation through the draw dim (``fit_ensemble``'s default), sharing mini-batches;
- ``nuts``: ``fit_mcmc(kernel="nuts")`` of a small fully Bayesian model (``NUTS_MODEL``, pinned:
  the preset of ``probtransformer fit --inference mcmc`` when these rows were measured; d_model
  8, 2 heads, 1 layer, d_ff 16, every part latent, at most 2**6 - 1 leapfrog steps per
  transition, log density JIT-traced) on at most 200 training rows (a stratified subsample,
  fixed by the data seed), one chain of 100 warm-up + 100 kept transitions;
- ``chees``: ``fit_mcmc(kernel="chees", init="ensemble")`` (ChEES-HMC, Hoffman, Radul &
  Sountsov 2021, K chains through the model's draw dim) of ``MODEL`` with every part latent
  and dropout 0 (``CHEES_MODEL``) on the whole training split: 10 chains from 5 MAP starts
  (superchains of 2 chains, for nested R-hat), the starts' MAP fits at most 1,000 Adam steps,
  at most 60 warm-up + 20 kept transitions per chain. Its fit may take ``CHEES_COST_RATIO``
  (5) x the ensemble's fit seconds of the same data set and seed, measured in the same process
  (``RUN_ORDER`` runs the ensemble first; without that row, a timed ensemble pilot estimates
  them); ``plan_chees`` cuts the MAP steps and transitions from timed K-chain gradients (see
  Budget);
- ``chees-perchain``: the same ChEES fit of ``MODEL`` itself (its latent parts: attention
  projections, logit scales, head), whose point-estimate parts (embedding, FFN, LayerNorm) each
  MAP start fits, from the model re-initialised with its own seed, and each chain keeps: a deep
  ensemble's features with the Bayesian parts sampled around every member (eval mode: dropout
  off while sampling);
- ``laplace``, ``laplace-attention``, ``mola``: ``fit_laplace`` (MacKay 1992; Daxberger et al.
  2021; MoLA: Eschenhagen et al. 2021) around the MAP fit (``map``'s settings; last layer with
  the full GGN, or the attention projections with its diagonal) or around every member of the
  batched ensemble fitted in the same process (``mola``, last layer), the prior precision per
  site from the Laplace evidence, predictions from ``Sizes.draws`` draws of the linearized
  (GLM) predictive; they run after ``map`` and ``ensemble-batched`` (``RUN_ORDER``), reuse
  their fits, and record the cost against the batched ensemble's fit seconds
  (``benchmarks.quality_laplace``).

Every other method fits the same ``SequenceClassifier`` (``MODEL``: d_model 32, 4 heads, 1
layer, d_ff 64, dropout 0.1; latent attention projections, logit scales and output head, the
library default) with the same optimiser settings on a data set: 1,000 Adam steps at lr 1e-2
decaying to 1e-3; batch 128 on digits, 64 on JapaneseVowels, the full 24 series on ArrowHead.
The architecture is ``benchmarks.studies.task_families``' UCR model. On validation parts of the
training splits (seed 0; the test splits unused) these settings gave the SVI fits (mean-field,
low-rank, stochastic attention) and MAP validation accuracy 0.96-1.00 on digits and
JapaneseVowels and 0.875 (7 of 8 series) on ArrowHead;
1,000 steps stay clear of the collapse to the prior that a converged mean-field fit shows on
ArrowHead's few series (BENCHMARKS.md, task families).

Metrics on the in-distribution test split, from the posterior predictive mean of 100 draws
(ensemble: its 5 members; NUTS: its 100 kept draws; MAP: its one point estimate): accuracy,
NLL (nats), ECE (15 equal-width bins), Brier score (multiclass, summed over classes), and AURC,
the area under the risk-coverage curve when test rows are accepted in order of increasing total
predictive entropy (``metrics.aurc``; lower is better). OOD AUROC: the test rows against every
held-out row, scored by the total predictive entropy and by its epistemic part (the mutual
information between label and parameters; left blank for MAP, whose single draw has none).
``fit_seconds`` is the wall time of the fit call (NUTS: warm-up and sampling, JIT tracing
included; ChEES: MAP starts, warm-up and sampling). Each row also records the steps or
transitions actually run, sizes, the model config, the fit settings and, for NUTS, the
sampler's divergences, tree depths and step size; for ChEES, K, M, the chain-gradients, the
divergences, the mean acceptance, the adapted step size and trajectory length, the mean
leapfrog steps per transition, the nested R-hat of the log density (``lp``; Margossian et al.
2024, arviz-stats, superchains = starts) and its fit seconds against the ensemble's.

Budget: each row keeps its fit to a share of ``ctx.budget_s``; ``benchmarks.quality_fits``
says how each method's steps, transitions or draws are cut to it.

Run (about 40 minutes on 2 unloaded CPU cores, one torch thread, without ChEES, whose nine
rows may take 5x the ensemble's fit seconds each: up to about another hour; ``--quick``: digits
and ArrowHead, seed 0, 5 steps, 3 + 3 NUTS transitions on 40 rows, 4 ChEES chains of 3 + 3
transitions, about 30 s)::

    python -m benchmarks.run --only quality

The Laplace rows of one data set with their batched ensemble, in one process (3 seeds)::

    python -m benchmarks.run --only quality/digits/ensemble-batched quality/digits/laplace \\
        quality/digits/laplace-attention quality/digits/mola --force

ChEES and the ensemble alone, measured together (the ensemble first, ``RUN_ORDER``)::

    python -m benchmarks.run --only quality/digits/ensemble quality/digits/chees --force
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.model_selection import train_test_split

from benchmarks._suite import Context
from benchmarks.quality_fits import (
    FULL,
    QUICK,
    SETUPS,
    Sizes,
    fit_chees,
    fit_nuts,
    fit_optimised,
    fit_route,
    optimised_settings,
    pilot_step_seconds,
)
from benchmarks.quality_laplace import LAPLACE_METHODS, fit_laplace_row, mode_method
from benchmarks.studies.task_families import _patch
from probtransformer import datasets, metrics, priors
from probtransformer.block import BAYESIAN_PARTS
from probtransformer.datasets import SequenceData
from probtransformer.inference import (
    Posterior,
)
from probtransformer.models import SequenceClassifier

NAME = "quality"
TITLE = (
    "Uncertainty quality: SVI, NUTS, ChEES, MILE and Laplace against MAP, MC dropout and deep "
    "ensembles"
)
BUDGET_S = 300.0

#: The ChEES rows: every part latent, or the model's own latent parts with each chain keeping
#: its ensemble start's point estimates (``fit_mcmc``'s per-start plain parameters).
CHEES_METHODS = ("chees", "chees-perchain")
#: The MILE route (``fit_mile``): chains started from the batched ensemble's members and tuned
#: per member, MCLMC (``mile``), the same with circuit attention (``mile-circuits``, its own
#: ensemble), or ChEES (``chees-permember``).
MILE_METHODS = ("mile", "mile-circuits", "chees-permember")
BAYESIAN = (
    "svi-meanfield", "svi-lowrank", "svi-stochastic", "nuts", *CHEES_METHODS, *MILE_METHODS,
    *LAPLACE_METHODS,
)  # fmt: skip
CHEAP = ("map", "mc-dropout", "ensemble", "ensemble-batched")
METHODS = BAYESIAN + CHEAP
#: The order rows run in: ChEES, MILE and Laplace after MAP and the ensembles, whose fit seconds
#: set ChEES's budget and the Laplace rows' cost ratio, and whose modes MILE and Laplace start
#: from.
LATER = CHEES_METHODS + MILE_METHODS + LAPLACE_METHODS
RUN_ORDER = tuple(m for m in METHODS if m not in LATER) + LATER
#: The model of every method but NUTS and ChEES.
MODEL = dict(d_model=32, num_heads=4, num_layers=1, d_ff=64, dropout=0.1)
#: ChEES's model: ``MODEL`` with every part latent and no dropout (MCMC runs in eval mode).
CHEES_MODEL = {**MODEL, "dropout": 0.0, "bayesian": BAYESIAN_PARTS}
#: ``mile-circuits``'s model: ``MODEL`` with per-head W_QK and W_OV latents
#: (``probtransformer.circuits``; no logit scale).
CIRCUITS_MODEL = {**MODEL, "attention_parameterization": "circuits", "attention_prior": None}
STOCHASTIC_KL_WEIGHT = 0.01
#: NUTS's small fully Bayesian model (780 latent scalars on digits), pinned here: it was
#: ``probtransformer fit --inference mcmc``'s preset when the NUTS rows were measured.
NUTS_MODEL = dict(
    d_model=8, num_heads=2, num_layers=1, d_ff=16, dropout=0.0, bayesian=BAYESIAN_PARTS
)
MAX_TOKENS = 50  # longer equal-length series are cut into patches (task_families)
ECE_BINS = 15

#: Table columns: row key, header, decimals, True if higher is better.
COLUMNS = (
    ("accuracy", "accuracy", 3, True),
    ("nll", "NLL", 3, False),
    ("ece", "ECE", 3, False),
    ("brier", "Brier", 3, False),
    ("auroc_entropy", "OOD AUROC, entropy", 3, True),
    ("auroc_epistemic", "OOD AUROC, epistemic", 3, True),
    ("aurc", "AURC", 4, False),
    ("fit_seconds", "fit s", 0, False),
)
DIGITS = {key: digits for key, _, digits, _ in COLUMNS}
#: The metrics on which the reading compares the Bayesian methods with the cheap ones.
VERDICT = ("nll", "ece", "brier", "auroc_entropy", "aurc")


@dataclass(frozen=True)
class Splits:
    """One data set ready to fit: patched splits and what they are."""

    train: SequenceData
    test: SequenceData
    ood: SequenceData
    patch: int
    class_names: list[str]


def row_keys(ctx: Context) -> list[str]:
    """``dataset/method/seed`` for every data set, method (``RUN_ORDER``) and seed (quick:
    fewer, see QUICK)."""
    sizes = QUICK if ctx.quick else FULL
    return [f"{d}/{m}/{s}" for d in sizes.datasets for m in RUN_ORDER for s in sizes.seeds]


# ---------------------------------------------------------------------------------------------
# data and models
# ---------------------------------------------------------------------------------------------


def stratified(data: SequenceData, n: int | None, seed: int) -> SequenceData:
    """``n`` rows of ``data`` drawn stratified by label, in their original order (all rows
    when ``n`` is None or not smaller)."""
    if n is None or len(data) <= n:
        return data
    keep, _ = train_test_split(
        np.arange(len(data)), train_size=n, stratify=data.y.numpy(), random_state=seed
    )
    return data[torch.from_numpy(np.sort(keep))]


@functools.lru_cache(maxsize=3)
def load_splits(name: str, seed: int, rows: int | None) -> Splits:
    """Train, test and OOD rows of ``name`` (split by ``seed``), patched when longer than
    ``MAX_TOKENS`` steps; ``rows``: a stratified subsample of each (quick runs)."""
    splits = datasets.load(name, seed=seed, val_fraction=0.0, holdout_classes=SETUPS[name].holdout)
    length = splits.train.x.shape[1]
    patch = math.ceil(length / MAX_TOKENS) if splits.train.mask is None else 1
    train, test, ood = (
        stratified(_patch(part, patch), rows, seed)
        for part in (splits.train, splits.test, splits.meta["ood"])
    )
    return Splits(train, test, ood, patch, [str(c) for c in splits.meta["class_names"]])


def classifier(method: str, train: SequenceData, num_classes: int) -> SequenceClassifier:
    """The model ``method`` fits: ``NUTS_MODEL`` for NUTS, ``CHEES_MODEL`` for ChEES, otherwise
    ``MODEL`` (with stochastic attention for ``svi-stochastic``)."""
    models = {"nuts": NUTS_MODEL, "chees": CHEES_MODEL, "mile-circuits": CIRCUITS_MODEL}
    options = dict(models.get(method, MODEL))
    if method == "svi-stochastic":
        options["attention_prior"] = (
            priors.LogitScalePrior(),
            priors.StochasticAttentionPrior(kl_weight=STOCHASTIC_KL_WEIGHT),
        )
    return SequenceClassifier(train.x.shape[2], num_classes, train.x.shape[1], **options)


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------


def evaluate(
    post: Posterior, test: SequenceData, ood: SequenceData, draws: int | None, seed: int
) -> dict:
    """Test-split scores of the posterior predictive from ``draws`` draws (None: every draw)
    and OOD AUROC against ``ood``."""
    pred_in = post.predict(test.x, test.mask, num_samples=draws, seed=seed)
    pred_out = post.predict(ood.x, ood.mask, num_samples=draws, seed=seed)
    probs = pred_in.mean
    num_draws = pred_in.probs.shape[0]
    return {
        "accuracy": metrics.accuracy(probs, test.y),
        "nll": metrics.nll(probs, test.y),
        "ece": metrics.ece(probs, test.y, n_bins=ECE_BINS, strategy="uniform"),
        "brier": metrics.brier(probs, test.y),
        "auroc_entropy": metrics.ood_auroc(pred_in.entropy, pred_out.entropy),
        "auroc_epistemic": (
            metrics.ood_auroc(pred_in.epistemic, pred_out.epistemic) if num_draws > 1 else None
        ),
        "aurc": metrics.aurc(pred_in.entropy, probs.argmax(-1) == test.y),
        "predictive_draws": num_draws,
    }


#: ``(dataset, fit seed, sizes): seconds`` of the ensemble fits run in this process, ChEES's
#: budget (``RUN_ORDER`` runs them first); a ChEES row without one times an ensemble pilot.
_ENSEMBLE_SECONDS: dict[tuple[str, int, Sizes], float] = {}
#: ``(dataset, fit seed, sizes): posterior`` of the batched ensembles fitted in this process:
#: ``mile`` and ``chees-permember`` start from them (without one, ``fit_mile`` fits its own).
_BATCHED_ENSEMBLES: dict[tuple[str, int, Sizes], Posterior] = {}
#: ``(method, dataset, fit seed, sizes): (posterior, fit fields, where from)`` of the MAP and
#: batched-ensemble fits made in this process (``map`` and ``ensemble-batched`` rows, or a
#: Laplace row that fitted its own): the Laplace rows' modes.
_MODES: dict[tuple[str, str, int, Sizes], tuple[Posterior, dict, str]] = {}


def run_row(key: str, ctx: Context) -> dict:
    """Fit one method on one data set with one seed and score it (see the module docstring)."""
    name, method, seed = key.split("/")
    sizes = QUICK if ctx.quick else FULL
    data = load_splits(name, ctx.seed, sizes.rows)
    fit_seed = ctx.seed + int(seed)
    train = stratified(data.train, sizes.nuts_train, ctx.seed) if method == "nuts" else data.train
    model = classifier(method, train, len(data.class_names))
    if method == "nuts":
        post, fit = fit_nuts(model, train, sizes, fit_seed, ctx)
    elif method in CHEES_METHODS:
        ensemble_seconds = _ENSEMBLE_SECONDS.get((name, fit_seed, sizes))
        basis = "measured in this process" if ensemble_seconds else "pilot"
        if ensemble_seconds is None:
            ensemble = classifier("ensemble", train, len(data.class_names))
            settings = optimised_settings(train, SETUPS[name], fit_seed, ctx)
            steps = sizes.num_steps or SETUPS[name].num_steps
            ensemble_seconds = steps * pilot_step_seconds("ensemble", ensemble, train, settings)
        post, fit = fit_chees(model, train, ensemble_seconds, sizes, fit_seed, ctx)
        fit["ensemble_seconds_basis"] = basis
    elif method in MILE_METHODS:
        batched = _BATCHED_ENSEMBLES.get((name, fit_seed, sizes))
        shared = method != "mile-circuits"  # the circuits model fits an ensemble of its own
        post, fit = fit_route(
            method, model, train, SETUPS[name], batched if shared else None, sizes, fit_seed,
            ctx, reference_seconds=None if batched is None else batched.record["seconds"],
        )  # fmt: skip
    elif method in LAPLACE_METHODS:
        mode_key = (mode_method(method), name, fit_seed, sizes)
        batched = _MODES.get(("ensemble-batched", name, fit_seed, sizes))
        post, fit, _MODES[mode_key] = fit_laplace_row(
            method, model, train, SETUPS[name], _MODES.get(mode_key), sizes, fit_seed, ctx,
            reference_seconds=None if batched is None else batched[1]["fit_seconds"],
        )  # fmt: skip
    else:
        post, fit = fit_optimised(method, model, train, SETUPS[name], sizes, fit_seed, ctx)
        if method == "ensemble":
            _ENSEMBLE_SECONDS[name, fit_seed, sizes] = fit["fit_seconds"]
        if method == "ensemble-batched":
            _BATCHED_ENSEMBLES[name, fit_seed, sizes] = post
        if method in ("map", "ensemble-batched"):
            _MODES[method, name, fit_seed, sizes] = (post, fit, f"the {method} row's, this process")
    # None: every draw (Laplace: its sizes.draws); ChEES: each chain thinned evenly to
    # ceil(draws / K) (all when fewer)
    every = ("nuts", "ensemble", "ensemble-batched", *MILE_METHODS, *LAPLACE_METHODS)
    draws = None if method in every else sizes.draws
    start = time.perf_counter()
    scores = evaluate(post, data.test, data.ood, draws, fit_seed)
    return {
        "dataset": name,
        "method": method,
        "seed": int(seed),
        "fit_seed": fit_seed,
        **scores,
        **fit,
        "predict_seconds": time.perf_counter() - start,
        "num_train": len(train),
        "num_test": len(data.test),
        "num_ood": len(data.ood),
        "holdout_classes": [data.class_names[c] for c in SETUPS[name].holdout],
        "patch": data.patch,
        "tokens": train.x.shape[1],
        "config": model.config,
        "data_seed": ctx.seed,
    }


def markdown(rows: dict[str, dict], ctx: Context) -> str:
    """The section's tables and reading (``benchmarks.quality_report``)."""
    from benchmarks import quality_report

    return quality_report.markdown(rows, ctx)


def plot(rows: dict[str, dict], ctx: Context) -> list[Path]:
    """The section's plot (``benchmarks.quality_report``)."""
    from benchmarks import quality_report

    return quality_report.plot(rows, ctx)
