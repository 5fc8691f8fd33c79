"""Attention parameterized by its circuits (``probtransformer.circuits``): the same predictions
as the factors when W_QK and W_OV are formed from a factor draw, a prior matched in scale, the
options it refuses, and saving, loading and ArviZ export unchanged."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro import poutine

from probtransformer import priors
from probtransformer.attention import BayesMultiheadAttention, _projection_prior
from probtransformer.circuits import CircuitAttention, _ov_prior, _qk_prior, from_factors
from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_map, load_posterior
from probtransformer.models import SequenceClassifier

D, H, N, T, S = 8, 2, 3, 5, 4
CIRCUITS = dict(attention_parameterization="circuits", attention_prior=None)


def _draw(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    projection = 0.5 * torch.randn(S, 1, 4, D, D + 1, generator=g)
    logit_scale = 0.5 + torch.rand(S, 1, H, generator=g)
    return projection, logit_scale


def _pair(**options):
    factors = BayesMultiheadAttention(D, H, attention_prior=priors.LogitScalePrior(), **options)
    circuits = CircuitAttention(D, H, attention_prior=None, **options)
    return factors, circuits


def _run(module, values: dict, *inputs, **kwargs):
    with pyro.plate("draws", S, dim=-2), poutine.condition(data=values):
        return module(*inputs, **kwargs)


def _both(factors, circuits, *inputs, **kwargs):
    projection, logit_scale = _draw()
    qk, ov, bias = from_factors(projection, logit_scale, H)
    a = _run(factors, {"projection": projection, "logit_scale": logit_scale}, *inputs, **kwargs)
    b = _run(circuits, {"qk_circuit": qk, "ov_circuit": ov, "out_bias": bias}, *inputs, **kwargs)
    return a, b


def test_circuits_formed_from_factors_attend_and_output_the_same():
    """Padding (a sequence with no visible key at all: all-zero weights, output the bias),
    causal masks, every head and pruned heads, self- and cross-attention."""
    factors, circuits = _pair()
    x = torch.randn(1, N, T, D)
    mask = torch.ones(N, T, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2] = False
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    a, b = _both(factors, circuits, x, key_padding_mask=mask, attn_mask=causal)
    assert a.shape == b.shape == (S, N, T, D)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(factors.attention_weights, circuits.attention_weights)
    assert circuits.attention_weights[:, 2].abs().max() == 0  # no visible key: zero weights
    memory = torch.randn(1, N, T + 2, D)
    a, b = _both(factors, circuits, x, memory)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for module in (factors, circuits):
        module.head_active[1] = False
    a, b = _both(factors, circuits, x, key_padding_mask=mask)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert circuits.attention_weights[:, :, 1].abs().max() == 0
    for module in (factors, circuits):
        module.head_active[0] = False  # no head left: the output bias alone
    a, b = _both(factors, circuits, x)
    torch.testing.assert_close(a, b)


def test_a_classifier_with_circuits_predicts_what_its_factor_draw_predicts():
    """The issue's check: a whole SequenceClassifier, every layer's circuits from the factor
    model's draw, the same class probabilities."""
    factors = SequenceClassifier(4, 3, T, d_model=D, num_heads=H, num_layers=2, d_ff=8).eval()
    circuits = SequenceClassifier(
        4, 3, T, d_model=D, num_heads=H, num_layers=2, d_ff=8, **CIRCUITS
    ).eval()
    circuits.load_state_dict(factors.state_dict(), strict=False)  # the point estimates
    x = torch.randn(N, T, 4)
    mask = torch.ones(N, T, dtype=torch.bool)
    mask[0, 2:] = False
    factor_values, circuit_values = {}, {}
    for layer in range(2):
        prefix = f"encoder.layers.{layer}.attention."
        projection, logit_scale = _draw(seed=layer)
        factor_values[prefix + "projection"] = projection
        factor_values[prefix + "logit_scale"] = logit_scale
        qk, ov, bias = from_factors(projection, logit_scale, H)
        circuit_values.update(
            {prefix + "qk_circuit": qk, prefix + "ov_circuit": ov, prefix + "out_bias": bias}
        )
    head = {"head.weight": torch.randn(S, 1, 3, D), "head.bias": torch.randn(S, 1, 3)}
    probs = []
    for model, values in ((factors, factor_values), (circuits, circuit_values)):
        with pyro.plate("draws", S, dim=-2), poutine.condition(data={**values, **head}):
            trace = poutine.trace(model).get_trace(x, None, mask)
        probs.append(trace.nodes["y"]["fn"].probs)
    assert probs[0].shape == (S, N, 3)
    torch.testing.assert_close(probs[0], probs[1], rtol=1e-5, atol=1e-6)


def test_the_prior_matches_the_variance_of_factor_products():
    """Entries of W_Qᵀ W_K and W_O W_V with N(0, σ²) factors have variance d_head σ⁴: the
    circuits' prior sd is its square root (Monte Carlo over 20,000 factor draws, within 3%)."""
    spec = priors.Normal(3.0)
    factors = BayesMultiheadAttention(D, H, weight_prior=spec, attention_prior=None)
    circuits = CircuitAttention(D, H, weight_prior=spec, attention_prior=None)
    torch.manual_seed(0)
    draws = _projection_prior(factors).sample((20_000,))  # (draws, 4, D, D + 1)
    qk, ov, bias = from_factors(draws, None, H)
    expected = (D // H) ** 0.5 * spec.std(D) ** 2
    assert float(qk[..., :D, :].std()) == pytest.approx(expected, rel=0.03)
    assert float(ov[..., :, :D].std()) == pytest.approx(expected, rel=0.03)
    for prior in (_qk_prior(circuits), _ov_prior(circuits)):
        assert torch.allclose(prior.base_dist.scale, torch.tensor(expected))
    assert float(bias.std()) == pytest.approx(spec.std(D), rel=0.03)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"attention_prior": priors.LogitScalePrior()}, "takes no LogitScalePrior"),
        ({}, "takes no LogitScalePrior"),  # the default attention_prior
        (
            {"attention_prior": priors.StochasticAttentionPrior()},
            "takes no StochasticAttentionPrior",
        ),
        ({"attention_prior": None, "positions": "rotary"}, "cannot rotate queries and keys"),
        (
            {"attention_prior": None, "weight_prior": priors.Normal(1.0, loc=0.5)},
            "weight_prior centred at 0",
        ),
        ({"attention_prior": None, "attention_parameterization": "products"}, "must be one of"),
    ],
)
def test_what_circuits_refuse_is_named(options, match):
    options = {"attention_parameterization": "circuits", **options}
    with pytest.raises(ValueError, match=match):
        SequenceClassifier(4, 3, T, d_model=D, num_heads=H, **options)


def test_a_fit_saves_loads_and_exports_with_named_dims(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = SequenceData(torch.randn(30, T, 4, generator=g), torch.randint(0, 3, (30,), generator=g))
    model = SequenceClassifier(4, 3, T, d_model=D, num_heads=H, d_ff=8, **CIRCUITS)
    post = fit_map(model, data, num_steps=5, progress=False)
    assert model.config["attention_parameterization"] == "circuits"
    post.save(tmp_path / "run")
    again = load_posterior(tmp_path / "run")
    torch.testing.assert_close(again.predict(data.x).mean, post.predict(data.x).mean)
    idata = post.to_inference_data(data)
    qk = idata.posterior["encoder.layers.0.attention.qk_circuit"]
    prefix = "encoder.layers.0.attention."
    assert qk.dims[2:] == tuple(
        prefix + dim for dim in ("head", "query_features_and_bias", "key_features")
    )
    assert qk.shape[2:] == (H, D + 1, D)
    assert "attention" in idata.posterior  # posterior attention, as with factors
