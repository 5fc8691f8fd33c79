"""Positional information for the Transformer: sinusoidal encodings, 1-D for sequences
(Vaswani et al. 2017, section 3.5) and 2-D for grids of image patches (half the features encode
the row, half the column); learned absolute positions; and the rotation of rotary position
embedding (RoPE, Su et al. 2021), which attention applies to its queries and keys. A
distance-decay bias with a latent slope per head is an attention prior
(``priors.ALiBiSlopePrior``)."""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample
from torch import nn

from probtransformer import kv_cache
from probtransformer.layers import flatten_draws


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
        start = kv_cache.offset()  # 0 unless decoding step by step
        return h + self.pe[start : start + h.shape[-2]]


#: The positional schemes of the built-in models (``EncoderConfig.positions``).
POSITIONS = ("sinusoidal", "learned", "rotary", "none")


def _learned_prior(module: LearnedPositionalEncoding):
    loc = torch.zeros(module.positions, module.d_model, device=module.device_anchor.device)
    return dist.Normal(loc, LEARNED_PRIOR_SCALE).to_event(2)


#: Prior sd of a latent learned position table, and the sd a point-estimate table starts from
#: (BERT's initialisation, Devlin et al. 2019).
LEARNED_PRIOR_SCALE, LEARNED_INIT_STD = 1.0, 0.02


class LearnedPositionalEncoding(PyroModule):
    """Adds a learned vector per position (learned absolute positions, as BERT and GPT-2).

    The ``(max_len + leading, d)`` table is a point estimate (initialised from N(0, 0.02²)) or,
    with ``bayesian``, a latent site ``table`` with prior N(0, 1) per entry.

    Shapes:
        ``forward(h)``: ``(s, ..., T, d)`` -> ``(s', ..., T, d)`` with ``T <= max_len + leading``.
    """

    site_dims = {"table": ("position", "features")}

    def __init__(
        self, d_model: int, max_len: int, *, leading: int = 0, bayesian: bool = False
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.positions = max_len + leading
        self.register_buffer("device_anchor", torch.zeros(()), persistent=False)
        if bayesian:
            self.table = PyroSample(_learned_prior)
        else:
            self.table = nn.Parameter(torch.empty(self.positions, d_model))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw a point-estimate table from N(0, 0.02²)."""
        if isinstance(self.table, nn.Parameter):
            nn.init.normal_(self.table, std=LEARNED_INIT_STD)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        start = kv_cache.offset()  # 0 unless decoding step by step
        table = flatten_draws(self.table, 2)[:, start : start + h.shape[-2]]  # (s, T, d)
        return h + table.view(table.shape[0], *([1] * (h.dim() - 3)), *table.shape[1:])


def rotary_angles(
    positions: torch.Tensor, d_head: int, *, base: float = 1e4
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(T, d_head / 2)``: the angles ``t * base^(-2i / d_head)`` of rotary
    position embedding (RoPE, Su et al. 2021) at ``positions`` ``(T,)``."""
    freq = base ** (-torch.arange(0, d_head, 2, device=positions.device) / d_head)
    angles = positions.to(freq.dtype)[:, None] * freq  # (T, d_head / 2)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair ``(x[..., 2i], x[..., 2i + 1])`` of ``x`` ``(..., T, d_head)`` by the
    angle of its step: ``q_m · k_n`` of rotated queries and keys depends on ``m - n`` only."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
