"""Bayesian multi-head attention with priors on the projections and on the attention logits."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.nn import PyroModule, PyroSample
from torch import nn

from probtransformer import kv_cache, priors
from probtransformer.layers import (
    Dropout,
    align_draws,
    batched_affine,
    batched_linear,
    flatten_draws,
)
from probtransformer.positional import rotary_angles, rotate

_DATA_PLATE: contextvars.ContextVar = contextvars.ContextVar("data_plate", default=None)
_AMORTIZED_GUIDE: contextvars.ContextVar = contextvars.ContextVar("amortized_guide", default=None)

#: ``infer`` key marking the local (per-sequence) latent sites of stochastic attention.
LOCAL_LATENT = "local_latent"


@contextlib.contextmanager
def data_plate(plate: pyro.plate) -> Iterator[None]:
    """Make the model's data plate available to the layers that sample local latents.

    A model creates ``pyro.plate("data", ...)`` once per call and runs its network inside this
    context; stochastic attention samples its per-sequence logits inside that plate (so a
    mini-batch scales them like the likelihood), and the model observes ``y`` in the same plate.
    """
    token = _DATA_PLATE.set(plate)
    try:
        yield
    finally:
        _DATA_PLATE.reset(token)


@contextlib.contextmanager
def amortized(guide) -> Iterator[None]:
    """Sample stochastic-attention logits from the amortized guide ``guide`` instead of the prior.

    ``guide.local_scale(name, num_heads, device)`` gives the per-head guide scales.
    """
    token = _AMORTIZED_GUIDE.set(guide)
    try:
        yield
    finally:
        _AMORTIZED_GUIDE.reset(token)


def _active(per_head: torch.Tensor, heads: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``per_head[:, heads]``, without the gather (a copy) when every head is active."""
    return per_head if len(heads) == num_heads else per_head[:, heads]


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
    if allowed is not None:
        logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    # exp / sum written out: torch's CPU softmax kernel is slow on short rows (5x slower
    # forward and 2x slower forward + backward over (64, 100, 2, 9, 9) logits, one thread);
    # the max is subtracted as in torch's kernel, so no entry overflows
    e = logits - logits.detach().amax(-1, keepdim=True)
    if torch.is_grad_enabled():
        e = e.exp()
        weights = e / e.sum(-1, keepdim=True)
    else:  # predictions and decoding: in place, no new (..., Tq, Tk) tensors
        weights = e.exp_().div_(e.sum(-1, keepdim=True))
    return weights if allowed is None else weights * allowed


def _projection_prior(module: BayesMultiheadAttention):
    d = module.d_model
    return module.weight_prior.distribution(
        (4, d, d + 1), fan_in=d, device=module.device_anchor.device
    )


def _logit_scale_prior(module: BayesMultiheadAttention):
    spec = module.priors[priors.LogitScalePrior]
    return spec.distribution(module.num_heads, device=module.device_anchor.device)


def _alibi_slope_prior(module: BayesMultiheadAttention):
    spec = module.priors[priors.ALiBiSlopePrior]
    return spec.distribution(module.num_heads, device=module.device_anchor.device)


def _logit_offset_prior(module: BayesMultiheadAttention):
    T = module.max_len
    spec = module.priors[priors.AttentionLogitPrior]
    return spec.offset_distribution((module.num_heads, T, T), device=module.device_anchor.device)


def _noise_scale_prior(module: BayesMultiheadAttention):
    spec = module.priors[priors.StochasticAttentionPrior]
    return spec.scale_distribution(module.num_heads, device=module.device_anchor.device)


def _head_global_prior(module: BayesMultiheadAttention):
    return module.head_prior.global_distribution(device=module.device_anchor.device)


def _head_local_prior(module: BayesMultiheadAttention):
    return module.head_prior.local_distribution(
        module.num_heads, device=module.device_anchor.device
    )


class BayesMultiheadAttention(PyroModule):
    """Multi-head scaled dot-product attention (Vaswani et al. 2017) as a Pyro model.

    The Q, K, V and O projections (weights and biases) form **one** latent site, ``projection``,
    of shape ``(4, d_model, d_model + 1)`` — row block ``[q, k, v, o]``, last column the bias —
    with prior ``weight_prior`` (default ``Normal(1, fan_in=True)``, i.e. N(0, 1/d_model)).
    One site instead of eight keeps Pyro's per-site cost low (see
    ``benchmarks/studies/svi_overhead.py``).

    Priors on the attention logits ``s = q·k / sqrt(d_head)`` (``attention_prior``, any of):

    - ``priors.LogitScalePrior``: a per-head inverse temperature, ``s -> tau_h · s`` (site
      ``logit_scale``; only with Bayesian projections).
    - ``priors.AttentionLogitPrior``: guidance, ``s -> s + log P + ε`` with a latent per-head
      ``(max_len, max_len)`` offset ``ε ~ N(0, 1 / strength)`` (site ``logit_offset``).
    - ``priors.ALiBiSlopePrior``: a distance-decay bias ``s -> s - m_h |i - j|`` with a latent
      slope per head (site ``alibi_slope``; Press et al. 2022, the slopes learned).
    - ``priors.StochasticAttentionPrior``: the logits become local latents (site
      ``attention_logits``, one ``(H, Tq, Tk)`` event per sequence, in the model's data plate)
      with a contextual prior mean from the keys and per-head noise scales (site
      ``noise_scale``); see that class.

    ``head_prior=priors.HeadGatePrior()`` multiplies each head's output by a gate in [0, 1]
    (sites ``head_global_scale``, ``head_local_scale``). Heads switched off in the bool buffer
    ``head_active`` (see ``Posterior.prune_heads``) are not computed at all.

    The weights of every call are kept in ``attention_weights`` (detached), shape
    ``(s, N, H, Tq, Tk)`` (pruned heads all zero), so the posterior attention can be read after a
    vectorized forward pass.

    Args:
        d_model: model width ``d``; divisible by ``num_heads``.
        num_heads: number of heads ``H``.
        bayesian: projections (and the logit scale) are latent; otherwise point estimates.
        weight_prior: prior spec of the projections.
        attention_prior: None, one attention-logit prior spec, or a sequence of them.
        head_prior: ``priors.HeadGatePrior`` or None.
        max_len: longest sequence the attention sees (required with ``AttentionLogitPrior``).
        dropout: dropout probability on the attention weights during training.
        rotary: rotate the queries and keys of self-attention by their positions (RoPE, Su et
            al. 2021), so the logits depend on relative offsets only; needs an even ``d_head``.
        hard: hard selection of the top key: each query takes the value of the key with the
            largest attention weight only (weights one-hot; ties go to the first key). Gradients
            pass through the softmax weights (straight-through estimator, Bengio et al. 2013),
            so the projections still learn. The ablation against full attention of
            ``benchmarks/claims.py``.

    Raises:
        ValueError: ``d_model`` not divisible by ``num_heads``, sizes < 1, guidance without
            ``max_len``, or ``rotary`` with an odd ``d_head``.
        TypeError: a prior of the wrong spec type.
    """

    #: Where guides start these sites instead of at a random prior draw: the guidance offsets at
    #: 0, i.e. at the guidance itself (a draw from a weak prior would put attention anywhere and
    #: SVI keeps most of it; see tests/probtransformer/test_guidance.py).
    initial_values = {"logit_offset": 0.0}

    site_dims = {
        "projection": ("qkvo", "out_features", "in_features_and_bias"),
        "logit_scale": ("head",),
        "logit_offset": ("head", "query", "key"),
        "alibi_slope": ("head",),
        "noise_scale": ("head",),
        "head_global_scale": (),
        "head_local_scale": ("head",),
    }

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        bayesian: bool = True,
        weight_prior: priors.Normal | None = None,
        attention_prior=None,
        head_prior: priors.HeadGatePrior | None = None,
        max_len: int | None = None,
        dropout: float = 0.0,
        rotary: bool = False,
        hard: bool = False,
    ) -> None:
        super().__init__()
        if d_model < 1 or num_heads < 1 or d_model % num_heads:
            raise ValueError(
                f"d_model must be a positive multiple of num_heads, got d_model={d_model}, "
                f"num_heads={num_heads}"
            )
        if head_prior is not None and not isinstance(head_prior, priors.HeadGatePrior):
            raise TypeError(
                "head_prior must be a priors.HeadGatePrior or None, got "
                f"{type(head_prior).__name__}"
            )
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_head = d_model // num_heads
        if rotary and self.d_head % 2:
            raise ValueError(
                f"rotary positions rotate pairs of features: d_head = d_model / num_heads must be "
                f"even, got {d_model} / {num_heads} = {self.d_head}"
            )
        self.rotary = rotary
        self.bayesian = bayesian
        self.weight_prior = weight_prior or priors.Normal()
        self.priors = {type(spec): spec for spec in priors.attention_specs(attention_prior)}
        if not bayesian:
            self.priors.pop(priors.LogitScalePrior, None)
        self.head_prior = head_prior
        self.max_len = max_len
        self.hard = hard
        self.dropout = Dropout(dropout)
        self.register_buffer("device_anchor", torch.zeros(()), persistent=False)
        self.register_buffer("head_active", torch.ones(num_heads, dtype=torch.bool))
        self._make_projections()
        if priors.LogitScalePrior in self.priors:
            self.logit_scale = PyroSample(_logit_scale_prior)
        if priors.AttentionLogitPrior in self.priors:
            if max_len is None or max_len < 1:
                raise ValueError(f"an AttentionLogitPrior needs max_len >= 1, got {max_len!r}")
            self.priors[priors.AttentionLogitPrior].log_guidance(max_len, None, device="cpu")
            self.logit_offset = PyroSample(_logit_offset_prior)
        if priors.ALiBiSlopePrior in self.priors:
            self.alibi_slope = PyroSample(_alibi_slope_prior)
        self.stochastic = priors.StochasticAttentionPrior in self.priors
        if self.stochastic:
            self.noise_scale = PyroSample(_noise_scale_prior)
            self.prior_key_weight = nn.Parameter(torch.zeros(num_heads, self.d_head))
        if head_prior is not None:
            self.head_global_scale = PyroSample(_head_global_prior)
            self.head_local_scale = PyroSample(_head_local_prior)
        self.reset_parameters()
        self.attention_weights: torch.Tensor | None = None

    def _make_projections(self) -> None:
        """The Q, K, V, O projections: one ``(4, d, d + 1)`` latent site, or a parameter."""
        if self.bayesian:
            self.projection = PyroSample(_projection_prior)
        else:
            self.projection = nn.Parameter(torch.empty(4, self.d_model, self.d_model + 1))

    def reset_parameters(self) -> None:
        """Re-draw point-estimate projections (Xavier-uniform weights, zero bias)."""
        if self.stochastic:
            with torch.no_grad():
                self.prior_key_weight.zero_()
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

        Raises:
            ValueError: stochastic attention called outside a model's ``data_plate``.
        """
        heads = self.head_active.nonzero().flatten()  # (H',)
        nh = len(heads)
        if nh == 0:  # every head switched off: the sublayer adds its output bias alone
            Tk = query.shape[-2] if key_value is None else key_value.shape[-2]
            bias = self._output_bias()  # (s, d)
            S, N, Tq = bias.shape[0], query.shape[-3], query.shape[-2]
            self.attention_weights = query.new_zeros(S, N, self.num_heads, Tq, Tk)
            return bias.view(S, 1, 1, -1).expand(S, N, Tq, self.d_model)
        logits, keys, values, first_query = self._scores(query, key_value, heads)
        S, N, _, Tq, Tk = logits.shape
        allowed = _allowed(key_padding_mask, attn_mask)
        prior_terms = 0.0
        if priors.ALiBiSlopePrior in self.priors:
            slope = _active(flatten_draws(self.alibi_slope, 1), heads, self.num_heads)  # (s, H')
            offsets = torch.arange(first_query, first_query + Tq, device=logits.device)[
                :, None
            ] - torch.arange(Tk, device=logits.device)
            distance = offsets.abs().to(logits.dtype)  # (Tq, Tk): |i - j|
            prior_terms = -slope.view(slope.shape[0], 1, nh, 1, 1) * distance
            logits = logits + prior_terms
        if priors.AttentionLogitPrior in self.priors:
            spec = self.priors[priors.AttentionLogitPrior]
            log_p = spec.log_guidance(Tk, key_padding_mask, device=logits.device)  # ([N,] T, T)
            if log_p.dim() == 3 and log_p.shape[0] not in (1, N):
                raise ValueError(
                    f"the guidance returned weights for {log_p.shape[0]} sequences, but the "
                    f"input has N={N}: return (T, T) or (N, T, T)"
                )
            log_p = log_p.view(1, -1, 1, Tk, Tk)[..., first_query:, :]  # (1, N or 1, 1, Tq, Tk)
            offset = flatten_draws(self.logit_offset, 3)[:, heads, first_query:Tk, :Tk]
            guidance = log_p.masked_fill(log_p == -math.inf, 0.0) + offset[:, None]
            prior_terms = prior_terms + guidance
            guided = log_p > -math.inf
            allowed = guided if allowed is None else allowed & guided
            logits = logits + guidance
        if self.stochastic:
            logits = self._stochastic_logits(logits, keys, prior_terms, allowed, heads)
        weights = masked_softmax(logits, allowed)
        if self.hard:
            weights = _straight_through_top1(weights)
        self.attention_weights = weights.detach()
        if nh < self.num_heads:  # pruned heads keep their index, with weights 0
            self.attention_weights = weights.new_zeros(S, N, self.num_heads, Tq, Tk)
            self.attention_weights[:, :, heads] = weights.detach()
        ctx = self._attend(self.dropout(weights), values)  # (S, N, H', Tq, d_v)
        if self.head_prior is not None:
            gate = priors.HeadGatePrior.gate(
                flatten_draws(self.head_global_scale, 0), flatten_draws(self.head_local_scale, 1)
            )[:, heads]  # (s, H')
            ctx = ctx * gate.view(gate.shape[0], 1, nh, 1, 1)
        return self._combine(ctx, heads)

    # -- what the parameterization decides: the logits, the values, the output ------------------

    def _output_bias(self) -> torch.Tensor:
        """``(s, d)`` the output projection's bias (the sublayer's output with every head off)."""
        return flatten_draws(self.projection, 3)[:, 3, :, self.d_model]

    def _scores(self, query, key_value, heads):
        """The logits of the active ``heads`` and what the weights average: ``(logits (S, N,
        H', Tq, Tk), keys (S, N, H', Tk, d_head), values (S, N, H', Tk, d_head), first_query)``,
        ``first_query`` the position of the first query (past steps of a KV cache before)."""
        d, hs = self.d_model, self.d_head
        nh = len(heads)
        proj = flatten_draws(self.projection, 3)  # (s, 4, d, d + 1)
        if nh < self.num_heads:  # pruned heads: drop their Q/K/V rows
            rows = (heads[:, None] * hs + torch.arange(hs, device=heads.device)).flatten()
            qkv = proj[:, :3].index_select(2, rows)  # (s, 3, d', d + 1)
        else:
            qkv = proj[:, :3]
        di = nh * hs
        s = proj.shape[0]
        if key_value is None:
            q, k, v = batched_affine(query, qkv.reshape(s, 3 * di, d + 1)).split(di, dim=-1)
        else:
            q = batched_affine(query, qkv[:, 0])
            k, v = batched_affine(key_value, qkv[:, 1:].reshape(s, 2 * di, d + 1)).split(di, -1)
        S, N, Tq, _ = q.shape
        Tk = k.shape[-2]
        q = q.view(S, N, Tq, nh, hs).transpose(2, 3)  # (S, N, H', Tq, hs)
        k = k.view(k.shape[0], N, Tk, nh, hs).transpose(2, 3)  # (S, N, H', Tk, hs)
        v = v.view(v.shape[0], N, Tk, nh, hs).transpose(2, 3)  # (S, N, H', Tk, hs)
        # self-attention: the queries are the last Tq of the Tk steps (Tk > Tq with a cache)
        cache = kv_cache.active() if key_value is None else None
        first_query = 0 if cache is None else cache.offset
        if self.rotary and key_value is None:
            positions = torch.arange(first_query, first_query + Tq, device=q.device)
            cos, sin = rotary_angles(positions, hs)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:  # the new steps attend to the cached ones too
            if self.stochastic:
                raise RuntimeError(
                    "stochastic attention samples a (T, T) logit event per sequence, which a "
                    "KV cache cannot extend step by step: decode without the cache"
                )
            k, v = cache.keys_values(self, k, v)
        # the scales go on the (Tq, d_head) queries rather than the (Tq, Tk) logits: same
        # logits, fewer operations whenever T > d_head
        scale = 1.0 / math.sqrt(hs)
        if priors.LogitScalePrior in self.priors:
            tau = _active(flatten_draws(self.logit_scale, 1), heads, self.num_heads)  # (s, H')
            scale = tau.view(tau.shape[0], 1, nh, 1, 1) * scale
        logits = (q * scale) @ k.transpose(-1, -2)  # (S, N, H', Tq, Tk)
        return logits, k, v, first_query

    def _attend(self, weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``weights (S, N, H', Tq, Tk) @ values (S, N, H', Tk, d_head)``."""
        return weights @ values

    def _combine(self, ctx: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """The output ``(S, N, Tq, d)`` of the heads' contexts ``ctx (S, N, H', Tq, d_head)``:
        the heads side by side through the output projection."""
        d, hs, nh = self.d_model, self.d_head, len(heads)
        proj = flatten_draws(self.projection, 3)  # (s, 4, d, d + 1)
        if nh < self.num_heads:  # pruned heads: drop their O columns
            rows = (heads[:, None] * hs + torch.arange(hs, device=heads.device)).flatten()
            out = torch.cat([proj[:, 3, :, rows], proj[:, 3, :, d:]], -1)  # (s, d, d' + 1)
        else:
            out = proj[:, 3]
        S, N, _, Tq, _ = ctx.shape
        di = nh * hs
        # (S, N, Tq, d' + 1): the heads side by side and a column of ones for the output bias,
        # written in one copy (batched_affine would copy once more to append the ones)
        ctx_one = ctx.new_empty(S, N, Tq, di + 1)
        ctx_one[..., :di].view(S, N, Tq, nh, hs).copy_(ctx.transpose(2, 3))
        ctx_one[..., di] = 1.0
        return batched_linear(ctx_one, out)

    def _stochastic_logits(
        self,
        logits: torch.Tensor,
        k: torch.Tensor,
        prior_terms: torch.Tensor | float,
        allowed: torch.Tensor | None,
        heads: torch.Tensor,
    ) -> torch.Tensor:
        """Sample the local latent logits ``(S, N, H', Tq, Tk)`` (see StochasticAttentionPrior).

        Model: ``N(k_j · w_h / sqrt(d_head) + prior terms, σ_h)``; amortized guide (inside
        ``amortized(guide)``): ``N(logits, s_h)``. Masked entries are ``N(0, 1)`` in both (their
        KL is 0, and ``LocScaleReparam`` sees a plain Normal).
        """
        plate = _DATA_PLATE.get()
        if plate is None:
            raise ValueError(
                "stochastic attention samples one latent per sequence: the model must run its "
                "network inside probtransformer.attention.data_plate(pyro.plate('data', ...))"
            )
        name = self._pyro_get_fullname("attention_logits")
        guide = _AMORTIZED_GUIDE.get()
        if guide is not None:
            loc = logits
            scale = guide.local_scale(name, self.num_heads, logits.device)[heads]  # (H',)
            scale = scale.view(1, 1, -1, 1, 1)
        else:
            w = self.prior_key_weight[heads]  # (H', hs)
            context = torch.einsum("snhkc,hc->snhk", k, w) / math.sqrt(self.d_head)
            loc = context[..., None, :] + prior_terms  # (S, N, H', 1 or Tq, Tk)
            sigma = flatten_draws(self.noise_scale, 1)[:, heads]  # (s, H')
            scale = sigma.view(sigma.shape[0], 1, -1, 1, 1)
        shape = (max(loc.shape[0], scale.shape[0]), *logits.shape[1:])
        loc, scale = align_draws(loc.expand(shape)), align_draws(scale.expand(shape))
        if allowed is not None:  # masked logits: N(0, 1) in model and guide alike, KL 0
            visible = allowed[0]  # (N or 1, 1, Tq, Tk) against (*draws, N, H', Tq, Tk)
            loc, scale = loc.where(visible, 0.0), scale.where(visible, 1.0)
        weight = self.priors[priors.StochasticAttentionPrior].kl_weight
        with plate, poutine.scale(scale=weight):
            fn = dist.Normal(loc, scale).to_event(3)
            z = pyro.sample(name, fn, infer={LOCAL_LATENT: True})
        return z.reshape(-1, *logits.shape[1:])


def _straight_through_top1(weights: torch.Tensor) -> torch.Tensor:
    """One-hot weights on each row's largest entry (all-zero rows stay zero), with the gradient
    of ``weights`` (straight-through)."""
    top = weights.argmax(-1, keepdim=True)
    one_hot = torch.zeros_like(weights).scatter_(-1, top, 1.0)
    one_hot = one_hot * (weights.sum(-1, keepdim=True) > 0)
    return one_hot + (weights - weights.detach())  # exactly one_hot forward


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
