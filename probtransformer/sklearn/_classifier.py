"""``BayesianTransformerClassifier``: a ``SequenceClassifier`` with scikit-learn's API."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from sklearn.base import ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets

from probtransformer.sklearn._base import DOCSTRING_PARAMETERS, BayesianTransformer, check_choice


class BayesianTransformerClassifier(ClassifierMixin, BayesianTransformer):
    """A Bayesian Transformer sequence classifier with scikit-learn's estimator API.

    ``fit`` builds a ``models.SequenceClassifier(F, len(classes_), T, ...)`` (attention
    projections, logit temperatures and the output head latent by default) and fits it with
    the library's ``inference``; predictions are the posterior predictive mean over
    ``num_samples`` draws, so ``predict_proba`` is calibrated by the posterior rather than by a
    single softmax, and ``predict_uncertainty`` splits each row's predictive entropy into its
    aleatoric and epistemic (mutual information) parts. Features are used as given (the model
    does not standardise them): scale them as you would for a neural network.

    Args:
        {parameters}
    Attributes:
        classes_: ``(C,)`` the labels seen in ``fit``, sorted; any hashable labels (strings
            too): ``predict`` returns them.
        n_features_in_: values per sample, ``T * F``.
        feature_names_in_: column names of a DataFrame ``X`` (2-D only).
        input_shape_: ``(T, F)``.
        posterior_: the fitted ``inference.Posterior`` (its model takes float32 ``(N, T, F)``
            and labels as indices into ``classes_``).
        seed_: the seed of the fit and of every prediction.

    scikit-learn's estimator checks (``check_estimator``) pass
    (``tests/probtransformer/test_sklearn.py``, at small sizes and a 10-step fit) except
    those in ``EXPECTED_FAILED_CHECKS``: see there why. Fits and predictions are deterministic
    for an int ``random_state`` on one machine.

    Raises:
        ValueError: at ``fit``: an ``inference`` not among ``INFERENCES``, fewer than two
            classes, NaN/inf or non-numeric ``X``, continuous ``y``, ``X`` not 2-D or 3-D,
            bad sizes (the model's message).
    """

    def fit(self, X, y) -> BayesianTransformerClassifier:
        """Fit the posterior of a ``SequenceClassifier`` to ``(X, y)``.

        Args:
            X: ``(N, T, F)`` float sequences, or ``(N, T * F)`` (see the module docstring).
            y: ``(N,)`` class labels of any kind (at least two distinct ones).

        Returns:
            self.

        Raises:
            ValueError: see the class docstring.
            NonFiniteELBOError: the fit diverged (lower ``lr``).
        """
        from probtransformer.data import SequenceData
        from probtransformer.models import SequenceClassifier

        check_choice(self.inference)
        x, y = self._fit_inputs(X, y)
        check_classification_targets(y)
        self.classes_, encoded = np.unique(y, return_inverse=True)
        if len(self.classes_) < 2:
            raise ValueError(
                f"y has only one class ({self.classes_[0]!r}): a classifier needs at least 2 "
                "classes"
            )
        steps, features = self.input_shape_
        model = SequenceClassifier(features, len(self.classes_), steps, **self._model_kwargs())
        data = SequenceData(torch.from_numpy(np.ascontiguousarray(x)), encoded.astype(np.int64))
        self._fit_posterior(model, data)
        return self

    def _targets(self, y) -> torch.Tensor:
        y = np.asarray(y)
        index = np.searchsorted(self.classes_, y)
        index = np.clip(index, 0, len(self.classes_) - 1)
        unknown = self.classes_[index] != y
        if unknown.any():
            raise ValueError(f"y holds labels not seen in fit: {sorted(set(y[unknown]))[:5]}")
        return torch.from_numpy(index.astype(np.int64))

    def predict_proba(self, X) -> np.ndarray:
        """Posterior predictive class probabilities.

        Args:
            X: ``(N, T, F)`` or ``(N, T * F)`` float array of the fitted shape.

        Returns:
            ``(N, C)`` float64, columns in the order of ``classes_``; rows sum to 1.

        Raises:
            NotFittedError: before ``fit``.
            ValueError: NaN/inf, not 2-D or 3-D, or another number of values per sample
                than ``n_features_in_`` (the message names both).
        """
        probs = self._predict(X).mean.double().numpy()
        return probs / probs.sum(1, keepdims=True)

    def predict(self, X) -> np.ndarray:
        """The most probable class under the posterior predictive.

        Returns:
            ``(N,)`` labels from ``classes_``.

        Raises:
            NotFittedError, ValueError: as ``predict_proba``.
        """
        index = self.predict_proba(X).argmax(1)  # checks that it is fitted first
        return self.classes_[index]

    def predict_uncertainty(self, X) -> pd.DataFrame:
        """Predictive uncertainty per row, in nats (``inference.Prediction``).

        Returns:
            DataFrame of ``N`` rows: ``entropy`` (of the predictive mean), ``aleatoric``
            (expected entropy of each draw's prediction) and ``epistemic`` (their difference,
            the mutual information between label and weights; 0 for point estimates).

        Raises:
            NotFittedError, ValueError: as ``predict_proba``.
        """
        pred = self._predict(X)
        return pd.DataFrame(
            {
                "entropy": pred.entropy.double().numpy(),
                "aleatoric": pred.aleatoric.double().numpy(),
                "epistemic": pred.epistemic.double().numpy(),
            }
        )


BayesianTransformerClassifier.__doc__ = BayesianTransformerClassifier.__doc__.format(
    parameters=DOCSTRING_PARAMETERS.strip("\n").lstrip()
)
