"""``probtransformer diagnose``: the aggregated diagnostics table, verdict and PSIS-LOO of a run,
recomputed from its posterior and training rows."""

from __future__ import annotations

import argparse

from probtransformer.cli._common import given
from probtransformer.rundir import diagnostic_rows, read_run, run_data


def run(args: argparse.Namespace) -> None:
    """Print ``Posterior.diagnose`` on the training rows the run's log-likelihood covers; for a
    forecasting run, the verdict adds the test-split interval coverage of its metrics.json
    (``tasks.forecasting.interval_lines``)."""
    from probtransformer.inference.diagnostics.summary import format_table
    from probtransformer.tasks.forecasting import interval_lines

    fitted = read_run(args.run_dir)
    train = diagnostic_rows(fitted.record, run_data(fitted.record, fitted.path)[1])
    table = fitted.posterior.diagnose(train, verbose=False, **given(num_samples=args.num_samples))
    print(format_table(table))
    verdict = table.attrs["verdict"]
    if "interval_coverage" in fitted.record and "num_test_forecasts" in fitted.record:
        verdict = [*verdict, *interval_lines(fitted.record)]  # the test split, from metrics.json
    print("\n".join(verdict))
