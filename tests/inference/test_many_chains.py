"""The many-chain kernels of ``fit_mcmc``: ChEES-HMC and MCLMC through the model's draw dim.

Exactness is held to the references and tolerances of ``test_correctness.py`` (the analytic
linear regression, posteriordb's eight schools and, with the slow tests, arK: ``Z = 4`` Monte
Carlo standard errors with ArviZ's ESS over all chains) and to the SBC helper of
``test_sbc.py``. The vectorized density is compared with Pyro's own ``potential_fn`` chain by
chain. Runs are many short chains (16-32 chains of 40-60 kept draws): the default tests take
45-60 s on one core, a third of it the quick SBC.
"""

from __future__ import annotations

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.mcmc.util import initialize_model
from pyro.nn import PyroModule, PyroSample

from probtransformer.block import BAYESIAN_PARTS
from probtransformer.datasets import SequenceData
from probtransformer.inference import (
    MCLMC,
    NUTS,
    ChEES,
    EnsembleStarts,
    MAPStarts,
    Posterior,
    PriorStarts,
    fit_mcmc,
    load_posterior,
)
from probtransformer.inference.mcmc import adaptation as metric
from probtransformer.inference.mcmc import chees as samplers
from probtransformer.inference.mcmc import mclmc
from probtransformer.inference.mcmc import starts as many_chains
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.kernel import ChainRNG
from probtransformer.models import BayesianLinearRegression, SequenceClassifier
from tests.inference.test_correctness import (
    REFERENCE,
    AutoRegressive,
    EightSchoolsNonCentered,
    Z,
    _load,
    assert_matches_reference,
    coefficients,
    correlated_regression,
    exact_moments,
    moment_errors,
)
from tests.inference.test_local_latents import SIGMA, EightSchools, Y
from tests.inference.test_model_checks import AveragesOverDraws, SumsOverDraws
from tests.inference.test_sbc import LR_X, assert_uniform, prior_trace, sbc

CPU = torch.device("cpu")

# Short warm-ups are the point of many chains; fit_mcmc warns below 50 transitions.
pytestmark = pytest.mark.filterwarnings("ignore:num_warmup=.*is short:UserWarning")


def chees(model, data, **options) -> Posterior:
    """``fit_mcmc(kernel="chees")`` without a progress bar."""
    return fit_mcmc(model, data, kernel=ChEES(), progress=False, **options)


# -- models -----------------------------------------------------------------------------------


class ScaledRegression(PyroModule):
    """``y_n ~ N(w · x_n, sigma²)``, ``w ~ N(0, 1)`` (P,), ``sigma ~ HalfNormal(1)``: a latent on
    ``(0, inf)``, sampled as ``log sigma`` (so the density carries a log-Jacobian)."""

    likelihood_site = "y"

    def __init__(self, in_features: int = 2) -> None:
        super().__init__()
        self.config = {"in_features": in_features}
        self.w = PyroSample(dist.Normal(0.0, 1.0).expand([in_features]).to_event(1))
        self.sigma = PyroSample(dist.HalfNormal(1.0))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        w, sigma = self.w, self.sigma  # (*draws, 1, P), (*draws, 1): before the data plate
        loc = (w * x).sum(-1)  # (*draws, N)
        n = len(x)
        with pyro.plate("data", num_data or n, subsample=torch.arange(n, device=x.device)):
            return pyro.sample("y", dist.Normal(loc, sigma), obs=y)


class NaNAboveThree(PyroModule):
    """``y_n ~ N(w · x_n, 1)`` whose mean is NaN where ``w[0] > 3``: out of reach of the uniform
    (-2, 2) initialisation of NUTS, so only a many-chain start placed there finds it."""

    likelihood_site = "y"

    def __init__(self) -> None:
        super().__init__()
        self.config = {}
        self.w = PyroSample(dist.Normal(0.0, 1.0).expand([2]).to_event(1))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        w = self.w
        loc = (w * x).sum(-1)  # (*draws, N)
        loc = torch.where(w[..., 0] > 3.0, torch.nan, loc)  # w[..., 0]: (*draws, 1)
        n = len(x)
        with pyro.plate("data", num_data or n, subsample=torch.arange(n, device=x.device)):
            return pyro.sample("y", dist.Normal(loc, 1.0), obs=y)


class PositiveWeights(PyroModule):
    """``y_n ~ N(w · x_n, 1)``, ``w ~ LogNormal(0, 1)`` (P,): a prior expanded when the model is
    built, so Pyro validates its values (a ``w`` of 0 is refused, not given -inf)."""

    likelihood_site = "y"

    def __init__(self) -> None:
        super().__init__()
        self.config = {}
        self.w = PyroSample(dist.LogNormal(0.0, 1.0).expand([2]).to_event(1))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        w = self.w
        loc = (w * x).sum(-1)  # (*draws, N)
        n = len(x)
        with pyro.plate("data", num_data or n, subsample=torch.arange(n, device=x.device)):
            return pyro.sample("y", dist.Normal(loc, 1.0), obs=y)


def tiny_classifier() -> SequenceClassifier:
    """A fully Bayesian classifier (every part latent, as ``mcmc_preset``), 177 latents; its
    logit-scale prior is a positive latent (an exp transform)."""
    model = SequenceClassifier(
        3, 3, 4, d_model=4, num_heads=2, num_layers=1, d_ff=4, dropout=0.0, bayesian=BAYESIAN_PARTS
    )
    return model.eval()


def scaled_data(n: int = 12) -> SequenceData:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 2, generator=g)
    return SequenceData(x, x @ torch.tensor([1.0, -0.5]) + 0.3 * torch.randn(n, generator=g))


def classifier_data() -> SequenceData:
    g = torch.Generator().manual_seed(4)
    return SequenceData(torch.randn(6, 4, 3, generator=g), torch.randint(0, 3, (6,), generator=g))


MODELS = {
    "linear_regression": lambda: (BayesianLinearRegression(3), correlated_regression()[1]),
    "half_normal_scale": lambda: (ScaledRegression(), scaled_data()),
    "classifier": lambda: (tiny_classifier(), classifier_data()),
}


# -- 1. exactness -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def regression_chees() -> tuple[Posterior, SequenceData, tuple[np.ndarray, np.ndarray]]:
    """32 chains x 60 kept draws (1,920 draws; ArviZ ESS 1,350-1,530 per coefficient)."""
    model, data = correlated_regression()
    post = chees(model, data, num_chains=32, num_warmup=100, num_samples=60, seed=0)
    return post, data, exact_moments(model, data)


def test_chees_recovers_the_analytic_posterior(regression_chees):
    """Every mean and covariance entry within ``Z = 4`` MCSE of the closed form, as NUTS
    (observed: at most 0.9 for a mean, 1.7 for a covariance)."""
    post, _, exact = regression_chees
    draws = coefficients(post)
    assert draws.shape == (32, 60, 4)
    mean_err, cov_err = moment_errors(draws, *exact, independent=False)
    assert mean_err.max() < Z, mean_err
    assert cov_err.max() < Z, cov_err
    stats = post.sample_stats()
    assert not stats["diverging"].any()
    assert 0.3 < float(stats["acceptance_rate"].mean()) < 1.0


def test_the_metropolis_correction_keeps_a_standard_normal_exact_at_a_large_step_size():
    """ChEES's kernel alone on ``N(0, I_2)``, 2,048 chains started from it, step size 1.9 (the
    leapfrog is stable below 2): uncorrected, the draws' variance would grow to about
    ``1 / (1 - 1.9² / 4) = 10``; with the per-chain Metropolis step it stays 1. The variance of
    4,096 independent coordinates has a standard error of 2.2%; the bound is 4.5 of them."""
    chains = 2048
    z0 = torch.randn(chains, 2, generator=torch.Generator().manual_seed(0))
    sampler = samplers.ChEESSampler(
        lambda z: (-0.5 * z.square().sum(1), -z), ChainRNG(0, chains, CPU), 0
    )
    state = sampler.init(z0)
    sampler.step_size = torch.tensor([1.9], dtype=torch.float64)
    sampler.log_T_avg = torch.tensor([math.log(3 * 1.9)], dtype=torch.float64)  # 1-3 steps
    accept = []
    for _ in range(20):
        state, move = sampler.step(state, adapt=False)
        accept.append(move.accept_prob)
    assert float(torch.stack(accept).mean()) < 0.8  # the correction rejects often
    assert abs(float(state.z.var()) - 1.0) < 0.1, float(state.z.var())
    assert float(state.z.mean().abs()) < 4.5 / math.sqrt(2 * chains)


def two_modes(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log density and gradient of ``N(-10, I_2) / 2 + N(10, I_2) / 2`` at ``z`` ``(K, 2)``."""
    z = z.detach().requires_grad_(True)
    lp = torch.logsumexp(torch.stack([-0.5 * (z + m).square().sum(1) for m in (10, -10)]), 0)
    return lp.detach(), torch.autograd.grad(lp.sum(), z)[0]


@pytest.mark.parametrize("superchains", [True, False])
def test_chees_adapts_within_superchains_started_in_different_modes(superchains):
    """32 chains, superchain 0 started in the mode at -10 and superchain 1 in the one at +10
    (as ensemble starts land in different modes): with the superchains given, the mass matrix
    is the variance within a mode (1) and the step size a unit-scale Gaussian's (0.91 here).
    Pooled over all chains, the variance is the distance between the modes (about 100), and
    the step size shrinks tenfold (0.09) to make up for it."""
    chains = 32
    superchain = torch.arange(chains) // (chains // 2)
    z0 = torch.where(superchain[:, None] == 0, -10.0, 10.0).expand(chains, 2).clone()
    sampler = samplers.ChEESSampler(
        two_modes,
        ChainRNG(0, chains, CPU),
        150,
        groups=superchain if superchains else None,
    )
    state = sampler.init(z0)
    for _ in range(150):
        state, _ = sampler.step(state, adapt=True)
    assert torch.equal(state.z[:16] < 0, torch.ones(16, 2, dtype=torch.bool))  # no mode switch
    if superchains:
        assert ((sampler.inv_mass > 0.5) & (sampler.inv_mass < 2.0)).all(), sampler.inv_mass
        assert float(sampler.step_size) > 0.5, sampler.step_size
    else:
        assert (sampler.inv_mass > 50.0).all(), sampler.inv_mass
        assert float(sampler.step_size) < 0.3, sampler.step_size


def test_chees_per_superchain_adapts_each_mode_to_its_own_width():
    """Two superchains of 16 chains in Gaussians of sd 1 and 0.01 (two ensemble members in
    modes of different widths): adapted apart, each superchain's mass matrix is its own mode's
    variance and the draws keep each mode's scale; the chains of both run together."""
    chains = 32
    superchain = torch.arange(chains) // 16
    scale = torch.where(superchain == 0, 1.0, 0.01)[:, None]

    def widths(z):
        return -0.5 * (z / scale).square().sum(1), -z / scale**2

    sampler = samplers.ChEESSampler(
        widths, ChainRNG(0, chains, CPU), 150, groups=superchain, per_start=True
    )
    state = sampler.init(torch.zeros(chains, 2))
    draws = []
    for t in range(250):
        state, move = sampler.step(state, adapt=t < 150)
        if t >= 150:
            draws.append(state.z)
    z = torch.stack(draws, 1)
    assert sampler.step_size.shape == (2,) and len(sampler.adapted()["step_size"]) == 2
    assert (
        0.5 < float(sampler.inv_mass[0].mean()) < 2
        and 5e-5 < float(sampler.inv_mass[-1].mean()) < 2e-4
    )
    assert float(z[:16].std()) == pytest.approx(1.0, rel=0.15)
    assert float(z[16:].std()) == pytest.approx(0.01, rel=0.15)
    assert torch.equal(move.step_size[:16], move.step_size[0].expand(16))
    with pytest.raises(ValueError, match="two or more chains from every start"):
        samplers.ChEESSampler(
            widths, ChainRNG(0, 2, CPU), 10, groups=torch.tensor([0, 1]), per_start=True
        )


#: A narrow Gaussian ridge off the axes: sds 10 and 0.1 along the diagonals.
RIDGE_ROTATION = torch.tensor([[1.0, 1.0], [-1.0, 1.0]]) / math.sqrt(2)
RIDGE_COVARIANCE = RIDGE_ROTATION @ torch.diag(torch.tensor([100.0, 0.01])) @ RIDGE_ROTATION.T


def ridge(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    precision = torch.linalg.inv(RIDGE_COVARIANCE)
    return -0.5 * ((z @ precision) * z).sum(1), -(z @ precision)


@pytest.mark.parametrize("dense", [True, False])
def test_a_dense_metric_takes_unit_steps_along_a_ridge_off_the_axes(dense):
    """``N(0, Σ)`` with sds 10 and 0.1 along the diagonals (as a softmax head's shift
    direction against the directions the data pin down): both marginal variances are about
    50, so a diagonal metric cannot tell the ridge's width from its length and the step size
    shrinks to the narrow direction (below 0.05); the dense metric whitens it and steps at a
    unit Gaussian's scale (0.5 or more). The dense chains' draws keep ``Σ`` (each entry within
    20% of the long direction's variance, 64 chains x 100 draws)."""
    chains = 64
    sampler = samplers.ChEESSampler(
        ridge, ChainRNG(0, chains, CPU), 200, groups=torch.arange(chains) // 16, dense=dense
    )
    state = sampler.init(torch.randn(chains, 2, generator=torch.Generator().manual_seed(1)))
    for _ in range(200):
        state, _ = sampler.step(state, adapt=True)
    if not dense:
        assert sampler.step_size < 0.05, sampler.step_size
        return
    assert sampler.step_size > 0.5, sampler.step_size
    draws = []
    for _ in range(100):
        state, move = sampler.step(state, adapt=False)
        draws.append(state.z)
    draws = torch.cat(draws)
    assert (torch.cov(draws.T) - RIDGE_COVARIANCE).abs().max() < 20.0, torch.cov(draws.T)
    assert float(move.accept_prob.mean()) > 0.3


def test_a_dense_metric_falls_back_to_the_diagonal_with_fewer_draws_than_dimensions():
    """2 chains on a 300-dimensional N(0, I): each window holds fewer draws than dimensions, so
    the metric stays diagonal (a rank-deficient covariance halved the sampled sd)."""
    sampler = samplers.ChEESSampler(
        lambda z: (-0.5 * z.square().sum(1), -z), ChainRNG(0, 2, CPU), 100, dense=True
    )
    state = sampler.init(torch.zeros(2, 300))
    for _ in range(100):
        state, _ = sampler.step(state, adapt=True)
    assert sampler.covariance is None
    assert ((sampler.inv_mass > 0.3) & (sampler.inv_mass < 3.0)).float().mean() > 0.9


def test_the_dense_metric_is_the_covariance_within_superchains():
    """Draws of two superchains around means 50 apart: the metric is the covariance around
    each superchain's mean (the known ``Σ``, within sampling error), not the distance between
    them, and its narrow direction stays narrow."""
    generator = torch.Generator().manual_seed(0)
    chol = torch.linalg.cholesky(RIDGE_COVARIANCE)
    draws = torch.randn(500, 8, 2, generator=generator) @ chol.T  # (n, K, D)
    groups = torch.arange(8) // 4
    draws = draws + 50.0 * groups[None, :, None]
    covariance = metric.regularized_covariance(draws, groups)
    assert covariance.dtype == torch.float64
    assert torch.allclose(covariance.float(), RIDGE_COVARIANCE, atol=2.0), covariance
    narrow = RIDGE_ROTATION[:, 1].double()
    assert 0.009 < float(narrow @ covariance @ narrow) < 0.011


def test_a_dense_metric_over_its_dimension_limit_is_refused_with_its_size():
    dim = metric.MAX_DENSE_DIM + 1
    sampler = samplers.ChEESSampler(ridge, ChainRNG(0, 2, CPU), 10, dense=True)
    with pytest.raises(ValueError, match=f"at most {metric.MAX_DENSE_DIM}.*has {dim}.*MiB"):
        sampler.init(torch.zeros(2, dim))


def test_fit_mcmc_refuses_a_dense_metric_over_the_limit_before_its_map_starts(
    small, monkeypatch, no_sampling
):
    monkeypatch.setattr(many_chains, "map_fit", lambda *a, **k: pytest.fail("MAP fits ran"))
    monkeypatch.setattr(metric, "MAX_DENSE_DIM", 2)  # the regression has 3 latents
    with pytest.raises(ValueError, match="at most 2 unconstrained scalars; this posterior has 3"):
        fit_mcmc(
            BayesianLinearRegression(2), small, kernel=ChEES(full_mass=True), starts=MAPStarts(),
            num_chains=2, num_warmup=10, num_samples=5, progress=False,
        )  # fmt: skip


@pytest.fixture(scope="module")
def schools() -> SequenceData:
    return SequenceData(torch.tensor(SIGMA)[:, None], torch.tensor(Y))


@pytest.fixture(scope="module")
def schools_chees(schools) -> Posterior:
    """posteriordb ``eight_schools_noncentered`` with ``theta_trans`` local to the data plate
    (``test_local_latents.EightSchools``): 16 chains x 40 draws."""
    return chees(EightSchools(), schools, num_chains=16, num_warmup=60, num_samples=40, seed=0)


def test_chees_recovers_eight_schools_noncentered(schools_chees):
    draws = {name: schools_chees.samples[name].double().numpy() for name in ("mu", "tau")}
    assert_matches_reference(draws, REFERENCE["eight_schools"])


def ark_data() -> SequenceData:
    data = _load("arK")
    K, T = data["K"], data["T"]
    series = torch.tensor(data["y"], dtype=torch.float32)
    lags = torch.stack([series[K - k : T - k] for k in range(1, K + 1)], -1)  # (T - K, K)
    return SequenceData(x=lags, y=series[K:])


def check_ark(post: Posterior) -> None:
    beta = post.samples["beta"].double().numpy()
    draws = {
        "beta[1]": beta[..., 0],
        "beta[5]": beta[..., -1],
        "sigma": post.samples["sigma"].double().numpy(),
    }
    assert_matches_reference(draws, REFERENCE["arK"])


@pytest.mark.slow
def test_chees_recovers_ark():
    """arK's lag coefficients are strongly correlated and ChEES adapts a diagonal mass matrix:
    the adapted step size is 0.001-0.02 and transitions take 15-200 leapfrog steps, 10-40 s
    for 32 chains x 90 transitions on one core, so this runs with the slow tests."""
    post = chees(AutoRegressive(5), ark_data(), num_chains=32, num_warmup=150, num_samples=100)
    check_ark(post)


@pytest.mark.slow
def test_chees_recovers_eight_schools_with_a_global_theta(schools):
    """posteriordb's ``eight_schools_noncentered`` as ``test_correctness`` writes it
    (``theta_trans`` a global latent), 32 chains x 200 draws."""
    post = chees(
        EightSchoolsNonCentered(8), schools, num_chains=32, num_warmup=200, num_samples=200, seed=1
    )
    draws = {name: post.samples[name].double().numpy() for name in ("mu", "tau")}
    assert_matches_reference(draws, REFERENCE["eight_schools"])


# -- 2. simulation-based calibration ----------------------------------------------------------


def chees_lr_replication(num_warmup: int, num_samples: int):
    """One SBC replication of ``test_sbc``'s linear regression: 19 chains, the last draw of each
    (19 independent posterior draws, L = 19)."""
    model = BayesianLinearRegression(2)

    def replicate(seed: int):
        trace = prior_trace(model, LR_X, seed)
        truth = torch.cat([trace.nodes["weight"]["value"], trace.nodes["bias"]["value"][None]])
        data = SequenceData(x=LR_X, y=trace.nodes["y"]["value"])
        post = chees(
            model, data, num_chains=19, num_warmup=num_warmup, num_samples=num_samples, seed=seed
        )
        last = {name: value[:, -1] for name, value in post.samples.items()}
        coefficients = torch.cat([last["weight"], last["bias"][:, None]], -1)  # (19, 3)
        names = ("weight[0]", "weight[1]", "bias")
        return (
            {name: float(truth[i]) for i, name in enumerate(names)},
            {name: coefficients[:, i].numpy() for i, name in enumerate(names)},
        )

    return replicate


def test_sbc_linear_regression_chees():
    """20 replications, ranks 0..19 in 4 bins (5 expected per bin), as test_sbc's quick
    attention test: a smoke test of calibration."""
    result = sbc(chees_lr_replication(40, 5), 20, num_draws=19, num_bins=4)
    assert_uniform(result)


@pytest.mark.slow
def test_sbc_linear_regression_chees_slow():
    """200 replications in 10 bins (20 expected), as test_sbc's slow NUTS test (about 8 min)."""
    result = sbc(chees_lr_replication(100, 10), 200, num_draws=19, num_bins=10)
    assert_uniform(result)


# -- 3. MCLMC ---------------------------------------------------------------------------------


def test_mclmc_is_close_to_the_analytic_posterior_and_says_it_is_unadjusted():
    """Unadjusted: a step-size bias is allowed, within 5 MCSE on the means and 10% on the sds."""
    model, data = correlated_regression()
    post = fit_mcmc(
        model, data, kernel=MCLMC(), num_chains=16, num_warmup=200, num_samples=80, progress=False
    )
    mean, cov = exact_moments(model, data)
    draws = coefficients(post)
    assert draws.shape == (16, 80, 4)
    mean_err, _ = moment_errors(draws, mean, cov, independent=False)
    assert mean_err.max() < 5.0, mean_err
    sd_ratio = draws.reshape(-1, 4).std(0) / np.sqrt(np.diag(cov))
    assert np.abs(sd_ratio - 1).max() < 0.10, sd_ratio
    assert post.record["unadjusted"] is True
    assert math.isfinite(post.record["energy_error_var_per_dim"])
    assert post.record["energy_error_var_per_dim"] > 0
    assert "acceptance_rate" not in post.record["sample_stats"]


# -- 4. the vectorized density ----------------------------------------------------------------


def pyro_log_density(model, data: SequenceData, z: torch.Tensor, density: VectorizedDensity):
    """``(K,)`` log densities and ``(K, D)`` gradients from Pyro's ``potential_fn``, one chain at a
    time, in ``density``'s flat layout."""
    _, potential_fn, _, _ = initialize_model(model, model_args=(data.x, data.y, data.mask))
    values, grads = [], []
    for k in range(len(z)):
        params = {
            name: u[0].clone().requires_grad_(True)
            for name, u in density.unflatten(z[k : k + 1]).items()
        }
        energy = potential_fn(params)
        grad = torch.autograd.grad(energy, list(params.values()))
        values.append(-energy.detach())
        grads.append(-torch.cat([g.reshape(-1) for g in grad]))
    return torch.stack(values), torch.stack(grads)


@pytest.mark.parametrize("name", list(MODELS))
def test_k_chain_density_equals_pyro_potential_per_chain(name):
    model, data = MODELS[name]()
    model.eval()
    density = VectorizedDensity(model, data.x, data.y, data.mask, memory_budget=None)
    z = many_chains.prior_states(density, 5)  # (K, D)
    assert z.shape == (5, density.dim)
    lp, grad = density.log_density(z)
    expected_lp, expected_grad = pyro_log_density(model, data, z, density)
    torch.testing.assert_close(lp, expected_lp, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-4)
    density.check(z)  # the K-chain values equal single-chain ones site by site


def test_the_density_has_the_log_jacobian_of_a_positive_latent():
    """By hand: ``log p(w) + log p(sigma) + log sigma + sum_n log N(y_n | w · x_n, sigma)``
    with ``sigma = exp(u)``; the ``log sigma`` term is the Jacobian."""
    model, data = ScaledRegression(), scaled_data()
    density = VectorizedDensity(model, data.x, data.y, None, memory_budget=None)
    assert [s.name for s in density.sites] == ["w", "sigma"] and density.dim == 3
    z = torch.tensor([[0.5, -1.0, -0.7], [1.5, 0.2, 0.4]])  # (K=2, D=3): w, log sigma
    lp, grad = density.log_density(z)
    u = z.clone().requires_grad_(True)
    w, sigma = u[:, :2], u[:, 2].exp()
    expected = (
        dist.Normal(0.0, 1.0).log_prob(w).sum(-1)
        + dist.HalfNormal(1.0).log_prob(sigma)
        + u[:, 2]
        + dist.Normal(w @ data.x.T, sigma[:, None]).log_prob(data.y).sum(-1)
    )
    (expected_grad,) = torch.autograd.grad(expected.sum(), u)
    torch.testing.assert_close(lp, expected.detach())
    torch.testing.assert_close(grad, expected_grad)
    constrained = density.constrain(z)
    torch.testing.assert_close(constrained["sigma"], z[:, 2].exp())
    torch.testing.assert_close(density.unconstrain(constrained), z)


@pytest.mark.parametrize("name", ["half_normal_scale", "classifier"])
def test_row_chunked_passes_equal_one_pass(name):
    model, data = MODELS[name]()
    whole = VectorizedDensity(model, data.x, data.y, data.mask, memory_budget=None)
    chunked = VectorizedDensity(model, data.x, data.y, data.mask, memory_budget=1)
    assert chunked._rows_per_pass(4) == 1  # one row per pass: N passes
    z = many_chains.prior_states(whole, 4)
    lp, grad = whole.log_density(z)
    lp_chunked, grad_chunked = chunked.log_density(z)
    torch.testing.assert_close(lp_chunked, lp, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad_chunked, grad, rtol=1e-4, atol=1e-5)


def test_a_mini_batch_scales_the_likelihood_by_n_over_b_and_not_the_prior():
    model, data = ScaledRegression(), scaled_data(12)
    density = VectorizedDensity(model, data.x, data.y, None, memory_budget=None)
    rows = torch.tensor([0, 3, 5, 10])  # B = 4 of N = 12
    z = torch.tensor([[0.5, -1.0, -0.7], [1.5, 0.2, 0.4], [-0.3, 0.8, 0.1]])
    lp, grad = density.log_density(z, rows=rows)
    u = z.clone().requires_grad_(True)
    w, sigma = u[:, :2], u[:, 2].exp()
    likelihood = dist.Normal(w @ data.x[rows].T, sigma[:, None]).log_prob(data.y[rows]).sum(-1)
    prior = dist.Normal(0.0, 1.0).log_prob(w).sum(-1) + dist.HalfNormal(1.0).log_prob(sigma)
    expected = prior + u[:, 2] + 12 / 4 * likelihood
    (expected_grad,) = torch.autograd.grad(expected.sum(), u)
    torch.testing.assert_close(lp, expected.detach())
    torch.testing.assert_close(grad, expected_grad)
    # without the Jacobian (the MAP objective of init="map"/"ensemble")
    lp_map, _ = density.log_density(z, rows=rows, grad=False, jacobian=False)
    torch.testing.assert_close(lp_map, (expected - u[:, 2]).detach())


def test_local_latents_take_one_value_per_row_in_the_flat_layout(schools):
    density = VectorizedDensity(EightSchools(), schools.x, schools.y, None)
    local = {s.name: (s.local, tuple(s.shape)) for s in density.sites}
    assert local == {"mu": (False, ()), "tau": (False, ()), "theta_trans": (True, (8,))}
    assert density.dim == 10


# -- 5. refusals ------------------------------------------------------------------------------


@pytest.fixture
def small() -> SequenceData:
    x = torch.randn(6, 2, generator=torch.Generator().manual_seed(0))
    return SequenceData(x, x @ torch.tensor([1.0, -1.0]))


@pytest.fixture
def no_sampling(monkeypatch):
    """Fail the test if a many-chain kernel takes a step."""

    def fail(*args, **kwargs):
        raise AssertionError("sampling started")

    monkeypatch.setattr(samplers.ChEESSampler, "init", fail)
    monkeypatch.setattr(mclmc.MCLMCSampler, "init", fail)


@pytest.mark.parametrize("model", [SumsOverDraws, AveragesOverDraws])
def test_a_model_that_mixes_the_draw_dim_is_refused_naming_the_site(small, model, no_sampling):
    with pytest.raises(ValueError, match=r"'y' does not follow each .*\(x \* w\)\.sum"):
        chees(model(), small, num_chains=4, num_warmup=10, num_samples=5)
    # the K-chain probe of the vectorized density refuses it on its own too
    density = VectorizedDensity(model(), small.x, small.y, None)
    z = torch.randn(3, density.dim, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"the site 'y' does not follow each chain.*draw dim"):
        density.check(z)


@pytest.mark.parametrize(
    "options, error, words",
    [
        (dict(num_chains=6, num_starts=4), ValueError, "multiple of num_starts.*6.*4"),
        (dict(init="map", num_starts=2), ValueError, "init='map'.*num_starts must be 1, got 2"),
        (dict(kernel="nuts", init="ensemble"), ValueError, "init and num_starts apply to"),
        (dict(kernel="nuts", num_starts=2), ValueError, "init and num_starts apply to"),
        (dict(num_chains=0), ValueError, "num_chains must be >= 1, got 0"),
        (dict(init="uniform"), ValueError, r"init must be one of \('prior', 'map', 'ensemble'\)"),
        (dict(jit_compile=True), ValueError, "jit_compile applies to kernel='nuts'"),
        (dict(kernel="mclmc", full_mass=True), ValueError, "full_mass applies to.*'chees'"),
        (dict(kernel="mclmc", jit_compile=True), ValueError, "jit_compile .* not 'mclmc'"),
        (dict(num_starts=1.5), TypeError, "num_starts must be an int"),
        (dict(kernel="mclmc", target_accept_prob=0.9), ValueError, "prob .* not 'mclmc'"),
        (dict(kernel="mclmc", trajectory_length=1.0), ValueError, "length .* not 'mclmc'"),
        (dict(init="ensemble", map_steps=0), ValueError, "init='ensemble' needs MAP fits"),
        (dict(max_tree_depth=3), ValueError, "max_tree_depth applies to kernel='nuts', not"),
        (dict(kernel="nuts", trajectory_length=1.0), ValueError, "trajectory_length applies to"),
    ],
)
def test_bad_settings_of_the_string_form_are_refused(small, options, error, words, no_sampling):
    settings = dict(kernel="chees", num_chains=4, num_warmup=10, num_samples=5, progress=False)
    with pytest.raises(error, match=words), pytest.warns(DeprecationWarning, match="is deprecated"):
        fit_mcmc(BayesianLinearRegression(2), small, **{**settings, **options})


@pytest.mark.parametrize(
    "build, error, words",
    [
        (lambda: ChEES(target_accept_prob=1.5), ValueError, "target_accept_prob must be a float"),
        (lambda: ChEES(step_size=-1.0), ValueError, "step_size must be a finite number > 0"),
        (lambda: ChEES(full_mass=1), TypeError, "full_mass must be a Python bool"),
        (lambda: ChEES(temperature=0), ValueError, "temperature must be a finite number > 0"),
        (lambda: MCLMC(thinning=0), ValueError, "thinning must be >= 1"),
        (lambda: MCLMC(tuning="mile"), TypeError, "tuning must be an mclmc.Tuning"),
        (lambda: MCLMC(target_accept_prob=0.9), TypeError, "unexpected keyword"),
        (lambda: PriorStarts(num_starts=0), ValueError, "num_starts must be >= 1"),
        (lambda: EnsembleStarts(ensemble="run"), ValueError, "fit_ensemble posterior"),
    ],
)
def test_bad_settings_objects_are_refused_on_construction(build, error, words):
    with pytest.raises(error, match=words):
        build()


@pytest.mark.parametrize(
    "options, error, words",
    [
        (dict(kernel="chees"), TypeError, "got unexpected keyword arguments \\['init'\\]"),
        (dict(kernel=ChEES, init=None), TypeError, "kernel must be a kernel settings object"),
        (dict(kernel=ChEES(), starts="ensemble"), TypeError, "starts must be PriorStarts"),
        (dict(kernel=NUTS(), starts=PriorStarts()), ValueError, "starts apply to the many-chain"),
        (dict(kernel=ChEES(), starts=PriorStarts(3)), ValueError, "multiple of num_starts"),
        (dict(kernel=ChEES(), starts=EnsembleStarts(), map_steps=0), ValueError, "MAP fits"),
    ],
)
def test_bad_settings_of_the_object_form_are_refused(small, options, error, words, no_sampling):
    settings = dict(num_chains=4, num_warmup=10, num_samples=5, progress=False)
    options = dict(options)
    if options.get("init", "") is None:
        del options["init"]
    elif options.get("kernel") == "chees":
        options = dict(kernel=ChEES(), init="map")
    with pytest.raises(error, match=words):
        fit_mcmc(BayesianLinearRegression(2), small, **{**settings, **options})


def test_the_string_form_warns_and_builds_the_same_objects(small):
    """``kernel="chees", init="ensemble", num_starts=2, target_accept_prob=0.7`` is
    ``kernel=ChEES(target_accept_prob=0.7), starts=EnsembleStarts(2)``: the same draws."""
    settings = dict(num_chains=4, num_warmup=10, num_samples=5, map_steps=5, progress=False)
    with pytest.warns(DeprecationWarning, match=r"kernel=ChEES\(\.\.\.\)"):
        old = fit_mcmc(
            BayesianLinearRegression(2), small, kernel="chees", init="ensemble", num_starts=2,
            target_accept_prob=0.7, **settings,
        )  # fmt: skip
    new = fit_mcmc(
        BayesianLinearRegression(2), small, kernel=ChEES(target_accept_prob=0.7),
        starts=EnsembleStarts(2), **settings,
    )  # fmt: skip
    for name, value in new.samples.items():
        torch.testing.assert_close(old.samples[name], value, rtol=0, atol=0)
    assert old.record["target_accept_prob"] == 0.7 and old.record["init"] == "ensemble"


def test_draws_over_the_memory_limit_are_refused_with_the_estimate(small, monkeypatch, no_sampling):
    monkeypatch.setattr(many_chains, "MAX_DRAW_BYTES", 2**30)
    # 1,024 chains x 100,000 draws x 3 float32 latents = 1.2288e9 bytes = 1.14 GiB > 1 GiB
    words = (
        r"1024 chains x 100000 draws x 3 scalars \(3 latent, 0 per-chain point estimates\) "
        r"would keep 1\.1 GiB .*limit 1 GiB"
    )
    with pytest.raises(ValueError, match=words):
        chees(BayesianLinearRegression(2), small, num_chains=1024, num_samples=100_000)
    assert many_chains.draw_bytes(1024, 100_000, 3) == 1_228_800_000
    # many chains of few draws: the samplers' working state and a one-row pass count too (a
    # fresh user's 200,000 chains passed the kept-draws check and then failed in the allocator;
    # 10 million hung in the initial-density check, then a Python loop over chains)
    monkeypatch.setattr(many_chains, "MAX_DRAW_BYTES", 2**31)
    words = r"would keep 0\.1 GiB of draws and hold 4\.7 GiB of sampler state \(limit 2 GiB\)"
    with pytest.raises(ValueError, match=words):
        chees(BayesianLinearRegression(2), small, num_chains=10_000_000, num_samples=1)


def test_a_non_finite_initial_density_names_the_chain_and_the_site(small, monkeypatch):
    """Start 1 (chains 2 and 3 of 4) where the likelihood's mean is NaN."""
    prior_states = many_chains.prior_states

    def bad_second_start(density, num):
        z = prior_states(density, num)
        z[1, 0] = 5.0  # w[0] = 5 > 3
        return z

    monkeypatch.setattr(many_chains, "prior_states", bad_second_start)
    with pytest.raises(ValueError, match=r"chain 2 is not finite at its initial state: site 'y'"):
        chees(NaNAboveThree(), small, num_chains=4, starts=PriorStarts(2), num_samples=5)


# -- 6. per-chain random streams --------------------------------------------------------------


def test_a_chains_random_stream_does_not_depend_on_the_number_of_chains():
    four, eight = ChainRNG(7, 4, CPU), ChainRNG(7, 8, CPU)
    torch.testing.assert_close(four.normal(5), eight.normal(5)[:4], rtol=0, atol=0)
    torch.testing.assert_close(four.uniform(), eight.uniform()[:4], rtol=0, atol=0)
    rows = ChainRNG(7, 8, CPU).normal(5)
    assert len({tuple(r.tolist()) for r in rows}) == 8  # the chains' streams differ
    assert not torch.equal(ChainRNG(8, 4, CPU).normal(5), ChainRNG(7, 4, CPU).normal(5))


def test_the_same_seed_gives_the_same_draws_and_another_seed_others(small):
    def run(seed: int) -> Posterior:
        model = BayesianLinearRegression(2)
        return chees(model, small, num_chains=4, num_warmup=20, num_samples=5, seed=seed)

    first, again, other = run(3), run(3), run(4)
    for name in first.samples:
        assert torch.equal(first.samples[name], again.samples[name]), name
        assert not torch.equal(first.samples[name], other.samples[name]), name
    assert first.record["sample_stats"] == again.record["sample_stats"]


# -- 7. Ctrl-C --------------------------------------------------------------------------------


def interrupt_at(monkeypatch, call: int) -> None:
    """Make ChEES's ``call``-th transition (1-based) raise KeyboardInterrupt."""
    step = samplers.ChEESSampler.step
    calls = []

    def step_or_interrupt(self, state, *, adapt):
        calls.append(adapt)
        if len(calls) == call:
            raise KeyboardInterrupt
        return step(self, state, adapt=adapt)

    monkeypatch.setattr(samplers.ChEESSampler, "step", step_or_interrupt)


def test_ctrl_c_after_kept_draws_returns_them_as_a_partial_posterior(small, monkeypatch):
    interrupt_at(monkeypatch, 20 + 3 + 1)  # 20 warm-up transitions, then 3 kept draws
    post = chees(BayesianLinearRegression(2), small, num_chains=4, num_warmup=20, num_samples=50)
    assert post.record["partial"] is True
    assert post.samples["weight"].shape == (4, 3, 2)
    assert post.samples["bias"].shape == (4, 3)
    assert np.asarray(post.record["sample_stats"]["lp"]).shape == (4, 3)
    assert post.predict(small.x, num_samples=None).loc.shape == (12, len(small))


def test_ctrl_c_before_the_first_kept_draw_raises_keyboard_interrupt(small, monkeypatch):
    interrupt_at(monkeypatch, 20)  # the last warm-up transition
    with pytest.raises(KeyboardInterrupt, match="before the first draw was kept"):
        chees(BayesianLinearRegression(2), small, num_chains=4, num_warmup=20, num_samples=50)


# -- 8. divergences ---------------------------------------------------------------------------


def test_a_diverging_superchain_is_recorded_and_flagged_and_the_fit_returns(monkeypatch):
    """Start 1 at ``sigma = e^-40``: its gradient is about 1e36, so its leapfrog steps overflow
    (``exp`` of a huge number: a scale of inf, then NaN). Before the fix in
    ``VectorizedDensity.log_density`` one such chain raised Pyro's ValueError for all four.

    The step size adapts on the chains that do not diverge (as BlackJAX), and the stuck
    chains are left out of the mass matrix: the healthy superchain keeps a usable step size
    (before, dual averaging shrank it towards 1e-21 for the stuck chains' sake and every
    trajectory ran into ``max_leapfrog_steps``)."""
    prior_states = many_chains.prior_states

    def far_second_start(density, num):
        z = prior_states(density, num)
        z[1, 2] = -40.0  # log sigma
        return z

    monkeypatch.setattr(many_chains, "prior_states", far_second_start)
    data = scaled_data(20)
    post = chees(
        ScaledRegression(), data, num_chains=4, starts=PriorStarts(2), num_warmup=40, num_samples=20
    )
    diverging = np.asarray(post.record["sample_stats"]["diverging"])  # (chain, draw)
    assert diverging.shape == (4, 20) and diverging.dtype == bool
    assert post.record["superchain"] == [0, 0, 1, 1]
    assert not diverging[:2].any() and diverging[2:].all()
    assert max(post.record["sample_stats"]["n_steps"][0]) < 100  # not at max_leapfrog_steps
    assert all(torch.isfinite(v).all() for v in post.samples.values())
    torch.testing.assert_close(post.samples["sigma"][2:], torch.full((2, 20), math.exp(-40.0)))
    idata = post.to_inference_data(data)
    assert int(idata.sample_stats["diverging"].sum()) == 40
    verdict = post.diagnose(verbose=False).attrs["verdict"]
    assert "WARN  divergent transitions: 40 of 80" in "\n".join(verdict)
    assert "WARN  stuck chains (mean acceptance < 0.05): 2 of 4 (chains [2, 3])" in "\n".join(
        verdict
    )


def test_a_chain_outside_the_support_gets_nan_and_the_others_their_own_density():
    """``exp(-200)`` is 0 in float32, outside LogNormal's support, and a NaN state has no
    values at all: those two chains get NaN, the other two what they get alone."""
    model, data = PositiveWeights(), scaled_data()
    density = VectorizedDensity(model, data.x, data.y, None)
    z = torch.tensor([[0.1, -0.2], [-200.0, 0.3], [math.nan, 0.0], [0.5, 0.4]])
    lp, grad = density.log_density(z)
    assert torch.isnan(lp[1:3]).all() and torch.isnan(grad[1:3]).all()
    for k in (0, 3):
        alone, alone_grad = density.log_density(z[k : k + 1])
        torch.testing.assert_close(lp[k : k + 1], alone)
        torch.testing.assert_close(grad[k : k + 1], alone_grad)
    assert torch.isfinite(lp[[0, 3]]).all()


# -- 9. saving, loading and ArviZ --------------------------------------------------------------


def test_a_chees_posterior_saves_loads_and_predicts_the_same(regression_chees, tmp_path):
    post, data, _ = regression_chees
    post.save(tmp_path / "post")
    loaded = load_posterior(tmp_path / "post")
    for name, value in post.samples.items():
        assert torch.equal(loaded.samples[name], value), name
    assert loaded.record["kernel"] == "chees"
    assert loaded.record["superchain"] == post.record["superchain"]
    assert loaded.record["sample_stats"] == post.record["sample_stats"]
    before = post.predict(data.x[:5], num_samples=64, seed=1)
    after = loaded.predict(data.x[:5], num_samples=64, seed=1)
    torch.testing.assert_close(after.loc, before.loc)
    torch.testing.assert_close(after.samples, before.samples)


def test_to_inference_data_has_sample_stats_by_chain_and_draw(regression_chees):
    post, data, _ = regression_chees
    idata = post.to_inference_data(data)
    stats = idata.sample_stats
    for name in ("diverging", "acceptance_rate", "step_size", "n_steps", "energy", "lp"):
        assert stats[name].dims[:2] == ("chain", "draw"), name
        assert stats[name].shape == (32, 60), name
    assert "tree_depth" not in stats
    assert idata.posterior["weight"].shape[:2] == (32, 60)
    np.testing.assert_allclose(
        stats["lp"].values, np.asarray(post.record["sample_stats"]["lp"]), rtol=1e-6
    )


# -- 10. local latents ------------------------------------------------------------------------


def test_chees_keeps_local_latents_per_row_like_nuts(schools_chees, schools):
    post = schools_chees
    assert post.local_shapes == {"theta_trans": torch.Size([])}
    assert set(post.latent_shapes) == {"mu", "tau"}
    assert post.samples["theta_trans"].shape == (16, 40, 8)
    assert post.samples["mu"].shape == (16, 40)
    assert len(post.record["training_data_sha256"]) == 64
    idata = post.to_inference_data(schools)
    assert idata.posterior["theta_trans"].dims == ("chain", "draw", "obs")
    s = post.samples
    theta = s["mu"][..., None] + s["tau"][..., None] * s["theta_trans"]  # (chain, draw, 8)
    expected = dist.Normal(theta, schools.x[:, 0]).log_prob(schools.y)
    torch.testing.assert_close(post.log_likelihood(schools), expected)


def test_prior_starts_default_to_one_per_chain(small):
    """``num_starts=None``: each chain its own prior draw (its own superchain)."""
    post = chees(BayesianLinearRegression(2), small, num_chains=4, num_warmup=0, num_samples=2)
    assert post.record["num_starts"] == 4 and post.record["superchain"] == [0, 1, 2, 3]


def test_mclmc_tunes_a_badly_scaled_posterior_without_crashing():
    """Inputs scaled by 1e6 gave ``xi / step_size**6`` = inf in float32, a step size of 0 and a
    ZeroDivisionError (found by a fresh user); the tuning now runs in float64."""
    model, data = correlated_regression()
    data = SequenceData(x=data.x * 1e6, y=data.y)
    post = fit_mcmc(
        model, data, kernel=MCLMC(), num_chains=4, num_warmup=30, num_samples=2, progress=False
    )
    assert 0 < post.record["adapted_step_size"] < math.inf
    assert 0 < post.record["adapted_L"] < math.inf


def test_ensemble_starts_fit_the_plain_parameters_per_start_and_each_chain_keeps_its_own(
    tmp_path,
):
    """A model with point-estimate parts: each MAP start fits them (from the model
    re-initialised with seed + m), and the chains of a superchain share their start's values."""
    model = SequenceClassifier(3, 3, 4, d_model=4, num_heads=2, num_layers=1, d_ff=4, dropout=0.0)
    names = {name for name, _ in model.named_parameters()}
    post = chees(
        model, classifier_data(), num_chains=4, starts=EnsembleStarts(2), num_warmup=4,
        num_samples=3, map_steps=20, seed=1,
    )  # fmt: skip
    estimates = post.record["point_estimates"]
    assert (estimates["method"], estimates["per_chain"], estimates["num_steps"]) == (
        "map, per start",
        True,
        20,
    )
    assert set(estimates["parameters"]) == names
    assert set(post.members) == names
    weight = post.members["embedding.projection.weight"]  # (chain, draw, d_model, F)
    assert weight.shape == (4, 3, 4, 3)
    assert torch.equal(weight[0], weight[1]) and torch.equal(weight[2], weight[3])
    assert not torch.allclose(weight[0], weight[2])  # two starts, two fits
    assert torch.equal(weight[:, 0], weight[:, 2])  # held fixed while sampling
    # the draws are an MCMC posterior, judged by R-hat: not "independently fitted members"
    verdict = "\n".join(post.diagnose(verbose=False).attrs["verdict"])
    assert "independently fitted members" not in verdict and "R-hat" in verdict
    x = classifier_data().x
    probs = post.predict(x, num_samples=None).probs  # one pass per draw, its chain's values
    assert probs.shape == (12, 6, 3)
    post.save(tmp_path / "run")
    assert torch.equal(load_posterior(tmp_path / "run").predict(x, num_samples=None).probs, probs)


def test_per_chain_point_estimates_follow_their_chains_when_some_chains_are_not_finite():
    """A chain whose state is NaN is left out of the pass; the others keep their own plain
    parameters (a Seq2Seq, whose decoder queries are plain parameters, once crashed here)."""
    model = SequenceClassifier(3, 3, 4, d_model=4, num_heads=2, num_layers=1, d_ff=4, dropout=0.0)
    data = classifier_data()
    density = VectorizedDensity(model.eval(), data.x, data.y, None)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, density.dim, generator=g)
    density.parameters = {
        name: (p.detach() + 0.1 * torch.arange(3.0).view(3, *[1] * p.dim()))[:, None]
        for name, p in model.named_parameters()
    }
    every, _ = density.log_density(z)
    z[1] = math.nan
    some, grad = density.log_density(z)
    assert math.isnan(some[1]) and torch.isnan(grad[1]).all()
    torch.testing.assert_close(some[[0, 2]], every[[0, 2]])
    assert all(v.shape[0] == 3 for v in density.parameters.values())  # restored
