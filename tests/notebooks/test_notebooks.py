"""Every notebook runs as a script at tiny sizes and stays paired with an output-free .ipynb.

Notebooks live in ``notebooks/`` as jupytext percent-format ``.py`` files (the source of truth)
with a paired ``.ipynb`` committed without outputs. The scripts run in a temporary working
directory, so a notebook must not read or write files relative to the current directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
SCRIPTS = sorted(NOTEBOOKS.glob("*.py"))
TIMEOUT_S = 300  # a smoke run takes well under a minute on 2 cores
TAIL = 4000  # characters of stderr/stdout shown when a script fails
#: Text of each notebook's key results (metrics, tables, diagnostics) that a script run prints:
#: a cell's last expression shows in Jupyter only, so the notebooks print their results.
KEY_RESULTS = {
    "01_quickstart.py": ["{'accuracy': ", "hdi_97%", "Pareto k diagnostic values", "mean_sd"],
    "02_posterior_attention.py": ["band mass L1", "hdi_95%", "in window"],
    "03_hmc_vs_svi.py": ["elpd_diff", "mean_epistemic", "max |mean diff|"],
    "04_uncertainty_aware_prediction.py": ["AUROC by epistemic", "AURC by epistemic", "brier"],
    "05_language_model.py": ["test perplexity", "Bayesian CausalLM", "epistemic share"],
    "06_forecasting.py": ["val CRPS", "90% coverage", "lag (years)"],
    "07_your_own_data.py": ["utterance", "{'accuracy': "],
}


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
    missing = [text for text in KEY_RESULTS[script.name] if text not in result.stdout]
    assert not missing, f"{script.name} does not print {missing}; print its key results"
    truncated = re.search(r"\[\d+ rows x \d+ columns\]", result.stdout)  # pandas' "..." note
    assert truncated is None, f"{script.name} prints a table cut short ({truncated.group()})"


def test_every_notebook_names_its_key_results() -> None:
    assert set(KEY_RESULTS) == {script.name for script in SCRIPTS}


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
