import copy
import math
import pickle

import pyro
import pytest
import torch
from pyro import poutine
from torch import nn

from probtransformer import priors
from probtransformer.layers import (
    BayesLayerNorm,
    BayesLinear,
    Dropout,
    batched_linear,
    flatten_draws,
)


def _trace(module, *args):
    return poutine.trace(module).get_trace(*args)


@pytest.mark.parametrize(
    "shape, event_rank, expected",
    [
        ((5, 3), 2, (1, 5, 3)),
        ((7, 1, 5, 3), 2, (7, 5, 3)),
        ((2, 7, 1, 5, 3), 2, (14, 5, 3)),
        ((5,), 1, (1, 5)),
        ((7, 1, 5), 1, (7, 5)),
    ],
)
def test_flatten_draws_shapes(shape, event_rank, expected):
    value = torch.randn(shape)
    flat = flatten_draws(value, event_rank)
    assert flat.shape == expected
    assert torch.equal(flat.reshape(shape), value)


def test_flatten_draws_keeps_draw_order():
    S, out, inp = 4, 3, 2
    value = torch.randn(S, 1, out, inp)
    flat = flatten_draws(value, 2)
    for s in range(S):
        assert torch.equal(flat[s], value[s, 0])


@pytest.mark.parametrize("s_h, s_w", [(1, 1), (1, 4), (4, 1), (4, 4)])
def test_batched_linear_matches_loop_over_draws(s_h, s_w):
    N, T, F_in, F_out = 3, 5, 6, 2
    h = torch.randn(s_h, N, T, F_in)
    w = torch.randn(s_w, F_out, F_in)
    b = torch.randn(s_w, F_out)
    out = batched_linear(h, w, b)
    S = max(s_h, s_w)
    assert out.shape == (S, N, T, F_out)
    for s in range(S):
        expected = h[s % s_h] @ w[s % s_w].T + b[s % s_w]
        torch.testing.assert_close(out[s], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("in_features, out_features", [(4, 3), (16, 8), (64, 2)])
def test_bayes_linear_sites_shapes_and_fan_in_prior(in_features, out_features):
    layer = BayesLinear(in_features, out_features, prior=priors.Normal(scale=2.0))
    tr = _trace(layer, torch.randn(1, 5, in_features))
    weight, bias = tr.nodes["weight"], tr.nodes["bias"]
    assert weight["value"].shape == (out_features, in_features)
    assert bias["value"].shape == (out_features,)
    std = 2.0 / math.sqrt(in_features)  # Neal's fan-in scaling
    for site, event_rank in ((weight, 2), (bias, 1)):
        fn = site["fn"]
        assert fn.batch_shape == () and len(fn.event_shape) == event_rank
        torch.testing.assert_close(fn.stddev, torch.full_like(fn.stddev, std))
        torch.testing.assert_close(fn.mean, torch.zeros_like(fn.mean))
    assert tr.nodes["_RETURN"]["value"].shape == (1, 5, out_features)


def test_bayes_linear_without_fan_in_and_without_bias():
    layer = BayesLinear(9, 4, bias=False, prior=priors.Normal(scale=0.5, fan_in=False))
    tr = _trace(layer, torch.randn(1, 2, 9))
    assert "bias" not in tr.nodes
    fn = tr.nodes["weight"]["fn"]
    torch.testing.assert_close(fn.stddev, torch.full((4, 9), 0.5))


def test_bayes_linear_prior_draws_have_fan_in_std():
    torch.manual_seed(1)
    layer = BayesLinear(100, 50)
    draws = torch.stack([layer.weight for _ in range(40)])  # every read samples afresh
    assert draws.shape == (40, 50, 100)
    assert abs(draws.std().item() - 0.1) < 0.005


def test_bayes_linear_point_estimate_matches_torch_linear():
    torch.manual_seed(2)
    layer = BayesLinear(6, 4, bayesian=False)
    ref = nn.Linear(6, 4)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        ref.bias.copy_(layer.bias)
    h = torch.randn(1, 3, 5, 6)
    torch.testing.assert_close(layer(h)[0], ref(h[0]), rtol=1e-6, atol=1e-6)
    assert not list(_trace(layer, h).stochastic_nodes)


def test_bayes_linear_point_estimate_initialised_like_torch_linear():
    torch.manual_seed(3)
    layer = BayesLinear(7, 5, bayesian=False)
    torch.manual_seed(3)
    ref = nn.Linear(7, 5)
    torch.testing.assert_close(layer.weight.detach(), ref.weight.detach())
    torch.testing.assert_close(layer.bias.detach(), ref.bias.detach())


def test_bayes_linear_accepts_weights_with_leading_sample_dims():
    """Weights drawn as (S, 1, out, in) under a plate at dim -2 give one output per draw."""
    S, N, F_in, F_out = 5, 3, 4, 2
    layer = BayesLinear(F_in, F_out)
    w = torch.randn(S, 1, F_out, F_in)
    b = torch.randn(S, 1, F_out)
    h = torch.randn(1, N, F_in)
    conditioned = poutine.condition(layer, data={"weight": w, "bias": b})
    with pyro.plate("draws", S, dim=-2):
        out = conditioned(h)
    assert out.shape == (S, N, F_out)
    for s in range(S):
        torch.testing.assert_close(out[s], h[0] @ w[s, 0].T + b[s, 0], rtol=1e-5, atol=1e-6)


def test_bayes_layer_norm_sites_and_prior():
    norm = BayesLayerNorm(6, bayesian=True)
    tr = _trace(norm, torch.randn(1, 2, 3, 6))
    gain, shift = tr.nodes["weight"]["fn"], tr.nodes["bias"]["fn"]
    assert tr.nodes["weight"]["value"].shape == (6,) and tr.nodes["bias"]["value"].shape == (6,)
    torch.testing.assert_close(gain.mean, torch.ones(6))
    torch.testing.assert_close(shift.mean, torch.zeros(6))
    torch.testing.assert_close(gain.stddev, torch.full((6,), 0.1))
    torch.testing.assert_close(shift.stddev, torch.full((6,), 0.1))


def test_bayes_layer_norm_point_estimate_matches_torch_layer_norm():
    norm = BayesLayerNorm(8)
    ref = nn.LayerNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
        norm.bias.copy_(torch.linspace(-1.0, 1.0, 8))
        ref.weight.copy_(norm.weight)
        ref.bias.copy_(norm.bias)
    h = torch.randn(1, 3, 4, 8) * 3 + 1
    torch.testing.assert_close(norm(h)[0], ref(h[0]), rtol=1e-5, atol=1e-6)
    assert not list(_trace(norm, h).stochastic_nodes)


def test_bayes_layer_norm_draws_broadcast_against_hidden_state():
    S, d = 3, 4
    norm = BayesLayerNorm(d, bayesian=True)
    gain, shift = torch.randn(S, 1, d), torch.randn(S, 1, d)
    h = torch.randn(1, 2, 5, d)
    conditioned = poutine.condition(norm, data={"weight": gain, "bias": shift})
    with pyro.plate("draws", S, dim=-2):
        out = conditioned(h)
    assert out.shape == (S, 2, 5, d)
    normed = nn.functional.layer_norm(h[0], (d,))
    for s in range(S):
        torch.testing.assert_close(out[s], normed * gain[s, 0] + shift[s, 0])


def test_dropout_that_drops_nothing_returns_its_input_without_a_module_call():
    """``layers.Dropout`` skips the PyroModule call when inactive (p = 0 or eval mode), keeps
    its class through deepcopy and pickling (fits and saved runs copy models), and drops in
    training mode like ``nn.Dropout``."""
    calls = []
    x = torch.ones(4, 1000)
    for p, training in ((0.0, True), (0.5, False)):
        layer = Dropout(p).train(training)
        layer.register_forward_hook(lambda *_: calls.append(1))
        assert layer(x) is x
    assert calls == []
    layer = Dropout(0.5)
    assert isinstance(layer, torch.nn.Dropout)
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(copied) is Dropout and copied.p == 0.5
    torch.manual_seed(0)
    dropped = layer.train()(x)
    assert 0.4 < float((dropped == 0).float().mean()) < 0.6
    assert torch.all((dropped == 0) | (dropped == 2.0))  # kept units scaled by 1 / (1 - p)
