"""``BayesianTransformerRegressor``: a ``SequenceRegressor`` with scikit-learn's API."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from sklearn.base import RegressorMixin

from probtransformer.sklearn._base import DOCSTRING_PARAMETERS, BayesianTransformer, check_choice


class BayesianTransformerRegressor(RegressorMixin, BayesianTransformer):
    """A Bayesian Transformer sequence regressor with scikit-learn's estimator API.

    ``fit`` builds a ``models.SequenceRegressor(F, T, horizon=H)`` (``H`` outputs for a 2-D
    ``y``) with the inputs standardised per feature and the targets per output by the training
    rows' mean and sd (the model's ``x_loc``/``x_scale``/``y_loc``/``y_scale``), a latent noise
    scale and the chosen ``likelihood``, and fits it with the library's ``inference``.
    ``predict`` is the posterior predictive mean; ``predict(X, return_std=True)``,
    ``predict_interval`` and ``predict_uncertainty`` give its spread, split into aleatoric
    (noise) and epistemic (posterior) variance.

    Args:
        likelihood: ``"normal"`` or ``"student_t"`` (``model_options={{"df": ...}}``).
        {parameters}
    Attributes:
        n_features_in_: values per sample, ``T * F``.
        feature_names_in_: column names of a DataFrame ``X`` (2-D only).
        input_shape_: ``(T, F)``.
        posterior_: the fitted ``inference.Posterior`` (inputs and targets in their units).
        seed_: the seed of the fit and of every prediction.

    scikit-learn's estimator checks pass except those in ``EXPECTED_FAILED_CHECKS`` (as for
    the classifier).

    Raises:
        ValueError: at ``fit``: an ``inference`` not among ``INFERENCES``, NaN/inf or
            non-numeric ``X`` or ``y``, ``X`` not 2-D or 3-D, ``y`` not 1-D or 2-D, bad sizes
            (the model's message).
    """

    def __init__(
        self,
        *,
        likelihood: str = "normal",
        inference: str = "svi",
        d_model: int = 32,
        num_heads: int = 4,
        num_layers: int = 1,
        d_ff: int = 64,
        dropout: float = 0.1,
        num_steps: int = 1000,
        batch_size: int = 128,
        lr: float = 3e-3,
        n_members: int = 5,
        kernel: str = "chees",
        num_chains: int = 4,
        num_warmup: int = 50,
        num_draws: int = 25,
        laplace_subset: str | list[str] = "head",
        hessian: str = "full",
        prior_precision: str | float = "marglik",
        predictive: str = "glm",
        num_samples: int = 100,
        step_features: int | None = None,
        model_options: dict | None = None,
        fit_options: dict | None = None,
        device: str = "auto",
        random_state: int | np.random.RandomState | None = None,
        progress: bool = False,
    ) -> None:
        super().__init__(
            inference=inference,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_layers,
            d_ff=d_ff,
            dropout=dropout,
            num_steps=num_steps,
            batch_size=batch_size,
            lr=lr,
            n_members=n_members,
            kernel=kernel,
            num_chains=num_chains,
            num_warmup=num_warmup,
            num_draws=num_draws,
            laplace_subset=laplace_subset,
            hessian=hessian,
            prior_precision=prior_precision,
            predictive=predictive,
            num_samples=num_samples,
            step_features=step_features,
            model_options=model_options,
            fit_options=fit_options,
            device=device,
            random_state=random_state,
            progress=progress,
        )
        self.likelihood = likelihood

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        return tags

    def fit(self, X, y) -> BayesianTransformerRegressor:
        """Fit the posterior of a ``SequenceRegressor`` to ``(X, y)``.

        Args:
            X: ``(N, T, F)`` float sequences, or ``(N, T * F)`` (see the module docstring).
            y: ``(N,)`` real targets, or ``(N, H)`` for ``H`` outputs per sequence.

        Returns:
            self.

        Raises:
            ValueError: see the class docstring.
            NonFiniteELBOError: the fit diverged (lower ``lr``).
        """
        from probtransformer.data import SequenceData
        from probtransformer.models import SequenceRegressor

        check_choice(self.inference)
        x, y = self._fit_inputs(X, y, multi_output=True, y_numeric=True)
        y = y.astype(np.float64)
        steps, features = self.input_shape_
        flat = x.reshape(-1, features).astype(np.float64)
        outputs = y.reshape(len(y), -1)
        scales = dict(
            x_loc=flat.mean(0).tolist(),
            x_scale=_scale(flat.std(0)),
            y_loc=outputs.mean(0).tolist(),
            y_scale=_scale(outputs.std(0)),
        )
        horizon = y.shape[1] if y.ndim == 2 else None
        options = {"likelihood": self.likelihood, **scales, **self._model_kwargs()}
        model = SequenceRegressor(features, steps, horizon=horizon, **options)
        data = SequenceData(torch.from_numpy(np.ascontiguousarray(x)), y.astype(np.float32))
        self._fit_posterior(model, data)
        return self

    def _targets(self, y) -> torch.Tensor:
        return torch.as_tensor(np.asarray(y, dtype=np.float32))

    def predict(self, X, return_std: bool = False):
        """The posterior predictive mean ``E[y | x, data]``.

        Args:
            X: ``(N, T, F)`` or ``(N, T * F)`` float array of the fitted shape.
            return_std: also return the predictive standard deviation (noise and posterior).

        Returns:
            ``(N,)`` float64 (``(N, H)`` for a 2-D ``y`` in ``fit``), and with ``return_std``
            the tuple ``(mean, std)`` of that shape.

        Raises:
            NotFittedError: before ``fit``.
            ValueError: NaN/inf, not 2-D or 3-D, or another number of values per sample
                than ``n_features_in_`` (the message names both).
        """
        pred = self._predict(X)
        mean = pred.mean.double().numpy()
        if return_std:
            return mean, pred.std.double().numpy()
        return mean

    def predict_interval(self, X, prob: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
        """Equal-tailed posterior predictive interval of a new observation (noise included).

        Args:
            X: as for ``predict``.
            prob: the interval's probability, in (0, 1).

        Returns:
            ``(lower, upper)``, each of ``predict``'s shape, float64.

        Raises:
            NotFittedError, ValueError: as ``predict``; ``prob`` outside (0, 1).
        """
        lower, upper = self._predict(X).predictive_interval(prob)
        return lower.double().numpy(), upper.double().numpy()

    def predict_uncertainty(self, X) -> pd.DataFrame:
        """Predictive spread per row (``inference.RegressionPrediction.to_dataframe``).

        Returns:
            DataFrame of ``N`` rows: ``mean``, ``std``, ``aleatoric`` and ``epistemic``
            (variances: the expected noise variance and the posterior variance of the
            regression function), ``lower``/``upper`` (90% predictive interval); ``name[j]``
            per output for 2-D targets.

        Raises:
            NotFittedError, ValueError: as ``predict``.
        """
        return self._predict(X).to_dataframe()


def _scale(sd: np.ndarray) -> list[float]:
    """Standard deviations as the model's scales: 1 where a column is constant."""
    return np.where(sd > 1e-12, sd, 1.0).tolist()


BayesianTransformerRegressor.__doc__ = BayesianTransformerRegressor.__doc__.format(
    parameters=DOCSTRING_PARAMETERS.strip("\n").lstrip()
)
