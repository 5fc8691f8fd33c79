"""Digits with classes 8 and 9 held out: accuracy, calibration and OOD detection per method.

The acceptance table of the attention-prior issue: the same default ``SequenceClassifier``
(d_model 64, 4 heads, 2 layers; latent attention projections, logit scales and output head)
fitted on the digits training split **without** the digits 8 and 9, by

- ``svi``: ``fit_svi`` (mean-field AutoNormal, the library defaults: 3,000 steps of batch 128),
- ``svi-stochastic``: the same with stochastic attention
  (``attention_prior=(LogitScalePrior(), StochasticAttentionPrior())``, amortized guide),
- ``map``: ``fit_map`` (AutoDelta),
- ``mc-dropout``: ``fit_mc_dropout`` (the model's dropout 0.1 kept on at prediction),
- ``ensemble``: ``fit_ensemble`` with 5 MAP members,

each with the same optimiser settings. Reported on the in-distribution test split (digits 0-7):
accuracy, NLL, ECE (15 equal-width bins); on all held-out 8s and 9s against that split: the
AUROC of the epistemic part (mutual information) and of the total predictive entropy as OOD
scores; and the fit's wall seconds. Predictions use 100 draws (ensemble: its 5 members; MAP: one).

Reproduce (about 25 minutes on 2 CPU cores; ``--quick``: 50 steps, a smoke run)::

    python -m benchmarks.studies.ood_baselines [--only svi map ...] [--quick]

Rows are cached in ``benchmarks/results/ood_baselines.json`` (``--only`` re-runs some); the
table is printed and written to ``benchmarks/results/ood_baselines.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch

from probtransformer import datasets, metrics, priors
from probtransformer.inference import fit_ensemble, fit_map, fit_mc_dropout, fit_svi
from probtransformer.models import SequenceClassifier

RESULTS = Path(__file__).parents[1] / "results"
METHODS = ("svi", "svi-stochastic", "map", "mc-dropout", "ensemble")
HOLDOUT = (8, 9)
ECE_BINS = 15
NUM_SAMPLES = 100


def _model(meta: dict, method: str) -> SequenceClassifier:
    kwargs = {}
    if method == "svi-stochastic":
        kwargs["attention_prior"] = (priors.LogitScalePrior(), priors.StochasticAttentionPrior())
    return SequenceClassifier(meta["in_features"], meta["num_classes"], meta["max_len"], **kwargs)


def _fit(method: str, model, train, num_steps: int, seed: int):
    settings = dict(num_steps=num_steps, seed=seed, progress=False)
    if method in ("svi", "svi-stochastic"):
        return fit_svi(model, train, **settings)
    if method == "map":
        return fit_map(model, train, **settings)
    if method == "mc-dropout":
        return fit_mc_dropout(model, train, **settings)
    return fit_ensemble(model, train, n_members=5, **settings)


def run_method(method: str, splits, *, num_steps: int, seed: int) -> dict:
    """Fit ``method`` on the training split and evaluate it; one table row."""
    test, ood = splits.test, splits.meta["ood"]
    start = time.perf_counter()
    post = _fit(method, _model(splits.meta, method), splits.train, num_steps, seed)
    seconds = time.perf_counter() - start
    draws = None if method == "ensemble" else NUM_SAMPLES
    pred_in = post.predict(test.x, test.mask, num_samples=draws, seed=seed)
    pred_out = post.predict(ood.x, ood.mask, num_samples=draws, seed=seed)
    probs = pred_in.mean
    return dict(
        method=method,
        accuracy=metrics.accuracy(probs, test.y),
        nll=metrics.nll(probs, test.y),
        ece=metrics.ece(probs, test.y, n_bins=ECE_BINS, strategy="uniform"),
        auroc_epistemic=metrics.ood_auroc(pred_in.epistemic, pred_out.epistemic),
        auroc_entropy=metrics.ood_auroc(pred_in.entropy, pred_out.entropy),
        seconds=seconds,
        num_steps=num_steps,
        num_draws=pred_in.probs.shape[0],
        num_test=len(test),
        num_ood=len(ood),
        seed=seed,
        measured=dt.date.today().isoformat(),
    )


def table(rows: list[dict]) -> str:
    """Markdown table; the best value of each column in bold."""
    columns = [
        ("accuracy", "accuracy", max),
        ("nll", "NLL (nats)", min),
        ("ece", "ECE", min),
        ("auroc_epistemic", "OOD AUROC, epistemic", max),
        ("auroc_entropy", "OOD AUROC, entropy", max),
        ("seconds", "fit seconds", min),
    ]
    lines = [
        "| method | " + " | ".join(title for _, title, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for row in rows:
        cells = []
        for key, _, best in columns:
            value = row[key]
            text = f"{value:.0f}" if key == "seconds" else f"{value:.4f}"
            winner = best(r[key] for r in rows)
            cells.append(f"**{text}**" if value == winner and len(rows) > 1 else text)
        lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--quick", action="store_true", help="50 steps: a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    num_steps = 50 if args.quick else 3000
    splits = datasets.load("digits", seed=args.seed, holdout_classes=HOLDOUT)
    suffix = "_quick" if args.quick else ""
    cache = RESULTS / f"ood_baselines{suffix}.json"
    rows = json.loads(cache.read_text()) if cache.exists() else {}
    for method in args.only:
        torch.manual_seed(args.seed)
        print(f"fitting {method} ...", flush=True)
        rows[method] = run_method(method, splits, num_steps=num_steps, seed=args.seed)
        RESULTS.mkdir(exist_ok=True)
        cache.write_text(json.dumps(rows, indent=1) + "\n")  # keep finished rows
    text = table([rows[m] for m in METHODS if m in rows])
    (RESULTS / f"ood_baselines{suffix}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
