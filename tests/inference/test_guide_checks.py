"""The SVI verdict lines: an ELBO trend against its noise, a guide collapsed to a point."""

import math

import numpy as np
import pytest

from probtransformer.inference import fit_svi
from probtransformer.inference.diagnostics.guide_checks import (
    SCALE_RATIO_MIN,
    elbo_change_per_obs,
    elbo_line,
    elbo_noise_per_obs,
    guide_scale_ratio,
)
from probtransformer.inference.diagnostics.summary import _flag, diagnose
from probtransformer.models import SequenceClassifier

N = 1000  # observations the traces below are scaled to


def _trace(slope_per_obs: float, noise_per_obs: float, steps: int = 3000, seed: int = 0):
    """An ELBO trace ``(steps,)`` in nats: a line plus Gaussian Monte Carlo noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    return list(N * (-5.0 + slope_per_obs * t + noise_per_obs * rng.standard_normal(steps)))


def test_noise_is_the_standard_error_of_the_move():
    """Over many flat noisy traces the move's sd matches the estimated standard error."""
    moves = [elbo_change_per_obs(_trace(0.0, 0.5, seed=s), N) for s in range(200)]
    noise = elbo_noise_per_obs(_trace(0.0, 0.5), N)
    assert noise == pytest.approx(0.5 * math.sqrt(2 / 300), rel=0.1)
    # |N(0, se)| has mean se * sqrt(2 / pi)
    assert np.mean(moves) == pytest.approx(noise * math.sqrt(2 / math.pi), rel=0.15)


def test_a_flat_but_noisy_elbo_is_not_flagged():
    """Pure noise moved 0.02-0.07 nats/obs between tenths: the old check (> 0.01) flagged it."""
    elbo = _trace(0.0, 0.5, seed=1)
    assert elbo_change_per_obs(elbo, N) > 0.01  # what used to be a WARN
    assert elbo_line(elbo, N, _flag).startswith("ok ")


def test_a_rising_elbo_is_flagged_even_under_noise():
    """The main job's trace (issue 44): 3 nats/obs per tenth against noise of 0.009."""
    elbo = _trace(0.01, 0.5, seed=2)  # 3 nats/obs per tenth of 3,000 steps
    line = elbo_line(elbo, N, _flag)
    assert line.startswith("WARN") and "moved 3.01 nats" in line
    assert elbo_line(_trace(0.0, 0.0001), N, _flag).startswith("ok ")


def _fit(rows, **init_scale):
    """100 steps of a d_model-8 classifier; ``init_scale`` as given, else the default."""
    model = SequenceClassifier(8, 10, 8, d_model=8, num_heads=2, num_layers=1, d_ff=16)
    return fit_svi(model, rows, num_steps=100, batch_size=64, seed=0, progress=False, **init_scale)


def test_a_collapsed_guide_is_flagged(digits, capsys):
    """100 steps from init_scale 1e-3 leave every scale near 1e-3 (Adam moves a log-scale by
    about lr per step): a point, where the prior's sd is about 1; the verdict says so."""
    collapsed = _fit(digits.train[:128], init_scale=1e-3)
    assert guide_scale_ratio(collapsed) < 0.01
    verdict = diagnose(collapsed, num_samples=20).attrs["verdict"]
    assert any(line.startswith("WARN  guide sd / prior sd") for line in verdict)
    assert "init_scale 0.001" in capsys.readouterr().out


def test_a_guide_with_spread_is_not_flagged(digits):
    collapsed = _fit(digits.train[:128], init_scale=0.1)
    assert guide_scale_ratio(collapsed) > 2 * SCALE_RATIO_MIN
    verdict = diagnose(collapsed, num_samples=20, verbose=False).attrs["verdict"]
    assert any(line.startswith("ok    guide sd / prior sd") for line in verdict)
