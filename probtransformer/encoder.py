"""A stack of Transformer blocks with padding and optional causal masks."""

from __future__ import annotations

import torch
from pyro.nn import PyroModule, PyroModuleList

from probtransformer import priors
from probtransformer.attention import BayesMultiheadAttention
from probtransformer.block import DecoderBlock, TransformerBlock, make_norm


class TransformerEncoder(PyroModule):
    """``num_layers`` Transformer blocks, then a final LayerNorm when pre-norm.

    Args:
        num_layers: number of blocks ``L``.
        d_model, num_heads, d_ff, dropout, norm_first, bayesian, weight_prior, attention_prior,
        head_prior, max_len, layer_norm, hard_attention: passed to every ``TransformerBlock``.
        causal: each query sees only keys at or before its own position.

    Shapes:
        ``forward(h, key_padding_mask=(N, T))``: ``(s, N, T, d)`` -> ``(s', N, T, d)``.
    """

    def __init__(
        self,
        num_layers: int,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.0,
        norm_first: bool = True,
        causal: bool = False,
        bayesian: frozenset[str] = frozenset({"attention"}),
        weight_prior: priors.Normal | None = None,
        attention_prior=None,
        head_prior: priors.HeadGatePrior | None = None,
        max_len: int | None = None,
        layer_norm: bool = True,
        hard_attention: bool = False,
    ) -> None:
        super().__init__()
        self.causal = causal
        self.layers = PyroModuleList(
            [
                TransformerBlock(
                    d_model,
                    num_heads,
                    d_ff,
                    dropout=dropout,
                    norm_first=norm_first,
                    bayesian=bayesian,
                    weight_prior=weight_prior,
                    attention_prior=attention_prior,
                    head_prior=head_prior,
                    max_len=max_len,
                    layer_norm=layer_norm,
                    hard_attention=hard_attention,
                )
                for _ in range(num_layers)
            ]
        )
        norm = make_norm(d_model, enabled=layer_norm, bayesian="norm" in bayesian)
        self.norm = norm if norm_first else None

    @property
    def attention_modules(self) -> list[BayesMultiheadAttention]:
        """The self-attention module of each layer, in order."""
        return [layer.attention for layer in self.layers]

    def forward(
        self, h: torch.Tensor, *, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        T = h.shape[-2]
        attn_mask = None
        if self.causal:
            attn_mask = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()  # (T, T)
        for layer in self.layers:
            h = layer(h, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        return h if self.norm is None else self.norm(h)


class TransformerDecoder(PyroModule):
    """``num_layers`` decoder blocks (self-attention, cross-attention to the encoder output,
    feed-forward), then a final LayerNorm when pre-norm.

    Args:
        as ``TransformerEncoder``.

    Shapes:
        ``forward(h (s, N, Tq, d), memory (s, N, Tk, d), memory_mask=(N, Tk))`` ->
        ``(s', N, Tq, d)``.
    """

    def __init__(
        self,
        num_layers: int,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        causal: bool = False,
        norm_first: bool = True,
        bayesian: frozenset[str] = frozenset({"attention"}),
        **kwargs,
    ) -> None:
        super().__init__()
        self.causal = causal
        self.layers = PyroModuleList(
            [
                DecoderBlock(
                    d_model, num_heads, d_ff, norm_first=norm_first, bayesian=bayesian, **kwargs
                )
                for _ in range(num_layers)
            ]
        )
        self.norm = (
            make_norm(d_model, enabled=kwargs.get("layer_norm", True), bayesian="norm" in bayesian)
            if norm_first
            else None
        )

    @property
    def attention_modules(self) -> dict[str, list[BayesMultiheadAttention]]:
        """``{"decoder.self": [...], "decoder.cross": [...]}``, one module per layer."""
        return {
            "decoder.self": [layer.attention for layer in self.layers],
            "decoder.cross": [layer.cross_attention for layer in self.layers],
        }

    def forward(
        self,
        h: torch.Tensor,
        memory: torch.Tensor,
        *,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        T = h.shape[-2]
        attn_mask = None
        if self.causal:
            attn_mask = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()  # (T, T)
        for layer in self.layers:
            h = layer(h, memory, memory_mask=memory_mask, attn_mask=attn_mask)
        return h if self.norm is None else self.norm(h)
