"""The LSTM counterparts of ``benchmarks/_lstm.py``: the model protocol, masking, a short fit."""

import pytest
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample

from benchmarks._lstm import LSTMLM, LSTMClassifier, LSTMTagger
from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_svi

N, T, F, V, C = 5, 7, 3, 11, 4
SIZES = dict(d_model=8, hidden_size=6, num_layers=2)


def _mask() -> torch.Tensor:
    lengths = torch.tensor([7, 5, 3, 1, 6])
    return torch.arange(T) < lengths[:, None]


def _models():
    torch.manual_seed(0)
    return {
        "classifier": LSTMClassifier(F, C, T, **SIZES),
        "tagger": LSTMTagger(None, C, T, vocab_size=V, **SIZES),
        "lm": LSTMLM(V, T, **SIZES),
    }


def _inputs(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    if kind == "classifier":
        return torch.randn(N, T, F), torch.randint(0, C, (N,))
    labels = V if kind == "lm" else C
    return torch.randint(0, V, (N, T)), torch.randint(0, labels, (N, T))


@pytest.mark.parametrize("kind", ["classifier", "tagger", "lm"])
def test_protocol_shapes_and_observed_site_in_the_data_plate(kind):
    model = _models()[kind]
    x, y = _inputs(kind)
    trace = poutine.trace(model).get_trace(x, y, _mask(), num_data=50)
    site = trace.nodes[model.likelihood_site]
    assert site["is_observed"]
    assert [f.name for f in site["cond_indep_stack"]] == ["data"]
    assert site["fn"].batch_shape == (N,)
    classes = V if kind == "lm" else C
    logits = trace.nodes["_RETURN"]["value"]
    assert logits.shape == ((N, classes) if kind == "classifier" else (N, T, classes))
    assert isinstance(model.config, dict) and type(model)(**model.config).config == model.config
    # the latent head is the only sample site besides the observation
    latent = {
        name
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)
    }
    assert latent == {"head.weight", "head.bias"}


@pytest.mark.parametrize("kind", ["classifier", "tagger"])
def test_padded_steps_change_nothing_at_real_steps(kind):
    """Bidirectional: the values at padded steps must not reach real ones in either direction."""
    model = _models()[kind]
    x, y = _inputs(kind)
    mask = _mask()
    other = x.clone()
    if kind == "classifier":
        other[~mask] = 100.0
    else:
        other[~mask] = V - 1 - other[~mask]
    with poutine.trace() as tr:
        model(x, mask=mask)
    weights = tr.trace.nodes["head.weight"]["value"], tr.trace.nodes["head.bias"]["value"]
    data = {"head.weight": weights[0], "head.bias": weights[1]}
    a = poutine.condition(model, data)(x, mask=mask)
    b = poutine.condition(model, data)(other, mask=mask)
    if kind == "tagger":
        a, b = a[mask], b[mask]
    torch.testing.assert_close(a, b)


def test_left_padding_is_refused():
    model = _models()["tagger"]
    x, y = _inputs("tagger")
    with pytest.raises(ValueError, match="right padding"):
        model.validate(x, y, _mask().flip(1))


@pytest.mark.parametrize("kind", ["classifier", "tagger", "lm"])
def test_short_fit_and_vectorized_prediction(kind):
    model = _models()[kind]
    x, y = _inputs(kind)
    mask = None if kind == "lm" else _mask()
    post = fit_svi(model, SequenceData(x, y, mask), num_steps=20, lr=1e-2, progress=False)
    assert len(post.record["elbo"]) == 20
    pred = post.predict(x, mask, num_samples=6, seed=0)
    classes = V if kind == "lm" else C
    shape = (6, N, classes) if kind == "classifier" else (6, N, T, classes)
    assert pred.probs.shape == shape
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(shape[:-1]))
    assert pred.probs.std(0).max() > 0  # the draws of the latent head differ
    # the vectorized draws agree with one draw and one row per pass (memory_budget=1)
    one = post.predict(x, mask, num_samples=6, seed=0, memory_budget=1)
    torch.testing.assert_close(one.probs, pred.probs)
