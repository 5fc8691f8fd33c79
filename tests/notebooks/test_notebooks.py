"""Every notebook runs as a script at tiny sizes and stays paired with an output-free .ipynb.

Notebooks live in ``notebooks/`` as jupytext percent-format ``.py`` files (the source of truth)
with a paired ``.ipynb`` committed without outputs. The scripts run in a temporary working
directory, so a notebook must not read or write files relative to the current directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
SCRIPTS = sorted(NOTEBOOKS.glob("*.py"))
TIMEOUT_S = 300  # a smoke run takes well under a minute on 2 cores
TAIL = 4000  # characters of stderr/stdout shown when a script fails


def _code_sources(notebook) -> list[str]:
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


def test_notebooks_are_found() -> None:
    assert SCRIPTS, f"no jupytext .py notebooks found in {NOTEBOOKS}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_notebook_runs_as_script(script: Path, tmp_path: Path) -> None:
    # one intra-op thread, as in conftest.py: tiny models on a busy 2-core machine run 10x
    # slower with two threads waiting on each other
    env = {**os.environ, "PROBTRANSFORMER_SMOKE": "1", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"{script.name} exited with code {result.returncode}\n"
        f"--- stderr (tail) ---\n{result.stderr[-TAIL:]}\n"
        f"--- stdout (tail) ---\n{result.stdout[-TAIL:]}"
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_notebook_is_paired_without_outputs(script: Path) -> None:
    paired = script.with_suffix(".ipynb")
    regenerate = f"jupytext --to ipynb notebooks/{script.name}"
    assert paired.exists(), f"{paired.name} is missing; create it with `{regenerate}`"
    source = jupytext.read(script)
    notebook = jupytext.read(paired)
    assert source.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent", (
        f"{script.name} must declare `formats: ipynb,py:percent` in its jupytext header"
    )
    assert _code_sources(notebook) == _code_sources(source), (
        f"the code cells of {paired.name} differ from {script.name}; regenerate with `{regenerate}`"
    )
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [] and cell.execution_count is None, (
            f"code cell {index} of {paired.name} has outputs or an execution count; commit the "
            f"notebook without outputs (`{regenerate}`)"
        )
