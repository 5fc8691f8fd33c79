"""Simulation-based calibration of NUTS (Talts, Betancourt, Simpson, Vehtari & Gelman 2018,
"Validating Bayesian inference algorithms with simulation-based calibration", arXiv:1804.06788).

For each replication ``r``: draw ``theta* ~ prior`` and ``y* ~ p(y | x, theta*)`` (one trace of the
model with ``y=None`` under seed ``r``), fit NUTS to ``(x, y*)`` and count how many of ``L`` thinned
posterior draws ``theta_l`` have ``f(theta_l) < f(theta*)``. If the sampler draws from the exact
posterior, that rank is uniform on ``{0, ..., L}`` for every scalar ``f`` (the truth is just one
more posterior draw). Biased, over- or under-dispersed posteriors pile ranks up at one end, in
the middle or at both ends; a chi-square test on a few equal-probability bins of the ranks checks
uniformity.

Threshold: each quantity's test passes at ``p > SBC_P_MIN = 0.001``. With exact inference each
test raises a false alarm with probability 0.001, so a run of ``k`` tests (3 quantities per
model) false-alarms with probability at most ``k / 1000`` (Bonferroni); every fit is seeded, so a
given version of the code either passes or fails deterministically.
``test_sbc_helper_rejects_miscalibrated_posteriors`` shows what the quick size can detect.

The quick versions (the default run) are smoke-sized: 40 replications of the linear regression
and 20 of the attention model, with short chains. The ``slow`` versions use 200 and 100.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.nn import PyroModule
from scipy import stats

from probtransformer.attention import BayesMultiheadAttention
from probtransformer.datasets import SequenceData
from probtransformer.inference import NUTS, fit_mcmc
from probtransformer.models import BayesianLinearRegression

#: Per-quantity p-value threshold of the uniformity test (false-alarm rate 0.001 per quantity).
SBC_P_MIN = 1e-3

# fit_mcmc(jit_compile=True) goes through torch.jit.trace, which recent torch marks deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")

# -- the SBC helper ---------------------------------------------------------------------------

#: One replication: seed -> ({quantity: f(theta*)}, {quantity: (L,) f at the posterior draws}).
Replication = Callable[[int], tuple[dict[str, float], dict[str, np.ndarray]]]


def sbc(replicate: Replication, num_replications: int, *, num_draws: int, num_bins: int) -> dict:
    """Run ``num_replications`` SBC replications and test each quantity's ranks for uniformity.

    Ranks take ``num_draws + 1`` values, grouped into ``num_bins`` bins of equal probability
    (``num_draws + 1`` must be a multiple of ``num_bins``); ``num_replications / num_bins`` is the
    expected count per bin and should be >= 5 for the chi-square approximation.

    Returns:
        ``{quantity: (p_value, counts per bin)}``.
    """
    if (num_draws + 1) % num_bins:
        raise ValueError("num_draws + 1 must be a multiple of num_bins (equal-probability bins)")
    ranks: dict[str, list[int]] = {}
    for seed in range(num_replications):
        truth, draws = replicate(seed)
        for name, value in truth.items():
            assert draws[name].shape == (num_draws,), (name, draws[name].shape)
            ranks.setdefault(name, []).append(int((draws[name] < value).sum()))
    width = (num_draws + 1) // num_bins
    result = {}
    for name, values in ranks.items():
        counts = np.bincount(np.asarray(values) // width, minlength=num_bins)
        result[name] = (float(stats.chisquare(counts).pvalue), counts.tolist())
    return result


def assert_uniform(result: dict) -> None:
    """Every quantity's ranks pass the chi-square test at ``p > SBC_P_MIN``."""
    print(result)  # p-values and bin counts, shown with ``pytest -s`` or on failure
    failed = {name: r for name, r in result.items() if not r[0] > SBC_P_MIN}
    assert not failed, f"ranks not uniform at p > {SBC_P_MIN}: {failed} (all: {result})"


def prior_trace(model: PyroModule, x: torch.Tensor, seed: int) -> poutine.Trace:
    """``theta* ~ prior`` and ``y* ~ p(y | x, theta*)``: one trace of the model with ``y=None``."""
    with torch.no_grad():
        return poutine.trace(poutine.seed(model, rng_seed=seed)).get_trace(x)


# -- linear regression ------------------------------------------------------------------------

LR_X = torch.randn(10, 2, generator=torch.Generator().manual_seed(0))  # (N, P) fixed design


def lr_replication(num_warmup: int, num_samples: int, num_draws: int) -> Replication:
    model = BayesianLinearRegression(2)

    def replicate(seed: int):
        trace = prior_trace(model, LR_X, seed)
        truth = torch.cat([trace.nodes["weight"]["value"], trace.nodes["bias"]["value"][None]])
        data = SequenceData(x=LR_X, y=trace.nodes["y"]["value"])
        post = fit_mcmc(
            model,
            data,
            kernel=NUTS(jit_compile=True),
            num_chains=1,
            num_warmup=num_warmup,
            num_samples=num_samples,
            seed=seed,
            progress=False,
        )
        draws = post.draws(num_draws)  # thinned evenly
        coefficients = torch.cat([draws["weight"][0], draws["bias"][0, :, None]], -1)
        names = ("weight[0]", "weight[1]", "bias")
        return (
            {name: float(truth[i]) for i, name in enumerate(names)},
            {name: coefficients[:, i].numpy() for i, name in enumerate(names)},
        )

    return replicate


def test_sbc_linear_regression_nuts():
    """40 replications, L = 19 draws thinned from 80 (ranks 0..19 in 4 bins: 10 expected)."""
    result = sbc(lr_replication(60, 80, 19), 40, num_draws=19, num_bins=4)
    assert_uniform(result)


def analytic_replication(scale: float, shift: float, num_draws: int) -> Replication:
    """Draws from the exact posterior of the linear regression with its sd multiplied by
    ``scale`` and its mean moved by ``shift`` sds: a stand-in for a miscalibrated sampler."""
    model = BayesianLinearRegression(2)

    def replicate(seed: int):
        trace = prior_trace(model, LR_X, seed)
        truth = torch.cat([trace.nodes["weight"]["value"], trace.nodes["bias"]["value"][None]])
        exact = model.analytic_posterior(LR_X, trace.nodes["y"]["value"])
        noise = torch.randn(num_draws, 3, generator=torch.Generator().manual_seed(seed))
        sd = exact.covariance_matrix.diagonal().sqrt()
        draws = exact.mean + shift * sd + scale * noise.double() @ exact.scale_tril.T
        return (
            {f"theta[{i}]": float(truth[i]) for i in range(3)},
            {f"theta[{i}]": draws[:, i].numpy() for i in range(3)},
        )

    return replicate


@pytest.mark.parametrize(
    "scale, shift, calibrated",
    [(1.0, 0.0, True), (0.3, 0.0, False), (3.0, 0.0, False), (1.0, 1.0, False)],
)
def test_sbc_helper_rejects_miscalibrated_posteriors(scale, shift, calibrated):
    """The quick test's size (40 replications, 4 bins) passes exact posterior draws and rejects
    posteriors 3x too narrow or too wide or shifted by one sd. (Over 20 sets of seeds it rejected
    these in 20/20 runs, but sd x 0.6 or a 0.5-sd shift only in 1-8 of 20: the quick test is a
    smoke test. The slow test's 200 replications in 10 bins rejected those in 10/10 runs.)"""
    result = sbc(analytic_replication(scale, shift, 19), 40, num_draws=19, num_bins=4)
    passed = all(p > SBC_P_MIN for p, _ in result.values())
    assert passed == calibrated, result


@pytest.mark.slow
def test_sbc_linear_regression_nuts_slow():
    """200 replications, L = 19 draws thinned from 200 (ranks in 10 bins: 20 expected)."""
    result = sbc(lr_replication(200, 200, 19), 200, num_draws=19, num_bins=10)
    assert_uniform(result)


# -- micro attention model --------------------------------------------------------------------


class MicroAttentionRegression(PyroModule):
    """``y_n ~ N(mean_t attention(x_n)_t, noise_scale²)`` with the library's attention layer.

    ``x`` is ``(N, T, 1)``; one head of ``BayesMultiheadAttention`` with ``d_model = 1``: its one
    latent site ``attention.projection`` (4, 1, 2) holds the Q, K, V, O weights and biases (8
    latents, prior N(0, 1)); no logit-scale prior. The output projection already gives the
    prediction a scale and an offset, so there is no ``pooled * w + b`` head: it would only add
    multiplicative redundancy (``w * W_O * W_V``), a ridge-shaped posterior on which NUTS takes
    longer trajectories. At the quick settings, 8 fits took 41 s as here, 61 s with the
    logit-scale prior, 79 s with the head and 110 s with both (2 busy cores).
    """

    likelihood_site = "y"

    def __init__(self, noise_scale: float = 1.0) -> None:
        super().__init__()
        self.noise_scale = noise_scale
        self.config = dict(noise_scale=noise_scale)
        self.attention = BayesMultiheadAttention(1, 1)

    @property
    def attention_modules(self) -> dict[str, list[BayesMultiheadAttention]]:
        return {"encoder.self": [self.attention]}

    def forward(self, x, y=None, mask=None, *, num_data=None):
        N = x.shape[0]
        # Read the latent before the data plate: () draws, or (S, 1) under a vectorizing plate.
        draws = self.attention.projection.shape[:-3]
        h = self.attention(x[None])  # (s, N, T, 1)
        loc = h.mean(dim=(2, 3)).reshape(*draws[:-1], N)  # (*draws, N): drop the plate's 1
        with pyro.plate("data", num_data or N, subsample=torch.arange(N, device=x.device)):
            pyro.sample(self.likelihood_site, dist.Normal(loc, self.noise_scale), obs=y)
        return loc


ATT_X = torch.randn(10, 4, 1, generator=torch.Generator().manual_seed(1))  # (N, T, 1)
ATT_PROBE = torch.linspace(-1.5, 1.5, 4).reshape(1, 4, 1)  # one probe sequence


def _entropy(weights: torch.Tensor) -> torch.Tensor:
    """Mean over queries of the entropy (nats) of each attention row; keys on the last dim."""
    return -torch.special.xlogy(weights, weights).sum(-1).mean(-1)


def att_replication(num_warmup: int, num_samples: int, num_draws: int) -> Replication:
    model = MicroAttentionRegression()

    def replicate(seed: int):
        trace = prior_trace(model, ATT_X, seed)
        y = trace.nodes["y"]["value"]
        theta = {"attention.projection": trace.nodes["attention.projection"]["value"]}
        log_lik = trace.nodes["y"]["fn"].log_prob(y).sum()
        with torch.no_grad():
            probe_mean = poutine.condition(model, data=theta)(ATT_PROBE)[0]
        probe_entropy = _entropy(model.attention.attention_weights[0, 0, 0])
        truth = dict(
            log_lik=float(log_lik), probe_mean=float(probe_mean), entropy=float(probe_entropy)
        )

        data = SequenceData(x=ATT_X, y=y)
        post = fit_mcmc(
            model,
            data,
            kernel=NUTS(jit_compile=True),
            num_chains=1,
            num_warmup=num_warmup,
            num_samples=num_samples,
            seed=seed,
            progress=False,
        )
        L = num_draws
        log_liks = post.log_likelihood(data, num_samples=L).sum(-1)  # (1, L)
        probe = post.predict(ATT_PROBE, num_samples=L).loc[:, 0]  # (L,)
        weights = post.attention(ATT_PROBE, num_samples=L).samples  # (1, L, 1, 1, 1, T, T)
        draws = dict(
            log_lik=log_liks[0].numpy(),
            probe_mean=probe.numpy(),
            entropy=_entropy(weights[0, :, 0, 0, 0]).numpy(),
        )
        return truth, draws

    return replicate


def test_sbc_micro_attention_nuts():
    """20 replications, L = 19 draws thinned from 60 (ranks 0..19 in 4 bins: 5 expected)."""
    result = sbc(att_replication(80, 60, 19), 20, num_draws=19, num_bins=4)
    assert_uniform(result)


@pytest.mark.slow
def test_sbc_micro_attention_nuts_slow():
    """100 replications, L = 19 draws thinned from 100 (ranks in 5 bins: 20 expected)."""
    result = sbc(att_replication(150, 100, 19), 100, num_draws=19, num_bins=5)
    assert_uniform(result)
