"""Head gates: HeadGatePrior, posterior head importance, effective number of heads, pruning."""

import math

import pandas as pd
import pytest
import torch
from pyro import poutine

from probtransformer import priors
from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_svi, load_posterior
from probtransformer.models import SequenceClassifier

T, F, LAYERS, HEADS = 5, 2, 2, 4
TINY = dict(d_model=8, num_heads=HEADS, num_layers=LAYERS, d_ff=8)
FIT = dict(num_steps=100, batch_size=50, lr=1e-2, seed=0, progress=False)


@pytest.fixture(scope="module")
def data() -> SequenceData:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, T, F, generator=g)
    return SequenceData(x, (x[..., 0].sum(-1) > 0).long())


@pytest.fixture(scope="module")
def gated(data):
    model = SequenceClassifier(F, 2, T, **TINY, head_prior=priors.HeadGatePrior())
    return fit_svi(model, data[:150], **FIT)


@pytest.fixture(scope="module")
def new(data) -> torch.Tensor:
    return data.x[150:]


def _active(post) -> list[torch.Tensor]:
    return [m.head_active.clone() for m in post.model.attention_modules["encoder.self"]]


# -- HeadGatePrior -------------------------------------------------------------------------------


def test_gate_formula_by_hand():
    tau = torch.tensor(2.0)
    lam = torch.tensor([0.5, 1.0, 0.0, 3.0])
    # r = (tau * lam)^2 = [1, 4, 0, 36]; gate = r / (1 + r)
    expected = torch.tensor([0.5, 0.8, 0.0, 36 / 37])
    torch.testing.assert_close(priors.HeadGatePrior.gate(tau, lam), expected)
    # batched: tau (S,), lam (S, H)
    taus = torch.tensor([1.0, 0.1])
    lams = torch.tensor([[1.0, 2.0], [10.0, 1.0]])
    expected = torch.tensor([[0.5, 0.8], [0.5, 0.01 / 1.01]])
    torch.testing.assert_close(priors.HeadGatePrior.gate(taus, lams), expected)


def test_gate_with_unit_global_scale_is_arcsine_distributed():
    """tau = 1, lam ~ HalfCauchy(1): 1 - kappa ~ Beta(1/2, 1/2), CDF (2/pi) asin(sqrt(g))."""
    spec = priors.HeadGatePrior()
    torch.manual_seed(0)
    lam = spec.local_distribution(20_000, device=torch.device("cpu")).sample()
    gate = priors.HeadGatePrior.gate(torch.tensor(1.0), lam)
    assert gate.shape == (20_000,)
    assert ((gate >= 0) & (gate <= 1)).all()
    for g in (0.05, 0.25, 0.5, 0.75, 0.95):
        expected = 2 / math.pi * math.asin(math.sqrt(g))
        assert float((gate <= g).float().mean()) == pytest.approx(expected, abs=0.015)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_head_gate_prior_needs_a_positive_global_scale(scale):
    with pytest.raises(ValueError, match="global_scale"):
        priors.HeadGatePrior(global_scale=scale)


def test_head_gate_prior_global_scale_type():
    with pytest.raises(TypeError, match="global_scale"):
        priors.HeadGatePrior(global_scale="1")
    with pytest.raises(TypeError, match="head_prior"):
        SequenceClassifier(F, 2, T, **TINY, head_prior=priors.Normal())


def test_head_prior_config_round_trip():
    model = SequenceClassifier(F, 2, T, **TINY, head_prior=priors.HeadGatePrior(0.3))
    assert model.config["head_prior"] == {"type": "HeadGatePrior", "global_scale": 0.3}
    assert SequenceClassifier.from_config(model.config).config == model.config


# -- head importance -----------------------------------------------------------------------------


def test_head_importance_needs_head_gates(data):
    post = fit_svi(SequenceClassifier(F, 2, T, **TINY), data[:20], **{**FIT, "num_steps": 2})
    for call in (
        post.head_importance,
        post.effective_num_heads,
        lambda: post.prune_heads(0.5),
    ):
        with pytest.raises(ValueError, match="head_prior"):
            call()


def test_head_importance_table(gated):
    table = gated.head_importance()
    assert isinstance(table, pd.DataFrame)
    assert list(table.columns) == ["module", "layer", "head", "mean", "lower", "upper", "active"]
    assert len(table) == LAYERS * HEADS
    assert (table["module"] == "encoder.self").all()
    assert table["layer"].tolist() == [layer for layer in range(LAYERS) for _ in range(HEADS)]
    assert table["head"].tolist() == list(range(HEADS)) * LAYERS
    assert table["active"].all()
    for col in ("mean", "lower", "upper"):
        assert table[col].between(0, 1).all()
    assert (table["lower"] <= table["mean"]).all() and (table["mean"] <= table["upper"]).all()
    assert (table["lower"] < table["upper"]).all()  # a posterior, not a point
    # same seed, same table; a wider interval with a larger prob
    pd.testing.assert_frame_equal(table, gated.head_importance())
    wide = gated.head_importance(prob=0.99)
    assert (wide["lower"] <= table["lower"] + 1e-12).all()
    assert (wide["upper"] >= table["upper"] - 1e-12).all()
    with pytest.raises(ValueError, match="prob"):
        gated.head_importance(prob=1.0)


def test_head_importance_is_the_posterior_mean_of_the_gate(gated):
    table = gated.head_importance(num_samples=50, seed=3)
    draws = gated.draws(50, seed=3)
    for layer in range(LAYERS):
        name = f"encoder.layers.{layer}.attention"
        tau = draws[f"{name}.head_global_scale"][0]  # (S,)
        lam = draws[f"{name}.head_local_scale"][0]  # (S, H)
        mean = priors.HeadGatePrior.gate(tau, lam).double().mean(0)
        rows = table[table["layer"] == layer]
        torch.testing.assert_close(torch.tensor(rows["mean"].to_numpy()), mean)


def test_effective_num_heads_is_the_sum_of_active_means(gated):
    table = gated.head_importance()
    assert gated.effective_num_heads() == pytest.approx(table["mean"].sum())
    assert 0 < gated.effective_num_heads() <= LAYERS * HEADS
    pruned = gated.prune_heads(1.0)
    pruned_table = pruned.head_importance()
    kept = pruned_table[pruned_table["active"]]
    assert len(kept) == LAYERS
    assert pruned.effective_num_heads() == pytest.approx(kept["mean"].sum())
    assert pruned.effective_num_heads() < gated.effective_num_heads()


# -- pruning -------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [-0.1, 1.1, float("nan"), float("inf")])
def test_prune_threshold_outside_the_unit_interval(gated, threshold):
    with pytest.raises(ValueError, match="threshold"):
        gated.prune_heads(threshold)


@pytest.mark.parametrize("threshold", [True, "0.5", None])
def test_prune_threshold_of_the_wrong_type(gated, threshold):
    with pytest.raises(TypeError, match="threshold"):
        gated.prune_heads(threshold)


def test_prune_nothing(gated, new):
    pruned = gated.prune_heads(0)
    assert pruned.record["pruned_heads"] == []
    assert all(a.all() for a in _active(pruned))
    a = gated.predict(new, num_samples=10, seed=1).probs
    b = pruned.predict(new, num_samples=10, seed=1).probs
    assert torch.equal(a, b)


def test_prune_all_but_the_most_important_head(gated, new):
    before = gated.predict(new, num_samples=10, seed=1).probs
    table = gated.head_importance()
    pruned = gated.prune_heads(1.0)
    for layer, active in enumerate(_active(pruned)):
        assert int(active.sum()) == 1
        best = int(table[table["layer"] == layer]["mean"].to_numpy().argmax())
        assert bool(active[best])
    removed = pruned.record["pruned_heads"]
    assert len(removed) == LAYERS * (HEADS - 1)
    assert all(kind == "encoder.self" for kind, _, _ in removed)
    assert pruned.record["prune_threshold"] == 1.0
    probs = pruned.predict(new, num_samples=10, seed=1).probs
    assert probs.shape == before.shape and torch.isfinite(probs).all()
    att = pruned.attention(new[:4], num_samples=3, seed=1).samples
    assert att.shape == (1, 3, 4, LAYERS, HEADS, T, T)  # heads keep their original index
    for layer, keep in enumerate(_active(pruned)):
        rows = att[:, :, :, layer].sum(-1)  # (chain, draw, n, head, query)
        torch.testing.assert_close(rows[..., keep, :], torch.ones_like(rows[..., keep, :]))
        assert (att[:, :, :, layer, ~keep] == 0).all()  # pruned heads: all zero
    # the original posterior is untouched
    assert all(a.all() for a in _active(gated))
    assert pruned.model is not gated.model
    assert "pruned_heads" not in gated.record
    assert torch.equal(gated.predict(new, num_samples=10, seed=1).probs, before)


def test_prune_at_an_intermediate_threshold(gated):
    table = gated.head_importance()
    threshold = float(table["mean"].median())
    pruned = gated.prune_heads(threshold)
    expected = []
    for layer in range(LAYERS):
        means = table[table["layer"] == layer]["mean"].to_numpy().copy()
        keep = means >= threshold
        keep[means.argmax()] = True
        assert _active(pruned)[layer].tolist() == keep.tolist()
        expected += [["encoder.self", layer, h] for h in range(HEADS) if not keep[h]]
    assert pruned.record["pruned_heads"] == expected


def test_a_pruned_head_is_a_head_whose_gate_is_zero(gated, data):
    """Skipping a head's computation equals running every head with that head's gate at 0."""
    pruned = gated.prune_heads(1.0)
    draw = {k: v[0, 0] for k, v in gated.draws(1, seed=2).items()}
    zeroed = dict(draw)
    for layer, active in enumerate(_active(pruned)):
        name = f"encoder.layers.{layer}.attention.head_local_scale"
        zeroed[name] = torch.where(active, draw[name], torch.tensor(1e-30))
    x = data.x[150:160]
    with torch.no_grad():
        out_pruned = poutine.condition(pruned.model, data=draw)(x)
        out_zeroed = poutine.condition(gated.model, data=zeroed)(x)
        out_full = poutine.condition(gated.model, data=draw)(x)
    torch.testing.assert_close(out_pruned, out_zeroed, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out_pruned, out_full, rtol=1e-4, atol=1e-5)


def test_pruning_again_keeps_a_head_in_every_layer(gated):
    """When a layer's most important head is already off (an earlier prune, or the user's own
    ``head_active``), pruning keeps the most important head still active, never none."""
    table = gated.head_importance()
    first = gated.prune_heads(0.0)
    for layer, module in enumerate(first.model.attention_modules["encoder.self"]):
        best = int(table[table["layer"] == layer]["mean"].to_numpy().argmax())
        module.head_active[best] = False
    again = first.prune_heads(1.0)
    for layer, active in enumerate(_active(again)):
        assert int(active.sum()) == 1, active
        means = table[table["layer"] == layer]["mean"].to_numpy().copy()
        means[means.argmax()] = -1.0
        assert bool(active[int(means.argmax())])


def test_save_and_load_a_pruned_posterior(gated, new, tmp_path):
    pruned = gated.prune_heads(1.0)
    pruned.save(tmp_path / "pruned")
    loaded = load_posterior(tmp_path / "pruned")
    for a, b in zip(_active(loaded), _active(pruned), strict=True):
        assert torch.equal(a, b)
    assert loaded.record["pruned_heads"] == pruned.record["pruned_heads"]
    a = pruned.predict(new, num_samples=10, seed=5).probs
    b = loaded.predict(new, num_samples=10, seed=5).probs
    assert torch.equal(a, b)
    assert loaded.effective_num_heads() == pytest.approx(pruned.effective_num_heads())


def test_layers_pruned_to_different_head_counts_still_export_attention(gated, new):
    table = gated.head_importance()
    # prune exactly one head in layer 0 and none in layer 1
    weakest = table[table["layer"] == 0].sort_values("mean").iloc[0]
    threshold = float(weakest["mean"]) + 1e-9
    pruned = gated.prune_heads(threshold)
    counts = [int(a.sum()) for a in _active(pruned)]
    assert len(set(counts)) > 1, counts  # layers keep different numbers of heads
    att = pruned.attention(new[:2], num_samples=2, seed=0)
    assert att.samples.shape[4] == HEADS
    assert (att.samples[:, :, :, 0, int(weakest["head"])] == 0).all()
