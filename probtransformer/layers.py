"""Bayesian linear and LayerNorm layers, and the shape convention every layer follows.

Shape convention
----------------
Hidden states carry a leading **draw** dimension ``s``: ``h`` is ``(s, N, ..., features)`` with
``s == 1`` when one set of weights is in use. A latent weight may arrive with leading sample dims:
``Predictive(parallel=True)`` and vectorized ELBO particles run the model under a plate at dim
``-2``, so a ``(out, in)`` weight is drawn as ``(S, 1, out, in)`` (the plate-sized 1 stands for the
data plate). Layers flatten whatever leads the weight's event dims into ``s`` with
:func:`flatten_draws` and broadcast ``s`` against the hidden state's draw dim (equal, or one of
them 1). Point-estimate weights are plain ``nn.Parameter``s and broadcast the same way.
"""

from __future__ import annotations

import math

import pyro.poutine.runtime
import torch
import torch.nn.functional as F
from pyro.nn import PyroModule, PyroSample
from torch import nn

from probtransformer import priors


class Dropout(nn.Dropout, PyroModule):
    """``torch.nn.Dropout`` as a PyroModule that returns its input without a module call when
    it drops nothing (``p == 0``, or eval mode).

    Inside a PyroModule, a plain ``nn.Module`` is registered by a ``pyro.module`` statement at
    every attribute access; and a PyroModule's call enters its Pyro context and reads Pyro's
    settings. Over the ten dropouts of a decoding step (dropout 0, the text models' default)
    the calls cost more than the rest of the layer norms and projections' Python together.
    """

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        if self.p == 0 or not self.training:
            return input
        return super().__call__(input)


def flatten_draws(value: torch.Tensor, event_rank: int) -> torch.Tensor:
    """Collapse every dim before the last ``event_rank`` into one leading draw dim.

    ``(out, in)`` -> ``(1, out, in)``; ``(S, 1, out, in)`` -> ``(S, out, in)``.
    """
    return value.reshape(-1, *value.shape[value.dim() - event_rank :])


def draw_batch_shape() -> tuple[int, ...]:
    """Sizes of the vectorizing plates (dim <= -2) around the current model call.

    ``Predictive(parallel=True)`` and vectorized ELBO particles wrap the model in a plate at dim
    -2; the data plate owns dim -1. Outside any such plate this is ``()``.
    """
    frames = [f for f in pyro.poutine.runtime.get_plates() if f.vectorized and f.dim < -1]
    if not frames:
        return ()
    rank = -min(f.dim for f in frames)
    shape = [1] * (rank - 1)
    for f in frames:
        shape[rank + f.dim] = f.size
    return tuple(shape)


def align_draws(value: torch.Tensor) -> torch.Tensor:
    """Reshape a network output ``(s, N, ...)`` to ``(*draw_batch_shape(), N, ...)``.

    ``s`` is the product of the vectorizing plate sizes (every latent was drawn under them) or 1
    (no latent was: the output is broadcast).
    """
    lead = draw_batch_shape()
    if not lead:
        return value[0] if value.shape[0] == 1 else value
    size = torch.Size(lead).numel()
    if value.shape[0] == size:
        return value.reshape(*lead, *value.shape[1:])
    return value[0].expand(*lead, *value.shape[1:])


def batched_linear(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``h @ weight.T + bias`` with a draw dim on both sides.

    Args:
        h: ``(s_h, *B, in)``.
        weight: ``(s_w, out, in)``; ``s_h`` and ``s_w`` are equal or one of them is 1.
        bias: ``(s_w, out)`` or None.

    Returns:
        ``(max(s_h, s_w), *B, out)``.
    """
    if weight.shape[0] == 1:  # shared weights: one fused matmul-and-bias (addmm)
        return F.linear(h, weight[0], None if bias is None else bias[0])
    if h.shape[0] == 1 and not torch.is_grad_enabled():
        # predictions and decoding: a batched matmul with h broadcast over the draws is 3-8x
        # faster than the einsum, which copies strided weights (slices of the attention
        # projection) on every call; with gradients (many chains) the einsum's backward is the
        # faster one (1.5x at 256 chains)
        flat = h.reshape(1, -1, h.shape[-1]) @ weight.transpose(-1, -2)  # (s_w, prod(B), out)
        out = flat.reshape(weight.shape[0], *h.shape[1:-1], weight.shape[1])
    elif not torch.is_grad_enabled():  # a draw dim on both sides: one bmm, no einsum planning
        flat = torch.bmm(h.reshape(h.shape[0], -1, h.shape[-1]), weight.transpose(-1, -2))
        out = flat.view(weight.shape[0], *h.shape[1:-1], weight.shape[1])
    elif h.shape[0] == 1:
        out = torch.einsum("...i,soi->s...o", h[0], weight)
    else:
        out = torch.einsum("s...i,soi->s...o", h, weight)
    if bias is not None:
        out = out + bias.view(bias.shape[0], *([1] * (out.dim() - 2)), bias.shape[-1])
    return out


def batched_affine(h: torch.Tensor, weight_bias: torch.Tensor) -> torch.Tensor:
    """``batched_linear(h, weight_bias[..., :-1], weight_bias[..., -1])`` in one matmul.

    The bias rides in the matmul as a column of ones appended to ``h``, so no pass over the
    output adds it, and the weight is not sliced out of ``weight_bias`` (a copy): 1.4-1.8x
    faster for the attention projections at 100 draws (``benchmarks/BENCHMARKS.md``,
    "Predictive pass over many draws").

    Args:
        h: ``(s_h, *B, in)``.
        weight_bias: ``(s_w, out, in + 1)``, the weight with the bias as its last column.

    Returns:
        ``(max(s_h, s_w), *B, out)``.
    """
    ones = h.new_ones(()).expand(*h.shape[:-1], 1)
    return batched_linear(torch.cat([h, ones], -1), weight_bias)


def _linear_weight_prior(module: BayesLinear):
    return module.prior.distribution(
        (module.out_features, module.in_features),
        fan_in=module.in_features,
        device=module.device_anchor.device,
    )


def _linear_bias_prior(module: BayesLinear):
    return module.prior.distribution(
        (module.out_features,), fan_in=module.in_features, device=module.device_anchor.device
    )


class BayesLinear(PyroModule):
    """Affine map whose weight and bias are latent (``PyroSample``) or point estimates.

    Args:
        in_features: input size ``F_in``.
        out_features: output size ``F_out``.
        bias: learn an additive bias.
        bayesian: weight and bias are latent sites with prior ``prior``; otherwise ``nn.Parameter``s
            initialised like ``torch.nn.Linear``.
        prior: prior spec for weight and bias (default ``Normal(1, fan_in=True)``).

    Shapes:
        ``forward(h)``: ``(s, *B, F_in)`` -> ``(s', *B, F_out)`` (see the module docstring).
    """

    site_dims = {"weight": ("out_features", "in_features"), "bias": ("out_features",)}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        bayesian: bool = True,
        prior: priors.Normal | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bayesian = bayesian
        self.prior = prior or priors.Normal()
        self.register_buffer("device_anchor", torch.zeros(()), persistent=False)
        if bayesian:
            self.weight = PyroSample(_linear_weight_prior)
            self.bias = PyroSample(_linear_bias_prior) if bias else None
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
            self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw point-estimate parameters as ``torch.nn.Linear`` does (no-op when latent)."""
        if self.bayesian:
            return
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight = flatten_draws(self.weight, 2)  # (s, out, in)
        bias = None if self.bias is None else flatten_draws(self.bias, 1)  # (s, out)
        return batched_linear(h, weight, bias)


def _norm_weight_prior(module: BayesLayerNorm):
    gain = priors.Normal(module.prior.scale, loc=1.0, fan_in=False)
    return gain.distribution(
        (module.normalized_shape,), fan_in=1, device=module.device_anchor.device
    )


def _norm_bias_prior(module: BayesLayerNorm):
    shift = priors.Normal(module.prior.scale, loc=0.0, fan_in=False)
    return shift.distribution(
        (module.normalized_shape,), fan_in=1, device=module.device_anchor.device
    )


class BayesLayerNorm(PyroModule):
    """LayerNorm (Ba et al. 2016) whose gain and bias are latent or point estimates.

    Latent gain ~ Normal(1, ``prior.scale``), bias ~ Normal(0, ``prior.scale``) per feature.

    Args:
        normalized_shape: feature size ``d``.
        bayesian: gain and bias are latent sites; otherwise parameters initialised to 1 and 0.
        prior: spec whose ``scale`` sets the prior spread of gain and bias (default 0.1).
        eps: added to the variance for numerical stability.

    Shapes:
        ``forward(h)``: ``(s, *B, d)`` -> ``(s', *B, d)``.
    """

    site_dims = {"weight": ("features",), "bias": ("features",)}

    def __init__(
        self,
        normalized_shape: int,
        *,
        bayesian: bool = False,
        prior: priors.Normal | None = None,
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.normalized_shape = normalized_shape
        self.bayesian = bayesian
        self.prior = prior or priors.Normal(scale=0.1, fan_in=False)
        self.eps = eps
        self.register_buffer("device_anchor", torch.zeros(()), persistent=False)
        if bayesian:
            self.weight = PyroSample(_norm_weight_prior)
            self.bias = PyroSample(_norm_bias_prior)
        else:
            self.weight = nn.Parameter(torch.ones(normalized_shape))
            self.bias = nn.Parameter(torch.zeros(normalized_shape))

    def reset_parameters(self) -> None:
        """Reset point-estimate gain to 1 and bias to 0 (no-op when latent)."""
        if not self.bayesian:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight = flatten_draws(self.weight, 1)  # (s, d)
        bias = flatten_draws(self.bias, 1)
        if weight.shape[0] == 1:  # shared gain and bias: fused into the normalization
            return F.layer_norm(h, (self.normalized_shape,), weight[0], bias[0], self.eps)
        normed = F.layer_norm(h, (self.normalized_shape,), eps=self.eps)
        view = (weight.shape[0], *([1] * (h.dim() - 2)), self.normalized_shape)
        return normed * weight.view(view) + bias.view(view)
