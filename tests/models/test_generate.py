"""Text generation from a CausalLM posterior: decoding strategies, seeds, per-token uncertainty,
prompt handling and argument checks."""

import math
import warnings

import pandas as pd
import pytest
import torch

from probtransformer import metrics
from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_svi
from probtransformer.models import CausalLM, Generation, TokenTagger, generate
from probtransformer.models.generate import _filter

T = 8  # context window (max_len)
SIZES = dict(d_model=16, num_heads=2, num_layers=1, d_ff=16, dropout=0.0)
ABC_VOCAB = ["<unk>", "a", "b", "c"]
FLAT_VOCAB = ["<unk>", *"defghij"]
S = 10  # posterior draws per generation step


def _windows(ids: torch.Tensor, starts) -> SequenceData:
    x = torch.stack([ids[i : i + T] for i in starts])
    y = torch.stack([ids[i + 1 : i + T + 1] for i in starts])
    return SequenceData(x, y, None)


def _abc_ids(length: int) -> torch.Tensor:
    return torch.tensor([ABC_VOCAB.index(c) for c in ("abc" * length)[:length]])


def _random_lm_data(vocab_size: int, n: int = 16, seed: int = 0) -> SequenceData:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, T + 1), generator=g)
    return SequenceData(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), None)


def _fit(model, data, num_steps, **kwargs):
    settings = dict(lr=3e-2, batch_size=len(data), seed=0, progress=False)
    return fit_svi(model, data, num_steps=num_steps, **{**settings, **kwargs})


@pytest.fixture(scope="module")
def abc():
    """A CausalLM fitted to "abcabc...": the next character is always determined."""
    return _fit(CausalLM(ABC_VOCAB, T, **SIZES), _windows(_abc_ids(60), range(45)), 80)


@pytest.fixture(scope="module")
def flat():
    """A barely fitted CausalLM on random text: flat-ish next-token distributions."""
    return _fit(CausalLM(FLAT_VOCAB, T, **SIZES), _random_lm_data(len(FLAT_VOCAB)), 2)


def _gen(post, prompt="defg", **kwargs) -> Generation:
    return generate(post, prompt, **{"max_new_tokens": 12, "num_samples": S, **kwargs})


def _same(a: Generation, b: Generation) -> bool:
    return torch.equal(a.token_ids, b.token_ids) and torch.equal(a.entropy, b.entropy)


# -- learning a periodic sequence --------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, expected",
    [("abcab", "cabcabcabc"), ("c", "abcabcabca"), ("bcabcabcabca", "bcabcabcab")],
)
def test_greedy_continues_a_periodic_sequence(abc, prompt, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown characters: no warning
        gen = generate(abc, prompt, max_new_tokens=10, num_samples=S)
    assert gen.text == expected
    assert gen.tokens == tuple(expected)
    assert gen.token_ids.tolist() == [ABC_VOCAB.index(c) for c in expected]
    assert gen.prompt == prompt and gen.unknown == 0
    assert gen.entropy.max() < 0.3  # confident: the sequence is deterministic


def test_perplexity_of_a_periodic_sequence_is_close_to_one(abc):
    held_out = _windows(_abc_ids(90), range(50, 80))  # later windows of the same text
    pred = abc.predict(held_out.x, num_samples=S, seed=1)
    ppl = metrics.perplexity(pred.mean, held_out.y)
    assert 1.0 <= ppl < 1.5
    uniform = torch.full_like(pred.mean, 1 / len(ABC_VOCAB))
    assert metrics.perplexity(uniform, held_out.y) == pytest.approx(len(ABC_VOCAB), rel=1e-5)


# -- strategies and seeds ----------------------------------------------------------------------


def test_greedy_is_deterministic_and_equals_sampling_with_top_k_one(flat):
    first, second = _gen(flat, seed=2), _gen(flat, seed=2)
    assert _same(first, second)
    assert _same(first, _gen(flat, strategy="sample", top_k=1, seed=2))
    probs = flat.predict(torch.tensor([[1, 2, 3, 4]]), num_samples=S, seed=2).probs
    assert first.token_ids[0] == probs[:, 0, -1].mean(0).argmax()


def test_sampling_is_reproducible_per_seed_and_differs_across_seeds(flat):
    a, b = _gen(flat, strategy="sample", seed=0), _gen(flat, strategy="sample", seed=0)
    assert _same(a, b) and a.text == b.text
    c = _gen(flat, strategy="sample", seed=1)
    assert a.entropy.mean() > 0.5 * math.log(len(FLAT_VOCAB))  # the model is flat-ish
    assert not torch.equal(a.token_ids, c.token_ids)
    greedy = _gen(flat, seed=0)
    assert not torch.equal(a.token_ids, greedy.token_ids)


def test_tiny_top_p_equals_greedy(flat):
    for seed in (0, 3):
        assert _same(_gen(flat, strategy="sample", top_p=1e-6, seed=seed), _gen(flat, seed=seed))


def test_top_p_one_and_large_top_k_change_nothing(flat):
    plain = _gen(flat, strategy="sample", seed=4)
    assert _same(plain, _gen(flat, strategy="sample", top_p=1.0, seed=4))
    assert _same(plain, _gen(flat, strategy="sample", top_k=len(FLAT_VOCAB), seed=4))


def test_bayes_average_false_is_reproducible(flat, abc):
    a = _gen(flat, strategy="sample", bayes_average=False, seed=5)
    b = _gen(flat, strategy="sample", bayes_average=False, seed=5)
    assert _same(a, b) and len(a) == 12
    assert a.token_ids.min() >= 0 and a.token_ids.max() < len(FLAT_VOCAB)
    # with one draw, following that draw is the model average
    one = _gen(flat, bayes_average=False, num_samples=1, seed=6)
    assert _same(one, _gen(flat, num_samples=1, seed=6))
    assert generate(abc, "ab", max_new_tokens=6, bayes_average=False, num_samples=S).text == (
        "cabcab"
    )


# -- per-token uncertainty ---------------------------------------------------------------------


def test_entropy_splits_into_aleatoric_and_epistemic_per_token(flat):
    gen = _gen(flat, strategy="sample", seed=7)
    K = len(gen)
    assert K == 12
    for value in (gen.entropy, gen.aleatoric, gen.epistemic):
        assert value.shape == (K,)
    torch.testing.assert_close(gen.entropy, gen.aleatoric + gen.epistemic, rtol=1e-5, atol=1e-6)
    assert torch.all(gen.epistemic >= 0)
    assert torch.all(gen.entropy <= math.log(len(FLAT_VOCAB)) + 1e-5)
    # the first step's numbers are those of the posterior predictive for the prompt
    probs = flat.predict(torch.tensor([[1, 2, 3, 4]]), num_samples=S, seed=7).probs[:, 0, -1]
    mean = probs.mean(0)
    entropy = -(mean * mean.log()).sum()
    aleatoric = -(probs * probs.log()).sum(-1).mean()
    torch.testing.assert_close(gen.entropy[0], entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gen.aleatoric[0], aleatoric, rtol=1e-5, atol=1e-6)


def test_generation_to_dataframe(flat):
    gen = _gen(flat, seed=0)
    frame = gen.to_dataframe()
    assert isinstance(frame, pd.DataFrame) and len(frame) == len(gen)
    assert list(frame.columns) == ["token_id", "token", "entropy", "aleatoric", "epistemic"]
    assert "".join(frame["token"]) == gen.text
    assert frame["token_id"].tolist() == gen.token_ids.tolist()


def test_integer_vocabulary_generates_ids_only():
    post = _fit(CausalLM(5, T, **SIZES), _random_lm_data(5), 1)
    gen = generate(post, [1, 2, 3], max_new_tokens=4, num_samples=4)
    assert gen.text is None and gen.tokens is None and gen.prompt is None
    assert gen.token_ids.dtype == torch.int64 and len(gen) == 4
    assert gen.to_dataframe()["token"].isna().all()
    assert _same(gen, generate(post, torch.tensor([1, 2, 3]), max_new_tokens=4, num_samples=4))
    with pytest.raises(TypeError, match="integer vocabulary"):
        generate(post, "abc", max_new_tokens=2)


# -- prompts -----------------------------------------------------------------------------------


def test_prompt_longer_than_max_len_is_cropped(flat):
    g = torch.Generator().manual_seed(1)
    long = torch.randint(0, len(FLAT_VOCAB), (T + 5,), generator=g).tolist()
    full = _gen(flat, long, strategy="sample", seed=8)
    cropped = _gen(flat, long[-T:], strategy="sample", seed=8)
    assert _same(full, cropped)
    text = "defghij" * 3
    assert _same(_gen(flat, text, seed=1), _gen(flat, text[-T:], seed=1))


def test_unknown_characters_warn_and_are_counted(abc):
    with pytest.warns(UserWarning, match="2 prompt character"):
        gen = generate(abc, "abzcy", max_new_tokens=3, num_samples=S)
    assert gen.unknown == 2 and gen.prompt == "abzcy"
    ids = torch.tensor([1, 2, 0, 3, 0])  # the same prompt with <unk> ids
    assert _same(gen, generate(abc, ids, max_new_tokens=3, num_samples=S))


def test_unknown_characters_without_an_unk_token_raise():
    post = _fit(CausalLM(list("xyz"), T, **SIZES), _random_lm_data(3), 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(post, "xyq", max_new_tokens=2)


def test_vocabulary_without_unk_counts_no_unknown_characters():
    post = _fit(CausalLM(list("xyz"), T, **SIZES), _random_lm_data(3), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen = generate(post, "xyzxy", max_new_tokens=2, num_samples=2)
    assert gen.unknown == 0


def test_unk_token_at_any_index_takes_unknown_characters():
    vocab = [*"xyz", "<unk>"]
    post = _fit(CausalLM(vocab, T, **SIZES), _random_lm_data(4), 1)
    with pytest.warns(UserWarning, match="1 prompt character"):
        gen = generate(post, "xyq", max_new_tokens=2, num_samples=2)
    assert gen.unknown == 1
    assert _same(gen, generate(post, [0, 1, 3], max_new_tokens=2, num_samples=2))


# -- argument checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(prompt=""), ValueError, "prompt"),
        (dict(prompt=[]), ValueError, "prompt"),
        (dict(prompt=[[1, 2], []]), ValueError, "prompt"),
        (dict(prompt=[1.0, 2.0]), TypeError, "must hold ints"),
        (dict(prompt=[1, len(FLAT_VOCAB)]), ValueError, "token ids"),
        (dict(prompt=[-1, 2]), ValueError, "token ids"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=2.5), ValueError, "top_k"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=math.inf), ValueError, "temperature"),
        (dict(strategy="beam"), ValueError, "strategy"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=2.0), TypeError, "max_new_tokens"),
        (dict(seed=-1), ValueError, "seed"),
    ],
)
def test_bad_arguments_raise(flat, kwargs, error, match):
    kwargs = {"prompt": "defg", "max_new_tokens": 2, **kwargs}
    with pytest.raises(error, match=match):
        generate(flat, kwargs.pop("prompt"), **kwargs)


def test_posterior_of_a_non_lm_model_raises_type_error():
    tagger = TokenTagger(None, 2, T, vocab_size=4, **SIZES)
    data = _random_lm_data(4)
    post = _fit(tagger, SequenceData(data.x, data.y % 2, None), 1)
    with pytest.raises(TypeError, match="CausalLM"):
        generate(post, [1, 2], max_new_tokens=2)
    with pytest.raises(TypeError, match="CausalLM"):
        generate(object(), [1, 2], max_new_tokens=2)


# -- the decoding filter -----------------------------------------------------------------------


def test_filter_temperature_top_k_and_top_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    torch.testing.assert_close(_filter(probs, 1.0, None, None), probs)
    hot = _filter(probs, 2.0, None, None)
    torch.testing.assert_close(hot, probs.sqrt() / probs.sqrt().sum())
    cold = _filter(probs, 0.5, None, None)
    torch.testing.assert_close(cold, probs**2 / (probs**2).sum())
    two = torch.tensor([0.625, 0.375, 0.0, 0.0])
    torch.testing.assert_close(_filter(probs, 1.0, 2, None), two)
    torch.testing.assert_close(_filter(probs, 1.0, None, 0.6), two)  # 0.5 < 0.6 <= 0.8
    torch.testing.assert_close(_filter(probs, 1.0, None, 0.8), two)  # the mass reaches 0.8
    torch.testing.assert_close(_filter(probs, 1.0, None, 0.5), torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(
        _filter(probs, 1.0, None, 0.9), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    )
    shuffled = probs[[2, 0, 3, 1]]  # order of the vocabulary does not matter
    torch.testing.assert_close(_filter(shuffled, 1.0, 2, 0.9), two[[2, 0, 3, 1]])
