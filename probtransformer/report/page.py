"""The report page: ``write_report`` reads a run back, puts its sections in page order
under one heading each, with inline CSS, and writes ``report.html`` atomically."""

from __future__ import annotations

import html
import os
import uuid
from pathlib import Path

from probtransformer.report.catalog import _COMMON, _FIRST
from probtransformer.report.posterior_sections import (
    _attention_section,
    _diagnostics_section,
    _head_importance_section,
)
from probtransformer.report_sections import table, value_text
from probtransformer.rundir import REPORT_FILE, diagnostic_rows, read_run, run_data
from probtransformer.tasks import ReportContext, Task, task_of

#: Settings shown first in the report's run settings table, with their units.
SETTINGS_FIRST = {"inference": "", "seconds": "s"}

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

    The page has the sections of ``probtransformer.report``'s docstring; every image is a base64 PNG
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
