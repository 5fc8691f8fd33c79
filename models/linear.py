"""Bayesian linear regression with a conjugate Normal prior: the reference model with a known
posterior, against which every inference method is checked."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroSample

from probtransformer.models._base import ProtocolModel
from probtransformer.validation import check_int


def _weight_prior(module: BayesianLinearRegression):
    scale = torch.tensor(module.prior_scale, device=module.device_anchor.device)
    return dist.Normal(torch.zeros_like(scale), scale).expand([module.in_features]).to_event(1)


def _bias_prior(module: BayesianLinearRegression):
    scale = torch.tensor(module.prior_scale, device=module.device_anchor.device)
    return dist.Normal(torch.zeros_like(scale), scale)


class BayesianLinearRegression(ProtocolModel):
    """``y = x @ weight + bias + eps``, ``eps ~ N(0, noise_scale²)`` with known noise and
    independent ``N(0, prior_scale²)`` priors on ``weight`` (P,) and ``bias``.

    The prediction estimates ``E[y | x]``; the prior is conjugate, so the posterior is Gaussian in
    closed form (``analytic_posterior``; Bishop 2006, *Pattern Recognition and Machine
    Learning*, §3.3). It is the model the correctness tests hold every fit against.

    Args:
        in_features: number of inputs ``P``.
        prior_scale: prior standard deviation of every coefficient (> 0).
        noise_scale: known observation noise standard deviation (> 0).
        fit_intercept: add a latent ``bias`` site.

    Raises:
        ValueError: ``in_features < 1`` or a non-positive scale.
    """

    def __init__(
        self,
        in_features: int,
        *,
        prior_scale: float = 1.0,
        noise_scale: float = 1.0,
        fit_intercept: bool = True,
    ) -> None:
        super().__init__()
        check_int("in_features", in_features)
        for name, value in (("prior_scale", prior_scale), ("noise_scale", noise_scale)):
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        self.in_features = in_features
        self.prior_scale = float(prior_scale)
        self.noise_scale = float(noise_scale)
        self.fit_intercept = fit_intercept
        self.config = dict(
            in_features=in_features,
            prior_scale=self.prior_scale,
            noise_scale=self.noise_scale,
            fit_intercept=fit_intercept,
        )
        self.register_buffer("device_anchor", torch.zeros(()), persistent=False)
        self.weight = PyroSample(_weight_prior)
        if fit_intercept:
            self.bias = PyroSample(_bias_prior)

    def validate(
        self, x: torch.Tensor, y: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> None:
        """Check ``x`` (N, P) float, ``y`` (N,) float, no mask.

        Raises:
            TypeError: not tensors, or not floating point.
            ValueError: wrong shapes, N = 0, non-finite values, or a mask.
        """
        P = self.in_features
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"x must be a float tensor of shape (N, P={P}), got {got}")
        if x.dim() != 2 or x.shape[1] != P or x.shape[0] == 0:
            raise ValueError(f"x must have shape (N >= 1, P={P}), got {tuple(x.shape)}")
        if not torch.isfinite(x).all():
            raise ValueError("x contains NaN or inf values")
        if mask is not None:
            raise ValueError("mask must be None: BayesianLinearRegression inputs are not sequences")
        if y is not None:
            if not isinstance(y, torch.Tensor) or not y.is_floating_point():
                got = f"dtype {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
                raise TypeError(f"y must be a float tensor of shape (N,), got {got}")
            if y.device != x.device:
                raise ValueError(f"y is on {y.device} but x is on {x.device}")
            if tuple(y.shape) != (x.shape[0],):
                raise ValueError(f"y must have shape (N,)=({x.shape[0]},), got {tuple(y.shape)}")
            if not torch.isfinite(y).all():
                raise ValueError("y contains NaN or inf values")

    def _forward(self, x, y, mask, plate) -> torch.Tensor:
        """Observe (or sample) ``y``; returns ``E[y | x, weight, bias]`` of shape ``(*draws, N)``.

        ``x`` is ``(N, P)``; ``mask`` must be None (accepted for the model protocol).
        """
        # Under a vectorizing plate at dim -2 the latents arrive as (S, 1, P) and (S, 1): the 1
        # is the data plate's place, so plain broadcasting gives (S, N).
        weight = self.weight  # (*draws, P); read before the data plate
        loc = (weight * x).sum(-1)  # (*draws, N)
        if self.fit_intercept:
            loc = loc + self.bias
        with plate:
            pyro.sample(self.likelihood_site, dist.Normal(loc, self.noise_scale), obs=y)
        return loc

    def design(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, P + fit_intercept)`` design matrix: ``x`` with a column of ones for the bias."""
        if not self.fit_intercept:
            return x
        return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], -1)

    def analytic_posterior(
        self, x: torch.Tensor, y: torch.Tensor
    ) -> torch.distributions.MultivariateNormal:
        """Exact posterior of ``concat([weight, bias])`` given ``(x, y)``, in float64.

        With design ``X``, prior ``N(0, a² I)`` and noise ``s``: covariance
        ``Σ = (XᵀX / s² + I / a²)⁻¹`` and mean ``Σ Xᵀ y / s²``.

        Returns:
            ``MultivariateNormal`` over ``P + 1`` coefficients (``P`` without intercept).

        Raises:
            TypeError/ValueError: malformed ``x``/``y`` (see ``validate``).
        """
        if y is None:
            raise TypeError("y must be a float tensor of shape (N,), got None")
        self.validate(x, y)
        X = self.design(x.double().cpu())
        precision = X.T @ X / self.noise_scale**2
        precision += torch.eye(X.shape[1], dtype=X.dtype) / self.prior_scale**2
        covariance = torch.linalg.inv(precision)
        covariance = (covariance + covariance.T) / 2
        mean = covariance @ X.T @ y.double().cpu() / self.noise_scale**2
        return torch.distributions.MultivariateNormal(mean, covariance_matrix=covariance)
