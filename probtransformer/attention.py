"""Bayesian multi-head attention with priors on the projections and on the attention logits."""

from __future__ import annotations

import math

import torch
from pyro.nn import PyroModule, PyroSample
from torch import nn

from probtransformer import priors
from probtransformer.layers import batched_linear, flatten_draws


def masked_softmax(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim restricted to ``allowed`` entries.

    Masked entries get weight exactly 0; a row with no allowed entry gets all-zero weights (not
    NaN) and finite gradients, because masked logits are filled with the most negative finite
    float rather than ``-inf``.

    Args:
        logits: ``(..., Tq, Tk)``.
        allowed: bool, broadcastable to ``logits``; True = the query may attend to the key.

    Returns:
        ``(..., Tq, Tk)`` weights; each row sums to 1 or is all zero.
    """
    if allowed is None:
        return logits.softmax(-1)
    filled = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    return filled.softmax(-1) * allowed


def _projection_prior(module: BayesMultiheadAttention):
    d = module.d_model
    return module.weight_prior.distribution(
        (4, d, d + 1), fan_in=d, device=module.device_anchor.device
    )


def _logit_scale_prior(module: BayesMultiheadAttention):
    return module.attention_prior.distribution(module.num_heads, device=module.device_anchor.device)


class BayesMultiheadAttention(PyroModule):
    """Multi-head scaled dot-product attention (Vaswani et al. 2017) as a Pyro model.

    The Q, K, V and O projections (weights and biases) form **one** latent site, ``projection``,
    of shape ``(4, d_model, d_model + 1)`` — row block ``[q, k, v, o]``, last column the bias —
    with prior ``weight_prior`` (default ``Normal(1, fan_in=True)``, i.e. N(0, 1/d_model)).
    One site instead of eight keeps Pyro's per-site cost low (see ``benchmarks/svi_overhead.py``).
    The prior on the attention logits is a per-head inverse temperature ``logit_scale``
    (``priors.LogitScalePrior``, LogNormal): logits are ``tau_h * q·k / sqrt(d_head)``.

    The weights of every call are kept in ``attention_weights`` (detached), shape
    ``(s, N, num_heads, Tq, Tk)``, so the posterior attention can be read after a vectorized
    forward pass.

    Args:
        d_model: model width ``d``; divisible by ``num_heads``.
        num_heads: number of heads ``H``.
        bayesian: projections (and the logit scale) are latent; otherwise point estimates and no
            logit scale.
        weight_prior: prior spec of the projections.
        attention_prior: prior spec of the logit scale, or None for none.
        dropout: dropout probability on the attention weights during training.

    Raises:
        ValueError: ``d_model`` not divisible by ``num_heads``, or sizes < 1.
    """

    site_dims = {
        "projection": ("qkvo", "out_features", "in_features_and_bias"),
        "logit_scale": ("head",),
    }

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        bayesian: bool = True,
        weight_prior: priors.Normal | None = None,
        attention_prior: priors.LogitScalePrior | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if d_model < 1 or num_heads < 1 or d_model % num_heads:
            raise ValueError(
                f"d_model must be a positive multiple of num_heads, got d_model={d_model}, "
                f"num_heads={num_heads}"
            )
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_head = d_model // num_heads
        self.bayesian = bayesian
        self.weight_prior = weight_prior or priors.Normal()
        self.attention_prior = attention_prior
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("device_anchor", torch.zeros(()), persistent=False)
        if bayesian:
            self.projection = PyroSample(_projection_prior)
            self.logit_scale = (
                PyroSample(_logit_scale_prior) if attention_prior is not None else None
            )
        else:
            self.projection = nn.Parameter(torch.empty(4, d_model, d_model + 1))
            self.logit_scale = None
            self.reset_parameters()
        self.attention_weights: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        """Re-draw point-estimate projections (Xavier-uniform weights, zero bias)."""
        if self.bayesian:
            return
        with torch.no_grad():
            for i in range(4):
                nn.init.xavier_uniform_(self.projection[i, :, : self.d_model])
            self.projection[..., self.d_model].zero_()

    def forward(
        self,
        query: torch.Tensor,
        key_value: torch.Tensor | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend from ``query`` to ``key_value`` (itself when None: self-attention).

        Args:
            query: ``(s, N, Tq, d)``.
            key_value: ``(s, N, Tk, d)`` for cross-attention, or None.
            key_padding_mask: bool ``(N, Tk)``, True = real key.
            attn_mask: bool ``(Tq, Tk)``, True = allowed (e.g. causal).

        Returns:
            ``(s', N, Tq, d)``.
        """
        d, nh, hs = self.d_model, self.num_heads, self.d_head
        proj = flatten_draws(self.projection, 3)  # (s, 4, d, d + 1)
        weight, bias = proj[..., :d], proj[..., d]  # (s, 4, d, d), (s, 4, d)
        s = proj.shape[0]
        if key_value is None:
            qkv = batched_linear(
                query, weight[:, :3].reshape(s, 3 * d, d), bias[:, :3].reshape(s, 3 * d)
            )
            q, k, v = qkv.split(d, dim=-1)  # each (s', N, T, d)
        else:
            q = batched_linear(query, weight[:, 0], bias[:, 0])
            kv = batched_linear(
                key_value, weight[:, 1:3].reshape(s, 2 * d, d), bias[:, 1:3].reshape(s, 2 * d)
            )
            k, v = kv.split(d, dim=-1)
        S, N, Tq, _ = q.shape
        Tk = k.shape[-2]
        q = q.view(S, N, Tq, nh, hs).transpose(2, 3)  # (S, N, H, Tq, hs)
        k = k.view(k.shape[0], N, Tk, nh, hs).transpose(2, 3)  # (S, N, H, Tk, hs)
        v = v.view(v.shape[0], N, Tk, nh, hs).transpose(2, 3)  # (S, N, H, Tk, hs)
        logits = q @ k.transpose(-1, -2) / math.sqrt(hs)  # (S, N, H, Tq, Tk)
        if self.logit_scale is not None:
            tau = flatten_draws(self.logit_scale, 1)  # (s, H)
            logits = logits * tau.view(tau.shape[0], 1, nh, 1, 1)
        weights = masked_softmax(logits, _allowed(key_padding_mask, attn_mask))
        self.attention_weights = weights.detach()
        ctx = self.dropout(weights) @ v  # (S, N, H, Tq, hs)
        ctx = ctx.transpose(2, 3).reshape(ctx.shape[0], N, Tq, d)  # (S, N, Tq, d)
        return batched_linear(ctx, weight[:, 3], bias[:, 3])


def _allowed(
    key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """Combine masks into a bool tensor broadcastable to ``(S, N, H, Tq, Tk)``."""
    allowed = None
    if key_padding_mask is not None:
        allowed = key_padding_mask[None, :, None, None, :]  # (1, N, 1, 1, Tk)
    if attn_mask is not None:
        causal = attn_mask[None, None, None]  # (1, 1, 1, Tq, Tk)
        allowed = causal if allowed is None else allowed & causal
    return allowed
