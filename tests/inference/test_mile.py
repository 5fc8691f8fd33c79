"""MILE (``fit_mile``): a deep ensemble, then MCLMC or ChEES chains tuned per member; MCLMC's
per-member tuning and MILE's warm-up; the tempered likelihood. Known answers: Gaussians of
known scale, posteriordb's eight schools (and arK, slow), the members the chains start from."""

from __future__ import annotations

import math

import pytest
import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference import MCLMC, NUTS, ChEES, fit_ensemble, fit_mcmc, fit_mile
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.kernel import ChainRNG
from probtransformer.inference.mcmc.mclmc import MCLMCSampler, MCLMCState
from probtransformer.inference.mcmc.mclmc_adaptation import (
    BACKOFF,
    BLACKJAX_TUNING,
    MILE_TUNING,
    StepSizeAdaptation,
    Tuning,
)
from probtransformer.models import BayesianLinearRegression, SequenceClassifier
from tests.inference.test_correctness import REFERENCE, AutoRegressive, assert_matches_reference
from tests.inference.test_local_latents import SIGMA, EightSchools, Y
from tests.inference.test_many_chains import ark_data, check_ark

CPU = torch.device("cpu")
D = 20
#: Chains 0-3 see a unit Gaussian, chains 4-7 one of sd 0.01: two members in modes of very
#: different widths.
SCALE = torch.tensor([1.0] * 4 + [0.01] * 4)[:, None]
GROUPS = torch.tensor([0] * 4 + [1] * 4)


def two_widths(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return -0.5 * ((z / SCALE) ** 2).sum(1), -z / SCALE**2


def standard_normal(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return -0.5 * (z * z).sum(1), -z


def run(density, chains: int, groups, tuning: Tuning, steps: int, seed: int = 0, dim: int = D):
    """Tune from the mode (0) in ``steps`` steps, then ``steps`` more: the sampler, the states
    ``(K, steps, dim)`` and the energy errors ``(steps, K)``."""
    sampler = MCLMCSampler(density, ChainRNG(seed, chains, CPU), groups=groups, tuning=tuning)
    state, u = sampler.start(torch.zeros(chains, dim))
    state, u = sampler.tune(state, u, steps)
    states, errors = [], []
    for _ in range(steps):
        state, u, energy_change = sampler.step(state, u)
        states.append(state.z)
        errors.append(energy_change)
    return sampler, torch.stack(states, 1), torch.stack(errors).double()


# -- MCLMC's tuning ----------------------------------------------------------------------------


def test_each_member_gets_its_own_step_size_and_the_draws_their_own_scale():
    """Without a preconditioner the step size follows the width: about 100x apart, each member
    at the target energy error. Pooled, the narrow member sets one step size for all, and the
    wide member's chains crawl (energy error 1e-13 per dimension, not 5e-4)."""
    tuning = Tuning(diagonal_preconditioning=False)
    sampler, z, errors = run(two_widths, 8, GROUPS, tuning, 1000)
    ratio = float(sampler.step_size[0] / sampler.step_size[1])
    assert 30 < ratio < 300, sampler.step_size
    for group, sd in ((0, 1.0), (1, 0.01)):
        chains = GROUPS == group
        assert float(z[chains].std()) == pytest.approx(sd, rel=0.1)
        energy_var = float(errors[:, chains].square().mean() / D)
        assert 1e-4 < energy_var < 2.5e-3, (group, energy_var)  # target 5e-4
    pooled, _, pooled_errors = run(two_widths, 8, None, tuning, 1000)
    assert pooled.step_size.shape == (1,)
    assert float(pooled_errors[:, :4].square().mean() / D) < 1e-8


def test_mile_warmup_reaches_its_energy_target_and_says_what_it_costs():
    """MILE's target, 0.5 decaying to 0.1 per dimension: on a 200-dimensional standard normal
    the sampled energy error is about 0.1 per dimension, and the draws' sd about 1.1 (the
    unadjusted step's bias that MILE accepts); BlackJAX's 5e-4 gives sd 1.0."""
    for tuning, target, sd in (
        (MILE_TUNING, 0.1, (1.03, 1.2)),
        (BLACKJAX_TUNING, 5e-4, (0.97, 1.04)),
    ):
        _, z, errors = run(standard_normal, 4, None, tuning, 1500, seed=1, dim=200)
        energy_var = float(errors.square().mean() / 200)
        assert target / 2 < energy_var < 2 * target, (tuning, energy_var)
        assert sd[0] < float(z.std()) < sd[1], (tuning, float(z.std()))


def test_chains_started_at_a_mode_stay_in_the_typical_set_while_tuning():
    """At a mode the gradient is 0 and a step's energy error says nothing: the initial step size
    comes from several steps, and it grows at most 2x per step. (Uncapped, BlackJAX's estimate
    jumped twentyfold and threw the chains to a radius of 90 on a unit Gaussian in 20 dims.)"""
    sampler = MCLMCSampler(standard_normal, ChainRNG(0, 4, CPU))
    state, u = sampler.start(torch.zeros(4, D))
    adapt = StepSizeAdaptation(sampler, 100)
    state, u = sampler._initial_step_size(state, u)
    radius = 0.0
    for _ in range(100):
        state, u = adapt.step(state, u)
        radius = max(radius, float(state.z.norm(dim=1).max()))
    assert radius < 3 * math.sqrt(D)


def test_a_step_that_gives_nan_is_rejected_and_caps_its_members_step_size():
    """MILE's back-off: the chain keeps its state and its member's step size stays below 0.8
    of the one that failed; the other member carries on."""

    def wall(z):  # a unit Gaussian whose density is NaN beyond z[0] = 1
        lp = -0.5 * (z * z).sum(1)
        return lp.where(z[:, 0] <= 1.0, torch.nan), -z

    sampler = MCLMCSampler(wall, ChainRNG(0, 2, CPU), groups=torch.tensor([0, 1]))
    start = torch.zeros(2, D)
    start[0, 0] = 0.99
    state, u = sampler.start(start)
    u = torch.zeros(2, D)
    u[:, 0] = 1.0  # both moving up z[0]: chain 0 hits the wall
    sampler.step_size = torch.tensor([0.5, 0.5], dtype=torch.float64)
    adapt = StepSizeAdaptation(sampler, 10)
    new, _ = adapt.step(state, u)
    assert torch.equal(new.z[0], state.z[0]) and not torch.equal(new.z[1], state.z[1])
    assert float(sampler.step_size[0]) <= BACKOFF * 0.5
    assert float(adapt.largest[0]) == pytest.approx(BACKOFF * 0.5)
    assert math.isinf(float(adapt.largest[1]))


# -- fit_mile ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schools() -> SequenceData:
    return SequenceData(torch.tensor(SIGMA)[:, None], torch.tensor(Y))


@pytest.mark.parametrize(
    ("kernel", "num_warmup", "num_samples"), [("mclmc", 500, 100), ("chees", 60, 40)]
)
def test_mile_recovers_eight_schools(schools, kernel, num_warmup, num_samples):
    """posteriordb's eight schools (non-centred, ``theta_trans`` local): 4 members x 4 chains;
    MCLMC with BlackJAX's small energy error (MILE's 0.1 would carry its bias), or ChEES."""
    post = fit_mile(
        EightSchools(), schools, n_members=4, chains_per_member=4, kernel=kernel,
        tuning=BLACKJAX_TUNING, num_warmup=num_warmup, num_samples=num_samples, thinning=5,
        num_steps=200, lr=0.05, progress=False,
    )  # fmt: skip
    draws = {name: post.samples[name].double().numpy() for name in ("mu", "tau")}
    assert_matches_reference(draws, REFERENCE["eight_schools"])
    assert post.record["superchain"] == [k // 4 for k in range(16)]


@pytest.mark.slow
def test_mile_recovers_ark():
    post = fit_mile(
        AutoRegressive(5), ark_data(), n_members=4, chains_per_member=8, kernel="chees",
        num_warmup=150, num_samples=100, num_steps=300, progress=False,
    )  # fmt: skip
    check_ark(post)


@pytest.fixture(scope="module")
def digits_rows() -> SequenceData:
    from probtransformer.datasets import load

    return load("digits").train[:120]


def tiny_classifier(**options) -> SequenceClassifier:
    return SequenceClassifier(8, 10, 8, **{"d_model": 8, "num_heads": 2, "d_ff": 8, **options})


@pytest.fixture(scope="module")
def ensemble(digits_rows):
    return fit_ensemble(tiny_classifier(), digits_rows, n_members=3, num_steps=40, progress=False)


@pytest.fixture(scope="module")
def mile(digits_rows, ensemble):
    return fit_mile(
        tiny_classifier(), digits_rows, ensemble=ensemble, chains_per_member=2, num_warmup=60,
        num_samples=8, thinning=3, progress=False,
    )  # fmt: skip


def test_each_chain_starts_at_its_member_and_keeps_its_point_estimates(ensemble, mile):
    """Chain k belongs to member k // 2: its plain parameters are that member's, every draw, and
    the record says how the chains were tuned, per member."""
    record = mile.record
    assert record["route"] == "mile" and record["init"] == "ensemble"
    assert record["superchain"] == [0, 0, 1, 1, 2, 2]
    assert record["ensemble_seconds"] == ensemble.record["seconds"] < record["seconds"]
    assert len(record["adapted_step_size"]) == len(record["adapted_L"]) == 3
    assert len(record["energy_error_var_per_dim_by_start"]) == 3
    assert record["tuning"]["desired_energy_var"] == [0.5, 0.1]
    assert record["thinning"] == 3 and record["temperature"] == 1.0
    assert set(record["sample_stats"]["lp"][0]) and len(record["sample_stats"]["lp"]) == 6
    for name, value in mile.members.items():  # (chain, draw, *shape)
        theirs = ensemble.members[name][0]  # (member, *shape)
        assert value.shape[:2] == (6, 8)
        for chain in range(6):
            assert torch.equal(value[chain, 0], theirs[chain // 2])
            assert torch.equal(value[chain, -1], theirs[chain // 2])
    probs = mile.predict(ensemble.example.x).probs
    assert probs.shape[0] == 6 * 8 and torch.allclose(probs.sum(-1), torch.ones(()))


def test_an_ensemble_given_is_not_fitted_again(digits_rows, ensemble, monkeypatch):
    from probtransformer.inference.mcmc import mile as module

    monkeypatch.setattr(module, "fit_ensemble", lambda *a, **k: pytest.fail("fitted again"))
    fit_mile(
        tiny_classifier(), digits_rows, ensemble=ensemble, chains_per_member=1, num_warmup=30,
        num_samples=2, progress=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(kernel="nuts"), ValueError, "kernel must be one of"),
        (dict(chains_per_member=0), ValueError, "chains_per_member must be >= 1"),
        (dict(num_warmup=10), ValueError, "num_warmup >= 30"),
        (dict(thinning=1.5), TypeError, "thinning must be an int"),
        (dict(temperature=0), ValueError, "temperature must be a finite number > 0"),
        (dict(temperature=math.nan), ValueError, "temperature must be a finite number > 0"),
        (dict(tuning="mile"), TypeError, "tuning must be an mclmc.Tuning"),
        (dict(num_steps=5), TypeError, "ensemble is already fitted"),
        (dict(kernel=MCLMC(), temperature=0.5), TypeError, r"\['temperature'\]: with a kernel"),
        (dict(kernel=ChEES(), thinning=3), TypeError, r"\['thinning'\]: with a kernel object"),
    ],
)
def test_bad_settings_are_named(digits_rows, ensemble, change, error, match):
    """Every bad setting is named; with a kernel object, the settings it owns are its own."""
    with pytest.raises(error, match=match):
        fit_mile(tiny_classifier(), digits_rows, ensemble=ensemble, progress=False, **change)


def test_an_ensemble_of_another_model_or_another_fit_is_refused(digits_rows, ensemble):
    with pytest.raises(ValueError, match="ensemble was fitted for another model"):
        fit_mile(tiny_classifier(d_ff=16), digits_rows, ensemble=ensemble, progress=False)
    data = SequenceData(torch.randn(20, 2), torch.randn(20))
    sampled = fit_mcmc(
        BayesianLinearRegression(2), data, kernel=ChEES(), num_chains=2, num_warmup=2,
        num_samples=2, progress=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="must be a fit_ensemble posterior"):
        fit_mile(BayesianLinearRegression(2), data, ensemble=sampled, progress=False)


# -- temperature -------------------------------------------------------------------------------


def test_a_temperature_divides_the_log_likelihood_and_nothing_else():
    model = BayesianLinearRegression(2)
    data = SequenceData(torch.randn(30, 2), torch.randn(30))
    z = torch.randn(3, 3)
    plain = VectorizedDensity(model, data.x, data.y, None)
    cold = VectorizedDensity(model, data.x, data.y, None, temperature=0.25)
    sites = plain.site_log_densities(z)
    lp, _ = plain.log_density(z)
    lp_cold, _ = cold.log_density(z)
    torch.testing.assert_close(lp_cold - lp, 3 * sites["y"], rtol=1e-5, atol=1e-3)


def test_the_temperature_is_recorded_and_shown_in_the_verdict(digits_rows, ensemble):
    post = fit_mile(
        tiny_classifier(), digits_rows, ensemble=ensemble, chains_per_member=1, num_warmup=30,
        num_samples=4, temperature=0.5, progress=False,
    )  # fmt: skip
    assert post.record["temperature"] == 0.5
    verdict = post.diagnose(verbose=False).attrs["verdict"]
    assert any("temperature 0.5" in line and "not the Bayesian one" in line for line in verdict)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temperature'"):
        NUTS(temperature=0.5)


def test_diagnose_judges_each_member_and_reports_the_spread_between_them(digits_rows, mile):
    table = mile.diagnose(digits_rows, verbose=False)
    figures = table.attrs["modes"]
    assert [m["chains"] for m in figures["modes"]] == [2, 2, 2]
    assert 0 <= figures["between"]["mutual_information"] and figures["between"]["rows"] == 120
    verdict = table.attrs["verdict"]
    assert verdict[0].endswith("3 ensemble members):")
    assert any(
        line.startswith("info  3 modes (chains started from 3 ensemble members") for line in verdict
    )
    assert any("within-mode R-hat of lp" in line for line in verdict)
    assert any(line.startswith("info  between modes (first 120 training rows)") for line in verdict)
    assert not any("nested R-hat of lp" in line for line in verdict)
    assert "predictive" not in table.attrs  # nested R-hat across members is not computed


def test_an_mclmc_step_with_an_energy_error_over_1000_nats_is_divergent():
    """Unadjusted, MCLMC keeps every step; one whose energy error passes Stan's 1000-nat
    threshold (or is not finite) is flagged in ``diverging`` for its chain."""
    errors = iter([torch.tensor([0.5, 2e3, 0.1]), torch.tensor([0.5, 1.0, torch.nan])])

    class Scripted(MCLMCSampler):
        def step(self, state, u):
            return state, u, next(errors)

    sampler = Scripted(standard_normal, ChainRNG(0, 3, CPU), thinning=2)
    state = sampler.init(torch.zeros(3, 2))
    sampler.step_size = torch.tensor([1.0], dtype=torch.float64)
    _, stats = sampler.sample(state)
    assert stats["diverging"].tolist() == [False, True, True]
    assert isinstance(state, MCLMCState) and state.u.shape == (3, 2)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(desired_energy_var=0.5), ValueError, "desired_energy_var must be \\(start, end\\)"),
        (dict(desired_energy_var=(1, 2, 3)), ValueError, "desired_energy_var must be"),
        (dict(phases=0.4), ValueError, "phases must be three shares"),
        (dict(phases=("0.5", 0.2, 0.1)), ValueError, "phases must be three shares"),
        (dict(L_factor=-1), ValueError, "L_factor must be a finite number > 0"),
        (dict(trust_in_estimate="0.5"), ValueError, "trust_in_estimate must be a finite"),
        (dict(num_effective_samples=1.5), TypeError, "num_effective_samples must be an int"),
        (dict(diagonal_preconditioning=None), TypeError, "diagonal_preconditioning must be"),
    ],
)
def test_bad_tuning_is_refused_naming_the_setting(change, error, match):
    with pytest.raises(error, match=match):
        Tuning(**change)
