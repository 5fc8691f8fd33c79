"""fit_mcmc: per-draw sampler statistics, point estimates, interruption, export and bad input."""

import math
from unittest import mock

import numpy as np
import pyro
import pyro.distributions as dist
import pyro.infer.mcmc.api
import pytest
import torch
from pyro.infer.mcmc import MCMC
from pyro.nn import PyroModule, PyroSample

from probtransformer.datasets import SequenceData
from probtransformer.inference import HMC, NUTS, fit_mcmc, fit_svi, load_posterior
from probtransformer.inference._runtime import reinitialised_copy
from probtransformer.inference.diagnostics._arviz import az
from probtransformer.inference.mcmc.pyro_runner import SAMPLE_STATS, RecordingNUTS
from probtransformer.models import BayesianLinearRegression, SequenceClassifier

FAST = dict(num_warmup=100, num_samples=100, progress=False)


def _regression(n=40, seed=0) -> SequenceData:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=generator)
    y = x @ torch.tensor([1.0, -2.0]) + 0.5 + torch.randn(n, generator=generator)
    return SequenceData(x, y)


@pytest.fixture(scope="module")
def regression() -> SequenceData:
    return _regression()


@pytest.fixture(scope="module")
def nuts_posterior(regression):
    return fit_mcmc(BayesianLinearRegression(2), regression, num_chains=2, seed=1, **FAST)


def _stats(post) -> dict[str, torch.Tensor]:
    return post.sample_stats()


def test_draws_and_statistics_have_chain_and_draw_dims(nuts_posterior):
    assert nuts_posterior.samples["weight"].shape == (2, 100, 2)
    assert nuts_posterior.samples["bias"].shape == (2, 100)
    stats = _stats(nuts_posterior)
    assert set(stats) == set(SAMPLE_STATS)
    for value in stats.values():
        assert value.shape == (2, 100)
    assert stats["diverging"].dtype == torch.bool
    assert ((stats["acceptance_rate"] >= 0) & (stats["acceptance_rate"] <= 1)).all()
    assert (stats["step_size"] > 0).all()
    assert not nuts_posterior.record["partial"]


def test_chains_start_from_different_points(nuts_posterior):
    first = nuts_posterior.samples["weight"][:, 0]
    assert not torch.equal(first[0], first[1])


def test_lp_is_the_log_joint_density_of_each_draw(nuts_posterior, regression):
    """Every latent is unconstrained here, so lp__ is log prior + log likelihood exactly."""
    w, b = nuts_posterior.samples["weight"], nuts_posterior.samples["bias"]
    loc = torch.einsum("cdp,np->cdn", w, regression.x) + b[..., None]
    expected = (
        dist.Normal(0.0, 1.0).log_prob(w).sum(-1)
        + dist.Normal(0.0, 1.0).log_prob(b)
        + dist.Normal(loc, 1.0).log_prob(regression.y).sum(-1)
    )
    lp = _stats(nuts_posterior)["lp"].float()
    torch.testing.assert_close(lp, expected, rtol=1e-4, atol=1e-3)


def test_energy_is_potential_plus_a_non_negative_kinetic_energy(nuts_posterior):
    """Each transition starts at the previous draw: energy_t = K(r_t) + U(z_{t-1}), K >= 0."""
    stats = _stats(nuts_posterior)
    kinetic = stats["energy"][:, 1:] + stats["lp"][:, :-1]
    assert (kinetic >= -1e-4).all()
    assert kinetic.mean() > 0.1  # d = 3 dimensions: E[K] = 1.5 under the adapted metric


def test_tree_depth_bounds_the_number_of_leapfrog_steps(nuts_posterior):
    stats = _stats(nuts_posterior)
    depth, steps = stats["tree_depth"], stats["n_steps"]
    assert (steps >= 1).all()
    assert (steps <= 2 ** (depth + 1)).all()  # a tree of depth j holds at most 2^(j+1) - 1
    assert (depth >= 1).float().mean() > 0.5  # a Gaussian posterior needs a few steps


def test_hmc_reports_its_fixed_trajectory(regression):
    post = fit_mcmc(
        BayesianLinearRegression(2),
        regression,
        kernel=HMC(trajectory_length=1.0),
        num_chains=1,
        **FAST,
    )
    stats = _stats(post)
    step_size = float(stats["step_size"][0, 0])
    assert (stats["step_size"] == step_size).all()  # adaptation ended with the warm-up
    assert (stats["n_steps"] == max(1, int(1.0 / step_size))).all()
    assert (stats["tree_depth"] == 0).all()
    assert stats["acceptance_rate"].mean() > 0.5


def test_divergences_match_pyros_own_count():
    """Centred eight schools: the funnel makes NUTS diverge; our per-draw flags agree with the
    indices Pyro records."""

    def eight_schools(sigma, y):
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(5.0))
        with pyro.plate("schools", len(y)):
            theta = pyro.sample("theta", dist.Normal(mu, tau))
            pyro.sample("y", dist.Normal(theta, sigma), obs=y)

    y = torch.tensor([28.0, 8, -3, 7, -1, 1, 18, 12])
    sigma = torch.tensor([15.0, 10, 16, 11, 9, 11, 10, 18])
    kernel = RecordingNUTS(eight_schools, target_accept_prob=0.6)
    mcmc = MCMC(kernel, num_samples=100, warmup_steps=50, disable_progbar=True)
    mcmc.run(sigma, y)
    recorded = mcmc.diagnostics()["divergences"]["chain 0"]
    flags = torch.as_tensor(mcmc._diagnostics[0]["sample_stats"]["diverging"])
    assert flags.nonzero().flatten().tolist() == recorded
    assert len(recorded) > 0


def test_inference_data_has_sample_stats_that_arviz_reads(nuts_posterior, regression):
    idata = nuts_posterior.to_inference_data(regression)
    for group in ("posterior", "sample_stats", "log_likelihood", "observed_data"):
        assert group in idata.groups()
    assert idata.posterior.sizes == {"chain": 2, "draw": 100, **idata.posterior.sizes}
    assert idata.sample_stats["diverging"].dtype == bool
    bfmi = az.bfmi(idata)
    assert bfmi.shape == (2,) and (bfmi > 0.3).all()
    assert az.plot_energy(idata) is not None
    summary = az.summary(idata, var_names=["weight", "bias"])
    assert (summary["r_hat"] < 1.05).all()


def test_thinning_keeps_draws_and_statistics_aligned(nuts_posterior, regression):
    idata = nuts_posterior.to_inference_data(regression, num_samples=20)
    assert idata.posterior.sizes["draw"] == 10
    assert idata.sample_stats.sizes["draw"] == 10
    lp = _stats(nuts_posterior)["lp"][:, [0, 99]]
    torch.testing.assert_close(
        torch.from_numpy(idata.sample_stats["lp"].values[:, [0, -1]]), lp, rtol=0, atol=0
    )


def test_diagnose_reports_the_sampler(nuts_posterior, regression, capsys):
    table = nuts_posterior.diagnose(regression)
    printed = capsys.readouterr().out
    for words in ("max R-hat", "min bulk ESS", "min tail ESS", "divergent", "E-BFMI", "LOO"):
        assert words in printed
    assert list(table.index) == ["bias", "weight"]
    assert (table["r_hat_max"] < 1.05).all()
    assert table.attrs["loo"]["n"] == len(regression)


def test_diagnose_flags_a_bad_sampler(regression, capsys):
    """No warm-up and one doubling per transition: the chains have not mixed and every
    trajectory is cut short; the verdict says both."""
    post = fit_mcmc(
        BayesianLinearRegression(2),
        regression,
        kernel=NUTS(max_tree_depth=1),
        num_chains=2,
        num_warmup=0,
        num_samples=30,
        progress=False,
    )
    post.diagnose()
    printed = capsys.readouterr().out
    assert "WARN  max R-hat" in printed
    assert "WARN  transitions at max_tree_depth=1: 60" in printed


def test_regression_predictions_recover_the_analytic_predictive(nuts_posterior, regression):
    exact = BayesianLinearRegression(2).analytic_posterior(regression.x, regression.y)
    x = torch.tensor([[0.0, 0.0], [1.0, 1.0], [-2.0, 0.5]])
    pred = nuts_posterior.predict(x, num_samples=200)
    design = torch.cat([x, torch.ones(3, 1)], -1).double()
    mean = design @ exact.mean
    variance = (design @ exact.covariance_matrix * design).sum(-1)
    assert pred.samples.shape == pred.loc.shape == (200, 3)
    # ESS of the regression function is a few hundred: 4 standard errors of the mean
    tolerance = 4 * variance.sqrt() / math.sqrt(150)
    assert ((pred.mean.double() - mean).abs() < tolerance).all()
    torch.testing.assert_close(pred.aleatoric, torch.ones(3))  # the known noise variance
    assert ((pred.epistemic.double() / variance - 1).abs() < 0.4).all()
    lower, upper = pred.credible_interval(0.9)
    assert (lower < pred.mean).all() and (pred.mean < upper).all()
    assert (pred.std > 1).all()  # noise plus parameter uncertainty
    assert list(pred.to_dataframe().columns) == [
        "mean",
        "std",
        "aleatoric",
        "epistemic",
        "lower",
        "upper",
    ]


def test_point_estimates_are_fitted_by_map_then_held_fixed(digits):
    train = digits.train[:40]
    model = SequenceClassifier(8, 10, 8, d_model=8, num_heads=2, num_layers=1, d_ff=16)
    post = fit_mcmc(
        model, train, num_chains=1, num_warmup=3, num_samples=3, map_steps=30, progress=False
    )
    info = post.record["point_estimates"]
    assert info["method"] == "map" and info["num_steps"] == 30
    assert "encoder.layers.0.ffn.linear1.weight" in info["parameters"]
    assert "encoder.layers.0.attention.projection" in post.samples
    initial = dict(reinitialised_copy(model, 0, torch.device("cpu")).named_parameters())
    map_fit = dict(
        fit_svi(model, train, guide="delta", num_steps=30, progress=False).model.named_parameters()
    )
    for name, value in post.model.named_parameters():
        assert not torch.equal(value, initial[name]), f"{name} was left at its initialisation"
        torch.testing.assert_close(value, map_fit[name], rtol=0, atol=0)  # unchanged by HMC


def test_a_fully_bayesian_model_skips_map(regression, nuts_posterior):
    assert nuts_posterior.record["point_estimates"] is None
    with pytest.raises(ValueError, match="map_steps=0"):
        fit_mcmc(SequenceClassifier(8, 10, 8, d_model=8, num_heads=2), _digits_like(), map_steps=0)


def _digits_like() -> SequenceData:
    return SequenceData(torch.rand(6, 8, 8), torch.arange(6) % 10)


def test_same_seed_same_draws(regression):
    kwargs = dict(num_chains=1, num_warmup=20, num_samples=10, progress=False)
    a = fit_mcmc(BayesianLinearRegression(2), regression, seed=3, **kwargs)
    b = fit_mcmc(BayesianLinearRegression(2), regression, seed=3, **kwargs)
    c = fit_mcmc(BayesianLinearRegression(2), regression, seed=4, **kwargs)
    torch.testing.assert_close(a.samples["weight"], b.samples["weight"], rtol=0, atol=0)
    assert not torch.equal(a.samples["weight"], c.samples["weight"])


class _InterruptedRegression(BayesianLinearRegression):
    """Raises KeyboardInterrupt (as Ctrl-C would) once, at the ``interrupt_at``-th call of any
    instance (fit_mcmc works on a copy, so the count lives on the class)."""

    calls = 0
    interrupt_at = math.inf

    def forward(self, *args, **kwargs):
        type(self).calls += 1
        if type(self).calls == self.interrupt_at:
            raise KeyboardInterrupt
        return super().forward(*args, **kwargs)


def _interrupted_fit(regression, fraction: float, **kwargs):
    """Fit once to count the model calls, then again interrupted after ``fraction`` of them."""
    kwargs = dict(num_chains=2, num_warmup=20, progress=False, **kwargs)
    _InterruptedRegression.calls, _InterruptedRegression.interrupt_at = 0, math.inf
    complete = fit_mcmc(_InterruptedRegression(2), regression, **kwargs)
    total = _InterruptedRegression.calls
    _InterruptedRegression.calls, _InterruptedRegression.interrupt_at = 0, int(fraction * total)
    try:
        return complete, fit_mcmc(_InterruptedRegression(2), regression, **kwargs)
    finally:
        _InterruptedRegression.interrupt_at = math.inf


def test_ctrl_c_in_the_first_chain_returns_its_draws_so_far(regression):
    complete, post = _interrupted_fit(regression, 0.3, num_samples=200)
    assert post.record["partial"] and not complete.record["partial"]
    chains, draws = post.samples["weight"].shape[:2]
    assert chains == 1 and 0 < draws < 200
    # the same seed: the draws so far are exactly those of the complete run
    torch.testing.assert_close(post.samples["weight"][0], complete.samples["weight"][0, :draws])
    assert post.sample_stats()["lp"].shape == (1, draws)
    assert post.predict(regression.x[:3]).mean.shape == (3,)
    assert "PARTIAL" in "\n".join(post.diagnose(verbose=False).attrs["verdict"])


def test_ctrl_c_in_a_later_chain_cuts_chains_to_a_common_length(regression):
    _, post = _interrupted_fit(regression, 0.8, num_samples=200)
    assert post.record["partial"]
    chains, draws = post.samples["bias"].shape
    assert chains == 2 and 0 < draws < 200
    assert post.sample_stats()["energy"].shape == (2, draws)


def test_save_and_load_keep_draws_and_statistics(nuts_posterior, tmp_path):
    nuts_posterior.save(tmp_path / "post")
    loaded = load_posterior(tmp_path / "post")
    torch.testing.assert_close(loaded.samples["weight"], nuts_posterior.samples["weight"])
    assert loaded.record["sample_stats"] == nuts_posterior.record["sample_stats"]
    x = torch.randn(4, 2)
    torch.testing.assert_close(loaded.predict(x).mean, nuts_posterior.predict(x).mean)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(num_chains=0), ValueError, "num_chains must be >= 1"),
        (dict(num_samples=0), ValueError, "num_samples must be >= 1"),
        (dict(num_chains=1.5), TypeError, "num_chains must be an int"),
        (dict(num_warmup=-1), ValueError, "num_warmup"),
        (dict(kernel="gibbs"), ValueError, "kernel must be one of"),
        (dict(kernel=NUTS), TypeError, "kernel must be a kernel settings object"),
        (dict(kernel="nuts", target_accept_prob=1.2), ValueError, "target_accept_prob"),
        (dict(device="tpu"), ValueError, "device"),
        (dict(num_samples=10**9), ValueError, r"would keep 44\.7 GiB of draws \(limit 2 GiB\)"),
    ],
)
@pytest.mark.filterwarnings("ignore:fit_mcmc\\(kernel=.* is deprecated:DeprecationWarning")
def test_bad_settings_name_the_argument(regression, kwargs, error, words):
    with pytest.raises(error, match=words):
        fit_mcmc(BayesianLinearRegression(2), regression, **kwargs)


@pytest.mark.parametrize(
    "build, error, words",
    [
        (lambda: NUTS(target_accept_prob=1.2), ValueError, "target_accept_prob must be a float"),
        (lambda: NUTS(step_size=0.0), ValueError, "step_size must be a finite number > 0"),
        (lambda: NUTS(max_tree_depth=0), ValueError, "max_tree_depth must be >= 1"),
        (lambda: NUTS(jit_compile="yes"), TypeError, "jit_compile must be a Python bool"),
        (lambda: HMC(trajectory_length=-1.0), ValueError, "trajectory_length must be a finite"),
        (lambda: HMC(max_tree_depth=3), TypeError, "unexpected keyword argument"),
    ],
)
def test_bad_kernel_settings_are_refused_on_construction(build, error, words):
    with pytest.raises(error, match=words):
        build()


def test_bad_data_is_rejected(regression):
    with pytest.raises(ValueError, match="data.y is None"):
        fit_mcmc(BayesianLinearRegression(2), SequenceData(regression.x))
    with pytest.raises(ValueError, match="P=3"):
        fit_mcmc(BayesianLinearRegression(3), regression)
    with pytest.raises(TypeError, match="SequenceData"):
        fit_mcmc(BayesianLinearRegression(2), (regression.x, regression.y))


class _ImpossibleLikelihood(PyroModule):
    """Observes negative values under an Exponential likelihood: log density -inf anywhere."""

    likelihood_site = "y"
    config: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.rate = PyroSample(dist.LogNormal(0.0, 1.0))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        rate = self.rate
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Exponential(rate), obs=y)


def test_non_finite_initial_density_names_the_site():
    data = SequenceData(torch.zeros(5, 1), -torch.ones(5))
    with pytest.raises(ValueError, match="site 'y'"):
        fit_mcmc(_ImpossibleLikelihood(), data, num_chains=1, progress=False)


def test_svi_diagnose_reports_the_guide_k_hat(regression, capsys):
    post = fit_svi(
        BayesianLinearRegression(2),
        regression,
        guide="mvn",
        num_steps=1500,
        lr=0.02,
        batch_size=40,
        progress=False,
    )
    table = post.diagnose(regression, num_samples=500)
    assert "PSIS k-hat of the guide" in capsys.readouterr().out
    assert table.attrs["guide_k_hat"] < 0.7


def _small_classifier() -> SequenceClassifier:
    return SequenceClassifier(
        8, 10, 8, d_model=8, num_heads=2, num_layers=1, d_ff=16, dropout=0.0,
        bayesian=("embedding", "attention", "ffn", "norm", "head"),
    )  # fmt: skip


def _check_classifier_export(post, train, draws):
    idata = post.to_inference_data(train, attention_obs=2)
    for group in ("posterior", "sample_stats", "log_likelihood"):
        assert group in idata.groups()
    assert idata.posterior["attention"].shape == (2, draws, 2, 1, 2, 8, 8)
    summary = az.summary(idata, var_names=["attention"], coords={"attention_obs": [0]})
    assert {"r_hat", "ess_bulk", "ess_tail"} <= set(summary.columns)
    assert len(summary) == 2 * 8 * 8
    assert summary["r_hat"].notna().all()
    return summary


def test_small_classifier_nuts_exports_attention_for_arviz(digits):
    """The issue's setting at smoke size (shallow trees keep the short warm-up cheap)."""
    train = digits.train[:30]
    post = fit_mcmc(
        _small_classifier(), train, kernel=NUTS(max_tree_depth=4), num_chains=2, num_warmup=8,
        num_samples=8,
        progress=False,
    )  # fmt: skip
    _check_classifier_export(post, train, 8)


@pytest.mark.slow
def test_small_classifier_nuts_at_the_issue_size(digits):
    """About 100 training digits, d_model 8, 1 layer, 2 heads, 2 chains x 100 draws."""
    train = digits.train[:100]
    post = fit_mcmc(_small_classifier(), train, num_chains=2, num_warmup=100, num_samples=100)
    summary = _check_classifier_export(post, train, 100)
    print(summary[["r_hat", "ess_bulk", "ess_tail"]].describe())
    print(post.diagnose(train, verbose=False).attrs["verdict"], post.record["seconds"])


def test_parallel_chains_send_their_statistics_back(regression):
    """With cores to spare Pyro runs one worker process per chain; the draws and per-draw
    statistics come back through the kernel's diagnostics. (This machine has 2 cores, so the
    core count is patched to take that path.)"""
    kwargs = dict(num_chains=2, num_warmup=30, num_samples=30, progress=False)
    with mock.patch.object(pyro.infer.mcmc.api.mp, "cpu_count", return_value=8):
        post = fit_mcmc(BayesianLinearRegression(2), regression, **kwargs)
        again = fit_mcmc(BayesianLinearRegression(2), regression, **kwargs)
    assert post.record["parallel"]
    assert post.samples["weight"].shape == (2, 30, 2)
    assert {k: tuple(v.shape) for k, v in post.sample_stats().items()} == {
        k: (2, 30) for k in SAMPLE_STATS
    }
    assert not torch.equal(post.samples["weight"][0], post.samples["weight"][1])
    torch.testing.assert_close(post.samples["weight"], again.samples["weight"], rtol=0, atol=0)


def test_a_model_without_latents_is_refused_before_any_fit(digits):
    model = SequenceClassifier(8, 10, 8, d_model=8, num_heads=2, num_layers=1, bayesian=())
    with pytest.raises(ValueError, match="no latent sample sites"):
        fit_mcmc(model, digits.train[:10], num_chains=1, progress=False)


def test_full_mass_must_be_a_bool(regression):
    with pytest.raises(TypeError, match="full_mass must be a Python bool, got 'yes'"):
        fit_mcmc(
            BayesianLinearRegression(2),
            regression,
            kernel=NUTS(full_mass="yes"),
        )
    with pytest.raises(TypeError, match="got np.True_"):  # numpy's bool prints as "bool"
        fit_mcmc(
            BayesianLinearRegression(2),
            regression,
            kernel=NUTS(full_mass=np.True_),
        )


def test_a_log_density_the_jit_cannot_run_names_jit_compile_false(regression, monkeypatch):
    """The token models' traced density fails in PyTorch's JIT ("Unsupported value kind:
    Tensor") once Pyro asks for its gradient; the density itself ran before, without the JIT."""

    def run(self, *args, **kwargs):
        raise RuntimeError("Unsupported value kind: Tensor")

    monkeypatch.setattr(MCMC, "run", run)
    kwargs = dict(num_chains=1, **FAST)
    with pytest.raises(ValueError, match=r"could not run .* jit_compile=False .*--no-jit-compile"):
        fit_mcmc(BayesianLinearRegression(2), regression, kernel=NUTS(jit_compile=True), **kwargs)
    with pytest.raises(RuntimeError, match="Unsupported value kind"):  # not the JIT's doing
        fit_mcmc(BayesianLinearRegression(2), regression, **kwargs)


def test_short_warmup_warns(regression):
    with pytest.warns(UserWarning, match="num_warmup=5 is short"):
        fit_mcmc(
            BayesianLinearRegression(2), regression, num_chains=1, num_warmup=5, num_samples=5,
            progress=False,
        )  # fmt: skip


def test_too_few_draws_give_n_a_not_ok(regression, capsys):
    post = fit_mcmc(
        BayesianLinearRegression(2), regression, num_chains=2, num_warmup=0, num_samples=3,
        progress=False,
    )  # fmt: skip
    post.diagnose()
    printed = capsys.readouterr().out
    assert "n/a   R-hat and ESS: too few draws" in printed
    assert "ok    max R-hat" not in printed
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
        post.sample_stats(0)


def test_loading_draws_of_the_wrong_shape_is_a_damaged_posterior(nuts_posterior, tmp_path):
    nuts_posterior.save(tmp_path / "post")
    tensors = torch.load(tmp_path / "post" / "tensors.pt", weights_only=True)
    tensors["samples"]["weight"] = tensors["samples"]["weight"][..., :1]
    torch.save(tensors, tmp_path / "post" / "tensors.pt")
    with pytest.raises(ValueError, match="damaged.*samples\\['weight'\\]"):
        load_posterior(tmp_path / "post")


class _MisnamedLikelihood(PyroModule):
    """Observes site "y" but declares ``likelihood_site = "target"``."""

    likelihood_site = "target"
    config: dict = {}

    def __init__(self) -> None:
        super().__init__()
        self.loc = PyroSample(dist.Normal(0.0, 1.0))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        loc = self.loc
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(loc, 1.0), obs=y)


def test_a_likelihood_site_that_does_not_exist_is_named(regression):
    with pytest.raises(ValueError, match="likelihood_site is 'target'"):
        fit_mcmc(_MisnamedLikelihood(), regression, num_chains=1, num_samples=5, progress=False)


def test_the_default_kernels_settings_as_keywords_still_work_with_a_warning(regression):
    """``fit_mcmc(model, data, max_tree_depth=3)``, the old spelling of NUTS's settings with the
    kernel left out, runs NUTS(max_tree_depth=3) and says how to write it now."""
    with pytest.warns(DeprecationWarning, match=r"kernel=NUTS\(\.\.\.\)"):
        post = fit_mcmc(
            BayesianLinearRegression(2), regression, num_chains=1, num_warmup=5, num_samples=5,
            max_tree_depth=3, progress=False,
        )  # fmt: skip
    assert post.record["kernel"] == "nuts" and post.record["max_tree_depth"] == 3


def test_a_hand_edited_record_is_flagged_or_refused(nuts_posterior, regression, tmp_path):
    """A saved run from elsewhere: an unknown kernel or a temperature that is no number is
    flagged in the verdict (its kernel's own checks cannot run); a record that is no JSON
    object is refused on load."""
    import json

    nuts_posterior.save(tmp_path / "run")
    meta_path = tmp_path / "run" / "posterior.json"
    meta = json.loads(meta_path.read_text())
    meta["record"].update(kernel="gibbs", temperature="hot")
    meta_path.write_text(json.dumps(meta))
    verdict = load_posterior(tmp_path / "run").diagnose(regression, verbose=False).attrs["verdict"]
    assert any(line.startswith("WARN  kernel 'gibbs' is not one of") for line in verdict)
    assert "WARN  temperature 'hot' in the record is not a finite number > 0" in verdict
    meta["record"] = ["not", "a", "record"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="'record' must be a JSON object, got list"):
        load_posterior(tmp_path / "run")
