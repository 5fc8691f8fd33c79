"""Property-based checks over shapes and masks (hypothesis): whatever the batch, predictions
are finite distributions and every attention row sums to 1 over visible keys."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from probtransformer.attention import BayesMultiheadAttention

MAX_LEN = 8


@st.composite
def batches(draw):
    """(x (N, T, 8), mask (N, T) with at least one real step per row or None)."""
    n = draw(st.integers(1, 5))
    t = draw(st.integers(1, MAX_LEN))
    seed = draw(st.integers(0, 2**16))
    x = torch.rand(n, t, 8, generator=torch.Generator().manual_seed(seed))
    if draw(st.booleans()):
        return x, None
    rows = draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=n, max_size=n))
    mask = torch.tensor(rows, dtype=torch.bool).reshape(n, t)
    mask[~mask.any(1), 0] = True  # every sequence keeps a real step
    return x, mask


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=batches())
def test_predictions_are_finite_distributions(small_posterior, batch):
    x, mask = batch
    pred = small_posterior.predict(x, mask, num_samples=3)
    assert pred.probs.shape == (3, len(x), 10)
    assert torch.isfinite(pred.probs).all()
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(3, len(x)))
    assert (pred.epistemic >= 0).all() and torch.isfinite(pred.entropy).all()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=batches())
def test_posterior_attention_rows_sum_to_one_over_visible_keys(small_posterior, batch):
    x, mask = batch
    att = small_posterior.attention(x, mask, num_samples=2).samples  # (1, 2, n, L, H, T, T)
    assert torch.isfinite(att).all()
    torch.testing.assert_close(att.sum(-1), torch.ones(att.shape[:-1]))
    if mask is not None:
        hidden = ~mask[None, None, :, None, None, None, :]  # masked keys
        assert (att.masked_select(hidden.expand_as(att)) == 0).all()


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 4),
    t=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    causal=st.booleans(),
)
def test_any_mask_gives_rows_summing_to_one_or_all_zero(n, t, seed, causal):
    gen = torch.Generator().manual_seed(seed)
    attention = BayesMultiheadAttention(8, 2, bayesian=False)
    x = torch.randn(1, n, t, 8, generator=gen)
    keys = torch.rand(n, t, generator=gen) < 0.5  # rows may have no visible key at all
    attn_mask = torch.ones(t, t, dtype=torch.bool).tril() if causal else None
    out = attention(x, key_padding_mask=keys, attn_mask=attn_mask)
    weights = attention.attention_weights  # (1, n, H, t, t)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    sums = weights.sum(-1)
    assert torch.logical_or((sums - 1).abs() < 1e-5, sums == 0).all()
