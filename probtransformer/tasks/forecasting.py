"""Forecasting (sunspots, co2, macrodata): a ``SequenceRegressor`` (last-step pooling) or, with
``--model seq2seq``, a ``Seq2Seq``, in the dataset's standardisation, measured in the data's
units over every (origin, step) of the test split."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from probtransformer.tasks._base import Evaluation, ReportContext
from probtransformer.tasks._features import FeatureTask

INTERVAL_PROB = 0.9  # the predictive interval of coverage, width, the CSV and the fan chart
FORECASTS = 4  # test forecasts in the fan chart
#: Predictive draws of each target for CRPS, spread over the posterior draws (a one-draw
#: posterior gets them all from its likelihood: with one sampled y, CRPS was |y_1 - y|).
CRPS_SAMPLES = 1000
PREDICTIONS_FILE = "predictions.csv"  # every test forecast
FORECAST_FILE = "forecast.png"  # fan chart of a few test forecasts


class ForecastingTask(FeatureTask):
    """``H`` future values from a context window. Writes ``predictions.csv`` (origin, step,
    period, mean, lower, upper, y) and ``forecast.png``; the report adds the fan chart and the
    interval coverage per horizon step."""

    name = "forecasting"
    models = ("auto", "seq2seq")
    # Every part latent (block.BAYESIAN_PARTS, written out: tasks do not import torch). With
    # the embedding, feed-forward and norms as point estimates, the Nile forecast (43 training
    # windows) fitted its training targets to RMSE 11 against 152 on the test split, so the
    # latent noise scale settled at 37 instead of about 140 and the 90% interval covered 0.39;
    # every part latent: training RMSE 128, test 127, coverage 0.93 (benchmarks/BENCHMARKS.md,
    # "Forecast interval coverage").
    fit_preset = {"bayesian": ("embedding", "attention", "ffn", "norm", "head")}
    files = (PREDICTIONS_FILE, FORECAST_FILE)
    sections = {"forecast": "Test forecasts"}
    headline = {
        "rmse": "data units",
        "mae": "data units",
        "interval_coverage": "",
        "interval_width": "data units",
        "crps": "data units",
    }
    metrics_note = (
        "computed over every (origin, step) of the test split, in the data's units: RMSE and MAE "
        "of the posterior predictive mean, coverage and mean width of the 90% predictive "
        "interval (quantiles of the mixture of the draws' likelihoods, noise included; "
        "flagged outside metrics.coverage_band for the number of test points), CRPS from 1,000 "
        "draws of the posterior predictive."
    )
    printed_metrics = (
        ("rmse", ""),
        ("mae", ""),
        ("interval_coverage", f" ({INTERVAL_PROB:.0%} predictive interval)"),
        ("interval_width", ""),
        ("crps", ""),
    )

    def model_classes(self) -> tuple[type, ...]:
        from probtransformer.models import Seq2Seq, SequenceRegressor

        return (SequenceRegressor, Seq2Seq)

    def build_model(self, meta: dict, options: dict[str, Any], *, model: str = "auto") -> Any:
        """``SequenceRegressor(in_features, max_len, horizon=H, pooling="last")`` or, with
        ``model="seq2seq"``, ``Seq2Seq(in_features, max_len, H)``, both with the dataset's
        ``x_loc``/``x_scale``/``y_loc``/``y_scale``; see ``Task.build_model``."""
        from probtransformer.models import Seq2Seq, SequenceRegressor

        self.check_model_choice(model)
        scales = {key: meta[key] for key in ("x_loc", "x_scale", "y_loc", "y_scale")}
        if model == "seq2seq":
            return Seq2Seq(
                meta["in_features"], meta["max_len"], meta["horizon"], **scales, **options
            )
        return SequenceRegressor(
            meta["in_features"],
            meta["max_len"],
            horizon=meta["horizon"],
            pooling="last",
            **scales,
            **options,
        )

    def evaluate(self, post: Any, splits: Any, draws: dict) -> Evaluation:
        """RMSE, MAE, 90% interval coverage and width, CRPS in the data's units, over every
        (origin, step) of the test split; the predictions CSV and the fan chart."""
        from probtransformer import metrics

        test = splits.test
        pred = post.predict(test.x, test.mask, **draws)
        lower, upper = pred.predictive_interval(INTERVAL_PROB)
        error = (pred.mean - test.y).double()
        values = dict(
            rmse=float(error.pow(2).mean().sqrt()),
            mae=float(error.abs().mean()),
            interval_coverage=metrics.interval_coverage(lower, upper, test.y),
            interval_prob=INTERVAL_PROB,
            interval_width=float((upper - lower).double().mean()),
            crps=metrics.crps_samples(pred.predictive_samples(CRPS_SAMPLES), test.y),
        )
        num_samples = pred.samples.shape[0]
        low, high = metrics.coverage_band(INTERVAL_PROB, int(test.y.numel()))
        values["interval_coverage_band"] = [low, high]
        lines = interval_lines(
            {**values, "num_test_forecasts": int(test.y.numel()), "num_samples": num_samples}
        )
        values["warnings"] = [line for line in lines if not line.startswith("ok")]
        frame = forecast_frame(pred, test, splits.meta, prob=INTERVAL_PROB)

        def write(staging: Path, record: dict) -> None:
            from probtransformer import plots

            frame.to_csv(staging / PREDICTIONS_FILE, index=False)
            title = f"{record['dataset']} test forecasts, {record['model']}, {record['inference']}"
            figure = forecast_figure(frame, splits.meta, prob=INTERVAL_PROB, title=title)
            plots.save_figure(figure, staging / FORECAST_FILE)

        sizes = dict(horizon=splits.meta.get("horizon"), num_test_forecasts=int(test.y.numel()))
        lines = [f"  {line}" for line in lines]
        return Evaluation(values, sizes, num_samples, write, lines=lines, prediction=pred)

    def report(self, context: ReportContext) -> tuple[dict[str, str], int | str]:
        """The fan chart and the interval coverage per step, drawn again."""
        from probtransformer.report_sections import image, table

        record, test, meta = context.record, context.test, context.meta
        pred = context.post.predict(test.x, test.mask, **context.draws)
        frame = forecast_frame(pred, test, meta, prob=INTERVAL_PROB)
        title = f"{record['dataset']} test forecasts, {record.get('model', '?')}"
        fig = forecast_figure(frame, meta, prob=INTERVAL_PROB, title=title)
        inside = (frame["lower"] <= frame["y"]) & (frame["y"] <= frame["upper"])
        by_step = frame.assign(inside=inside, width=frame["upper"] - frame["lower"]).groupby("step")
        rows = [
            (str(step), f"{group['inside'].mean():.3f}", f"{group['width'].mean():.4g}")
            for step, group in by_step
        ]
        section = (
            f'<p class="note">{min(FORECASTS, len(test))} of the {len(test)} test forecasts: the '
            f"context before the origin (grey), the truth (black), the posterior predictive mean "
            f"(blue) and its {INTERVAL_PROB:.0%} predictive interval (band).</p>\n"
            + image(fig, "forecast fan chart")
            + f"<p>Coverage of the {INTERVAL_PROB:.0%} predictive interval (nominal "
            f"{INTERVAL_PROB:.2f}) and its mean width per horizon step, over the test "
            "origins:</p>\n" + table(("step", "coverage", "mean width"), rows)
        )
        return {"forecast": section}, pred.samples.shape[0]

    def predict_frame(
        self, path: Path, run: Any, draws: dict, *, warn: Callable[[str], None]
    ) -> Any:
        """See ``FeatureTask.predict_frame``. A run fitted on a ``--data`` series reads a
        table of the same layout (``.csv`` or ``.parquet``) and forecasts the ``horizon``
        periods after its last row from its last ``context`` rows: one row, led by
        ``after`` (that last time).

        Raises:
            ValueError: the series' own checks (``datasets.tables.read_series``), another
                number of feature columns, or fewer rows than the context.
        """
        data = run.record.get("data") or {}
        if data.get("task") != "forecasting":
            return super().predict_frame(path, run, draws, warn=warn)
        import torch

        from probtransformer.datasets.tables import read_series, read_table

        source = str(path)
        _, table = read_series(
            read_table(path), source, target=data["target"], time=data["time"],
            features=data["features"],
        )  # fmt: skip
        context, width = int(data["context"]), run.posterior.model.config["in_features"]
        if table.shape[1] != width:
            raise ValueError(
                f"{source}: the run reads {width} feature column(s), got {table.shape[1]}: "
                f"{list(table.columns)} (give the columns of the fitted file)"
            )
        if len(table) < context:
            raise ValueError(
                f"{source}: {len(table)} time steps, but the run forecasts from the last "
                f"{context} (its --context)"
            )
        x = torch.tensor(table.to_numpy()[-context:], dtype=torch.float32)[None]
        out = self.prediction_frame(run.posterior.predict(x, **draws), run.record)
        out.insert(0, "after", [table.index[-1]])
        return out

    def prediction_frame(self, pred: Any, record: dict) -> Any:
        """``mean``, ``std``, ``aleatoric``, ``epistemic`` (variances), ``lower``, ``upper`` (90%
        predictive interval) per horizon step."""
        return pred.to_dataframe()


def interval_lines(record: dict) -> list[str]:
    """Verdict lines on the test-split predictive interval of a forecasting run: ``"WARN  ..."``
    when its coverage is outside ``metrics.coverage_band`` for the number of test points
    (``"ok    ..."`` otherwise), and ``"info  ..."`` for a one-draw posterior, whose interval is
    the likelihood's noise alone. ``fit`` prints them and keeps all but the ok line in
    metrics.json (``warnings``); ``diagnose`` prints them from metrics.json.

    Args:
        record: metrics.json (or ``evaluate``'s metrics) with ``interval_coverage``,
            ``num_test_forecasts`` and, optionally, ``interval_prob`` (default 0.9) and
            ``num_samples``.

    Returns:
        One or two lines, each led by its flag (6 characters).
    """
    from probtransformer import metrics

    coverage, n = record["interval_coverage"], int(record["num_test_forecasts"])
    prob = record.get("interval_prob", INTERVAL_PROB)
    low, high = metrics.coverage_band(prob, n)
    band = (
        f"band [{low:.2f}, {high:.2f}] ({1 - 2 * (1 - prob):.2f}-{1 - 0.3 * (1 - prob):.2f} "
        "widened by 3 binomial SE)"
    )
    text = f"{prob:.0%} predictive interval covers {coverage:.3f} of {n} test points"
    if coverage < low:
        text = f"WARN  {text}, below the {band}: the interval is too narrow; trust its width less"
    elif coverage > high:
        text = f"WARN  {text}, above the {band}: the interval is wider than it needs to be"
    else:
        text = f"ok    {text}, inside the {band}"
    lines = [text]
    if record.get("num_samples") == 1:
        lines.append(
            "info  one posterior draw (a point estimate): the interval is the likelihood's "
            "noise alone, with no epistemic part"
        )
    return lines


def forecast_frame(pred, test, meta: dict, *, prob: float = 0.9):
    """Every test forecast of a forecasting run, one row per (origin, step).

    Args:
        pred: the ``RegressionPrediction`` of ``test.x``.
        test: the test split (``y`` ``(N, H)`` in the data's units).
        meta: the dataset's meta (``origins["test"]``: each row's origin, a position in
            ``series``).
        prob: probability of the predictive interval.

    Returns:
        DataFrame with columns ``origin`` (position of the first forecast period in the
        series), ``step`` (1..H), ``period`` (that step's index label), ``mean``, ``lower``,
        ``upper``, ``y``.
    """
    import pandas as pd

    n = len(test)
    lower, upper = pred.predictive_interval(prob)
    values = {
        name: value.reshape(n, -1).double().numpy()
        for name, value in dict(mean=pred.mean, lower=lower, upper=upper, y=test.y).items()
    }
    horizon = values["y"].shape[1]
    origins = np.asarray(meta.get("origins", {}).get("test", np.arange(n)), dtype=np.int64)
    steps = np.arange(1, horizon + 1)
    positions = (origins[:, None] + steps[None, :] - 1).reshape(-1)
    series = meta.get("series")
    if series is not None and len(series) > positions.max():
        period = [str(label) for label in series.index[positions]]
    else:
        period = [str(position) for position in positions]
    frame = {"origin": np.repeat(origins, horizon), "step": np.tile(steps, n), "period": period}
    return pd.DataFrame({**frame, **{k: v.reshape(-1) for k, v in values.items()}})


def forecast_figure(frame, meta: dict, *, forecasts: int = FORECASTS, prob: float = 0.9, title=""):
    """Fan chart (a matplotlib ``Figure``) of ``forecasts`` evenly spaced test forecasts of
    ``forecast_frame``: the context before each origin, the truth, the predictive mean and its
    ``prob`` interval."""
    import pandas as pd
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    series = meta.get("series")
    origins = frame["origin"].unique()
    chosen = origins[np.unique(np.linspace(0, len(origins) - 1, forecasts).round().astype(int))]
    cols = min(2, len(chosen))
    rows = math.ceil(len(chosen) / cols)
    fig = Figure(figsize=(5.0 * cols, 3.0 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).reshape(-1)
    index = None
    if series is not None:
        index = series.index.to_timestamp() if isinstance(series.index, pd.PeriodIndex) else None
        index = series.index if index is None else index
    for ax, origin in zip(axes, chosen, strict=False):
        part = frame[frame["origin"] == origin]
        steps = part["step"].to_numpy()
        positions = origin + steps - 1
        if series is not None:
            history = np.arange(max(0, origin - 3 * len(steps)), origin)
            ax.plot(index[history], series.to_numpy()[history], color="0.55", label="context")
            x = index[positions]
        else:
            x = positions
        ax.fill_between(
            x, part["lower"], part["upper"], color="tab:blue", alpha=0.25, label=f"{prob:.0%}"
        )
        ax.plot(x, part["mean"], color="tab:blue", marker=".", label="mean")
        ax.plot(x, part["y"], color="black", marker="o", markersize=3, label="truth")
        ax.set_title(f"origin {part['period'].iloc[0]}", fontsize=9)
        ax.tick_params(labelsize=8)
        if _integer_valued(x):  # years read as floats (1871.0): no tick at 1952.5
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    for ax in axes[len(chosen) :]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _integer_valued(x) -> bool:
    """Whether the time values ``x`` are plain numbers that are all whole (years, steps)."""
    values = np.asarray(x)
    if values.dtype.kind in "iu":
        return True
    if values.dtype.kind != "f":
        return False  # dates, periods, labels
    return bool((np.isfinite(values) & (values == np.round(values))).all())
