import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import (
    AutoDelta,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)
from pyro.nn import PyroModule, PyroSample

from probtransformer.datasets import SequenceData
from probtransformer.inference import NonFiniteELBOError, fit_ensemble, fit_map, fit_svi
from probtransformer.models import SequenceClassifier

TINY = dict(d_model=8, num_heads=2, num_layers=1, d_ff=16)
QUICK = dict(num_steps=20, batch_size=32, lr=1e-2, progress=False)


def _tiny(**kwargs) -> SequenceClassifier:
    return SequenceClassifier(8, 10, 8, **{**TINY, **kwargs})


def _state(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def rows(digits) -> SequenceData:
    return digits.train[:64]


# -- learning -------------------------------------------------------------------------------


def test_small_posterior_learns_digits(small_posterior, digits):
    """300 rows, 150 steps of a d_model-16 model: well above the 0.1 of chance (about 0.77)."""
    pred = small_posterior.predict(digits.test.x, num_samples=30)
    accuracy = (pred.predicted == digits.test.y).float().mean().item()
    assert accuracy > 0.6
    elbo = small_posterior.record["elbo"]
    assert len(elbo) == 150 and all(math.isfinite(v) for v in elbo)
    assert sum(elbo[-15:]) / 15 > sum(elbo[:15]) / 15 + 500  # about -7400 -> -5950


def test_record_describes_the_fit(rows):
    post = fit_svi(_tiny(), rows, guide="normal", num_particles=2, seed=3, **QUICK)
    rec = post.record
    assert rec["method"] == "svi" and rec["guide"] == "normal"
    assert (rec["num_steps"], rec["batch_size"], rec["num_particles"]) == (20, 32, 2)
    assert rec["seed"] == 3 and rec["num_data"] == 64 and rec["seconds"] > 0
    assert len(rec["elbo"]) == 20
    assert isinstance(post.guide, AutoNormal)
    assert post.latent_shapes == {
        "encoder.layers.0.attention.projection": (4, 8, 9),
        "encoder.layers.0.attention.logit_scale": (2,),
        "head.weight": (10, 8),
        "head.bias": (10,),
    }


def test_batch_size_is_capped_at_the_data_size(rows):
    post = fit_svi(_tiny(), rows[:10], num_steps=3, batch_size=128, progress=False)
    assert post.record["batch_size"] == 10


# -- guides ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "guide, cls",
    [
        ("normal", AutoNormal),
        ("lowrank", AutoLowRankMultivariateNormal),
        ("mvn", AutoMultivariateNormal),
        ("delta", AutoDelta),
    ],
)
def test_every_guide_fits_and_predicts(rows, guide, cls):
    post = fit_svi(_tiny(), rows, guide=guide, **QUICK)
    assert isinstance(post.guide, cls)
    assert all(math.isfinite(v) for v in post.record["elbo"])
    pred = post.predict(rows.x[:6], num_samples=5)
    expected_draws = 1 if guide == "delta" else 5
    assert pred.probs.shape == (expected_draws, 6, 10)
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(expected_draws, 6))
    if guide == "delta":
        assert post.is_point_estimate
        assert torch.equal(pred.epistemic, torch.zeros(6))
    else:
        assert not post.is_point_estimate
        assert torch.all(pred.epistemic > 0)


def test_fit_with_padding_mask(rows):
    mask = torch.ones(len(rows), 8, dtype=torch.bool)
    mask[::2, 5:] = False
    data = SequenceData(rows.x, rows.y, mask)
    post = fit_svi(_tiny(), data, **QUICK)
    pred = post.predict(data.x[:4], data.mask[:4], num_samples=3)
    assert pred.probs.shape == (3, 4, 10)
    assert torch.isfinite(pred.probs).all()


def test_every_part_latent_fits_and_predicts(rows):
    """A model with no point-estimate parameters at all (every part latent)."""
    model = _tiny(bayesian=("embedding", "attention", "ffn", "norm", "head"))
    post = fit_svi(model, rows, num_steps=5, batch_size=32, progress=False)
    assert "embedding.projection.weight" in post.latent_shapes
    pred = post.predict(rows.x[:3], num_samples=4)
    assert pred.probs.shape == (4, 3, 10)


# -- isolation and seeds ----------------------------------------------------------------------


def test_two_fits_do_not_share_state(rows):
    sentinel = torch.tensor([1.0, -2.0, 3.0])
    pyro.param("user.sentinel", sentinel.clone())
    model = _tiny()
    before = _state(model)
    x = rows.x[:8]

    first = fit_svi(model, rows, seed=0, **QUICK)
    first_probs = first.predict(x, num_samples=10, seed=5).probs
    first_guide = _state(first.guide)
    second = fit_svi(model, rows, seed=1, **QUICK)

    second_guide = _state(second.guide)
    assert first_guide.keys() == second_guide.keys()
    assert any(not torch.equal(first_guide[k], second_guide[k]) for k in first_guide)
    assert all(torch.equal(first_guide[k], v) for k, v in _state(first.guide).items())
    assert torch.equal(first.predict(x, num_samples=10, seed=5).probs, first_probs)
    assert first.model is not second.model and first.model is not model
    # the user's model and Pyro's global param store are untouched
    assert all(torch.equal(before[k], v) for k, v in _state(model).items())
    store = pyro.get_param_store()
    assert set(store.keys()) == {"user.sentinel"}
    assert torch.equal(store["user.sentinel"].detach(), sentinel)


def test_warm_start_from_map_starts_at_its_point(rows):
    """init_from: the guide's locations at the MAP point, the point estimates at its values."""
    map_fit = fit_map(_tiny(), rows, **{**QUICK, "num_steps": 60, "lr": 3e-2})
    # lr ~ 0: the warm-started fit stays at its start; the guide's scales are 1e-3
    warm = fit_svi(_tiny(), rows, init_from=map_fit, **{**QUICK, "num_steps": 1, "lr": 1e-12})
    cold = fit_svi(_tiny(), rows, **{**QUICK, "num_steps": 1, "lr": 1e-12})
    assert warm.record["init_from"] == "map" and "init_from" not in cold.record
    x = rows.x[:16]
    point = map_fit.predict(x, num_samples=1).mean
    torch.testing.assert_close(warm.predict(x, num_samples=20).mean, point, atol=0.02, rtol=0)
    assert (cold.predict(x, num_samples=20).mean - point).abs().max() > 0.1
    medians = warm.guide.median()
    for name, value in map_fit.draws(1).items():
        torch.testing.assert_close(medians[name], value[0, 0])
    for (name, a), b in zip(warm.model.named_parameters(), map_fit.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_warm_start_refuses_another_model(rows):
    map_fit = fit_map(_tiny(), rows, **{**QUICK, "num_steps": 2})
    with pytest.raises(ValueError, match="same model"):
        fit_svi(_tiny(d_ff=8), rows, init_from=map_fit, **QUICK)
    with pytest.raises(TypeError, match="init_from"):
        fit_svi(_tiny(), rows, init_from={"head.weight": 0}, **QUICK)
    ensemble = fit_ensemble(_tiny(), rows, n_members=2, **{**QUICK, "num_steps": 2})
    with pytest.raises(ValueError, match="ensemble"):
        fit_svi(_tiny(), rows, init_from=ensemble, **QUICK)


def test_same_seed_same_fit_and_different_seed_different_fit(rows):
    a = fit_svi(_tiny(), rows, seed=7, **QUICK)
    b = fit_svi(_tiny(), rows, seed=7, **QUICK)
    c = fit_svi(_tiny(), rows, seed=8, **QUICK)
    assert a.record["elbo"] == b.record["elbo"]
    assert all(torch.equal(v, _state(b.guide)[k]) for k, v in _state(a.guide).items())
    assert all(torch.equal(v, _state(b.model)[k]) for k, v in _state(a.model).items())
    x = rows.x[:5]
    assert torch.equal(a.predict(x, seed=1).probs, b.predict(x, seed=1).probs)
    assert not torch.allclose(a.predict(x, seed=1).probs, c.predict(x, seed=1).probs)
    assert a.record["elbo"] != c.record["elbo"]


def test_fit_does_not_touch_the_global_rng(rows):
    model = _tiny()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    fit_svi(model, rows, num_steps=2, batch_size=16, progress=False)
    torch.testing.assert_close(torch.rand(3), expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_cuda_raises(rows):
    with pytest.raises(ValueError, match="CUDA"):
        fit_svi(_tiny(), rows, num_steps=1, device="cuda", progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fit_on_cuda_returns_results_on_cpu(rows, tmp_path):
    from probtransformer.inference import load_posterior

    post = fit_svi(_tiny(), rows, device="cuda", **QUICK)
    assert post.device.type == "cuda"
    assert all(v.device.type == "cuda" for v in post.draws(3).values())
    pred = post.predict(rows.x[:5], num_samples=4)
    att = post.attention(rows.x[:2], num_samples=4)
    assert pred.probs.device.type == "cpu" and att.samples.device.type == "cpu"
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(4, 5))
    post.save(tmp_path / "cuda")
    loaded = load_posterior(tmp_path / "cuda", device="cpu")
    assert loaded.device.type == "cpu"
    assert loaded.predict(rows.x[:5], num_samples=4).probs.shape == (4, 5, 10)


# -- input validation -------------------------------------------------------------------------


def _malformed(rows: SequenceData, case: str) -> SequenceData:
    x, y = rows.x.clone(), rows.y.clone()
    n = len(rows)
    if case == "rank":
        return SequenceData(x.flatten(1), y)
    if case == "features":
        return SequenceData(x[..., :5], y)
    if case == "nan":
        data = SequenceData(x, y)
        data.x[0, 3, 2] = math.nan
        return data
    if case == "inf":
        data = SequenceData(x, y)
        data.x[1, 0, 0] = math.inf
        return data
    if case == "label_range":
        y[4] = 10
        return SequenceData(x, y)
    if case == "negative_label":
        y[0] = -1
        return SequenceData(x, y)
    if case == "label_dtype":
        return SequenceData(x, y.float())
    if case == "label_shape":
        return SequenceData(x, y[:, None])
    if case == "mask_shape":
        data = SequenceData(x, y)
        data.mask = torch.ones(n, 7, dtype=torch.bool)
        return data
    if case == "mask_dtype":
        data = SequenceData(x, y)
        data.mask = torch.ones(n, 8)
        return data
    if case == "empty":
        return rows[:0]
    if case == "too_long":
        return SequenceData(torch.cat([x, x[:, :1]], dim=1), y)
    if case == "no_labels":
        return SequenceData(x)
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("rank", ValueError, ["x", "(N, T, F"]),
        ("features", ValueError, ["x", "F=8"]),
        ("nan", ValueError, ["x", "NaN"]),
        ("inf", ValueError, ["x", "inf"]),
        ("label_range", ValueError, ["y", "[0, 10)"]),
        ("negative_label", ValueError, ["y", "[0, 10)"]),
        ("label_dtype", TypeError, ["y", "int64"]),
        ("label_shape", ValueError, ["y", "(N,)"]),
        ("mask_shape", ValueError, ["mask", "(N, T)"]),
        ("mask_dtype", TypeError, ["mask", "bool"]),
        ("empty", ValueError, ["data", "empty"]),
        ("too_long", ValueError, ["max_len", "T=9"]),
        ("no_labels", ValueError, ["data.y"]),
    ],
)
def test_malformed_data_is_rejected_before_fitting(rows, case, error, words):
    data = _malformed(rows, case)
    with pytest.raises(error) as info:
        fit_svi(_tiny(), data, num_steps=1, progress=False)
    for word in words:
        assert word in str(info.value)


def test_data_must_be_sequence_data(rows):
    with pytest.raises(TypeError, match="SequenceData"):
        fit_svi(_tiny(), (rows.x, rows.y), num_steps=1, progress=False)


def test_model_must_follow_the_protocol(rows):
    with pytest.raises(TypeError, match="PyroModule"):
        fit_svi(torch.nn.Linear(8, 10), rows, num_steps=1, progress=False)


@pytest.mark.parametrize(
    "setting, error, word",
    [
        (dict(num_steps=0), ValueError, "num_steps"),
        (dict(num_steps=2.5), TypeError, "num_steps"),
        (dict(guide="bogus"), ValueError, "guide"),
        (dict(lr=0.0), ValueError, "lr"),
        (dict(lr=-1e-3), ValueError, "lr"),
        (dict(lr=math.nan), ValueError, "lr"),
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(num_particles=0), ValueError, "num_particles"),
        (dict(lr_decay=0.0), ValueError, "lr_decay"),
        (dict(init_scale=0.0), ValueError, "init_scale"),
        (dict(device="tpu"), ValueError, "device"),
        (dict(seed="0"), TypeError, "seed"),
    ],
)
def test_bad_settings_raise(rows, setting, error, word):
    with pytest.raises(error, match=word):
        fit_svi(_tiny(), rows, **{"num_steps": 1, "progress": False, **setting})


# -- non-finite ELBO ----------------------------------------------------------------------------


class _Overflowing(PyroModule):
    """A model whose likelihood overflows: log p(y) = -inf with finite parameters."""

    likelihood_site = "y"

    def __init__(self) -> None:
        super().__init__()
        self.config = {}
        self.w = PyroSample(dist.Normal(0.0, 1.0))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        n = x.shape[0]
        w = self.w
        loc = torch.full((n,), 1e30)  # (y - loc) / scale overflows float32
        with pyro.plate("data", num_data or n, subsample=torch.arange(n)):
            return pyro.sample("y", dist.Normal(loc, 1e-30), obs=y) + 0 * w


def test_non_finite_likelihood_raises_with_step_and_site():
    data = SequenceData(torch.randn(16, 4, 3), torch.randn(16))
    with pytest.raises(NonFiniteELBOError) as info:
        fit_svi(_Overflowing(), data, num_steps=5, batch_size=8, progress=False)
    err = info.value
    assert err.step == 0
    assert err.site is not None and "'y'" in err.site
    assert "step 0" in str(err)
    assert isinstance(err, FloatingPointError)


def test_exploding_learning_rate_raises_non_finite_elbo_error(rows):
    with pytest.raises(NonFiniteELBOError) as info:
        fit_svi(_tiny(), rows, num_steps=50, batch_size=32, lr=1e10, progress=False)
    err = info.value
    assert 0 <= err.step < 50
    assert err.site is not None
    assert f"step {err.step}" in str(err)


def test_all_padding_training_sequences_are_rejected(rows):
    mask = torch.ones(len(rows), 8, dtype=torch.bool)
    mask[0] = False
    with pytest.raises(ValueError, match="as padding"):
        fit_svi(_tiny(), SequenceData(rows.x, rows.y, mask), **QUICK)


def test_seed_out_of_range_is_named(rows):
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
        fit_svi(_tiny(), rows, seed=2**70, **QUICK)


def test_huge_inputs_stop_at_the_first_step_with_the_step_named(rows):
    with pytest.raises(NonFiniteELBOError, match="at step 0") as info:
        fit_svi(_tiny(), SequenceData(rows.x * 1e30, rows.y), **QUICK)
    assert info.value.step == 0
