"""Transformer block: attention and feed-forward sublayers with residuals and LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pyro.nn import PyroModule
from torch import nn

from probtransformer import kv_cache, priors
from probtransformer.attention import BayesMultiheadAttention
from probtransformer.layers import BayesLayerNorm, BayesLinear, Dropout, flatten_draws

#: Parts of a Transformer that can be made latent (``bayesian=`` of the models).
BAYESIAN_PARTS = ("embedding", "attention", "ffn", "norm", "head")


def make_norm(d_model: int, *, enabled: bool, bayesian: bool) -> nn.Module:
    """A ``BayesLayerNorm`` over ``d_model`` features, or the identity when not ``enabled``."""
    return BayesLayerNorm(d_model, bayesian=bayesian) if enabled else nn.Identity()


class FeedForward(PyroModule):
    """Position-wise feed-forward network ``W2 · GELU(W1 · h)``.

    Shapes:
        ``forward(h)``: ``(s, N, T, d)`` -> ``(s', N, T, d)``.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        bayesian: bool = False,
        prior: priors.Normal | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.linear1 = BayesLinear(d_model, d_ff, bayesian=bayesian, prior=prior)
        self.linear2 = BayesLinear(d_ff, d_model, bayesian=bayesian, prior=prior)
        self.dropout = Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(F.gelu(self.linear1(h))))


class ConvMixing(PyroModule):
    """Depthwise convolution over steps: feature ``c`` at step ``t`` becomes
    ``sum_j w[c, j] h[t + j - shift, c] + b[c]``, mixing each feature over a window of
    ``kernel`` neighbouring steps (the local token mixing of ConvBERT, Jiang et al. 2020, and of
    the Conformer's convolution module, Gulati et al. 2020, without their gating).

    Causal (``causal=True``) windows end at the step itself (the ``kernel - 1`` steps before
    it); otherwise they are centred. Padded steps (``key_padding_mask`` False) enter as zeros.
    The ``(d, kernel)`` weights and ``(d,)`` biases are point estimates (Xavier-uniform, zero).
    Inside ``kv_cache.decoding`` the steps before the new ones come from the cache.

    Shapes:
        ``forward(h (s, N, T, d), key_padding_mask (N, T) | None)`` -> ``(s, N, T, d)``.
    """

    def __init__(self, d_model: int, kernel: int, *, causal: bool) -> None:
        super().__init__()
        self.kernel = kernel
        self.causal = causal
        self.weight = nn.Parameter(torch.empty(d_model, 1, kernel))
        self.bias = nn.Parameter(torch.empty(d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw the weights (Xavier-uniform over the window) and zero the biases."""
        nn.init.xavier_uniform_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, h: torch.Tensor, key_padding_mask: torch.Tensor | None = None):
        if key_padding_mask is not None:
            h = h * key_padding_mask[..., None].to(h.dtype)
        T = h.shape[-2]
        before = self.kernel - 1 if self.causal else (self.kernel - 1) // 2
        # one (d, kernel) window per draw when the chains of fit_mcmc carry their own values
        weight = flatten_draws(self.weight, 3)[:, :, 0]  # (s_w, d, kernel)
        bias = flatten_draws(self.bias, 1)  # (s_w, d)
        cache = kv_cache.active()
        if cache is None and weight.shape[0] == 1:  # shared weights: torch's depthwise conv
            lead = h.shape[:-2]
            x = h.reshape(-1, *h.shape[-2:]).transpose(1, 2)  # (s N, d, T)
            x = F.pad(x, (before, self.kernel - 1 - before))
            out = F.conv1d(x, weight[0, :, None], bias[0], groups=x.shape[1])  # (s N, d, T)
            return out.transpose(1, 2).reshape(*lead, T, -1)
        if cache is not None:  # decoding: the windows of the new steps, a few each
            h = cache.preceding(self, h, before)  # (s, N, before + T, d), zeros at the start
        else:
            h = F.pad(h, (0, 0, before, self.kernel - 1 - before))
        windows = h.unfold(-2, self.kernel, 1)  # (s, N, T, d, kernel)
        # a product and a sum: torch's depthwise conv1d costs 10x more on a few steps
        ones = [1] * (windows.dim() - 3)
        out = (windows * weight.view(weight.shape[0], *ones, *weight.shape[1:])).sum(-1)
        return out + bias.view(bias.shape[0], *ones, bias.shape[-1])


def attention_class(parameterization: str) -> type[BayesMultiheadAttention]:
    """The attention module of a parameterization (``circuits.PARAMETERIZATIONS``).

    Raises:
        ValueError: an unknown one, named.
    """
    from probtransformer.circuits import PARAMETERIZATIONS, CircuitAttention

    if parameterization not in PARAMETERIZATIONS:
        raise ValueError(
            f"attention_parameterization must be one of {PARAMETERIZATIONS}, got "
            f"{parameterization!r}"
        )
    return CircuitAttention if parameterization == "circuits" else BayesMultiheadAttention


class TransformerBlock(PyroModule):
    """Attention + feed-forward, each wrapped in a residual connection and LayerNorm.

    Pre-norm (``norm_first=True``, Xiong et al. 2020): ``h + f(LN(h))``; post-norm (the original
    Transformer): ``LN(h + f(h))``. The ablations of ``benchmarks/claims.py`` switch parts off:
    ``d_ff=0`` drops the feed-forward sublayer, ``layer_norm=False`` every LayerNorm (residuals
    stay), ``hard_attention=True`` makes attention select one key (see
    ``BayesMultiheadAttention``).

    Args:
        d_model: width ``d``.
        num_heads: attention heads.
        d_ff: hidden width of the feed-forward network; 0 for no feed-forward sublayer.
        dropout: dropout on attention weights and sublayer outputs during training.
        norm_first: pre-norm if True, post-norm otherwise.
        layer_norm: False replaces every LayerNorm by the identity.
        hard_attention: attention takes the value of its top-scoring key only.
        rotary: self-attention rotates queries and keys by position (RoPE).
        attention_parameterization: ``"factors"`` (``BayesMultiheadAttention``: latent W_Q,
            W_K, W_V, W_O) or ``"circuits"`` (``circuits.CircuitAttention``: latent per-head
            W_QK, W_OV, free of the factors' gauge symmetry).
        conv_kernel: > 0 adds a first sublayer of local token mixing, a ``ConvMixing`` over
            this many steps (causal with ``causal``); 0: none.
        causal: the block belongs to a causal stack (its convolution looks back only).
        bayesian: which of "attention", "ffn", "norm" are latent.
        weight_prior: prior spec of latent weights.
        attention_prior: prior spec(s) of the attention logits (see ``BayesMultiheadAttention``).
        head_prior: ``priors.HeadGatePrior`` on per-head gates, or None.
        max_len: longest sequence (needed by an ``AttentionLogitPrior``).

    Shapes:
        ``forward(h, key_padding_mask=(N, T), attn_mask=(T, T))``: ``(s, N, T, d)`` ->
        ``(s', N, T, d)``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.0,
        norm_first: bool = True,
        bayesian: frozenset[str] = frozenset({"attention"}),
        weight_prior: priors.Normal | None = None,
        attention_prior=None,
        head_prior: priors.HeadGatePrior | None = None,
        max_len: int | None = None,
        layer_norm: bool = True,
        hard_attention: bool = False,
        rotary: bool = False,
        attention_parameterization: str = "factors",
        conv_kernel: int = 0,
        causal: bool = False,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.layer_norm = layer_norm
        self.bayesian = bayesian
        self.attention = attention_class(attention_parameterization)(
            d_model,
            num_heads,
            bayesian="attention" in bayesian,
            weight_prior=weight_prior,
            attention_prior=attention_prior,
            head_prior=head_prior,
            max_len=max_len,
            dropout=dropout,
            rotary=rotary,
            hard=hard_attention,
        )
        self.ffn = (
            FeedForward(
                d_model, d_ff, bayesian="ffn" in bayesian, prior=weight_prior, dropout=dropout
            )
            if d_ff
            else None
        )
        self.norm1 = self._norm(d_model)
        self.norm2 = self._norm(d_model)
        self.dropout = Dropout(dropout)
        self.conv = ConvMixing(d_model, conv_kernel, causal=causal) if conv_kernel else None
        self.norm0 = self._norm(d_model) if conv_kernel else None

    def _norm(self, d_model: int) -> nn.Module:
        return make_norm(d_model, enabled=self.layer_norm, bayesian="norm" in self.bayesian)

    def _sublayer(self, h: torch.Tensor, f, norm: nn.Module) -> torch.Tensor:
        """Residual connection around ``f`` with pre- or post-norm."""
        if self.norm_first:
            return h + f(norm(h))
        return norm(h + f(h))

    def _conv_mixing(self, h: torch.Tensor, key_padding_mask: torch.Tensor | None):
        if self.conv is None:
            return h

        def mix(x: torch.Tensor) -> torch.Tensor:
            return self.dropout(self.conv(x, key_padding_mask))

        return self._sublayer(h, mix, self.norm0)

    def _feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.ffn is None:
            return h
        return self._sublayer(h, lambda x: self.dropout(self.ffn(x)), self.norm2)

    def _self_attention(
        self,
        h: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The self-attention sublayer, residual connection and LayerNorm included."""

        def attend(x: torch.Tensor) -> torch.Tensor:
            out = self.attention(x, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
            return self.dropout(out)

        return self._sublayer(h, attend, self.norm1)

    def forward(
        self,
        h: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self._conv_mixing(h, key_padding_mask)
        return self._feed_forward(self._self_attention(h, key_padding_mask, attn_mask))


class DecoderBlock(TransformerBlock):
    """Self-attention, cross-attention to an encoded sequence (the "memory"), and feed-forward,
    each with a residual connection and LayerNorm (Vaswani et al. 2017, section 3.1).

    Same arguments as ``TransformerBlock``. The cross-attention gets the same weight prior and
    only the attention priors that are defined for queries and keys of different sequences
    (``LogitScalePrior``, and the head gates); guidance and stochastic attention apply to
    self-attention.

    Shapes:
        ``forward(h (s, N, Tq, d), memory (s, N, Tk, d), memory_mask (N, Tk))`` ->
        ``(s', N, Tq, d)``.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, **kwargs) -> None:
        super().__init__(d_model, num_heads, d_ff, **kwargs)
        bayesian = kwargs.get("bayesian", frozenset({"attention"}))
        cross_priors = tuple(
            spec
            for spec in priors.attention_specs(kwargs.get("attention_prior"))
            if isinstance(spec, priors.LogitScalePrior)
        )
        cross = attention_class(kwargs.get("attention_parameterization", "factors"))
        if cross is not BayesMultiheadAttention:  # circuits take no logit scale
            cross_priors = ()
        self.cross_attention = cross(
            d_model,
            num_heads,
            bayesian="attention" in bayesian,
            weight_prior=kwargs.get("weight_prior"),
            attention_prior=cross_priors,
            head_prior=kwargs.get("head_prior"),
            dropout=kwargs.get("dropout", 0.0),
            hard=kwargs.get("hard_attention", False),
        )
        self.norm3 = self._norm(d_model)

    def forward(
        self,
        h: torch.Tensor,
        memory: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        def cross(x: torch.Tensor) -> torch.Tensor:
            return self.dropout(self.cross_attention(x, memory, key_padding_mask=memory_mask))

        h = self._self_attention(
            self._conv_mixing(h, key_padding_mask), key_padding_mask, attn_mask
        )
        return self._feed_forward(self._sublayer(h, cross, self.norm3))
