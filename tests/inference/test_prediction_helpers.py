"""Selective prediction helpers: ``Prediction.reject``, ``RegressionPrediction.reject`` and
``metrics.aurc``, on hand-built predictions with known uncertainties."""

import math

import numpy as np
import pytest
import torch

from probtransformer import metrics
from probtransformer.inference import Prediction, RegressionPrediction

LOG2 = math.log(2)


def _h(*p: float) -> float:
    """Entropy in nats."""
    return -sum(q * math.log(q) for q in p if q > 0)


def _one_draw(rows) -> Prediction:
    return Prediction(probs=torch.tensor([rows], dtype=torch.float64))  # (1, N, C)


@pytest.fixture
def four() -> Prediction:
    """Entropies log 2, 0, H(0.9), H(0.7): lowest-entropy order is rows 1, 2, 3, 0."""
    return _one_draw([[0.5, 0.5], [1.0, 0.0], [0.9, 0.1], [0.7, 0.3]])


def test_entropies_of_the_fixture(four):
    expected = [LOG2, 0.0, _h(0.9, 0.1), _h(0.7, 0.3)]
    torch.testing.assert_close(four.entropy, torch.tensor(expected, dtype=torch.float64))


def test_coverage_keeps_the_lower_entropy_part(four):
    keep = four.reject(coverage=0.5)
    assert keep.dtype == torch.bool and keep.shape == (4,)
    assert keep.tolist() == [False, True, True, False]
    assert four.reject(coverage=0.75).tolist() == [False, True, True, True]
    assert four.reject(coverage=1.0).tolist() == [True] * 4


def test_threshold_keeps_scores_at_or_below_it(four):
    assert four.reject(threshold=0).tolist() == [False, True, False, False]
    assert four.reject(threshold=_h(0.9, 0.1)).tolist() == [False, True, True, False]
    assert four.reject(threshold=0.65).tolist() == [False, True, True, True]  # H(0.7) = 0.611
    assert four.reject(threshold=LOG2 + 1e-9).all()
    assert four.reject(threshold=np.float64(0.5)).sum() == 2  # numpy scalars are numbers too


@pytest.mark.parametrize(
    "coverage, n, kept",
    [(0.3, 10, 3), (0.25, 10, 3), (0.5, 5, 3), (0.01, 4, 1), (1e-9, 1000, 1), (0.7, 10, 7)],
)
def test_coverage_keeps_ceil_of_coverage_times_n(coverage, n, kept):
    pred = _one_draw([[0.5, 0.5]] * n)
    assert int(pred.reject(coverage=coverage).sum()) == kept


def test_ties_are_broken_by_input_order():
    pred = _one_draw([[0.8, 0.2]] * 4)
    assert pred.reject(coverage=0.5).tolist() == [True, True, False, False]


def test_epistemic_and_aleatoric_scores_rank_differently():
    # row 0: two draws that disagree (epistemic log 2, aleatoric 0);
    # row 1: two draws that agree on 50/50 (epistemic 0, aleatoric log 2). Both have entropy log 2.
    probs = torch.tensor([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]]], dtype=torch.float64)
    pred = Prediction(probs=probs)
    torch.testing.assert_close(pred.epistemic, torch.tensor([LOG2, 0.0], dtype=torch.float64))
    torch.testing.assert_close(pred.aleatoric, torch.tensor([0.0, LOG2], dtype=torch.float64))
    assert pred.reject(coverage=0.5, score="epistemic").tolist() == [False, True]
    assert pred.reject(coverage=0.5, score="aleatoric").tolist() == [True, False]
    assert pred.reject(coverage=0.5).tolist() == [True, False]  # equal entropy: input order
    assert pred.reject(threshold=0.1, score="epistemic").tolist() == [False, True]


def test_least_confidence_is_one_minus_the_top_probability():
    # row 0: entropy log 2 = 0.693, 1 - max = 0.5; row 1: entropy 0.950, 1 - max = 0.4
    pred = _one_draw([[0.5, 0.5, 0.0], [0.6, 0.2, 0.2]])
    assert pred.entropy[0] < pred.entropy[1]
    assert pred.reject(coverage=0.5).tolist() == [True, False]
    assert pred.reject(coverage=0.5, score="least_confidence").tolist() == [False, True]
    assert pred.reject(threshold=0.4, score="least_confidence").tolist() == [False, True]
    assert pred.reject(threshold=0.5, score="least_confidence").tolist() == [True, True]


def test_kept_predictions_are_more_accurate():
    # the confident rows are right, the uncertain ones are mostly wrong
    rows = [[0.95, 0.05], [0.1, 0.9], [0.55, 0.45], [0.98, 0.02], [0.45, 0.55], [0.6, 0.4]]
    y = torch.tensor([0, 1, 1, 0, 0, 0])
    pred = _one_draw(rows)
    all_accuracy = metrics.accuracy(pred.mean, y)
    assert all_accuracy == pytest.approx(4 / 6)
    keep = pred.reject(coverage=0.5)
    assert keep.tolist() == [True, True, False, True, False, False]
    assert metrics.accuracy(pred.mean[keep], y[keep]) == 1.0 > all_accuracy
    for score in ("entropy", "epistemic", "aleatoric", "least_confidence"):
        keep = pred.reject(coverage=0.5, score=score)
        assert metrics.accuracy(pred.mean[keep], y[keep]) >= all_accuracy, score


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({}, ValueError, "exactly one of threshold and coverage; neither"),
        ({"threshold": 0.1, "coverage": 0.5}, ValueError, "exactly one of threshold and coverage"),
        ({"coverage": 0.0}, ValueError, "coverage must be in (0, 1]"),
        ({"coverage": 1.5}, ValueError, "coverage must be in (0, 1]"),
        ({"coverage": -0.2}, ValueError, "coverage must be in (0, 1]"),
        ({"coverage": float("nan")}, ValueError, "coverage must be in (0, 1]"),
        ({"threshold": -0.1}, ValueError, "threshold must be a finite number >= 0"),
        ({"threshold": float("nan")}, ValueError, "threshold must be a finite number >= 0"),
        ({"threshold": float("inf")}, ValueError, "threshold must be a finite number >= 0"),
        ({"coverage": 0.5, "score": "max_prob"}, ValueError, "score must be one of"),
        ({"coverage": 0.5, "score": 1}, TypeError, "score must be a str"),
        ({"coverage": "0.5"}, TypeError, "coverage must be a real number"),
        ({"coverage": True}, TypeError, "coverage must be a real number"),
        ({"threshold": torch.tensor(0.1)}, TypeError, "threshold must be a real number"),
    ],
)
def test_reject_bad_arguments(four, kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace("]", r"\]")):
        four.reject(**kwargs)


def test_reject_arguments_are_keyword_only(four):
    with pytest.raises(TypeError):
        four.reject(0.5)


@pytest.fixture
def regression() -> RegressionPrediction:
    """Three inputs: epistemic variance (0, 1, 0), aleatoric (1, 0, 4), std (1, 1, 2)."""
    loc = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 0.0]])  # (S=2, N=3)
    variance = torch.tensor([[1.0, 0.0, 4.0], [1.0, 0.0, 4.0]])
    return RegressionPrediction(samples=loc.clone(), loc=loc, variance=variance)


def test_regression_reject_scores(regression):
    torch.testing.assert_close(regression.std, torch.tensor([1.0, 1.0, 2.0]))
    keep = regression.reject(coverage=2 / 3)
    assert keep.dtype == torch.bool and keep.tolist() == [True, True, False]
    assert regression.reject(coverage=2 / 3, score="epistemic").tolist() == [True, False, True]
    assert regression.reject(coverage=1 / 3, score="aleatoric").tolist() == [False, True, False]
    assert regression.reject(threshold=1.0, score="aleatoric").tolist() == [True, True, False]
    assert regression.reject(threshold=1.5).tolist() == [True, True, False]


def test_regression_reject_averages_vector_targets():
    loc = torch.zeros(2, 3, 2)  # (S, N, H=2): no epistemic variance
    variance = torch.tensor([[[1.0, 1.0], [0.0, 4.0], [1.0, 0.0]]]).expand(2, 3, 2)
    pred = RegressionPrediction(samples=loc.clone(), loc=loc, variance=variance)
    # mean std over outputs: (1, 1, 0.5); mean aleatoric variance: (1, 2, 0.5)
    assert pred.reject(coverage=1 / 3).tolist() == [False, False, True]
    assert pred.reject(threshold=1.0, score="aleatoric").tolist() == [True, False, True]


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({}, ValueError, "exactly one of threshold and coverage"),
        ({"coverage": 2.0}, ValueError, "coverage must be in"),
        ({"threshold": -1}, ValueError, "threshold must be a finite number >= 0"),
        ({"coverage": 0.5, "score": "entropy"}, ValueError, "score must be one of"),
    ],
)
def test_regression_reject_bad_arguments(regression, kwargs, error, words):
    with pytest.raises(error, match=words):
        regression.reject(**kwargs)


def test_aurc_is_the_area_of_risk_coverage():
    uncertainty = np.array([0.1, 0.4, 0.2, 0.3])
    correct = np.array([True, False, True, True])
    # accepted in order 0, 2, 3, 1: risks 0, 0, 0, 1/4
    assert metrics.aurc(uncertainty, correct) == pytest.approx(1 / 16)
    assert metrics.aurc(uncertainty, correct) == metrics.risk_coverage(uncertainty, correct)[2]
    assert metrics.aurc(-uncertainty, correct) == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    with pytest.raises(TypeError, match="correct must be a bool"):
        metrics.aurc(uncertainty, np.ones(4))
