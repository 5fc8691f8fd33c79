"""Property-based checks (hypothesis) over shapes and masks for the task families beyond the
classifier: ``TokenTagger`` (token ids), ``CausalLM``, ``SequenceRegressor`` with a horizon
(mean and last-step pooling) and ``Seq2Seq``.

Whatever the batch (1-4 sequences of 1..MAX_LEN steps, any padding that leaves each sequence a
real step), predictions are finite; token models give one distribution per step; regression
models a finite, positive predictive spread; every attention row of every module kind
(``encoder.self``, ``decoder.self``, ``decoder.cross``) sums to 1 over the keys it may see, or is
all zero when it may see none; and what sits at padded steps does not change the predictions
at real steps. The models are tiny and barely fitted: these properties hold for any weights.
"""

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from probtransformer.datasets import SequenceData
from probtransformer.inference import Prediction, RegressionPrediction, fit_svi
from probtransformer.models import CausalLM, Seq2Seq, SequenceRegressor, TokenTagger

MAX_LEN, V, C, F, H = 6, 7, 3, 2, 3  # steps, vocabulary, tag classes, features, horizon
SIZES = dict(d_model=8, num_heads=2, num_layers=1, d_ff=8, dropout=0.0)
FIT = dict(num_steps=3, batch_size=16, lr=1e-2, seed=0, progress=False)
S = 3  # posterior draws per call

TOKEN_FAMILIES = ("tagger", "lm")
REGRESSION_FAMILIES = ("regressor_mean", "regressor_last", "seq2seq")
FAMILIES = TOKEN_FAMILIES + REGRESSION_FAMILIES

# features drawn at 5x (and padding overwritten at 10x) the training scale on purpose
pytestmark = pytest.mark.filterwarnings("ignore:x spans .* but the training features spanned")

PROPERTY = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # conftest's autouse pyro_state
)


def _train(tokens: bool, targets: str, n: int = 16) -> SequenceData:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (n, MAX_LEN), generator=g) if tokens else torch.randn(n, MAX_LEN, F)
    lengths = torch.randint(2, MAX_LEN + 1, (n,), generator=g)
    mask = torch.arange(MAX_LEN) < lengths[:, None]
    if targets == "tags":
        y = torch.randint(0, C, (n, MAX_LEN), generator=g)
    elif targets == "next":
        y, mask = torch.randint(0, V, (n, MAX_LEN), generator=g), None
    else:
        y = torch.randn(n, H, generator=g)
    return SequenceData(x, y, mask)


@pytest.fixture(scope="module")
def posteriors() -> dict:
    """Tiny fits of each family (a few SVI steps: the properties hold for any weights)."""
    specs = {
        "tagger": (TokenTagger(None, C, MAX_LEN, vocab_size=V, **SIZES), _train(True, "tags")),
        "lm": (CausalLM(V, MAX_LEN, **SIZES), _train(True, "next")),
        "regressor_mean": (
            SequenceRegressor(F, MAX_LEN, horizon=H, pooling="mean", **SIZES),
            _train(False, "values"),
        ),
        "regressor_last": (
            SequenceRegressor(F, MAX_LEN, horizon=H, pooling="last", **SIZES),
            _train(False, "values"),
        ),
        "seq2seq": (Seq2Seq(F, MAX_LEN, H, num_decoder_layers=1, **SIZES), _train(False, "values")),
    }
    return {name: fit_svi(model, data, **FIT) for name, (model, data) in specs.items()}


@st.composite
def batches(draw, *, tokens: bool, padded: bool = False):
    """``(x, mask, seed)``: ``x`` (n, t) token ids or (n, t, F) features; ``mask`` (n, t) with at
    least one real step per sequence, or None (never None with ``padded``)."""
    n = draw(st.integers(1, 4))
    t = draw(st.integers(1, MAX_LEN))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if tokens:
        x = torch.randint(0, V, (n, t), generator=g)
    else:
        x = torch.randn(n, t, F, generator=g) * draw(st.sampled_from([0.1, 1.0, 5.0]))
    if not padded and draw(st.booleans()):
        return x, None, seed
    rows = draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=n, max_size=n))
    mask = torch.tensor(rows, dtype=torch.bool).reshape(n, t)
    mask[~mask.any(1), draw(st.integers(0, t - 1))] = True  # every sequence keeps a real step
    return x, mask, seed


def _perturbed_padding(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` with every padded step replaced by other values (other token ids, other features)."""
    g = torch.Generator().manual_seed(seed + 1)
    out = x.clone()
    if x.is_floating_point():
        out[~mask] = torch.randn(out[~mask].shape, generator=g) * 10
    else:
        out[~mask] = (out[~mask] + torch.randint(1, V, out[~mask].shape, generator=g)) % V
    return out


def _is_causal(posterior) -> bool:
    return posterior.model.encoder.causal


def _visible(kind: str, mask: torch.Tensor | None, n: int, tq: int, tk: int, causal: bool):
    """``(n, tq, tk)`` bool: the keys each query of ``kind`` may attend to."""
    if kind == "decoder.self":  # the H forecast queries see each other, no mask
        return torch.ones(n, tq, tk, dtype=torch.bool)
    keys = torch.ones(n, tk, dtype=torch.bool) if mask is None else mask
    visible = keys[:, None, :].expand(n, tq, tk)
    if causal and kind == "encoder.self":
        visible = visible & torch.ones(tq, tk, dtype=torch.bool).tril()
    return visible


# -- token models: a distribution per step ---------------------------------------------------


@pytest.mark.parametrize("family", TOKEN_FAMILIES)
@PROPERTY
@given(batch=batches(tokens=True))
def test_token_predictions_are_distributions_at_every_step(posteriors, family, batch):
    x, mask, seed = batch
    pred = posteriors[family].predict(x, mask, num_samples=S, seed=seed)
    classes = C if family == "tagger" else V
    assert isinstance(pred, Prediction)
    assert pred.probs.shape == (S, *x.shape, classes)
    assert torch.isfinite(pred.probs).all() and (pred.probs >= 0).all()
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(S, *x.shape))
    assert pred.entropy.shape == x.shape and torch.isfinite(pred.entropy).all()
    assert (pred.epistemic >= 0).all() and torch.isfinite(pred.aleatoric).all()


# -- regression models: a finite, positive spread --------------------------------------------


@pytest.mark.parametrize("family", REGRESSION_FAMILIES)
@PROPERTY
@given(batch=batches(tokens=False))
def test_regression_predictions_have_finite_positive_spread(posteriors, family, batch):
    x, mask, seed = batch
    pred = posteriors[family].predict(x, mask, num_samples=S, seed=seed)
    assert isinstance(pred, RegressionPrediction)
    for name in ("samples", "loc", "variance"):
        value = getattr(pred, name)
        assert value.shape == (S, len(x), H), name
        assert torch.isfinite(value).all(), name
    assert (pred.variance > 0).all()
    assert torch.isfinite(pred.std).all() and (pred.std > 0).all()
    lower, upper = pred.predictive_interval(0.8)
    assert (lower <= upper).all()


# -- attention: rows are distributions over the keys a query may see --------------------------


@pytest.mark.parametrize(
    ("family", "kind"),
    [
        ("tagger", "encoder.self"),
        ("lm", "encoder.self"),
        ("regressor_mean", "encoder.self"),
        ("regressor_last", "encoder.self"),
        ("seq2seq", "encoder.self"),
        ("seq2seq", "decoder.self"),
        ("seq2seq", "decoder.cross"),
    ],
)
@PROPERTY
@given(data=st.data())
def test_attention_rows_sum_to_one_over_visible_keys_or_are_zero(posteriors, family, kind, data):
    posterior = posteriors[family]
    x, mask, seed = data.draw(batches(tokens=family in TOKEN_FAMILIES))
    att = posterior.attention(x, mask, module=kind, num_samples=S, seed=seed)
    w = att.samples  # (chain, draw, n, layer, head, query, key)
    n, t = x.shape[:2]
    tq, tk = {"encoder.self": (t, t), "decoder.self": (H, H), "decoder.cross": (H, t)}[kind]
    assert w.shape[2] == n and w.shape[-2:] == (tq, tk)
    assert torch.isfinite(w).all() and (w >= 0).all()
    visible = _visible(kind, mask, n, tq, tk, _is_causal(posterior))  # (n, tq, tk)
    visible = visible[None, None, :, None, None].expand_as(w)
    assert (w.masked_select(~visible) == 0).all(), "weight on a key the query may not see"
    sums = w.sum(-1)
    expected = visible.any(-1).to(sums.dtype)  # 1 with a visible key, 0 (all zero) without
    torch.testing.assert_close(sums, expected)


def test_a_causal_query_with_only_padded_keys_gets_all_zero_weights(posteriors):
    """The all-zero branch above, made certain: the first step is padding, so under the causal
    mask the first query may see no key at all."""
    x = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[False, True, True, True]])
    w = posteriors["lm"].attention(x, mask, num_samples=S).samples
    assert (w[..., 0, :] == 0).all()
    torch.testing.assert_close(w[..., 1:, :].sum(-1), torch.ones_like(w[..., 1:, 0]))


# -- padding: what sits at padded steps does not reach the real steps ------------------------


@pytest.mark.parametrize("family", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_padded_steps_do_not_change_predictions_at_real_steps(posteriors, family, data):
    posterior = posteriors[family]
    x, mask, seed = data.draw(batches(tokens=family in TOKEN_FAMILIES, padded=True))
    assume(not mask.all())  # some padding to overwrite
    changed = _perturbed_padding(x, mask, seed)
    first = posterior.predict(x, mask, num_samples=S, seed=seed)
    second = posterior.predict(changed, mask, num_samples=S, seed=seed)
    if family in TOKEN_FAMILIES:  # per-step outputs: compare the real steps only
        real = mask[None].expand(S, *mask.shape)
        torch.testing.assert_close(first.probs[real], second.probs[real])
    else:  # one forecast per sequence, from its real steps only
        for name in ("samples", "loc", "variance"):
            torch.testing.assert_close(getattr(first, name), getattr(second, name))
