"""How the last-layer Laplace predicts against the prior scale: the evidence's choice, the
model's fixed ``N(0, 3/sqrt(fan_in))``, and fixed smaller scales, around one MAP fit.

The quality rows show the evidence-tuned Laplace predicting worse than its own MAP on digits.
This study says why: at a mode that fits the training data almost perfectly the GGN is tiny
(every ``p(1 - p)`` near 0), so the posterior of the head is its prior in most directions
(condition number of the posterior precision near 1), and the evidence, weighing the MAP's
weight norms, picks a prior broader than the model's. Each row: ``fit_laplace(ensemble=map,
subset="head", hessian="full", prior_precision=...)`` on the quality benchmark's MODEL and
digits split, the MAP fitted with the ``map`` row's settings; test NLL, ECE and OOD AUROC
(entropy) over 100 draws, the log evidence (nats) and the condition number.

Reproduce::

    python -m benchmarks.studies.laplace_prior_scale            # about 1 minute of one core
    python -m benchmarks.studies.laplace_prior_scale --dataset JapaneseVowels --seed 1
"""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

import torch

from benchmarks.quality import classifier, load_splits
from benchmarks.quality_fits import SETUPS
from probtransformer import metrics
from probtransformer.inference import fit_laplace, fit_map

RESULT = Path(__file__).parents[1] / "results" / "laplace_prior_scale.md"
#: Prior settings compared: the evidence's, the model's own, and fixed scales (sd).
SETTINGS = ("marglik", "prior", 0.3, 0.1, 0.03)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="digits", choices=tuple(SETUPS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    splits = load_splits(args.dataset, 0, None)
    setup = SETUPS[args.dataset]
    model = classifier("map", splits.train, len(splits.class_names))
    mode = fit_map(
        model, splits.train, num_steps=setup.num_steps, lr=setup.lr, lr_decay=setup.lr_decay,
        batch_size=setup.batch_size or len(splits.train), seed=args.seed, progress=False,
    )  # fmt: skip
    lines = [
        f"# Last-layer Laplace against the prior scale ({args.dataset}, seed {args.seed})",
        "",
        f"`python -m benchmarks.studies.laplace_prior_scale --dataset {args.dataset} "
        f"--seed {args.seed}`, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, torch "
        f"{torch.__version__}, one thread.",
        "",
        "| prior | head.weight scale | NLL | ECE | OOD AUROC | log evidence | condition number |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [("MAP", None, mode)]
    for setting in SETTINGS:
        precision = setting if isinstance(setting, str) else setting**-2
        post = fit_laplace(model, splits.train, ensemble=mode, prior_precision=precision)
        rows.append((setting if isinstance(setting, str) else f"sd {setting}", post, post))
    for label, laplace, post in rows:
        pred = post.predict(splits.test.x, splits.test.mask, seed=args.seed)
        ood = post.predict(splits.ood.x, splits.ood.mask, seed=args.seed)
        nll = metrics.nll(pred.mean, splits.test.y)
        ece = metrics.ece(pred.mean, splits.test.y, n_bins=15, strategy="uniform")
        auroc = metrics.ood_auroc(pred.entropy, ood.entropy)
        if laplace is None:
            extra = ["", "", ""]
        else:
            summary = laplace.record["laplace"][0]
            extra = [
                f"{summary['prior_scale']['head.weight']:.3g}",
                f"{summary['log_evidence']:.1f}",
                f"{summary['condition_number']:.3g}",
            ]
        lines.append(
            f"| {label} | {extra[0]} | {nll:.4f} | {ece:.4f} | {auroc:.3f} | {extra[1]} | "
            f"{extra[2]} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULT.write_text(text)


if __name__ == "__main__":
    main()
