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
  off while sampling).

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
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter
from sklearn.model_selection import train_test_split

from benchmarks._suite import Context, fmt, mean_spread
from benchmarks.quality_fits import (
    CHEES_COST_RATIO,
    ENSEMBLE_MEMBERS,
    FULL,
    QUICK,
    SETUPS,
    Sizes,
    fit_chees,
    fit_nuts,
    fit_optimised,
    optimised_settings,
    pilot_step_seconds,
)
from benchmarks.studies.task_families import _patch
from probtransformer import datasets, metrics, priors
from probtransformer.block import BAYESIAN_PARTS
from probtransformer.datasets import SequenceData
from probtransformer.inference import (
    Posterior,
)
from probtransformer.models import SequenceClassifier

NAME = "quality"
TITLE = "Uncertainty quality: SVI, NUTS and ChEES against MAP, MC dropout and deep ensembles"
BUDGET_S = 300.0

#: The ChEES rows: every part latent, or the model's own latent parts with each chain keeping
#: its ensemble start's point estimates (``fit_mcmc``'s per-start plain parameters).
CHEES_METHODS = ("chees", "chees-perchain")
BAYESIAN = ("svi-meanfield", "svi-lowrank", "svi-stochastic", "nuts", *CHEES_METHODS)
CHEAP = ("map", "mc-dropout", "ensemble", "ensemble-batched")
METHODS = BAYESIAN + CHEAP
#: The order rows run in: ChEES after the ensemble, whose fit seconds set its budget.
RUN_ORDER = tuple(m for m in METHODS if m not in CHEES_METHODS) + CHEES_METHODS
#: The model of every method but NUTS and ChEES.
MODEL = dict(d_model=32, num_heads=4, num_layers=1, d_ff=64, dropout=0.1)
#: ChEES's model: ``MODEL`` with every part latent and no dropout (MCMC runs in eval mode).
CHEES_MODEL = {**MODEL, "dropout": 0.0, "bayesian": BAYESIAN_PARTS}
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
    options = dict({"nuts": NUTS_MODEL, "chees": CHEES_MODEL}.get(method, MODEL))
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
    else:
        post, fit = fit_optimised(method, model, train, SETUPS[name], sizes, fit_seed, ctx)
        if method == "ensemble":
            _ENSEMBLE_SECONDS[name, fit_seed, sizes] = fit["fit_seconds"]
    # None: every draw; ChEES: each chain thinned evenly to ceil(draws / K) (all when fewer)
    draws = None if method in ("nuts", "ensemble", "ensemble-batched") else sizes.draws
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


# ---------------------------------------------------------------------------------------------
# tables, reading, plot
# ---------------------------------------------------------------------------------------------


def _groups(rows: dict[str, dict], ctx: Context) -> dict[str, dict[str, list[dict]]]:
    """``{dataset: {method: [rows over seeds]}}`` in ``row_keys`` order, measured rows only."""
    groups: dict[str, dict[str, list[dict]]] = {}
    for key in row_keys(ctx):
        if key in rows:
            row = rows[key]
            groups.setdefault(row["dataset"], {}).setdefault(row["method"], []).append(row)
    return groups


def _values(group: list[dict], key: str) -> list[float]:
    return [row[key] for row in group if row.get(key) is not None]


def _mean(group: list[dict], key: str) -> float | None:
    values = _values(group, key)
    return float(np.mean(values)) if values else None


def _sd(group: list[dict], key: str) -> float:
    values = _values(group, key)
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _best(methods: dict[str, list[dict]], key: str, higher: bool, names=METHODS) -> str | None:
    """The method of ``names`` with the best mean of ``key`` (None when none has one)."""
    means = {m: _mean(methods[m], key) for m in names if m in methods}
    means = {m: v for m, v in means.items() if v is not None}
    if not means:
        return None
    return (max if higher else min)(means, key=means.get)


def _setting_line(name: str, methods: dict[str, list[dict]]) -> str:
    """What the data set's rows ran: sizes, held-out classes, fit settings."""
    optimised = next((g[0] for m, g in methods.items() if m not in ("nuts", *CHEES_METHODS)), None)
    any_row = next(iter(methods.values()))[0]
    held_out = any_row["holdout_classes"]
    parts = [
        f"**{name}**: class{'es' if len(held_out) > 1 else ''} {', '.join(held_out)} held out; "
        f"{any_row['num_test']:,} test / {any_row['num_ood']:,} OOD rows"
    ]
    if any_row["patch"] > 1:
        parts.append(f"patches of {any_row['patch']} steps ({any_row['tokens']} tokens)")
    if optimised is not None:
        s = optimised["settings"]
        parts.append(
            f"{optimised['num_train']:,} training rows, {optimised['planned_steps']:,} steps of "
            f"batch {s['batch_size']} at lr {s['lr']:g} (decaying to {s['lr'] * s['lr_decay']:g})"
        )
    if "nuts" in methods:
        n = methods["nuts"][0]
        parts.append(
            f"NUTS: {n['num_train']} training rows, 1 chain of {n['settings']['num_warmup']} + "
            f"{n['planned_draws']} transitions, tree depth <= {n['settings']['max_tree_depth']}"
        )
    for method in CHEES_METHODS:
        if method not in methods:
            continue
        group = methods[method]
        c = group[0]["settings"]

        def span(key: str, group: list[dict] = group) -> str:
            low, high = (f(r["settings"][key] for r in group) for f in (min, max))
            return f"{low}" if low == high else f"{low}-{high}"

        parts.append(
            f"{method}: {group[0]['num_train']:,} training rows, {c['num_chains']} chains from "
            f"{c['num_starts']} MAP starts (map_steps {span('map_steps')}), {span('num_warmup')} + "
            f"{span('num_samples')} transitions per chain"
        )
    return "; ".join(parts) + "."


def _table(methods: dict[str, list[dict]]) -> list[str]:
    """Mean ± sd over seeds per method; the best mean of each column in bold."""
    lines = [
        "| method | " + " | ".join(title for _, title, _, _ in COLUMNS) + " | seeds |",
        "|---|" + "---:|" * (len(COLUMNS) + 1),
    ]
    best = {}
    for key, _, digits, higher in COLUMNS:
        winner = _best(methods, key, higher)
        best[key] = None if winner is None else round(_mean(methods[winner], key), digits)
    for method, group in methods.items():
        cells = []
        for key, _, digits, _ in COLUMNS:
            text = mean_spread(_values(group, key), digits)
            mean = _mean(group, key)
            if mean is not None and len(methods) > 1 and round(mean, digits) == best[key]:
                text = f"**{text}**"
            cells.append(text)
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {len(group)} |")
    return lines


def _verdict(groups: dict[str, dict[str, list[dict]]]) -> str | None:
    """Best Bayesian method against best cheap one, per data set and ``VERDICT`` metric. A lead
    is clear when it exceeds the larger sd over seeds of the two (both need 2+ seeds)."""
    columns = {key: (title, up) for key, title, _, up in COLUMNS}
    ahead = {"Bayesian": 0, "cheap": 0}
    clear: dict[str, list[str]] = {"Bayesian": [], "cheap": []}
    compared = 0
    for name, methods in groups.items():
        for key in VERDICT:
            title, higher = columns[key]
            bayes = _best(methods, key, higher, BAYESIAN)
            cheap = _best(methods, key, higher, CHEAP)
            if bayes is None or cheap is None:
                continue
            compared += 1
            b, c = _mean(methods[bayes], key), _mean(methods[cheap], key)
            if b == c:
                continue
            bayes_ahead = (b > c) == higher
            side = "Bayesian" if bayes_ahead else "cheap"
            win, lose = (bayes, cheap) if bayes_ahead else (cheap, bayes)
            ahead[side] += 1
            pair = (methods[bayes], methods[cheap])
            seeded = all(len(_values(group, key)) > 1 for group in pair)
            if seeded and abs(b - c) > max(_sd(group, key) for group in pair):
                digits = DIGITS[key]
                clear[side].append(
                    f"{name} {title} {win} {fmt(_mean(methods[win], key), digits)} vs {lose} "
                    f"{fmt(_mean(methods[lose], key), digits)}"
                )
    if not compared:
        return None
    parts = [
        f"the {side} one is ahead in {ahead[side]}, clearly in {len(clear[side])}"
        + (f" ({'; '.join(clear[side])})" if clear[side] else "")
        for side in ahead
    ]
    return (
        "- **Bayesian vs cheap.** The best Bayesian method (SVI, NUTS, ChEES) against the best "
        "cheap one (MAP, MC dropout, ensemble) on NLL, ECE, Brier, OOD AUROC by entropy and AURC, "
        f"{compared} comparisons (data set x metric; clearly: by more than the larger sd over "
        f"seeds of the two): {'; '.join(parts)}."
    )


def _reading(groups: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Statements computed from the rows (each only where its rows exist)."""
    lines = []
    verdict = _verdict(groups)
    if verdict:
        lines.append(verdict)
    best = []
    for name, methods in groups.items():
        nll, auroc = _best(methods, "nll", False), _best(methods, "auroc_entropy", True)
        best.append(
            f"{name}: NLL {nll} ({fmt(_mean(methods[nll], 'nll'))}), OOD AUROC {auroc} "
            f"({fmt(_mean(methods[auroc], 'auroc_entropy'))})"
        )
    lines.append("- **Best per data set.** " + "; ".join(best) + ".")
    pairs = [
        (name, method)
        for name, methods in groups.items()
        for method, group in methods.items()
        if _mean(group, "auroc_epistemic") is not None
    ]
    if pairs:
        better = [
            f"{name} {method}"
            for name, method in pairs
            if _mean(groups[name][method], "auroc_epistemic")
            > _mean(groups[name][method], "auroc_entropy")
        ]
        lines.append(
            f"- **Epistemic part vs total entropy as OOD score.** The epistemic part is the "
            f"better score in {len(better)} of {len(pairs)} (data set, method) pairs"
            + (f" ({', '.join(better)})" if better else "")
            + "; MAP has no epistemic part (one draw)."
        )
    ratios = {}
    for methods in groups.values():
        if "map" in methods:
            for method, group in methods.items():
                ratios.setdefault(method, []).append(
                    _mean(group, "fit_seconds") / _mean(methods["map"], "fit_seconds")
                )
    if len(ratios) > 1:
        lines.append(
            "- **Cost.** Fit seconds relative to MAP on the same data set, mean over data sets: "
            + ", ".join(f"{m} {np.mean(r):.1f}x" for m, r in ratios.items() if m != "map")
            + "."
        )
    nuts = [row for methods in groups.values() for row in methods.get("nuts", [])]
    if nuts:
        depth = max(row["settings"]["max_tree_depth"] for row in nuts)
        at_cap = np.mean([row["share_at_max_depth"] for row in nuts])
        gaps = [
            f"{name} {fmt(_mean(m['nuts'], 'accuracy'))} vs {fmt(_mean(m['map'], 'accuracy'))}"
            for name, m in groups.items()
            if "nuts" in m and "map" in m
        ]
        lines.append(
            f"- **NUTS** runs a smaller model (d_model {NUTS_MODEL['d_model']}, every part latent) "
            f"on at most {max(row['num_train'] for row in nuts)} training rows: {at_cap:.0%} of "
            f"its kept transitions hit the tree-depth cap ({depth}), with "
            f"{sum(row['divergences'] for row in nuts)} divergences over {len(nuts)} rows"
            + (f"; test accuracy against MAP: {'; '.join(gaps)}" if gaps else "")
            + "."
        )
    lines += [line for m in CHEES_METHODS if (line := _chees_reading(groups, m))]
    cut = [
        f"{row['dataset']}/{row['method']}/{row['seed']}"
        for methods in groups.values()
        for group in methods.values()
        for row in group
        if row["budget_cut"]
    ]
    if cut:
        lines.append(
            f"- Cut short by the time budget (fewer steps or draws than planned): {', '.join(cut)}."
        )
    return lines


def _chees_reading(groups: dict[str, dict[str, list[dict]]], method: str) -> str | None:
    """ChEES against the ensemble on the seeds both have, the issue's goal per data set: mean
    NLL <= the ensemble's + tolerance, mean OOD AUROC (entropy) >= the ensemble's - tolerance
    (tolerance: the larger sd over seeds of the two, at least 0.005), every seed's fit within
    ``CHEES_COST_RATIO`` x the ensemble's fit seconds of the same process."""
    verdicts = []
    for name, methods in groups.items():
        seeds = {r["seed"] for r in methods.get(method, [])}
        seeds &= {r["seed"] for r in methods.get("ensemble", [])}
        if not seeds:
            continue
        new = [r for r in methods[method] if r["seed"] in seeds]
        ens = [r for r in methods["ensemble"] if r["seed"] in seeds]
        misses = []
        for key, title, sign in (("nll", "NLL", 1), ("auroc_entropy", "OOD AUROC", -1)):
            tolerance = max(_sd(new, key), _sd(ens, key), 0.005)
            a, b = _mean(new, key), _mean(ens, key)
            if sign * (a - b) > tolerance:
                misses.append(f"{title} {fmt(a)} vs {fmt(b)} (tolerance {fmt(tolerance)})")
        ratio = max(row["ensemble_ratio"] for row in new)
        if ratio > CHEES_COST_RATIO:
            misses.append(f"fit up to {ratio:.1f}x the ensemble's seconds")
        verdicts.append(
            f"{name} (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, sorted(seeds)))}): "
            + ("met" if not misses else "missed: " + ", ".join(misses))
            + f" (fit {ratio:.1f}x the ensemble's at most)"
        )
    rows = [row for methods in groups.values() for row in methods.get(method, [])]
    if not rows:
        return None
    return (
        f"- **{method} against the ensemble** (the goal: mean NLL within, and mean OOD AUROC by "
        "entropy within, the larger seed sd of the two (at least 0.005) of the ensemble's, at "
        f"<= {CHEES_COST_RATIO:g}x its fit seconds): "
        + ("; ".join(verdicts) if verdicts else "no ensemble rows to compare")
        + f". Over {len(rows)} rows: {sum(r['divergences'] for r in rows)} divergent "
        f"transitions, mean acceptance {np.mean([r['mean_acceptance'] for r in rows]):.2f}, "
        f"adapted step size {min(r['adapted_step_size'] for r in rows):.2g}-"
        f"{max(r['adapted_step_size'] for r in rows):.2g}, "
        f"{min(r['mean_leapfrog_steps_sampling'] for r in rows):.0f}-"
        f"{max(r['mean_leapfrog_steps_sampling'] for r in rows):.0f} leapfrog steps per kept "
        "transition, nested R-hat of the log density "
        f"{min(r['nested_rhat_lp'] for r in rows):.2f}-"
        f"{max(r['nested_rhat_lp'] for r in rows):.2f}."
    )


def markdown(rows: dict[str, dict], ctx: Context) -> str:
    """One table per data set (mean ± sd over seeds, best mean in bold) and the reading."""
    groups = _groups(rows, ctx)
    sizes = QUICK if ctx.quick else FULL
    out = [
        "Are the Bayesian fits' uncertainties better than the cheap alternatives? Classes held "
        "out of training are the OOD inputs. Mean ± sd over seeds; best mean of each column in "
        f"bold. NLL in nats; ECE with {ECE_BINS} equal-width bins; AURC: area under the "
        "risk-coverage "
        "curve, test rows accepted by increasing predictive entropy (lower is better); OOD "
        "AUROC: test rows against held-out rows, scored by total predictive entropy or its "
        f"epistemic part (mutual information). Predictions from {sizes.draws} draws (ensemble: "
        f"{ENSEMBLE_MEMBERS} members; NUTS: its kept draws; ChEES: its kept draws, each chain "
        f"thinned evenly to {sizes.draws} / K when there are more; MAP: one). Every method but "
        "NUTS fits the same classifier "
        f"(d_model {MODEL['d_model']}, {MODEL['num_heads']} heads, {MODEL['num_layers']} layer, "
        f"d_ff {MODEL['d_ff']}, dropout {MODEL['dropout']}); `svi-stochastic` adds stochastic "
        f"attention (kl_weight {STOCHASTIC_KL_WEIGHT}); `chees` makes every part latent, "
        "dropout 0; `chees-perchain` samples the classifier's own latent parts (attention, head) "
        "and each chain keeps its MAP start's point estimates; both may take "
        f"{CHEES_COST_RATIO:g}x the (sequential) ensemble's fit seconds; `ensemble-batched` fits "
        "the ensemble's members as one batched optimisation. "
        "`benchmarks/quality.py` documents the details.",
        "",
    ]
    for name, methods in groups.items():
        out += [_setting_line(name, methods), "", *_table(methods), ""]
    if groups:
        out += _reading(groups)
    missing: dict[str, list[str]] = {}  # "dataset/method": seeds not measured
    for key in row_keys(ctx):
        if key not in rows:
            prefix, seed = key.rsplit("/", 1)
            missing.setdefault(prefix, []).append(seed)
    if missing:
        listed = ", ".join(f"{p} (seed {', '.join(s)})" for p, s in missing.items())
        out += ["", f"Not measured yet: {listed}; `python -m benchmarks.run --only {NAME}`."]
    return "\n".join(out)


def plot(rows: dict[str, dict], ctx: Context) -> list[Path]:
    """OOD AUROC (entropy) against NLL per method, one panel per data set, seed sd as bars."""
    groups = _groups(rows, ctx)
    if not groups:
        return []
    fig = Figure(figsize=(4 * len(groups), 3.8), layout="constrained")
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    markers = dict(zip(METHODS, "os^D*8vPXh", strict=True))
    for ax, (name, methods) in zip(axes, groups.items(), strict=True):
        for method, group in methods.items():
            ax.errorbar(
                _mean(group, "nll"),
                _mean(group, "auroc_entropy"),
                xerr=_sd(group, "nll"),
                yerr=_sd(group, "auroc_entropy"),
                marker=markers[method],
                linestyle="none",
                capsize=3,
                label=method,
            )
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on short ranges
        ax.set_xlabel("test NLL (nats, log scale)")
        ax.set_ylabel("OOD AUROC, predictive entropy")
        ax.set_title(name)
    axes[0].legend(fontsize="small")
    path = ctx.cache(NAME).with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return [path]
