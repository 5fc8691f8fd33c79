"""What every section of ``python -m benchmarks.run`` shares: the section contract, the row
cache on disk and time budgets.

A section is a module of ``benchmarks`` with

- ``NAME``: short name used by ``--only`` and in file names (``"speed"``);
- ``TITLE``: the heading of its part of ``BENCHMARKS.md``;
- ``row_keys(ctx) -> list[str]``: the rows it measures (fewer and smaller with ``ctx.quick``);
- ``run_row(key, ctx) -> dict``: measure one row and return plain JSON values; it must keep to
  ``ctx.budget_s`` wall seconds (cap steps or draws from a timed pilot, see ``budgeted_steps``)
  and record what it actually did (steps, draws, seconds) in the row;
- ``markdown(rows, ctx) -> str``: its tables and their reading, from the cached rows (some may
  be missing: say so rather than fail);
- optionally ``plot(rows, ctx) -> list[Path]``: figures written under ``ctx.results``.

Rows are cached one file per section (``<results>/<NAME>[_cuda].json``), so a long suite fills
its tables over several runs and a rerun skips finished rows unless ``--only`` names them.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyro
import torch

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Context:
    """How a row is run.

    Attributes:
        quick: smoke-run sizes (CI): seconds per row, figures meaningless.
        device: ``"cpu"`` or ``"cuda"``.
        budget_s: wall seconds one row should take at most.
        seed: base seed.
        results: directory of the caches, tables and plots.
    """

    quick: bool = False
    device: str = "cpu"
    budget_s: float = 300.0
    seed: int = 0
    results: Path = RESULTS

    def cache(self, section: str) -> Path:
        """The JSON cache of ``section``'s rows for this device."""
        suffix = "_cuda" if self.device == "cuda" else ""
        return self.results / f"{section}{suffix}.json"


def budgeted_steps(step_seconds: float, budget_s: float, *, max_steps: int, min_steps: int) -> int:
    """Steps that fit ``budget_s`` at ``step_seconds`` each, within ``[min_steps, max_steps]``."""
    if step_seconds <= 0:
        return max_steps
    return int(max(min_steps, min(max_steps, budget_s // step_seconds)))


def load_rows(cache: Path) -> dict[str, dict]:
    """Cached rows of one section, ``{}`` when there are none yet.

    Raises:
        ValueError: the file is not a JSON object of rows (it names the file and the fix).
    """
    if not cache.exists():
        return {}
    try:
        rows = json.loads(cache.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cache} is not valid JSON ({e}): delete it to remeasure") from e
    if not isinstance(rows, dict) or not all(isinstance(r, dict) for r in rows.values()):
        raise ValueError(f"{cache} must hold a JSON object of rows: delete it to remeasure")
    return rows


def store(cache: Path, key: str, row: dict) -> dict[str, dict]:
    """Add one finished row to ``cache`` and return all its rows.

    The file is re-read first, so rows written meanwhile by another process are kept, and
    replaced atomically.
    """
    cache.parent.mkdir(parents=True, exist_ok=True)
    rows = load_rows(cache)
    rows[key] = row
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rows, indent=1, default=json_default) + "\n")
    os.replace(tmp, cache)
    return rows


def json_default(value):
    """``json.dumps`` fallback for NumPy scalars and arrays and tuples."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def provenance() -> dict:
    """When and where a row was measured: UTC time, versions, cores, load average."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return dict(
        measured=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        torch=torch.__version__,
        pyro=pyro.__version__,
        python=platform.python_version(),
        cpus=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        load_average=round(load, 2),
    )


def fmt(value, digits: int = 3) -> str:
    """A table cell: ``digits`` decimals, blank for a missing value."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return ""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return f"{value:,}"
    return f"{value:.{digits}f}"


def mean_spread(values: list[float], digits: int = 3) -> str:
    """``mean ± sd`` over seeds (sample sd; ``mean`` alone for one value)."""
    values = [v for v in values if v is not None]
    if not values:
        return ""
    if len(values) == 1:
        return fmt(values[0], digits)
    return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"
