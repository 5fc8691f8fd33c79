"""Attention guidance: builders, AttentionLogitPrior, bad input, configs, forward invariants, and
the statistical check that a strong prior dominates while a weak one yields to the data."""

import json
import math

import numpy as np
import pytest
import torch

from probtransformer import priors
from probtransformer.attention import BayesMultiheadAttention
from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_svi, load_posterior
from probtransformer.models import SequenceClassifier

TINY = dict(d_model=8, num_heads=2, num_layers=1, d_ff=8)


def _band(T: int, width: int = 1) -> torch.Tensor:
    i = torch.arange(T)
    return (i[:, None] - i[None, :]).abs() <= width


def _guided_attention(guidance, *, max_len=6, **kwargs) -> BayesMultiheadAttention:
    """Point-estimate projections, so only the logit offset is drawn (from its prior)."""
    prior = priors.AttentionLogitPrior(guidance, **kwargs)
    attn = BayesMultiheadAttention(8, 2, bayesian=False, attention_prior=prior, max_len=max_len)
    with torch.no_grad():
        attn.projection.normal_(0.0, 0.5)
    return attn


# -- builders -----------------------------------------------------------------------------------


def test_local_window_is_the_band_with_outside_weight():
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.float32,
    )
    torch.testing.assert_close(priors.local_window(1)(5), expected, rtol=0, atol=0)
    soft = priors.local_window(1, outside=0.25)(5)
    torch.testing.assert_close(soft, torch.where(expected.bool(), 1.0, 0.25), rtol=0, atol=0)
    torch.testing.assert_close(priors.local_window(0)(3), torch.eye(3), rtol=0, atol=0)


def test_causal_is_lower_triangular():
    torch.testing.assert_close(priors.causal()(4), torch.ones(4, 4).tril(), rtol=0, atol=0)


def test_distance_decay_values():
    rate = 0.7
    w = priors.distance_decay(rate)(5)
    i = torch.arange(5.0)
    expected = torch.exp(-rate * (i[:, None] - i[None, :]).abs())
    torch.testing.assert_close(w, expected)
    assert w[0, 3].item() == pytest.approx(math.exp(-2.1), rel=1e-6)
    torch.testing.assert_close(priors.distance_decay(0)(3), torch.ones(3, 3))


@pytest.mark.parametrize(
    "guidance",
    [
        priors.local_window(1),
        priors.local_window(2, outside=0.1),
        priors.causal(),
        priors.distance_decay(0.5),
    ],
    ids=["window", "soft-window", "causal", "decay"],
)
def test_log_guidance_rows_normalise_and_zeros_are_hard_masks(guidance):
    spec = priors.AttentionLogitPrior(guidance)
    log_p = spec.log_guidance(6, None, device="cpu")
    assert log_p.shape == (6, 6)
    weights = guidance(6)
    assert torch.equal(log_p == -math.inf, weights == 0)
    torch.testing.assert_close(log_p.logsumexp(-1), torch.zeros(6), atol=1e-6, rtol=0)
    # the log of the row-normalised weights
    expected = (weights / weights.sum(-1, keepdim=True)).log()
    torch.testing.assert_close(log_p, expected)


_MATRIX = [[1.0, 3.0, 0.0], [0.0, 2.0, 2.0], [1.0, 1.0, 1.0]]


@pytest.mark.parametrize(
    "matrix",
    [torch.tensor(_MATRIX), np.array(_MATRIX), _MATRIX, torch.tensor(_MATRIX, dtype=torch.float64)],
    ids=["tensor", "numpy", "list", "float64"],
)
def test_user_matrix_is_accepted_in_any_container(matrix):
    spec = priors.AttentionLogitPrior(matrix)
    assert isinstance(spec.guidance, priors.GuidanceMatrix)
    p = spec.log_guidance(3, None, device="cpu").exp()
    expected = torch.tensor([[0.25, 0.75, 0.0], [0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    torch.testing.assert_close(p, expected)
    # shorter inputs use the top-left block, renormalised
    torch.testing.assert_close(
        spec.log_guidance(2, None, device="cpu").exp(), torch.tensor([[0.25, 0.75], [0.0, 1.0]])
    )


def test_bool_matrix_is_a_hard_mask():
    allowed = torch.tensor([[True, False], [True, True]])
    for matrix in (allowed, allowed.numpy()):
        log_p = priors.AttentionLogitPrior(matrix).log_guidance(2, None, device="cpu")
        assert log_p[0, 1] == -math.inf
        torch.testing.assert_close(log_p.exp(), torch.tensor([[1.0, 0.0], [0.5, 0.5]]))


def test_callable_guidance_per_sequence():
    """A callable may return (N, T, T): each sequence n attends only to key n % T."""
    seen = []

    def one_key_each(T, mask):
        seen.append(None if mask is None else tuple(mask.shape))
        if mask is None:
            return torch.ones(T, T)
        w = torch.zeros(mask.shape[0], T, T)
        w[torch.arange(mask.shape[0]), :, torch.arange(mask.shape[0]) % T] = 1.0
        return w

    attn = _guided_attention(one_key_each, max_len=4)
    assert seen == [None]  # checked once at construction with mask=None
    N = 6
    out = attn(torch.randn(1, N, 4, 8), key_padding_mask=torch.ones(N, 4, dtype=torch.bool))
    assert seen[-1] == (N, 4)
    assert torch.isfinite(out).all()
    w = attn.attention_weights  # (1, N, H, T, T)
    expected = torch.zeros(N, 4)
    expected[torch.arange(N), torch.arange(N) % 4] = 1.0
    torch.testing.assert_close(w[0], expected[:, None, None, :].expand_as(w[0]), rtol=0, atol=0)
    # without a mask the callable's (T, T) branch applies: all keys visible
    attn(torch.randn(1, N, 4, 8))
    assert (attn.attention_weights > 0).all()


# -- bad input: every message names the argument -----------------------------------------------


@pytest.mark.parametrize(
    "matrix, words",
    [
        (torch.ones(3, 4), ["guidance", "(3, 4)"]),
        (torch.ones(4), ["guidance", "(4,)"]),
        (torch.ones(2, 2, 2, 2), ["guidance", "(2, 2, 2, 2)"]),
        (torch.ones(3, 2, 2), ["guidance matrix must be (T, T)", "(3, 2, 2)", "callable"]),
        (torch.tensor([[1.0, -0.5], [1.0, 1.0]]), ["guidance", "negative"]),
        (torch.tensor([[1.0, float("nan")], [1.0, 1.0]]), ["guidance", "NaN"]),
        (torch.tensor([[1.0, float("inf")], [1.0, 1.0]]), ["guidance", "inf"]),
        (torch.tensor([[1.0, 1.0], [0.0, 0.0]]), ["guidance", "row", "[1]", "positive"]),
        ([[False, False], [True, True]], ["guidance", "[0]"]),
    ],
    ids=["non-square", "1-D", "4-D", "3-D", "negative", "nan", "inf", "empty-row", "empty-bool"],
)
def test_bad_guidance_matrix_is_named(matrix, words):
    with pytest.raises(ValueError) as info:
        priors.AttentionLogitPrior(matrix)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("guidance", ["local", 3.0, None, {"a": 1}])
def test_guidance_of_the_wrong_type_is_a_type_error(guidance):
    with pytest.raises(TypeError, match="guidance must be"):
        priors.AttentionLogitPrior(guidance)


def test_ragged_list_is_a_type_error():
    with pytest.raises(TypeError, match="guidance"):
        priors.AttentionLogitPrior([[1.0, 1.0], [1.0]])


@pytest.mark.parametrize("strength", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_strength_is_named(strength):
    with pytest.raises(ValueError, match="strength"):
        priors.AttentionLogitPrior(priors.causal(), strength=strength)


def test_strength_of_the_wrong_type_is_named():
    with pytest.raises(TypeError, match="strength"):
        priors.AttentionLogitPrior(priors.causal(), strength="strong")


def test_bad_builder_arguments_are_named():
    with pytest.raises(ValueError, match="width"):
        priors.local_window(-1)
    with pytest.raises(TypeError, match="width"):
        priors.local_window(1.5)
    with pytest.raises(TypeError, match="width"):
        priors.local_window(True)
    with pytest.raises(ValueError, match="outside"):
        priors.local_window(1, outside=-0.1)
    with pytest.raises(ValueError, match="outside"):
        priors.local_window(1, outside=float("nan"))
    with pytest.raises(ValueError, match="rate"):
        priors.distance_decay(-0.5)
    with pytest.raises(ValueError, match="rate"):
        priors.distance_decay(float("nan"))
    with pytest.raises(TypeError, match="rate"):
        priors.distance_decay("fast")


def test_matrix_smaller_than_max_len_fails_at_construction():
    spec = priors.AttentionLogitPrior(torch.ones(4, 4))
    with pytest.raises(ValueError, match=r"guidance matrix is \(4, 4\).*T=6"):
        SequenceClassifier(2, 2, 6, **TINY, attention_prior=spec)
    SequenceClassifier(2, 2, 4, **TINY, attention_prior=spec)  # fits exactly
    # a CLS token adds one position: max_len 4 + CLS needs a 5x5 matrix
    with pytest.raises(ValueError, match=r"guidance matrix is \(4, 4\).*T=5"):
        SequenceClassifier(2, 2, 4, **TINY, pooling="cls", attention_prior=spec)


def test_guidance_needs_max_len():
    with pytest.raises(ValueError, match="max_len"):
        BayesMultiheadAttention(8, 2, attention_prior=priors.AttentionLogitPrior(priors.causal()))


def test_callable_of_the_wrong_shape_fails_at_forward():
    def fixed(T, mask):
        return torch.ones(6, 6)  # right for max_len=6 only

    attn = _guided_attention(fixed, max_len=6)  # construction checks T = max_len: passes
    attn(torch.randn(1, 2, 6, 8))
    with pytest.raises(ValueError, match=r"guidance's weights must be a \(4, 4\).*\(6, 6\)"):
        attn(torch.randn(1, 2, 4, 8))


def test_callable_with_negative_or_empty_rows_fails_at_forward():
    def bad(T, mask):
        w = torch.ones(T, T)
        if mask is not None:
            w[0] = 0.0
        return w

    attn = _guided_attention(bad, max_len=4)
    with pytest.raises(ValueError, match="guidance's weights.*row"):
        attn(torch.randn(1, 2, 4, 8), key_padding_mask=torch.ones(2, 4, dtype=torch.bool))


def test_callable_returning_too_many_sequences_is_a_value_error():
    """Per-sequence guidance (N', T, T) with N' not matching the batch's N: a clear ValueError
    naming the guidance, not a broadcasting RuntimeError deep in the forward pass."""

    def three(T, mask):
        return torch.ones(T, T) if mask is None else torch.ones(3, T, T)

    attn = _guided_attention(three, max_len=4)
    with pytest.raises(ValueError, match="guidance"):
        attn(torch.randn(1, 5, 4, 8), key_padding_mask=torch.ones(5, 4, dtype=torch.bool))


# -- configs and persistence --------------------------------------------------------------------


def _json(value):
    return json.loads(json.dumps(value))


@pytest.mark.parametrize(
    "guidance",
    [
        priors.local_window(1),
        priors.local_window(2, outside=0.05),
        priors.causal(),
        priors.distance_decay(0.3),
        priors.local_window(1, outside=0.5)(5).numpy() * 2.0,
        (torch.rand(5, 5, generator=torch.Generator().manual_seed(0)) > 0.3) | torch.eye(5).bool(),
    ],
    ids=["window", "soft-window", "causal", "decay", "matrix", "bool-matrix"],
)
def test_config_round_trip(guidance):
    spec = priors.AttentionLogitPrior(guidance, strength=2.5)
    assert priors.from_config(priors.to_config(spec)) == spec
    assert priors.from_config(_json(priors.to_config(spec))) == spec
    for attention_prior in (spec, (priors.LogitScalePrior(0.1, 0.2), spec)):
        m = SequenceClassifier(2, 2, 5, **TINY, attention_prior=attention_prior)
        assert SequenceClassifier.from_config(m.config).config == m.config
        again = SequenceClassifier.from_config(_json(m.config))  # as load_posterior reads it
        assert _json(again.config) == _json(m.config)
        modules = again.encoder.attention_modules
        assert modules[0].priors[priors.AttentionLogitPrior] == spec


def test_callable_guidance_builds_but_cannot_be_rebuilt_from_config(tmp_path):
    spec = priors.AttentionLogitPrior(lambda T, mask: torch.ones(T, T))
    config = priors.to_config((priors.LogitScalePrior(), spec))
    assert config[1]["guidance"]["type"] == "callable"
    json.dumps(config)  # the model's config stays JSON-serialisable
    with pytest.raises(ValueError, match="callable.*matrix"):
        priors.from_config(config)
    m = SequenceClassifier(2, 2, 5, **TINY, attention_prior=spec)  # usable in a model
    g = torch.Generator().manual_seed(1)
    data = SequenceData(torch.randn(20, 5, 2, generator=g), torch.randint(0, 2, (20,), generator=g))
    post = fit_svi(m, data, num_steps=5, progress=False)
    assert torch.isfinite(post.predict(data.x, num_samples=2).probs).all()
    with pytest.raises(ValueError, match="callable"):  # refused before anything is written
        post.save(tmp_path / "post")
    assert not (tmp_path / "post").exists()


def test_save_and_load_with_a_matrix_guidance(tmp_path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(60, 5, 2, generator=g)
    y = (x[:, 0, 0] > 0).long()
    matrix = priors.distance_decay(1.0)(5) * (torch.rand(5, 5, generator=g) + 0.5)
    model = SequenceClassifier(
        2, 2, 5, **TINY, attention_prior=priors.AttentionLogitPrior(matrix, strength=3.0)
    )
    post = fit_svi(
        model, SequenceData(x, y), num_steps=30, batch_size=30, lr=1e-2, seed=0, progress=False
    )
    post.save(tmp_path / "post")
    loaded = load_posterior(tmp_path / "post")
    assert _json(loaded.model.config) == _json(post.model.config)
    spec = loaded.model.encoder.attention_modules[0].priors[priors.AttentionLogitPrior]
    assert spec == post.model.encoder.attention_modules[0].priors[priors.AttentionLogitPrior]
    a = post.predict(x[:10], num_samples=8, seed=3).probs
    b = loaded.predict(x[:10], num_samples=8, seed=3).probs
    assert torch.equal(a, b)
    att_a = post.attention(x[:4], num_samples=4, seed=3).samples
    att_b = loaded.attention(x[:4], num_samples=4, seed=3).samples
    assert torch.equal(att_a, att_b)


# -- forward invariants -------------------------------------------------------------------------


def test_hard_window_zeroes_attention_outside_the_band():
    attn = _guided_attention(priors.local_window(1), strength=0.5)  # noisy offsets
    attn(torch.randn(1, 3, 6, 8))
    w = attn.attention_weights  # (1, N, H, T, T)
    outside = ~_band(6)
    assert torch.all(w[..., outside] == 0.0)
    assert (w[..., _band(6)] > 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))


def test_hard_window_with_padding_gives_zero_rows_when_the_window_is_all_padding():
    attn = _guided_attention(priors.local_window(1), max_len=6)
    mask = torch.tensor([[True] * 6, [True, True, False, False, False, False]])
    out = attn(torch.randn(1, 2, 6, 8), key_padding_mask=mask)
    w = attn.attention_weights[0]  # (N, H, T, T)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    assert torch.all(w[..., ~_band(6)] == 0.0)
    assert torch.all(w[1, :, :, 2:] == 0.0)  # padded keys
    sums = w.sum(-1)  # (N, H, T)
    torch.testing.assert_close(sums[0], torch.ones(2, 6))
    # sequence 1: queries 0..2 see key 0 or 1; queries 3..5 see only padding in their window
    torch.testing.assert_close(sums[1, :, :3], torch.ones(2, 3))
    assert torch.all(w[1, :, 3:] == 0.0)


def test_gradients_are_finite_with_an_all_padding_window():
    attn = _guided_attention(priors.local_window(1), max_len=6)
    mask = torch.tensor([[True, True, False, False, False, False]])
    x = torch.randn(1, 1, 6, 8, requires_grad=True)
    attn(x, key_padding_mask=mask).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.isfinite(attn.projection.grad).all()


# -- statistics: a strong prior dominates, a weak one yields to the data -------------------------


def _band_mass(post, x, T) -> float:
    att = post.attention(x, num_samples=50, seed=0).mean()  # (n, layer, head, T, T)
    return float((att * _band(T)).sum(-1).mean())


OFFSET = "encoder.layers.0.attention.logit_offset"


def test_strong_guidance_dominates_when_labels_carry_no_signal():
    """Random features and labels: the posterior follows the prior. The attention projections
    have a tight prior (Normal(0.3)) so the content logits q·k stay small and the guidance
    offsets carry the prior; the guide starts wide (init_scale 1) so 500 steps can reach the
    prior's width. Measured (seed 0): band mass 0.986 with strength 10 vs 0.686 with strength
    0.1; posterior sd of the offsets 0.16 vs 5.95 (prior sd 0.1 vs 10)."""
    T, N = 6, 200
    g = torch.Generator().manual_seed(0)
    data = SequenceData(torch.randn(N, T, 2, generator=g), torch.randint(0, 2, (N,), generator=g))
    mass, spread = {}, {}
    for strength in (10.0, 0.1):
        prior = priors.AttentionLogitPrior(priors.local_window(1, outside=0.01), strength=strength)
        model = SequenceClassifier(
            2,
            2,
            T,
            **TINY,
            bayesian=("attention", "head"),
            weight_prior=priors.Normal(0.3),
            attention_prior=prior,
        )
        post = fit_svi(
            model, data, num_steps=500, batch_size=100, lr=5e-2, init_scale=1.0, progress=False
        )
        mass[strength] = _band_mass(post, data.x[:50], T)
        spread[strength] = float(post.draws(50)[OFFSET].std((0, 1)).mean())
    # uniform attention puts 2.67 of 6 keys' mass on the band (0.44); the prior 0.97-0.99
    assert mass[10.0] >= 0.95, mass
    assert mass[0.1] <= 0.8, mass
    assert spread[10.0] < 0.3 and spread[0.1] > 3.0, spread


def test_weak_guidance_yields_to_data_that_needs_a_far_key():
    """The label is the sign of the last step's first feature and is read from the CLS token
    (position 0), whose window (|i - j| <= 1) excludes the last key (position T): the data pull
    the CLS offset of that key up, against the prior. Measured (seed 0): the largest posterior
    mean offset (CLS -> last key) over heads 1.78 under strength 0.1 (prior sd 10) vs 0.008
    under strength 10 (prior sd 0.1). The attention itself reaches the key under both (0.77):
    the content logits q·k, point estimates here, learn it too, so the offsets are the test."""
    T, N = 5, 200
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, T, 2, generator=g)
    data = SequenceData(x, (x[:, -1, 0] > 0).long())
    moved = {}
    for strength in (10.0, 0.1):
        prior = priors.AttentionLogitPrior(priors.local_window(1, outside=0.03), strength=strength)
        model = SequenceClassifier(
            2, 2, T, **TINY, bayesian=("head",), pooling="cls", attention_prior=prior
        )
        post = fit_svi(model, data, num_steps=300, batch_size=100, lr=3e-2, seed=0, progress=False)
        offset = post.draws(50)[OFFSET].flatten(0, 1)[:, :, 0, T].mean(0)  # (H,) CLS -> last
        moved[strength] = float(offset.max())
        pred = post.predict(x[:100], num_samples=50, seed=0).mean.argmax(-1)
        assert float((pred == data.y[:100]).float().mean()) >= 0.9
    assert moved[0.1] > 1.0 and abs(moved[10.0]) < 0.3, moved
