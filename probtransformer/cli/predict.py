"""``probtransformer predict``: the posterior predictive of a run for new inputs, as CSV."""

from __future__ import annotations

import argparse
from pathlib import Path

from probtransformer.cli._common import CLIError, check_output, given, warn, write_csv
from probtransformer.rundir import read_run

#: Input files some task reads (each task refuses the suffixes it does not read).
INPUT_SUFFIXES = (".npy", ".csv", ".txt", ".parquet", ".pq", ".csv.gz")  # tables: fit --data runs


def run(args: argparse.Namespace) -> None:
    """Predict for ``--input`` with the run's task (``Task.predict_frame``), write the CSV.

    Raises:
        CLIError: ``--input`` has another suffix or is not a file, or ``--output`` cannot be
            written (``check_output``: not a ``.csv``, or ``--input`` itself).
        ValueError: not a run directory, or an input file the task cannot read.
    """
    from probtransformer.tasks import task_of

    path = Path(args.input)
    if not path.name.lower().endswith(INPUT_SUFFIXES):
        raise CLIError(
            f"--input must be a .npy, .csv, .csv.gz, .txt or .parquet file, got {args.input!r}"
        )
    if not path.is_file():
        raise CLIError(f"--input {args.input} does not exist or is not a file")
    check_output(args.output, inputs=(args.input,))
    if (
        args.output is not None
        and Path(args.run_dir).resolve() in Path(args.output).resolve().parents
    ):
        raise CLIError(f"--output {args.output} is inside the run directory: write it elsewhere")
    fitted = read_run(args.run_dir)
    task = task_of(fitted.posterior.model)
    draws = given(num_samples=args.num_samples, seed=args.seed)
    write_csv(task.predict_frame(path, fitted, draws, warn=warn), args.output)
    if args.output is not None:
        print(f"wrote {args.output}")
