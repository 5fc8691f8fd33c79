"""Test-split interval coverage of a forecasting run directory (issue 44), two ways on one fit.

``python -m benchmarks.studies.forecast_coverage RUN_DIR [DRAWS]`` predicts the run's test split
again (its seed; ``DRAWS`` posterior draws, default the run's ``num_samples``) and prints the 90%
interval coverage and mean width from the quantiles of one sampled ``y`` per draw (the interval
before issue 44) and from the mixture of the draws' likelihoods (``predictive_interval``), with
RMSE, the mean noise and epistemic sd, and the training RMSE and noise sd: a training RMSE far
below the test RMSE says the fit memorised its training windows and learned its noise from that.
"""

from __future__ import annotations

import sys

import torch

from probtransformer import metrics
from probtransformer.inference.posterior.results import _quantiles
from probtransformer.rundir import read_run, run_data

PROB = 0.9


def main(run_dir: str, draws: int | None = None) -> None:
    """Print the figures above for ``run_dir``."""
    torch.set_num_threads(1)
    run = read_run(run_dir)
    test, train, _ = run_data(run.record, run.path)
    draws = draws or run.record.get("num_samples") or 100
    seed = run.record["seed"]
    pred = run.posterior.predict(test.x, test.mask, num_samples=draws, seed=seed)
    old = _quantiles(pred.samples, PROB)  # (lower, upper), each (N, H)
    new = pred.predictive_interval(PROB)
    print(f"{run_dir}: {pred.loc.shape[0]} draws, {test.y.numel()} test points")
    for name, (lower, upper) in (("one sampled y per draw", old), ("mixture", new)):
        coverage = metrics.interval_coverage(lower, upper, test.y)
        print(f"  {name:<24}coverage {coverage:.3f}  width {float((upper - lower).mean()):.4g}")
    rmse = float((pred.mean - test.y).pow(2).mean().sqrt())
    noise, epistemic = pred.aleatoric.mean().sqrt(), pred.epistemic.mean().sqrt()
    print(f"  test RMSE {rmse:.4g}, noise sd {noise:.4g}, epistemic sd {epistemic:.4g}")
    fitted = run.posterior.predict(train.x, train.mask, num_samples=draws, seed=seed)
    train_rmse = float((fitted.mean - train.y).pow(2).mean().sqrt())
    print(f"  training RMSE {train_rmse:.4g}, noise sd {fitted.aleatoric.mean().sqrt():.4g}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
