"""Text models saved before the positional options existed (``tests/fixtures/text-83eafce``,
written by that commit with sinusoidal positions and no ``positions`` config key) load with
their old behaviour and give the same predictions."""

import json
from pathlib import Path

import pytest
import torch

from probtransformer import datasets
from probtransformer.inference import load_posterior

FIXTURE = Path(__file__).parents[1] / "fixtures" / "text-83eafce"
EXPECTED = json.loads((FIXTURE / "expected_predictions.json").read_text())


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_a_text_run_saved_before_positions_predicts_as_when_saved(model):
    expected = EXPECTED[model]
    meta = json.loads((FIXTURE / model / "posterior.json").read_text())
    assert "positions" not in meta["config"]  # saved before the option existed
    post = load_posterior(FIXTURE / model)
    test = datasets.load(expected["dataset"], seed=0).test[: expected["rows"]]
    pred = post.predict(test.x, test.mask, num_samples=expected["num_samples"], seed=0)
    steps = expected["steps"]
    torch.testing.assert_close(
        pred.mean[:, :steps], torch.tensor(expected["mean"]), rtol=0, atol=1e-6
    )
