import re
import warnings

import matplotlib
import numpy as np
import pytest
import torch

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # ArviZ 0.2x announces its 1.0 refactor
    import arviz as az  # noqa: E402

from probtransformer.datasets import SequenceData  # noqa: E402

NUM_SAMPLES, ATTENTION_OBS, N_TRAIN, N_TEST = 40, 3, 60, 30
ATTENTION_DIMS = ("chain", "draw", "attention_obs", "layer", "head", "query", "key")


@pytest.fixture(scope="module")
def train(digits) -> SequenceData:
    return digits.train[:N_TRAIN]


@pytest.fixture(scope="module")
def idata(small_posterior, train, digits):
    return small_posterior.to_inference_data(
        train,
        test=digits.test[:N_TEST],
        attention_obs=ATTENTION_OBS,
        num_samples=NUM_SAMPLES,
        seed=0,
    )


def test_groups(idata):
    assert set(idata.groups()) == {
        "posterior",
        "posterior_predictive",
        "log_likelihood",
        "observed_data",
        "predictions",
    }
    assert idata.attrs["method"] == "svi"  # the ELBO trace is in the record, not sample_stats


def test_no_predictions_group_without_test(small_posterior, train):
    small = small_posterior.to_inference_data(train[:10], attention_obs=0, num_samples=4)
    assert "predictions" not in small.groups()
    assert "attention" not in small.posterior


def test_attention_dims_and_values(idata, small_posterior, train):
    att = idata.posterior["attention"]
    assert att.dims == ATTENTION_DIMS
    assert att.shape == (1, NUM_SAMPLES, ATTENTION_OBS, 1, 2, 8, 8)
    np.testing.assert_allclose(att.sum("key").values, 1.0, rtol=1e-5)
    expected = small_posterior.attention(
        train.x[:ATTENTION_OBS], num_samples=NUM_SAMPLES, seed=0
    ).samples
    np.testing.assert_allclose(att.values, expected.numpy(), rtol=1e-6)


def test_every_axis_has_a_real_dim_name(idata):
    generated = re.compile(r"_dim_\d+$")
    for group in idata.groups():
        dataset = idata[group]
        for name, var in dataset.data_vars.items():
            assert var.dims[:2] == ("chain", "draw") or group == "observed_data", (group, name)
            bad = [d for d in var.dims if generated.search(str(d))]
            assert not bad, f"{group}.{name} has generated dims {bad}"


def test_posterior_holds_the_latent_draws(idata, small_posterior):
    draws = small_posterior.draws(NUM_SAMPLES, seed=0)
    assert set(idata.posterior.data_vars) == set(draws) | {"attention"}
    for name, value in draws.items():
        np.testing.assert_array_equal(idata.posterior[name].values, value.numpy())
    proj = idata.posterior["encoder.layers.0.attention.projection"]
    assert proj.dims[2] == "encoder.layers.0.attention.qkvo"
    assert list(proj.coords["encoder.layers.0.attention.qkvo"].values) == ["q", "k", "v", "o"]


def test_likelihood_observed_and_predictive_groups(idata, small_posterior, train):
    ll = idata.log_likelihood["y"]
    assert ll.dims == ("chain", "draw", "obs") and ll.shape == (1, NUM_SAMPLES, N_TRAIN)
    expected = small_posterior.log_likelihood(train, num_samples=NUM_SAMPLES, seed=0)
    np.testing.assert_allclose(ll.values, expected.numpy(), rtol=1e-6)
    assert idata.observed_data["y"].dims == ("obs",)
    np.testing.assert_array_equal(idata.observed_data["y"].values, train.y.numpy())
    pp = idata.posterior_predictive["y"]
    assert pp.dims == ("chain", "draw", "obs") and pp.shape == (1, NUM_SAMPLES, N_TRAIN)
    pred = idata.predictions["y"]
    assert pred.dims == ("chain", "draw", "test_obs") and pred.shape == (1, NUM_SAMPLES, N_TEST)
    assert set(np.unique(pred.values)) <= set(range(10))


def test_summary_of_attention_has_one_row_per_weight(idata):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one chain: ArviZ warns about R-hat
        summary = az.summary(idata, var_names=["attention"], kind="stats")
    assert len(summary) == ATTENTION_OBS * 1 * 2 * 8 * 8
    assert summary["mean"].between(0, 1).all()


def test_loo_has_finite_elpd(idata):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loo = az.loo(idata)
    assert np.isfinite(loo.elpd_loo) and loo.elpd_loo < 0
    assert loo.n_data_points == N_TRAIN
    # elpd_loo cannot exceed the in-sample log pointwise predictive density
    ll = idata.log_likelihood["y"].values.reshape(-1, N_TRAIN)
    lppd = float(np.sum(np.log(np.mean(np.exp(ll), axis=0))))
    assert loo.elpd_loo <= lppd + 1e-6


def test_plot_forest_of_a_few_attention_entries(idata):
    coords = {"attention_obs": [0], "layer": [0], "head": [0], "query": [0, 1]}
    axes = az.plot_forest(idata, var_names=["attention"], coords=coords, combined=True)
    assert len(np.ravel(axes)) >= 1
    assert all(isinstance(ax, plt.Axes) for ax in np.ravel(axes))
    plt.close("all")


def test_netcdf_round_trip(idata, tmp_path):
    path = tmp_path / "posterior.nc"
    idata.to_netcdf(str(path))
    back = az.from_netcdf(str(path))
    assert set(back.groups()) == set(idata.groups())
    for group in idata.groups():
        for name, var in idata[group].data_vars.items():
            assert back[group][name].dims == var.dims
            np.testing.assert_array_equal(back[group][name].values, var.values)


def test_bad_arguments(small_posterior, train):
    with pytest.raises(ValueError, match="attention_obs"):
        small_posterior.to_inference_data(train, attention_obs=-1, num_samples=2)
    with pytest.raises(ValueError, match="data.y"):
        small_posterior.to_inference_data(SequenceData(train.x), num_samples=2)


def test_attention_obs_larger_than_the_data(small_posterior, train):
    small = small_posterior.to_inference_data(train[:2], attention_obs=5, num_samples=3)
    assert small.posterior["attention"].sizes["attention_obs"] == 2
    assert torch.isfinite(torch.from_numpy(small.posterior["attention"].values)).all()
