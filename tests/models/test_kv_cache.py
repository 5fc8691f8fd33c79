"""The key-value cache and the generation engine: cached steps equal full passes for every
positional scheme and attention prior, the same tokens with and without the cache for guide,
MCMC and ensemble posteriors, ragged prompt batches, Thompson decoding, and the window beyond
``max_len``."""

import warnings

import numpy as np
import pytest
import torch

from probtransformer import kv_cache, priors
from probtransformer.datasets import SequenceData
from probtransformer.inference import Posterior, fit_ensemble, fit_mc_dropout, fit_svi
from probtransformer.inference.posterior.decoding import NextTokenDecoder
from probtransformer.models import CausalLM, Generation, generate, generate_stream

T, V = 10, 6  # max_len, vocabulary
SIZES = dict(d_model=16, num_heads=2, num_layers=2, d_ff=16, dropout=0.0)
SCHEMES = {
    "sinusoidal": {},
    "learned": {"positions": "learned"},
    "rotary": {"positions": "rotary"},
    "alibi": {
        "positions": "none",
        "attention_prior": (priors.LogitScalePrior(), priors.ALiBiSlopePrior(scale=1.0)),
    },
    "conv": {"conv_kernel": 3},
    "guidance": {"attention_prior": priors.AttentionLogitPrior(priors.LocalWindow(3))},
    "hard": {"hard_attention": True},
    "circuits": {"attention_parameterization": "circuits", "attention_prior": None},
    "latent-everything": {"bayesian": ("embedding", "attention", "ffn", "norm", "head")},
}


def _data(seed: int = 0, n: int = 16) -> SequenceData:
    ids = torch.randint(0, V, (n, T + 1), generator=torch.Generator().manual_seed(seed))
    return SequenceData(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), None)


def _svi(num_steps: int = 5, **options):
    model = CausalLM(V, T, **{**SIZES, **options})
    return fit_svi(model, _data(), num_steps=num_steps, batch_size=16, lr=3e-2, progress=False)


@pytest.fixture(scope="module")
def svi():
    return _svi(num_steps=30)


def _steps(post, draws, history: torch.Tensor, extra: torch.Tensor, *, cache: bool):
    """Next-token probabilities after the prompt ``history`` and after each of ``extra``'s
    columns, ``(steps, S, B, V)``."""
    decoder = NextTokenDecoder(post.model, draws, device=post.device, seed=0, cache=cache)
    out = []
    with decoder.held():
        out.append(decoder.step(history, history.shape[1]))
        for t in range(extra.shape[1]):
            history = torch.cat([history, extra[:, t : t + 1]], 1)
            out.append(decoder.step(history, 1))
    return torch.stack(out)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_cached_steps_equal_full_passes(scheme):
    post = _svi(**SCHEMES[scheme])
    draws = post.draw(4, seed=1)
    g = torch.Generator().manual_seed(2)
    prompt, extra = (
        torch.randint(0, V, (3, 4), generator=g),
        torch.randint(0, V, (3, 6), generator=g),
    )
    before = {name: dict(vars(m)) for name, m in post.model.named_modules()}
    full = _steps(post, draws, prompt, extra, cache=False)
    cached = _steps(post, draws, prompt, extra, cache=True)
    assert full.shape == (7, 4, 3, V)
    # the attributes pinned for the steps are gone, the parameters are the model's again
    after = {name: vars(m) for name, m in post.model.named_modules()}
    assert {n: set(v) - {"attention_weights"} for n, v in after.items()} == {
        n: set(v) - {"attention_weights"} for n, v in before.items()
    }
    assert all(isinstance(p, torch.nn.Parameter) for p in post.model.parameters())
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
    # and the full passes are Posterior.predict's numbers for the same draws
    history = torch.cat([prompt, extra], 1)
    probs = post.predict(history, draws=draws).probs  # (S, B, T, V)
    torch.testing.assert_close(full[-1], probs[:, :, -1], atol=1e-5, rtol=1e-5)


def test_the_cache_counts_and_restarts():
    cache = kv_cache.KVCache()
    k = torch.zeros(1, 1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="advanced"):
        cache.keys_values("m", k, k)
        cache.keys_values("m", k, k)  # the same module twice in one pass
    cache.reset()
    assert cache.offset == 0 and kv_cache.offset() == 0
    with kv_cache.decoding(cache):
        cache.keys_values("m", k, k)
        cache.advance(3)
        assert kv_cache.offset() == 3 and kv_cache.active() is cache
        keys, _ = cache.keys_values("m", k[..., :1, :], k[..., :1, :])
        assert keys.shape == (1, 1, 2, 4, 4)
    assert kv_cache.active() is None


def test_the_cache_grows_past_its_buffers_and_keeps_every_step():
    """The buffers double when full (16, then 2x the steps): the steps read back are those
    appended, in order, across several growths."""
    cache, g = kv_cache.KVCache(), torch.Generator().manual_seed(0)
    steps = [torch.randn(2, 1, 3, t, 4, generator=g) for t in (5, 1, 12, 1, 30, 1)]
    for new in steps:
        keys, values = cache.keys_values("m", new, -new)
        cache.advance(new.shape[-2])
    expected = torch.cat(steps, -2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)


def _ensemble():
    model = CausalLM(V, T, **SIZES)
    return fit_ensemble(
        model, _data(), n_members=2, num_steps=5, batch_size=16, lr=3e-2, progress=False
    )


def _mcmc_like(post: Posterior) -> Posterior:
    """A sample-based posterior: 2 chains of 3 kept draws (guide draws stand in for MCMC's)."""
    samples = {k: v.reshape(2, 3, *v.shape[2:]) for k, v in post.draws(6, seed=3).items()}
    return Posterior(post.model, samples=samples, record={}, example=post.example)


@pytest.mark.parametrize("kind", ["guide", "mcmc", "ensemble"])
@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(strategy="sample", seed=4),
        dict(strategy="sample", bayes_average=False, top_p=0.9, seed=5),
    ],
)
def test_same_tokens_with_and_without_the_cache(svi, kind, options):
    post = {"guide": lambda: svi, "mcmc": lambda: _mcmc_like(svi), "ensemble": _ensemble}[kind]()
    prompts = [[1, 2, 3], [4], [5, 0, 1, 2]]  # ragged; prompt + output <= max_len
    kwargs = dict(max_new_tokens=5, num_samples=6, **options)
    cached = generate(post, prompts, cache=True, **kwargs)
    full = generate(post, prompts, cache=False, **kwargs)
    assert [len(g) for g in cached] == [5, 5, 5]
    for a, b in zip(cached, full, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.epistemic, b.epistemic, atol=1e-5, rtol=1e-5)


def test_a_ragged_batch_equals_its_prompts_one_by_one(svi):
    prompts = [[1, 2, 3], [4], [5, 0, 1, 2, 3, 4]]
    batch = generate(svi, prompts, max_new_tokens=6, num_samples=5)
    assert isinstance(batch, list) and all(isinstance(g, Generation) for g in batch)
    for prompt, gen in zip(prompts, batch, strict=True):
        alone = generate(svi, prompt, max_new_tokens=6, num_samples=5)
        assert gen.token_ids.tolist() == alone.token_ids.tolist()
        torch.testing.assert_close(gen.entropy, alone.entropy, atol=1e-5, rtol=1e-5)
    # a 2-D tensor is a batch of equal-length prompts
    rows = generate(svi, torch.tensor([[1, 2], [3, 4]]), max_new_tokens=3, num_samples=5)
    assert len(rows) == 2 and rows[0].prompt is None


def _spread(post: Posterior, num: int = 8) -> Posterior:
    """A sample-based posterior of ``num`` clearly different draws (guide draws plus noise)."""
    g = torch.Generator().manual_seed(8)
    samples = {k: v + torch.randn(v.shape, generator=g) for k, v in post.draws(num, seed=8).items()}
    return Posterior(post.model, samples=samples, record={}, example=post.example)


def test_thompson_decoding_follows_one_draw_per_sequence(svi):
    post = _spread(svi)
    prompts = [[1, 2]] * 6
    kwargs = dict(max_new_tokens=4, bayes_average=False, num_samples=8, seed=7)
    gens = generate(post, prompts, **kwargs)
    again = generate(post, prompts, **kwargs)
    assert [g.token_ids.tolist() for g in gens] == [g.token_ids.tolist() for g in again]
    # each sequence is the greedy decoding of one posterior draw
    singles = {
        tuple(generate(_one(post, s), [1, 2], max_new_tokens=4, num_samples=1).token_ids.tolist())
        for s in range(8)
    }
    assert all(tuple(g.token_ids.tolist()) in singles for g in gens)
    assert len({tuple(g.token_ids.tolist()) for g in gens}) > 1  # not all the same draw
    # the uncertainty is the whole posterior's, not the followed draw's
    average = generate(post, [1, 2], max_new_tokens=1, num_samples=8)
    torch.testing.assert_close(gens[0].entropy[:1], average.entropy)


def _one(post: Posterior, s: int) -> Posterior:
    samples = {k: v[:, s : s + 1] for k, v in post.samples.items()}
    return Posterior(post.model, samples=samples, record={}, example=post.example)


def test_beyond_max_len_the_window_is_reencoded(svi):
    prompt = [1, 2, 3, 4]
    cached = generate(svi, prompt, max_new_tokens=3 * T, num_samples=4, cache=True)
    full = generate(svi, prompt, max_new_tokens=3 * T, num_samples=4, cache=False)
    assert len(cached) == len(full) == 3 * T
    within = T - len(prompt) + 1  # steps whose context fits max_len: the same tokens
    assert cached.token_ids[:within].tolist() == full.token_ids[:within].tolist()
    assert cached.token_ids.max() < V and torch.isfinite(cached.entropy).all()
    # a prompt longer than max_len: both read its last max_len tokens at the first step
    long = list(range(V)) * 3
    a = generate(svi, long, max_new_tokens=1, num_samples=4, cache=True)
    b = generate(svi, long, max_new_tokens=1, num_samples=4, cache=False)
    assert a.token_ids.tolist() == b.token_ids.tolist()


def test_stochastic_attention_decodes_without_the_cache():
    post = _svi(attention_prior=priors.StochasticAttentionPrior(), num_steps=2)
    gen = generate(post, [1, 2], max_new_tokens=3, num_samples=3)  # cache=None: not used
    assert (
        gen.token_ids.tolist()
        == generate(post, [1, 2], max_new_tokens=3, num_samples=3, cache=False).token_ids.tolist()
    )
    with pytest.raises(ValueError, match="stochastic attention"):
        generate(post, [1, 2], max_new_tokens=3, cache=True)


def test_mc_dropout_decodes_with_a_cache_per_draw():
    model = CausalLM(V, T, **{**SIZES, "dropout": 0.2})
    post = fit_mc_dropout(model, _data(), num_steps=3, batch_size=16, progress=False)
    a = generate(post, [[1, 2], [3]], max_new_tokens=4, num_samples=3, seed=1)
    b = generate(post, [[1, 2], [3]], max_new_tokens=4, num_samples=3, seed=1)
    assert [g.token_ids.tolist() for g in a] == [g.token_ids.tolist() for g in b]
    assert all(bool((g.epistemic >= 0).all()) for g in a)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(cache="yes"), TypeError, "cache"),
        (dict(prompt=[]), ValueError, "prompt"),
        (dict(prompt=[[1, 2], []]), ValueError, "prompt"),
        (dict(prompt=[[1, 2], [V]]), ValueError, "token ids"),
        (dict(prompt=[1, "a"]), TypeError, "must hold ints"),
        (dict(prompt=[None]), TypeError, "NoneType"),
        (dict(prompt=[2**70]), ValueError, rf"got values in \[{2**70}, {2**70}\]"),
        (dict(prompt=np.array(["a", "b"])), ValueError, "dtype <U1"),
        (dict(prompt=torch.tensor([1 + 0j])), ValueError, "complex"),
        (dict(bayes_average="no"), TypeError, "bayes_average"),
        (dict(cache=1), TypeError, "cache"),
    ],
)
def test_bad_arguments_raise(svi, kwargs, error, match):
    kwargs = {"prompt": [1, 2], "max_new_tokens": 2, **kwargs}
    with pytest.raises(error, match=match):
        generate(svi, kwargs.pop("prompt"), **kwargs)


def test_a_read_only_prompt_array_is_read_without_torch_warning(svi):
    """A pandas Series's values can be read-only, and torch warns on those."""
    ids = np.array([1, 2])
    ids.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = generate(svi, ids, max_new_tokens=2, num_samples=3, seed=0)
    expected = generate(svi, [1, 2], max_new_tokens=2, num_samples=3, seed=0)
    assert got.token_ids.tolist() == expected.token_ids.tolist()


def test_a_tiny_temperature_is_greedy_not_nan(svi):
    """Log-probabilities over 1e-40 overflow float32 unless the largest is 0 first."""
    greedy = generate(svi, [1, 2], max_new_tokens=4, num_samples=3)
    for strategy in ("greedy", "sample"):
        cold = generate(
            svi, [1, 2], max_new_tokens=4, num_samples=3, temperature=1e-40, strategy=strategy
        )
        assert cold.token_ids.tolist() == greedy.token_ids.tolist()


def test_generate_stream_yields_the_tokens_of_generate_one_at_a_time(svi):
    options = dict(max_new_tokens=5, strategy="sample", top_p=0.9, num_samples=4, seed=1)
    expected = generate(svi, [1, 2, 3], **options)
    stream = generate_stream(svi, [1, 2, 3], **options)
    first = next(stream)
    assert first.index == 0 and first.token_id == int(expected.token_ids[0])
    steps = [first, *stream]
    assert [s.token_id for s in steps] == expected.token_ids.tolist()
    for name in ("entropy", "aleatoric", "epistemic"):
        assert torch.allclose(
            torch.tensor([getattr(s, name) for s in steps]), getattr(expected, name)
        )
    with pytest.raises(ValueError, match="one prompt"):
        generate_stream(svi, [[1, 2], [3]])
    with pytest.raises(ValueError, match="temperature"):
        generate_stream(svi, [1], temperature=0)  # checked at the call, not at the first step


def test_a_list_of_0d_integer_tensors_is_one_prompt_of_ids(svi):
    ids = [torch.tensor(1), np.int64(2), np.array(3)]
    assert isinstance(generate(svi, ids, max_new_tokens=2, num_samples=2), Generation)
    with pytest.raises(TypeError, match="must hold ints"):
        generate(svi, [torch.tensor(1.5)], max_new_tokens=2)


def test_a_vanishing_temperature_or_top_p_samples_the_greedy_tokens(svi):
    greedy = generate(svi, [1, 2], max_new_tokens=4, num_samples=4)
    for tiny in ({"temperature": 1e-300}, {"top_p": 1e-300}):
        cold = generate(svi, [1, 2], max_new_tokens=4, num_samples=4, strategy="sample", **tiny)
        assert cold.token_ids.tolist() == greedy.token_ids.tolist()
