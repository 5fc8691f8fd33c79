"""A self-contained HTML report of a run directory written by ``probtransformer fit``.

``write_report(run_dir)`` writes ``run_dir/report.html``: one file with inline CSS and every
figure embedded as a base64 PNG ``data:`` URI, so it can be mailed or archived alone. It
reloads the run's posterior and its dataset split (dataset, seed and ``num_train`` from
``metrics.json``) and draws the test-split predictions again with the run's seed and number of
draws, so its numbers match ``metrics.json``. Sections, each an ``<h2>`` with a stable ``id``,
those that apply to the run's task (``TASK_SECTIONS``) in this order:

- ``metrics``: the numbers of ``metrics.json``;
- ``reliability`` (classification, tagging): reliability diagram of the test predictive mean
  (tagging: over the real test characters);
- ``risk-coverage`` (classification): risk-coverage curves of selective prediction by total
  predictive entropy and by epistemic uncertainty (mutual information), AURC in the legend, and
  the accuracy of the predictions kept at a few coverages (``Prediction.reject``);
- ``forecast`` (forecasting): fan chart of a few test forecasts (predictive mean, 90%
  predictive interval, truth) and the interval coverage per horizon step;
- ``samples`` (language modeling): the generated test continuations of ``samples.json``;
- ``attention``: posterior mean and sd of the attention of the first test sequences per layer
  and head, and the mean posterior sd per layer and head;
- ``head-importance``: the posterior of the head gates (``Posterior.head_importance``) when the
  model has them;
- ``diagnostics``: the aggregated table and verdict of ``Posterior.diagnose`` on the training
  rows the fit saw (PSIS-LOO included).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from probtransformer._rundir import (
    diagnostic_rows,
    model_task,
    read_run,
    real_steps,
    run_data,
    token_predictions,
)

REPORT_FILE = "report.html"
SAMPLES_FILE = "samples.json"  # written by fit for language-modeling runs
#: ``id`` of each section's ``<h2>``, in order, with its heading.
SECTIONS = {
    "metrics": "Test metrics",
    "reliability": "Reliability",
    "risk-coverage": "Selective prediction: risk–coverage",
    "forecast": "Test forecasts",
    "samples": "Generated text",
    "attention": "Posterior attention",
    "head-importance": "Head importance",
    "diagnostics": "Diagnostics",
}
_COMMON = ("attention", "head-importance", "diagnostics")
#: The sections of each task's report, in ``SECTIONS`` order.
TASK_SECTIONS = {
    "classification": ("metrics", "reliability", "risk-coverage", *_COMMON),
    "tagging": ("metrics", "reliability", *_COMMON),
    "language-modeling": ("metrics", "samples", *_COMMON),
    "forecasting": ("metrics", "forecast", *_COMMON),
}
FORECASTS = 4  # test forecasts in the fan chart
INTERVAL_PROB = 0.9  # the predictive interval of the fan chart
ATTENTION_EXAMPLES = 2  # test sequences whose posterior attention is drawn
COVERAGES = (0.5, 0.8, 0.9, 1.0)  # coverages of the selective-accuracy table
ECE_BINS = 15  # when metrics.json does not record ece_bins
DPI = 100
#: metrics.json keys shown first, with their units.
HEADLINE = {
    "accuracy": "",
    "nll": "nats",
    "ece": "",
    "brier": "",
    "mean_epistemic": "nats",
    "perplexity": "",
    "boundary_f1": "",
    "rmse": "data units",
    "mae": "data units",
    "interval_coverage": "",
    "interval_width": "data units",
    "crps": "data units",
    "inference": "",
    "seconds": "s",
}
#: The note above the metrics table, by task.
METRICS_NOTES = {
    "classification": "computed on the test split from the posterior predictive mean (NLL in "
    "nats; ECE over equal-width bins of the top-class probability).",
    "tagging": "computed over the real (unpadded) characters of the test split from the "
    "posterior predictive mean: per-character accuracy, NLL in nats per character, ECE over "
    "equal-width bins of the top-class probability, F1 of the boundary tag.",
    "language-modeling": "computed over every next-token prediction of the test split from the "
    "posterior predictive mean: perplexity = exp(NLL), NLL in nats per token, accuracy of the "
    "most probable next token.",
    "forecasting": "computed over every (origin, step) of the test split, in the data's units: "
    "RMSE and MAE of the posterior predictive mean, coverage and mean width of the 90% "
    "predictive interval (noise included), CRPS from the predictive samples.",
}
NO_GATES = (
    "This model has no head gates, so there is no posterior over how many heads it needs; fit "
    "one with <code>SequenceClassifier(head_prior=priors.HeadGatePrior())</code>."
)
STYLE = """
body { font-family: system-ui, sans-serif; max-width: 72rem; margin: 2rem auto; padding: 0 1rem;
       color: #222; line-height: 1.45; }
h1 { font-size: 1.5rem; } h2 { margin-top: 2.5rem; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: right; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; }
img { max-width: 100%; height: auto; display: block; margin: 0.8rem 0; }
pre { background: #f7f7f7; padding: 0.8rem; overflow-x: auto; font-size: 0.85rem; }
nav a { margin-right: 1rem; } .note { color: #555; }
"""


def write_report(
    run_dir: str | os.PathLike, *, num_samples: int | None = None, seed: int | None = None
) -> Path:
    """Write ``run_dir/report.html``, a self-contained HTML report of a ``probtransformer fit`` run.

    The page has the sections of this module's docstring; every image is a base64 PNG
    ``data:`` URI and the CSS is inline, so the file references nothing else. An existing
    report is replaced (written to a temporary file first, then renamed).

    Args:
        run_dir: a run directory (``metrics.json`` and ``posterior/``) written by
            ``probtransformer fit``.
        num_samples: posterior draws for the predictions, attention and diagnostics (default:
            the ``num_samples`` of ``metrics.json`` for predictions and attention, so the
            figures match its numbers, and ``Posterior.diagnose``'s default for diagnostics).
        seed: seeds the draws (default: the run's ``seed``).

    Returns:
        The path of ``report.html``.

    Raises:
        ValueError: ``run_dir`` is not a run directory; its ``metrics.json`` is not a JSON
            object recording ``dataset`` and ``seed``, names an unknown dataset, or records a
            ``num_train`` outside its training split; ``num_samples`` is not a positive int.
        TypeError: ``seed`` is not an int.
        OSError: ``report.html`` cannot be written.
    """
    run_dir = Path(run_dir)
    if num_samples is not None and (
        isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1
    ):
        raise ValueError(f"num_samples must be a positive int or None, got {num_samples!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    record, post = read_run(run_dir)
    test, train, meta = run_data(record, run_dir)
    page = _page(run_dir, record, post, test, train, meta, num_samples=num_samples, seed=seed)
    path = run_dir / REPORT_FILE
    staging = run_dir / f".{REPORT_FILE}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        staging.write_text(page, encoding="utf-8")
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    return path


# -- reading the run ----------------------------------------------------------------------------


# -- the page -----------------------------------------------------------------------------------


def _page(run_dir, record, post, test, train, meta, *, num_samples, seed) -> str:
    seed = record["seed"] if seed is None else seed
    draws = record.get("num_samples") if num_samples is None else num_samples
    draws = {"seed": seed, **({"num_samples": draws} if isinstance(draws, int) else {})}
    task = model_task(post.model)
    sections = {"metrics": _metrics_section(record, task)}
    if task == "classification":
        pred = post.predict(test.x, test.mask, **draws)
        used = pred.probs.shape[0]
        sections["reliability"] = _reliability_section(record, pred.mean, test.y, "sequences")
        sections["risk-coverage"] = _risk_coverage_section(record, pred, test)
    elif task == "tagging":
        probs, labels, used = [], [], 0
        for rows, pred in token_predictions(post, test, draws):
            probs.append(real_steps(rows, pred.mean))
            labels.append(real_steps(rows, rows.y))
            used = pred.probs.shape[0]
        probs, labels = torch.cat(probs), torch.cat(labels)
        sections["reliability"] = _reliability_section(record, probs, labels, "characters")
    elif task == "forecasting":
        pred = post.predict(test.x, test.mask, **draws)
        used = pred.samples.shape[0]
        sections["forecast"] = _forecast_section(record, pred, test, meta)
    else:  # language modeling: the metrics and samples are those fit computed
        used = record.get("num_samples", "?")
        sections["samples"] = _samples_section(run_dir)
    sections["attention"] = _attention_section(record, post, test, draws)
    sections["head-importance"] = _head_importance_section(post)
    sections["diagnostics"] = _diagnostics_section(
        post, diagnostic_rows(record, train), num_samples=num_samples, seed=seed
    )
    title = f"probtransformer report: {run_dir.name}"
    what = (
        f"{record['dataset']} · {record.get('inference', '?')} · "
        f"{record.get('num_train', len(train))} training rows · {len(test)} test rows · "
        f"{used} posterior draws for the predictions (seed {seed})"
    )
    nav = " ".join(f'<a href="#{key}">{html.escape(SECTIONS[key])}</a>' for key in sections)
    body = "\n".join(
        f'<h2 id="{key}">{html.escape(SECTIONS[key])}</h2>\n{content}'
        for key, content in sections.items()
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        f"<h1>{html.escape(title)}</h1>\n<p>{html.escape(what)}</p>\n<nav>{nav}</nav>\n"
        f"{body}\n</body>\n</html>\n"
    )


def _metrics_section(record: dict, task: str = "classification") -> str:
    keys = [k for k in HEADLINE if k in record] + [k for k in record if k not in HEADLINE]
    rows = [(key, _value(record[key]), HEADLINE.get(key, "")) for key in keys]
    return f'<p class="note">From metrics.json: {html.escape(METRICS_NOTES[task])}</p>\n' + _table(
        ("metric", "value", "unit"), rows
    )


def _reliability_section(record: dict, probs, labels, what: str) -> str:
    from probtransformer import plots

    bins = record.get("ece_bins", ECE_BINS)
    title = f"{record['dataset']} test, {record.get('inference', '?')}"
    if what != "sequences":
        title = f"{record['dataset']} test {what}, {record.get('inference', '?')}"
    fig = plots.reliability_figure(probs, labels, n_bins=bins, title=title)
    return (
        f'<p class="note">Accuracy per bin of top-class confidence on the {len(labels)} test '
        f"{what}; bars on the diagonal are calibrated, bars below it over-confident.</p>\n"
        + _image(fig, "reliability diagram")
    )


def _risk_coverage_section(record: dict, pred, test) -> str:
    from probtransformer import metrics, plots

    correct = pred.predicted == test.y
    scores = {"total entropy": "entropy", "epistemic (mutual information)": "epistemic"}
    fig = plots.risk_coverage_figure(
        {label: getattr(pred, name) for label, name in scores.items()},
        correct,
        title=f"{record['dataset']} test: selective prediction",
    )
    rows = []
    for coverage in COVERAGES:
        row = [f"{coverage:.0%}"]
        for name in scores.values():
            keep = pred.reject(coverage=coverage, score=name)
            row.append(f"{float(correct[keep].double().mean()):.4f}")
        rows.append(row)
    aurc = [f"{metrics.aurc(getattr(pred, name), correct):.4f}" for name in scores.values()]
    rows.append(["AURC", *aurc])
    header = ("coverage", *(f"accuracy kept, by {label}" for label in scores))
    return (
        '<p class="note">Predictions are kept from the most to the least certain; risk is the '
        "error rate among those kept. A useful uncertainty score keeps the risk low at low "
        "coverage (small AURC).</p>\n" + _image(fig, "risk-coverage curves") + _table(header, rows)
    )


def _attention_section(record: dict, post, test, draws: dict) -> str:
    """The encoder's self-attention; an encoder-decoder's cross-attention too."""
    kinds = getattr(post.model, "attention_modules", {})
    modules = [kind for kind in ("encoder.self", "decoder.cross") if kind in kinds]
    return "\n".join(_attention_part(record, post, test, draws, m) for m in modules)


def _attention_part(record: dict, post, test, draws: dict, module: str) -> str:
    n = min(ATTENTION_EXAMPLES, len(test))
    first = test[:n]
    attention = post.attention(first.x, first.mask, module=module, **draws)
    labelled = first.y is not None and first.y.dim() == 1 and not first.y.is_floating_point()
    images = []
    for i in range(n):
        label = f" (label {int(first.y[i])})" if labelled else ""
        title = f"posterior attention, {record['dataset']} test example {i}{label}"
        if module != "encoder.self":
            title += f" ({module})"
        images.append(_image(attention.plot(i, title=title), f"posterior attention {i}"))
    std = attention.std()  # (n, layer, head, query, key)
    if first.mask is None or module != "encoder.self":
        weight = torch.ones(std.shape[0], 1, 1, *std.shape[3:])
    else:  # only (query, key) pairs of real steps
        mask = first.mask.to(std.dtype)
        weight = (mask[:, :, None] * mask[:, None, :])[:, None, None]
    weight = weight.expand_as(std)
    mean_std = (std * weight).sum((0, 3, 4)) / weight.sum((0, 3, 4))  # (layer, head)
    header = ("layer", *(f"head {h}" for h in range(mean_std.shape[1])))
    rows = [(str(layer), *(f"{v:.4f}" for v in values)) for layer, values in enumerate(mean_std)]
    return (
        f'<p class="note">Posterior mean and standard deviation of the attention weights '
        f"({attention.module}) of the first {n} test sequence(s), per layer (rows) and head "
        "(columns).</p>\n"
        + "\n".join(images)
        + f"<p>Mean posterior sd of the attention weights over the {n} sequence(s) and every "
        "(query, key) pair, per layer and head: how unsure the posterior is of where each head "
        "looks.</p>\n" + _table(header, rows)
    )


def _forecast_section(record: dict, pred, test, meta: dict) -> str:
    frame = forecast_frame(pred, test, meta, prob=INTERVAL_PROB)
    title = f"{record['dataset']} test forecasts, {record.get('model', '?')}"
    fig = forecast_figure(frame, meta, prob=INTERVAL_PROB, title=title)
    inside = (frame["lower"] <= frame["y"]) & (frame["y"] <= frame["upper"])
    by_step = frame.assign(inside=inside, width=frame["upper"] - frame["lower"]).groupby("step")
    rows = [
        (str(step), f"{group['inside'].mean():.3f}", f"{group['width'].mean():.4g}")
        for step, group in by_step
    ]
    return (
        f'<p class="note">{min(FORECASTS, len(test))} of the {len(test)} test forecasts: the '
        f"context before the origin (grey), the truth (black), the posterior predictive mean "
        f"(blue) and its {INTERVAL_PROB:.0%} predictive interval (band).</p>\n"
        + _image(fig, "forecast fan chart")
        + f"<p>Coverage of the {INTERVAL_PROB:.0%} predictive interval (nominal "
        f"{INTERVAL_PROB:.2f}) and its mean width per horizon step, over the test origins:</p>\n"
        + _table(("step", "coverage", "mean width"), rows)
    )


def _samples_section(run_dir: Path) -> str:
    path = run_dir / SAMPLES_FILE
    try:
        samples = json.loads(path.read_text(encoding="utf-8"))
        rows = [
            (
                str(s["test_row"]),
                s["prompt"].replace("\n", "⏎"),
                s["continuation"].replace("\n", "⏎"),
                f"{s['mean_entropy']:.3f}",
                f"{s['mean_epistemic']:.4f}",
            )
            for s in samples["samples"]
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return f"<p>This run has no readable {SAMPLES_FILE}.</p>"
    header = ("test row", "prompt", "continuation", "mean entropy", "mean epistemic")
    return (
        f'<p class="note">{samples.get("strategy", "?")} continuations of '
        f"{samples.get('max_new_tokens', '?')} tokens after the first characters of test "
        "windows (written by fit), with the mean per-token entropy of the posterior predictive "
        "and its epistemic part (nats).</p>\n" + _table(header, rows, text_columns=3)
    )


def forecast_frame(pred, test, meta: dict, *, prob: float = 0.9) -> pd.DataFrame:
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


def forecast_figure(
    frame: pd.DataFrame, meta: dict, *, forecasts: int = FORECASTS, prob: float = 0.9, title=""
) -> Figure:
    """Fan chart of ``forecasts`` evenly spaced test forecasts of ``forecast_frame``: the context
    before each origin, the truth, the predictive mean and its ``prob`` interval."""
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
    for ax in axes[len(chosen) :]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _head_importance_section(post) -> str:
    frame = _call_optional(post, "head_importance")
    if not isinstance(frame, pd.DataFrame) or frame.empty:
        return f"<p>{NO_GATES}</p>"
    parts = [
        '<p class="note">Posterior of each head\'s gate in [0, 1] (mean and credible interval): '
        "a gate near 0 switches its head off.</p>",
        _image(_head_importance_figure(frame), "head importance"),
        _frame_table(frame),
    ]
    effective = _call_optional(post, "effective_num_heads")
    if isinstance(effective, pd.DataFrame | pd.Series):
        parts += ["<p>Effective number of heads:</p>", _frame_table(pd.DataFrame(effective))]
    elif effective is not None:
        parts.append(f"<p>Effective number of heads: {html.escape(_value(effective))}</p>")
    return "\n".join(parts)


def _call_optional(post, name: str) -> Any:
    """``post.name()``, or None when the method is missing or the model lacks head gates."""
    method = getattr(post, name, None)
    if not callable(method):
        return None
    try:
        return method()
    except (ValueError, TypeError, NotImplementedError):
        return None


def _head_importance_figure(frame: pd.DataFrame) -> Figure:
    """Bars of each head's posterior gate mean, with its interval as error bars."""
    pairs = zip(frame["layer"], frame["head"], strict=True)
    labels = [f"L{int(layer)}·H{int(head)}" for layer, head in pairs]
    mean = frame["mean"].to_numpy(dtype=float)
    fig = Figure(figsize=(max(4.0, 0.5 * len(labels) + 1.5), 3.2), layout="constrained")
    ax = fig.subplots()
    xs = np.arange(len(labels))
    error = None
    if {"lower", "upper"} <= set(frame.columns):
        lower = frame["lower"].to_numpy(dtype=float)
        upper = frame["upper"].to_numpy(dtype=float)
        error = np.stack([np.clip(mean - lower, 0, None), np.clip(upper - mean, 0, None)])
    ax.bar(xs, mean, yerr=error, capsize=3, edgecolor="black")
    ax.set_xticks(xs, labels=labels, rotation=90 if len(labels) > 12 else 0, fontsize=8)
    ax.set(xlabel="layer · head", ylabel="gate (posterior mean)", title="head importance")
    return fig


def _diagnostics_section(post, train, *, num_samples: int | None, seed: int) -> str:
    given = {} if num_samples is None else {"num_samples": num_samples}
    table = post.diagnose(train, verbose=False, seed=seed, **given)
    verdict = "\n".join(table.attrs.get("verdict", []))
    return (
        f'<p class="note">Posterior.diagnose on {len(train)} training rows the fit saw: one '
        "row per variable group (R-hat and ESS need two or more MCMC chains).</p>\n"
        + _frame_table(table)
        + f"<pre>{html.escape(verdict)}</pre>"
    )


# -- HTML helpers -------------------------------------------------------------------------------


def _image(fig: Figure, alt: str) -> str:
    """``fig`` as an ``<img>`` with a base64 PNG data URI (rendered by Agg), then cleared."""
    buffer = io.BytesIO()
    FigureCanvasAgg(fig)  # render with Agg whatever pyplot's backend is
    fig.savefig(buffer, format="png", dpi=DPI)
    fig.clear()
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">\n'


def _value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple):
        return ", ".join(map(_value, value))
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _table(header: Iterable[str], rows: Iterable[Iterable[str]], text_columns: int = 1) -> str:
    def cells(tag: str, values: Iterable[str]) -> str:
        return "".join(
            f'<{tag} class="text">{html.escape(str(v))}</{tag}>'
            if i < text_columns
            else f"<{tag}>{html.escape(str(v))}</{tag}>"
            for i, v in enumerate(values)
        )

    body = "\n".join(f"<tr>{cells('td', row)}</tr>" for row in rows)
    return f"<table>\n<tr>{cells('th', header)}</tr>\n{body}\n</table>\n"


def _frame_table(frame: pd.DataFrame, fmt: Callable[[float], str] = "{:.4g}".format) -> str:
    return frame.to_html(float_format=fmt, na_rep="—", border=0, escape=True) + "\n"
