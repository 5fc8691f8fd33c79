"""The report's sections on the posterior itself, the same for every task: its attention
(``attention``), the posterior of the head gates (``head-importance``) and
``Posterior.diagnose`` on the training rows the fit saw (``diagnostics``). Each returns the
HTML under its ``<h2>``."""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

from probtransformer.report_sections import frame_table, image, table, value_text

ATTENTION_EXAMPLES = 2  # test sequences whose posterior attention is drawn
NO_GATES = (
    "This model has no head gates, so there is no posterior over how many heads it needs; fit "
    "one with <code>SequenceClassifier(head_prior=priors.HeadGatePrior())</code>."
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
        images.append(image(attention.plot(i, title=title), f"posterior attention {i}"))
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
        "looks.</p>\n" + table(header, rows)
    )


def _head_importance_section(post) -> str:
    frame = _call_optional(post, "head_importance")
    if not isinstance(frame, pd.DataFrame) or frame.empty:
        return f"<p>{NO_GATES}</p>"
    parts = [
        '<p class="note">Posterior of each head\'s gate in [0, 1] (mean and credible interval): '
        "a gate near 0 switches its head off.</p>",
        image(_head_importance_figure(frame), "head importance"),
        frame_table(frame),
    ]
    effective = _call_optional(post, "effective_num_heads")
    if isinstance(effective, pd.DataFrame | pd.Series):
        parts += ["<p>Effective number of heads:</p>", frame_table(pd.DataFrame(effective))]
    elif effective is not None:
        parts.append(f"<p>Effective number of heads: {html.escape(value_text(effective))}</p>")
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
    diagnosed = post.diagnose(train, verbose=False, seed=seed, **given)
    verdict = "\n".join(diagnosed.attrs.get("verdict", []))
    return (
        f'<p class="note">Posterior.diagnose on {len(train)} training rows the fit saw: one '
        "row per variable group (R-hat and ESS need two or more MCMC chains).</p>\n"
        + frame_table(diagnosed)
        + f"<pre>{html.escape(verdict)}</pre>"
    )
