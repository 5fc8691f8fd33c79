"""Per-mode diagnostics (``inference.diagnostics.modes``): chains from different ensemble members
judged one
member at a time, with the spread between members reported apart. Known answers: modes that
converged apart (nested R-hat far above 1, each mode at R-hat 1), a mode whose chains disagree,
a single chain that drifts, members whose predictions are known."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference.diagnostics import modes
from probtransformer.inference.diagnostics._arviz import az, rhat_nested
from probtransformer.inference.diagnostics.summary import _flag
from probtransformer.inference.posterior.results import Prediction

DRAWS = 2000


def _idata(lp: np.ndarray, log_lik: np.ndarray) -> az.InferenceData:
    return az.from_dict(
        posterior={"w": lp[..., None]},
        sample_stats={"lp": lp},
        log_likelihood={"y": log_lik},
    )


def _modes(offsets, chains_per_mode: int, seed: int = 0, drift: float = 0.0):
    """White-noise lp around a different level per mode; log-likelihoods of 3 rows likewise."""
    rng = np.random.default_rng(seed)
    superchain = np.repeat(np.arange(len(offsets)), chains_per_mode)
    level = np.asarray(offsets, dtype=float)[superchain][:, None]
    trend = drift * np.linspace(0, 1, DRAWS)
    lp = level + rng.normal(size=(len(superchain), DRAWS)) + trend
    log_lik = level[..., None] / 100 + rng.normal(size=(len(superchain), DRAWS, 3))
    return _idata(lp, log_lik), superchain


def test_modes_that_converged_apart_pass_where_nested_r_hat_fails():
    idata, superchain = _modes([-100.0, -200.0, -150.0], chains_per_mode=2)
    lp = idata.sample_stats["lp"].values
    assert float(rhat_nested(lp, superchain)) > 2  # asks the members to mix: they do not
    figures = modes.within_modes(idata, superchain, "y")
    assert [m["chains"] for m in figures["modes"]] == [2, 2, 2]
    assert figures["lp"]["r_hat"] < 1.01 and figures["lp"]["ess_bulk"] > 1500
    assert figures["probe_log_lik"]["rows"] == 3
    lines = modes.verdict_lines(figures, None, _flag)
    assert lines[-1] == (
        "ok    each mode converged; modes not mixed, treated as an equally weighted mixture"
    )
    assert not any(line.startswith("WARN") for line in lines)


def test_a_mode_whose_chains_disagree_is_named():
    idata, superchain = _modes([-100.0, -200.0], chains_per_mode=2)
    lp = idata.sample_stats["lp"].values.copy()
    lp[3] += 5.0  # mode 1's second chain sits elsewhere
    idata = _idata(lp, idata.log_likelihood["y"].values)
    figures = modes.within_modes(idata, superchain, "y")
    assert figures["modes"][0]["lp"]["r_hat"] < 1.01 < figures["modes"][1]["lp"]["r_hat"]
    lines = modes.verdict_lines(figures, None, _flag)
    assert any(
        line.startswith("WARN  within-mode R-hat of lp") and "modes [1]" in line for line in lines
    )
    assert lines[-1].startswith("WARN  not every mode converged")


def test_one_chain_per_mode_is_judged_by_its_split_halves():
    steady, superchain = _modes([-100.0, -200.0], chains_per_mode=1)
    assert modes.within_modes(steady, superchain, "y")["lp"]["r_hat"] < 1.01
    drifting, _ = _modes([-100.0, -200.0], chains_per_mode=1, drift=10.0)
    assert modes.within_modes(drifting, superchain, "y")["lp"]["r_hat"] > 1.1


def test_few_draws_or_no_data_are_said_not_judged():
    idata, superchain = _modes([-100.0, -200.0], chains_per_mode=2)
    no_data = az.from_dict(
        posterior={"w": idata.posterior["w"].values},
        sample_stats={"lp": idata.sample_stats["lp"].values},
    )
    lines = modes.verdict_lines(modes.within_modes(no_data, superchain, "y"), None, _flag)
    assert any("pass data to check them" in line for line in lines)
    assert lines[-1].startswith("WARN  not every mode converged")


class Members:
    """Two members of a 3-class classifier with known predictions: member 0 says class 0 with
    0.9, member 1 class 1 with 0.9, on every row; each has 2 chains of 5 draws."""

    superchain = np.array([0, 0, 1, 1])

    def predict(self, x, mask=None, *, num_samples=None, seed=0):
        n = len(x)
        one = torch.tensor([[0.9, 0.05, 0.05]]).expand(n, 3)
        two = torch.tensor([[0.05, 0.9, 0.05]]).expand(n, 3)
        per_chain = torch.stack([one, one, two, two])  # (chain, n, C)
        return Prediction(per_chain[:, None].expand(4, 5, n, 3).reshape(20, n, 3))


def test_the_spread_between_members_is_their_mutual_information_with_the_label():
    rows = SequenceData(torch.zeros(7, 2, 1), torch.zeros(7, dtype=torch.long))
    spread = modes.between_modes(Members(), rows, Members.superchain)
    mixture = np.array([0.475, 0.475, 0.05])
    member = np.array([0.9, 0.05, 0.05])
    expected = -(mixture * np.log(mixture)).sum() + (member * np.log(member)).sum()
    assert spread["rows"] == 7
    assert spread["mutual_information"] == pytest.approx(expected, rel=1e-6)
    assert spread["disagreement"] == 1.0  # the mixture's argmax (class 0) is not member 1's
    line = modes.verdict_lines(
        {"modes": [{"mode": 0, "chains": 2}, {"mode": 1, "chains": 2}]}, spread, _flag
    )
    assert any(f"{expected:.3g} nats" in text and "100.0% of rows" in text for text in line)


def test_only_ensemble_starts_are_judged_by_mode():
    assert modes.by_mode({"method": "mcmc", "init": "ensemble"})
    assert not modes.by_mode({"method": "mcmc", "init": "prior"})
    assert not modes.by_mode({"method": "ensemble"})
    assert math.isnan(modes._nan_max([math.nan]))
