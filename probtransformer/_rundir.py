"""Reading a run directory written by ``probtransformer fit``, and what the CLI and the report
share about the four task families (classification, tagging, language modeling, forecasting)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.json"
POSTERIOR_DIR = "posterior"
#: The task families of ``datasets.available()["task"]``, each fitted with its own model.
TASKS = ("classification", "tagging", "language-modeling", "forecasting")
#: Sequences per ``predict`` call for token-level models: their ``Prediction.probs`` is
#: ``(S, N, T, V)`` (100 draws x 32 windows x 64 steps x 101 characters: about 80 MB).
TOKEN_BATCH = 32


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


def model_task(model: Any) -> str:
    """The task family of a fitted model, one of ``TASKS`` (from its class, so runs written
    before metrics.json recorded ``task`` are read too).

    Raises:
        ValueError: a model of another class (not written by ``probtransformer fit``).
    """
    from probtransformer.models import (
        CausalLM,
        Seq2Seq,
        SequenceClassifier,
        SequenceRegressor,
        TokenTagger,
    )

    if isinstance(model, CausalLM):  # before TokenTagger: a CausalLM is one
        return "language-modeling"
    if isinstance(model, TokenTagger):
        return "tagging"
    if isinstance(model, SequenceRegressor | Seq2Seq):
        return "forecasting"
    if isinstance(model, SequenceClassifier):
        return "classification"
    raise ValueError(f"probtransformer fit does not write runs of a {type(model).__name__}")


def run_data(record: dict, run_dir: str | Path):
    """``(test, train, meta)``: the run's test split, the training rows its fit saw (the first
    ``num_train`` rows of the training split of ``dataset`` with ``seed``) and the dataset's
    ``meta``.

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
    return splits.test, splits.train[:num_train], splits.meta


def diagnostic_rows(record: dict, train):
    """The training rows the run's log-likelihood covers: the first
    ``inference_data_rows["train"]`` for token-level tasks (see the CLI), else all."""
    rows = record.get("inference_data_rows", {}).get("train")
    return train if rows is None else train[:rows]


def run_splits(record: dict, run_dir: str | Path):
    """``(test, train)`` of ``run_data``."""
    return run_data(record, run_dir)[:2]


def token_predictions(post, data, draws: dict, batch_size: int = TOKEN_BATCH) -> Iterator:
    """``(rows, Prediction)`` for successive batches of ``batch_size`` sequences of ``data``.

    Token-level predictions hold ``(S, N, T, V)`` probabilities; predicting a few sequences at a
    time keeps memory bounded (the caller keeps what it needs of each batch). ``draws`` are
    ``predict``'s ``num_samples``/``seed``: the same draws for every batch.
    """
    for start in range(0, len(data), batch_size):
        rows = data[start : start + batch_size]
        yield rows, post.predict(rows.x, rows.mask, **draws)


def real_steps(rows, value):
    """``value (N, T, ...)`` at the real steps of ``rows`` (all, without a mask): ``(M, ...)``."""
    if rows.mask is None:
        return value.reshape(-1, *value.shape[2:])
    return value[rows.mask]
