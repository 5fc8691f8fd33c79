"""Stacks of Transformer blocks with padding and optional causal masks."""

from __future__ import annotations

import torch
from pyro.nn import PyroModule, PyroModuleList

from probtransformer import kv_cache
from probtransformer.attention import BayesMultiheadAttention
from probtransformer.block import DecoderBlock, TransformerBlock, make_norm


class _BlockStack(PyroModule):
    """``num_layers`` blocks of one class, then a final LayerNorm when pre-norm; ``causal``
    stacks give every block a mask that lets each query see only keys at or before it."""

    _block: type[TransformerBlock] = TransformerBlock

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
        **block_options,
    ) -> None:
        super().__init__()
        self.causal = causal
        self.layers = PyroModuleList(
            [
                self._block(
                    d_model,
                    num_heads,
                    d_ff,
                    norm_first=norm_first,
                    bayesian=bayesian,
                    causal=causal,
                    **block_options,
                )
                for _ in range(num_layers)
            ]
        )
        enabled = block_options.get("layer_norm", True)
        self.norm = (
            make_norm(d_model, enabled=enabled, bayesian="norm" in bayesian) if norm_first else None
        )

    def _attn_mask(self, h: torch.Tensor) -> torch.Tensor | None:
        """``(T, offset + T)`` bool, True where a query (row) may see a key, for ``h (..., T, d)``
        and the ``offset`` steps of an active ``kv_cache`` (0 without); None when not causal.

        Raises:
            RuntimeError: a ``kv_cache`` is active but the stack is not causal (the cached steps
                would need the new steps' keys).
        """
        start = kv_cache.offset()
        if not self.causal:
            if kv_cache.active() is not None:
                raise RuntimeError("a KV cache decodes causal stacks only")
            return None
        T = h.shape[-2]
        return torch.ones(T, start + T, dtype=torch.bool, device=h.device).tril(start)

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.norm is None else self.norm(h)


class TransformerEncoder(_BlockStack):
    """``num_layers`` Transformer blocks, then a final LayerNorm when pre-norm.

    Args:
        num_layers: number of blocks ``L``.
        d_model, num_heads, d_ff: passed to every ``TransformerBlock``.
        causal: each query sees only keys at or before its own position.
        norm_first: pre-norm blocks, and a final LayerNorm.
        bayesian: which of "attention", "ffn", "norm" are latent (the final LayerNorm included).
        **block_options: the other keyword arguments of ``TransformerBlock`` (``dropout``,
            ``weight_prior``, ``attention_prior``, ``head_prior``, ``max_len``, ``layer_norm``,
            ``hard_attention``), passed to every block.

    Shapes:
        ``forward(h, key_padding_mask=(N, T))``: ``(s, N, T, d)`` -> ``(s', N, T, d)``.
    """

    @property
    def attention_modules(self) -> list[BayesMultiheadAttention]:
        """The self-attention module of each layer, in order."""
        return [layer.attention for layer in self.layers]

    def forward(
        self, h: torch.Tensor, *, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        attn_mask = self._attn_mask(h)
        for layer in self.layers:
            h = layer(h, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        return self._final_norm(h)


class TransformerDecoder(_BlockStack):
    """``num_layers`` decoder blocks (self-attention, cross-attention to the encoder output,
    feed-forward), then a final LayerNorm when pre-norm.

    Args:
        as ``TransformerEncoder``, with ``DecoderBlock``s.

    Shapes:
        ``forward(h (s, N, Tq, d), memory (s, N, Tk, d), memory_mask=(N, Tk))`` ->
        ``(s', N, Tq, d)``.
    """

    _block = DecoderBlock

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
        attn_mask = self._attn_mask(h)
        for layer in self.layers:
            h = layer(h, memory, memory_mask=memory_mask, attn_mask=attn_mask)
        return self._final_norm(h)
