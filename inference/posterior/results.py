"""Results of posterior prediction: predictive probabilities and posterior attention."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import pandas as pd
import torch

from probtransformer.inference.diagnostics import _arviz
from probtransformer.inference.posterior.mixture import mixture_quantile, standard_quantile


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last dim (0 log 0 = 0)."""
    return -torch.special.xlogy(probs, probs).sum(-1)


def _check_prob(prob: float) -> None:
    if not (isinstance(prob, (int, float)) and 0 < prob < 1):
        raise ValueError(f"prob must be in (0, 1), got {prob!r}")


def _kept(
    scores: dict[str, torch.Tensor],
    score: str,
    threshold: float | None,
    coverage: float | None,
) -> torch.Tensor:
    """The ``reject`` rule shared by ``Prediction`` and ``RegressionPrediction``.

    ``scores`` maps each allowed score name to a (lazily computed) ``(N,)`` uncertainty.
    """
    if not isinstance(score, str):
        raise TypeError(f"score must be a str, one of {sorted(scores)}, got {type(score).__name__}")
    if score not in scores:
        raise ValueError(f"score must be one of {sorted(scores)}, got {score!r}")
    if (threshold is None) == (coverage is None):
        given = "both were given" if threshold is not None else "neither was given"
        raise ValueError(f"give exactly one of threshold and coverage; {given}")
    for name, value in (("threshold", threshold), ("coverage", coverage)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    uncertainty = scores[score]()
    if threshold is not None:
        if not (math.isfinite(threshold) and threshold >= 0):
            raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
        return uncertainty <= threshold
    if not 0 < coverage <= 1:  # False for NaN as well
        raise ValueError(f"coverage must be in (0, 1], got {coverage!r}")
    n = uncertainty.numel()  # token-level scores (N, T) are ranked over all steps
    # at least the requested fraction; rounded first so that 0.3 * 10 keeps 3, not 4
    count = max(1, math.ceil(round(coverage * n, 9)))
    order = torch.argsort(uncertainty.flatten(), stable=True)  # ties: input order
    keep = torch.zeros(n, dtype=torch.bool)
    keep[order[:count]] = True
    return keep.reshape(uncertainty.shape)


@dataclass(frozen=True)
class Prediction:
    """Posterior predictive of a classifier for ``N`` inputs from ``S`` posterior draws.

    The total predictive entropy splits into an aleatoric part (expected entropy of each draw's
    prediction) and an epistemic part (mutual information between the label and the weights):
    ``entropy = aleatoric + epistemic`` (Depeweg et al. 2018; Houlsby et al. 2011, BALD).

    Token-level models (``TokenTagger``, ``CausalLM``) give one distribution per step: ``probs``
    is then ``(S, N, T, C)`` and every summary below gains the ``T`` dim (values at padded steps
    are computed but meaningless: select the real steps with the mask).

    Attributes:
        probs: ``(S, N, C)`` (or ``(S, N, T, C)``) class probabilities of each draw (CPU).
    """

    probs: torch.Tensor

    @property
    def mean(self) -> torch.Tensor:
        """``(N, C)`` posterior predictive probabilities (average over draws)."""
        return self.probs.mean(0)

    @property
    def predicted(self) -> torch.Tensor:
        """``(N,)`` int64 most probable class under the posterior predictive."""
        return self.mean.argmax(-1)

    @property
    def entropy(self) -> torch.Tensor:
        """``(N,)`` total predictive entropy in nats."""
        return _entropy(self.mean)

    @property
    def aleatoric(self) -> torch.Tensor:
        """``(N,)`` expected entropy of the per-draw predictions, nats."""
        return _entropy(self.probs).mean(0)

    @property
    def epistemic(self) -> torch.Tensor:
        """``(N,)`` mutual information ``entropy - aleatoric`` in nats (>= 0)."""
        return (self.entropy - self.aleatoric).clamp(min=0.0)

    def credible_interval(self, prob: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
        """Equal-tailed interval of each class probability over draws.

        Returns:
            ``(lower, upper)``, each ``(N, C)``.

        Raises:
            ValueError: ``prob`` not in (0, 1).
        """
        return _quantiles(self.probs, prob)

    def reject(
        self,
        *,
        threshold: float | None = None,
        coverage: float | None = None,
        score: str = "entropy",
    ) -> torch.Tensor:
        """Selective prediction: which inputs to keep (predict on) and which to reject (abstain).

        Inputs are ranked by an uncertainty ``score`` (higher = less certain):

        - ``"entropy"``: total predictive entropy in nats (the default);
        - ``"epistemic"``: mutual information between label and weights, nats (what more data
          would reduce; the usual score for out-of-distribution inputs);
        - ``"aleatoric"``: expected entropy of the per-draw predictions, nats;
        - ``"least_confidence"``: ``1 - max_c mean[:, c]``, one minus the top predictive
          probability (the softmax response of Geifman & El-Yaniv 2017).

        Give exactly one of ``threshold`` (keep every input whose score is ``<= threshold``) or
        ``coverage`` (keep the ``ceil(coverage * N)`` inputs with the lowest score, at least one;
        ties are broken by input order, so the count is exact).

        Args:
            threshold: finite number ``>= 0`` in the score's units.
            coverage: fraction of inputs to keep, in ``(0, 1]``.
            score: one of the names above.

        Returns:
            ``(N,)`` bool tensor (``(N, T)`` for token-level predictions, ranked over all
            steps), True = keep (predict), False = reject.

        Raises:
            ValueError: both or neither of ``threshold`` and ``coverage`` given, ``coverage``
                outside (0, 1] or NaN, ``threshold`` negative, NaN or infinite, unknown
                ``score``.
            TypeError: ``threshold`` or ``coverage`` not a real number (bools refused),
                ``score`` not a str.
        """
        scores = {
            "entropy": lambda: self.entropy,
            "epistemic": lambda: self.epistemic,
            "aleatoric": lambda: self.aleatoric,
            "least_confidence": lambda: 1 - self.mean.max(-1).values,
        }
        return _kept(scores, score, threshold, coverage)

    def __repr__(self) -> str:
        draws, n, *steps, classes = self.probs.shape
        steps = f"steps={steps[0]}, " if steps else ""
        return (
            f"Prediction(draws={draws}, n={n}, {steps}classes={classes}, "
            f"mean_entropy={self.entropy.mean():.4f} nats, "
            f"mean_epistemic={self.epistemic.mean():.4f} nats)"
        )

    def to_dataframe(self, class_names: list[str] | None = None) -> pd.DataFrame:
        """One row per input: ``prob_<class>``, ``predicted``, ``entropy``, ``aleatoric``,
        ``epistemic``. For token-level predictions one row per (input, step), with columns
        ``sequence`` and ``step`` first."""
        if self.probs.dim() == 4:
            S, N, T, C = self.probs.shape
            frame = Prediction(self.probs.reshape(S, N * T, C)).to_dataframe(class_names)
            index = pd.MultiIndex.from_product([range(N), range(T)], names=["sequence", "step"])
            return frame.set_index(index).reset_index()
        mean = self.mean
        names = class_names or [str(c) for c in range(mean.shape[-1])]
        frame = pd.DataFrame(mean.numpy(), columns=[f"prob_{c}" for c in names])
        frame["predicted"] = [names[i] for i in self.predicted.tolist()]
        frame["entropy"] = self.entropy.numpy()
        frame["aleatoric"] = self.aleatoric.numpy()
        frame["epistemic"] = self.epistemic.numpy()
        return frame


@dataclass(frozen=True)
class RegressionPrediction:
    """Posterior predictive of a regression model for ``N`` inputs from ``S`` posterior draws.

    The predictive variance splits by the law of total variance into an aleatoric part (the
    expected noise variance) and an epistemic part (the variance of ``E[y | x, θ]`` over draws).

    Predictive intervals are quantiles of the posterior predictive itself, the equal-weight
    mixture of the ``S`` draws' likelihoods (``mixture.mixture_quantile``), when the likelihood
    is a Normal or a Student-t (``df``); for one draw (a point estimate) that is the
    likelihood's own interval, which holds the noise but no epistemic part.

    Attributes:
        samples: ``(S, N, ...)`` one draw of ``y`` from each posterior draw's likelihood (CPU).
        loc: ``(S, N, ...)`` ``E[y | x, θ_s]``, the regression function of each draw.
        variance: ``(S, N, ...)`` ``Var[y | x, θ_s]``, the noise variance of each draw.
        df: degrees of freedom of each draw's Student-t likelihood (``math.inf``, the
            default: a Normal); None for another family, whose predictive interval is then
            read from ``samples`` (and refused below ``min_sample_draws`` draws).
    """

    samples: torch.Tensor
    loc: torch.Tensor
    variance: torch.Tensor
    df: float | None = math.inf

    @property
    def mean(self) -> torch.Tensor:
        """``(N, ...)`` posterior predictive mean ``E[y | x, data]``."""
        return self.loc.mean(0)

    @property
    def aleatoric(self) -> torch.Tensor:
        """``(N, ...)`` expected noise variance."""
        return self.variance.mean(0)

    @property
    def epistemic(self) -> torch.Tensor:
        """``(N, ...)`` posterior variance of ``E[y | x, θ]`` (0 for one draw)."""
        return self.loc.var(0, correction=0)

    @property
    def std(self) -> torch.Tensor:
        """``(N, ...)`` predictive standard deviation, ``sqrt(aleatoric + epistemic)``."""
        return (self.aleatoric + self.epistemic).sqrt()

    def credible_interval(self, prob: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
        """Equal-tailed interval of ``E[y | x, θ]`` over draws (the regression function).

        Returns:
            ``(lower, upper)``, each ``(N, ...)``.

        Raises:
            ValueError: ``prob`` not in (0, 1).
        """
        return _quantiles(self.loc, prob)

    @property
    def scale(self) -> torch.Tensor:
        """``(S, N, ...)`` scale of each draw's Normal or Student-t likelihood (``sqrt`` of the
        variance, times ``sqrt((df - 2) / df)`` for a Student-t).

        Raises:
            ValueError: the family is unknown (``df`` None), or a Student-t with ``df <= 2``
                (no variance to read the scale from).
        """
        if self.df is None:
            raise ValueError("the likelihood is neither Normal nor Student-t (df is None)")
        if math.isinf(self.df):
            return self.variance.sqrt()
        if not self.df > 2:
            raise ValueError(f"a Student-t needs df > 2 to have a variance, got df={self.df}")
        return (self.variance * (self.df - 2) / self.df).sqrt()

    def predictive_interval(self, prob: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
        """Equal-tailed interval of a new observation ``y`` (noise included).

        For a Normal or Student-t likelihood, the quantiles ``(1 -+ prob) / 2`` of the
        posterior predictive, the equal-weight mixture of the ``S`` draws' likelihoods
        (``mixture.mixture_quantile``): exact for the draws at hand, however few. One draw gives
        the likelihood's own interval (aleatoric only). Another family takes the quantiles of
        ``samples``, one ``y`` per draw, which needs ``min_sample_draws(prob)`` draws or more.

        Returns:
            ``(lower, upper)``, each ``(N, ...)``, in the dtype of ``loc``.

        Raises:
            ValueError: ``prob`` not in (0, 1); fewer than ``min_sample_draws(prob)`` draws for
                a likelihood other than Normal or Student-t.
        """
        _check_prob(prob)
        if self.df is None:
            draws, needed = self.samples.shape[0], min_sample_draws(prob)
            if draws < needed:
                raise ValueError(
                    f"a {prob:.0%} interval read from one sampled y per draw needs at least "
                    f"{needed} draws (one in each tail), got {draws}: predict with more "
                    "num_samples"
                )
            return _quantiles(self.samples, prob)
        scale = self.scale
        lower, upper = (
            mixture_quantile(self.loc, scale, q, df=self.df).to(self.loc.dtype)
            for q in ((1 - prob) / 2, (1 + prob) / 2)
        )
        return lower, upper

    def predictive_samples(self, num_samples: int = 1000, *, seed: int = 0) -> torch.Tensor:
        """Draws of a new observation ``y`` from the posterior predictive: ``ceil(num_samples /
        S)`` from each draw's Normal or Student-t likelihood, so that a point estimate (``S =
        1``) gets its noise too (``samples`` holds one ``y`` per draw). For CRPS
        (``metrics.crps_samples``).

        Args:
            num_samples: at least this many draws in all, >= 1.
            seed: seeds the draws.

        Returns:
            ``(K * S, N, ...)`` draws, ``K = ceil(num_samples / S)``, in the dtype of ``loc``;
            ``samples`` itself when the family is unknown (``df`` None).

        Raises:
            ValueError: ``num_samples`` not an integer >= 1.
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
        if self.df is None:
            return self.samples
        per_draw = math.ceil(num_samples / self.loc.shape[0])
        gen = torch.Generator().manual_seed(seed)
        shape = (per_draw, *self.loc.shape)  # (K, S, N, ...)
        u = torch.rand(shape, generator=gen, dtype=torch.float64).clamp_min(2.0**-54)
        z = standard_quantile(u, self.df)  # (K, S, N, ...) inverse-CDF draws
        draws = self.loc.double() + self.scale.double() * z
        return draws.flatten(0, 1).to(self.loc.dtype)

    def reject(
        self,
        *,
        threshold: float | None = None,
        coverage: float | None = None,
        score: str = "std",
    ) -> torch.Tensor:
        """Selective prediction: which inputs to keep (predict on) and which to reject (abstain).

        Inputs are ranked by an uncertainty ``score`` (higher = less certain): ``"std"`` the
        predictive standard deviation (the default, in the units of ``y``), ``"epistemic"`` or
        ``"aleatoric"`` its variance parts (units of ``y`` squared). For vector targets the
        score is averaged over the output dims. Give exactly one of ``threshold`` (keep every
        input whose score is ``<= threshold``) or ``coverage`` (keep the ``ceil(coverage * N)``
        inputs with the lowest score, at least one; ties broken by input order).

        Args:
            threshold: finite number ``>= 0`` in the score's units.
            coverage: fraction of inputs to keep, in ``(0, 1]``.
            score: ``"std"``, ``"epistemic"`` or ``"aleatoric"``.

        Returns:
            ``(N,)`` bool tensor, True = keep (predict), False = reject.

        Raises:
            ValueError, TypeError: as for ``Prediction.reject``.
        """

        def per_input(value: torch.Tensor) -> torch.Tensor:
            return value.reshape(value.shape[0], -1).mean(-1)  # (N,)

        scores = {
            "std": lambda: per_input(self.std),
            "epistemic": lambda: per_input(self.epistemic),
            "aleatoric": lambda: per_input(self.aleatoric),
        }
        return _kept(scores, score, threshold, coverage)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per input: ``mean``, ``std``, ``aleatoric``, ``epistemic`` (variances) and the
        90% predictive interval ``lower``/``upper`` (``name[j]`` per output for vector targets)."""
        lower, upper = self.predictive_interval(0.9)
        columns = dict(
            mean=self.mean,
            std=self.std,
            aleatoric=self.aleatoric,
            epistemic=self.epistemic,
            lower=lower,
            upper=upper,
        )
        frame = {}
        for name, value in columns.items():
            value = value.reshape(value.shape[0], -1)  # (N, outputs)
            for j in range(value.shape[1]):
                frame[name if value.shape[1] == 1 else f"{name}[{j}]"] = value[:, j].numpy()
        return pd.DataFrame(frame)

    def __repr__(self) -> str:
        draws, n = self.samples.shape[:2]
        return (
            f"RegressionPrediction(draws={draws}, n={n}, mean_std={self.std.mean():.4g}, "
            f"mean_epistemic_var={self.epistemic.mean():.4g})"
        )


def min_sample_draws(prob: float) -> int:
    """Fewest draws whose sample quantiles give an equal-tailed ``prob`` interval with at least
    one draw beyond each end: ``ceil(2 / (1 - prob))`` (20 for 90%).

    Raises:
        ValueError: ``prob`` not in (0, 1).
    """
    _check_prob(prob)
    return math.ceil(round(2 / (1 - prob), 9))


def _quantiles(values: torch.Tensor, prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_prob(prob)
    q = torch.tensor([(1 - prob) / 2, (1 + prob) / 2], dtype=values.dtype)
    lower, upper = torch.quantile(values, q, dim=0)
    return lower, upper


@dataclass(frozen=True)
class PosteriorAttention:
    """Posterior distribution of attention weights for ``n`` sequences.

    Attributes:
        samples: ``(chain, draw, n, layer, head, query, key)`` attention weights (CPU); each
            ``(query, key)`` row sums to 1 over the visible keys, or is all zero when the query
            sees no key.
        module: which attention, e.g. ``"encoder.self"``.
    """

    samples: torch.Tensor
    module: str = "encoder.self"

    def _flat(self) -> torch.Tensor:
        return self.samples.flatten(0, 1)  # (S, n, layer, head, query, key)

    def mean(self) -> torch.Tensor:
        """``(n, layer, head, query, key)`` posterior mean."""
        return self._flat().mean(0)

    def std(self) -> torch.Tensor:
        """``(n, layer, head, query, key)`` posterior standard deviation."""
        return self._flat().std(0, correction=0)

    def hdi(self, prob: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
        """Highest-density interval of every weight (ArviZ ``hdi``).

        Returns:
            ``(lower, upper)``, each ``(n, layer, head, query, key)``.

        Raises:
            ValueError: ``prob`` not in (0, 1).
        """
        _check_prob(prob)
        return _arviz.hdi(self.samples, prob)

    def plot(self, i: int = 0, *, title: str | None = None):
        """Posterior mean and std of sequence ``i``'s attention, per layer and head (Figure)."""
        from probtransformer.plots import attention_figure

        n = self.samples.shape[2]
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"i must be an int sequence index, got {type(i).__name__}")
        if not -n <= i < n:
            raise IndexError(f"i must index one of the n={n} sequences, got {i}")
        title = title or f"posterior attention of sequence {i} ({self.module} attention)"
        return attention_figure(self.mean()[i], self.std()[i], title=title)

    def __repr__(self) -> str:
        chains, draws, n, layers, heads, tq, tk = self.samples.shape
        return (
            f"PosteriorAttention(module={self.module!r}, chains={chains}, draws={draws}, n={n}, "
            f"layers={layers}, heads={heads}, query={tq}, key={tk})"
        )
