"""Stochastic attention (attention logits as local latents): the amortized SVI guide, the data
plate, predictions on new sequences, non-centred MCMC on small data, and persistence."""

import math
import warnings

import pyro
import pytest
import torch
from pyro import poutine

from probtransformer import priors
from probtransformer.attention import LOCAL_LATENT, BayesMultiheadAttention, amortized, data_plate
from probtransformer.datasets import SequenceData
from probtransformer.inference import NUTS, fit_mcmc, fit_svi, load_posterior
from probtransformer.inference.mcmc import driver as mcmc_module
from probtransformer.inference.mcmc import pyro_runner as pyro_kernels
from probtransformer.inference.vi.guides import AmortizedGuide, has_local_latents
from probtransformer.models import SequenceClassifier

T, F = 5, 2
TINY = dict(d_model=8, num_heads=2, num_layers=1, d_ff=8)
FIT = dict(num_steps=100, batch_size=50, lr=1e-2, seed=0, progress=False)
SITE = "encoder.layers.0.attention.attention_logits"


def _data(n=260, seed=0) -> SequenceData:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, T, F, generator=g)
    mask = torch.ones(n, T, dtype=torch.bool)
    mask[::3, 3:] = False  # every third sequence: the last two steps are padding
    y = ((x[..., 0] * mask).sum(-1) > 0).long()
    return SequenceData(x, y, mask)


def _model(**kwargs) -> SequenceClassifier:
    kwargs.setdefault("attention_prior", priors.StochasticAttentionPrior())
    return SequenceClassifier(F, 2, T, **TINY, **kwargs)


@pytest.fixture(scope="module")
def data() -> SequenceData:
    return _data()


@pytest.fixture(scope="module")
def posterior(data):
    return fit_svi(_model(), data[:200], **FIT)


def _num_guide_parameters(post) -> int:
    return sum(p.numel() for p in post.guide.parameters())


# -- SVI: the amortized guide -------------------------------------------------------------------


def test_svi_builds_an_amortized_guide_whose_size_does_not_grow_with_n(posterior, data):
    assert has_local_latents(posterior.model)
    assert not has_local_latents(SequenceClassifier(F, 2, T, **TINY))
    assert isinstance(posterior.guide, AmortizedGuide)
    small = fit_svi(_model(), data[:50], **FIT)
    assert isinstance(small.guide, AmortizedGuide)
    assert _num_guide_parameters(small) == _num_guide_parameters(posterior)
    names = dict(posterior.guide.named_parameters())
    # one learned scale per head for the local site, no per-sequence parameters
    assert names["local_scales.encoder__layers__0__attention__attention_logits"].shape == (2,)
    assert not any(p.shape[:1] in ((50,), (200,)) for p in names.values())
    # the model's point estimates are not the guide's parameters
    assert not {id(p) for p in posterior.guide.parameters()} & {
        id(p) for p in posterior.model.parameters()
    }
    assert all(math.isfinite(v) for v in posterior.record["elbo"])


def test_latent_shapes_exclude_the_local_site(posterior):
    shapes = posterior.latent_shapes
    assert SITE not in shapes
    assert not any("attention_logits" in name for name in shapes)
    assert shapes["encoder.layers.0.attention.noise_scale"] == (2,)
    assert "encoder.layers.0.attention.projection" in shapes
    draws = posterior.draws(7, seed=0)
    assert set(draws) == set(shapes)
    assert (draws["encoder.layers.0.attention.noise_scale"] > 0).all()


def test_predictions_on_new_sequences_are_seeded(posterior, data):
    new = data[200:]
    a = posterior.predict(new.x, new.mask, num_samples=20, seed=0)
    b = posterior.predict(new.x, new.mask, num_samples=20, seed=0)
    c = posterior.predict(new.x, new.mask, num_samples=20, seed=1)
    assert a.probs.shape == (20, 60, 2)
    assert torch.isfinite(a.probs).all()
    torch.testing.assert_close(a.probs.sum(-1), torch.ones(20, 60))
    assert torch.equal(a.probs, b.probs)
    assert not torch.allclose(a.probs, c.probs)
    assert torch.isfinite(posterior.predict(new.x[:3], new.mask[:3], num_samples=4).probs).all()


def test_posterior_attention_rows_on_new_sequences(posterior, data):
    new = data[200:]
    att = posterior.attention(new.x, new.mask, num_samples=10, seed=0).samples
    assert att.shape == (1, 10, 60, 1, 2, T, T)
    torch.testing.assert_close(att.sum(-1), torch.ones(att.shape[:-1]))
    padded = (~new.mask)[None, None, :, None, None, None, :].expand_as(att)  # padded keys
    assert padded.any()
    assert torch.all(att[padded] == 0.0)
    # the local latents make the attention itself random, draw to draw
    assert att.std(1).max() > 1e-3


def test_attention_rows_with_a_hard_window_and_padding_sum_to_one_or_zero(data):
    """Stochastic logits combined with a hard local_window(1): keys outside the window and
    padded keys get weight 0; a query whose window is all padding gets an all-zero row."""
    model = _model(
        attention_prior=(
            priors.StochasticAttentionPrior(),
            priors.AttentionLogitPrior(priors.local_window(1), strength=2.0),
        )
    )
    post = fit_svi(model, data[:100], **{**FIT, "num_steps": 30})
    x = data.x[200:206]
    mask = torch.ones(6, T, dtype=torch.bool)
    mask[0, 2:] = False  # queries 3 and 4 see only padding within |i - j| <= 1
    att = post.attention(x, mask, num_samples=6, seed=0).samples[0, :, :, 0]  # (S, n, H, T, T)
    assert torch.isfinite(att).all()
    sums = att.sum(-1)
    assert torch.all(((sums - 1).abs() < 1e-5) | (sums == 0))
    assert torch.all(att[..., 0, :, 3:, :] == 0.0)
    assert torch.all(att[..., 0, :, :, 2:] == 0.0)
    i = torch.arange(T)
    assert torch.all(att[..., (i[:, None] - i[None, :]).abs() > 1] == 0.0)
    torch.testing.assert_close(sums[:, 1:], torch.ones_like(sums[:, 1:]))


def test_local_site_is_in_the_data_plate_scaled_like_the_likelihood(posterior, data):
    batch = data[:10]
    with poutine.trace() as tracer, torch.no_grad():
        posterior.model(batch.x, batch.y, batch.mask, num_data=200)
    trace = tracer.trace
    site = trace.nodes[SITE]
    assert site["infer"].get(LOCAL_LATENT)
    assert [f.name for f in site["cond_indep_stack"]] == ["data"]
    assert site["scale"] == pytest.approx(20.0)
    assert trace.nodes["y"]["scale"] == pytest.approx(20.0)
    assert site["value"].shape == (10, 2, T, T)
    assert site["fn"].event_shape == (2, T, T)
    for name in ("encoder.layers.0.attention.noise_scale", "encoder.layers.0.attention.projection"):
        assert trace.nodes[name]["scale"] == 1.0  # globals: the prior is never scaled
        assert not trace.nodes[name]["cond_indep_stack"]


def test_stochastic_attention_outside_a_data_plate_is_refused():
    attn = BayesMultiheadAttention(
        8, 2, bayesian=False, attention_prior=priors.StochasticAttentionPrior()
    )
    with pytest.raises(ValueError, match="data_plate"):
        attn(torch.randn(1, 3, T, 8))


def _attention_input(model, x, mask, run):
    """Run ``run()`` and return the first attention module's query input (s, N, T, d)."""
    seen = []
    attn = model.encoder.attention_modules[0]
    handle = attn.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    try:
        run()
    finally:
        handle.remove()
    return seen[0]


def _content_logits(h, projection, heads=2):
    """``q·k / sqrt(d_head)`` per head from the projection ``(4, d, d + 1)``: ``(N, H, T, T)``."""
    d = projection.shape[1]
    q = h @ projection[0, :, :d].T + projection[0, :, d]
    k = h @ projection[1, :, :d].T + projection[1, :, d]
    N, Tq, _ = q.shape
    q = q.view(N, Tq, heads, d // heads).transpose(1, 2)
    k = k.view(N, Tq, heads, d // heads).transpose(1, 2)
    return q @ k.transpose(-1, -2) / math.sqrt(d // heads), k


def test_guide_loc_is_the_network_logits_and_model_loc_is_the_contextual_prior(posterior, data):
    batch = data[:4]
    guide = posterior.guide
    with poutine.trace() as tracer, torch.no_grad():
        h = _attention_input(
            posterior.model, batch.x, batch.mask, lambda: guide(batch.x, batch.y, batch.mask)
        )
    trace = tracer.trace
    projection = trace.nodes["encoder.layers.0.attention.projection"]["value"]
    expected, k = _content_logits(h[0], projection)
    fn = trace.nodes[SITE]["fn"]
    normal = fn.base_dist
    while not hasattr(normal, "loc"):  # Independent(Normal)
        normal = normal.base_dist
    visible = batch.mask[:, None, None, :].expand_as(expected)  # real keys
    assert not visible.all()  # the batch has padding
    loc, scale = normal.loc.reshape(expected.shape), normal.scale.reshape(expected.shape)
    torch.testing.assert_close(loc[visible], expected[visible], rtol=1e-4, atol=1e-5)
    scales = guide.local_scale(SITE, 2, torch.device("cpu")).view(1, 2, 1, 1).expand_as(expected)
    torch.testing.assert_close(scale[visible], scales[visible])
    # padded keys: N(0, 1) in the guide as in the model, so they add nothing to the KL
    assert (loc[~visible] == 0).all() and (scale[~visible] == 1).all()
    log_prob = trace.nodes[SITE]["fn"].log_prob(trace.nodes[SITE]["value"])
    assert log_prob.numel() == 4 and torch.isfinite(log_prob).all()

    # the model's prior mean: k_j · w_h / sqrt(d_head), the same for every query i
    attn = posterior.model.encoder.attention_modules[0]
    w = torch.randn(2, 4)
    values = {name: trace.nodes[name]["value"] for name in posterior.latent_shapes}
    conditioned = poutine.condition(posterior.model, data=values)
    kept = attn.prior_key_weight.detach().clone()
    try:
        with torch.no_grad():
            attn.prior_key_weight.copy_(w)
        with poutine.trace() as model_tracer, torch.no_grad():
            conditioned(batch.x, batch.y, batch.mask)
    finally:
        with torch.no_grad():
            attn.prior_key_weight.copy_(kept)
    normal = model_tracer.trace.nodes[SITE]["fn"].base_dist
    while not hasattr(normal, "loc"):
        normal = normal.base_dist
    context = torch.einsum("nhkc,hc->nhk", k, w) / math.sqrt(4)  # (N, H, Tk)
    loc, scale = normal.loc.reshape(expected.shape), normal.scale.reshape(expected.shape)
    context = context[:, :, None, :].expand_as(expected)
    torch.testing.assert_close(loc[visible], context[visible], rtol=1e-4, atol=1e-5)
    sigma = trace.nodes["encoder.layers.0.attention.noise_scale"]["value"]
    torch.testing.assert_close(scale[visible], sigma.view(1, 2, 1, 1).expand_as(expected)[visible])
    assert (loc[~visible] == 0).all() and (scale[~visible] == 1).all()


def test_amortized_context_samples_from_the_given_guide_scales():
    """At module level: inside ``amortized(g)`` the logits are drawn around the network logits
    with g's scales; a tiny scale reproduces deterministic attention."""

    class Scales:
        def local_scale(self, name, num_heads, device):
            return torch.full((num_heads,), 1e-6, device=device)

    attn = BayesMultiheadAttention(
        8, 2, bayesian=False, attention_prior=priors.StochasticAttentionPrior()
    )
    with torch.no_grad():
        attn.projection.normal_(0.0, 0.5)
    plain = BayesMultiheadAttention(8, 2, bayesian=False, attention_prior=None)
    with torch.no_grad():
        plain.projection.copy_(attn.projection)
    x = torch.randn(1, 3, T, 8)
    mask = torch.tensor([[True] * T, [True, True, True, False, False], [True] * T])
    with data_plate(pyro.plate("data", 3)), amortized(Scales()), torch.no_grad():
        out = attn(x, key_padding_mask=mask)
    expected = plain(x, key_padding_mask=mask)
    torch.testing.assert_close(attn.attention_weights, plain.attention_weights, atol=1e-4, rtol=0)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


# -- persistence --------------------------------------------------------------------------------


def test_save_and_load_round_trip(posterior, data, tmp_path):
    posterior.save(tmp_path / "post")
    loaded = load_posterior(tmp_path / "post")
    assert isinstance(loaded.guide, AmortizedGuide)
    assert loaded.latent_shapes == posterior.latent_shapes
    new = data[200:230]
    a = posterior.predict(new.x, new.mask, num_samples=10, seed=4).probs
    b = loaded.predict(new.x, new.mask, num_samples=10, seed=4).probs
    assert torch.equal(a, b)
    att_a = posterior.attention(new.x[:5], new.mask[:5], num_samples=5, seed=4).samples
    att_b = loaded.attention(new.x[:5], new.mask[:5], num_samples=5, seed=4).samples
    assert torch.equal(att_a, att_b)


# -- MCMC ---------------------------------------------------------------------------------------


def _tiny_mcmc(small: SequenceData, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short warm-up
        return fit_mcmc(
            _model(**kwargs),
            small,
            kernel=NUTS(max_tree_depth=3),
            num_chains=1,
            num_warmup=10,
            num_samples=5,
            map_steps=20,
            seed=0,
            progress=False,
        )


def test_mcmc_samples_the_local_latents_non_centred(data, monkeypatch):
    seen = set()
    setup = pyro_kernels.RecordingNUTS.setup

    def spy(self, *args, **kwargs):
        setup(self, *args, **kwargs)
        seen.update(self.transforms)

    monkeypatch.setattr(pyro_kernels.RecordingNUTS, "setup", spy)
    small = SequenceData(data.x[:16], data.y[:16])  # no padding: see the test below
    post = _tiny_mcmc(small)
    # the kernel sampled the non-centred local site, not the centred one
    assert f"{SITE}_decentered" in seen
    assert SITE not in seen
    assert "encoder.layers.0.attention.noise_scale" in seen
    # ... but neither is kept in the Posterior: they are per training sequence
    assert set(post.samples) == set(post.latent_shapes)
    assert not any("attention_logits" in name for name in post.samples)
    assert post.samples["encoder.layers.0.attention.projection"].shape == (1, 5, 4, 8, 9)

    # the reparameterised model: z = loc + scale * eps, eps ~ N(0, 1) is the latent
    with poutine.trace() as tracer, torch.no_grad():
        pyro_kernels._non_centred(post.model)(small.x, small.y, small.mask)
    nodes = tracer.trace.nodes
    eps = nodes[f"{SITE}_decentered"]
    assert not eps["is_observed"]
    base = eps["fn"]
    while not hasattr(base, "loc"):
        base = base.base_dist
    assert torch.all(base.loc == 0) and torch.all(base.scale == 1)
    assert nodes[SITE]["is_observed"]  # a deterministic function of eps and the globals
    assert [f.name for f in eps["cond_indep_stack"]] == ["data"]
    # models without local latents are left as they are
    plain = SequenceClassifier(F, 2, T, **TINY)
    assert pyro_kernels._non_centred(plain) is plain

    # predictions for new sequences (padded too) draw the local latents from their prior
    new = data[200:210]
    pred = post.predict(new.x, new.mask, num_samples=5, seed=0)
    assert pred.probs.shape == (5, 10, 2) and torch.isfinite(pred.probs).all()
    assert torch.equal(pred.probs, post.predict(new.x, new.mask, num_samples=5, seed=0).probs)


def test_mcmc_with_padded_sequences(data):
    """Masked logits (padding here; a hard guidance or causal mask alike) must not stop the
    non-centred reparameterisation: LocScaleReparam unwraps Independent, not MaskedDistribution,
    so ``fn.mask(allowed)`` in ``_stochastic_logits`` fails with AttributeError 'loc'."""
    small = data[:16]
    assert not small.mask.all()
    post = _tiny_mcmc(small)
    pred = post.predict(small.x, small.mask, num_samples=5, seed=0)
    assert torch.isfinite(pred.probs).all()


def test_mcmc_refuses_more_than_max_local_sequences(data):
    assert mcmc_module.MAX_LOCAL_SEQUENCES == 50
    with pytest.raises(ValueError, match=r"at most 50 .*got 51.*fit_svi"):
        fit_mcmc(_model(), data[:51], num_chains=1, num_warmup=0, num_samples=1, progress=False)
