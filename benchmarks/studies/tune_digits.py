"""Validation figures of one digits setting: how the SequenceClassifier defaults were chosen.

    python -m benchmarks.studies.tune_digits \
        --model '{"weight_prior_scale": 3.0}' --fit '{"lr": 1e-2}'

Fits on ``load("digits", val_fraction=0.25)`` (909 train / 338 validation digits) with the library
defaults overridden by the JSON options, then prints one JSON line: validation accuracy, NLL,
ECE, Brier, mean top-class probability, mean epistemic uncertainty, final ELBO, and how far the
ELBO moved over the last tenth of the steps (nats per observation). The test split is not used.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from probtransformer import priors
from probtransformer.datasets import load
from probtransformer.inference import fit_svi
from probtransformer.inference.diagnostics.guide_checks import elbo_change_per_obs
from probtransformer.metrics import classification_report
from probtransformer.models import SequenceClassifier


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="{}", help="SequenceClassifier options (JSON)")
    parser.add_argument("--fit", default="{}", help="fit_svi options (JSON)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_options, fit_options = json.loads(args.model), json.loads(args.fit)
    if "weight_prior_scale" in model_options:
        model_options["weight_prior"] = priors.Normal(model_options.pop("weight_prior_scale"))
    splits = load("digits", val_fraction=0.25)
    start = time.perf_counter()
    post = fit_svi(
        SequenceClassifier(8, 10, 8, **model_options), splits.train, progress=False, **fit_options
    )
    seconds = time.perf_counter() - start
    pred = post.predict(splits.val.x, num_samples=100)
    elbo = post.record["elbo"]
    row = dict(
        model=model_options | {"weight_prior": str(model_options.get("weight_prior", "default"))},
        fit=fit_options,
        seconds=round(seconds, 1),
        **{k: round(v, 4) for k, v in classification_report(pred.mean, splits.val.y).items()},
        confidence=round(pred.mean.max(-1).values.mean().item(), 4),
        epistemic=round(pred.epistemic.mean().item(), 4),
        elbo=round(elbo[-1]),
        elbo_moved_per_obs=round(elbo_change_per_obs(elbo, post.record["num_data"]), 3),
    )
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
