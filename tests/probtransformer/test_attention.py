"""Attention, and the blocks built on it: TransformerBlock, TransformerEncoder, embeddings."""

import math

import pyro
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from torch import nn

from probtransformer import priors
from probtransformer.attention import BayesMultiheadAttention, masked_softmax
from probtransformer.block import TransformerBlock
from probtransformer.embedding import FeatureEmbedding
from probtransformer.encoder import TransformerEncoder
from probtransformer.positional import SinusoidalPositionalEncoding

D, H = 8, 2


def _point_attention(d=D, h=H) -> BayesMultiheadAttention:
    attn = BayesMultiheadAttention(d, h, bayesian=False)
    with torch.no_grad():
        attn.projection.normal_(0.0, 0.5)  # non-zero biases too
    return attn


def _conditioned(projection, logit_scale=None, d=D, h=H):
    attn = BayesMultiheadAttention(d, h, attention_prior=priors.LogitScalePrior())
    data = {"projection": projection}
    if logit_scale is not None:
        data["logit_scale"] = logit_scale
    return attn, poutine.condition(attn, data=data)


def _padding_mask():
    # sequence 0: all 5 keys real; sequence 1: last two are padding; sequence 2: no real key
    return torch.tensor(
        [[True] * 5, [True, True, True, False, False], [False] * 5], dtype=torch.bool
    )


# -- masked softmax ---------------------------------------------------------------------------


def test_masked_softmax_rows_sum_to_one_and_masked_entries_are_zero():
    logits = torch.randn(4, 3, 6) * 10
    allowed = torch.rand(4, 3, 6) > 0.4
    allowed[..., 0] = True
    allowed[0, 0] = False  # one row with no allowed entry
    w = masked_softmax(logits, allowed)
    assert torch.equal(w[~allowed], torch.zeros_like(w[~allowed]))
    sums = w.sum(-1)
    torch.testing.assert_close(sums[0, 0], torch.tensor(0.0))
    rest = torch.ones_like(sums, dtype=torch.bool)
    rest[0, 0] = False
    torch.testing.assert_close(sums[rest], torch.ones_like(sums[rest]))
    reference = logits.masked_fill(~allowed, -math.inf).softmax(-1)
    torch.testing.assert_close(w[rest], reference[rest])


# -- masks in the attention module -------------------------------------------------------------


def test_padding_mask_rows_sum_to_one_and_padded_keys_get_zero_weight():
    attn = _point_attention()
    mask = _padding_mask()
    out = attn(torch.randn(1, 3, 5, D), key_padding_mask=mask)
    w = attn.attention_weights
    assert out.shape == (1, 3, 5, D)
    assert w.shape == (1, 3, H, 5, 5)
    sums = w.sum(-1)  # (1, N, H, Tq)
    torch.testing.assert_close(sums[:, :2], torch.ones_like(sums[:, :2]))
    assert torch.all(w[:, 1, :, :, 3:] == 0.0)
    assert torch.all(w[:, 2] == 0.0)  # no visible key: all-zero weights, not NaN


def test_causal_mask_zeroes_future_keys():
    attn = _point_attention()
    T = 6
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    attn(torch.randn(1, 2, T, D), attn_mask=causal)
    w = attn.attention_weights  # (1, 2, H, T, T)
    future = ~causal
    assert torch.all(w[..., future] == 0.0)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, H, T))
    torch.testing.assert_close(w[..., 0, 0], torch.ones(1, 2, H))  # first query sees itself only


def test_padding_and_causal_masks_combine():
    attn = _point_attention()
    T = 4
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.tensor([[True, True, True, False], [False, True, True, True]])
    attn(torch.randn(1, 2, T, D), key_padding_mask=mask, attn_mask=causal)
    w = attn.attention_weights[0]  # (2, H, T, T)
    allowed = causal[None, None] & mask[:, None, None, :]  # (2, 1, T, T)
    assert torch.all(w[~allowed.expand_as(w)] == 0.0)
    sums = w.sum(-1)  # (2, H, T)
    # sequence 1, query 0 may only see key 0, which is padding: an all-zero row
    torch.testing.assert_close(sums[1, :, 0], torch.zeros(H))
    torch.testing.assert_close(sums[1, :, 1:], torch.ones(H, T - 1))
    torch.testing.assert_close(sums[0], torch.ones(H, T))


def test_query_without_visible_key_has_zero_weights_and_finite_gradients():
    attn = _point_attention()
    query = torch.randn(1, 3, 5, D, requires_grad=True)
    out = attn(query, key_padding_mask=_padding_mask())
    assert torch.isfinite(out).all()
    # with no visible key the context is 0 and the output is the output projection's bias
    torch.testing.assert_close(out[0, 2], attn.projection[3, :, D].detach().expand(5, D))
    loss = (out**2).sum() + out.logsumexp(-1).sum()
    loss.backward()
    assert torch.isfinite(query.grad).all()
    assert torch.isfinite(attn.projection.grad).all()
    assert query.grad[0, 0].abs().sum() > 0


def test_latent_attention_with_empty_rows_has_finite_gradients_for_its_draws():
    S = 3
    projection = (torch.randn(S, 1, 4, D, D + 1) * 0.3).requires_grad_()
    logit_scale = torch.full((S, 1, H), 2.0, requires_grad=True)
    _, attn = _conditioned(projection, logit_scale)
    query = torch.randn(1, 3, 5, D, requires_grad=True)
    with pyro.plate("draws", S, dim=-2):
        out = attn(query, key_padding_mask=_padding_mask())
    assert out.shape == (S, 3, 5, D)
    out.pow(2).sum().backward()
    for grad in (query.grad, projection.grad, logit_scale.grad):
        assert torch.isfinite(grad).all()


# -- draw dims --------------------------------------------------------------------------------


@pytest.mark.parametrize("s_h", [1, 4])
def test_draw_dims_match_a_loop_over_draws(s_h):
    S, N, T = 4, 2, 5
    projection = torch.randn(S, 1, 4, D, D + 1) * 0.4
    logit_scale = torch.rand(S, 1, H) + 0.5
    module, attn = _conditioned(projection, logit_scale)
    query = torch.randn(s_h, N, T, D)
    mask = torch.tensor([[True] * T, [True, True, True, False, False]])
    with pyro.plate("draws", S, dim=-2):
        out = attn(query, key_padding_mask=mask)
    weights = module.attention_weights
    assert out.shape == (S, N, T, D)
    assert weights.shape == (S, N, H, T, T)
    for s in range(S):
        _, single = _conditioned(projection[s, 0], logit_scale[s, 0])
        expected = single(query[s % s_h][None], key_padding_mask=mask)
        assert expected.shape == (1, N, T, D)
        torch.testing.assert_close(out[s], expected[0], rtol=1e-5, atol=1e-5)


def test_one_draw_keeps_a_draw_dim_of_one():
    _, attn = _conditioned(torch.randn(4, D, D + 1) * 0.4, torch.ones(H))
    assert attn(torch.randn(1, 3, 5, D)).shape == (1, 3, 5, D)


def test_point_estimate_weights_broadcast_over_hidden_draws():
    attn = _point_attention()
    query = torch.randn(3, 2, 4, D)
    out = attn(query)
    assert out.shape == (3, 2, 4, D)
    for s in range(3):
        torch.testing.assert_close(out[s], attn(query[s : s + 1])[0], rtol=1e-5, atol=1e-6)


def test_cross_attention_shapes_with_different_lengths():
    attn = _point_attention()
    N, Tq, Tk = 3, 4, 7
    query, memory = torch.randn(1, N, Tq, D), torch.randn(1, N, Tk, D)
    mask = torch.ones(N, Tk, dtype=torch.bool)
    mask[1, 5:] = False
    out = attn(query, memory, key_padding_mask=mask)
    w = attn.attention_weights
    assert out.shape == (1, N, Tq, D)
    assert w.shape == (1, N, H, Tq, Tk)
    assert torch.all(w[0, 1, :, :, 5:] == 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, N, H, Tq))


# -- logit scale ------------------------------------------------------------------------------


def test_larger_logit_scale_sharpens_attention():
    projection = torch.randn(4, D, D + 1) * 0.5
    query = torch.randn(1, 3, 6, D)
    module, attn = _conditioned(projection, torch.ones(H))
    attn(query)
    soft = module.attention_weights
    module, attn = _conditioned(projection, torch.full((H,), 4.0))
    attn(query)
    sharp = module.attention_weights
    # softmax(tau * z): the max weight grows and the entropy falls as tau grows
    assert torch.all(sharp.amax(-1) >= soft.amax(-1) - 1e-6)
    assert sharp.amax(-1).mean() > soft.amax(-1).mean() + 0.05
    entropy = lambda w: -(w * w.clamp_min(1e-30).log()).sum(-1)  # noqa: E731
    assert torch.all(entropy(sharp) <= entropy(soft) + 1e-5)


def test_logit_scale_site_has_lognormal_prior():
    attn = BayesMultiheadAttention(D, 4, attention_prior=priors.LogitScalePrior(loc=0.0, scale=0.5))
    tr = poutine.trace(attn).get_trace(torch.randn(1, 2, 3, D))
    proj, tau = tr.nodes["projection"], tr.nodes["logit_scale"]
    assert proj["value"].shape == (4, D, D + 1)
    assert tau["value"].shape == (4,)
    torch.testing.assert_close(proj["fn"].stddev, torch.full((4, D, D + 1), 1 / math.sqrt(D)))
    median = tau["fn"].base_dist.icdf(torch.tensor(0.5))
    torch.testing.assert_close(median, torch.ones(4))
    assert not hasattr(BayesMultiheadAttention(D, 4), "logit_scale")  # no attention prior, no site


# -- numerics against PyTorch -------------------------------------------------------------------


def _torch_mha(attn: BayesMultiheadAttention) -> nn.MultiheadAttention:
    d = attn.d_model
    ref = nn.MultiheadAttention(d, attn.num_heads, batch_first=True)
    p = attn.projection.detach()
    with torch.no_grad():
        ref.in_proj_weight.copy_(p[:3, :, :d].reshape(3 * d, d))
        ref.in_proj_bias.copy_(p[:3, :, d].reshape(3 * d))
        ref.out_proj.weight.copy_(p[3, :, :d])
        ref.out_proj.bias.copy_(p[3, :, d])
    return ref.eval()


@pytest.mark.parametrize("causal", [False, True])
def test_point_estimate_attention_matches_torch_multihead_attention(causal):
    attn = _point_attention(16, 4)
    ref = _torch_mha(attn)
    N, T = 3, 6
    x = torch.randn(N, T, 16)
    mask = torch.ones(N, T, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 2:] = False
    attn_mask = torch.ones(T, T, dtype=torch.bool).tril() if causal else None
    out = attn(x[None], key_padding_mask=mask, attn_mask=attn_mask)[0]
    expected, expected_w = ref(
        x,
        x,
        x,
        key_padding_mask=~mask,  # PyTorch: True = ignore
        attn_mask=None if attn_mask is None else ~attn_mask,
        need_weights=True,
        average_attn_weights=False,
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn.attention_weights[0], expected_w, rtol=1e-5, atol=1e-5)


def test_latent_attention_matches_scaled_dot_product_attention():
    """One conditioned draw with per-head tau equals SDPA with scale tau / sqrt(d_head)."""
    d, h = 16, 4
    hs = d // h
    projection = torch.randn(4, d, d + 1) * 0.3
    tau = torch.tensor([0.5, 1.0, 2.0, 3.0])
    _, attn = _conditioned(projection, tau, d=d, h=h)
    N, Tq, Tk = 2, 3, 5
    query, memory = torch.randn(N, Tq, d), torch.randn(N, Tk, d)
    mask = torch.tensor([[True] * Tk, [True, True, False, True, False]])
    out = attn(query[None], memory[None], key_padding_mask=mask)[0]

    w, b = projection[..., :d], projection[..., d]
    q = (query @ w[0].T + b[0]).view(N, Tq, h, hs).transpose(1, 2)
    k = (memory @ w[1].T + b[1]).view(N, Tk, h, hs).transpose(1, 2)
    v = (memory @ w[2].T + b[2]).view(N, Tk, h, hs).transpose(1, 2)
    heads = [
        F.scaled_dot_product_attention(
            q[:, i : i + 1],
            k[:, i : i + 1],
            v[:, i : i + 1],
            attn_mask=mask[:, None, None, :],
            scale=float(tau[i]) / math.sqrt(hs),
        )
        for i in range(h)
    ]
    ctx = torch.cat(heads, 1).transpose(1, 2).reshape(N, Tq, d)
    expected = ctx @ w[3].T + b[3]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="d_model"):
        BayesMultiheadAttention(10, 4)
    with pytest.raises(ValueError, match="num_heads"):
        BayesMultiheadAttention(8, 0)


# -- positional encoding, embedding ---------------------------------------------------------------


def test_sinusoidal_positional_encoding_values():
    d, max_len = 6, 10
    pe = SinusoidalPositionalEncoding(d, max_len)
    h = torch.zeros(2, 7, d)
    out = pe(h)
    assert out.shape == (2, 7, d)
    t = torch.arange(7, dtype=torch.float32)
    for i in range(d // 2):
        freq = 10000 ** (-2 * i / d)
        torch.testing.assert_close(out[0, :, 2 * i], torch.sin(t * freq))
        torch.testing.assert_close(out[0, :, 2 * i + 1], torch.cos(t * freq))
    torch.testing.assert_close(out[1], out[0])


def test_sinusoidal_positional_encoding_odd_width():
    out = SinusoidalPositionalEncoding(5, 4)(torch.zeros(4, 5))
    assert out.shape == (4, 5)
    torch.testing.assert_close(out[0], torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0]))


def test_feature_embedding_cls_token_prepends_a_step_and_a_true_mask_column():
    emb = FeatureEmbedding(3, 8, 5, cls_token=True)
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[True, True, False, False], [True] * 4])
    h, new_mask = emb(x, mask)
    assert h.shape == (1, 2, 5, 8)
    assert torch.equal(new_mask[:, 0], torch.tensor([True, True]))
    assert torch.equal(new_mask[:, 1:], mask)
    pe = emb.positional.pe
    torch.testing.assert_close(h[0, :, 0], (emb.cls.detach() + pe[0]).expand(2, 8))


def test_feature_embedding_latent_cls_token_with_draws():
    S = 3
    emb = FeatureEmbedding(3, 8, 5, cls_token=True, bayesian=True)
    cls = torch.randn(S, 1, 8)
    conditioned = poutine.condition(emb, data={"cls": cls})
    with pyro.plate("draws", S, dim=-2):
        h, _ = conditioned(torch.randn(2, 4, 3))
    assert h.shape == (S, 2, 5, 8)
    pe0 = emb.positional.pe[0]
    for s in range(S):
        torch.testing.assert_close(h[s, :, 0], (cls[s, 0] + pe0).expand(2, 8))


# -- blocks and the encoder ---------------------------------------------------------------------


def test_pre_norm_block_is_identity_when_sublayer_outputs_are_zero():
    block = TransformerBlock(D, H, 16, bayesian=frozenset())
    with torch.no_grad():
        block.attention.projection[3].zero_()  # output projection (weights and bias)
        block.ffn.linear2.weight.zero_()
        block.ffn.linear2.bias.zero_()
    h = torch.randn(1, 2, 5, D)
    torch.testing.assert_close(block(h), h)


def test_post_norm_block_output_is_normalised_per_position():
    block = TransformerBlock(D, H, 16, norm_first=False, bayesian=frozenset())
    out = block(torch.randn(2, 3, 5, D) * 4 + 2)
    assert out.shape == (2, 3, 5, D)
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 3, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.var(-1, correction=0), torch.ones(2, 3, 5), atol=1e-3, rtol=0)


@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_outputs_at_real_steps_ignore_padded_steps(norm_first):
    enc = TransformerEncoder(2, D, H, 16, norm_first=norm_first, bayesian=frozenset())
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    h = torch.randn(1, 2, 5, D)
    changed = h.clone()
    changed[0, 1, 3:] = torch.randn(2, D) * 10
    out, out_changed = enc(h, key_padding_mask=mask), enc(changed, key_padding_mask=mask)
    assert out.shape == (1, 2, 5, D)
    torch.testing.assert_close(out[0, 1, :3], out_changed[0, 1, :3])
    torch.testing.assert_close(out[0, 0], out_changed[0, 0])


def test_causal_encoder_ignores_future_steps():
    enc = TransformerEncoder(2, D, H, 16, causal=True, bayesian=frozenset())
    h = torch.randn(1, 2, 6, D)
    changed = h.clone()
    changed[..., 4:, :] = torch.randn(1, 2, 2, D)
    out, out_changed = enc(h), enc(changed)
    torch.testing.assert_close(out[..., :4, :], out_changed[..., :4, :])
    assert not torch.allclose(out[..., 4:, :], out_changed[..., 4:, :])
    assert len(enc.attention_modules) == 2
    for attn in enc.attention_modules:
        w = attn.attention_weights  # (1, 2, H, 6, 6)
        assert torch.all(w.triu(1) == 0)
        torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, H, 6))


def test_encoder_with_latent_parts_has_one_site_group_per_layer():
    enc = TransformerEncoder(
        2,
        D,
        H,
        16,
        bayesian=frozenset({"attention", "ffn", "norm"}),
        attention_prior=priors.LogitScalePrior(),
    )
    tr = poutine.trace(enc).get_trace(torch.randn(1, 2, 3, D))
    latent = {name for name, site in tr.nodes.items() if site["type"] == "sample"}
    expected = set()
    for i in range(2):
        p = f"layers.{i}"
        expected |= {f"{p}.attention.projection", f"{p}.attention.logit_scale"}
        expected |= {f"{p}.ffn.linear{j}.{w}" for j in (1, 2) for w in ("weight", "bias")}
        expected |= {f"{p}.norm{j}.{w}" for j in (1, 2) for w in ("weight", "bias")}
    expected |= {"norm.weight", "norm.bias"}
    assert latent == expected
