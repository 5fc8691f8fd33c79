"""Correctness evidence: NUTS and SVI recover known posteriors within Monte Carlo error.

Tolerances come from the Monte Carlo standard error (MCSE) of each estimate (plus, for SVI, a
measured optimisation error, and for the Stan references their own MCSE and rounding): an
estimate ``m`` of ``E[g(theta)]`` from draws with effective sample size ``ESS`` has
``MCSE = sd(g) / sqrt(ESS)``, and every check asserts ``|m - truth| < Z * SE`` with ``Z = 4``
(two-sided false-alarm rate 6e-5 per check, about 1e-3 over the ~15 checks of a test). ``ESS`` is
ArviZ's ``ess(method="mean")`` for NUTS draws and the number of draws for independent draws of a
guide.

- Means: ``g = theta_k``.
- Covariances: ``g = (theta_k - mean_k)(theta_l - mean_l)``, whose sd is estimated from the draws
  (for a Gaussian it is ``sqrt(S_kk S_ll + S_kl²)``, so a variance gets ``S_kk sqrt(2 / ESS)``).
- Standard deviations: ``sd = sqrt(var)``, so ``SE(sd) = SE(var) / (2 sd)`` (delta method); this
  accounts for heavy tails (eight schools' ``tau``) through the sd of ``(theta - mean)²``. The
  relative tolerance on an sd is then about ``Z sqrt((kurtosis - 1) / (4 ESS))``, i.e.
  ``Z / sqrt(2 ESS)`` for a Gaussian coordinate: 13% with the ESS of about 500 that 1,000 NUTS
  draws give ``(theta - mean)²`` here, 21% for ``tau``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroSample

from probtransformer.datasets import SequenceData
from probtransformer.inference import NUTS, fit_mcmc, fit_svi
from probtransformer.inference.diagnostics._arviz import az, pareto_khat
from probtransformer.models import BayesianLinearRegression

#: Standard errors allowed per check.
Z = 4.0

# fit_mcmc(jit_compile=True) goes through torch.jit.trace, which recent torch marks deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")


# -- Monte Carlo standard errors ----------------------------------------------------------------


def _ess(values: np.ndarray, independent: bool) -> float:
    """ESS of ``(chain, draw)`` values: ArviZ's for MCMC, the number of draws when independent."""
    return float(values.size) if independent else float(az.ess(values, method="mean"))


def moment_errors(
    draws: np.ndarray,
    mean: np.ndarray,
    cov: np.ndarray,
    *,
    independent: bool,
    extra_error: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Errors of the draws' mean and covariance in units of their standard errors.

    Args:
        draws: ``(chain, draw, K)``.
        mean, cov: the exact ``(K,)`` mean and ``(K, K)`` covariance.
        independent: the draws are independent (guide draws), else MCMC.
        extra_error: a further error, independent of the Monte Carlo error, in units of the sd
            (mean) or of ``sd_k sd_l`` (covariance), added in quadrature (see the SVI test).

    Returns:
        ``(K,)`` and ``(K, K)`` arrays of ``|estimate - exact| / SE``.
    """
    K = draws.shape[-1]
    sd = np.sqrt(np.diag(cov))
    centred = draws - draws.mean(axis=(0, 1))
    mean_err = np.empty(K)
    cov_err = np.empty((K, K))
    for k in range(K):
        mcse = draws[..., k].std() / np.sqrt(_ess(draws[..., k], independent))
        se = np.hypot(mcse, extra_error * sd[k])
        mean_err[k] = abs(draws[..., k].mean() - mean[k]) / se
        for j in range(K):
            product = centred[..., k] * centred[..., j]
            mcse = product.std() / np.sqrt(_ess(product, independent))
            se = np.hypot(mcse, extra_error * sd[k] * sd[j])
            cov_err[k, j] = abs(product.mean() - cov[k, j]) / se
    return mean_err, cov_err


# -- linear regression with a known Gaussian posterior ----------------------------------------


def correlated_regression() -> tuple[BayesianLinearRegression, SequenceData]:
    """50 rows, 3 features; the first two correlated (0.7) and the third off-centre, so the
    posterior has correlations of -0.72 (weight[0], weight[1]) and -0.67 (weight[2], bias): a
    check of the covariance then tells a full-rank posterior from a mean-field one. (Shared with
    ``test_many_chains.py``.)"""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(50, 3, generator=g)
    x = torch.stack([z[:, 0], 0.7 * z[:, 0] + 0.71 * z[:, 1], 0.5 + 0.7 * z[:, 2]], -1)
    y = x @ torch.tensor([0.8, -0.5, 0.3]) + 0.2 + torch.randn(50, generator=g)
    return BayesianLinearRegression(3), SequenceData(x=x, y=y)


def exact_moments(model, data: SequenceData) -> tuple[np.ndarray, np.ndarray]:
    """The closed-form posterior's ``(P + 1,)`` mean and ``(P + 1, P + 1)`` covariance."""
    posterior = model.analytic_posterior(data.x, data.y)
    return posterior.mean.numpy(), posterior.covariance_matrix.numpy()


@pytest.fixture(scope="module")
def regression() -> tuple[BayesianLinearRegression, SequenceData]:
    return correlated_regression()


@pytest.fixture(scope="module")
def exact(regression) -> tuple[np.ndarray, np.ndarray]:
    return exact_moments(*regression)


def coefficients(post, num_samples: int | None = None) -> np.ndarray:
    """``(chain, draw, P + 1)`` draws of ``concat([weight, bias])`` (the analytic order)."""
    draws = post.draws(num_samples)
    return torch.cat([draws["weight"], draws["bias"][..., None]], -1).double().numpy()


def test_exact_posterior_correlations_are_strong(exact):
    """The design gives the covariance checks something to find (a mean-field fit has none)."""
    _, cov = exact
    sd = np.sqrt(np.diag(cov))
    corr = cov / np.outer(sd, sd)
    assert corr[0, 1] < -0.6 and corr[2, 3] < -0.6


def test_nuts_recovers_the_analytic_posterior(regression, exact):
    """1,000 NUTS draws (ESS 1,000-1,500 per coefficient): every mean and covariance entry within
    4 MCSE of the closed form (observed: at most 1.2 for a mean, 2.0 for a covariance)."""
    model, data = regression
    post = fit_mcmc(
        model,
        data,
        kernel=NUTS(full_mass=True, jit_compile=True),
        num_chains=1,
        num_warmup=300,
        num_samples=1000,
        seed=0,
        progress=False,
    )
    mean_err, cov_err = moment_errors(coefficients(post), *exact, independent=False)
    assert mean_err.max() < Z, mean_err
    assert cov_err.max() < Z, cov_err


@pytest.fixture(scope="module")
def mvn_posterior(regression):
    """Full-rank SVI, fitted to convergence: 16 particles per step, lr decaying 0.05 -> 2.5e-4."""
    model, data = regression
    return fit_svi(
        model,
        data,
        guide="mvn",
        num_steps=1000,
        lr=0.05,
        lr_decay=5e-3,
        num_particles=16,
        init_scale=0.1,
        seed=0,
        progress=False,
    )


#: Optimisation error allowed to the SVI guide, in posterior sds (means) and in ``sd_k sd_l``
#: (covariances). The ELBO's optimum in the full-rank Gaussian family is the exact posterior (it
#: is Gaussian), so what remains after the fit is the scatter of the final Adam iterates around
#: it, driven by the noise of the ELBO gradient. With these settings the guide's own mean and
#: covariance (read from its parameters, no sampling) missed the exact ones by at most 0.03 sd and
#: 0.036 sd_k sd_l over seeds 0-5 (root mean square about 0.013 and 0.015). Taking 0.02 as its
#: standard error and combining it in quadrature with the Monte Carlo error of 4,000 independent
#: guide draws (sd / sqrt(4000) = 0.016 sd for a mean; sqrt(2 / 4000) = 0.022 sd² for a variance)
#: gives 4-SE tolerances of 0.10 sd for a mean and 0.12 sd² for a variance.
SVI_OPTIMISATION_ERROR = 0.02


def test_svi_mvn_guide_recovers_the_analytic_posterior(mvn_posterior, exact):
    draws = coefficients(mvn_posterior, 4000)
    mean_err, cov_err = moment_errors(
        draws, *exact, independent=True, extra_error=SVI_OPTIMISATION_ERROR
    )
    assert mean_err.max() < Z, mean_err
    assert cov_err.max() < Z, cov_err


def test_the_tolerance_rejects_a_mean_field_posterior(exact):
    """Negative control: the exact mean-field optimum (the right means, variances 1 / Λ_kk and no
    correlations; Bishop 2006, §10.1.2) fails the covariance check that the fits above pass."""
    mean, cov = exact
    diagonal = np.diag(1.0 / np.diag(np.linalg.inv(cov)))
    rng = np.random.default_rng(0)
    draws = rng.multivariate_normal(mean, diagonal, size=(1, 4000))
    mean_err, cov_err = moment_errors(
        draws, mean, cov, independent=True, extra_error=SVI_OPTIMISATION_ERROR
    )
    assert mean_err.max() < Z  # the means are right ...
    assert cov_err.max() > 5 * Z  # ... the covariance is far off (about 33 SE)


def test_converged_guide_has_small_pareto_khat(mvn_posterior, regression):
    """PSIS k̂ of ``log p(y, θ) - log q(θ)`` (Yao et al. 2018): below 0.5 when the guide is close
    to the posterior, so importance sampling from it is reliable."""
    _, data = regression
    log_weights = mvn_posterior.log_importance_weights(data, num_samples=2000)
    assert log_weights.shape == (2000,) and torch.isfinite(log_weights).all()
    assert pareto_khat(log_weights) < 0.5


def test_underdispersed_guide_has_large_pareto_khat(regression):
    """A mean-field guide stopped after 5 steps with sd 1e-3 is far narrower than the posterior
    (sd about 0.3): the weights ``p / q`` grow without bound in q's tails, k̂ > 0.7 (unreliable)."""
    model, data = regression
    post = fit_svi(
        model, data, guide="normal", num_steps=5, init_scale=1e-3, seed=0, progress=False
    )
    log_weights = post.log_importance_weights(data, num_samples=2000)
    assert pareto_khat(log_weights) > 0.7


# -- posteriordb reference posteriors (Stan) ----------------------------------------------------

#: The two posteriordb data sets and the reference posteriors' summary, kept in the repository
#: (4 kB) so that every clone runs these checks.
POSTERIORDB = Path(__file__).resolve().parents[1] / "fixtures" / "posteriordb"

#: ``(mean, sd, rounding)`` of the Stan reference posteriors (``POSTERIORDB / "README.md"``);
#: ``rounding`` is half a unit of the last printed digit.
REFERENCE = {
    "eight_schools": {"mu": (4.41, 3.31, 0.005), "tau": (3.60, 3.20, 0.005)},
    "arK": {
        "beta[1]": (0.692, 0.071, 5e-4),
        "beta[5]": (-0.302, 0.070, 5e-4),
        "sigma": (0.1506, 0.0078, 5e-5),
    },
}

#: Effective draws of the reference: 10 chains x 1,000 draws; its MCSE is about sd / 100.
REFERENCE_ESS = 10_000


def _load(name: str) -> dict:
    return json.loads((POSTERIORDB / f"{name}.data.json").read_text())


class EightSchoolsNonCentered(PyroModule):
    """posteriordb ``eight_schools_noncentered``: ``theta_j = mu + tau * theta_trans_j``,
    ``y_j ~ N(theta_j, sigma_j)``, ``mu ~ N(0, 5)``, ``tau ~ half-Cauchy(0, 5)``,
    ``theta_trans ~ N(0, 1)``. ``x`` is ``(J, 1)``: each school's known ``sigma_j``."""

    likelihood_site = "y"

    def __init__(self, num_schools: int = 8) -> None:
        super().__init__()
        self.config = dict(num_schools=num_schools)
        self.mu = PyroSample(dist.Normal(0.0, 5.0))
        self.tau = PyroSample(dist.HalfCauchy(5.0))
        self.theta_trans = PyroSample(dist.Normal(0.0, 1.0).expand([num_schools]).to_event(1))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        mu, tau, theta_trans = self.mu, self.tau, self.theta_trans
        # Under a vectorizing plate at dim -2: mu, tau (S, 1), theta_trans (S, 1, J); drop the
        # 1 (the data plate's place) so that schools line up with the data dim.
        if theta_trans.dim() > 1:
            theta_trans = theta_trans.squeeze(-2)
        N = x.shape[0]
        with pyro.plate("data", num_data or N, subsample=torch.arange(N, device=x.device)) as i:
            loc = mu + tau * theta_trans[..., i]  # row i is school i
            pyro.sample(self.likelihood_site, dist.Normal(loc, x[:, 0]), obs=y)
        return loc


class AutoRegressive(PyroModule):
    """posteriordb ``arK``: ``y_t ~ N(alpha + sum_k beta_k y_{t-k}, sigma)`` for t = K+1..T,
    ``alpha, beta_k ~ N(0, 10)``, ``sigma ~ half-Cauchy(0, 2.5)``. ``x[t, k-1] = y_{t-k}``."""

    likelihood_site = "y"

    def __init__(self, order: int = 5) -> None:
        super().__init__()
        self.config = dict(order=order)
        self.alpha = PyroSample(dist.Normal(0.0, 10.0))
        self.beta = PyroSample(dist.Normal(0.0, 10.0).expand([order]).to_event(1))
        self.sigma = PyroSample(dist.HalfCauchy(2.5))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        alpha, beta, sigma = self.alpha, self.beta, self.sigma
        loc = alpha + (beta * x).sum(-1)  # (*draws, N): beta (*draws, 1, K) meets x (N, K)
        N = x.shape[0]
        with pyro.plate("data", num_data or N, subsample=torch.arange(N, device=x.device)):
            pyro.sample(self.likelihood_site, dist.Normal(loc, sigma), obs=y)
        return loc


def assert_matches_reference(draws: dict[str, np.ndarray], reference: dict) -> None:
    """Each posterior mean and sd within ``Z`` combined standard errors (ours and the
    reference's), plus the reference's rounding, of Stan's.

    Ours: ``sd / sqrt(ESS)`` for the mean, ``sd((θ - mean)²) / sqrt(ESS of (θ - mean)²) / (2 sd)``
    for the sd. The reference's: the same with ``REFERENCE_ESS`` (its draws' spread of
    ``(θ - mean)²`` estimated by ours), which adds only 1-4% to the tolerances.
    """
    for name, (ref_mean, ref_sd, rounding) in reference.items():
        values = draws[name]  # (chain, draw)
        mean = values.mean()
        squares = (values - mean) ** 2
        sd = np.sqrt(squares.mean())
        se_mean = np.hypot(
            sd / np.sqrt(_ess(values, independent=False)), ref_sd / np.sqrt(REFERENCE_ESS)
        )
        se_sd = np.hypot(
            squares.std() / np.sqrt(_ess(squares, independent=False)) / (2 * sd),
            squares.std() / np.sqrt(REFERENCE_ESS) / (2 * sd),
        )
        tol_mean, tol_sd = Z * se_mean + rounding, Z * se_sd + rounding
        assert abs(mean - ref_mean) < tol_mean, (name, "mean", mean, ref_mean, tol_mean)
        assert abs(sd - ref_sd) < tol_sd, (name, "sd", sd, ref_sd, f"{tol_sd / ref_sd:.1%}")


def test_nuts_recovers_eight_schools_noncentered():
    data = _load("eight_schools")
    schools = SequenceData(
        x=torch.tensor(data["sigma"], dtype=torch.float32)[:, None],
        y=torch.tensor(data["y"], dtype=torch.float32),
    )
    post = fit_mcmc(
        EightSchoolsNonCentered(data["J"]),
        schools,
        kernel=NUTS(target_accept_prob=0.9, jit_compile=True),
        num_chains=1,
        num_warmup=300,
        num_samples=1000,
        seed=0,
        progress=False,
    )
    draws = {name: post.samples[name].double().numpy() for name in ("mu", "tau")}
    assert_matches_reference(draws, REFERENCE["eight_schools"])


def test_nuts_recovers_ark():
    data = _load("arK")
    K, T = data["K"], data["T"]
    series = torch.tensor(data["y"], dtype=torch.float32)
    lags = torch.stack([series[K - k : T - k] for k in range(1, K + 1)], -1)  # (T - K, K)
    post = fit_mcmc(
        AutoRegressive(K),
        SequenceData(x=lags, y=series[K:]),
        kernel=NUTS(full_mass=True, jit_compile=True),
        num_chains=1,
        num_warmup=300,
        num_samples=1000,
        # the lag coefficients are strongly correlated
        seed=0,
        progress=False,
    )
    beta = post.samples["beta"].double().numpy()
    draws = {
        "beta[1]": beta[..., 0],
        "beta[5]": beta[..., K - 1],
        "sigma": post.samples["sigma"].double().numpy(),
    }
    assert_matches_reference(draws, REFERENCE["arK"])
