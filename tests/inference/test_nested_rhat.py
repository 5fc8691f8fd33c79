"""Diagnostics of many short chains: nested R-hat (Margossian et al. 2024) through arviz-stats,
the ``superchain`` coordinate of the export and the many-chain verdict of ``diagnose``.

The posteriors are built directly from iid draws of the exact posterior of a Bayesian linear
regression, so "well mixed" is known to be true and "stuck" superchains are made by shifting.
"""

import math
import warnings

import numpy as np
import pytest
import scipy.stats
import torch
from arviz_stats.base import array_stats

from probtransformer.datasets import SequenceData
from probtransformer.inference import Posterior
from probtransformer.inference.diagnostics import summary
from probtransformer.inference.diagnostics._arviz import az, ess, rhat, rhat_nested
from probtransformer.inference.diagnostics.summary import (
    MANY_CHAINS,
    NESTED_RHAT_MAX,
    POOLED_ESS_MIN,
    PROBE_OBS,
    _variable_table,
    has_unit_symmetries,
)
from probtransformer.models import BayesianLinearRegression, SequenceClassifier

NUM_DATA, DRAWS = 40, 100
OLD_COLUMNS = ["size", "mean_sd", "r_hat_max", "ess_bulk_min", "ess_tail_min"]


@pytest.fixture(scope="module")
def data() -> SequenceData:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 2, generator=generator)
    y = x @ torch.tensor([1.0, -2.0]) + 0.5 + torch.randn(NUM_DATA, generator=generator)
    return SequenceData(x, y)


def _posterior(
    data: SequenceData,
    *,
    chains: int,
    starts: int | None,
    shift_sd: float = 0.0,
    lp_rho: float = 0.0,
    seed: int = 0,
) -> Posterior:
    """``chains`` chains of iid exact-posterior draws; superchain ``s`` (``chains // starts``
    consecutive chains) is moved by ``s * shift_sd`` posterior sds, its ``lp`` by ``s * shift_sd``.
    ``starts=None`` writes a NUTS-like record without ``superchain``. ``lp`` is an AR(1) of
    coefficient ``lp_rho`` within each chain (0: iid)."""
    model = BayesianLinearRegression(2)
    exact = model.analytic_posterior(data.x, data.y)
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(chains, DRAWS, 3, generator=generator, dtype=torch.float64)
    superchain = [c * (starts or chains) // chains for c in range(chains)]
    offset = shift_sd * torch.tensor(superchain, dtype=torch.float64)[:, None, None]
    scale = exact.covariance_matrix.diagonal().sqrt()
    draws = exact.mean + (noise @ exact.scale_tril.T) + offset * scale  # (chain, draw, 3)
    rng = np.random.default_rng(seed)
    innovations = rng.normal(size=(chains, DRAWS))
    lp = np.empty((chains, DRAWS))
    lp[:, 0] = innovations[:, 0]
    for t in range(1, DRAWS):
        lp[:, t] = lp_rho * lp[:, t - 1] + math.sqrt(1 - lp_rho**2) * innovations[:, t]
    lp += shift_sd * np.asarray(superchain)[:, None]
    stats = dict(
        diverging=np.zeros((chains, DRAWS), bool).tolist(),
        acceptance_rate=np.full((chains, DRAWS), 0.8).tolist(),
        step_size=np.full((chains, DRAWS), 0.1).tolist(),
        n_steps=np.full((chains, DRAWS), 7).tolist(),
        energy=rng.normal(size=(chains, DRAWS)).tolist(),  # iid: E-BFMI about 2
        lp=lp.tolist(),
    )
    record = dict(method="mcmc", kernel="chees", num_chains=chains, sample_stats=stats)
    if starts is None:
        record["kernel"] = "nuts"
    else:
        record.update(num_starts=starts, superchain=superchain)
    samples = {"weight": draws[..., :2].float(), "bias": draws[..., 2].float()}
    return Posterior(model, samples=samples, record=record, example=data[:2])


# -- nested R-hat ---------------------------------------------------------------------------


def _nested_rhat_by_hand(chains: np.ndarray, superchain: np.ndarray) -> float:
    """Margossian et al. 2024, eqs. 4-8, on rank-normalised split chains (bulk and folded,
    the larger), written out independently of arviz-stats for one ``(chain, draw)`` array."""

    def z_scale(a):
        ranks = scipy.stats.rankdata(a, method="average").reshape(a.shape)
        return scipy.stats.norm.ppf((ranks - 3 / 8) / (a.size + 1 / 4))

    def nested(a, labels):
        means, variances = a.mean(1), a.var(1, ddof=1)
        groups = [labels == k for k in np.unique(labels)]
        super_means = np.array([means[g].mean() for g in groups])
        between_within = np.array([means[g].var(ddof=1) for g in groups])  # B_k
        within = np.array([variances[g].mean() for g in groups])  # W_k
        return math.sqrt(1 + super_means.var(ddof=1) / np.mean(between_within + within))

    half = chains.shape[1] // 2
    split = np.concatenate([chains[:, :half], chains[:, -half:]])  # (2 chain, half)
    labels = np.concatenate([superchain, superchain])
    folded = np.abs(split - np.median(split))
    return max(nested(z_scale(split), labels), nested(z_scale(folded), labels))


def test_nested_rhat_matches_arviz_stats_and_the_paper():
    rng = np.random.default_rng(1)
    labels = np.array([7, 7, 7, 2, 2, 2])  # any ints; equal sizes
    values = rng.normal(size=(6, 41, 3)) + np.array([0.0, 0.3, 1.0]) * (labels == 2)[:, None, None]
    got = rhat_nested(values, labels)  # (3,)
    assert got.shape == (3,)
    ids = np.array([1, 1, 1, 0, 0, 0])
    for i in range(3):
        own = array_stats.rhat_nested(values[:, :, i], ids)
        assert got[i] == pytest.approx(float(own), rel=1e-12)
        assert got[i] == pytest.approx(_nested_rhat_by_hand(values[:, :, i], labels), rel=1e-10)
    assert got[0] < got[1] < got[2]  # a larger gap between the superchains, a larger R-hat
    assert got[2] > 1.1


@pytest.mark.parametrize(
    "labels, message",
    [
        ([0, 0, 0, 1, 1, 2], "superchain sizes \\[3, 2, 1\\]"),
        ([0] * 6, "2 or more"),
        ([0, 1], "shape"),
    ],
)
def test_nested_rhat_rejects_bad_superchains(labels, message):
    with pytest.raises(ValueError, match=message):
        rhat_nested(np.zeros((6, 10)), np.array(labels))


def test_variable_table_equals_arviz_0x():
    """The arviz-stats table means what the ArviZ 0.x per-site one did."""
    rng = np.random.default_rng(2)
    values = {"w": rng.normal(size=(3, 30, 4, 2)), "b": rng.normal(size=(3, 30)).cumsum(1)}
    values["w"][..., 0, 0] = 1.0  # constant: NaN R-hat, ignored by the max
    dataset = az.from_dict(posterior=values).posterior
    table = _variable_table(dataset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = dict(
            r_hat_max=az.rhat(dataset), ess_bulk_min=az.ess(dataset, method="bulk"),
            ess_tail_min=az.ess(dataset, method="tail"),
        )  # fmt: skip
    assert list(table.columns) == OLD_COLUMNS
    for name in values:
        assert table.loc[name, "r_hat_max"] == pytest.approx(
            float(expected["r_hat_max"][name].max())
        )
        for column in ("ess_bulk_min", "ess_tail_min"):
            assert table.loc[name, column] == pytest.approx(float(expected[column][name].min()))
    assert table.loc["w", "size"] == 8 and table.loc["b", "r_hat_max"] > 1.1  # random walks


def test_ess_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="'bulk' or 'tail', got 'mean'"):
        ess(np.zeros((2, 10)), "mean")


# -- export ---------------------------------------------------------------------------------


def test_superchain_coordinate_in_the_export(data):
    post = _posterior(data, chains=8, starts=2)
    idata = post.to_inference_data(data, attention_obs=0)
    for group in ("posterior", "sample_stats", "log_likelihood", "posterior_predictive"):
        coord = idata[group].coords["superchain"]
        assert coord.dims == ("chain",), group
        assert coord.values.tolist() == [0, 0, 0, 0, 1, 1, 1, 1], group
    assert "superchain" not in idata.posterior.dims  # a coordinate along chain, not a dim
    nuts = _posterior(data, chains=2, starts=None).to_inference_data(data, attention_obs=0)
    assert "superchain" not in nuts.posterior.coords


def test_export_rejects_a_superchain_list_of_the_wrong_length(data):
    post = _posterior(data, chains=8, starts=2)
    post.record["superchain"] = [0, 1]
    with pytest.raises(ValueError, match="each of the 8 chains, got 2 entries"):
        post.to_inference_data(data, attention_obs=0)


# -- diagnose -------------------------------------------------------------------------------


def test_well_mixed_many_chains_pass(data):
    post = _posterior(data, chains=16, starts=4)
    table = post.diagnose(data, verbose=False)
    verdict = table.attrs["verdict"]
    assert verdict[0] == f"verdict (mcmc, 16 chain(s) x {DRAWS} draws, 4 superchains):"
    assert not [line for line in verdict if line.startswith("WARN")], verdict
    assert (table["nested_r_hat_max"] < NESTED_RHAT_MAX).all()
    predictive = table.attrs["predictive"]
    assert predictive["probe_log_lik"]["rows"] == PROBE_OBS
    for figures in predictive.values():
        assert 1 <= figures["nested_r_hat"] < NESTED_RHAT_MAX
        assert figures["r_hat"] < NESTED_RHAT_MAX
        assert figures["ess_bulk"] > 1000  # 1,600 iid draws
    # a linear regression has no head or unit symmetries: its weight-space nested R-hat is checked
    assert any(
        line.startswith("ok    max R-hat") and "4 superchains of 4 chain(s)" in line
        for line in verdict
    )
    assert any(line.startswith("ok    E-BFMI min") and "over 16 chains" in line for line in verdict)


def test_weight_space_is_information_only_for_models_with_unit_symmetries(data, monkeypatch):
    assert has_unit_symmetries(SequenceClassifier(8, 10, 8, d_model=8, num_heads=2))
    assert not has_unit_symmetries(BayesianLinearRegression(2))
    monkeypatch.setattr(summary, "has_unit_symmetries", lambda model: True)
    post = _posterior(data, chains=16, starts=4, shift_sd=1.0)
    verdict = post.diagnose(data, verbose=False).attrs["verdict"]
    assert any(
        line.startswith("info  weight-space R-hat and ESS are information only") for line in verdict
    )
    assert any(line.startswith("info  max R-hat") for line in verdict)
    assert not any(line.startswith("WARN  max R-hat") for line in verdict)


def test_superchains_at_different_means_are_flagged(data):
    post = _posterior(data, chains=16, starts=4, shift_sd=1.0)
    table = post.diagnose(data, verbose=False)
    verdict = table.attrs["verdict"]
    predictive = table.attrs["predictive"]
    assert predictive["lp"]["nested_r_hat"] > 1.1
    assert predictive["probe_log_lik"]["nested_r_hat"] > 1.1
    assert table["r_hat_max"].max() > 1.1 and table["nested_r_hat_max"].min() > 1.1
    assert any(line.startswith("WARN  nested R-hat of lp ") for line in verdict)
    assert any(
        line.startswith(f"WARN  max nested R-hat of the log-likelihoods of the first {PROBE_OBS}")
        for line in verdict
    )
    assert any(line.startswith("WARN  max R-hat") for line in verdict)  # no symmetries here


def test_a_slowly_mixing_lp_is_flagged_by_pooled_ess(data):
    """lp an AR(1) of coefficient 0.98 per chain: ESS about 16 x 100 / 99 = 16 draws."""
    table = _posterior(data, chains=16, starts=4, lp_rho=0.98).diagnose(verbose=False)
    assert table.attrs["predictive"]["lp"]["ess_bulk"] < POOLED_ESS_MIN
    assert "probe_log_lik" not in table.attrs["predictive"]  # no data, no probe
    verdict = table.attrs["verdict"]
    assert any(line.startswith("WARN  pooled bulk ESS of lp ") for line in verdict)
    assert "n/a   the probe log-likelihoods: pass data to check the log-likelihoods" in verdict


def test_many_nuts_chains_are_their_own_superchains(data):
    table = _posterior(data, chains=MANY_CHAINS, starts=None).diagnose(verbose=False)
    assert "nested_r_hat_max" in table.columns
    assert set(table.attrs["predictive"]) == {"lp"}
    assert any("8 superchains of 1 chain(s)" in line for line in table.attrs["verdict"])


def test_many_chains_from_one_start_are_their_own_superchains(data):
    """``init="map"`` (or ``num_starts=1``): one superchain, in which nested R-hat says
    nothing; the verdict reads each chain as its own superchain, as for NUTS's chains."""
    table = _posterior(data, chains=MANY_CHAINS, starts=1).diagnose(data, verbose=False)
    assert "nested_r_hat_max" in table.columns
    assert set(table.attrs["predictive"]) == {"lp", "probe_log_lik"}
    assert any("8 superchains of 1 chain(s)" in line for line in table.attrs["verdict"])


def test_fewer_than_many_chains_keep_the_plain_verdict(data):
    post = _posterior(data, chains=4, starts=None)
    table = post.diagnose(data, verbose=False)
    assert list(table.columns) == OLD_COLUMNS and "predictive" not in table.attrs
    verdict = table.attrs["verdict"]
    assert verdict[0] == f"verdict (mcmc, 4 chain(s) x {DRAWS} draws):"
    texts = [
        "max R-hat ", "min bulk ESS ", "min tail ESS ", "divergent transitions: 0 of 400",
        "E-BFMI per chain ", "temperature 1: the Bayesian posterior", "LOO: elpd_loo ",
    ]  # fmt: skip
    assert len(verdict) == 1 + len(texts)
    for line, text in zip(verdict[1:], texts, strict=True):
        assert line[:6] in ("ok    ", "WARN  ", "info  "), line
        assert line[6:].startswith(text), (line, text)
    assert [line[6:] for line in verdict if line.startswith("info")] == [texts[-2]]
    # an explicit superchain record below MANY_CHAINS: the nested column, the same verdict
    few = _posterior(data, chains=4, starts=2).diagnose(data, verbose=False)
    assert list(few.columns) == [*OLD_COLUMNS, "nested_r_hat_max"]
    assert set(few.attrs["predictive"]) == {"lp", "probe_log_lik"}
    # the same draws: the same lines, plus ChEES's stuck-chain check
    assert [line for line in few.attrs["verdict"] if "stuck chains" not in line] == verdict


def test_rhat_of_one_chain_is_nan_and_ess_is_pooled():
    rng = np.random.default_rng(3)
    assert np.isnan(rhat(rng.normal(size=(1, 50))))
    assert float(ess(rng.normal(size=(4, 250)), "bulk")) == pytest.approx(1000, rel=0.2)


def test_a_loo_that_is_not_finite_is_flagged(data, monkeypatch):
    """A badly tuned run gave elpd_loo NaN with NaN Pareto k's, which the verdict called ok."""
    nan_loo = type("Loo", (), dict(elpd_loo=np.nan, se=np.nan, p_loo=np.nan))()
    nan_loo.pareto_k = np.full(len(data), np.nan)
    monkeypatch.setattr(summary.az, "loo", lambda idata, pointwise: nan_loo)
    table = _posterior(data, chains=4, starts=None).diagnose(data, verbose=False)
    (line,) = [line for line in table.attrs["verdict"] if "LOO" in line]
    assert line.startswith("WARN  LOO: elpd_loo nan") and "unreliable" in line
    assert f"Pareto k > 0.7: {len(data)} of {len(data)}" in line
