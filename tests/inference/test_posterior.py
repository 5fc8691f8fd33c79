import math

import numpy as np
import pytest
import torch
from pyro.infer import Predictive

from probtransformer.inference import PosteriorAttention, Prediction

S = 12  # posterior draws per call: enough for every invariant checked here


@pytest.fixture(scope="module")
def x(digits) -> torch.Tensor:
    return digits.test.x[:20]


@pytest.fixture(scope="module")
def prediction(small_posterior, x) -> Prediction:
    return small_posterior.predict(x, num_samples=S, seed=0)


@pytest.fixture(scope="module")
def masked(digits):
    x = digits.test.x[:6]
    mask = torch.ones(6, 8, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, 2:] = False
    return x, mask


# -- draws ------------------------------------------------------------------------------------


def test_draws_have_chain_and_draw_dims(small_posterior):
    draws = small_posterior.draws(S, seed=0)
    assert set(draws) == set(small_posterior.latent_shapes)
    for name, shape in small_posterior.latent_shapes.items():
        assert draws[name].shape == (1, S, *shape)
    tau = draws["encoder.layers.0.attention.logit_scale"]
    assert torch.all(tau > 0)  # LogNormal support
    assert draws["head.weight"].std(1).min() > 0  # distinct draws


def test_draws_reject_bad_num_samples(small_posterior):
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="num_samples"):
            small_posterior.draws(bad)


def test_draws_that_are_not_from_draw_are_a_type_error(small_posterior, x):
    """A dict of latents (what ``draws`` returns) raised AttributeError on ``.latents``."""
    for bad in (small_posterior.draws(2), 5):
        with pytest.raises(TypeError, match="draws must come from Posterior.draw, got"):
            small_posterior.predict(x, draws=bad)


# -- vectorized vs sequential -------------------------------------------------------------------


def test_parallel_predictive_equals_sequential_and_predict(small_posterior, x):
    draws = {k: v.flatten(0, 1) for k, v in small_posterior.draws(S, seed=4).items()}
    model = small_posterior.model.eval()
    parallel = Predictive(model, posterior_samples=draws, parallel=True, return_sites=["logits"])
    sequential = Predictive(model, posterior_samples=draws, parallel=False, return_sites=["logits"])
    logits_par = parallel(x)["logits"]
    logits_seq = sequential(x)["logits"]
    assert logits_par.shape == (S, len(x), 10)
    torch.testing.assert_close(logits_par, logits_seq, rtol=1e-5, atol=1e-5)
    probs = small_posterior.predict(x, num_samples=S, seed=4).probs
    torch.testing.assert_close(logits_par.softmax(-1), probs, rtol=1e-5, atol=1e-6)


def test_row_batches_do_not_change_predictions(small_posterior, x):
    whole = small_posterior.predict(x, num_samples=S, seed=2).probs
    batched = small_posterior.predict(x, num_samples=S, seed=2, batch_size=7).probs
    torch.testing.assert_close(batched, whole, rtol=1e-5, atol=1e-6)


def test_numpy_inputs_give_the_same_prediction(small_posterior, x, prediction):
    from_numpy = small_posterior.predict(x.numpy().astype(np.float64), num_samples=S, seed=0)
    torch.testing.assert_close(from_numpy.probs, prediction.probs)


def test_log_likelihood_is_log_prob_of_the_observed_label(small_posterior, digits):
    data = digits.test[:15]
    ll = small_posterior.log_likelihood(data, num_samples=S, seed=3)
    assert ll.shape == (1, S, 15)
    probs = small_posterior.predict(data.x, num_samples=S, seed=3).probs  # (S, N, C)
    expected = probs.gather(-1, data.y.expand(S, 15)[..., None]).squeeze(-1).log()
    torch.testing.assert_close(ll[0], expected, rtol=1e-4, atol=1e-5)


def test_pointwise_replicates_are_labels(small_posterior, digits):
    log_lik, replicated = small_posterior.pointwise(digits.test[:15], num_samples=S, seed=3)
    assert log_lik.shape == (1, S, 15) and torch.all(log_lik <= 0)
    assert replicated.shape == (1, S, 15) and replicated.dtype == torch.int64
    assert replicated.min() >= 0 and replicated.max() < 10


# -- prediction invariants ------------------------------------------------------------------------


def test_prediction_shapes_and_probabilities(prediction, x):
    n = len(x)
    assert prediction.probs.shape == (S, n, 10)
    assert prediction.probs.device.type == "cpu"
    torch.testing.assert_close(prediction.probs.sum(-1), torch.ones(S, n))
    assert prediction.mean.shape == (n, 10)
    torch.testing.assert_close(prediction.mean.sum(-1), torch.ones(n))
    assert torch.equal(prediction.predicted, prediction.mean.argmax(-1))


def test_entropy_splits_into_aleatoric_and_epistemic(prediction):
    entropy, aleatoric, epistemic = prediction.entropy, prediction.aleatoric, prediction.epistemic
    assert entropy.shape == aleatoric.shape == epistemic.shape == (20,)
    torch.testing.assert_close(entropy, aleatoric + epistemic, rtol=1e-5, atol=1e-6)
    assert torch.all(epistemic >= 0)
    assert torch.all(entropy <= math.log(10) + 1e-5)
    assert epistemic.max() > 0


def test_entropy_decomposition_on_known_probabilities():
    # two draws, each certain of a different class: no aleatoric, log 2 epistemic
    probs = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # (S=2, N=1, C=2)
    pred = Prediction(probs=probs)
    torch.testing.assert_close(pred.entropy, torch.tensor([math.log(2)]))
    torch.testing.assert_close(pred.aleatoric, torch.tensor([0.0]))
    torch.testing.assert_close(pred.epistemic, torch.tensor([math.log(2)]))
    # identical draws: no epistemic part
    same = Prediction(probs=torch.tensor([[[0.3, 0.7]], [[0.3, 0.7]]]))
    torch.testing.assert_close(same.epistemic, torch.tensor([0.0]))


def test_credible_interval_brackets_the_mean(prediction):
    lower, upper = prediction.credible_interval(0.9)
    assert lower.shape == upper.shape == (20, 10)
    assert torch.all(lower <= upper)
    assert torch.all((lower >= 0) & (upper <= 1))
    with pytest.raises(ValueError, match="prob"):
        prediction.credible_interval(1.5)


def test_to_dataframe_columns(prediction):
    frame = prediction.to_dataframe()
    assert list(frame.columns) == [
        *(f"prob_{c}" for c in range(10)),
        "predicted",
        "entropy",
        "aleatoric",
        "epistemic",
    ]
    assert len(frame) == 20
    np.testing.assert_allclose(frame.filter(like="prob_").sum(axis=1), 1.0, rtol=1e-5)
    assert frame["predicted"].tolist() == [str(c) for c in prediction.predicted.tolist()]
    named = prediction.to_dataframe(class_names=list("abcdefghij"))
    assert "prob_a" in named.columns and set(named["predicted"]) <= set("abcdefghij")


# -- posterior attention --------------------------------------------------------------------------


def test_posterior_attention_shapes_and_summaries(small_posterior, masked):
    x, mask = masked
    att = small_posterior.attention(x, mask, num_samples=S, seed=0)
    assert isinstance(att, PosteriorAttention) and att.module == "encoder.self"
    assert att.samples.shape == (1, S, 6, 1, 2, 8, 8)
    sums = att.samples.sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums))
    assert torch.all(att.samples[:, :, 1, ..., 5:] == 0)
    assert torch.all(att.samples[:, :, 2, ..., 2:] == 0)
    mean, std = att.mean(), att.std()
    assert mean.shape == std.shape == (6, 1, 2, 8, 8)
    assert torch.all(std >= 0) and std.max() > 0
    lower, upper = att.hdi(0.9)
    assert lower.shape == upper.shape == (6, 1, 2, 8, 8)
    assert torch.all(lower <= upper)
    inside = (lower <= mean + 1e-6) & (mean <= upper + 1e-6)
    assert inside.float().mean() > 0.9
    with pytest.raises(ValueError, match="prob"):
        att.hdi(0.0)


def test_posterior_attention_plot(small_posterior, masked):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    att = small_posterior.attention(*masked, num_samples=4, seed=0)
    fig = att.plot(1)
    assert isinstance(fig, matplotlib.figure.Figure) and fig.axes
    plt.close(fig)
    with pytest.raises(IndexError, match="i"):
        att.plot(6)


def test_attention_rejects_unknown_module(small_posterior, x):
    with pytest.raises(ValueError, match="module"):
        small_posterior.attention(x[:2], module="decoder.cross", num_samples=2)


# -- seeds ------------------------------------------------------------------------------------


def test_same_seed_same_numbers_and_different_seeds_differ(small_posterior, masked):
    x, mask = masked
    post = small_posterior
    p0, p0_again, p1 = (post.predict(x, mask, num_samples=5, seed=s).probs for s in (0, 0, 1))
    assert torch.equal(p0, p0_again) and not torch.allclose(p0, p1)
    a0, a0_again, a1 = (post.attention(x, mask, num_samples=5, seed=s).samples for s in (0, 0, 1))
    assert torch.equal(a0, a0_again) and not torch.allclose(a0, a1)
    d0, d0_again, d1 = (post.draws(5, seed=s)["head.weight"] for s in (0, 0, 1))
    assert torch.equal(d0, d0_again) and not torch.allclose(d0, d1)


# -- input validation -------------------------------------------------------------------------


def _bad_input(x: torch.Tensor, case: str):
    n = len(x)
    if case == "rank":
        return x.flatten(1), None
    if case == "features":
        return x[..., :5], None
    if case == "nan":
        bad = x.clone()
        bad[0, 1, 1] = math.nan
        return bad, None
    if case == "inf":
        bad = x.clone()
        bad[0, 1, 1] = -math.inf
        return bad, None
    if case == "dtype":
        return x.long(), None
    if case == "type":
        return x.tolist(), None
    if case == "mask_shape":
        return x, torch.ones(n, 7, dtype=torch.bool)
    if case == "mask_dtype":
        return x, torch.ones(n, 8, dtype=torch.int64)
    if case == "empty":
        return x[:0], None
    if case == "too_long":
        return torch.cat([x, x[:, :2]], 1), None
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("rank", ValueError, ["x", "(N, T, F"]),
        ("features", ValueError, ["x", "F=8"]),
        ("nan", ValueError, ["x", "NaN"]),
        ("inf", ValueError, ["x", "inf"]),
        ("dtype", TypeError, ["x", "floating"]),
        ("type", TypeError, ["x"]),
        ("mask_shape", ValueError, ["mask", "(N, T)"]),
        ("mask_dtype", TypeError, ["mask", "bool"]),
        ("empty", ValueError, ["x", "at least one"]),
        ("too_long", ValueError, ["max_len", "T=10"]),
    ],
)
def test_malformed_inputs_are_rejected(small_posterior, x, case, error, words):
    bad_x, bad_mask = _bad_input(x[:4], case)
    for call in (small_posterior.predict, small_posterior.attention):
        with pytest.raises(error) as info:
            call(bad_x, bad_mask, num_samples=2)
        for word in words:
            assert word in str(info.value)


def test_float64_tensors_are_handled_like_float64_arrays(small_posterior, x, prediction):
    """numpy float64 input is converted to float32; a float64 tensor must not crash in matmul."""
    try:
        pred = small_posterior.predict(x.double(), num_samples=S, seed=0)
    except TypeError as e:  # an explicit dtype error naming x is acceptable too
        assert "x" in str(e) and "float" in str(e)
    else:
        torch.testing.assert_close(pred.probs, prediction.probs)


def test_bad_prediction_settings_name_the_argument(small_posterior, x):
    with pytest.raises(ValueError, match="num_samples"):
        small_posterior.predict(x, num_samples=0)
    with pytest.raises(TypeError, match="seed"):
        small_posterior.predict(x, seed="0")
    for bad in (0, -1):
        with pytest.raises(ValueError, match="batch_size"):
            small_posterior.predict(x, batch_size=bad)


# -- diagnostics --------------------------------------------------------------------------------


def test_diagnose_without_data_has_one_row_per_latent_site(small_posterior, capsys):
    table = small_posterior.diagnose(verbose=True)
    assert set(table.index) == set(small_posterior.latent_shapes)
    sizes = {name: math.prod(shape) for name, shape in small_posterior.latent_shapes.items()}
    assert table["size"].to_dict() == sizes
    assert list(table.columns) == ["size", "mean_sd", "r_hat_max", "ess_bulk_min", "ess_tail_min"]
    assert (table["mean_sd"] > 0).all()
    assert table["r_hat_max"].isna().all()  # one SVI chain: no R-hat
    verdict = table.attrs["verdict"]
    assert verdict[0].startswith("verdict (svi, 1 chain(s)")
    assert any(line.startswith("n/a   R-hat and ESS") for line in verdict)
    assert any("ELBO" in line for line in verdict)
    assert not any("LOO" in line for line in verdict)
    printed = capsys.readouterr().out
    assert "ELBO" in printed and "head.weight" not in printed  # the table is returned


def test_diagnose_with_data_adds_attention_and_loo(small_posterior, digits):
    table = small_posterior.diagnose(digits.train[:40], verbose=False)
    assert set(table.index) == set(small_posterior.latent_shapes) | {"attention"}
    assert table.loc["attention", "size"] == 2 * 1 * 2 * 8 * 8  # attention_obs=2
    loo = table.attrs["loo"]
    assert loo["n"] == 40 and math.isfinite(loo["elpd_loo"]) and loo["elpd_loo"] < 0
    assert any("LOO: elpd_loo" in line for line in table.attrs["verdict"])


# -- inputs that look valid but are not -------------------------------------------------------


def test_all_padding_sequences_are_rejected(small_posterior, x):
    mask = torch.ones(len(x), 8, dtype=torch.bool)
    mask[3] = False
    with pytest.raises(ValueError, match=r"mask marks every step of sequence\(s\) 3 as padding"):
        small_posterior.predict(x, mask)


def test_inputs_far_outside_the_training_range_warn(small_posterior, x):
    with pytest.warns(UserWarning, match=r"training features spanned \[0, 1\]"):
        small_posterior.predict(x * 16, num_samples=2)  # raw 0-16 pixels instead of [0, 1]


def test_non_finite_model_outputs_raise_a_clear_error(small_posterior, x):
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="outputs are not finite"):
        small_posterior.predict(x * 1e30, num_samples=2)


def test_export_and_diagnose_reject_tensors_for_data(small_posterior, digits):
    with pytest.raises(TypeError, match="data must be a probtransformer.datasets.SequenceData"):
        small_posterior.to_inference_data(digits.train.x)
    with pytest.raises(TypeError, match="test must be"):
        small_posterior.to_inference_data(digits.train[:8], test=digits)
    with pytest.raises(TypeError, match="data must be"):
        small_posterior.diagnose(digits.train.x)


def test_plot_index_must_be_an_int(small_posterior, masked):
    att = small_posterior.attention(*masked, num_samples=2)
    with pytest.raises(TypeError, match="i must be an int"):
        att.plot("a")
    with pytest.raises(TypeError, match="i must be an int"):
        att.plot(0.5)


def test_reprs_are_short(small_posterior, prediction, masked):
    att = small_posterior.attention(*masked, num_samples=2)
    assert repr(prediction).startswith(f"Prediction(draws={S}, n=") and len(repr(prediction)) < 150
    assert repr(att) == (
        "PosteriorAttention(module='encoder.self', chains=1, draws=2, n=6, layers=1, heads=2, "
        "query=8, key=8)"
    )
