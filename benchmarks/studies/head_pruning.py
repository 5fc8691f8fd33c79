"""Head gates on digits: how many heads the posterior keeps, and what pruning the rest costs.

The default ``SequenceClassifier`` (d_model 64, 4 heads, 2 layers) with
``head_prior=priors.HeadGatePrior()`` fitted by ``fit_svi`` (library defaults, 3,000 steps) on
the digits training split. Reported: the posterior mean gate of every head, the effective number
of heads, and for each pruning threshold the heads removed, the test accuracy and NLL change, and
the prediction speed-up: wall time of ``predict`` (100 draws, the 450 test digits) of the full
posterior over that of the pruned one, median of 7 alternating runs in one process.

Reproduce (about 3 minutes on 2 CPU cores; ``--quick``: 50 steps)::

    python -m benchmarks.studies.head_pruning [--quick]

Printed and written to ``benchmarks/results/head_pruning.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from probtransformer import datasets, metrics, priors
from probtransformer.inference import fit_svi
from probtransformer.models import SequenceClassifier

RESULTS = Path(__file__).parents[1] / "results"
THRESHOLDS = (0.05, 0.1, 0.3, 0.5)
REPEATS = 7


def _predict_seconds(posterior, x) -> float:
    start = time.perf_counter()
    posterior.predict(x, num_samples=100)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    splits = datasets.load("digits")
    test = splits.test
    model = SequenceClassifier(8, 10, 8, head_prior=priors.HeadGatePrior())
    start = time.perf_counter()
    post = fit_svi(model, splits.train, num_steps=50 if args.quick else 3000, progress=False)
    seconds = time.perf_counter() - start
    gates = post.head_importance()
    full = post.predict(test.x, num_samples=100).mean
    lines = [
        f"Fit: {seconds:.0f} s. Posterior mean gate per head (layer: heads 0-3):",
        "",
        *(
            f"- layer {layer}: "
            + ", ".join(f"{g:.3f}" for g in rows["mean"])
            + " (90% intervals "
            + ", ".join(f"[{a:.2f}, {b:.2f}]" for a, b in rows[["lower", "upper"]].to_numpy())
            + ")"
            for layer, rows in gates.groupby("layer")
        ),
        "",
        f"Effective number of heads: {post.effective_num_heads():.2f} of {len(gates)}.",
        "",
        "| threshold | heads pruned | accuracy | NLL (nats) | ΔNLL | predict speed-up |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| none | 0 | {metrics.accuracy(full, test.y):.4f} | {metrics.nll(full, test.y):.4f} | "
        "0 | 1.00 |",
    ]
    for threshold in THRESHOLDS:
        pruned = post.prune_heads(threshold)
        probs = pruned.predict(test.x, num_samples=100).mean
        times = {"full": [], "pruned": []}
        for _ in range(REPEATS):  # alternate, so drifts in machine load hit both
            times["full"].append(_predict_seconds(post, test.x))
            times["pruned"].append(_predict_seconds(pruned, test.x))
        speedup = statistics.median(times["full"]) / statistics.median(times["pruned"])
        nll = metrics.nll(probs, test.y)
        lines.append(
            f"| {threshold} | {len(pruned.record['pruned_heads'])} | "
            f"{metrics.accuracy(probs, test.y):.4f} | {nll:.4f} | "
            f"{nll - metrics.nll(full, test.y):+.4f} | {speedup:.2f} |"
        )
    text = "\n".join(lines)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"head_pruning{'_quick' if args.quick else ''}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
