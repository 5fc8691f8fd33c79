"""Sinusoidal positional encoding (Vaswani et al. 2017, section 3.5)."""

from __future__ import annotations

import math

import torch
from torch import nn


class SinusoidalPositionalEncoding(nn.Module):
    """Adds ``PE[t, 2i] = sin(t / 10000^(2i/d))``, ``PE[t, 2i+1] = cos(...)`` to the input.

    Args:
        d_model: feature size ``d``.
        max_len: the longest sequence accepted.

    Shapes:
        ``forward(h)``: ``(..., T, d)`` -> ``(..., T, d)`` with ``T <= max_len``.
    """

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        position = torch.arange(max_len, dtype=torch.float32)[:, None]  # (max_len, 1)
        freq = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(1e4) / d_model)
        )
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * freq)
        pe[:, 1::2] = torch.cos(position * freq[: d_model // 2])
        self.register_buffer("pe", pe, persistent=False)  # (max_len, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.pe[: h.shape[-2]]
