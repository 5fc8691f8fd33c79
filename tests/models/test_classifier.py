import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, init_to_sample

from probtransformer import priors
from probtransformer.models import SequenceClassifier

F_IN, C, T = 5, 3, 6
SIZES = dict(d_model=8, num_heads=2, num_layers=1, d_ff=16, dropout=0.0)


def _model(**kwargs) -> SequenceClassifier:
    return SequenceClassifier(F_IN, C, T, **{**SIZES, **kwargs})


def _data(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, T, F_IN, generator=g)
    y = torch.randint(0, C, (n,), generator=g)
    return x, y


def _latent_sites(trace) -> dict[str, torch.Size]:
    return {
        name: site["value"].shape
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and name not in ("data", "y")
        and not site["infer"].get("_deterministic")
    }


def _prior_draws(model, num, x):
    """``num`` prior draws of every latent, ``{site: (num, *shape)}``."""
    with torch.no_grad(), pyro.plate("draws", num, dim=-2):
        tr = poutine.trace(model).get_trace(x)
    shapes = _latent_sites(poutine.trace(model).get_trace(x))
    return {name: tr.nodes[name]["value"].reshape(num, *shape) for name, shape in shapes.items()}


def _log_prob_terms(trace) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of latent log priors, scaled log-likelihood of "y") of a trace."""
    trace.compute_log_prob()
    prior = sum(
        site["log_prob_sum"]
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and name != "data"
    )
    return prior, trace.nodes["y"]["log_prob_sum"]


# -- construction -----------------------------------------------------------------------------


def test_latent_sites_names_and_shapes():
    model = _model(num_layers=2)
    x, y = _data()
    tr = poutine.trace(model).get_trace(x, y)
    assert _latent_sites(tr) == {
        "encoder.layers.0.attention.projection": (4, 8, 9),
        "encoder.layers.0.attention.logit_scale": (2,),
        "encoder.layers.1.attention.projection": (4, 8, 9),
        "encoder.layers.1.attention.logit_scale": (2,),
        "head.weight": (C, 8),
        "head.bias": (C,),
    }
    assert tr.nodes["y"]["is_observed"]
    assert tr.nodes["y"]["fn"].batch_shape == (12,)
    assert list(model.attention_modules) == ["encoder.self"]
    assert len(model.attention_modules["encoder.self"]) == 2


def test_every_part_latent_and_no_attention_prior():
    model = _model(bayesian=("embedding", "attention", "ffn", "norm", "head"), attention_prior=None)
    tr = poutine.trace(model).get_trace(*_data())
    sites = _latent_sites(tr)
    assert "embedding.projection.weight" in sites
    assert "encoder.layers.0.ffn.linear1.weight" in sites
    assert "encoder.norm.weight" in sites
    assert not any(name.endswith("logit_scale") for name in sites)
    assert not list(model.parameters())


def test_config_round_trip_rebuilds_the_same_architecture():
    model = _model(
        pooling="cls",
        bayesian=("head",),
        weight_prior=priors.Normal(scale=0.5),
        attention_prior=priors.LogitScalePrior(loc=0.1, scale=0.2),
    )
    rebuilt = SequenceClassifier.from_config(model.config)
    assert rebuilt.config == model.config
    assert rebuilt.config["bayesian"] == ["head"]
    assert [n for n, _ in rebuilt.named_parameters()] == [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(bayesian=("bogus",)), "bayesian"),
        (dict(pooling="max"), "pooling"),
        (dict(d_model=10, num_heads=4), "d_model"),
        (dict(num_layers=0), "num_layers"),
        (dict(dropout=1.0), "dropout"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, word):
    with pytest.raises(ValueError, match=word):
        _model(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, word",
    [
        (dict(bayesian=None), TypeError, "bayesian must be a str or an iterable of str"),
        (dict(bayesian=("attention", 3)), TypeError, "bayesian must be a str"),
        (dict(weight_prior="normal"), TypeError, "weight_prior must be a priors.Normal"),
        (
            dict(attention_prior=1.0),
            TypeError,
            "attention_prior must be None, one of LogitScalePrior",
        ),
        (dict(head_prior=priors.Normal()), TypeError, "head_prior must be a priors.HeadGatePrior"),
        (dict(num_classes=1), ValueError, "num_classes must be >= 2"),
    ],
)
def test_constructor_arguments_of_the_wrong_type_are_named(kwargs, error, word):
    args = dict(in_features=8, num_classes=10, max_len=8, **SIZES) | kwargs
    with pytest.raises(error, match=word):
        SequenceClassifier(**args)


# -- forward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_logits_shape_with_and_without_vectorizing_plate(pooling):
    model = _model(pooling=pooling)
    x, _ = _data(n=4)
    assert model(x).shape == (4, C)
    with pyro.plate("particles", 5, dim=-2):
        assert model(x).shape == (5, 4, C)


def test_prediction_mode_records_logits_and_samples_labels():
    model = _model()
    x, _ = _data(n=7)
    tr = poutine.trace(model).get_trace(x)
    logits = tr.nodes["logits"]["value"]
    assert logits.shape == (7, C)
    assert not tr.nodes["y"]["is_observed"]
    assert tr.nodes["y"]["value"].shape == (7,)
    torch.testing.assert_close(tr.nodes["y"]["fn"].logits, logits.log_softmax(-1))


def test_mean_pooling_ignores_padded_steps():
    model = _model()
    x, _ = _data(n=3)
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 1:] = False
    draw = {k: v[0] for k, v in _prior_draws(model, 1, x).items()}
    fixed = poutine.condition(model, data=draw)
    changed = x.clone()
    changed[1, 4:] = 100.0
    changed[2, 1:] = -50.0
    torch.testing.assert_close(fixed(x, mask=mask), fixed(changed, mask=mask))
    assert not torch.allclose(fixed(x), fixed(changed))


def test_all_padding_sequence_gives_finite_logits():
    model = _model()
    x, _ = _data(n=2)
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[0] = True
    assert torch.isfinite(model(x, mask=mask)).all()


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_parallel_predictive_matches_sequential_with_every_part_latent(pooling):
    model = _model(pooling=pooling, bayesian=("embedding", "attention", "ffn", "norm", "head"))
    x, _ = _data(n=4)
    mask = torch.ones(4, T, dtype=torch.bool)
    mask[1, 3:] = False
    draws = _prior_draws(model, 5, x)
    assert "embedding.projection.weight" in draws and "encoder.norm.bias" in draws
    if pooling == "cls":
        assert draws["embedding.cls"].shape == (5, 8)
    kwargs = dict(posterior_samples=draws, return_sites=["logits"])
    parallel = Predictive(model, parallel=True, **kwargs)(x, mask=mask)["logits"]
    sequential = Predictive(model, parallel=False, **kwargs)(x, mask=mask)["logits"]
    assert parallel.shape == (5, 4, C)
    torch.testing.assert_close(parallel, sequential, rtol=1e-5, atol=1e-5)
    assert parallel.std(0).min() > 0  # the draws differ


# -- vectorized ELBO particles --------------------------------------------------------------------


def test_vectorized_particles_log_joint_matches_a_loop_over_particles():
    P = 4
    model = _model()
    x, y = _data()
    draws = _prior_draws(model, P, x)
    conditioned = poutine.condition(model, data={k: v[:, None] for k, v in draws.items()})
    with pyro.plate("num_particles_vectorized", P, dim=-2):
        tr = poutine.trace(conditioned).get_trace(x, y)
    tr.compute_log_prob()
    per_particle = sum(
        site["log_prob"].reshape(P, -1).sum(-1)
        for name, site in tr.nodes.items()
        if site["type"] == "sample" and name != "data"
    )
    assert per_particle.shape == (P,)
    for p in range(P):
        single = poutine.condition(model, data={k: v[p] for k, v in draws.items()})
        expected = poutine.trace(single).get_trace(x, y).log_prob_sum()
        torch.testing.assert_close(per_particle[p], expected, rtol=1e-5, atol=1e-4)


def test_vectorized_elbo_with_delta_guide_equals_single_particle_loss():
    model = _model()
    x, y = _data()
    guide = AutoDelta(model, init_loc_fn=init_to_sample)
    single = Trace_ELBO(num_particles=1).loss(model, guide, x, y)
    vectorized = Trace_ELBO(num_particles=4, vectorize_particles=True).loss(model, guide, x, y)
    assert vectorized == pytest.approx(single, rel=1e-6)


# -- mini-batch scaling ----------------------------------------------------------------------


def test_mini_batch_log_likelihood_is_unbiased_and_the_prior_is_not_scaled():
    N, B = 240, 40
    model = _model()
    x, y = _data(n=N)
    draw = {k: v[0] for k, v in _prior_draws(model, 1, x).items()}
    fixed = poutine.condition(model, data=draw)
    full_prior, full_ll = _log_prob_terms(poutine.trace(fixed).get_trace(x, y))

    order = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    estimates = []
    for idx in order.view(N // B, B):
        tr = poutine.trace(fixed).get_trace(x[idx], y[idx], num_data=N)
        assert tr.nodes["y"]["scale"] == pytest.approx(N / B)
        prior, ll = _log_prob_terms(tr)
        torch.testing.assert_close(prior, full_prior)  # the prior is never scaled
        estimates.append(ll)
    estimates = torch.stack(estimates)
    # each batch estimates the full-data log-likelihood; over a partition the mean is exact
    torch.testing.assert_close(estimates.mean(), full_ll, rtol=1e-5, atol=1e-3)
    assert estimates.std() > 0  # they are estimates, not copies


def test_latents_are_drawn_once_not_per_data_point():
    model = _model()
    x, y = _data(n=9)
    tr = poutine.trace(model).get_trace(x, y)
    assert tr.nodes["head.weight"]["value"].shape == (C, 8)
    assert tr.nodes["head.weight"]["cond_indep_stack"] == ()
