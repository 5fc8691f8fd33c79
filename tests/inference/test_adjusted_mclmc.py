"""Adjusted MCLMC (MAMS, ``inference.mcmc.adjusted_mclmc``), driven directly through the
many-chain sampler interface (init -> warm-up generator -> sample loop).

Exactness is held to ``test_correctness.py``'s tolerances (``Z = 4`` Monte Carlo standard
errors, ArviZ's ESS over all chains): a 100-D Gaussian whose sds span two decades (where
unadjusted MCLMC inflates the narrow coordinates), the analytic linear regression and
posteriordb's eight schools. Everything runs in float64 on the CPU.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xarray as xr

from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_mcmc
from probtransformer.inference.mcmc.adjusted_mclmc import (
    AdjustedMCLMC,
    _Moments,
    jitter_scale,
)
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.kernel import ChainRNG
from probtransformer.inference.mcmc.mclmc import MCLMCSampler, isokinetic_velocity
from probtransformer.inference.mcmc.starts import prior_states
from tests.inference.test_correctness import (
    REFERENCE,
    Z,
    _ess,
    assert_matches_reference,
    correlated_regression,
    exact_moments,
    moment_errors,
)
from tests.inference.test_local_latents import SIGMA, EightSchools, Y

CPU = torch.device("cpu")

#: The 100-D Gaussian's standard deviations, log-spaced from 0.01 to 1.
SD = torch.logspace(-2, 0, 100, dtype=torch.float64)


def gaussian(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log density and gradient of ``N(0, diag(SD²))`` at ``z`` ``(K, 100)``."""
    return -0.5 * (z / SD).square().sum(1), -z / SD.square()


def run(kernel, density, z0, *, num_warmup, num_samples, seed=0, groups=None, per_start=False):
    """Drive ``kernel``'s sampler from ``z0`` ``(K, D)``: ``(sampler, draws (K, S, D), stats
    {name: (K, S)})``."""
    chains = len(z0)
    groups = torch.zeros(chains, dtype=torch.long) if groups is None else groups
    sampler = kernel.sampler(
        density,
        ChainRNG(seed, chains, CPU),
        num_warmup=num_warmup,
        groups=groups,
        per_start=per_start,
    )
    warmup = sampler.warmup(sampler.init(z0))
    while True:
        try:
            next(warmup)
        except StopIteration as done:
            state = done.value
            break
    draws, stats = [], {}
    for _ in range(num_samples):
        state, step = sampler.sample(state)
        draws.append(state.z)
        for name, value in step.items():
            stats.setdefault(name, []).append(value)
    return sampler, torch.stack(draws, 1), {k: torch.stack(v, 1) for k, v in stats.items()}


def variance_errors(draws: torch.Tensor, sd: torch.Tensor) -> tuple[np.ndarray, float]:
    """``|mean of z_k² - sd_k²| / SE`` per coordinate (the mean is known: 0), and the same for
    the narrowest tenth's mean of ``z_k² / sd_k²``; SE from ArviZ's ESS of ``z_k²``."""
    ratio = (draws / sd).square().numpy()  # (K, S, D): z_k² / sd_k², mean 1
    errors = np.array(
        [
            abs(ratio[..., k].mean() - 1)
            / (ratio[..., k].std() / math.sqrt(_ess(ratio[..., k], False)))
            for k in range(ratio.shape[-1])
        ]
    )
    tenth = ratio[..., : ratio.shape[-1] // 10].mean(-1)
    se = tenth.std() / math.sqrt(_ess(tenth, False))
    return errors, abs(tenth.mean() - 1) / se


# -- (a) a 100-D Gaussian of sds 0.01 .. 1 ------------------------------------------------------


def test_the_variances_of_a_badly_scaled_gaussian_are_exact():
    """32 chains x 200 kept draws after 150 warm-up transitions: every coordinate's variance
    within ``Z`` MCSE of its own, and the narrowest tenth's (sds < 0.016) mean variance ratio
    within ``Z`` MCSE of 1 (no inflation); the mean acceptance near MAMS's target of 0.9.
    Over seeds 0-7 the largest of the 100 coordinates' errors was 2.3-3.7 (the expected
    maximum of 100 half-normals is about 2.6; with 16 chains x 150 draws the ESS of ``z²`` was
    overestimated and it reached 4.1); 1,500 draws per chain gave per-decile ratios within 1%
    of 1."""
    z0 = torch.randn(32, 100, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sampler, draws, stats = run(AdjustedMCLMC(), gaussian, z0 * SD, num_warmup=150, num_samples=200)
    errors, narrow = variance_errors(draws, SD)
    assert errors.max() < Z, (errors.argmax(), errors.max())
    assert narrow < Z, narrow
    assert 0.8 < float(stats["acceptance_rate"].mean()) < 0.97
    assert not stats["diverging"].any()
    adapted = sampler.adapted()
    assert adapted["steps_per_proposal"] >= 1 and adapted["L"] > 0
    assert torch.allclose(sampler.sigma[0], SD, rtol=0.5)  # the preconditioner found the sds


def test_the_metropolis_step_removes_the_bias_unadjusted_mclmc_has_at_the_same_step_size():
    """No warm-up and no preconditioner, ε = 0.1 (ten times the narrowest sd), 64 chains
    started from the target: unadjusted MCLMC's narrowest tenth comes out about 20% too wide
    (measured 1.19; 12-17 MCSE over seeds 0-9), adjusted MCLMC's within ``Z`` MCSE of exact
    (0.2-1.7 MCSE over seeds 4-9) while it rejects about one proposal in six."""
    z0 = torch.randn(64, 100, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    z0 = z0 * SD
    unadjusted = MCLMCSampler(gaussian, ChainRNG(0, 64, CPU))
    state, u = unadjusted.start(z0)
    unadjusted.step_size, unadjusted.L = torch.tensor([0.1]), torch.tensor([1.0])
    kept = []
    for i in range(400):
        state, u, _ = unadjusted.step(state, u)
        if i >= 100 and i % 5 == 0:
            kept.append(state.z)
    _, biased = variance_errors(torch.stack(kept, 1), SD)
    assert biased > 2 * Z, biased
    kernel = AdjustedMCLMC(step_size=0.1, L=1.0, diagonal_preconditioning=False)
    _, draws, stats = run(kernel, gaussian, z0, num_warmup=0, num_samples=160)
    _, narrow = variance_errors(draws[:, 10:], SD)
    assert narrow < Z, narrow
    assert 0.6 < float(stats["acceptance_rate"].mean()) < 0.95


# -- (b) the analytic linear regression ---------------------------------------------------------


def test_adjusted_mclmc_recovers_the_analytic_posterior():
    """``test_correctness``'s correlated regression through ``VectorizedDensity``: 16 chains x
    100 kept draws, every mean and covariance entry within ``Z`` MCSE of the closed form."""
    model, data = correlated_regression()
    exact = exact_moments(model, data)
    density = VectorizedDensity(model.double().eval(), data.x.double(), data.y.double(), None)
    torch.manual_seed(0)
    z0 = prior_states(density, 16)
    _, z, stats = run(AdjustedMCLMC(), density.log_density, z0, num_warmup=150, num_samples=100)
    values = density.constrain(z.flatten(0, 1))
    draws = torch.cat([values["weight"], values["bias"][:, None]], -1).reshape(16, 100, 4)
    mean_err, cov_err = moment_errors(draws.numpy(), *exact, independent=False)
    assert mean_err.max() < Z, mean_err
    assert cov_err.max() < Z, cov_err
    assert not stats["diverging"].any()


def test_fit_mcmc_runs_the_kernel_object_through_the_many_chain_runner():
    """``fit_mcmc(kernel=AdjustedMCLMC())`` with the driver's default prior starts: the runner
    knows the kernel only through the interface; the record carries the settings and the
    adapted values, the statistics their ArviZ names, ``(chain, draw)`` each."""
    model, data = correlated_regression()
    post = fit_mcmc(model, data, kernel=AdjustedMCLMC(), num_chains=8, num_warmup=100,
                    num_samples=40, progress=False)  # fmt: skip
    assert post.samples["weight"].shape == (8, 40, 3)
    record = post.record
    assert (record["kernel"], record["target_accept_prob"]) == ("adjusted-mclmc", 0.9)
    assert record["adapted_step_size"] > 0 and record["adapted_steps_per_proposal"] >= 1
    stats = post.sample_stats()
    names = {"diverging", "acceptance_rate", "step_size", "n_steps", "energy_error", "lp"}
    assert set(stats) == names and all(v.shape == (8, 40) for v in stats.values())
    assert 0.7 < float(stats["acceptance_rate"].mean()) < 1.0


# -- (c) posteriordb's eight schools (non-centred) ----------------------------------------------


def test_adjusted_mclmc_recovers_eight_schools_noncentered():
    """``eight_schools_noncentered`` with ``theta_trans`` local to the data plate (as ChEES's
    test), 16 chains x 100 draws; ``mu`` and ``tau`` within ``Z`` combined standard errors of
    Stan's reference. The chains start as Stan's do (uniform in (-2, 2), unconstrained): a
    prior start of ``tau`` from the half-Cauchy's far tail (``tau = 5000`` at seed 1) has
    energy errors of 1e3-1e6 nats at the step size its group adapts and never moves (the verdict's
    stuck chains).
    """
    schools = SequenceData(
        torch.tensor(SIGMA, dtype=torch.float64)[:, None], torch.tensor(Y, dtype=torch.float64)
    )
    density = VectorizedDensity(EightSchools().double().eval(), schools.x, schools.y, None)
    generator = torch.Generator().manual_seed(0)
    z0 = 4 * torch.rand(16, density.dim, generator=generator, dtype=torch.float64) - 2
    _, z, stats = run(AdjustedMCLMC(), density.log_density, z0, num_warmup=150, num_samples=100)
    values = density.constrain(z.flatten(0, 1))
    draws = {name: values[name].reshape(16, 100).numpy() for name in ("mu", "tau")}
    assert_matches_reference(draws, REFERENCE["eight_schools"])
    assert float(stats["diverging"].double().mean()) < 0.01


# -- per-start tuning, the verdict, the pieces --------------------------------------------------


def test_per_start_tuning_gives_each_start_its_own_step_size():
    """Chains 0-3 on ``N(0, I)``, chains 4-7 on ``N(0, 0.01² I)`` (D = 4), no preconditioner:
    tuned apart, the second start's ε and L come out about 100 times smaller."""
    scale = torch.tensor([1.0] * 4 + [0.01] * 4, dtype=torch.float64)[:, None]

    def two_scales(z):
        return -0.5 * (z / scale).square().sum(1), -z / scale.square()

    groups = torch.tensor([0] * 4 + [1] * 4)
    z0 = torch.randn(8, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kernel = AdjustedMCLMC(diagonal_preconditioning=False)
    sampler, draws, stats = run(
        kernel,
        two_scales,
        z0 * scale,
        num_warmup=100,
        num_samples=20,
        groups=groups,
        per_start=True,
    )
    eps, L = sampler.adapted()["step_size"], sampler.adapted()["L"]
    assert len(eps) == 2 and 30 < eps[0] / eps[1] < 300, eps
    assert 30 < L[0] / L[1] < 300, L
    assert stats["step_size"][:4].unique().numel() == 1
    assert float(draws[4:].std()) < 0.03 < float(draws[:4].std())


def test_the_warmup_variance_is_taken_about_each_starts_own_mean():
    """Two starts in modes at -10 and +10 tuned together: the variance that sets the
    preconditioner is the spread within each mode (1), not the distance between them (100)."""
    starts = torch.tensor([0, 0, 1, 1])
    moments = _Moments(starts, torch.zeros(4, dtype=torch.long), 1, 2)
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        z = torch.randn(4, 2, generator=g, dtype=torch.float64)
        moments.add(z + 10 * (2 * starts[:, None] - 1), torch.tensor([True, True, True, False]))
    assert moments.variance().shape == (1, 2)
    assert torch.allclose(moments.variance(), torch.ones(1, 2, dtype=torch.float64), atol=0.1)
    per_start = _Moments(starts, starts, 2, 2)
    per_start.add(torch.zeros(4, 2, dtype=torch.float64), torch.tensor([True, True, False, False]))
    assert per_start.variance()[1].tolist() == [1.0, 1.0]  # start 1 never moved


def test_the_verdict_names_stuck_chains_and_a_low_acceptance():
    """Chain 2 stuck: named, and left out of the mean acceptance; a mean 0.3 below the target
    is flagged."""
    accept = np.full((4, 10), 0.9)
    accept[2] = 0.01
    stats = xr.Dataset({"acceptance_rate": (("chain", "draw"), accept)})

    def flag(bad, text):
        return ("WARN " if bad else "ok ") + text

    lines = AdjustedMCLMC.verdict_lines(stats, {"target_accept_prob": 0.9}, flag)
    assert lines[0].startswith("WARN stuck chains") and "(chains [2])" in lines[0]
    assert lines[1] == "ok mean acceptance 0.90 (target 0.9)"  # the stuck chain left out
    stats["acceptance_rate"][:] = 0.6
    assert AdjustedMCLMC.verdict_lines(stats, {"target_accept_prob": 0.9}, flag) == [
        "ok stuck chains (mean acceptance < 0.05): 0 of 4",
        "WARN mean acceptance 0.60 (target 0.9): the step size did not settle; lengthen num_warmup",
    ]


def test_the_velocity_update_keeps_unit_norm_and_jitter_has_the_asked_mean():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(5, 7, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=1, keepdim=True)
    new, kinetic = isokinetic_velocity(
        u,
        torch.randn(5, 7, generator=g, dtype=torch.float64),
        torch.full((5, 1), 0.3, dtype=torch.float64),
    )
    assert torch.allclose(new.norm(dim=1), torch.ones(5, dtype=torch.float64))
    assert kinetic.shape == (5,) and torch.isfinite(kinetic).all()
    for mean in (1.0, 1.7, 5.0, 12.3):
        s = float(jitter_scale(torch.tensor(mean, dtype=torch.float64)))
        uniform = (torch.arange(200_000, dtype=torch.float64) + 0.5) / 200_000
        assert abs(float(torch.ceil(uniform * s).mean()) - mean) < 1e-3, (mean, s)


def test_a_one_dimensional_density_is_refused():
    sampler = AdjustedMCLMC().sampler(
        gaussian,
        ChainRNG(0, 2, CPU),
        num_warmup=0,
        groups=torch.zeros(2, dtype=torch.long),
        per_start=False,
    )
    with pytest.raises(ValueError, match=r"at least 2 unconstrained scalars \(.*\), got 1"):
        sampler.init(torch.zeros(2, 1, dtype=torch.float64))


def test_bad_sampler_inputs_are_refused_naming_what_arrived():
    def sampler(groups, num_warmup=0):
        rng = ChainRNG(0, 2, CPU)
        return AdjustedMCLMC().sampler(
            gaussian, rng, num_warmup=num_warmup, groups=groups, per_start=False
        )

    z = torch.zeros(2, 100, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"groups must be a \(2,\) torch.long tensor, got \(3,\)"):
        sampler(torch.zeros(3, dtype=torch.long)).init(z)
    with pytest.raises(ValueError, match=r"got \(2,\) torch.float32"):
        sampler(torch.zeros(2)).init(z)
    with pytest.raises(
        ValueError, match=r"z must be \(K, D\), one row per chain, got shape \(100,\)"
    ):
        sampler(torch.zeros(2, dtype=torch.long)).init(z[0])
    with pytest.raises(TypeError, match="num_warmup must be an int, got 1.5"):
        sampler(torch.zeros(2, dtype=torch.long), num_warmup=1.5)
    with pytest.raises(ValueError, match="num_warmup must be >= 0, got -1"):
        sampler(torch.zeros(2, dtype=torch.long), num_warmup=-1)


# -- (d) bad settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (dict(target_accept_prob=1.0), ValueError, "target_accept_prob must be a float in"),
        (dict(target_accept_prob=1), ValueError, "target_accept_prob must be a float in"),
        (dict(step_size=0.0), ValueError, "step_size must be a finite number > 0"),
        (dict(step_size=math.inf), ValueError, "step_size must be a finite number > 0"),
        (dict(L=-1.0), ValueError, "L must be a finite number > 0"),
        (dict(L="2"), ValueError, "L must be a finite number > 0"),
        (dict(diagonal_preconditioning=1), TypeError, "diagonal_preconditioning must be"),
        (dict(random_trajectory_length=None), TypeError, "random_trajectory_length must be"),
        (dict(max_steps=2.0), TypeError, "max_steps must be an int"),
        (dict(max_steps=0), ValueError, "max_steps must be >= 1"),
        (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0"),
        (dict(compile="yes"), TypeError, "compile must be True, False or None"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(options, error, match):
    with pytest.raises(error, match=match):
        AdjustedMCLMC(**options)


def test_the_settings_record_names_the_kernel():
    record = AdjustedMCLMC(step_size=0.5).record()
    assert record["kernel"] == "adjusted-mclmc" and record["step_size"] == 0.5
    assert record["target_accept_prob"] == 0.9 and record["temperature"] == 1.0
