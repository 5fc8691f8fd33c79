"""Architecture ablations of benchmarks/claims.py: hard top-1 attention, no feed-forward
(``d_ff=0``), no LayerNorm; what they change and that the rest still holds."""

import re

import numpy as np
import pytest
import torch

from probtransformer.attention import BayesMultiheadAttention
from probtransformer.block import TransformerBlock
from probtransformer.inference import fit_mcmc
from probtransformer.layers import BayesLayerNorm
from probtransformer.models import CausalLM, SequenceClassifier, TokenTagger


def _attention(hard: bool) -> BayesMultiheadAttention:
    torch.manual_seed(0)
    return BayesMultiheadAttention(8, 2, bayesian=False, hard=hard)


def test_hard_attention_selects_the_top_key_of_the_soft_weights():
    h = torch.randn(1, 3, 5, 8)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [True] * 4 + [False]])
    soft, hard = _attention(False), _attention(True)
    soft(h, key_padding_mask=mask)
    hard(h, key_padding_mask=mask)
    weights = hard.attention_weights  # (1, N, H, Tq, Tk)
    assert torch.equal(weights.sum(-1), torch.ones_like(weights.sum(-1)))
    assert set(weights.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(weights.argmax(-1), soft.attention_weights.argmax(-1))
    assert not weights[:, 1, :, :, 3:].any()  # padded keys are never chosen


def test_hard_attention_output_is_the_chosen_value_and_gradients_reach_queries():
    attention = _attention(True)
    h = torch.randn(1, 2, 4, 8)
    out = attention(h)
    top = attention.attention_weights.argmax(-1)  # (1, N, H, Tq)
    proj = attention.projection
    v = h @ proj[2, :, :8].T + proj[2, :, 8]  # (1, N, T, d)
    v = v.view(1, 2, 4, 2, 4).transpose(2, 3)  # (1, N, H, T, d_head)
    chosen = torch.gather(v, 3, top[..., None].expand(-1, -1, -1, -1, 4))
    ctx = chosen.transpose(2, 3).reshape(1, 2, 4, 8)
    torch.testing.assert_close(out, ctx @ proj[3, :, :8].T + proj[3, :, 8])
    out.square().sum().backward()
    assert proj.grad[0].abs().sum() > 0  # query rows learn through the straight-through path


def test_no_feed_forward_block_is_the_attention_sublayer_alone():
    torch.manual_seed(0)
    block = TransformerBlock(8, 2, 0, bayesian=frozenset())
    assert block.ffn is None
    h = torch.randn(1, 2, 4, 8)
    expected = h + block.attention(block.norm1(h))
    torch.testing.assert_close(block(h), expected)


def test_attention_with_every_head_off_adds_its_output_bias_only():
    """The ``noattn`` ablation of benchmarks/claims.py: ``head_active`` all False."""
    attention = _attention(False)
    attention.head_active.zero_()
    h = torch.randn(2, 3, 5, 8)
    out = attention(h)
    bias = attention.projection[3, :, 8]
    torch.testing.assert_close(out, bias.expand(1, 3, 5, 8))
    assert attention.attention_weights.shape == (1, 3, 2, 5, 5)
    assert not attention.attention_weights.any()


@pytest.mark.parametrize("model_cls", [SequenceClassifier, TokenTagger, CausalLM])
def test_ablated_models_record_their_config_and_rebuild_from_it(model_cls):
    args = {
        SequenceClassifier: (4, 3, 6),
        TokenTagger: (4, 3, 6),
        CausalLM: (list("abc"), 6),
    }[model_cls]
    model = model_cls(*args, d_model=8, num_heads=2, d_ff=0, layer_norm=False, hard_attention=True)
    assert model.config["d_ff"] == 0
    assert model.config["layer_norm"] is False and model.config["hard_attention"] is True
    assert not any(isinstance(m, BayesLayerNorm) for m in model.modules())
    rebuilt = model_cls.from_config(model.config)
    assert rebuilt.config == model.config
    assert all(layer.attention.hard for layer in rebuilt.encoder.layers)
    # defaults keep configs as before: the ablation keys appear only when switched on
    assert "layer_norm" not in model_cls(*args, d_model=8, num_heads=2).config


def test_bad_ablation_settings_are_refused():
    with pytest.raises(ValueError, match="d_ff must be an integer >= 0"):
        SequenceClassifier(4, 3, 6, d_ff=-1)
    with pytest.raises(ValueError, match="layer_norm=False"):
        SequenceClassifier(4, 3, 6, bayesian=("norm",), layer_norm=False)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"layer_norm": "no"}, TypeError, "layer_norm must be True or False, got 'no'"),
        ({"hard_attention": 1}, TypeError, "hard_attention must be True or False, got 1"),
        ({"d_ff": 0, "bayesian": ("ffn",)}, ValueError, "d_ff=0 drops the feed-forward"),
        ({"d_ff": np.int64(8)}, ValueError, "of type int64 (pass a Python int)"),
    ],
)
def test_ablation_options_of_the_wrong_kind_are_named(kwargs, error, words):
    with pytest.raises(error, match=re.escape(words)):
        SequenceClassifier(4, 3, 6, **kwargs)


def test_hmc_refuses_hard_attention(digits):
    model = SequenceClassifier(8, 10, 8, d_model=8, num_heads=2, num_layers=1, hard_attention=True)
    with pytest.raises(ValueError, match="hard attention .*straight-through gradient"):
        fit_mcmc(model, digits.train[:10], num_samples=2, num_warmup=2, num_chains=1)
