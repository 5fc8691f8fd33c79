"""Shared test set-up: a clean Pyro state per test (as Pyro's own conftest) and shared fixtures."""

import pyro
import pytest
import torch

from probtransformer.datasets import DatasetSplits, load
from probtransformer.inference import Posterior, fit_svi
from probtransformer.models import SequenceClassifier

# The test models are tiny: thread synchronisation costs more than it saves, and on a busy
# 2-core machine two intra-op threads make a small SVI step up to 10x slower.
torch.set_num_threads(1)

#: Sizes of the shared small posterior (see ``small_posterior``).
SMALL_MODEL = dict(d_model=16, num_heads=2, num_layers=1, d_ff=32)
SMALL_FIT = dict(num_steps=150, batch_size=128, lr=1e-2, seed=0, progress=False)
SMALL_TRAIN_ROWS = 300


@pytest.fixture(autouse=True)
def pyro_state():
    """Clear the param store, enable validation and seed every test; clear again afterwards."""
    pyro.clear_param_store()
    pyro.enable_validation(True)
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()


@pytest.fixture(scope="session")
def digits() -> DatasetSplits:
    """``datasets.load("digits")``: 8x8 images as sequences of 8 rows of 8 pixels."""
    return load("digits")


@pytest.fixture(scope="session")
def small_posterior(digits) -> Posterior:
    """A small mean-field fit on 300 digits, shared read-only by many tests (about 5 s)."""
    model = SequenceClassifier(8, 10, 8, **SMALL_MODEL)
    return fit_svi(model, digits.train[:SMALL_TRAIN_ROWS], **SMALL_FIT)


def _one_line(label: str):
    def read(capsys) -> str:
        out, err = capsys.readouterr()
        assert out == ""
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"probtransformer: {label}: ")
        return lines[0]

    return read


@pytest.fixture
def one_error_line():
    """A function of ``capsys`` that checks the CLI printed nothing to stdout and exactly one
    ``probtransformer: error: ...`` line to stderr, and returns that line."""
    return _one_line("error")


@pytest.fixture
def one_stop_line():
    """As ``one_error_line``, for the ``probtransformer: stopped: ...`` line of a Ctrl-C."""
    return _one_line("stopped")
