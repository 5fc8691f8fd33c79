"""The positional schemes of the built-in models (``positions=``) and the latent-slope
distance-decay prior, each tested for its defining property."""

import math

import pyro
import pytest
import torch
from pyro import poutine

from probtransformer import priors
from probtransformer.attention import BayesMultiheadAttention
from probtransformer.models import CausalLM, SequenceClassifier, TokenTagger
from probtransformer.positional import LearnedPositionalEncoding, rotary_angles, rotate

D_HEAD, T = 8, 6


def test_rotated_dot_products_depend_on_the_offset_only():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, T, D_HEAD, generator=g)
    positions = torch.arange(T)
    logits = []
    for shift in (0, 5, 37):
        cos, sin = rotary_angles(positions + shift, D_HEAD)
        logits.append(rotate(q, cos, sin) @ rotate(k, cos, sin).T)
    torch.testing.assert_close(logits[1], logits[0])
    torch.testing.assert_close(logits[2], logits[0])
    assert not torch.allclose(logits[0], q @ k.T)  # the rotation does change the logits
    # a rotation keeps each vector's length
    cos, sin = rotary_angles(positions + 3, D_HEAD)
    torch.testing.assert_close(rotate(q, cos, sin).norm(dim=-1), q.norm(dim=-1))


def _attention(rotary: bool) -> BayesMultiheadAttention:
    torch.manual_seed(0)
    return BayesMultiheadAttention(16, 2, bayesian=False, rotary=rotary).eval()


@pytest.mark.parametrize("causal", [False, True])
def test_rotary_attention_pattern_is_unchanged_when_the_sequence_is_shifted(causal):
    """The same tokens after ``pad`` masked steps: the pattern among them is unchanged with
    rotary positions (relative offsets), and changed by absolute ones."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(1, 1, T, 16, generator=g)
    pad = 3
    shifted = torch.cat([torch.randn(1, 1, pad, 16, generator=g), h], dim=2)
    keys = torch.cat([torch.zeros(1, pad, dtype=torch.bool), torch.ones(1, T, dtype=torch.bool)], 1)
    mask = torch.ones(T + pad, T + pad).tril().bool() if causal else None
    attention = _attention(rotary=True)
    attention(h, attn_mask=None if mask is None else mask[:T, :T])
    alone = attention.attention_weights[0, 0]  # (H, T, T)
    attention(shifted, key_padding_mask=keys, attn_mask=mask)
    torch.testing.assert_close(attention.attention_weights[0, 0, :, pad:, pad:], alone)
    # absolute (sinusoidal) positions added to the same tokens do change the pattern
    attention = _attention(False)
    sinusoidal = SequenceClassifier(16, 3, T + pad, d_model=16, num_heads=2).embedding.positional
    attention(sinusoidal(h))
    absolute = attention.attention_weights[0, 0]
    attention(sinusoidal(shifted), key_padding_mask=keys)
    assert not torch.allclose(attention.attention_weights[0, 0, :, pad:, pad:], absolute, atol=1e-3)


def test_rotary_needs_an_even_head_size():
    with pytest.raises(ValueError, match="d_head = d_model / num_heads must be even, got 6 / 2"):
        BayesMultiheadAttention(6, 2, rotary=True)
    with pytest.raises(ValueError, match="rotary positions rotate pairs"):
        SequenceClassifier(4, 3, 8, d_model=6, num_heads=2, positions="rotary")


def test_learned_positions_are_a_trained_table_or_a_latent_one():
    model = SequenceClassifier(4, 3, 8, d_model=8, num_heads=2, positions="learned")
    table = model.embedding.positional.table
    assert isinstance(table, torch.nn.Parameter) and table.shape == (8, 8)
    assert 0.005 < float(table.detach().std()) < 0.05  # N(0, 0.02²) start
    x = torch.randn(5, 8, 4)
    model(x, torch.randint(0, 3, (5,))).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    latent = SequenceClassifier(
        4, 3, 8, d_model=8, num_heads=2, positions="learned", bayesian=("embedding", "head")
    )
    trace = poutine.trace(latent).get_trace(x)
    site = trace.nodes["embedding.positional.table"]
    assert site["value"].shape == (8, 8) and isinstance(
        site["fn"].base_dist, pyro.distributions.Normal
    )
    # a CLS token gets its own row
    cls = LearnedPositionalEncoding(8, 8, leading=1)
    assert cls.table.shape == (9, 8)


def test_alibi_slopes_decay_attention_with_distance():
    """Zero queries and keys leave only the bias: weights proportional to exp(-m_h |i - j|)."""
    attention = BayesMultiheadAttention(
        8, 2, bayesian=False, attention_prior=priors.ALiBiSlopePrior(scale=0.5)
    ).eval()
    with torch.no_grad():
        attention.projection.zero_()
    slopes = torch.tensor([0.0, 0.7])
    with poutine.condition(data={"alibi_slope": slopes}):
        attention(torch.randn(1, 1, T, 8))
    weights = attention.attention_weights[0, 0]  # (H, T, T)
    distance = (torch.arange(T)[:, None] - torch.arange(T)).abs().float()
    for h, m in enumerate(slopes):
        expected = torch.softmax(-m * distance, dim=-1)
        torch.testing.assert_close(weights[h], expected)
    trace = poutine.trace(attention).get_trace(torch.randn(1, 1, T, 8))
    prior = trace.nodes["alibi_slope"]["fn"]
    assert trace.nodes["alibi_slope"]["value"].shape == (2,)
    assert isinstance(prior.base_dist, pyro.distributions.HalfNormal)
    assert float(prior.base_dist.scale[0]) == 0.5
    with pytest.raises(ValueError, match="ALiBiSlopePrior.scale"):
        priors.ALiBiSlopePrior(scale=0.0)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rotary", "none"])
def test_each_scheme_is_a_model_option_recorded_in_the_config(positions):
    prior = (priors.LogitScalePrior(), priors.ALiBiSlopePrior(scale=1.0))
    lm = CausalLM(list("abcdef"), 8, d_model=8, num_heads=2, num_layers=1, d_ff=8,
                  positions=positions, attention_prior=prior)  # fmt: skip
    # "sinusoidal" is what every run saved before the option had: it is left out of the config
    assert lm.config.get("positions", "sinusoidal") == positions
    assert ("positions" in lm.config) == (positions != "sinusoidal")
    rebuilt = CausalLM.from_config(lm.config)
    assert rebuilt.config == lm.config
    ids = torch.randint(0, 6, (3, 8))
    assert lm(ids).shape[-3:] == (3, 8, 6)
    tagger = TokenTagger(None, 3, 8, vocab_size=6, positions=positions, d_model=8, num_heads=2)
    assert tagger(ids).shape[-3:] == (3, 8, 3)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(positions="alibi"), "positions must be one of"),
        (dict(positions="learned", grid=(2, 4)), "grid gives image patches 2-D sinusoidal"),
        (dict(attention_prior=priors.ALiBiSlopePrior(), grid=(2, 4)), "a grid of image patches"),
        (dict(attention_prior=priors.ALiBiSlopePrior(), pooling="cls"), "or a CLS token"),
    ],
)
def test_bad_position_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        SequenceClassifier(4, 3, 8, d_model=8, num_heads=2, **options)


def test_alibi_spec_round_trips_through_the_config():
    spec = priors.ALiBiSlopePrior(scale=0.25)
    assert priors.from_config(priors.to_config(spec)) == spec
    assert math.isclose(priors.to_config(spec)["scale"], 0.25)


# -- convolutional token mixing (conv_kernel=) --------------------------------------------------


@pytest.mark.parametrize("causal, reach", [(True, (0, 2)), (False, (-1, 1))])
def test_a_convolution_mixes_each_step_with_its_window_only(causal, reach):
    """A change at step t moves the outputs at ``t + reach[0] .. t + reach[1]`` only: the
    window of kernel 3 is the step and the two before it (causal) or its two neighbours."""
    from probtransformer.block import ConvMixing

    torch.manual_seed(0)
    conv = ConvMixing(4, 3, causal=causal)
    h = torch.randn(1, 2, T, 4)
    changed = h.clone()
    changed[:, 0, 3] += 1.0
    moved = (conv(changed) - conv(h)).abs().sum(-1)[0]  # (N, T)
    assert (moved[1] == 0).all()  # the other sequence
    lo, hi = 3 + reach[0], 3 + reach[1]
    assert (moved[0, lo : hi + 1] > 0).all()
    outside = torch.ones(T, dtype=torch.bool)
    outside[lo : hi + 1] = False
    assert (moved[0, outside] == 0).all()
    # padded steps enter as zeros: a masked step's values do not reach its neighbours
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[0, 3] = False
    torch.testing.assert_close(conv(changed, mask), conv(h, mask))


@pytest.mark.parametrize("causal", [True, False])
def test_a_convolution_with_weights_per_draw_equals_one_convolution_per_draw(causal):
    """fit_mcmc's chains with per-start point estimates give the layer ``(K, 1, d, 1, kernel)``
    weights; each draw's output must be its own weights' convolution."""
    from probtransformer.block import ConvMixing

    torch.manual_seed(0)
    convs = [ConvMixing(4, 3, causal=causal) for _ in range(3)]
    for conv in convs:
        torch.nn.init.normal_(conv.bias)
    h = torch.randn(3, 2, T, 4)
    stacked = ConvMixing(4, 3, causal=causal)
    del stacked.weight, stacked.bias
    stacked.weight = torch.stack([c.weight for c in convs])[:, None]  # (3, 1, 4, 1, 3)
    stacked.bias = torch.stack([c.bias for c in convs])[:, None]  # (3, 1, 4)
    expected = torch.cat([c(h[k : k + 1]) for k, c in enumerate(convs)])
    torch.testing.assert_close(stacked(h), expected)
    torch.testing.assert_close(stacked(h[:1]), torch.cat([c(h[:1]) for c in convs]))
    del stacked.weight, stacked.bias  # one chain (one MAP start): (1, 1, d, 1, kernel)
    stacked.weight, stacked.bias = convs[0].weight[None, None], convs[0].bias[None, None]
    torch.testing.assert_close(stacked(h), convs[0](h))


def test_conv_kernel_is_recorded_and_missing_means_none():
    model = TokenTagger(None, 2, T, vocab_size=5, d_model=8, num_heads=2, conv_kernel=3)
    assert model.config["conv_kernel"] == 3 and model.encoder.layers[0].conv.kernel == 3
    rebuilt = TokenTagger.from_config(model.config)
    assert rebuilt.encoder.layers[0].conv.kernel == 3
    old = {k: v for k, v in model.config.items() if k != "conv_kernel"}  # saved before it
    assert TokenTagger.from_config(old).encoder.layers[0].conv is None
    for bad, error in ((-1, ValueError), (2.5, ValueError), (True, ValueError)):
        with pytest.raises(error, match="conv_kernel"):
            TokenTagger(None, 2, T, vocab_size=5, d_model=8, num_heads=2, conv_kernel=bad)
