"""A self-contained HTML report of a run directory written by ``probtransformer fit``.

``write_report(run_dir)`` writes ``run_dir/report.html``: one file with inline CSS and every
figure embedded as a base64 PNG ``data:`` URI, so it can be mailed or archived alone. It
reloads the run's posterior and its dataset split (dataset, seed and ``num_train`` from
``metrics.json``) and draws the test-split predictions again with the run's seed and number of
draws, so its numbers match ``metrics.json``. Sections, each an ``<h2>`` with a stable ``id``,
those that apply to the run's task (``TASK_SECTIONS``) in this order:

- ``metrics``: the numbers of ``metrics.json``;
- the sections of the run's task (``Task.sections``, ``Task.report``):
  - ``reliability`` (classification, tagging): reliability diagram of the test predictive mean
    (tagging: over the real test characters);
  - ``risk-coverage`` (classification): risk-coverage curves of selective prediction by total
    predictive entropy and by epistemic uncertainty (mutual information), AURC in the legend,
    and the accuracy of the predictions kept at a few coverages (``Prediction.reject``);
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

import html
import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

from probtransformer.report_sections import frame_table, image, table, value_text
from probtransformer.rundir import REPORT_FILE, diagnostic_rows, read_run, run_data
from probtransformer.tasks import TASKS, ReportContext, Task, task_of

_FIRST = {"metrics": "Test metrics"}
_COMMON = {
    "attention": "Posterior attention",
    "head-importance": "Head importance",
    "diagnostics": "Diagnostics",
}


class _Sections(Mapping):
    """``{id: heading}`` of every section: the metrics, each registered task's, the common ones
    (read from ``TASKS`` when used, so a task registered later is included)."""

    def _all(self) -> dict[str, str]:
        tasks = {key: text for task in TASKS.values() for key, text in task.sections.items()}
        return {**_FIRST, **tasks, **_COMMON}

    def __getitem__(self, key: str) -> str:
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class _TaskSections(Mapping):
    """``{task name: section ids}`` in page order, for every registered task."""

    def __getitem__(self, name: str) -> tuple[str, ...]:
        return _section_ids(TASKS[name])

    def __iter__(self) -> Iterator[str]:
        return iter(TASKS)

    def __len__(self) -> int:
        return len(TASKS)


#: ``id`` of each section's ``<h2>``, in page order, with its heading.
SECTIONS: Mapping[str, str] = _Sections()
#: The sections of each task's report, in ``SECTIONS`` order.
TASK_SECTIONS: Mapping[str, tuple[str, ...]] = _TaskSections()
ATTENTION_EXAMPLES = 2  # test sequences whose posterior attention is drawn
#: metrics.json keys shown after the task's ``headline``, with their units.
#: Settings shown first in the report's run settings table, with their units.
SETTINGS_FIRST = {"inference": "", "seconds": "s"}
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
pre { background: #f7f7f7; padding: 0.8rem; font-size: 0.85rem;
      white-space: pre-wrap; overflow-wrap: anywhere; }
table.settings td { overflow-wrap: anywhere; }
table.settings td:nth-child(2), table.settings th:nth-child(2) { text-align: left; }
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
    fitted = read_run(run_dir)
    test, train, meta = run_data(fitted.record, run_dir)
    page = _page(fitted, test, train, meta, num_samples=num_samples, seed=seed)
    path = run_dir / REPORT_FILE
    staging = run_dir / f".{REPORT_FILE}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        staging.write_text(page, encoding="utf-8")
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    return path


# -- the page -----------------------------------------------------------------------------------


def _section_ids(task: Task) -> tuple[str, ...]:
    return (*_FIRST, *task.sections, *_COMMON)


def _page(fitted, test, train, meta, *, num_samples, seed) -> str:
    run_dir, record, post = fitted.path, fitted.record, fitted.posterior
    seed = record["seed"] if seed is None else seed
    draws = record.get("num_samples") if num_samples is None else num_samples
    draws = {"seed": seed, **({"num_samples": draws} if isinstance(draws, int) else {})}
    task = task_of(post.model)
    context = ReportContext(run_dir, record, post, test, meta, draws)
    sections = {"metrics": _metrics_section(record, task)}
    task_sections, used = task.report(context)
    sections.update(task_sections)
    sections["attention"] = _attention_section(record, post, test, draws)
    sections["head-importance"] = _head_importance_section(post)
    sections["diagnostics"] = _diagnostics_section(
        post, diagnostic_rows(record, train), num_samples=num_samples, seed=seed
    )
    headings = {**_FIRST, **task.sections, **_COMMON}
    title = f"probtransformer report: {run_dir.name}"
    what = (
        f"{record['dataset']} · {record.get('inference', '?')} · "
        f"{record.get('num_train', len(train))} training rows · {len(test)} test rows · "
        f"{used} posterior draws for the predictions (seed {seed})"
    )
    nav = " ".join(f'<a href="#{key}">{html.escape(headings[key])}</a>' for key in sections)
    body = "\n".join(
        f'<h2 id="{key}">{html.escape(headings[key])}</h2>\n{content}'
        for key, content in sections.items()
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        f"<h1>{html.escape(title)}</h1>\n<p>{html.escape(what)}</p>\n<nav>{nav}</nav>\n"
        f"{body}\n</body>\n</html>\n"
    )


def _metrics_section(record: dict, task: Task) -> str:
    """The task's test metrics (``task.headline``), then the run's settings: every other
    metrics.json key, ``SETTINGS_FIRST`` first."""
    metrics = [(k, value_text(record[k]), unit) for k, unit in task.headline.items() if k in record]
    keys = [k for k in SETTINGS_FIRST if k in record]
    keys += [k for k in record if k not in task.headline and k not in SETTINGS_FIRST]
    settings = [(k, value_text(record[k]), SETTINGS_FIRST.get(k, "")) for k in keys]
    return (
        f'<p class="note">From metrics.json: {html.escape(task.metrics_note)}</p>\n'
        + table(("metric", "value", "unit"), metrics)
        + '<h3>Run settings</h3>\n<p class="note">How the run was fitted and measured (the rest '
        "of metrics.json).</p>\n"
        + table(("setting", "value", "unit"), settings, classes="settings")
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
