"""Metrics for probabilistic predictions: classification, calibration, OOD, selective, regression.

Every function accepts torch tensors (any device) or numpy arrays, validates its inputs at the
boundary and returns Python floats (curves come back as numpy arrays). Log-likelihoods are in nats.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from sklearn.metrics import accuracy_score, brier_score_loss, roc_auc_score

from probtransformer.validation import check_int

ArrayLike = torch.Tensor | np.ndarray

PROB_ATOL = 1e-4  # tolerance on probability rows summing to 1 (float32 softmax drifts ~1e-7)
NLL_CLIP = 1e-12  # floor on the probability of the true class, so a confident miss stays finite


def accuracy(probs: ArrayLike, y: ArrayLike) -> float:
    """Fraction of examples whose most probable class is the label.

    Args:
        probs: (N, C) class probabilities, rows summing to 1.
        y: (N,) integer labels in [0, C).

    Returns:
        Accuracy in [0, 1].

    Raises:
        TypeError: if an input is not a tensor/array of numbers, or `y` is not integer.
        ValueError: on wrong shapes, N = 0, rows not summing to 1, or labels out of range.
    """
    p, labels = _check_classification(probs, y)
    return float(accuracy_score(labels, p.argmax(axis=1)))


def nll(probs: ArrayLike, y: ArrayLike) -> float:
    """Mean negative log-likelihood of the labels in nats, -mean log p(y_i).

    The probability of the true class is clipped at 1e-12 (so the worst per-example value is
    about 27.6 nats).

    Args:
        probs: (N, C) class probabilities, rows summing to 1.
        y: (N,) integer labels in [0, C).

    Returns:
        Mean NLL in nats (0 for perfect confident predictions; log C for uniform ones).

    Raises:
        TypeError, ValueError: as for `accuracy`.
    """
    p, labels = _check_classification(probs, y)
    p_true = p[np.arange(len(labels)), labels]
    return float(-np.log(np.clip(p_true, NLL_CLIP, 1.0)).mean())


def brier(probs: ArrayLike, y: ArrayLike) -> float:
    """Multiclass Brier score, mean over N of sum_c (p_c - onehot_c)^2 (Brier 1950).

    Args:
        probs: (N, C) class probabilities, rows summing to 1.
        y: (N,) integer labels in [0, C).

    Returns:
        Brier score in [0, 2]: 0 for perfect predictions, 1 - 1/C for uniform ones.

    Raises:
        TypeError, ValueError: as for `accuracy`.
    """
    p, labels = _check_classification(probs, y)
    classes = np.arange(p.shape[1])
    return float(brier_score_loss(labels, p, labels=classes, scale_by_half=False))


def ece(
    probs: ArrayLike,
    y: ArrayLike,
    *,
    n_bins: int = 15,
    strategy: Literal["uniform", "quantile"] = "uniform",
) -> float:
    """Expected calibration error of the top-class confidence (Guo et al. 2017).

    ECE = sum_b (n_b / N) |accuracy_b - confidence_b| over bins of the top-class probability.

    Args:
        probs: (N, C) class probabilities, rows summing to 1.
        y: (N,) integer labels in [0, C).
        n_bins: number of bins (>= 1).
        strategy: "uniform" for equal-width bins (lo, hi] on [0, 1]; "quantile" for equal-mass
            bins (sizes differ by at most one; ties broken by input order).

    Returns:
        ECE in [0, 1].

    Raises:
        TypeError, ValueError: as for `accuracy`, and for a bad `n_bins` or `strategy`.
    """
    p, labels = _check_classification(probs, y)
    check_int("n_bins", n_bins, type_error=True)
    confidence, correct = p.max(axis=1), p.argmax(axis=1) == labels
    if strategy == "uniform":
        bins = _uniform_bins(confidence, n_bins)
    elif strategy == "quantile":
        rank = np.empty(len(confidence), dtype=np.int64)
        rank[np.argsort(confidence, kind="stable")] = np.arange(len(confidence))
        bins = rank * n_bins // len(confidence)
    else:
        raise ValueError(f"strategy must be 'uniform' or 'quantile', got {strategy!r}")
    gap = correct.astype(np.float64) - confidence  # (N,) per-example accuracy - confidence
    bin_gap = np.bincount(bins, weights=gap, minlength=n_bins)  # (n_bins,) summed per bin
    return float(np.abs(bin_gap).sum() / len(confidence))


def reliability_curve(probs: ArrayLike, y: ArrayLike, *, n_bins: int = 15) -> dict[str, np.ndarray]:
    """Per-bin confidence and accuracy of the top class, on equal-width bins (lo, hi] of [0, 1].

    Args:
        probs: (N, C) class probabilities, rows summing to 1.
        y: (N,) integer labels in [0, C).
        n_bins: number of bins (>= 1).

    Returns:
        dict with "edges" (n_bins + 1,) bin edges, and (n_bins,) arrays "confidence" (mean top
        probability), "accuracy" (fraction correct) — both NaN for empty bins — and "count".

    Raises:
        TypeError, ValueError: as for `ece`.
    """
    p, labels = _check_classification(probs, y)
    check_int("n_bins", n_bins, type_error=True)
    confidence, correct = p.max(axis=1), p.argmax(axis=1) == labels
    bins = _uniform_bins(confidence, n_bins)
    count = np.bincount(bins, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(bins, weights=confidence, minlength=n_bins) / count
        mean_acc = np.bincount(bins, weights=correct, minlength=n_bins) / count
    return {
        "edges": np.linspace(0.0, 1.0, n_bins + 1),
        "confidence": mean_conf,
        "accuracy": mean_acc,
        "count": count,
    }


def ood_auroc(score_in: ArrayLike, score_out: ArrayLike) -> float:
    """AUROC of an uncertainty score separating out-of-distribution (positive) from in-distribution.

    Higher scores should mean "more likely OOD" (e.g. predictive entropy or epistemic MI).

    Args:
        score_in: (N_in,) scores of in-distribution examples.
        score_out: (N_out,) scores of OOD examples.

    Returns:
        AUROC in [0, 1]: 1 for perfect separation, 0.5 for an uninformative score.

    Raises:
        TypeError: if a score is not a tensor/array of numbers.
        ValueError: if a score is not 1-D, is empty, or holds NaN/inf.
    """
    s_in = _check_vector(score_in, "score_in")
    s_out = _check_vector(score_out, "score_out")
    is_ood = np.concatenate([np.zeros(len(s_in)), np.ones(len(s_out))])
    return float(roc_auc_score(is_ood, np.concatenate([s_in, s_out])))


def risk_coverage(
    uncertainty: ArrayLike, correct: ArrayLike
) -> tuple[np.ndarray, np.ndarray, float]:
    """Risk-coverage curve of selective prediction and its area, AURC (Geifman & El-Yaniv 2017).

    Examples are accepted in order of increasing uncertainty (ties by input order); at coverage
    k/N the risk is the error rate among the k accepted ones. AURC is the mean risk over
    k = 1..N (the area under the step curve).

    Args:
        uncertainty: (N,) uncertainty score, lower = more confident.
        correct: (N,) bool, whether each prediction is correct.

    Returns:
        (coverage, risk, aurc): coverage and risk are (N,) arrays; aurc a float in [0, 1].

    Raises:
        TypeError: if `correct` is not bool or `uncertainty` not numeric.
        ValueError: on shapes other than (N,), unequal lengths, N = 0, or NaN/inf uncertainty.
    """
    u = _check_vector(uncertainty, "uncertainty")
    c = _as_array(correct, "correct")
    if c.dtype != np.bool_:
        raise TypeError(f"correct must be a bool array, got dtype {c.dtype}")
    if c.shape != u.shape:
        raise ValueError(f"correct must have shape (N,)=({len(u)},), got {c.shape}")
    errors = ~c[np.argsort(u, kind="stable")]
    k = np.arange(1, len(u) + 1)
    coverage = k / len(u)
    risk = np.cumsum(errors) / k
    return coverage, risk, float(risk.mean())


def aurc(uncertainty: ArrayLike, correct: ArrayLike) -> float:
    """Area under the risk-coverage curve of selective prediction (AURC; lower is better).

    The third value of `risk_coverage`: the mean error rate among the k most confident
    examples over k = 1..N. A score that ranks every error last gives the smallest AURC
    possible for the error rate; an uninformative one gives about the error rate itself.

    Args:
        uncertainty: (N,) uncertainty score, lower = more confident (e.g. predictive entropy).
        correct: (N,) bool, whether each prediction is correct.

    Returns:
        AURC in [0, 1].

    Raises:
        TypeError, ValueError: as for `risk_coverage`.
    """
    return risk_coverage(uncertainty, correct)[2]


def interval_coverage(lower: ArrayLike, upper: ArrayLike, y: ArrayLike) -> float:
    """Fraction of targets inside their predictive interval [lower, upper].

    Args:
        lower: (N, ...) lower interval bounds.
        upper: same shape as `lower`, upper bounds.
        y: same shape as `lower`, observed values.

    Returns:
        Empirical coverage in [0, 1] (compare with the nominal probability of the interval).

    Raises:
        TypeError: if an input is not a tensor/array of numbers.
        ValueError: on unequal shapes, no entries, NaN/inf, or lower > upper anywhere.
    """
    lo = _finite_float(_as_array(lower, "lower"), "lower")
    hi = _finite_float(_as_array(upper, "upper"), "upper")
    target = _finite_float(_as_array(y, "y"), "y")
    if hi.shape != lo.shape or target.shape != lo.shape:
        raise ValueError(
            f"lower, upper and y must have the same shape, got {lo.shape}, {hi.shape}, "
            f"{target.shape}"
        )
    if lo.size == 0:
        raise ValueError("lower, upper and y must be non-empty, got 0 entries")
    if (lo > hi).any():
        raise ValueError(f"lower must be <= upper, got {int((lo > hi).sum())} entries above")
    return float(((lo <= target) & (target <= hi)).mean())


def coverage_band(prob: float, n: int, *, z: float = 3.0) -> tuple[float, float]:
    """Range of empirical coverage that does not flag a ``prob`` interval on ``n`` test points.

    Two allowances, the wider one kept at each end:

    - a fixed one for misspecification that is tolerable: a miss rate up to twice the nominal
      ``1 - prob`` and down to 0.3 of it, i.e. ``[1 - 2 (1 - prob), 1 - 0.3 (1 - prob)]``,
      which is 0.8 to 0.97 for a 90% interval (the target band of issue 44);
    - the binomial sampling error of a calibrated interval's coverage on ``n`` independent
      points, ``prob -+ z sqrt(prob (1 - prob) / n)`` (``z = 3``: a calibrated interval is
      flagged by chance about once in 370 runs). Test points of overlapping forecast windows
      are correlated, so the true error is larger than this; the fixed allowance covers the
      difference for the test sets here (95 points: 0.8 to 0.99 for 90%).

    Args:
        prob: nominal probability of the interval, in (0, 1).
        n: number of test points (targets) the coverage was measured on, >= 1.
        z: standard errors of the binomial allowance, > 0.

    Returns:
        ``(low, high)`` within [0, 1]: coverage outside it is far from nominal.

    Raises:
        ValueError: ``prob`` not in (0, 1), ``n`` < 1 or ``z`` not > 0.
        TypeError: ``n`` not an int.
    """
    if not (isinstance(prob, (int, float)) and 0 < prob < 1):
        raise ValueError(f"prob must be in (0, 1), got {prob!r}")
    check_int("n", n, type_error=True)
    if not (isinstance(z, (int, float)) and z > 0):
        raise ValueError(f"z must be a number > 0, got {z!r}")
    error = z * (prob * (1 - prob) / n) ** 0.5
    low = min(1 - 2 * (1 - prob), prob - error)
    high = max(1 - 0.3 * (1 - prob), prob + error)
    return max(0.0, low), min(1.0, high)


def crps_samples(samples: ArrayLike, y: ArrayLike) -> float:
    """Continuous ranked probability score from predictive samples (Gneiting & Raftery 2007).

    Per target, CRPS = E|X - y| - 0.5 E|X - X'| with X, X' drawn from the S samples (the
    ensemble estimator, pairs with i = j included); lower is better, in the units of y.

    Args:
        samples: (S, N, ...) predictive samples.
        y: (N, ...) observed values, `samples.shape[1:]`.

    Returns:
        Mean CRPS over all targets (equals |x - y| for a point mass at x).

    Raises:
        TypeError: if an input is not a tensor/array of numbers.
        ValueError: on mismatched shapes, no samples or targets, or NaN/inf.
    """
    x = _finite_float(_as_array(samples, "samples"), "samples")
    target = _finite_float(_as_array(y, "y"), "y")
    if x.ndim < 2 or x.shape[1:] != target.shape:
        raise ValueError(
            f"samples must have shape (S, *y.shape)=(S, {', '.join(map(str, target.shape))}), "
            f"got {x.shape}"
        )
    if x.shape[0] == 0 or target.size == 0:
        raise ValueError(f"samples and y must be non-empty, got samples of shape {x.shape}")
    s = x.shape[0]
    x = np.sort(x.reshape(s, -1), axis=0)  # (S, M)
    abs_error = np.abs(x - target.reshape(-1)).mean(axis=0)  # (M,) E|X - y|
    # sum_{i,j} |x_i - x_j| = 2 sum_i (2i - S - 1) x_(i) for sorted x, i = 1..S
    weights = 2 * np.arange(1, s + 1) - s - 1  # (S,)
    spread = 2 * (weights @ x) / s**2  # (M,) E|X - X'|
    return float((abs_error - 0.5 * spread).mean())


def token_level(
    probs: ArrayLike, y: ArrayLike, mask: ArrayLike | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Flatten token-level predictions to the real steps, for the per-example metrics above.

    Args:
        probs: (N, T, C) per-step class probabilities (e.g. ``Prediction.mean`` of a
            ``TokenTagger`` or ``CausalLM``).
        y: (N, T) integer labels.
        mask: (N, T) bool, True = real step, or None (every step is real).

    Returns:
        ``(probs (M, C), y (M,))`` for the ``M`` real steps, as numpy arrays.

    Raises:
        TypeError: if an input is not a tensor/array, or `mask` is not bool.
        ValueError: on mismatched shapes, or no real step.
    """
    p = _as_array(probs, "probs")
    labels = _as_array(y, "y")
    if p.ndim != 3 or labels.shape != p.shape[:2]:
        raise ValueError(
            f"probs must be (N, T, C) and y (N, T), got shapes {p.shape} and {labels.shape}"
        )
    keep = np.ones(labels.shape, dtype=bool) if mask is None else _as_array(mask, "mask")
    if keep.dtype != bool:
        raise TypeError(f"mask must be bool, got dtype {keep.dtype}")
    if keep.shape != labels.shape:
        raise ValueError(f"mask must have shape {labels.shape} like y, got {keep.shape}")
    if not keep.any():
        raise ValueError("mask marks no real step")
    return p[keep], labels[keep]


def perplexity(probs: ArrayLike, y: ArrayLike, mask: ArrayLike | None = None) -> float:
    """Perplexity of next-token predictions: ``exp`` of the mean per-token NLL in nats.

    Args:
        probs: (N, T, C) predictive next-token probabilities (or (M, C) already flattened).
        y: (N, T) (or (M,)) the tokens that followed.
        mask: (N, T) bool, True = a real step to score, or None.

    Returns:
        Perplexity, >= 1 (the vocabulary size for uniform predictions).

    Raises:
        TypeError, ValueError: as for `nll` and `token_level`.
    """
    if _as_array(probs, "probs").ndim == 3:
        probs, y = token_level(probs, y, mask)
    return float(np.exp(nll(probs, y)))


def classification_report(probs: ArrayLike, y: ArrayLike) -> dict[str, float]:
    """Accuracy, NLL (nats), ECE (15 equal-width bins) and Brier score in one dict.

    Args:
        probs: (N, C) class probabilities, rows summing to 1.
        y: (N,) integer labels in [0, C).

    Returns:
        {"accuracy", "nll", "ece", "brier"} -> float.

    Raises:
        TypeError, ValueError: as for `accuracy`.
    """
    return {
        "accuracy": accuracy(probs, y),
        "nll": nll(probs, y),
        "ece": ece(probs, y),
        "brier": brier(probs, y),
    }


def _as_array(value: ArrayLike, name: str) -> np.ndarray:
    """A tensor (any device/dtype) or numpy array of numbers/bools -> numpy array on CPU."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.is_floating_point():
            value = value.double()  # bfloat16/half have no numpy dtype
        value = value.numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")
    if value.dtype.kind not in "biuf":
        raise TypeError(f"{name} must hold real numbers, got dtype {value.dtype}")
    return value


def _finite_float(a: np.ndarray, name: str) -> np.ndarray:
    """Raise if `a` holds NaN/inf; return it as float64."""
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite, got {int((~np.isfinite(a)).sum())} NaN/inf")
    return a.astype(np.float64)


def _check_vector(value: ArrayLike, name: str) -> np.ndarray:
    a = _finite_float(_as_array(value, name), name)
    if a.ndim != 1 or len(a) == 0:
        raise ValueError(f"{name} must have shape (N,) with N > 0, got {a.shape}")
    return a


def _check_classification(probs: ArrayLike, y: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Validate (N, C) probabilities and (N,) labels; return float64 probs (rows renormalised to
    sum to 1) and int64 labels."""
    p = _finite_float(_as_array(probs, "probs"), "probs")
    if p.ndim != 2 or p.shape[0] == 0 or p.shape[1] < 2:
        raise ValueError(f"probs must have shape (N, C) with N > 0 and C >= 2, got {p.shape}")
    if p.min() < 0 or p.max() > 1:
        raise ValueError(f"probs must lie in [0, 1], got values in [{p.min():.4g}, {p.max():.4g}]")
    row_error = np.abs(p.sum(axis=1) - 1).max()
    if row_error > PROB_ATOL:
        raise ValueError(
            f"probs rows must sum to 1 (tolerance {PROB_ATOL}), got a row off by {row_error:.3g}"
        )
    labels = _as_array(y, "y")
    if labels.dtype.kind not in "iu":
        raise TypeError(f"y must hold integer class labels, got dtype {labels.dtype}")
    n, num_classes = p.shape
    if labels.shape != (n,):
        raise ValueError(f"y must have shape (N,)=({n},) like probs, got {labels.shape}")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(
            f"y must lie in [0, C)=[0, {num_classes}), got labels in "
            f"[{labels.min()}, {labels.max()}]"
        )
    # float32 rows sum to 1 only within ~1e-7; renormalise so scikit-learn sees exact sums
    return p / p.sum(axis=1, keepdims=True), labels.astype(np.int64)


def _uniform_bins(confidence: np.ndarray, n_bins: int) -> np.ndarray:
    """Bin index of each confidence in equal-width bins (lo, hi] of [0, 1]; 0 goes to bin 0."""
    interior_edges = np.linspace(0.0, 1.0, n_bins + 1)[1:-1]
    return np.searchsorted(interior_edges, confidence, side="left")
