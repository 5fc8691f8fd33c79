"""Work is done once per call chain: one ``probtransformer fit`` validates each split once, and
``to_inference_data`` draws the posterior once for all its groups."""

import pytest
import torch

from probtransformer.cli import main
from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_svi, inputs
from probtransformer.inference.posterior.draws import GuideDraws
from probtransformer.models import SequenceClassifier

TINY = ["--num-train", "60", "--num-steps", "5", "--d-model", "8", "--num-heads", "2"]
TINY += ["--num-layers", "1", "--d-ff", "16", "--num-samples", "4", "--no-progress"]


@pytest.fixture
def validations(monkeypatch):
    """Every run of the one validator: the number of rows it checked and whether with targets."""
    seen = []
    validate = inputs._validate

    def spy(model, x, y, mask):
        seen.append((x.shape[0], y is not None))
        return validate(model, x, y, mask)

    monkeypatch.setattr(inputs, "_validate", spy)
    return seen


def test_one_fit_validates_each_split_once(tmp_path, validations, capsys):
    assert main(["fit", "--out", str(tmp_path / "run"), *TINY]) == 0
    # the 60 training rows (fit, export, diagnostics) and the 450 test rows (metrics, export,
    # attention figure): once each, with their targets
    assert sorted(validations) == [(60, True), (450, True)]


def test_a_row_slice_of_validated_data_is_not_validated_again(small_posterior, digits, validations):
    test = digits.test
    small_posterior.predict(test.x, test.mask, num_samples=2)
    small_posterior.attention(test.x[:3], num_samples=2)  # rows of the validated x
    assert validations == [(len(test), False)]
    small_posterior.predict(test.x[[0, 1]], num_samples=2)  # a copy: validated on its own
    assert validations == [(len(test), False), (2, False)]


def test_a_changed_tensor_is_validated_again(small_posterior, digits, validations):
    x = digits.test.x[:5].clone()
    small_posterior.predict(x, num_samples=2)
    x[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        small_posterior.predict(x, num_samples=2)
    with pytest.raises(ValueError, match="NaN"):
        small_posterior.attention(x[:1], num_samples=2)
    assert validations == [(5, False), (5, False), (1, False)]


def test_to_inference_data_draws_once(monkeypatch, digits):
    train, test = digits.train[:40], digits.test[:10]
    post = fit_svi(SequenceClassifier(8, 10, 8, d_model=8, num_heads=2, d_ff=16), train,
                   num_steps=3, progress=False)  # fmt: skip
    calls = []
    draw = GuideDraws.draw

    def spy(self, *args, **kwargs):
        calls.append(args)
        return draw(self, *args, **kwargs)

    monkeypatch.setattr(GuideDraws, "draw", spy)
    idata = post.to_inference_data(train, test=test, num_samples=6)
    assert len(calls) == 1
    # every group holds the same draws: the log-likelihood recomputed from the exported draws
    draws = post.draw(6)
    ll = post.log_likelihood(train, draws=draws)
    assert torch.equal(torch.from_numpy(idata.log_likelihood["y"].values), ll)
    assert idata.posterior.sizes["draw"] == idata.predictions.sizes["draw"] == 6
    assert isinstance(train, SequenceData)
