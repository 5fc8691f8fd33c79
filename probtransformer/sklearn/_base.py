"""What both scikit-learn estimators share: their parameters, input validation, the fit and
pickling (see ``probtransformer.sklearn``)."""

from __future__ import annotations

import numbers
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_array, check_is_fitted

from probtransformer.methods import LAPLACE_BASED, METHODS

try:
    from sklearn.utils.validation import validate_data
except ImportError:  # scikit-learn < 1.6: the method that validate_data replaced

    def validate_data(estimator, /, X="no_validation", y="no_validation", **kwargs):
        return estimator._validate_data(X, y, **kwargs)


#: The values of ``inference``: the library's fit functions they call (every method of
#: ``probtransformer.methods`` but MILE, whose ensemble the estimators' settings do not size).
INFERENCES = {name: fit for name, fit in METHODS.items() if name != "mile"}
#: The checks of scikit-learn's ``check_estimator`` that may fail, with why; pass it as
#: ``check_estimator(estimator, expected_failed_checks=EXPECTED_FAILED_CHECKS)``. Every other
#: check passes.
EXPECTED_FAILED_CHECKS = {
    # float32 forward passes are not bitwise invariant to the rows batched together (the matrix
    # products block the rows differently), so a row predicted within a subset or a permutation
    # of X can differ from the full batch's by about one float32 ulp (1e-7 relative): the
    # checks' tolerance is rtol=1e-7. They pass or fail by the draw of the data.
    "check_methods_subset_invariance": "float32 predictions differ by ~1 ulp across batches",
    "check_methods_sample_order_invariance": "float32 predictions differ by ~1 ulp across batches",
    # The training-score bars (accuracy 0.83 on blobs, R^2 0.5 on one informative column of
    # ten) need a fit budget, not the few steps that keep the other checks fast: with 60 steps
    # (classifier, d_model 8) or 300 (regressor) they pass.
    "check_classifiers_train": "needs a fit budget of about 60 SVI steps",
    "check_regressors_train": "needs a fit budget of about 300 SVI steps",
}
#: ``fit_svi``'s ``init_scale`` for ``inference="svi"`` (``fit_options`` overrides it). Adam
#: moves a log-scale by about ``lr`` per step, so from ``fit_svi``'s 1e-3 the estimator's
#: 1,000 steps at lr 3e-3 leave every guide sd near 1e-3 x e^1.2: a point, epistemic
#: uncertainty 2e-3 nats on breast cancer and 7e-5 on the README's digits example (issue 44).
#: From 0.1 (Pyro's ``AutoNormal`` default) the sds settle where the ELBO puts them:
#: epistemic 0.063 nats and a lower test NLL on breast cancer (``benchmarks/BENCHMARKS.md``).
SVI_INIT_SCALE = 0.1
#: Settings of the MAP-based fits (every inference but mcmc), by estimator parameter.
_SVI_SETTINGS = ("num_steps", "batch_size", "lr")
#: Settings of ``fit_mcmc``: estimator parameter -> ``fit_mcmc`` argument.
_MCMC_SETTINGS = {
    "kernel": "kernel",
    "num_chains": "num_chains",
    "num_warmup": "num_warmup",
    "num_draws": "num_samples",
    "num_steps": "map_steps",
}
#: Settings of ``fit_laplace`` (and ``fit_mola``): estimator parameter -> their argument.
_LAPLACE_SETTINGS = {
    "laplace_subset": "subset",
    "hessian": "hessian",
    "prior_precision": "prior_precision",
    "predictive": "predictive",
}
DOCSTRING_PARAMETERS = """
        inference: ``"svi"`` (mean-field variational inference, ``fit_svi``), ``"map"``
            (``fit_map``), ``"mc-dropout"`` (``fit_mc_dropout``), ``"ensemble"`` (a deep
            ensemble of MAP fits, ``fit_ensemble``), ``"mcmc"`` (``fit_mcmc``), ``"laplace"``
            (a Laplace approximation around a MAP fit, ``fit_laplace``) or ``"mola"`` (one
            around every member of a deep ensemble, ``fit_mola``).
        d_model: model width (a multiple of ``num_heads``).
        num_heads: attention heads per layer.
        num_layers: Transformer blocks.
        d_ff: feed-forward hidden width; 0 for none.
        dropout: dropout probability while training (the point-estimate parts; the masks of
            ``"mc-dropout"``).
        num_steps: optimisation steps of SVI, MAP and each ensemble member; with ``"mcmc"``,
            the MAP steps of the point-estimate parameters (``map_steps``).
        batch_size: sequences per optimisation step (capped at ``N``).
        lr: initial Adam learning rate.
        n_members: ensemble members (``"ensemble"`` and ``"mola"``).
        kernel, num_chains, num_warmup, num_draws: ``fit_mcmc``'s ``kernel``, ``num_chains``,
            ``num_warmup`` and ``num_samples`` (kept draws per chain; ``"mcmc"`` only).
        laplace_subset, hessian, prior_precision, predictive: ``fit_laplace``'s ``subset``
            (``"head"``, ``"attention"``, ``"all"`` or a list of latent site names),
            ``hessian`` (``"full"`` or ``"diag"``), ``prior_precision`` (``"marglik"``,
            ``"prior"`` or a number > 0) and ``predictive`` (``"glm"`` or ``"nn"``;
            ``"laplace"`` and ``"mola"`` only). The mode is fitted with ``num_steps``,
            ``batch_size`` and ``lr``.
        num_samples: posterior draws per prediction, None for every draw (point estimates use
            one; ensembles and sampled posteriors at most those they hold); with ``"laplace"``
            and ``"mola"`` also the draws the fit keeps (None: ``fit_laplace``'s 100).
        step_features: features per step ``F`` of a 2-D ``X`` ``(N, T * F)``; None reads a 2-D
            ``X`` as ``T = P`` steps of one feature. Ignored for 3-D ``X``.
        model_options: more keyword arguments of the model (``bayesian``, ``weight_prior``,
            ``pooling``, ``positions`` ...); they override the sizes above.
        fit_options: more keyword arguments of the fit function (``guide``, ``lr_decay``,
            ``init``, ...); they override the settings above, and ``"svi"``'s initial guide sd
            ``init_scale=0.1`` (``fit_svi``'s 1e-3 leaves a 1,000-step fit a point estimate).
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` ...
        random_state: an int seeds the fit and every prediction (``seed=random_state`` of the
            library's functions); None or a ``numpy.random.RandomState`` draws that seed at
            each ``fit`` (kept in ``seed_``).
        progress: show the fit's progress bar.
"""


def _mcmc_objects(settings: dict[str, Any]) -> dict[str, Any]:
    """``fit_mcmc``'s settings with the kernel's name and the kernel and start settings among
    ``fit_options`` (``init``, ``target_accept_prob`` ...) made its settings objects."""
    from probtransformer.inference.mcmc.legacy import SETTINGS, settings_objects

    own = ("init", "num_starts", *SETTINGS)
    settings = dict(settings)
    named = {name: settings.pop(name) for name in own if name in settings}
    settings["kernel"], settings["starts"] = settings_objects(settings["kernel"], **named)
    return settings


def check_choice(inference: object) -> str:
    if not isinstance(inference, str) or inference not in INFERENCES:
        raise ValueError(f"inference must be one of {tuple(INFERENCES)}, got {inference!r}")
    return inference


def _seed(random_state: object) -> int:
    """The library seed for ``random_state``: an int as it is, else one drawn from it."""
    if isinstance(random_state, numbers.Integral) and not isinstance(random_state, bool):
        return int(random_state)
    return int(check_random_state(random_state).randint(np.iinfo(np.int32).max))


class BayesianTransformer(BaseEstimator):
    """What both estimators share: parameters, input validation, the fit and pickling."""

    def __init__(
        self,
        *,
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
        self.inference = inference
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.d_ff = d_ff
        self.dropout = dropout
        self.num_steps = num_steps
        self.batch_size = batch_size
        self.lr = lr
        self.n_members = n_members
        self.kernel = kernel
        self.num_chains = num_chains
        self.num_warmup = num_warmup
        self.num_draws = num_draws
        self.laplace_subset = laplace_subset
        self.hessian = hessian
        self.prior_precision = prior_precision
        self.predictive = predictive
        self.num_samples = num_samples
        self.step_features = step_features
        self.model_options = model_options
        self.fit_options = fit_options
        self.device = device
        self.random_state = random_state
        self.progress = progress

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.three_d_array = True
        return tags

    # -- inputs ---------------------------------------------------------------------------

    def _fit_inputs(self, X, y, **y_options) -> tuple[np.ndarray, np.ndarray]:
        """Validate ``X`` and ``y``; set ``n_features_in_`` and ``input_shape_``; return X as
        float32 ``(N, T, F)``.

        Raises:
            ValueError: ``num_samples`` is neither None nor an int >= 1, or ``X`` has another
                shape.
        """
        n = self.num_samples
        if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1):
            raise ValueError(f"num_samples must be None (every draw) or an int >= 1, got {n!r}")
        X, y = validate_data(
            self, X, y, allow_nd=True, dtype=(np.float64, np.float32), reset=True, **y_options
        )
        if X.ndim == 2:
            steps, features = self._steps_of(X.shape[1])
        elif X.ndim == 3:
            steps, features = X.shape[1:]
            self.n_features_in_ = steps * features
        else:
            raise ValueError(
                f"X must be 3-D (N, T, F) sequences or 2-D (N, T * F), got shape {X.shape}"
            )
        self.input_shape_ = (int(steps), int(features))
        return X.reshape(X.shape[0], steps, features).astype(np.float32, copy=False), y

    def _steps_of(self, width: int) -> tuple[int, int]:
        features = self.step_features
        if features is None:
            return width, 1
        if isinstance(features, bool) or not isinstance(features, numbers.Integral):
            raise ValueError(f"step_features must be an int >= 1 or None, got {features!r}")
        if features < 1 or width % features:
            raise ValueError(
                f"X has {width} features, which is not a whole number of steps of "
                f"step_features={features} features"
            )
        return width // features, int(features)

    def _inputs(self, X) -> torch.Tensor:
        """Validate ``X`` against the fitted shape; float32 ``(N, T, F)`` tensor.

        Raises:
            ValueError: NaN/inf, not 2-D or 3-D, or another number of values per sample
                (names the expected and the given counts) or another ``(T, F)``.
        """
        check_is_fitted(self)
        steps, features = self.input_shape_
        name = type(self).__name__
        given = X
        X = check_array(
            X, allow_nd=True, dtype=(np.float64, np.float32), estimator=self, input_name="X"
        )
        if X.ndim == 3:
            if X.shape[1:] != self.input_shape_:
                raise ValueError(
                    f"X has sequences of shape (T, F)={X.shape[1:]}, but {name} is expecting "
                    f"{self.input_shape_} as input"
                )
            validate_data(self, X.reshape(X.shape[0], -1), reset=False, skip_check_array=True)
        elif X.ndim == 2:  # the DataFrame as given: its column names against fit's
            validate_data(self, given, reset=False, skip_check_array=True)
        else:
            raise ValueError(
                f"X must be 3-D (N, T, F) sequences or 2-D (N, T * F), got shape {X.shape}"
            )
        x = X.reshape(X.shape[0], steps, features).astype(np.float32, copy=False)
        return torch.from_numpy(np.ascontiguousarray(x))

    # -- fit ------------------------------------------------------------------------------

    def _model_kwargs(self) -> dict[str, Any]:
        kwargs = dict(
            d_model=self.d_model,
            num_heads=self.num_heads,
            num_layers=self.num_layers,
            d_ff=self.d_ff,
            dropout=self.dropout,
        )
        return {**kwargs, **(self.model_options or {})}

    def _fit_posterior(self, model, data) -> None:
        """Fit ``model`` to ``data`` with the chosen inference; set ``posterior_``."""
        from probtransformer import inference as fits

        method = check_choice(self.inference)
        self.seed_ = _seed(self.random_state)
        settings: dict[str, Any] = dict(device=self.device, seed=self.seed_, progress=self.progress)
        if method == "mcmc":
            settings |= {arg: getattr(self, name) for name, arg in _MCMC_SETTINGS.items()}
        else:
            settings |= {name: getattr(self, name) for name in _SVI_SETTINGS}
        if method in ("ensemble", "mola"):
            settings["n_members"] = self.n_members
        if method in LAPLACE_BASED:
            settings |= {arg: getattr(self, name) for name, arg in _LAPLACE_SETTINGS.items()}
            if self.num_samples is not None:
                settings["num_samples"] = self.num_samples
        if method == "svi":
            settings["init_scale"] = SVI_INIT_SCALE
        settings |= self.fit_options or {}
        if method == "mcmc" and isinstance(settings["kernel"], str):
            settings = _mcmc_objects(settings)
        self.posterior_ = getattr(fits, INFERENCES[method])(model, data, **settings)
        self._training_data = data

    def _predict(self, X):
        """The library's ``Prediction`` or ``RegressionPrediction`` of ``X``."""
        x = self._inputs(X)
        return self.posterior_.predict(x, num_samples=self.num_samples, seed=self.seed_)

    def predict_distribution(self, X):
        """The posterior predictive of ``X`` as the library returns it.

        Args:
            X: ``(N, T, F)`` or ``(N, T * F)`` float array.

        Returns:
            ``inference.Prediction`` (classifier: ``probs (S, N, C)``, columns in the order of
            the encoded labels, i.e. of ``classes_``) or ``inference.RegressionPrediction``
            (``samples``, ``loc``, ``variance``, each ``(S, N[, H])``), from ``num_samples``
            draws seeded by ``seed_``.

        Raises:
            NotFittedError: before ``fit``.
            ValueError: malformed ``X`` (see ``predict``).
        """
        return self._predict(X)

    def to_inference_data(self, X=None, y=None, **options):
        """The fitted posterior as ArviZ ``InferenceData`` (``Posterior.to_inference_data``).

        Args:
            X, y: the rows of the ``log_likelihood``, ``posterior_predictive`` and
                ``observed_data`` groups; None (both): the training rows. Classifier labels
                appear as their index in ``classes_``; regression targets in their units.
            **options: ``Posterior.to_inference_data``'s keyword arguments (``num_samples``,
                ``seed``, ``attention_obs``).

        Returns:
            ``arviz.InferenceData`` with ``posterior`` (latent sites and attention),
            ``log_likelihood`` (dim ``obs``, for ``az.loo``), ``posterior_predictive`` and
            ``observed_data``, plus ``sample_stats`` for MCMC.

        Raises:
            NotFittedError: before ``fit``.
            ValueError: only one of ``X`` and ``y``, or malformed ones.
        """
        from probtransformer.data import SequenceData

        check_is_fitted(self)
        if (X is None) != (y is None):
            raise ValueError("give both X and y, or neither for the training rows")
        data = self._training_data
        if X is not None:
            data = SequenceData(self._inputs(X), self._targets(y))
        return self.posterior_.to_inference_data(data, **options)

    # -- pickling: a Posterior holds Pyro closures; it travels as its saved files ----------

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())  # object.__getstate__ gives __dict__ itself
        posterior = state.get("posterior_")
        if posterior is not None:
            with tempfile.TemporaryDirectory() as tmp:
                posterior.save(Path(tmp) / "posterior")
                files = {p.name: p.read_bytes() for p in (Path(tmp) / "posterior").iterdir()}
            state["posterior_"] = files
        return state

    def __setstate__(self, state: dict) -> None:
        files = state.get("posterior_")
        if isinstance(files, dict):
            from probtransformer.inference import load_posterior

            with tempfile.TemporaryDirectory() as tmp:
                for name, content in files.items():
                    (Path(tmp) / name).write_bytes(content)
                device = state.get("device", "auto")
                state["posterior_"] = load_posterior(tmp, device=device)
        super().__setstate__(state)
