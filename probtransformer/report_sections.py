"""HTML pieces of ``report.html`` shared by the report page and the tasks' sections: embedded
figures, tables, and the reliability and risk-coverage sections of categorical predictions."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

COVERAGES = (0.5, 0.8, 0.9, 1.0)  # coverages of the selective-accuracy table
ECE_BINS = 15  # when metrics.json does not record ece_bins
DPI = 100


def reliability_section(record: dict, probs, labels, what: str, title: str) -> str:
    """Reliability diagram of top-class probabilities ``probs`` ``(M, C)`` against ``labels``
    ``(M,)`` over ``record["ece_bins"]`` equal-width bins; ``what`` names the M test items."""
    from probtransformer import plots

    bins = record.get("ece_bins", ECE_BINS)
    fig = plots.reliability_figure(probs, labels, n_bins=bins, title=title)
    return (
        f'<p class="note">Accuracy per bin of top-class confidence on the {len(labels)} test '
        f"{what}; bars on the diagonal are calibrated, bars below it over-confident.</p>\n"
        + image(fig, "reliability diagram")
    )


def risk_coverage_section(record: dict, pred, test) -> str:
    """Risk-coverage curves of a classification ``Prediction`` on ``test`` by total entropy and
    by epistemic uncertainty, with the accuracy kept at ``COVERAGES`` and the AURC."""
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
        "coverage (small AURC).</p>\n" + image(fig, "risk-coverage curves") + table(header, rows)
    )


def image(fig: Figure, alt: str) -> str:
    """``fig`` as an ``<img>`` with a base64 PNG data URI (rendered by Agg), then cleared."""
    buffer = io.BytesIO()
    FigureCanvasAgg(fig)  # render with Agg whatever pyplot's backend is
    fig.savefig(buffer, format="png", dpi=DPI)
    fig.clear()
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">\n'


def value_text(value: Any) -> str:
    """A metrics.json value as table text (floats to 4 significant digits, None as a dash)."""
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple):
        return ", ".join(map(value_text, value))
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def table(
    header: Iterable[str], rows: Iterable[Iterable[str]], text_columns: int = 1, classes: str = ""
) -> str:
    """An HTML table (of CSS ``classes``); the first ``text_columns`` columns are left-aligned
    text."""

    def cells(tag: str, values: Iterable[str]) -> str:
        return "".join(
            f'<{tag} class="text">{html.escape(str(v))}</{tag}>'
            if i < text_columns
            else f"<{tag}>{html.escape(str(v))}</{tag}>"
            for i, v in enumerate(values)
        )

    body = "\n".join(f"<tr>{cells('td', row)}</tr>" for row in rows)
    opening = f'<table class="{html.escape(classes)}">' if classes else "<table>"
    return f"{opening}\n<tr>{cells('th', header)}</tr>\n{body}\n</table>\n"


def frame_table(frame: pd.DataFrame, fmt: Callable[[float], str] = "{:.4g}".format) -> str:
    """A DataFrame as an HTML table (4 significant digits, NaN as a dash)."""
    return frame.to_html(float_format=fmt, na_rep="—", border=0, escape=True) + "\n"
