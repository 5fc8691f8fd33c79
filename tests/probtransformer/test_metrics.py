import math

import numpy as np
import pytest
import torch

from probtransformer.metrics import (
    accuracy,
    brier,
    classification_report,
    coverage_band,
    crps_samples,
    ece,
    interval_coverage,
    nll,
    ood_auroc,
    reliability_curve,
    risk_coverage,
)

# Hand-computed ECE example, 2 equal-width bins (0, 0.5] and (0.5, 1]:
#   bin 0: confidences 0.4, 0.4, one correct -> |0.5 - 0.4| = 0.1, weight 1/2
#   bin 1: confidences 0.9 (correct), 0.7 (wrong) -> |0.5 - 0.8| = 0.3, weight 1/2
#   ECE = 0.05 + 0.15 = 0.2
TWO_BIN_PROBS = np.array(
    [
        [0.4, 0.2, 0.2, 0.2],
        [0.4, 0.2, 0.2, 0.2],
        [0.9, 0.1, 0.0, 0.0],
        [0.7, 0.1, 0.1, 0.1],
    ]
)
TWO_BIN_Y = np.array([0, 1, 0, 2])


@pytest.mark.parametrize("num_classes", [2, 5, 10])
def test_perfect_predictions(num_classes):
    y = np.arange(40) % num_classes
    probs = np.eye(num_classes)[y]
    assert accuracy(probs, y) == 1.0
    assert nll(probs, y) == pytest.approx(0.0, abs=1e-12)
    assert brier(probs, y) == 0.0
    assert ece(probs, y) == 0.0
    assert ece(probs, y, strategy="quantile") == 0.0


@pytest.mark.parametrize("num_classes", [2, 5, 10])
def test_uniform_predictions(num_classes):
    y = np.arange(30) % num_classes
    probs = np.full((30, num_classes), 1.0 / num_classes)
    assert nll(probs, y) == pytest.approx(math.log(num_classes))
    assert brier(probs, y) == pytest.approx(1.0 - 1.0 / num_classes)
    assert accuracy(probs, y) == pytest.approx(np.mean(y == 0))  # ties -> class 0


def test_nll_and_brier_known_values():
    probs = np.array([[0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    y = np.array([0, 0, 1])
    assert nll(probs, y) == pytest.approx(-(math.log(0.8) + math.log(0.3) + math.log(0.4)) / 3)
    expected_brier = (2 * 0.2**2 + 2 * 0.7**2 + 2 * 0.6**2) / 3
    assert brier(probs, y) == pytest.approx(expected_brier)
    assert accuracy(probs, y) == pytest.approx(1 / 3)
    confident_miss = np.array([[1.0, 0.0]])
    assert nll(confident_miss, np.array([1])) == pytest.approx(-math.log(1e-12))


def test_ece_hand_computed_two_bins():
    assert ece(TWO_BIN_PROBS, TWO_BIN_Y, n_bins=2) == pytest.approx(0.2)
    assert ece(torch.tensor(TWO_BIN_PROBS), torch.tensor(TWO_BIN_Y), n_bins=2) == pytest.approx(0.2)


def test_ece_quantile_bins_differ_from_uniform():
    # confidences 0.6 (right), 0.7 (wrong), 0.8 (right), 0.9 (right)
    top = np.array([0.6, 0.7, 0.8, 0.9])
    probs = np.stack([top, 1 - top], axis=1)
    y = np.array([0, 1, 0, 0])
    # one uniform bin (0.5, 1]: accuracy 0.75 = mean confidence 0.75
    assert ece(probs, y, n_bins=2) == pytest.approx(0.0)
    # two equal-mass bins: |0.5 - 0.65| and |1 - 0.85|, each weight 1/2
    assert ece(probs, y, n_bins=2, strategy="quantile") == pytest.approx(0.15)


def test_reliability_curve_matches_ece():
    curve = reliability_curve(TWO_BIN_PROBS, TWO_BIN_Y, n_bins=4)
    np.testing.assert_allclose(curve["edges"], [0, 0.25, 0.5, 0.75, 1])
    np.testing.assert_array_equal(curve["count"], [0, 2, 1, 1])
    np.testing.assert_allclose(curve["confidence"], [np.nan, 0.4, 0.7, 0.9])
    np.testing.assert_allclose(curve["accuracy"], [np.nan, 0.5, 0.0, 1.0])

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(10, 0.5), size=500)
    y = rng.integers(0, 10, size=500)
    curve = reliability_curve(probs, y)
    full = curve["count"] > 0
    from_curve = np.sum(
        curve["count"][full] / 500 * np.abs(curve["accuracy"][full] - curve["confidence"][full])
    )
    assert ece(probs, y) == pytest.approx(from_curve)
    assert curve["count"].sum() == 500


def test_classification_report_keys_and_values():
    report = classification_report(TWO_BIN_PROBS, TWO_BIN_Y)
    assert set(report) == {"accuracy", "nll", "ece", "brier"}
    assert all(isinstance(v, float) for v in report.values())
    assert report["accuracy"] == pytest.approx(0.5)
    assert report["nll"] == nll(TWO_BIN_PROBS, TWO_BIN_Y)


def test_ood_auroc():
    assert ood_auroc(np.array([0.1, 0.2, 0.3]), np.array([0.5, 0.9])) == 1.0
    assert ood_auroc(torch.tensor([0.5, 0.9]), torch.tensor([0.1, 0.2])) == 0.0
    assert ood_auroc(np.ones(10), np.ones(7)) == 0.5
    rng = np.random.default_rng(0)
    assert ood_auroc(rng.normal(size=2000), rng.normal(size=2000)) == pytest.approx(0.5, abs=0.03)


def test_risk_coverage_known_sequence():
    uncertainty = np.array([0.1, 0.4, 0.2, 0.3])
    correct = np.array([True, False, True, False])
    coverage, risk, aurc = risk_coverage(uncertainty, correct)
    np.testing.assert_allclose(coverage, [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(risk, [0.0, 0.0, 1 / 3, 0.5])
    assert aurc == pytest.approx((1 / 3 + 1 / 2) / 4)
    # an uncertainty that ranks errors first gives the worst curve
    _, worst, worst_aurc = risk_coverage(-uncertainty, correct)
    np.testing.assert_allclose(worst, [1.0, 1.0, 2 / 3, 0.5])
    assert worst_aurc > aurc


def test_interval_coverage():
    lower = np.zeros(4)
    upper = np.ones(4)
    y = np.array([0.5, 1.0, 1.5, -0.1])
    assert interval_coverage(lower, upper, y) == 0.5  # bounds are inclusive
    assert interval_coverage(torch.zeros(2, 3), torch.ones(2, 3), torch.full((2, 3), 0.5)) == 1.0


def test_crps_point_mass_is_absolute_error():
    x = np.array([0.0, 2.0, -1.0])
    y = np.array([1.5, 2.0, 3.0])
    samples = np.tile(x, (50, 1))  # (S, N)
    assert crps_samples(samples, y) == pytest.approx(np.mean(np.abs(x - y)))


def test_crps_matches_pairwise_definition():
    rng = np.random.default_rng(1)
    samples = rng.normal(size=(7, 5))
    y = rng.normal(size=5)
    pairwise = np.abs(samples[:, None, :] - samples[None, :, :]).mean(axis=(0, 1))
    expected = np.mean(np.abs(samples - y).mean(axis=0) - 0.5 * pairwise)
    assert crps_samples(torch.tensor(samples), torch.tensor(y)) == pytest.approx(expected)


def test_crps_normal_sample_matches_closed_form():
    mu, sigma, s = 0.5, 2.0, 20_000
    y = np.array([-3.0, 0.0, 0.5, 2.0, 6.0])
    rng = np.random.default_rng(0)
    samples = rng.normal(mu, sigma, size=(s, len(y)))
    z = (y - mu) / sigma
    pdf = np.exp(-(z**2) / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
    closed = sigma * (z * (2 * cdf - 1) + 2 * pdf - 1 / math.sqrt(math.pi))
    for j in range(len(y)):
        estimate = crps_samples(samples[:, j : j + 1], y[j : j + 1])
        assert estimate == pytest.approx(closed[j], rel=0.02)


BAD_CLASSIFICATION_INPUTS = [
    (np.full(4, 0.25), np.zeros(4, dtype=int), ValueError, r"probs must have shape \(N, C\)"),
    (np.zeros((0, 3)), np.zeros(0, dtype=int), ValueError, "N > 0"),
    (np.full((2, 3), 0.3), np.zeros(2, dtype=int), ValueError, "rows must sum to 1"),
    (np.array([[1.2, -0.2]]), np.zeros(1, dtype=int), ValueError, r"probs must lie in \[0, 1\]"),
    (np.array([[np.nan, 1.0]]), np.zeros(1, dtype=int), ValueError, "probs must be finite"),
    (np.full((2, 2), 0.5), np.zeros(2), TypeError, "y must hold integer"),
    (np.full((2, 2), 0.5), np.array([0, 2]), ValueError, r"y must lie in \[0, C\)=\[0, 2\)"),
    (np.full((2, 2), 0.5), np.array([0, 1, 1]), ValueError, r"y must have shape \(N,\)=\(2,\)"),
    ([[0.5, 0.5]], np.zeros(1, dtype=int), TypeError, "probs must be a torch.Tensor"),
]


@pytest.mark.parametrize("metric", [accuracy, nll, brier, ece, classification_report])
@pytest.mark.parametrize("probs, y, error, match", BAD_CLASSIFICATION_INPUTS)
def test_classification_metrics_reject_bad_inputs(metric, probs, y, error, match):
    with pytest.raises(error, match=match):
        metric(probs, y)


def test_other_metrics_reject_bad_inputs():
    probs, y = np.full((2, 2), 0.5), np.array([0, 1])
    with pytest.raises(ValueError, match="n_bins must be >= 1"):
        ece(probs, y, n_bins=0)
    with pytest.raises(TypeError, match="n_bins must be an int"):
        reliability_curve(probs, y, n_bins=2.0)
    with pytest.raises(ValueError, match="strategy"):
        ece(probs, y, strategy="equal")
    with pytest.raises(ValueError, match="score_out must have shape"):
        ood_auroc(np.ones(3), np.ones(0))
    with pytest.raises(TypeError, match="correct must be a bool"):
        risk_coverage(np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match=r"correct must have shape \(N,\)=\(3,\)"):
        risk_coverage(np.ones(3), np.ones(2, dtype=bool))
    with pytest.raises(ValueError, match="lower must be <= upper"):
        interval_coverage(np.ones(2), np.zeros(2), np.ones(2))
    with pytest.raises(ValueError, match="same shape"):
        interval_coverage(np.zeros(2), np.ones(3), np.ones(2))
    with pytest.raises(ValueError, match=r"samples must have shape \(S, \*y.shape\)"):
        crps_samples(np.zeros((10, 3)), np.zeros(4))
    with pytest.raises(ValueError, match="samples must be finite"):
        crps_samples(np.full((10, 3), np.inf), np.zeros(3))


def test_coverage_band_is_the_issue_band_or_the_binomial_error_whichever_is_wider():
    # 90%, many points: the 0.8-0.97 band; 95 points: 3 sd = 0.092 widens the top to 0.992
    assert coverage_band(0.9, 10_000) == pytest.approx((0.8, 0.97))
    low, high = coverage_band(0.9, 95)
    assert low == pytest.approx(0.8) and high == pytest.approx(0.9 + 3 * (0.09 / 95) ** 0.5)
    assert coverage_band(0.9, 4) == pytest.approx((0.45, 1.0))  # 3 sd = 0.45, capped
    with pytest.raises(ValueError, match=r"prob must be in \(0, 1\), got 1.5"):
        coverage_band(1.5, 10)
    with pytest.raises(TypeError, match="n must be an int"):
        coverage_band(0.9, 10.0)
