"""Multi-head attention parameterized by its circuits: per-head ``W_QK`` and ``W_OV`` latents.

The factors ``W_Q, W_K, W_V, W_O`` of ``BayesMultiheadAttention`` enter the output only through
the products ``W_Qᵀ W_K`` (the logits) and ``W_O W_V`` (the output), which are unchanged under
``(W_Q A, W_K A⁻ᵀ)`` and ``(W_V B, W_O B⁻¹)`` for any invertible ``A``, ``B`` per head: a gauge
symmetry that only the prior breaks, leaving the posterior with curved ridges that no fixed
metric straightens. Sampling the products themselves removes it: the logits are linear in
``W_QK`` and the output in ``W_OV`` (Elhage et al. 2021, "A Mathematical Framework for
Transformer Circuits", read the same products).

Per head ``h``, with ``x̃ = [x; 1]``:

- logits ``s_ij = x̃_iᵀ W_QK^h x_j / sqrt(d_head)``, ``W_QK^h`` of shape ``(d + 1, d)``: its last
  row is the query bias's term ``b_Qᵀ W_K``; the key bias's terms are constant along a row and
  drop out of the softmax;
- output ``o_i = Σ_h W_OV^h (Σ_j a_ij x̃_j) + b_O``, ``W_OV^h`` of shape ``(d, d + 1)``: its last
  column is ``W_O b_V``, which enters times the row's total weight (0 for a query with no
  visible key, as in the factors).

From a factor draw, ``W_QK^h = τ_h [W_Q^hᵀ W_K^h; b_Q^hᵀ W_K^h]`` and ``W_OV^h = [W_O^h W_V^h,
W_O^h b_V^h]`` give the same predictions (``from_factors``). The circuits hold ``2 H d (d + 1)
+ d`` latents against the factors' ``4 d (d + 1)``; every ``W_QK^h`` may have full rank ``d``
where a factor product has rank ``d_head``.

Prior, matched in scale to the factors': a product of ``d_head`` pairs of N(0, σ²) entries has
entry variance ``d_head σ⁴``, so ``W_QK`` and ``W_OV`` are ``N(0, d_head σ⁴)`` entrywise, σ the
factors' prior sd (``weight_prior`` with ``fan_in = d``); ``b_O`` is ``N(0, σ²)``. The logit
scale is ``W_QK``'s own: a ``LogitScalePrior`` would bring the symmetry back (``τ W`` against
``W / c``), so it is refused, as are rotary positions (a rotation between the factors) and
stochastic attention (its prior mean is built from the keys).
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from pyro.nn import PyroSample
from torch import nn

from probtransformer import kv_cache, priors
from probtransformer.attention import BayesMultiheadAttention
from probtransformer.layers import batched_affine, batched_linear, flatten_draws

#: The attention parameterizations of ``EncoderConfig.attention_parameterization``.
PARAMETERIZATIONS = ("factors", "circuits")


def _circuit_sd(module: CircuitAttention) -> float:
    """Entry sd of a product of ``d_head`` pairs of the factors' N(0, σ²) entries."""
    sigma = module.weight_prior.std(module.d_model)
    return math.sqrt(module.d_head) * sigma**2


def _qk_prior(module: CircuitAttention):
    shape = (module.num_heads, module.d_model + 1, module.d_model)
    loc = torch.zeros(shape, device=module.device_anchor.device)
    return dist.Normal(loc, _circuit_sd(module)).to_event(3)


def _ov_prior(module: CircuitAttention):
    shape = (module.num_heads, module.d_model, module.d_model + 1)
    loc = torch.zeros(shape, device=module.device_anchor.device)
    return dist.Normal(loc, _circuit_sd(module)).to_event(3)


def _out_bias_prior(module: CircuitAttention):
    return module.weight_prior.distribution(
        (module.d_model,), fan_in=module.d_model, device=module.device_anchor.device
    )


class CircuitAttention(BayesMultiheadAttention):
    """``BayesMultiheadAttention`` with latent per-head circuits ``W_QK``, ``W_OV`` (see the
    module docstring) instead of the factors' ``projection``.

    Sites: ``qk_circuit`` ``(H, d + 1, d)``, ``ov_circuit`` ``(H, d, d + 1)``, ``out_bias``
    ``(d,)`` (plain parameters when not ``bayesian``, started at the products of Xavier-uniform
    factors). The other sites, the recorded ``attention_weights``, head gates and pruning, the
    guidance and ALiBi priors, cross-attention and the KV cache work as in the factors.

    Args:
        As ``BayesMultiheadAttention``.

    Raises:
        ValueError: ``attention_prior`` holding a ``LogitScalePrior`` or a
            ``StochasticAttentionPrior``, ``rotary=True``, or a ``weight_prior`` with a
            nonzero ``loc`` (a product's mean would not be its factors'); the base class's
            errors.
    """

    site_dims = {
        **BayesMultiheadAttention.site_dims,
        "qk_circuit": ("head", "query_features_and_bias", "key_features"),
        "ov_circuit": ("head", "out_features", "value_features_and_bias"),
        "out_bias": ("out_features",),
    }

    def __init__(self, d_model: int, num_heads: int, **options) -> None:
        specs = priors.attention_specs(options.get("attention_prior"))
        refused = [
            type(spec).__name__
            for spec in specs
            if isinstance(spec, (priors.LogitScalePrior, priors.StochasticAttentionPrior))
        ]
        if refused:
            raise ValueError(
                f"attention_parameterization='circuits' takes no {refused[0]}: W_QK carries the "
                "logits' scale itself (a LogitScalePrior, the default attention_prior, would add "
                "a scale symmetry back) and stochastic attention builds its prior from the keys, "
                "which circuits do not form; pass attention_prior=None (or guidance/ALiBi specs)"
            )
        if options.get("rotary"):
            raise ValueError(
                "attention_parameterization='circuits' cannot rotate queries and keys (rotary "
                "positions sit between W_Q and W_K): use positions='sinusoidal' or 'learned'"
            )
        weight_prior = options.get("weight_prior") or priors.Normal()
        if weight_prior.loc != 0:
            raise ValueError(
                f"attention_parameterization='circuits' needs a weight_prior centred at 0, got "
                f"loc={weight_prior.loc}: the circuits' prior is matched to products of "
                "zero-mean factors"
            )
        super().__init__(d_model, num_heads, **options)

    def _make_projections(self) -> None:
        d, h = self.d_model, self.num_heads
        if self.bayesian:
            self.qk_circuit = PyroSample(_qk_prior)
            self.ov_circuit = PyroSample(_ov_prior)
            self.out_bias = PyroSample(_out_bias_prior)
        else:
            self.qk_circuit = nn.Parameter(torch.empty(h, d + 1, d))
            self.ov_circuit = nn.Parameter(torch.empty(h, d, d + 1))
            self.out_bias = nn.Parameter(torch.empty(d))

    def reset_parameters(self) -> None:
        """Re-draw point-estimate circuits: the products of Xavier-uniform factors (zero
        biases), as the factors start."""
        if self.bayesian:
            return
        factors = torch.empty(4, self.d_model, self.d_model + 1)
        for i in range(4):
            nn.init.xavier_uniform_(factors[i, :, : self.d_model])
        factors[..., self.d_model] = 0.0
        qk, ov, bias = from_factors(factors, None, self.num_heads)
        with torch.no_grad():
            self.qk_circuit.copy_(qk)
            self.ov_circuit.copy_(ov)
            self.out_bias.copy_(bias)

    def _output_bias(self) -> torch.Tensor:
        return flatten_draws(self.out_bias, 1)  # (s, d)

    def _scores(self, query, key_value, heads):
        """Logits ``x̃_iᵀ W_QK x_j / sqrt(d_head)`` of the active heads; the keys are the key
        inputs ``(s, N, Tk, d)`` and the values ``x̃`` ``(s, N, Tk, d + 1)``, shared by the
        heads (see ``BayesMultiheadAttention._scores``)."""
        qk = flatten_draws(self.qk_circuit, 3)  # (s, H, d + 1, d)
        if len(heads) < self.num_heads:
            qk = qk[:, heads]
        s, nh, d = qk.shape[0], qk.shape[1], self.d_model
        keys = query if key_value is None else key_value  # (s, N, Tk, d)
        values = torch.cat([keys, torch.ones_like(keys[..., :1])], -1)  # (s, N, Tk, d + 1)
        cache = kv_cache.active() if key_value is None else None
        first_query = 0 if cache is None else cache.offset
        if cache is not None:  # the new steps attend to the cached ones too
            keys, values = cache.keys_values(self, keys, values)
        # every head's W_QK as one affine map: (s, H' d, d + 1), the query bias's row last
        weight_bias = (qk / math.sqrt(self.d_head)).transpose(-1, -2).reshape(s, nh * d, d + 1)
        projected = batched_affine(query, weight_bias)  # (S, N, Tq, H' d)
        S, N, Tq, _ = projected.shape
        heads_first = projected.view(S, N, Tq, nh, d).transpose(2, 3).reshape(S, N, nh * Tq, d)
        logits = heads_first @ keys.transpose(-1, -2)  # (S, N, H' Tq, Tk)
        return logits.view(S, N, nh, Tq, -1), keys, values, first_query

    def _attend(self, weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``(S, N, H', Tq, d + 1)``: each head's weights over the shared values ``x̃``, one
        product for all heads (broadcasting the values over the heads would copy them)."""
        S, N, nh, Tq, Tk = weights.shape
        return (weights.reshape(S, N, nh * Tq, Tk) @ values).view(S, N, nh, Tq, -1)

    def _combine(self, ctx: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """``Σ_h W_OV^h ctx_h + b_O`` of the contexts ``ctx (S, N, H', Tq, d + 1)``."""
        ov = flatten_draws(self.ov_circuit, 3)  # (s, H, d, d + 1)
        if len(heads) < self.num_heads:
            ov = ov[:, heads]
        S, N, nh, Tq, dv = ctx.shape
        # the heads side by side: one product with W_OV's heads as one (d, H' (d + 1)) matrix
        flat = ctx.transpose(2, 3).reshape(S, N, Tq, nh * dv)  # (S, N, Tq, H' (d + 1))
        weight = ov.transpose(1, 2).reshape(ov.shape[0], self.d_model, nh * dv)
        return batched_linear(flat, weight, self._output_bias())


def from_factors(
    projection: torch.Tensor, logit_scale: torch.Tensor | None, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The circuits that compute what factors compute (see the module docstring).

    Args:
        projection: ``(..., 4, d, d + 1)`` a factor draw, rows ``[q, k, v, o]``, last column
            the bias.
        logit_scale: ``(..., H)`` the per-head inverse temperatures, or None (1).
        num_heads: ``H``.

    Returns:
        ``(qk (..., H, d + 1, d), ov (..., H, d, d + 1), out_bias (..., d))``.
    """
    *lead, _, d, _ = projection.shape
    hs = d // num_heads
    q, k, v, o = projection.unbind(-3)  # (..., d, d + 1) each
    wq = q[..., :d].reshape(*lead, num_heads, hs, d)  # (..., H, hs, d)
    bq = q[..., d].reshape(*lead, num_heads, hs, 1)
    wk = k[..., :d].reshape(*lead, num_heads, hs, d)
    wv = v[..., :d].reshape(*lead, num_heads, hs, d)
    bv = v[..., d].reshape(*lead, num_heads, hs, 1)
    wo = o[..., :d].reshape(*lead, d, num_heads, hs).movedim(-2, -3)  # (..., H, d, hs)
    qk = torch.cat([wq, bq], -1).transpose(-1, -2) @ wk  # (..., H, d + 1, d)
    if logit_scale is not None:
        qk = qk * logit_scale[..., :, None, None]
    ov = wo @ torch.cat([wv, bv], -1)  # (..., H, d, d + 1)
    return qk, ov, o[..., d]


__all__ = ["PARAMETERIZATIONS", "CircuitAttention", "from_factors"]
