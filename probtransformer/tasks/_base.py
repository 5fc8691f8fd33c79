"""The task-family interface: what differs between the classification, tagging, language-modelling
and forecasting runs of ``probtransformer fit``, ``predict`` and ``report``.

A task family is one ``Task`` subclass in its own module, registered in ``probtransformer.tasks``.
It builds its model from a dataset's ``meta``, measures the test split, writes its own run files,
supplies its report sections and reads ``predict`` inputs; the CLI and the report page only call
these methods. Modules here import torch, pandas and the models lazily (inside methods), so the
registry can be read by ``probtransformer --help`` without importing torch.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

#: Equal-width bins of the reported ECE and of the reliability diagrams.
ECE_BINS = 15
#: Token-level runs export the log-likelihood (for LOO) and predictive draws of the first
#: this-many training and test sequences only (recorded as ``inference_data_rows``): 100 draws x
#: 5,000 windows of 64 steps would take about 30 minutes.
TOKEN_INFERENCE_DATA_ROWS = 500


@dataclasses.dataclass
class Evaluation:
    """What ``fit`` measured on the test split, and how the task writes its run files.

    Attributes:
        metrics: the metrics, first in metrics.json.
        sizes: counts recorded after ``num_test`` (tokens, forecasts).
        num_samples: posterior draws the predictions used.
        write: ``write(staging, record)`` writes the task's files (``Task.files``) into the
            run directory being staged, from the predictions already made.
        label: appended to the title of the attention figure of test example 0.
        lines: printed after the metrics.
        prediction: the ``Posterior.predict`` of the whole test split the metrics came from,
            reused for the ``predictions`` group of ``inference_data.nc``; None when the task
            predicts the test split in pieces (token-level tasks).
    """

    metrics: dict[str, Any]
    sizes: dict[str, Any]
    num_samples: int
    write: Callable[[Path, dict], None]
    label: str = ""
    lines: list[str] = dataclasses.field(default_factory=list)
    prediction: Any = None


@dataclasses.dataclass(frozen=True)
class ReportContext:
    """What a task's report sections read.

    Attributes:
        run_dir: the run directory.
        record: its metrics.json.
        post: its ``Posterior``.
        test: the test split (``SequenceData``).
        meta: the dataset's meta.
        draws: ``predict``'s ``seed`` and, when known, ``num_samples`` (the run's by default, so
            the figures match metrics.json).
    """

    run_dir: Path
    record: dict
    post: Any
    test: Any
    meta: dict
    draws: dict


class Task(abc.ABC):
    """One task family of ``probtransformer fit`` (``datasets.available()["task"]``).

    Class attributes:
        name: the task name of ``datasets.available()`` and of metrics.json's ``task``.
        models: the ``--model`` values the task accepts; ``"auto"`` is the task's model.
        files: the files ``Evaluation.write`` adds to a run directory.
        sections: ``{id: heading}`` of the report sections the task supplies, in page order
            (after the metrics, before attention, head importance and diagnostics).
        headline: ``{metrics.json key: unit}`` shown first in the report's metrics table.
        metrics_note: the report's note above the metrics table.
        printed_metrics: ``(metrics.json key, unit)`` printed by ``fit``.
        names_model: ``fit``'s summary line names the model class.
        inference_data_rows: training and test rows ``inference_data.nc`` covers (None: all).
        fit_preset: ``fit`` settings (``fit_svi`` names) the task's SVI and MAP-based fits use
            where the command line leaves them unset (``{}``: the library defaults).
    """

    name: ClassVar[str]
    models: ClassVar[tuple[str, ...]] = ("auto",)
    files: ClassVar[tuple[str, ...]] = ()
    sections: ClassVar[dict[str, str]] = {}
    headline: ClassVar[dict[str, str]] = {}
    metrics_note: ClassVar[str] = ""
    printed_metrics: ClassVar[tuple[tuple[str, str], ...]] = ()
    names_model: ClassVar[bool] = True
    inference_data_rows: ClassVar[int | None] = None
    fit_preset: ClassVar[dict[str, Any]] = {}

    @abc.abstractmethod
    def model_classes(self) -> tuple[type, ...]:
        """The model classes whose fitted runs are of this task (``task_of``)."""

    @abc.abstractmethod
    def build_model(self, meta: dict, options: dict[str, Any], *, model: str = "auto") -> Any:
        """The task's model for a dataset.

        Args:
            meta: the dataset's ``meta`` (``datasets.load(name).meta``).
            options: model keyword arguments that were set (d_model, num_heads, priors, ...);
                the rest take the model's defaults.
            model: one of ``models``.

        Returns:
            An unfitted model (a ``PyroModule`` following the model protocol).

        Raises:
            ValueError: ``model`` is not one of ``models``, or the model refuses ``options``.
        """

    @abc.abstractmethod
    def evaluate(self, post: Any, splits: Any, draws: dict) -> Evaluation:
        """Measure ``post`` on ``splits.test`` (predictions made once, reused by ``write``).

        Args:
            post: the fitted ``Posterior``.
            splits: the ``DatasetSplits`` of the fit (``test``, ``meta``).
            draws: ``predict``'s ``num_samples``/``seed`` that were set.
        """

    @abc.abstractmethod
    def report(self, context: ReportContext) -> tuple[dict[str, str], int | str]:
        """The task's report sections, ``{id: HTML}`` with the ids of ``sections``, and the
        number of posterior draws its predictions used ("?" when unknown)."""

    @abc.abstractmethod
    def predict_frame(
        self, path: Path, run: Any, draws: dict, *, warn: Callable[[str], None]
    ) -> Any:
        """``probtransformer predict``: the posterior predictive of ``run`` for the inputs in
        ``path``, one CSV row per sequence (or per real token).

        Args:
            path: the input file (the suffixes the task reads; others are refused).
            run: a run read back (``record``, ``posterior``, ``meta()``: the dataset's meta).
            draws: ``predict``'s ``num_samples``/``seed`` that were set.
            warn: called with a message for input problems that do not stop the prediction.

        Returns:
            A pandas DataFrame.

        Raises:
            ValueError: an unreadable or malformed input file, naming what was expected.
        """

    def handles(self, model: Any) -> int | None:
        """How specific this task is to ``model``: the position in ``type(model).__mro__`` of
        the nearest of ``model_classes`` (0 = its own class), or None when none matches."""
        mro = type(model).__mro__
        positions = [mro.index(cls) for cls in self.model_classes() if cls in mro]
        return min(positions, default=None)

    def check_model_choice(self, model: str) -> None:
        """Raise ValueError unless ``model`` is one of ``models``."""
        if model not in self.models:
            raise ValueError(f"model must be one of {self.models} for {self.name}, got {model!r}")


def read_table_data(path: Path, run: Any) -> tuple[Any, Any, str | None]:
    """A table of a ``fit --data`` run's layout, encoded by the run's schema (its scaling and
    vocabulary; the target column, if present, is not read: new data may lack it or hold
    classes never seen).

    Returns:
        ``SequenceData`` (``x`` ``(N, T[, F])``, ``mask`` ``(N, T)``), the ``(N,)`` sequence
        ids in file order (None for the wide layout), and the id column's name.

    Raises:
        ValueError: the table's own checks (file, column and row named).
    """
    import numpy as np
    import pandas as pd

    from probtransformer.data import SequenceData
    from probtransformer.data.table_files import read_table
    from probtransformer.data.table_schema import TableSchema

    schema = TableSchema.from_dict(run.record["table"])
    frame = read_table(path, text_columns=(schema.id,) if schema.id else ())
    schema = dataclasses.replace(schema, target=None)
    data = SequenceData.from_pandas(frame, schema=schema, source=str(path))
    if schema.id is None:
        return data, None, None
    return data, np.asarray(pd.factorize(frame[schema.id], sort=False)[1]), schema.id


def table_scaling(record: dict) -> dict[str, Any] | None:
    """How a ``fit --data`` run standardized the file's numeric columns for its model, as
    ``out_of_range_message``'s ``loc``, ``scale`` (``(F,)``), ``names`` (the columns; the
    wide layout's one feature is the values) and, where the run recorded them, ``low`` and
    ``high`` (``(F,)``, each column's training range in the file's units); None for other runs
    (their inputs are the model's)."""
    table = record.get("table") or {}
    if table.get("x_loc") is None or table.get("vocab") is not None:
        return None
    loc, scale, features = table["x_loc"], table["x_scale"], table["features"]
    names = features if len(features) == len(loc) else ["values"] * len(loc)
    return dict(loc=loc, scale=scale, names=names, low=table.get("x_min"), high=table.get("x_max"))


def training_range(
    x_range: list[float] | None, scaling: dict[str, Any] | None
) -> list[float] | dict[str, list[float]] | None:
    """The range of the training inputs, ``x_range`` (``[low, high]``); with a ``fit --data``
    run's ``scaling`` (``table_scaling``), per column in the file's units (``{column: [low,
    high]}``: the recorded range of each column, or for runs saved before it was recorded,
    ``x_range`` with the standardization undone, a bound on it)."""
    if x_range is None or scaling is None:
        return x_range
    pairs = list(zip(scaling["loc"], scaling["scale"], strict=True))
    lows = scaling["low"] or [loc + x_range[0] * scale for loc, scale in pairs]
    highs = scaling["high"] or [loc + x_range[1] * scale for loc, scale in pairs]
    return {name: [lo, hi] for name, lo, hi in zip(scaling["names"], lows, highs, strict=True)}
