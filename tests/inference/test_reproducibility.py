"""Same seed, same numbers; different seeds, different numbers: for every fit method, and for
predict, attention and generate. No fit reads or writes Pyro's global param store."""

import pyro
import pytest
import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference import NUTS, fit_ensemble, fit_map, fit_mc_dropout, fit_mcmc, fit_svi
from probtransformer.models import CausalLM, SequenceClassifier, generate

TINY = dict(d_model=8, num_heads=2, num_layers=1, d_ff=8)
FITS = {
    "svi": (fit_svi, dict(num_steps=5, progress=False)),
    "map": (fit_map, dict(num_steps=5, progress=False)),
    "mc-dropout": (fit_mc_dropout, dict(num_steps=5, progress=False)),
    "ensemble": (fit_ensemble, dict(n_members=2, num_steps=5, progress=False)),
    "mcmc": (
        fit_mcmc,
        dict(
            kernel=NUTS(max_tree_depth=3),
            num_chains=1,
            num_warmup=3,
            num_samples=3,
            map_steps=5,
            progress=False,
        ),
    ),
}


@pytest.fixture(scope="module")
def rows(digits):
    return digits.train[:24]


def _predict(posterior, x, seed):
    return posterior.predict(x, num_samples=4, seed=seed).probs


@pytest.mark.parametrize("method", FITS)
def test_every_fit_is_seeded_and_leaves_the_global_store_alone(rows, method):
    fit, options = FITS[method]
    sentinel = torch.tensor([1.0, 2.0])
    pyro.param("user.sentinel", sentinel.clone())
    a, b, c = (
        fit(SequenceClassifier(8, 10, 8, **TINY), rows, seed=s, **options) for s in (3, 3, 4)
    )
    x = rows.x[:5]
    assert torch.equal(_predict(a, x, 0), _predict(b, x, 0))
    assert not torch.equal(_predict(a, x, 0), _predict(c, x, 0))
    assert set(pyro.get_param_store().keys()) == {"user.sentinel"}
    assert torch.equal(pyro.param("user.sentinel").detach(), sentinel)


def test_a_global_param_with_a_model_site_name_does_not_leak_into_the_fit(rows):
    clean = fit_svi(SequenceClassifier(8, 10, 8, **TINY), rows, seed=3, num_steps=5, progress=False)
    pyro.param("AutoNormal.locs.head.weight", torch.full((10, 8), 99.0))
    pyro.param("head.bias", torch.full((10,), 99.0))
    dirty = fit_svi(SequenceClassifier(8, 10, 8, **TINY), rows, seed=3, num_steps=5, progress=False)
    assert clean.record["elbo"] == dirty.record["elbo"]


def test_attention_and_generate_are_seeded(small_posterior, digits):
    x = digits.test.x[:3]
    a, b, c = (small_posterior.attention(x, num_samples=5, seed=s).samples for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    vocab = ["<unk>", "a", "b", "c"]
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2], [2, 3, 1, 2, 3, 1, 2, 3]])
    lm = fit_svi(
        CausalLM(vocab, 8, **TINY),
        SequenceData(ids[:, :-1], ids[:, 1:]),
        num_steps=5,
        progress=False,
    )
    runs = [
        generate(lm, "ab", max_new_tokens=12, strategy="sample", num_samples=4, seed=s)
        for s in (5, 5, 6)
    ]
    assert runs[0].text == runs[1].text
    assert torch.equal(runs[0].entropy, runs[1].entropy)
    assert runs[0].text != runs[2].text  # an almost untrained model: sampling is near uniform
