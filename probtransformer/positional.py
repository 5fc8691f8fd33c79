"""Sinusoidal positional encodings: 1-D for sequences (Vaswani et al. 2017, section 3.5) and
2-D for grids of image patches (half the features encode the row, half the column)."""

from __future__ import annotations

import math

import torch
from torch import nn


def sinusoid_table(positions: int, dim: int) -> torch.Tensor:
    """``PE[t, 2i] = sin(t / 10000^(2i/dim))``, ``PE[t, 2i+1] = cos(...)``: ``(positions, dim)``."""
    position = torch.arange(positions, dtype=torch.float32)[:, None]  # (positions, 1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(1e4) / dim))
    pe = torch.zeros(positions, dim)
    pe[:, 0::2] = torch.sin(position * freq)
    pe[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return pe


class SinusoidalPositionalEncoding(nn.Module):
    """Adds a fixed sinusoidal code of each step's position to the input.

    Args:
        d_model: feature size ``d``.
        max_len: the longest sequence accepted.
        grid: ``(rows, cols)`` for image patches in row-major order (ViT, Dosovitskiy et al.
            2021): the first ``d/2`` features encode the patch row, the last ``d/2`` its column.
            Needs ``d_model`` divisible by 4 and ``max_len == rows * cols``.
        leading: number of steps before the grid (a CLS token) that get a zero code.

    Shapes:
        ``forward(h)``: ``(..., T, d)`` -> ``(..., T, d)`` with ``T <= max_len + leading``.

    Raises:
        ValueError: a grid that does not match ``max_len``, or ``d_model`` not divisible by 4.
    """

    def __init__(
        self,
        d_model: int,
        max_len: int,
        *,
        grid: tuple[int, int] | None = None,
        leading: int = 0,
    ) -> None:
        super().__init__()
        if grid is None:
            pe = sinusoid_table(max_len + leading, d_model)
        else:
            rows, cols = grid
            if rows * cols != max_len:
                raise ValueError(
                    f"grid {tuple(grid)} has {rows * cols} patches but max_len is {max_len}"
                )
            if d_model % 4:
                raise ValueError(f"2-D positions need d_model divisible by 4, got {d_model}")
            half = d_model // 2
            row = sinusoid_table(rows, half).repeat_interleave(cols, 0)  # (rows * cols, d/2)
            col = sinusoid_table(cols, half).repeat(rows, 1)  # (rows * cols, d/2)
            pe = torch.cat([torch.zeros(leading, d_model), torch.cat([row, col], -1)])
        self.register_buffer("pe", pe, persistent=False)  # (max_len + leading, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.pe[: h.shape[-2]]
