"""Real-valued targets: ``SequenceRegressor`` (a sequence to one value or ``H`` values) and
``Seq2Seq`` (encoder–decoder with Bayesian cross-attention, for multi-horizon forecasting)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroSample
from torch import nn

from probtransformer import priors
from probtransformer.attention import BayesMultiheadAttention
from probtransformer.encoder import TransformerDecoder
from probtransformer.layers import BayesLinear, flatten_draws
from probtransformer.models._base import (
    TransformerModel,
    align_draws,
    check_sizes,
    check_values,
    data_plate_for,
)
from probtransformer.positional import sinusoid_table

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

    def _build_likelihood(self, *, horizon, likelihood, df, x_loc, x_scale, y_loc, y_scale):
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
        outputs = horizon or 1
        F = self.in_features
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

    def validate(
        self, x: torch.Tensor, y: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> None:
        """Check inputs: ``x`` as ``check_sequence_inputs``, ``y`` finite float ``(N,)`` (no
        ``horizon``) or ``(N, horizon)``.

        Raises:
            TypeError, ValueError: see ``check_sequence_inputs`` and ``check_values``.
        """
        self._check_inputs(x, y, mask)
        if y is not None:
            check_values(
                y, (x.shape[0], *self.output_shape), dims="(N, H)" if self.horizon else "(N,)"
            )

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

    Raises:
        ValueError: unknown ``likelihood`` or ``pooling``, ``df <= 2``, a non-positive scale,
            standardisation of the wrong length; others as ``SequenceClassifier``.
    """

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
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        d_ff: int = 128,
        dropout: float = 0.1,
        norm_first: bool = True,
        layer_norm: bool = True,
        hard_attention: bool = False,
        bayesian: Iterable[str] | str = ("attention", "head"),
        weight_prior: priors.Normal | None = priors.Normal(scale=3.0),
        attention_prior=priors.LogitScalePrior(),
        head_prior: priors.HeadGatePrior | None = None,
    ) -> None:
        super().__init__()
        if pooling not in ("mean", "last"):
            raise ValueError(f"pooling must be 'mean' or 'last', got {pooling!r}")
        if in_features is None:
            raise ValueError("in_features must be an integer >= 1, got None")
        self._build_encoder(
            in_features=in_features,
            vocab_size=None,
            max_len=max_len,
            grid=grid,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_layers,
            d_ff=d_ff,
            dropout=dropout,
            norm_first=norm_first,
            layer_norm=layer_norm,
            hard_attention=hard_attention,
            bayesian=bayesian,
            weight_prior=weight_prior,
            attention_prior=attention_prior,
            head_prior=head_prior,
        )
        self._build_likelihood(
            horizon=horizon,
            likelihood=likelihood,
            df=df,
            x_loc=x_loc,
            x_scale=x_scale,
            y_loc=y_loc,
            y_scale=y_scale,
        )
        self.pooling = pooling
        self.config["pooling"] = pooling
        self.head = BayesLinear(
            d_model, horizon or 1, bayesian="head" in self.bayesian_parts, prior=weight_prior
        )

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        *,
        num_data: int | None = None,
    ) -> torch.Tensor:
        """Run the model; observe ``y`` when given, sample it otherwise.

        Args:
            x: ``(N, T, F)`` float features, in the data's units.
            y: ``(N,)`` or ``(N, H)`` float targets, or None.
            mask: ``(N, T)`` bool, True = real step, or None.
            num_data: size of the full data set when ``x`` is a mini-batch.

        Returns:
            ``loc (*draws, N, *output_shape)``: the mean of ``y`` under each draw.
        """
        plate = data_plate_for(x, num_data)
        h, key_mask = self._encode(self._standardize(x), mask, plate)  # (s, N, T, d)
        if key_mask is None:
            pooled = h[:, :, -1] if self.pooling == "last" else h.mean(dim=2)
        elif self.pooling == "last":
            last = key_mask.long().cumsum(1).argmax(1)  # (N,) index of the last real step
            pooled = h[:, torch.arange(h.shape[1], device=h.device), last]  # (s, N, d)
        else:
            weights = key_mask.to(h.dtype)  # (N, T)
            pooled = torch.einsum("sntd,nt->snd", h, weights) / weights.sum(-1, keepdim=True)
        f = self.head(pooled)  # (s, N, H or 1)
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

    Raises:
        ValueError, TypeError: as ``SequenceRegressor``.
    """

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
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        d_ff: int = 128,
        dropout: float = 0.1,
        norm_first: bool = True,
        layer_norm: bool = True,
        hard_attention: bool = False,
        bayesian: Iterable[str] | str = ("attention", "head"),
        weight_prior: priors.Normal | None = priors.Normal(scale=3.0),
        attention_prior=priors.LogitScalePrior(),
        head_prior: priors.HeadGatePrior | None = None,
    ) -> None:
        super().__init__()
        if in_features is None:
            raise ValueError("in_features must be an integer >= 1, got None")
        check_sizes(horizon=horizon)
        num_decoder_layers = num_layers if num_decoder_layers is None else num_decoder_layers
        check_sizes(num_decoder_layers=num_decoder_layers)
        self._build_encoder(
            in_features=in_features,
            vocab_size=None,
            max_len=max_len,
            grid=None,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_layers,
            d_ff=d_ff,
            dropout=dropout,
            norm_first=norm_first,
            layer_norm=layer_norm,
            hard_attention=hard_attention,
            bayesian=bayesian,
            weight_prior=weight_prior,
            attention_prior=attention_prior,
            head_prior=head_prior,
        )
        self._build_likelihood(
            horizon=horizon,
            likelihood=likelihood,
            df=df,
            x_loc=x_loc,
            x_scale=x_scale,
            y_loc=y_loc,
            y_scale=y_scale,
        )
        self.config["num_decoder_layers"] = num_decoder_layers
        parts = self.bayesian_parts
        decoder_priors = tuple(
            spec
            for spec in priors.attention_specs(attention_prior)
            if isinstance(spec, priors.LogitScalePrior)
        )
        self.decoder = TransformerDecoder(
            num_decoder_layers,
            d_model,
            num_heads,
            d_ff,
            norm_first=norm_first,
            layer_norm=layer_norm,
            hard_attention=hard_attention,
            bayesian=parts,
            dropout=dropout,
            weight_prior=weight_prior,
            attention_prior=decoder_priors,
            head_prior=head_prior,
        )
        self.queries = nn.Parameter(torch.empty(horizon, d_model))  # one per future step
        self.reset_parameters()
        code = sinusoid_table(max_len + horizon, d_model)[max_len:]  # positions T+1..T+H
        self.register_buffer("query_positions", code, persistent=False)  # (H, d)
        self.head = BayesLinear(d_model, 1, bayesian="head" in parts, prior=weight_prior)

    def reset_parameters(self) -> None:
        """Re-draw the decoder queries from N(0, 0.02²) (every fit does, from its seed)."""
        nn.init.normal_(self.queries, std=0.02)

    @property
    def attention_modules(self) -> dict[str, list[BayesMultiheadAttention]]:
        """``"encoder.self"``, ``"decoder.self"`` and ``"decoder.cross"``, one per layer."""
        return {"encoder.self": self.encoder.attention_modules, **self.decoder.attention_modules}

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        *,
        num_data: int | None = None,
    ) -> torch.Tensor:
        """Run the model; observe ``y`` when given, sample it otherwise.

        Args:
            x: ``(N, T, F)`` float features of the past, in the data's units.
            y: ``(N, H)`` float future values, or None.
            mask: ``(N, T)`` bool, True = real step, or None.
            num_data: size of the full data set when ``x`` is a mini-batch.

        Returns:
            ``loc (*draws, N, H)``: the forecast mean under each draw.
        """
        plate = data_plate_for(x, num_data)
        memory, key_mask = self._encode(self._standardize(x), mask, plate)  # (s, N, T, d)
        queries = (self.queries + self.query_positions).expand(1, x.shape[0], -1, -1)
        h = self.decoder(queries, memory, memory_mask=key_mask)  # (s, N, H, d)
        return self._observe(self.head(h)[..., 0], y, plate)  # head: (s, N, H, 1)
