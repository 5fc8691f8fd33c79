"""``probtransformer report``: write ``report.html`` into a run directory."""

from __future__ import annotations

import argparse

from probtransformer.cli._common import given


def run(args: argparse.Namespace) -> None:
    """Write the report (``probtransformer.report.write_report``) and say where."""
    from probtransformer.report import write_report

    path = write_report(args.run_dir, **given(num_samples=args.num_samples, seed=args.seed))
    print(f"wrote {path}")
