"""Real-valued targets: ``SequenceRegressor`` (a sequence to one value or ``H`` values) and
``Seq2Seq`` (encoder–decoder with Bayesian cross-attention, for multi-horizon forecasting)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroSample
from torch import nn

from probtransformer import priors
from probtransformer.attention import BayesMultiheadAttention
from probtransformer.encoder import TransformerDecoder
from probtransformer.layers import align_draws, flatten_draws
from probtransformer.models._base import TransformerModel
from probtransformer.models._config import EncoderConfig, takes_encoder_options
from probtransformer.models.heads import check_pooling, pool
from probtransformer.positional import sinusoid_table
from probtransformer.validation import check_sizes, check_values

LIKELIHOODS = ("normal", "student_t")


def _noise_prior(module: _RegressionModel):
    shape = module.output_shape
    loc = torch.zeros(shape, device=module.device_anchor.device)
    return dist.HalfNormal(loc + 1.0).to_event(len(shape))


def _standardizer(value, size: int, name: str, default: float) -> torch.Tensor:
    """A float or ``size`` floats -> float32 ``(size,)``; ``ValueError`` if not finite (> 0)."""
    if value is None:
        value = default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [float(value)] * size
    if not isinstance(value, Sequence) or len(value) != size:
        raise ValueError(f"{name} must be a float or a list of {size} floats, got {value!r}")
    out = torch.tensor([float(v) for v in value], dtype=torch.float32)
    if not torch.isfinite(out).all() or (name.endswith("scale") and (out <= 0).any()):
        raise ValueError(f"{name} must be finite{' and > 0' * name.endswith('scale')}, got {value}")
    return out


def _feature_config(in_features: int, max_len: int, **options) -> EncoderConfig:
    """The ``EncoderConfig`` of a model over feature sequences (``in_features`` required)."""
    if in_features is None:
        raise ValueError("in_features must be an integer >= 1, got None")
    return EncoderConfig(max_len, in_features, **options)


class _RegressionModel(TransformerModel):
    """Shared parts of the real-valued models: standardisation and the likelihood.

    The network works in standardised units: inputs ``(x - x_loc) / x_scale``, outputs ``f``
    mapped back as ``loc = y_loc + y_scale * f``. The noise scale is latent: ``noise_scale ~
    HalfNormal(1)`` per output in standardised units, so ``scale = y_scale * noise_scale``.
    """

    #: Guides start the noise at the targets' sd, not at a prior draw: a draw near 0 makes the
    #: likelihood so sharp that SVI never recovers (found on sunspots: a start at 0.002 ended at
    #: 0.003, the residual sd being about 1 in standardised units).
    initial_values = {"noise_scale": 1.0}

    def _build_likelihood(self, horizon, likelihood, df, x_standardization, y_standardization):
        """Check the likelihood options; register the standardisation ``(loc, scale)`` of the
        inputs and of the targets and the latent noise scale; record them in ``config``."""
        if likelihood not in LIKELIHOODS:
            raise ValueError(f"likelihood must be one of {LIKELIHOODS}, got {likelihood!r}")
        if likelihood == "student_t" and not (isinstance(df, (int, float)) and 2 < df < math.inf):
            raise ValueError(
                f"df must be a finite number > 2 (so the predictive variance exists), got {df!r}"
            )
        if horizon is not None:
            check_sizes(horizon=horizon)
        self.horizon = horizon
        self.output_shape = () if horizon is None else (horizon,)
        self.site_dims = {"noise_scale": ("horizon",)[: len(self.output_shape)]}
        self.likelihood = likelihood
        self.df = float(df)
        (x_loc, x_scale), (y_loc, y_scale) = x_standardization, y_standardization
        F, outputs = self.in_features, horizon or 1
        self.register_buffer("x_loc", _standardizer(x_loc, F, "x_loc", 0.0), persistent=False)
        self.register_buffer("x_scale", _standardizer(x_scale, F, "x_scale", 1.0), persistent=False)
        self.register_buffer("y_loc", _standardizer(y_loc, outputs, "y_loc", 0.0), persistent=False)
        self.register_buffer(
            "y_scale", _standardizer(y_scale, outputs, "y_scale", 1.0), persistent=False
        )
        self.register_buffer("device_anchor", torch.zeros(()), persistent=False)
        self.noise_scale = PyroSample(_noise_prior)
        self.config.update(
            horizon=horizon,
            likelihood=likelihood,
            df=self.df,
            x_loc=self.x_loc.tolist(),
            x_scale=self.x_scale.tolist(),
            y_loc=self.y_loc.tolist(),
            y_scale=self.y_scale.tolist(),
        )

    def _check_targets(self, x: torch.Tensor, y: torch.Tensor) -> None:
        dims = "(N, H)" if self.horizon else "(N,)"
        check_values(y, (x.shape[0], *self.output_shape), dims=dims)

    def _observe(self, f: torch.Tensor, y: torch.Tensor | None, plate: pyro.plate) -> torch.Tensor:
        """``f (s, N, *output_shape)`` standardised outputs -> the likelihood site; returns loc."""
        sigma = flatten_draws(self.noise_scale, len(self.output_shape))  # (s, *out)
        y_loc, y_scale = self.y_loc.view(self.output_shape), self.y_scale.view(self.output_shape)
        loc = align_draws(y_loc + y_scale * f)  # (*draws, N, *out)
        scale = align_draws((y_scale * sigma)[:, None])  # (*draws, 1, *out)
        if self.likelihood == "normal":
            fn = dist.Normal(loc, scale)
        else:
            fn = dist.StudentT(torch.tensor(self.df, device=loc.device), loc, scale)
        with plate:
            if y is None:
                pyro.deterministic("loc", loc, event_dim=len(self.output_shape))
            pyro.sample(self.likelihood_site, fn.to_event(len(self.output_shape)), obs=y)
        return loc

    def _standardize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.x_loc) / self.x_scale


class SequenceRegressor(_RegressionModel):
    """Sequence-to-value regression and direct multi-horizon forecasting.

    ``x (N, T, F)`` -> standardise -> embedding + positions -> encoder -> pooling -> linear ->
    ``H`` outputs (or one) -> ``y ~ Normal(loc, scale)`` or ``StudentT(df, loc, scale)`` inside
    ``pyro.plate("data")``, with a latent noise scale per output (see ``_RegressionModel``).
    Predictions (``Posterior.predict``) are a ``RegressionPrediction``: predictive intervals,
    the variance split into aleatoric and epistemic parts, CRPS via
    ``probtransformer.metrics.crps_samples``.

    Args:
        in_features: features per step ``F``.
        max_len: longest sequence ``T``.
        horizon: number of outputs ``H`` (``y`` is ``(N, H)``), or None for one value
            (``y`` is ``(N,)``).
        likelihood: ``"normal"`` or ``"student_t"`` (heavy tails, fixed ``df > 2``).
        df: degrees of freedom of the Student-t likelihood.
        pooling: ``"mean"`` over real steps or ``"last"`` real step (forecasting).
        x_loc, x_scale: per-feature standardisation of the inputs (floats or ``F`` floats;
            ``datasets.load`` gives them from the training split in ``meta``).
        y_loc, y_scale: standardisation of the targets (floats or ``H`` floats).
        Others: as ``SequenceClassifier``.

    Shapes:
        ``forward(x, y=None, mask=None, *, num_data=None)``: ``x (N, T, F)`` float features in
        the data's units, ``y (N,)`` or ``(N, H)`` float targets or None, ``mask (N, T)`` bool or
        None -> ``loc (*draws, N, *output_shape)``: the mean of ``y`` under each draw.

    Raises:
        ValueError: unknown ``likelihood`` or ``pooling``, ``df <= 2``, a non-positive scale,
            standardisation of the wrong length; others as ``SequenceClassifier``.
    """

    @takes_encoder_options
    def __init__(
        self,
        in_features: int,
        max_len: int,
        *,
        horizon: int | None = None,
        likelihood: str = "normal",
        df: float = 4.0,
        pooling: str = "mean",
        x_loc: float | Sequence[float] = 0.0,
        x_scale: float | Sequence[float] = 1.0,
        y_loc: float | Sequence[float] = 0.0,
        y_scale: float | Sequence[float] = 1.0,
        grid: tuple[int, int] | None = None,
        **options,
    ) -> None:
        super().__init__()
        check_pooling(pooling, ("mean", "last"))
        self._build_encoder(_feature_config(in_features, max_len, grid=grid, **options))
        self._build_likelihood(horizon, likelihood, df, (x_loc, x_scale), (y_loc, y_scale))
        self.pooling = pooling
        self.config["pooling"] = pooling
        self._build_head(horizon or 1)

    def _forward(self, x, y, mask, plate) -> torch.Tensor:
        h, key_mask = self._encode(self._standardize(x), mask, plate)  # (s, N, T, d)
        f = self.head(pool(h, key_mask, self.pooling))  # (s, N, H or 1)
        return self._observe(f if self.horizon else f[..., 0], y, plate)


class Seq2Seq(_RegressionModel):
    """Encoder–decoder Transformer with Bayesian cross-attention for multi-horizon forecasts.

    The encoder reads the past ``x (N, T, F)``; the decoder has one query per future step
    ``h = 1..H`` (a learned vector plus the sinusoidal code of position ``T + h``), which
    attend to each other (``"decoder.self"``) and to the encoded past (``"decoder.cross"``,
    ``(H, T)`` weights: which past steps each forecast relies on). A linear map of each
    query's output gives the forecast ``loc (N, H)``; the likelihood is as for
    ``SequenceRegressor``. All forecasts come from one pass (no autoregressive feedback), as in
    direct multi-horizon forecasting (Lim et al. 2021, Temporal Fusion Transformers).

    ``Posterior.attention(x, module=...)`` takes ``"encoder.self"`` (``T x T``),
    ``"decoder.self"`` (``H x H``) or ``"decoder.cross"`` (``H x T``).

    Args:
        in_features: features per step ``F``.
        max_len: longest past ``T``.
        horizon: number of future steps ``H``.
        num_decoder_layers: decoder blocks (default: ``num_layers``).
        Others: as ``SequenceRegressor``. Guidance and stochastic attention priors apply to
            the encoder's self-attention; the decoder gets the ``LogitScalePrior`` (if given)
            and the head gates.

    Shapes:
        ``forward(x, y=None, mask=None, *, num_data=None)``: ``x (N, T, F)`` the past in the
        data's units, ``y (N, H)`` float future values or None, ``mask (N, T)`` bool or None ->
        ``loc (*draws, N, H)``: the forecast mean under each draw.

    Raises:
        ValueError, TypeError: as ``SequenceRegressor``.
    """

    @takes_encoder_options
    def __init__(
        self,
        in_features: int,
        max_len: int,
        horizon: int,
        *,
        num_decoder_layers: int | None = None,
        likelihood: str = "normal",
        df: float = 4.0,
        x_loc: float | Sequence[float] = 0.0,
        x_scale: float | Sequence[float] = 1.0,
        y_loc: float | Sequence[float] = 0.0,
        y_scale: float | Sequence[float] = 1.0,
        **options,
    ) -> None:
        super().__init__()
        config = _feature_config(in_features, max_len, **options)
        check_sizes(horizon=horizon)
        num_decoder_layers = config.num_layers if num_decoder_layers is None else num_decoder_layers
        check_sizes(num_decoder_layers=num_decoder_layers)
        self._build_encoder(config)
        self._build_likelihood(horizon, likelihood, df, (x_loc, x_scale), (y_loc, y_scale))
        self.config["num_decoder_layers"] = num_decoder_layers
        decoder_priors = tuple(
            spec for spec in config.attention_prior if isinstance(spec, priors.LogitScalePrior)
        )
        self.decoder = TransformerDecoder(
            num_decoder_layers,
            config.d_model,
            config.num_heads,
            config.d_ff,
            attention_prior=decoder_priors,
            **config.block_options(),
        )
        self.queries = nn.Parameter(torch.empty(horizon, config.d_model))  # one per future step
        self.reset_parameters()
        code = sinusoid_table(max_len + horizon, config.d_model)[max_len:]  # positions T+1..T+H
        self.register_buffer("query_positions", code, persistent=False)  # (H, d)
        self._build_head(1)

    def reset_parameters(self) -> None:
        """Re-draw the decoder queries from N(0, 0.02²) (every fit does, from its seed)."""
        nn.init.normal_(self.queries, std=0.02)

    @property
    def attention_modules(self) -> dict[str, list[BayesMultiheadAttention]]:
        """``"encoder.self"``, ``"decoder.self"`` and ``"decoder.cross"``, one per layer."""
        return {"encoder.self": self.encoder.attention_modules, **self.decoder.attention_modules}

    def _forward(self, x, y, mask, plate) -> torch.Tensor:
        memory, key_mask = self._encode(self._standardize(x), mask, plate)  # (s, N, T, d)
        queries = flatten_draws(self.queries, 2) + self.query_positions  # (s, H, d): one per draw
        queries = queries[:, None].expand(-1, x.shape[0], -1, -1)  # (s, N, H, d)
        h = self.decoder(queries, memory, memory_mask=key_mask)  # (s, N, H, d)
        return self._observe(self.head(h)[..., 0], y, plate)  # head: (s, N, H, 1)
