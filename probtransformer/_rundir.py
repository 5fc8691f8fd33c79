"""Reading a run directory written by ``probtransformer fit`` (shared by the CLI and the report)."""

from __future__ import annotations

import json
from pathlib import Path

METRICS_FILE = "metrics.json"
POSTERIOR_DIR = "posterior"


def is_run_dir(path: Path) -> bool:
    return (path / METRICS_FILE).is_file() and (path / POSTERIOR_DIR).is_dir()


def read_run(run_dir: str | Path):
    """``(metrics.json dict, Posterior on CPU)`` of ``run_dir``.

    Raises:
        ValueError: not a run directory, or its metrics.json is not a JSON object.
    """
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise ValueError(
            f"{run_dir} is not a probtransformer run directory "
            f"(it needs {METRICS_FILE} and {POSTERIOR_DIR}/)"
        )
    try:
        record = json.loads((run_dir / METRICS_FILE).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{run_dir / METRICS_FILE} is not valid JSON: {e}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{run_dir / METRICS_FILE} must hold a JSON object")

    from probtransformer.inference import load_posterior

    return record, load_posterior(run_dir / POSTERIOR_DIR)


def run_splits(record: dict, run_dir: str | Path):
    """``(test, train)``: the run's test split and the training rows its fit saw (the first
    ``num_train`` rows of the training split of ``dataset`` with ``seed``).

    Raises:
        ValueError: metrics.json does not record dataset and seed, or records a ``num_train``
            outside the training split.
    """
    from probtransformer import datasets

    metrics_file = Path(run_dir) / METRICS_FILE
    if "dataset" not in record or "seed" not in record:
        raise ValueError(f"{metrics_file} does not record dataset and seed")
    options = {}
    if record.get("val_fraction") is not None:
        options["val_fraction"] = record["val_fraction"]
    splits = datasets.load(record["dataset"], seed=record["seed"], **options)
    num_train = record.get("num_train", len(splits.train))
    if (
        isinstance(num_train, bool)
        or not isinstance(num_train, int)
        or not 1 <= num_train <= len(splits.train)
    ):
        raise ValueError(
            f"{metrics_file} records num_train {num_train!r}; the {record['dataset']} training "
            f"split has {len(splits.train)} rows"
        )
    return splits.test, splits.train[:num_train]
