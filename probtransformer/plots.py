"""Matplotlib figures: posterior attention maps, reliability diagrams, risk-coverage curves.

Functions build `matplotlib.figure.Figure` objects directly (no pyplot state, no `show()`), so they
work under any backend; display one in a notebook by leaving it as a cell's value, or write it with
`save_figure`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure, SubFigure

from probtransformer.metrics import ArrayLike, ece, reliability_curve, risk_coverage

CELL_INCHES = 1.9  # size of one attention heatmap; keeps 8x8 maps readable at dpi 120


def attention_figure(
    mean: ArrayLike,
    std: ArrayLike,
    *,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Figure:
    """Posterior attention of one example: mean and std heatmaps for every layer and head.

    The figure has two panels side by side, "posterior mean" and "posterior std", each a grid of
    layer rows x head columns with one shared colorbar (so heads and layers are comparable).

    Args:
        mean: (layer, head, query, key) posterior mean attention weights, e.g.
            `PosteriorAttention.mean()[i]`.
        std: same shape, posterior standard deviation of the weights.
        query_labels: `query` tick labels (e.g. tokens); default step indices.
        key_labels: `key` tick labels; default step indices.
        title: figure title.

    Returns:
        Figure with 2 * layer * head heatmap axes plus 2 colorbar axes.

    Raises:
        TypeError: if `mean`/`std` is not a tensor or numpy array.
        ValueError: if `mean` is not 4-D, `std` has another shape, either holds NaN/inf, `std`
            is negative, or a label list has the wrong length.
    """
    m = _as_float_array(mean, "mean")
    s = _as_float_array(std, "std")
    if m.ndim != 4:
        raise ValueError(
            f"mean must have shape (layer, head, query, key) for one example, got {m.shape}"
        )
    if s.shape != m.shape:
        raise ValueError(f"std must have the shape of mean {m.shape}, got {s.shape}")
    if (s < 0).any():
        raise ValueError(f"std must be >= 0, got a minimum of {s.min():.3g}")
    num_layers, num_heads, num_queries, num_keys = m.shape
    _check_labels(query_labels, num_queries, "query_labels")
    _check_labels(key_labels, num_keys, "key_labels")

    fig = Figure(
        figsize=(2 * num_heads * CELL_INCHES + 2.0, num_layers * CELL_INCHES + 1.0),
        layout="constrained",
    )
    mean_panel, std_panel = fig.subfigures(1, 2)
    for panel, values, cmap, name in (
        (mean_panel, m, "viridis", "posterior mean"),
        (std_panel, s, "magma", "posterior std"),
    ):
        _heatmap_grid(panel, values, cmap, query_labels, key_labels)
        panel.suptitle(name)
    if title is not None:
        fig.suptitle(title)
    return fig


def reliability_figure(
    probs: ArrayLike, y: ArrayLike, *, n_bins: int = 15, title: str | None = None
) -> Figure:
    """Reliability diagram (Guo et al. 2017) over a histogram of top-class confidence.

    Top: accuracy per equal-width confidence bin as bars against the diagonal of perfect
    calibration, each bar labelled with its number of examples (a bar of 2 examples says
    little); the title gives the ECE. Bottom: number of examples per bin on a log scale.

    Args:
        probs: (N, C) class probabilities, rows summing to 1.
        y: (N,) integer labels in [0, C).
        n_bins: number of equal-width bins on [0, 1].
        title: title prefix; the ECE is appended.

    Returns:
        Figure with two axes (reliability diagram, confidence histogram).

    Raises:
        TypeError, ValueError: as for `probtransformer.metrics.ece`.
    """
    curve = reliability_curve(probs, y, n_bins=n_bins)
    ece_value = ece(probs, y, n_bins=n_bins)
    left, width = curve["edges"][:-1], 1.0 / n_bins
    accuracy = np.nan_to_num(curve["accuracy"])  # empty bins draw no bar

    fig = Figure(figsize=(4.5, 5.5), layout="constrained")
    diagram, histogram = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    diagram.bar(left, accuracy, width=width, align="edge", edgecolor="black")
    diagram.plot([0, 1], [0, 1], linestyle="--", color="gray")  # perfect calibration
    diagram.set(xlim=(0, 1), ylim=(0, 1.08), ylabel="accuracy (dashed: perfect calibration)")
    for x, acc, count in zip(left, accuracy, curve["count"], strict=True):
        if count:
            diagram.annotate(f"{count}", (x + width / 2, acc), ha="center", va="bottom", fontsize=6)
    prefix = f"{title}: " if title else ""
    diagram.set_title(f"{prefix}ECE = {ece_value:.3f} ({n_bins} bins)")

    histogram.bar(left, curve["count"], width=width, align="edge", edgecolor="black")
    histogram.set(xlabel="confidence (top-class probability)", ylabel="count")
    histogram.set_yscale("log")
    return fig


def risk_coverage_figure(
    scores: Mapping[str, ArrayLike], correct: ArrayLike, *, title: str | None = None
) -> Figure:
    """Risk-coverage curves of selective prediction (Geifman & El-Yaniv 2017), one per score.

    For each uncertainty score the examples are accepted from the most to the least confident
    (`metrics.risk_coverage`); the curve gives the error rate among the accepted ones against
    the fraction accepted, and the legend gives its AURC (lower is better). A dotted "oracle"
    curve ranks every error last (the best AURC possible at this error rate) and a dashed line
    marks the error rate of accepting everything (what an uninformative score averages).

    Args:
        scores: label -> (N,) uncertainty score, higher = less certain (e.g. ``{"entropy":
            pred.entropy, "epistemic": pred.epistemic}``).
        correct: (N,) bool, whether each prediction is correct.
        title: axes title.

    Returns:
        Figure with one axes: one line per score, the oracle and the full-coverage risk.

    Raises:
        TypeError: `scores` is not a mapping, or as for `metrics.risk_coverage`.
        ValueError: `scores` is empty, or as for `metrics.risk_coverage`.
    """
    if not isinstance(scores, Mapping):
        raise TypeError(f"scores must map labels to (N,) scores, got {type(scores).__name__}")
    if not scores:
        raise ValueError("scores must hold at least one uncertainty score, got none")
    curves = {label: risk_coverage(score, correct) for label, score in scores.items()}
    coverage, _, _ = next(iter(curves.values()))
    errors = ~np.asarray(correct.cpu() if isinstance(correct, torch.Tensor) else correct)
    _, oracle, oracle_aurc = risk_coverage(errors.astype(np.float64), ~errors)

    fig = Figure(figsize=(5.0, 4.0), layout="constrained")
    ax = fig.subplots()
    for label, (_, risk, aurc) in curves.items():
        ax.plot(coverage, risk, label=f"{label} (AURC = {aurc:.4f})")
    ax.plot(
        coverage, oracle, linestyle=":", color="gray", label=f"oracle (AURC = {oracle_aurc:.4f})"
    )
    ax.axhline(
        errors.mean(), linestyle="--", color="lightgray", label="error rate at full coverage"
    )
    ax.set(xlim=(0, 1), ylim=(0, None), xlabel="coverage (fraction accepted)")
    ax.set_ylabel("risk (error rate among accepted)")
    ax.legend(fontsize=8)
    if title is not None:
        ax.set_title(title)
    return fig


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write `fig` as a PNG at dpi 120, creating parent folders; the figure stays open.

    Args:
        fig: the figure to write.
        path: destination ending in ".png".

    Returns:
        The path written.

    Raises:
        TypeError: if `fig` is not a matplotlib Figure.
        ValueError: if `path` does not end in ".png".
    """
    if not isinstance(fig, Figure):
        raise TypeError(f"fig must be a matplotlib Figure, got {type(fig).__name__}")
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"path must end in '.png', got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, format="png")
    return path


def _heatmap_grid(
    panel: SubFigure,
    values: np.ndarray,
    cmap: str,
    query_labels: Sequence[str] | None,
    key_labels: Sequence[str] | None,
) -> None:
    """Draw a layer x head grid of (query, key) heatmaps on one colour scale, with a colorbar."""
    num_layers, num_heads = values.shape[:2]
    axes = panel.subplots(num_layers, num_heads, squeeze=False, sharex=True, sharey=True)
    vmax = max(float(values.max()), 1e-12)  # shared scale from 0; avoid an empty range
    for layer in range(num_layers):
        for head in range(num_heads):
            ax: Axes = axes[layer, head]
            image = ax.imshow(values[layer, head], cmap=cmap, vmin=0.0, vmax=vmax)
            ax.set_title(f"layer {layer} · head {head}", fontsize=8)
            _set_ticks(ax, query_labels, key_labels)
        axes[layer, 0].set_ylabel("query")
    for head in range(num_heads):
        axes[-1, head].set_xlabel("key")
    panel.colorbar(image, ax=axes, shrink=0.8)


def _set_ticks(
    ax: Axes, query_labels: Sequence[str] | None, key_labels: Sequence[str] | None
) -> None:
    if query_labels is not None:
        ax.set_yticks(range(len(query_labels)), labels=list(query_labels), fontsize=7)
    if key_labels is not None:
        ax.set_xticks(range(len(key_labels)), labels=list(key_labels), fontsize=7, rotation=90)


def _check_labels(labels: Sequence[str] | None, size: int, name: str) -> None:
    if labels is not None and len(labels) != size:
        raise ValueError(f"{name} must have {size} entries, got {len(labels)}")


def _as_float_array(value: ArrayLike, name: str) -> np.ndarray:
    """A tensor (any device) or numpy array -> finite float64 numpy array."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().double().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")
    if value.dtype.kind not in "biuf":
        raise TypeError(f"{name} must hold real numbers, got dtype {value.dtype}")
    value = value.astype(np.float64)
    if not np.isfinite(value).all():
        raise ValueError(f"{name} must be finite, got {int((~np.isfinite(value)).sum())} NaN/inf")
    return value
