"""TokenTagger and CausalLM: one categorical output per step, padding and causal masks, token
predictions, serialization, Bayesian token embeddings and the token-level metrics."""

import math

import numpy as np
import pandas as pd
import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive

from probtransformer import metrics
from probtransformer.datasets import SequenceData
from probtransformer.embedding import TokenEmbedding
from probtransformer.inference import Prediction, fit_svi, load_posterior
from probtransformer.models import CausalLM, SequenceClassifier, TokenTagger
from probtransformer.positional import sinusoid_table

V, T, C = 6, 8, 2  # tagger: vocabulary, steps, label classes
SIZES = dict(d_model=16, num_heads=2, num_layers=1, d_ff=16, dropout=0.0)
S = 10  # posterior draws per prediction
LM_VOCAB = ["<unk>", "a", "b", "c"]


def _tag_data(n: int, seed: int) -> SequenceData:
    """Token ids in [0, V), label = token > 2 at real steps (0 at padding), 3..T real steps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (n, T), generator=g)
    lengths = torch.randint(3, T + 1, (n,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    y = ((x > 2) & mask).long()
    return SequenceData(x, y, mask)


def _lm_data(n: int, seed: int, vocab_size: int = len(LM_VOCAB)) -> SequenceData:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, T + 1), generator=g)
    return SequenceData(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), None)


def _fit(model, data, num_steps: int, **kwargs):
    settings = dict(lr=3e-2, batch_size=len(data), seed=0, progress=False)
    return fit_svi(model, data, num_steps=num_steps, **{**settings, **kwargs})


def _changed_after(x: torch.Tensor, t: int, vocab_size: int) -> torch.Tensor:
    """``x`` with every token after step ``t`` replaced by a different token."""
    changed = x.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % vocab_size
    return changed


@pytest.fixture(scope="module")
def tag_train() -> SequenceData:
    return _tag_data(200, seed=0)


@pytest.fixture(scope="module")
def tag_test() -> SequenceData:
    return _tag_data(60, seed=1)


@pytest.fixture(scope="module")
def tagger(tag_train):
    """A TokenTagger fitted to the rule label = token > 2 (non-causal)."""
    model = TokenTagger(None, C, T, vocab_size=V, **SIZES)
    return _fit(model, tag_train, num_steps=50)


@pytest.fixture(scope="module")
def causal_tagger(tag_train):
    model = TokenTagger(None, C, T, vocab_size=V, causal=True, **SIZES)
    return _fit(model, tag_train, num_steps=5)


@pytest.fixture(scope="module")
def lm():
    """A barely fitted CausalLM with a string vocabulary."""
    return _fit(CausalLM(LM_VOCAB, T, **SIZES), _lm_data(32, seed=0), num_steps=5)


@pytest.fixture(scope="module")
def tag_prediction(tagger, tag_test) -> Prediction:
    return tagger.predict(tag_test.x, tag_test.mask, num_samples=S, seed=0)


# -- construction and validation ---------------------------------------------------------------


def test_tagger_trace_shapes_and_likelihood_event():
    model = TokenTagger(None, C, T, vocab_size=V, **SIZES)
    data = _tag_data(5, seed=3)
    tr = poutine.trace(model).get_trace(data.x, data.y, data.mask)
    fn = tr.nodes["y"]["fn"]
    assert fn.batch_shape == (5,) and fn.event_shape == (T,)  # one event per sequence
    assert tr.nodes["y"]["is_observed"]
    assert tr.nodes["head.weight"]["value"].shape == (C, 16)
    assert tr.nodes["head.weight"]["cond_indep_stack"] == ()  # a global latent
    tr = poutine.trace(model).get_trace(data.x)
    assert tr.nodes["logits"]["value"].shape == (5, T, C)
    assert tr.nodes["y"]["value"].shape == (5, T)
    assert list(model.attention_modules) == ["encoder.self"]
    assert model.config["causal"] is False and model.config["vocab_size"] == V


def test_tagger_with_features_input():
    model = TokenTagger(3, C, T, **SIZES)
    x = torch.randn(4, T, 3)
    logits = model(x)
    assert logits.shape == (4, T, C)
    rebuilt = TokenTagger.from_config(model.config)
    assert rebuilt.config == model.config


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((None, C, T), dict()),  # neither in_features nor vocab_size
        ((3, C, T), dict(vocab_size=V)),  # both
        ((None, 1, T), dict(vocab_size=V)),  # one class
        ((None, C, 0), dict(vocab_size=V)),
        ((None, C, T), dict(vocab_size=0)),
    ],
)
def test_tagger_rejects_bad_construction(args, kwargs):
    with pytest.raises(ValueError):
        TokenTagger(*args, **{**SIZES, **kwargs})


def test_tagger_validate_errors():
    model = TokenTagger(None, C, T, vocab_size=V, **SIZES)
    data = _tag_data(4, seed=2)
    model.validate(data.x, data.y, data.mask)  # fine
    with pytest.raises(ValueError, match="shape"):
        model.validate(data.x, data.y[:, 0])  # (N,) labels for a tagger
    with pytest.raises(TypeError, match="int64"):
        model.validate(data.x, data.y.float())
    with pytest.raises(ValueError, match="labels in"):
        model.validate(data.x, data.y + 2)
    with pytest.raises(TypeError, match="int64"):
        model.validate(data.x.float())
    with pytest.raises(ValueError, match="token ids in"):
        model.validate(data.x + V)
    with pytest.raises(ValueError, match="max_len"):
        model.validate(torch.zeros(2, T + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="padding"):
        model.validate(data.x, mask=torch.zeros(4, T, dtype=torch.bool))


# -- learning and predictions ------------------------------------------------------------------


def test_tagger_learns_a_token_rule(tag_prediction, tag_test):
    probs, y = metrics.token_level(tag_prediction.mean, tag_test.y, tag_test.mask)
    assert len(y) == int(tag_test.mask.sum())
    assert metrics.accuracy(probs, y) > 0.9


def test_token_prediction_shapes(tag_prediction, tag_test):
    n = len(tag_test)
    assert tag_prediction.probs.shape == (S, n, T, C)
    torch.testing.assert_close(tag_prediction.probs.sum(-1), torch.ones(S, n, T))
    assert tag_prediction.mean.shape == (n, T, C)
    assert tag_prediction.predicted.shape == (n, T)
    for value in (tag_prediction.entropy, tag_prediction.aleatoric, tag_prediction.epistemic):
        assert value.shape == (n, T)
    assert "steps=8" in repr(tag_prediction)


def test_token_entropy_splits_per_step(tag_prediction):
    p = tag_prediction
    torch.testing.assert_close(p.entropy, p.aleatoric + p.epistemic, rtol=1e-5, atol=1e-6)
    assert torch.all(p.epistemic >= 0)
    assert torch.all(p.entropy <= math.log(C) + 1e-5)
    assert p.epistemic.max() > 0  # the draws differ


def test_token_prediction_to_dataframe(tag_prediction, tag_test):
    n = len(tag_test)
    frame = tag_prediction.to_dataframe(class_names=["small", "large"])
    assert isinstance(frame, pd.DataFrame)
    assert len(frame) == n * T
    assert list(frame.columns[:2]) == ["sequence", "step"]
    assert {"prob_small", "prob_large", "predicted", "entropy", "epistemic"} <= set(frame.columns)
    np.testing.assert_array_equal(frame["sequence"], np.repeat(np.arange(n), T))
    np.testing.assert_array_equal(frame["step"], np.tile(np.arange(T), n))
    row = frame.iloc[3 * T + 5]  # sequence 3, step 5
    assert row["prob_large"] == pytest.approx(float(tag_prediction.mean[3, 5, 1]), abs=1e-6)
    assert row["entropy"] == pytest.approx(float(tag_prediction.entropy[3, 5]), abs=1e-6)
    expected = ["small", "large"][int(tag_prediction.predicted[3, 5])]
    assert row["predicted"] == expected


def test_token_prediction_reject_by_threshold_is_per_step(tag_prediction):
    keep = tag_prediction.reject(threshold=0.1)
    assert keep.shape == tag_prediction.entropy.shape
    assert torch.equal(keep, tag_prediction.entropy <= 0.1)


def test_token_prediction_reject_by_coverage_keeps_the_most_certain_steps(tag_prediction):
    entropy = tag_prediction.entropy
    keep = tag_prediction.reject(coverage=0.5)
    assert keep.shape == entropy.shape
    assert int(keep.sum()) == math.ceil(0.5 * entropy.numel())
    assert entropy[keep].max() <= entropy[~keep].min()


# -- padding -----------------------------------------------------------------------------------


def test_labels_at_padded_steps_do_not_change_the_log_likelihood(tagger, tag_test):
    data = tag_test[:20]
    flipped = data.y.clone()
    flipped[~data.mask] = 1 - flipped[~data.mask]
    assert (~data.mask).any()
    base = tagger.log_likelihood(data, num_samples=S, seed=2)
    same = tagger.log_likelihood(SequenceData(data.x, flipped, data.mask), num_samples=S, seed=2)
    assert base.shape == (1, S, 20)  # pointwise: one value per sequence
    torch.testing.assert_close(base, same)
    real = data.y.clone()
    real[0, 0] = 1 - real[0, 0]
    changed = tagger.log_likelihood(SequenceData(data.x, real, data.mask), num_samples=S, seed=2)
    assert not torch.allclose(changed[..., 0], base[..., 0])
    torch.testing.assert_close(changed[..., 1:], base[..., 1:])


def test_labels_at_padded_steps_do_not_change_the_trace_log_prob():
    model = TokenTagger(None, C, T, vocab_size=V, **SIZES)
    data = _tag_data(6, seed=4)
    draw = {
        name: site["value"]
        for name, site in poutine.trace(model).get_trace(data.x).nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and name not in ("data", "y")
    }
    fixed = poutine.condition(model, data=draw)
    flipped = data.y.clone()
    flipped[~data.mask] = 1 - flipped[~data.mask]
    base = poutine.trace(fixed).get_trace(data.x, data.y, data.mask).log_prob_sum()
    same = poutine.trace(fixed).get_trace(data.x, flipped, data.mask).log_prob_sum()
    torch.testing.assert_close(base, same)
    unmasked = poutine.trace(fixed).get_trace(data.x, flipped).log_prob_sum()
    assert not torch.allclose(base, unmasked)


def test_padded_steps_do_not_change_predictions_at_real_steps(tagger, tag_test):
    data = tag_test[:20]
    changed = data.x.clone()
    changed[~data.mask] = (changed[~data.mask] + 3) % V
    base = tagger.predict(data.x, data.mask, num_samples=S, seed=1).probs
    other = tagger.predict(changed, data.mask, num_samples=S, seed=1).probs
    real = data.mask[None].expand(S, -1, -1)
    torch.testing.assert_close(other[real], base[real], rtol=0, atol=1e-6)
    # without the mask the padded tokens are attended to and change the real steps
    unmasked = tagger.predict(data.x, num_samples=S, seed=1).probs
    unmasked_changed = tagger.predict(changed, num_samples=S, seed=1).probs
    assert not torch.allclose(unmasked_changed[real], unmasked[real], atol=1e-4)


# -- causal mask -------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [0, 3, T - 2])
def test_causal_tagger_ignores_later_tokens(causal_tagger, tag_test, t):
    x = tag_test.x[:12]
    base = causal_tagger.predict(x, num_samples=S, seed=3).probs
    other = causal_tagger.predict(_changed_after(x, t, V), num_samples=S, seed=3).probs
    assert torch.equal(base[:, :, : t + 1], other[:, :, : t + 1])
    assert not torch.allclose(base[:, :, t + 1 :], other[:, :, t + 1 :])


@pytest.mark.parametrize("t", [0, 4])
def test_causal_lm_ignores_later_tokens(lm, t):
    x = _lm_data(12, seed=5).x
    base = lm.predict(x, num_samples=S, seed=3).probs
    other = lm.predict(_changed_after(x, t, len(LM_VOCAB)), num_samples=S, seed=3).probs
    assert base.shape == (S, 12, T, len(LM_VOCAB))
    assert torch.equal(base[:, :, : t + 1], other[:, :, : t + 1])
    assert not torch.allclose(base[:, :, t + 1 :], other[:, :, t + 1 :])


def test_non_causal_tagger_sees_later_tokens(tagger, tag_test):
    x, t = tag_test.x[:12], 3
    base = tagger.predict(x, num_samples=S, seed=3).probs
    other = tagger.predict(_changed_after(x, t, V), num_samples=S, seed=3).probs
    assert not torch.allclose(base[:, :, : t + 1], other[:, :, : t + 1], atol=1e-5)


# -- CausalLM ----------------------------------------------------------------------------------


def test_causal_lm_vocab_as_list_or_int():
    listed = CausalLM(tuple(LM_VOCAB), T, **SIZES)
    assert listed.vocab == LM_VOCAB and listed.vocab_size == 4 and listed.num_classes == 4
    assert listed.config["vocab"] == LM_VOCAB
    assert list(listed.config)[0] == "vocab"
    assert not {"in_features", "num_classes", "vocab_size", "causal"} & set(listed.config)
    assert listed.encoder.causal
    sized = CausalLM(7, T, **SIZES)
    assert sized.vocab is None and sized.vocab_size == 7 and sized.config["vocab"] == 7
    for model in (listed, sized):
        rebuilt = CausalLM.from_config(model.config)
        assert rebuilt.config == model.config
        assert rebuilt.vocab == model.vocab and rebuilt.vocab_size == model.vocab_size


@pytest.mark.parametrize(
    "vocab, error",
    [
        (["a", "b", "a"], ValueError),
        (["a"], ValueError),
        ([], ValueError),
        (1, ValueError),
        (0, ValueError),
        ([1, 2, 3], TypeError),
        (["a", 2], TypeError),
        ("abc", TypeError),
        (2.0, TypeError),
        (None, TypeError),
        (True, TypeError),
    ],
)
def test_causal_lm_rejects_bad_vocab(vocab, error):
    with pytest.raises(error, match="vocab"):
        CausalLM(vocab, T, **SIZES)


def test_causal_lm_targets_must_be_token_labels():
    model = CausalLM(LM_VOCAB, T, **SIZES)
    data = _lm_data(3, seed=0)
    model.validate(data.x, data.y)
    with pytest.raises(ValueError, match="labels in"):
        model.validate(data.x, data.y + len(LM_VOCAB))
    with pytest.raises(ValueError, match="shape"):
        model.validate(data.x, data.y[:, :-1])


@pytest.mark.parametrize("vocab", [LM_VOCAB, 5])
def test_causal_lm_save_and_load_give_identical_predictions(vocab, tmp_path):
    size = vocab if isinstance(vocab, int) else len(vocab)
    post = _fit(CausalLM(vocab, T, **SIZES), _lm_data(16, seed=0, vocab_size=size), num_steps=3)
    post.save(tmp_path / "lm")
    loaded = load_posterior(tmp_path / "lm")
    assert isinstance(loaded.model, CausalLM)
    assert loaded.model.config == post.model.config
    assert loaded.model.vocab == post.model.vocab
    x = _lm_data(6, seed=7, vocab_size=size).x
    before = post.predict(x, num_samples=S, seed=4).probs
    after = loaded.predict(x, num_samples=S, seed=4).probs
    assert before.shape == (S, 6, T, size)
    assert torch.equal(before, after)


# -- vectorized vs sequential ------------------------------------------------------------------


def test_tagger_predict_equals_a_loop_over_draws(tagger, tag_test):
    x, mask = tag_test.x[:10], tag_test.mask[:10]
    draws = {k: v.flatten(0, 1) for k, v in tagger.draws(S, seed=4).items()}
    model = tagger.model.eval()
    kwargs = dict(posterior_samples=draws, return_sites=["logits"])
    parallel = Predictive(model, parallel=True, **kwargs)(x, mask=mask)["logits"]
    sequential = Predictive(model, parallel=False, **kwargs)(x, mask=mask)["logits"]
    assert parallel.shape == (S, 10, T, C)
    torch.testing.assert_close(parallel, sequential, rtol=1e-5, atol=1e-5)
    loop = torch.stack(
        [
            poutine.condition(model, data={k: v[s] for k, v in draws.items()})(x, mask=mask)
            for s in range(S)
        ]
    )
    torch.testing.assert_close(loop, parallel, rtol=1e-5, atol=1e-5)
    probs = tagger.predict(x, mask, num_samples=S, seed=4).probs
    torch.testing.assert_close(parallel.softmax(-1), probs, rtol=1e-5, atol=1e-6)


def test_causal_lm_predict_equals_a_loop_over_draws(lm):
    x = _lm_data(5, seed=9).x
    draws = {k: v.flatten(0, 1) for k, v in lm.draws(S, seed=6).items()}
    model = lm.model.eval()
    loop = torch.stack(
        [poutine.condition(model, data={k: v[s] for k, v in draws.items()})(x) for s in range(S)]
    )
    probs = lm.predict(x, num_samples=S, seed=6).probs
    torch.testing.assert_close(loop.softmax(-1), probs, rtol=1e-5, atol=1e-6)


def test_every_part_latent_parallel_matches_sequential():
    model = CausalLM(
        LM_VOCAB, T, bayesian=("embedding", "attention", "ffn", "norm", "head"), **SIZES
    )
    x = _lm_data(4, seed=3).x
    with torch.no_grad(), pyro.plate("draws", 5, dim=-2):
        tr = poutine.trace(model).get_trace(x)
    shapes = {
        name: site["value"].shape
        for name, site in poutine.trace(model).get_trace(x).nodes.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and name not in ("data", "y")
        and not site["infer"].get("_deterministic")
    }
    assert shapes["embedding.projection.weight"] == (len(LM_VOCAB), 16)
    draws = {name: tr.nodes[name]["value"].reshape(5, *shape) for name, shape in shapes.items()}
    kwargs = dict(posterior_samples=draws, return_sites=["logits"])
    parallel = Predictive(model, parallel=True, **kwargs)(x)["logits"]
    sequential = Predictive(model, parallel=False, **kwargs)(x)["logits"]
    assert parallel.shape == (5, 4, T, len(LM_VOCAB))
    torch.testing.assert_close(parallel, sequential, rtol=1e-5, atol=1e-5)
    assert parallel.std(0).min() > 0


# -- Bayesian token embedding ------------------------------------------------------------------


def test_token_embedding_latent_table_is_sampled():
    emb = TokenEmbedding(V, 8, T, bayesian=True)
    ids = torch.randint(0, V, (3, T))
    tr = poutine.trace(emb).get_trace(ids)
    table = tr.nodes["projection.weight"]["value"]
    assert table.shape == (V, 8)
    h, mask = poutine.condition(emb, data={"projection.weight": table})(ids)
    assert mask is None and h.shape == (1, 3, T, 8)
    torch.testing.assert_close(h[0], table[ids] + sinusoid_table(T, 8))
    first, _ = emb(ids)
    second, _ = emb(ids)
    assert not torch.allclose(first, second)  # a fresh table per call
    with pyro.plate("draws", 4, dim=-3):
        stacked, _ = emb(ids)
    assert stacked.shape == (4, 3, T, 8) and stacked.std(0).min() > 0


def test_token_embedding_point_estimate_is_a_parameter():
    emb = TokenEmbedding(V, 8, T)
    assert isinstance(emb.projection.weight, torch.nn.Parameter)
    ids = torch.randint(0, V, (2, T))
    torch.testing.assert_close(emb(ids)[0], emb(ids)[0])


def test_bayesian_embedding_predictions_vary_across_draws(tag_train, tag_test):
    model = TokenTagger(None, C, T, vocab_size=V, bayesian="embedding", **SIZES)
    post = _fit(model, tag_train, num_steps=5, init_scale=0.1)
    slopes = {f"encoder.layers.{i}.attention.alibi_slope" for i in range(SIZES["num_layers"])}
    assert set(post.latent_shapes) == {"embedding.projection.weight", *slopes}
    assert post.latent_shapes["embedding.projection.weight"] == (V, 16)
    pred = post.predict(tag_test.x[:10], tag_test.mask[:10], num_samples=S, seed=0)
    assert pred.probs.std(0).max() > 1e-3
    assert pred.epistemic.max() > 0


# -- SequenceClassifier over token ids ---------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_classifier_over_token_ids_ignores_padded_tokens(pooling):
    model = SequenceClassifier(
        None,
        3,
        T,
        vocab_size=V,
        pooling=pooling,
        bayesian=("embedding", "attention", "head"),
        **SIZES,
    )
    assert model.config["vocab_size"] == V and model.config["in_features"] is None
    assert SequenceClassifier.from_config(model.config).config == model.config
    data = _tag_data(5, seed=6)
    tr = poutine.trace(model).get_trace(data.x, mask=data.mask)
    assert tr.nodes["logits"]["value"].shape == (5, 3)
    assert tr.nodes["embedding.projection.weight"]["value"].shape == (V, 16)
    if pooling == "cls":
        assert tr.nodes["embedding.cls"]["value"].shape == (16,)
    draw = {
        name: site["value"]
        for name, site in tr.nodes.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and name not in ("data", "y")
        and not site["infer"].get("_deterministic")
    }
    fixed = poutine.condition(model, data=draw)
    changed = data.x.clone()
    changed[~data.mask] = (changed[~data.mask] + 1) % V
    torch.testing.assert_close(fixed(changed, mask=data.mask), fixed(data.x, mask=data.mask))
    assert not torch.allclose(fixed(changed), fixed(data.x))
    with pytest.raises(TypeError, match="int64"):
        model.validate(data.x.float())


# -- token-level metrics -----------------------------------------------------------------------


def test_token_level_keeps_real_steps_in_order():
    probs = torch.softmax(torch.randn(3, 4, 5), -1)
    y = torch.randint(0, 5, (3, 4))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    flat_probs, flat_y = metrics.token_level(probs, y, mask)
    assert flat_probs.shape == (7, 5) and flat_y.shape == (7,)
    np.testing.assert_allclose(flat_probs, probs[mask].numpy())
    np.testing.assert_array_equal(flat_y, y[mask].numpy())
    all_probs, all_y = metrics.token_level(probs, y)
    assert all_probs.shape == (12, 5) and all_y.shape == (12,)


def test_token_level_errors():
    probs = torch.softmax(torch.randn(2, 3, 4), -1)
    y = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError):
        metrics.token_level(probs, y[:, :2])
    with pytest.raises(ValueError):
        metrics.token_level(probs[0], y[0])
    with pytest.raises(TypeError, match="bool"):
        metrics.token_level(probs, y, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        metrics.token_level(probs, y, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="no real step"):
        metrics.token_level(probs, y, torch.zeros(2, 3, dtype=torch.bool))


def test_perplexity_values():
    y = torch.randint(0, 5, (3, 4))
    uniform = torch.full((3, 4, 5), 0.2)
    assert metrics.perplexity(uniform, y) == pytest.approx(5.0, rel=1e-5)
    sure = torch.nn.functional.one_hot(y, 5).float() * 0.99 + 0.01 / 5
    assert metrics.perplexity(sure, y) == pytest.approx(1 / (0.99 + 0.002), rel=1e-4)
    probs = torch.softmax(torch.randn(3, 4, 5), -1)
    mask = torch.rand(3, 4) > 0.3
    mask[0, 0] = True
    expected = math.exp(-probs.gather(-1, y[..., None])[..., 0][mask].log().mean().item())
    assert metrics.perplexity(probs, y, mask) == pytest.approx(expected, rel=1e-5)
    flat_probs, flat_y = metrics.token_level(probs, y, mask)
    assert metrics.perplexity(flat_probs, flat_y) == pytest.approx(expected, rel=1e-5)
