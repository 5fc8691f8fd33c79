"""Predictive intervals from the mixture of the draws' likelihoods: ``mixture_quantile`` against
known answers, and ``RegressionPrediction.predictive_interval`` for one draw and few draws."""

import math

import pytest
import torch
from scipy import stats

from probtransformer import metrics
from probtransformer.inference import RegressionPrediction
from probtransformer.inference.posterior.mixture import mixture_quantile
from probtransformer.inference.posterior.results import min_sample_draws


@pytest.mark.parametrize("df", [math.inf, 4.0])
def test_one_draw_gives_the_likelihoods_own_quantiles(df):
    loc, scale = torch.tensor([[1.0, -2.0]]), torch.tensor([[2.0, 0.5]])  # (S=1, N=2)
    got = mixture_quantile(loc, scale, 0.95, df=df)
    own = stats.norm.ppf(0.95) if math.isinf(df) else stats.t.ppf(0.95, df)
    torch.testing.assert_close(got, (loc + scale * own)[0].double())


def test_a_two_component_mixture_solves_its_cdf():
    # 0.5 N(-1, 1) + 0.5 N(2, 0.5): the quantile x has mean CDF q, checked with scipy
    loc, scale = torch.tensor([[-1.0], [2.0]]), torch.tensor([[1.0], [0.5]])
    for q in (0.05, 0.3, 0.5, 0.95):
        x = float(mixture_quantile(loc, scale, q)[0])
        cdf = 0.5 * stats.norm.cdf(x, -1, 1) + 0.5 * stats.norm.cdf(x, 2, 0.5)
        assert cdf == pytest.approx(q, abs=1e-10)


def test_identical_draws_give_the_components_quantile_and_symmetry_holds():
    loc, scale = torch.zeros(7, 3), torch.ones(7, 3)
    torch.testing.assert_close(
        mixture_quantile(loc, scale, 0.95), torch.full((3,), stats.norm.ppf(0.95)).double()
    )
    loc = torch.tensor([[-1.0], [1.0]])  # symmetric about 0: the median is 0
    assert float(mixture_quantile(loc, torch.ones(2, 1), 0.5)[0]) == pytest.approx(0, abs=1e-12)


def test_point_masses_and_bad_inputs():
    # three point masses at 0, 1, 2: the 0.5 quantile is 1 (CDF jumps from 1/3 to 2/3 there)
    loc, scale = torch.tensor([[0.0], [1.0], [2.0]]), torch.zeros(3, 1)
    assert float(mixture_quantile(loc, scale, 0.5)[0]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="shape"):
        mixture_quantile(loc, torch.zeros(2, 1), 0.5)
    with pytest.raises(ValueError, match=r"q must be in \(0, 1\), got 1.0"):
        mixture_quantile(loc, scale, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        mixture_quantile(loc, -scale - 1, 0.5)


def test_a_one_draw_posterior_has_the_noise_interval_not_zero_width():
    """The old interval took quantiles of one sampled y per draw: zero width for one draw."""
    loc, variance = torch.tensor([[3.0, 5.0]]), torch.tensor([[4.0, 1.0]])  # (S=1, N=2)
    pred = RegressionPrediction(samples=loc + 0.1, loc=loc, variance=variance)
    lower, upper = pred.predictive_interval(0.9)
    z = float(stats.norm.ppf(0.95))
    torch.testing.assert_close(lower, torch.tensor([3.0 - 2 * z, 5.0 - z]))
    torch.testing.assert_close(upper, torch.tensor([3.0 + 2 * z, 5.0 + z]))


def test_a_student_t_prediction_uses_its_scale_not_its_sd():
    df = 4.0  # variance = scale^2 df / (df - 2) = 2 scale^2
    loc, variance = torch.zeros(1, 1), torch.full((1, 1), 2.0)
    pred = RegressionPrediction(samples=loc, loc=loc, variance=variance, df=df)
    torch.testing.assert_close(pred.scale, torch.ones(1, 1))
    upper = pred.predictive_interval(0.9)[1]
    assert float(upper[0]) == pytest.approx(stats.t.ppf(0.95, df), rel=1e-6)


def test_few_draws_interval_matches_many_sampled_ys():
    """Five draws: the mixture interval equals the quantiles of 200,000 y's drawn from them."""
    gen = torch.Generator().manual_seed(0)
    loc, sd = torch.randn(5, 4, generator=gen), torch.rand(5, 4, generator=gen) + 0.5
    pred = RegressionPrediction(samples=loc, loc=loc, variance=sd**2)
    lower, upper = pred.predictive_interval(0.8)
    ys = (loc + sd * torch.randn(40_000, 5, 4, generator=gen)).reshape(-1, 4)  # (200000, 4)
    torch.testing.assert_close(lower, ys.quantile(0.1, dim=0), atol=0.02, rtol=0)
    torch.testing.assert_close(upper, ys.quantile(0.9, dim=0), atol=0.02, rtol=0)


def test_another_family_needs_enough_sampled_draws():
    assert min_sample_draws(0.9) == 20 and min_sample_draws(0.5) == 4
    loc = torch.arange(10.0)[:, None]  # (S=10, N=1)
    pred = RegressionPrediction(samples=loc, loc=loc, variance=torch.ones(10, 1), df=None)
    with pytest.raises(ValueError, match="needs at least 20 draws .* got 10"):
        pred.predictive_interval(0.9)
    lower, upper = pred.predictive_interval(0.5)  # 10 >= 4: sample quantiles
    assert float(lower[0]) == pytest.approx(2.25) and float(upper[0]) == pytest.approx(6.75)


@pytest.mark.parametrize("df", [math.inf, 5.0])
def test_predictive_samples_of_one_draw_follow_its_likelihood(df):
    """CRPS read one sampled y per draw: |y_1 - y| for a point estimate, not the noise's CRPS."""
    loc, sd = torch.tensor([[2.0]]), 3.0  # (S=1, N=1)
    variance = torch.tensor([[sd**2]])
    pred = RegressionPrediction(samples=loc, loc=loc, variance=variance, df=df)
    ys = pred.predictive_samples(20_000, seed=1)
    assert ys.shape == (20_000, 1) and ys.dtype == torch.float32
    assert float(ys.mean()) == pytest.approx(2.0, abs=0.1)
    assert float(ys.std()) == pytest.approx(sd, rel=0.05)  # the scale is read from the sd
    torch.testing.assert_close(ys, pred.predictive_samples(20_000, seed=1))  # seeded
    if math.isinf(df):  # CRPS of N(mu, sd) at y (Gneiting & Raftery 2007): sd (z(2Phi-1) ...)
        y = torch.tensor([5.0])
        z = 1.0
        exact = sd * (
            z * (2 * stats.norm.cdf(z) - 1) + 2 * stats.norm.pdf(z) - 1 / math.sqrt(math.pi)
        )
        assert metrics.crps_samples(ys, y) == pytest.approx(exact, rel=0.03)
    many = RegressionPrediction(
        samples=torch.zeros(3, 2), loc=torch.zeros(3, 2), variance=torch.ones(3, 2)
    )
    assert many.predictive_samples(10).shape == (12, 2)  # ceil(10 / 3) = 4 per draw
