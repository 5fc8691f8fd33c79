"""Transformer block: attention and feed-forward sublayers with residuals and LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pyro.nn import PyroModule
from torch import nn

from probtransformer import priors
from probtransformer.attention import BayesMultiheadAttention
from probtransformer.layers import BayesLayerNorm, BayesLinear

#: Parts of a Transformer that can be made latent (``bayesian=`` of the models).
BAYESIAN_PARTS = ("embedding", "attention", "ffn", "norm", "head")


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
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(F.gelu(self.linear1(h))))


class TransformerBlock(PyroModule):
    """Attention + feed-forward, each wrapped in a residual connection and LayerNorm.

    Pre-norm (``norm_first=True``, Xiong et al. 2020): ``h + f(LN(h))``; post-norm (the original
    Transformer): ``LN(h + f(h))``.

    Args:
        d_model: width ``d``.
        num_heads: attention heads.
        d_ff: hidden width of the feed-forward network.
        dropout: dropout on attention weights and sublayer outputs during training.
        norm_first: pre-norm if True, post-norm otherwise.
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
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.attention = BayesMultiheadAttention(
            d_model,
            num_heads,
            bayesian="attention" in bayesian,
            weight_prior=weight_prior,
            attention_prior=attention_prior,
            head_prior=head_prior,
            max_len=max_len,
            dropout=dropout,
        )
        self.ffn = FeedForward(
            d_model, d_ff, bayesian="ffn" in bayesian, prior=weight_prior, dropout=dropout
        )
        self.norm1 = BayesLayerNorm(d_model, bayesian="norm" in bayesian)
        self.norm2 = BayesLayerNorm(d_model, bayesian="norm" in bayesian)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        h: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        def attend(x: torch.Tensor) -> torch.Tensor:
            out = self.attention(x, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
            return self.dropout(out)

        if self.norm_first:
            h = h + attend(self.norm1(h))
            return h + self.dropout(self.ffn(self.norm2(h)))
        h = self.norm1(h + attend(h))
        return self.norm2(h + self.dropout(self.ffn(h)))


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
        self.cross_attention = BayesMultiheadAttention(
            d_model,
            num_heads,
            bayesian="attention" in bayesian,
            weight_prior=kwargs.get("weight_prior"),
            attention_prior=cross_priors,
            head_prior=kwargs.get("head_prior"),
            dropout=kwargs.get("dropout", 0.0),
        )
        self.norm3 = BayesLayerNorm(d_model, bayesian="norm" in bayesian)

    def forward(
        self,
        h: torch.Tensor,
        memory: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        def attend(x: torch.Tensor) -> torch.Tensor:
            out = self.attention(x, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
            return self.dropout(out)

        def cross(x: torch.Tensor) -> torch.Tensor:
            return self.dropout(self.cross_attention(x, memory, key_padding_mask=memory_mask))

        if self.norm_first:
            h = h + attend(self.norm1(h))
            h = h + cross(self.norm3(h))
            return h + self.dropout(self.ffn(self.norm2(h)))
        h = self.norm1(h + attend(h))
        h = self.norm3(h + cross(h))
        return self.norm2(h + self.dropout(self.ffn(h)))
