"""Prior specifications for Bayesian Transformer components.

A spec is a small frozen dataclass that says *what* the prior is; layers ask it to build the Pyro
distribution for a given shape **on a given device** each time a latent is sampled, so a model
moved with ``.to(device)`` samples its priors there too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyro.distributions as dist
import torch

from probtransformer.validation import check_int


def _check_positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


@dataclass(frozen=True)
class Normal:
    """Independent Normal prior on every entry of a weight tensor.

    With ``fan_in=True`` the standard deviation is ``scale / sqrt(fan_in)``, the variance-preserving
    choice of Neal (1996, "Bayesian Learning for Neural Networks") that keeps activations O(1)
    whatever the layer width.

    Args:
        scale: prior standard deviation (before the fan-in correction); > 0.
        loc: prior mean.
        fan_in: divide ``scale`` by ``sqrt(fan_in)``.

    Raises:
        ValueError: ``scale`` is not a finite positive number.
    """

    scale: float = 1.0
    loc: float = 0.0
    fan_in: bool = True

    def __post_init__(self) -> None:
        _check_positive("Normal.scale", self.scale)
        if not math.isfinite(self.loc):
            raise ValueError(f"Normal.loc must be finite, got {self.loc}")

    def std(self, fan_in: int) -> float:
        """Prior standard deviation for a weight whose layer has ``fan_in`` inputs."""
        return self.scale / math.sqrt(fan_in) if self.fan_in else self.scale

    def distribution(
        self, shape: tuple[int, ...], *, fan_in: int, device: torch.device
    ) -> dist.TorchDistribution:
        """The prior as one event of shape ``shape`` (``batch_shape == ()``)."""
        loc = torch.full(shape, float(self.loc), device=device)
        return dist.Normal(loc, self.std(fan_in)).to_event(len(shape))


@dataclass(frozen=True)
class LogitScalePrior:
    """LogNormal prior on a per-head inverse temperature of the attention logits.

    Attention logits become ``tau_h * q·k / sqrt(d_head)``; ``log tau_h ~ Normal(loc, scale)``.
    The posterior of ``tau_h`` says how sharp head ``h`` attends: large values mean near-hard
    selection, values near 0 mean near-uniform averaging over the visible keys.

    Args:
        loc: mean of ``log tau``; 0 puts the prior median at the usual ``1 / sqrt(d_head)`` scaling.
        scale: standard deviation of ``log tau``; > 0.

    Raises:
        ValueError: ``scale`` is not a finite positive number.
    """

    loc: float = 0.0
    scale: float = 0.5

    def __post_init__(self) -> None:
        _check_positive("LogitScalePrior.scale", self.scale)
        if not math.isfinite(self.loc):
            raise ValueError(f"LogitScalePrior.loc must be finite, got {self.loc}")

    def distribution(self, num_heads: int, *, device: torch.device) -> dist.TorchDistribution:
        """The prior over the ``(num_heads,)`` vector of inverse temperatures, one event."""
        loc = torch.full((num_heads,), float(self.loc), device=device)
        return dist.LogNormal(loc, self.scale).to_event(1)


# -- attention guidance: a prior attention distribution P over keys ---------------------------


@dataclass(frozen=True)
class LocalWindow:
    """Guidance uniform over keys within ``width`` steps of the query, ``|i - j| <= width``.

    Keys outside the window get relative weight ``outside`` (0: a hard mask).
    Build with :func:`local_window`.
    """

    width: int
    outside: float = 0.0

    def __call__(self, T: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        i = torch.arange(T)
        inside = (i[:, None] - i[None, :]).abs() <= self.width
        return torch.where(inside, 1.0, float(self.outside))


@dataclass(frozen=True)
class Causal:
    """Guidance uniform over the query's own and earlier positions (a hard causal mask).

    Build with :func:`causal`.
    """

    def __call__(self, T: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ones(T, T).tril()


@dataclass(frozen=True)
class DistanceDecay:
    """Guidance ``P(j | i) ∝ exp(-rate · |i - j|)``: nearby keys are more probable.

    Build with :func:`distance_decay`.
    """

    rate: float

    def __call__(self, T: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        i = torch.arange(T, dtype=torch.float32)
        return torch.exp(-self.rate * (i[:, None] - i[None, :]).abs())


@dataclass(frozen=True)
class GuidanceMatrix:
    """A user's ``(T, T)`` matrix of non-negative weights (row ``i``: query ``i``).

    Shorter sequences use its top-left ``(t, t)`` block. Build by passing a tensor, array or
    nested list as ``AttentionLogitPrior(guidance=...)``.
    """

    weights: tuple[tuple[float, ...], ...]

    def __call__(self, T: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        size = len(self.weights)
        if T > size:
            raise ValueError(
                f"the guidance matrix is ({size}, {size}) but the attention has T={T} positions"
            )
        return torch.tensor(self.weights, dtype=torch.float32)[:T, :T]


def local_window(width: int, *, outside: float = 0.0) -> LocalWindow:
    """Guidance uniform over ``|i - j| <= width`` (weight ``outside`` elsewhere; 0 = hard mask).

    Raises:
        TypeError/ValueError: ``width`` not an int >= 0, ``outside`` not a finite number >= 0.
    """
    check_int("local_window width", width, minimum=0, type_error=True)
    _check_non_negative("local_window outside", outside)
    return LocalWindow(width, float(outside))


def causal() -> Causal:
    """Guidance uniform over the query's own and earlier positions."""
    return Causal()


def distance_decay(rate: float) -> DistanceDecay:
    """Guidance ``∝ exp(-rate · |i - j|)`` (``rate`` in nats per step).

    Raises:
        TypeError/ValueError: ``rate`` not a finite number >= 0.
    """
    _check_non_negative("distance_decay rate", rate)
    return DistanceDecay(float(rate))


Guidance = LocalWindow | Causal | DistanceDecay | GuidanceMatrix | Callable


def _check_non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def _as_guidance(guidance: object) -> Guidance:
    """Turn a matrix (tensor, array, nested list; float or bool) into a ``GuidanceMatrix``."""
    if isinstance(guidance, (LocalWindow, Causal, DistanceDecay, GuidanceMatrix)):
        return guidance
    if isinstance(guidance, (torch.Tensor, np.ndarray, list, tuple)):
        try:
            weights = torch.as_tensor(np.asarray(guidance, dtype=np.float64))
        except (TypeError, ValueError) as e:
            raise TypeError(f"guidance must be a numeric (T, T) matrix: {e}") from e
        if weights.dim() != 2:
            raise ValueError(
                f"a guidance matrix must be (T, T), got shape {tuple(weights.shape)}; for "
                "guidance that differs between sequences pass a callable (T, mask) -> (N, T, T)"
            )
        _check_weights(weights, "guidance")
        return GuidanceMatrix(tuple(map(tuple, weights.tolist())))
    if callable(guidance):
        return guidance
    raise TypeError(
        "guidance must be local_window(...), causal(), distance_decay(...), a (T, T) matrix of "
        f"non-negative weights or booleans, or a callable (T, mask) -> weights; got "
        f"{type(guidance).__name__}"
    )


def _check_weights(weights: torch.Tensor, name: str, T: int | None = None) -> None:
    """Weights must be ``(T, T)`` or ``(N, T, T)``, finite, >= 0, each row with a positive entry."""
    square = weights.dim() in (2, 3) and weights.shape[-1] == weights.shape[-2]
    if not square or (T is not None and weights.shape[-1] != T):
        want = "(T, T) or (N, T, T)" if T is None else f"({T}, {T}) or (N, {T}, {T})"
        raise ValueError(f"{name} must be a {want} matrix, got shape {tuple(weights.shape)}")
    if not torch.isfinite(weights).all():
        raise ValueError(f"{name} holds NaN or inf weights")
    if (weights < 0).any():
        raise ValueError(f"{name} holds negative weights (min {float(weights.min()):.4g})")
    empty = (weights.sum(-1) <= 0).nonzero()
    if len(empty):
        raise ValueError(
            f"{name} gives query row(s) {empty[:5, -1].tolist()} no key with positive weight"
        )


@dataclass(frozen=True)
class AttentionLogitPrior:
    """Domain knowledge as a prior on attention: logits get a latent offset ``δ ~ N(log P, σ)``.

    ``P`` is the guidance, a prior attention distribution over keys for each query (rows are
    normalised over the keys with positive weight; zero weights stay hard masks, ``log 0 = -inf``).
    Each head of each layer has its own ``(T, T)`` offset, shared across sequences. The prior
    standard deviation is ``σ = 1 / strength``: a weak prior (small strength) yields to the data,
    a strong one holds attention near ``P``. Sampled non-centred: the latent site ``logit_offset``
    holds ``δ - log P ~ N(0, σ)``, so the guidance may depend on the input (callable guidance).

    Args:
        guidance: ``local_window(w)``, ``causal()``, ``distance_decay(r)``, a ``(T, T)`` matrix
            of non-negative weights or booleans (T = the attention's sequence length; shorter
            inputs use its top-left block), or a callable ``(T, mask) -> (T, T) or (N, T, T)``
            weights (``mask``: ``(N, T)`` bool or None). Positions index the attention's
            sequence: with ``pooling="cls"`` the CLS token is position 0.
        strength: prior precision scale, ``σ = 1 / strength``; > 0.

    Raises:
        TypeError/ValueError: guidance of the wrong kind or shape, negative/NaN weights, a row
            with no positive weight, or a strength that is not a finite number > 0.
    """

    guidance: Guidance
    strength: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "guidance", _as_guidance(self.guidance))
        _check_positive("AttentionLogitPrior.strength", self.strength)

    def log_guidance(
        self, T: int, mask: torch.Tensor | None, *, device: torch.device
    ) -> torch.Tensor:
        """``log P`` for ``T`` positions: ``(T, T)`` or ``(N, T, T)``, ``-inf`` = hard mask.

        Raises:
            ValueError: the guidance returns weights of the wrong shape or values.
        """
        weights = self.guidance(T, None if mask is None else mask.cpu())
        if not isinstance(weights, torch.Tensor):
            try:
                weights = torch.as_tensor(np.asarray(weights, dtype=np.float32))
            except (TypeError, ValueError) as e:
                raise TypeError(f"the guidance must return numeric weights: {e}") from e
        weights = weights.float()
        _check_weights(weights, "the guidance's weights", T)
        return (weights / weights.sum(-1, keepdim=True)).log().to(device)

    def offset_distribution(self, shape: tuple[int, ...], *, device: torch.device):
        """Prior of the centred offset ``δ - log P``: ``N(0, 1 / strength)``, one event."""
        loc = torch.zeros(shape, device=device)
        return dist.Normal(loc, 1.0 / self.strength).to_event(len(shape))


@dataclass(frozen=True)
class StochasticAttentionPrior:
    """Stochastic attention: every attention logit is a local latent with a contextual prior.

    Bayesian Attention Modules (Fan, Zhang, Chen & Zhou, NeurIPS 2020): the logit of query ``i``
    and key ``j`` in head ``h`` is ``z ~ N(μ_h(k_j), σ_h)``, with a contextual prior mean that
    depends on the key only (``μ_h(k_j) = k_j · w_h / sqrt(d_head)``, ``w_h`` a point
    estimate), plus the other attention priors' terms, and a per-head noise scale
    ``σ_h ~ HalfNormal(noise_scale)``. SVI uses an amortized guide
    ``q(z | x) = N(q_i · k_j / sqrt(d_head) + ..., s_h)`` computed by the same network (the usual
    attention logits) with a learned per-head scale ``s_h`` (a point estimate of the guide), so
    the number of variational parameters does not grow with the data and new sequences can be
    predicted. MCMC samples ``z`` non-centred (``LocScaleReparam``) and is supported for small
    data only (at most 50 short sequences).

    Every logit of every sequence is a latent, so their KL term in the ELBO outweighs the labels
    by orders of magnitude (N·H·T² logits against N labels) and pulls attention towards the
    key-only prior. ``kl_weight`` < 1 scales that term, as Fan et al. do with their KL
    coefficient: a tempered posterior for the local latents (1: the exact ELBO). Measured on
    digits (classes 8 and 9 held out): the default model with the exact ELBO reached test
    accuracy 0.61 after 3,000 steps (``benchmarks/studies/ood_baselines.py``); a d_model-16, 1-layer
    model after 1,000 steps reached 0.93 with ``kl_weight=0.01`` against 0.95 without
    stochastic attention.

    Args:
        noise_scale: scale of the HalfNormal hyperprior on ``σ_h``; > 0.
        kl_weight: weight of the local latents' log densities in the ELBO (model and guide
            alike), in (0, 1].

    Raises:
        ValueError: ``noise_scale`` is not a finite number > 0, ``kl_weight`` not in (0, 1].
    """

    noise_scale: float = 1.0
    kl_weight: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("StochasticAttentionPrior.noise_scale", self.noise_scale)
        _check_positive("StochasticAttentionPrior.kl_weight", self.kl_weight)
        if self.kl_weight > 1:
            raise ValueError(
                f"StochasticAttentionPrior.kl_weight must be in (0, 1], got {self.kl_weight}"
            )

    def scale_distribution(self, num_heads: int, *, device: torch.device):
        """Hyperprior of the per-head noise scales, ``(num_heads,)`` one event."""
        scale = torch.full((num_heads,), float(self.noise_scale), device=device)
        return dist.HalfNormal(scale).to_event(1)


@dataclass(frozen=True)
class HeadGatePrior:
    """Horseshoe-style shrinkage on per-head gates: how many heads does a layer need?

    Each head's output is multiplied by a gate ``g_h = 1 - κ_h`` in [0, 1], where
    ``κ_h = 1 / (1 + τ² λ_h²)`` is the horseshoe shrinkage factor with a global scale
    ``τ ~ HalfCauchy(global_scale)`` per layer and local scales ``λ_h ~ HalfCauchy(1)``
    (Carvalho, Polson & Scott 2010). With ``τ = 1``, ``κ_h ~ Beta(1/2, 1/2)``: heads are pushed
    to be either off (κ → 1) or on (κ → 0); a small ``global_scale`` favours fewer heads
    (Piironen & Vehtari 2017). ``Posterior.head_importance()`` reports the posterior of ``g_h``.

    The default ``global_scale=0.1`` was chosen on a synthetic task one head solves (read the
    value at a marked step, ``tests/models/test_head_shrinkage.py``; 4 heads, mean-field SVI):
    with 0.1, two or three gates fell below 0.01 (posterior means 0.0/0.21/0.39/0.01 and
    0.0/0.0/0.67/0.0 for two seeds) and pruning the heads below 0.1 left test accuracy
    unchanged (0.99); with 1.0 every gate stayed in 0.17-0.79.

    Args:
        global_scale: scale of the HalfCauchy prior on the per-layer ``τ``; > 0.

    Raises:
        ValueError: ``global_scale`` is not a finite number > 0.
    """

    global_scale: float = 0.1

    def __post_init__(self) -> None:
        _check_positive("HeadGatePrior.global_scale", self.global_scale)

    def global_distribution(self, *, device: torch.device):
        """``τ ~ HalfCauchy(global_scale)``, a scalar."""
        return dist.HalfCauchy(torch.tensor(float(self.global_scale), device=device))

    def local_distribution(self, num_heads: int, *, device: torch.device):
        """``λ ~ HalfCauchy(1)``, ``(num_heads,)`` one event."""
        return dist.HalfCauchy(torch.ones(num_heads, device=device)).to_event(1)

    @staticmethod
    def gate(global_scale: torch.Tensor, local_scale: torch.Tensor) -> torch.Tensor:
        """``1 - κ = τ²λ² / (1 + τ²λ²)`` from ``τ (...)`` and ``λ (..., H)``: ``(..., H)``."""
        r = (global_scale[..., None] * local_scale).square()
        return r / (1.0 + r)


@dataclass(frozen=True)
class ALiBiSlopePrior:
    """A distance-decay bias on the attention logits with a latent slope per head.

    ALiBi (Press, Smith & Lewis, ICLR 2022) adds ``-m_h |i - j|`` to the logit of query ``i``
    and key ``j`` with fixed geometric slopes ``m_h``. Here the slopes are latent (site
    ``alibi_slope``, ``(H,)``), ``m_h ~ HalfNormal(scale)``, so the posterior says how local
    each head is: a slope near 0 leaves the head global, a large one confines it to its
    neighbours. Learned, not hand-set as ``AttentionLogitPrior(local_window(w))`` is, and it
    needs no ``(max_len, max_len)`` table. Sequences only: models refuse it with a grid of
    image patches or a CLS token, whose distances it would get wrong.

    Args:
        scale: scale of the half-normal prior on each slope (logit units per step); > 0.

    Raises:
        ValueError: ``scale`` is not a finite positive number.
    """

    scale: float = 0.5

    def __post_init__(self) -> None:
        _check_positive("ALiBiSlopePrior.scale", self.scale)

    def distribution(self, num_heads: int, *, device: torch.device) -> dist.TorchDistribution:
        """The prior over the ``(num_heads,)`` slopes, one event."""
        return dist.HalfNormal(torch.full((num_heads,), float(self.scale), device=device)).to_event(
            1
        )


AttentionSpec = LogitScalePrior | AttentionLogitPrior | StochasticAttentionPrior | ALiBiSlopePrior
_ATTENTION_SPECS = (LogitScalePrior, AttentionLogitPrior, StochasticAttentionPrior, ALiBiSlopePrior)
_SPECS = {cls.__name__: cls for cls in (Normal, HeadGatePrior, *_ATTENTION_SPECS)}
_GUIDANCE = {cls.__name__: cls for cls in (LocalWindow, Causal, DistanceDecay, GuidanceMatrix)}


def attention_specs(value: object) -> tuple[AttentionSpec, ...]:
    """Normalise ``attention_prior=`` (None, one spec, or a sequence of specs) to a tuple.

    Raises:
        TypeError: an element is not an attention prior spec.
        ValueError: two specs of the same kind.
    """
    specs = () if value is None else (value,) if isinstance(value, _ATTENTION_SPECS) else value
    if not isinstance(specs, Sequence) or not all(isinstance(s, _ATTENTION_SPECS) for s in specs):
        names = ", ".join(cls.__name__ for cls in _ATTENTION_SPECS)
        raise TypeError(
            f"attention_prior must be None, one of {names}, or a sequence of them; got {value!r}"
        )
    kinds = [type(s).__name__ for s in specs]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"attention_prior may hold each kind of prior once, got {kinds}")
    return tuple(specs)


def to_config(spec: object) -> dict | list | None:
    """A JSON-serialisable description of a prior spec (``{"type": ..., **fields}``), or a list
    of them for a sequence of specs.

    A callable guidance is recorded by name only: :func:`from_config` refuses it.
    """
    if spec is None:
        return None
    if isinstance(spec, (list, tuple)):
        return [to_config(s) for s in spec]
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    if isinstance(spec, AttentionLogitPrior):
        guidance = spec.guidance
        if type(guidance).__name__ in _GUIDANCE:
            fields["guidance"] = {"type": type(guidance).__name__, **dataclasses.asdict(guidance)}
        else:  # recorded by name; from_config refuses it (code is not data)
            name = getattr(guidance, "__qualname__", type(guidance).__qualname__)
            fields["guidance"] = {"type": "callable", "name": name}
    return {"type": type(spec).__name__, **fields}


def from_config(config: dict | list | None):
    """Inverse of :func:`to_config`.

    Raises:
        ValueError: unknown spec type, or a callable guidance (code cannot be rebuilt from JSON).
    """
    if config is None:
        return None
    if isinstance(config, list):
        return tuple(from_config(c) for c in config)
    fields = dict(config)
    kind = fields.pop("type", None)
    if kind not in _SPECS:
        raise ValueError(f"unknown prior spec type {kind!r}; expected one of {sorted(_SPECS)}")
    if kind == "AttentionLogitPrior":
        guidance = dict(fields["guidance"])
        if guidance["type"] not in _GUIDANCE:
            raise ValueError(
                f"the attention guidance {guidance.get('name')!r} is a callable: it cannot be "
                "rebuilt from a config; pass its (T, T) matrix or a built-in guidance instead"
            )
        guidance_cls = _GUIDANCE[guidance.pop("type")]
        if guidance_cls is GuidanceMatrix:
            guidance["weights"] = tuple(map(tuple, guidance["weights"]))
        fields["guidance"] = guidance_cls(**guidance)
    return _SPECS[kind](**fields)
