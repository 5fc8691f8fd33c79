"""Save and load of Laplace posteriors: each draw's linearization point (``modes``, the GLM
predictive) and a MoLA's members come back, and so do the predictions and the verdict."""

import shutil

import pytest
import torch

from probtransformer.inference import fit_laplace, fit_mola, load_posterior
from probtransformer.models import SequenceClassifier

TINY = dict(d_model=8, num_heads=2, num_layers=1, d_ff=16)


@pytest.fixture(scope="module")
def laplace(digits):
    model = SequenceClassifier(8, 10, 8, **TINY)
    return fit_laplace(model, digits.train[:48], num_steps=5, num_samples=8, progress=False)


@pytest.fixture(scope="module")
def mola(digits):
    model = SequenceClassifier(8, 10, 8, **TINY)
    return fit_mola(
        model, digits.train[:48], n_members=2, num_steps=5, num_samples=6, progress=False
    )


@pytest.fixture(scope="module")
def saved(laplace, tmp_path_factory):
    path = tmp_path_factory.mktemp("laplace") / "posterior"
    laplace.save(path)
    return path


def _assert_round_trip(posterior, loaded, x):
    assert loaded.record == posterior.record
    assert loaded.record["method"] == posterior.record["method"]
    for name, value in posterior.samples.items():
        assert torch.equal(loaded.samples[name], value)
    if posterior.source.modes is None:
        assert loaded.source.modes is None
    else:
        assert set(loaded.source.modes) == set(posterior.source.modes)
        for name, value in posterior.source.modes.items():
            assert torch.equal(loaded.source.modes[name], value)
    before = posterior.predict(x, num_samples=4, seed=3).probs
    after = loaded.predict(x, num_samples=4, seed=3).probs
    assert torch.equal(before, after)
    assert (
        posterior.diagnose(verbose=False).attrs["verdict"]
        == loaded.diagnose(verbose=False).attrs["verdict"]
    )


def test_laplace_round_trip_keeps_the_modes_and_the_glm_predictions(laplace, saved, digits):
    assert laplace.record["predictive"] == "glm"
    assert set(laplace.source.modes) == set(laplace.record["subset"])
    tensors = torch.load(saved / "tensors.pt", weights_only=True)
    assert set(tensors["modes"]) == set(laplace.record["subset"])
    _assert_round_trip(laplace, load_posterior(saved), digits.test.x[:6])


def test_mola_round_trip_keeps_members_and_modes(mola, digits, tmp_path):
    assert mola.record["method"] == "mola" and len(mola.record["laplace"]) == 2
    assert mola.members is not None and mola.source.modes is not None
    mola.save(tmp_path / "mola")
    loaded = load_posterior(tmp_path / "mola")
    for name, value in mola.members.items():
        assert torch.equal(loaded.members[name], value)
    _assert_round_trip(mola, loaded, digits.test.x[:6])


def test_the_network_predictive_saves_no_modes(digits, tmp_path):
    model = SequenceClassifier(8, 10, 8, **TINY)
    posterior = fit_laplace(
        model, digits.train[:32], num_steps=2, num_samples=4, predictive="nn", progress=False
    )
    assert posterior.source.modes is None
    posterior.save(tmp_path / "nn")
    assert "modes" not in torch.load(tmp_path / "nn" / "tensors.pt", weights_only=True)
    _assert_round_trip(posterior, load_posterior(tmp_path / "nn"), digits.test.x[:6])


def test_attention_round_trip_where_the_modes_change_the_predictions(digits, tmp_path):
    """Over the attention projections the network is not linear in the subset: the GLM
    predictive needs the saved linearization points to give the same predictions."""
    model = SequenceClassifier(8, 10, 8, **TINY)
    posterior = fit_laplace(
        model, digits.train[:32], subset="attention", prior_precision=1.0, num_steps=2,
        num_samples=4, progress=False,
    )  # fmt: skip
    x = digits.test.x[:6]
    posterior.save(tmp_path / "attention")
    loaded = load_posterior(tmp_path / "attention")
    _assert_round_trip(posterior, loaded, x)
    glm = loaded.predict(x, num_samples=4, seed=3).probs
    loaded.source.modes = None
    network = loaded.predict(x, num_samples=4, seed=3).probs
    assert (glm - network).abs().max() > 1e-3


@pytest.mark.parametrize("damage", ["one_draw_short", "site_shape", "unknown_site"])
def test_a_damaged_modes_entry_is_refused(saved, laplace, tmp_path, damage):
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    tensors = torch.load(copy / "tensors.pt", weights_only=True)
    site = laplace.record["subset"][0]
    value = tensors["modes"][site]
    if damage == "one_draw_short":
        tensors["modes"][site] = value[:, :-1].clone()
    elif damage == "site_shape":
        tensors["modes"][site] = value[..., :-1].clone()
    else:
        tensors["modes"]["no.such.site"] = value.clone()
    torch.save(tensors, copy / "tensors.pt")
    with pytest.raises(ValueError, match="damaged.*modes"):
        load_posterior(copy)
