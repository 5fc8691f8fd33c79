"""Importing the library loads no dataset loader: ``SequenceData`` lives in
``probtransformer.data``, apart from the dataset registry, and the registry imports
scikit-learn's dataset loaders only when a digits dataset is loaded.

Each import runs in a fresh interpreter, so modules an earlier test imported cannot hide one.
"""

import json
import subprocess
import sys

import pytest

HEAVY = ("sklearn.datasets",)


def _loaded_after(statement: str) -> list[str]:
    """The modules of ``HEAVY`` in ``sys.modules`` after ``statement`` in a fresh interpreter."""
    script = (
        f"import json, sys\n{statement}\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "statement",
    [
        "import probtransformer",
        "import probtransformer.inference",
        "from probtransformer.data import SequenceData",
        "import probtransformer.datasets",
    ],
)
def test_importing_loads_no_dataset_loader(statement):
    assert _loaded_after(statement) == []


def test_loading_digits_imports_its_loader():
    """The check can fail: loading a digits dataset does import ``sklearn.datasets``."""
    statement = "from probtransformer.datasets import load\nload('digits')"
    assert _loaded_after(statement) == ["sklearn.datasets"]


def test_sequence_data_is_one_class_wherever_imported():
    from probtransformer import data, datasets

    assert datasets.SequenceData is data.SequenceData
    assert datasets.DatasetSplits is data.DatasetSplits
