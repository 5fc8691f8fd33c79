"""scikit-learn estimators around the built-in Bayesian Transformers.

``BayesianTransformerClassifier`` (a ``SequenceClassifier``) and ``BayesianTransformerRegressor``
(a ``SequenceRegressor``) follow scikit-learn's estimator API: hyperparameters in ``__init__``,
``fit(X, y)``, ``predict``, ``predict_proba``, ``score``, ``get_params``/``set_params``, so they
work in ``Pipeline``, ``GridSearchCV`` and ``cross_val_score``. The fit is the library's own
(``inference.fit_svi``, ``fit_map``, ``fit_mc_dropout``, ``fit_ensemble``, ``fit_mcmc``,
``fit_laplace`` or ``fit_mola``) and ``posterior_`` keeps the ``Posterior`` it returns, for
attention, diagnostics and saving.

Inputs: ``X`` of shape ``(N, T, F)``, ``N`` sequences of ``T`` steps of ``F`` float features,
or 2-D ``(N, P)``, ``N`` flattened sequences read step by step: ``T = P`` steps of one feature,
or ``T = P / step_features`` steps of ``step_features`` features (the layout of ``probtransformer
predict``'s CSV inputs). A 2-D table of ``P`` features is therefore a sequence of ``P`` steps,
one feature each; attention runs over its columns. ``n_features_in_`` is ``T * F``, the number
of values per sample: the width a 2-D ``X`` must have at predict.
"""

from probtransformer.sklearn._base import EXPECTED_FAILED_CHECKS, INFERENCES
from probtransformer.sklearn._classifier import BayesianTransformerClassifier
from probtransformer.sklearn._regressor import BayesianTransformerRegressor

__all__ = [
    "EXPECTED_FAILED_CHECKS",
    "INFERENCES",
    "BayesianTransformerClassifier",
    "BayesianTransformerRegressor",
]
