"""SequenceRegressor and Seq2Seq: recovery of a known target and noise, standardisation,
horizons, likelihoods, pooling with masks, cross-attention, MCMC and serialization."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive

from probtransformer.datasets import SequenceData
from probtransformer.inference import NUTS, RegressionPrediction, fit_mcmc, fit_svi, load_posterior
from probtransformer.models import Seq2Seq, SequenceRegressor

T, F, H = 4, 2, 3
SIZES = dict(d_model=16, num_heads=2, num_layers=1, d_ff=16, dropout=0.0)
TINY = dict(d_model=8, num_heads=2, num_layers=1, d_ff=8, dropout=0.0)
NOISE = 0.3
S = 10
ALL_PARTS = ("embedding", "attention", "ffn", "norm", "head")


def _linear(n: int, seed: int) -> SequenceData:
    """y = 2 * mean(x) + 1 + N(0, 0.3^2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, T, F, generator=g)
    y = 2 * x.mean((1, 2)) + 1 + NOISE * torch.randn(n, generator=g)
    return SequenceData(x, y, None)


def _series(n: int, seed: int, past: int = 6, horizon: int = H) -> SequenceData:
    """Noisy sine waves with random phase: ``past`` steps in, the next ``horizon`` values out."""
    g = torch.Generator().manual_seed(seed)
    phase = torch.rand(n, 1, generator=g) * 2 * math.pi
    t = torch.arange(past + horizon, dtype=torch.float32)
    values = torch.sin(0.7 * t + phase) + 0.05 * torch.randn(n, past + horizon, generator=g)
    return SequenceData(values[:, :past, None].contiguous(), values[:, past:].contiguous(), None)


def _fit(model, data, num_steps, **kwargs):
    settings = dict(lr=3e-2, batch_size=len(data), seed=0, progress=False)
    return fit_svi(model, data, num_steps=num_steps, **{**settings, **kwargs})


def _base(fn):
    """The distribution inside ``.to_event`` (a no-op for scalar events)."""
    return getattr(fn, "base_dist", fn)


def _prior_draw(model, *args) -> dict[str, torch.Tensor]:
    tr = poutine.trace(model).get_trace(*args)
    return {
        name: site["value"]
        for name, site in tr.nodes.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and name not in ("data", "y")
        and not site["infer"].get("_deterministic")
    }


def _prior_draws(model, num: int, *args) -> dict[str, torch.Tensor]:
    shapes = {k: v.shape for k, v in _prior_draw(model, *args).items()}
    with torch.no_grad(), pyro.plate("draws", num, dim=-2):
        tr = poutine.trace(model).get_trace(*args)
    return {name: tr.nodes[name]["value"].reshape(num, *shape) for name, shape in shapes.items()}


# -- recovery of a known linear target ---------------------------------------------------------


@pytest.fixture(scope="module")
def linear_train() -> SequenceData:
    return _linear(300, seed=0)


@pytest.fixture(scope="module")
def linear_fit(linear_train):
    return _fit(SequenceRegressor(F, T, **SIZES), linear_train, 200)


@pytest.fixture(scope="module")
def fresh() -> SequenceData:
    return _linear(400, seed=1)


@pytest.fixture(scope="module")
def fresh_prediction(linear_fit, fresh) -> RegressionPrediction:
    return linear_fit.predict(fresh.x, num_samples=100, seed=0)


def test_predictive_mean_recovers_the_target(fresh_prediction, fresh):
    truth = 2 * fresh.x.mean((1, 2)) + 1
    rmse = (fresh_prediction.mean - truth).pow(2).mean().sqrt()
    assert rmse < 0.2  # the target itself has sd 0.7
    assert torch.corrcoef(torch.stack([fresh_prediction.mean, truth]))[0, 1] > 0.95


def test_posterior_noise_sd_is_close_to_the_truth(linear_fit):
    draws = linear_fit.draws(200, seed=0)["noise_scale"]
    assert draws.shape == (1, 200)
    y_scale = linear_fit.model.y_scale
    noise_sd = (y_scale * draws).mean()
    assert abs(noise_sd - NOISE) < 0.3 * NOISE


def test_predictive_intervals_cover_fresh_data(fresh_prediction, fresh):
    lower, upper = fresh_prediction.predictive_interval(0.9)
    assert lower.shape == upper.shape == (400,)
    coverage = ((fresh.y >= lower) & (fresh.y <= upper)).float().mean()
    assert 0.8 <= coverage <= 0.98
    # the credible interval of the regression function is narrower than the predictive one
    c_lower, c_upper = fresh_prediction.credible_interval(0.9)
    assert ((c_upper - c_lower) < (upper - lower)).all()


def test_regression_prediction_shapes_and_variance_split(fresh_prediction):
    p = fresh_prediction
    assert p.samples.shape == p.loc.shape == p.variance.shape == (100, 400)
    assert p.mean.shape == p.std.shape == (400,)
    torch.testing.assert_close(p.std**2, p.aleatoric + p.epistemic, rtol=1e-5, atol=1e-6)
    assert (p.epistemic >= 0).all() and (p.aleatoric > 0).all()
    frame = p.to_dataframe()
    assert len(frame) == 400 and {"mean", "std", "lower", "upper"} <= set(frame.columns)


def test_multi_horizon_export_names_the_horizon_dim(linear_train):
    data = SequenceData(linear_train.x[:30], linear_train.y[:30, None].expand(-1, H) + 0, None)
    post = _fit(SequenceRegressor(F, T, horizon=H, **SIZES), data, 2)
    idata = post.to_inference_data(data, num_samples=4, attention_obs=1)
    assert idata.posterior["noise_scale"].dims == ("chain", "draw", "horizon")
    assert idata.log_likelihood["y"].shape == (1, 4, 30)


@pytest.mark.filterwarnings("ignore:In variable noise_scale:UserWarning")
def test_single_output_export_and_diagnose(linear_fit, linear_train):
    data = linear_train[:30]
    idata = linear_fit.to_inference_data(data, num_samples=4, attention_obs=1)
    assert idata.posterior["noise_scale"].dims == ("chain", "draw")
    table = linear_fit.diagnose(data, num_samples=4, verbose=False)
    assert "noise_scale" in table.index


# -- standardisation ---------------------------------------------------------------------------


def test_target_standardisation_gives_predictions_in_data_units(linear_train, fresh):
    data = linear_train[:100]
    scaled = SequenceData(data.x, data.y * 1000 + 5000, None)
    small = _fit(SequenceRegressor(F, T, **SIZES), data, 25)
    big = _fit(SequenceRegressor(F, T, y_loc=5000, y_scale=1000, **SIZES), scaled, 25)
    torch.testing.assert_close(
        big.draws(S, seed=1)["noise_scale"],
        small.draws(S, seed=1)["noise_scale"],
        rtol=1e-3,
        atol=1e-4,
    )
    x = fresh.x[:20]
    p_small = small.predict(x, num_samples=S, seed=2)
    p_big = big.predict(x, num_samples=S, seed=2)
    assert p_big.mean.abs().min() > 1000  # data units
    torch.testing.assert_close((p_big.loc - 5000) / 1000, p_small.loc, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close((p_big.samples - 5000) / 1000, p_small.samples, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(p_big.std / 1000, p_small.std, rtol=1e-3, atol=1e-4)


def test_standardisation_of_inputs_and_targets_is_exact_for_fixed_weights():
    plain = SequenceRegressor(F, T, **SIZES)
    scaled = SequenceRegressor(
        F, T, x_loc=[3.0, -1.0], x_scale=[10.0, 0.5], y_loc=5000, y_scale=1000, **SIZES
    )
    scaled.load_state_dict(plain.state_dict())
    x = torch.randn(5, T, F)
    draw = _prior_draw(plain, x)
    loc_plain = poutine.condition(plain, data=draw)(x)
    x_data = x * torch.tensor([10.0, 0.5]) + torch.tensor([3.0, -1.0])
    tr = poutine.trace(poutine.condition(scaled, data=draw)).get_trace(x_data)
    torch.testing.assert_close(tr.nodes["_RETURN"]["value"], 5000 + 1000 * loc_plain)
    scale = _base(tr.nodes["y"]["fn"]).scale
    torch.testing.assert_close(scale, 1000 * draw["noise_scale"].expand(5))
    assert scaled.config["x_loc"] == [3.0, -1.0] and scaled.config["y_scale"] == [1000.0]
    assert SequenceRegressor.from_config(scaled.config).config == scaled.config


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(x_loc=[0.0, 0.0, 0.0]),
        dict(x_scale=0.0),
        dict(y_scale=-1.0),
        dict(y_loc=math.nan),
        dict(horizon=H, y_loc=[1.0, 2.0]),
        dict(pooling="max"),
        dict(likelihood="laplace"),
        dict(horizon=0),
    ],
)
def test_regressor_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        SequenceRegressor(F, T, **{**SIZES, **kwargs})


# -- horizons and likelihoods ------------------------------------------------------------------


@pytest.mark.parametrize("horizon, shape", [(None, (5,)), (H, (5, H))])
def test_horizon_sets_the_target_shape(horizon, shape):
    model = SequenceRegressor(F, T, horizon=horizon, **SIZES)
    x = torch.randn(5, T, F)
    tr = poutine.trace(model).get_trace(x)
    assert tr.nodes["y"]["value"].shape == shape
    assert tr.nodes["loc"]["value"].shape == shape
    assert tr.nodes["noise_scale"]["value"].shape == shape[1:]
    assert tr.nodes["y"]["fn"].batch_shape == (5,)  # one event per sequence
    model.validate(x, torch.zeros(shape))
    wrong = (5, H) if horizon is None else (5,)
    with pytest.raises(ValueError, match="shape"):
        model.validate(x, torch.zeros(wrong))


def test_multi_horizon_prediction_shapes():
    data = _series(40, seed=0, past=T)
    data = SequenceData(data.x.expand(-1, -1, F).contiguous(), data.y, None)
    post = _fit(SequenceRegressor(F, T, horizon=H, pooling="last", **SIZES), data, 3)
    pred = post.predict(data.x[:7], num_samples=S, seed=0)
    assert pred.samples.shape == pred.loc.shape == pred.variance.shape == (S, 7, H)
    assert pred.mean.shape == pred.std.shape == (7, H)
    lower, upper = pred.predictive_interval(0.8)
    assert lower.shape == (7, H) and (lower <= upper).all()
    frame = pred.to_dataframe()
    assert len(frame) == 7 and {"mean[0]", "mean[2]", "upper[1]"} <= set(frame.columns)


@pytest.mark.parametrize(
    "likelihood, df, factor",
    [("normal", 4.0, 1.0), ("student_t", 4.0, 2.0), ("student_t", 7.0, 1.4)],
)
def test_likelihood_variance(linear_train, likelihood, df, factor):
    model = SequenceRegressor(F, T, likelihood=likelihood, df=df, y_scale=2.0, **SIZES)
    post = _fit(model, linear_train[:60], 3)
    fn = poutine.trace(model).get_trace(linear_train.x[:3]).nodes["y"]["fn"]
    fn = _base(fn)
    assert isinstance(fn, dist.StudentT if likelihood == "student_t" else dist.Normal)
    if likelihood == "student_t":
        assert torch.all(fn.df == df) and model.config["df"] == df
    pred = post.predict(linear_train.x[:5], num_samples=S, seed=3)
    noise = post.draws(S, seed=3)["noise_scale"].reshape(S, 1)
    expected = (2.0 * noise) ** 2 * factor  # Var = scale^2 df / (df - 2) for Student-t
    torch.testing.assert_close(pred.variance, expected.expand(S, 5), rtol=1e-4, atol=1e-6)
    assert torch.isfinite(pred.samples).all()


@pytest.mark.parametrize("df", [2.0, 1.5, 0.0, -3.0, math.inf, math.nan, "4"])
def test_student_t_needs_df_above_two(df):
    with pytest.raises(ValueError, match="df"):
        SequenceRegressor(F, T, likelihood="student_t", df=df, **SIZES)


# -- pooling with masks ------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_padded_steps_do_not_change_predictions(pooling):
    model = SequenceRegressor(F, T, pooling=pooling, bayesian=ALL_PARTS, **SIZES)
    x = torch.randn(4, T, F)
    lengths = torch.tensor([4, 3, 1, 2])
    mask = torch.arange(T) < lengths[:, None]
    fixed = poutine.condition(model, data=_prior_draw(model, x))
    base = fixed(x, mask=mask)
    changed = x.clone()
    changed[~mask] = 50.0
    torch.testing.assert_close(fixed(changed, mask=mask), base)
    # each sequence predicts as if it were only its real steps
    for i, length in enumerate(lengths.tolist()):
        alone = fixed(x[i : i + 1, :length])
        torch.testing.assert_close(alone, base[i : i + 1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fixed(changed), fixed(x))  # unmasked, the changes count


def test_last_pooling_reads_the_last_real_step():
    model = SequenceRegressor(F, T, pooling="last", **SIZES)
    x = torch.randn(2, T, F)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    fixed = poutine.condition(model, data=_prior_draw(model, x))
    base = fixed(x, mask=mask)
    earlier = x.clone()
    earlier[0, 1] += 1.0  # the last real step of sequence 0
    assert not torch.allclose(fixed(earlier, mask=mask)[0], base[0])
    torch.testing.assert_close(fixed(earlier, mask=mask)[1], base[1])


# -- validation --------------------------------------------------------------------------------


def test_regressor_validate_errors(linear_train):
    model = SequenceRegressor(F, T, **SIZES)
    x, y = linear_train.x[:6], linear_train.y[:6]
    model.validate(x, y)
    bad = y.clone()
    bad[2] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        model.validate(x, bad)
    with pytest.raises(ValueError, match="NaN"):
        fit_svi(model, SequenceData(x, bad, None), num_steps=1, progress=False)
    with pytest.raises(ValueError, match="shape"):
        model.validate(x, y[:, None])
    with pytest.raises(ValueError, match="shape"):
        model.validate(x, y[:5])
    with pytest.raises(TypeError, match="float"):
        model.validate(x, y.round().long())
    with pytest.raises(ValueError, match="F=2"):
        model.validate(torch.randn(6, T, 3), y)
    inf_x = x.clone()
    inf_x[0, 0, 0] = math.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        model.validate(inf_x)


# -- Seq2Seq -----------------------------------------------------------------------------------

PAST = 6


@pytest.fixture(scope="module")
def series() -> SequenceData:
    return _series(48, seed=0, past=PAST)


@pytest.fixture(scope="module")
def seq2seq(series):
    return _fit(Seq2Seq(1, PAST, H, **SIZES), series, 20)


def test_seq2seq_attention_modules_and_config():
    model = Seq2Seq(1, PAST, H, num_decoder_layers=2, **SIZES)
    modules = model.attention_modules
    assert list(modules) == ["encoder.self", "decoder.self", "decoder.cross"]
    assert [len(v) for v in modules.values()] == [1, 2, 2]
    assert modules["decoder.cross"][0] is model.decoder.layers[0].cross_attention
    assert model.config["num_decoder_layers"] == 2 and model.config["horizon"] == H
    assert Seq2Seq.from_config(model.config).config == model.config
    tr = poutine.trace(model).get_trace(torch.randn(5, PAST, 1))
    assert tr.nodes["loc"]["value"].shape == (5, H)
    assert "decoder.layers.1.cross_attention.projection" in tr.nodes
    with pytest.raises(ValueError, match="shape"):
        model.validate(torch.randn(5, PAST, 1), torch.zeros(5))


def test_seq2seq_cross_attention_is_horizon_by_past(seq2seq, series):
    x = series.x[:5]
    att = seq2seq.attention(x, module="decoder.cross", num_samples=S, seed=0)
    assert att.module == "decoder.cross"
    assert att.samples.shape == (1, S, 5, 1, 2, H, PAST)  # (chain, draw, n, layer, head, q, k)
    torch.testing.assert_close(att.samples.sum(-1), torch.ones(1, S, 5, 1, 2, H))
    assert att.mean().shape == (5, 1, 2, H, PAST)
    decoder_self = seq2seq.attention(x, module="decoder.self", num_samples=S, seed=0)
    assert decoder_self.samples.shape[-2:] == (H, H)
    encoder_self = seq2seq.attention(x, num_samples=S, seed=0)
    assert encoder_self.module == "encoder.self"
    assert encoder_self.samples.shape[-2:] == (PAST, PAST)
    with pytest.raises(ValueError, match="module"):
        seq2seq.attention(x, module="decoder.bogus")


def test_seq2seq_cross_attention_skips_padded_keys(seq2seq, series):
    x = series.x[:4]
    mask = torch.ones(4, PAST, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 1:] = False
    att = seq2seq.attention(x, mask, module="decoder.cross", num_samples=S, seed=0).samples
    keys = mask[None, None, :, None, None, None, :].expand_as(att)
    assert torch.all(att[~keys] == 0)
    torch.testing.assert_close(att.sum(-1), torch.ones(att.shape[:-1]))
    pred = seq2seq.predict(x, mask, num_samples=S, seed=0)
    changed = x.clone()
    changed[~mask] = -changed[~mask]  # different values, inside the training range
    torch.testing.assert_close(seq2seq.predict(changed, mask, num_samples=S, seed=0).loc, pred.loc)


def test_seq2seq_predictions(seq2seq, series):
    pred = seq2seq.predict(series.x[:8], num_samples=S, seed=0)
    assert isinstance(pred, RegressionPrediction)
    assert pred.samples.shape == pred.loc.shape == (S, 8, H)
    assert torch.isfinite(pred.samples).all()
    assert pred.loc.std(0).max() > 0  # the draws differ


def test_seq2seq_save_and_load_round_trip(seq2seq, series, tmp_path):
    seq2seq.save(tmp_path / "s2s")
    loaded = load_posterior(tmp_path / "s2s")
    assert isinstance(loaded.model, Seq2Seq)
    assert loaded.model.config == seq2seq.model.config
    x = series.x[:6]
    before = seq2seq.predict(x, num_samples=S, seed=5)
    after = loaded.predict(x, num_samples=S, seed=5)
    assert torch.equal(before.loc, after.loc) and torch.equal(before.samples, after.samples)
    cross_before = seq2seq.attention(x[:2], module="decoder.cross", num_samples=4, seed=1)
    cross_after = loaded.attention(x[:2], module="decoder.cross", num_samples=4, seed=1)
    assert torch.equal(cross_before.samples, cross_after.samples)


def test_seq2seq_mcmc_runs_and_predicts(series):
    model = Seq2Seq(1, PAST, H, **TINY)
    with pytest.warns(UserWarning, match="num_warmup"):
        post = fit_mcmc(
            model,
            series[:16],
            kernel=NUTS(max_tree_depth=3),
            num_chains=1,
            num_warmup=4,
            num_samples=4,
            map_steps=5,
            seed=0,
            progress=False,
        )
    assert post.samples["noise_scale"].shape == (1, 4, H)
    pred = post.predict(series.x[:5], num_samples=None)
    assert pred.loc.shape == (4, 5, H) and torch.isfinite(pred.samples).all()
    att = post.attention(series.x[:2], module="decoder.cross", num_samples=None)
    assert att.samples.shape == (1, 4, 2, 1, 2, H, PAST)


# -- vectorized vs sequential ------------------------------------------------------------------


def test_regressor_predict_equals_a_loop_over_draws(linear_fit, fresh):
    x = fresh.x[:9]
    draws = {k: v.flatten(0, 1) for k, v in linear_fit.draws(S, seed=4).items()}
    model = linear_fit.model.eval()
    kwargs = dict(posterior_samples=draws, return_sites=["loc"])
    parallel = Predictive(model, parallel=True, **kwargs)(x)["loc"]
    sequential = Predictive(model, parallel=False, **kwargs)(x)["loc"]
    assert parallel.shape == (S, 9)
    torch.testing.assert_close(parallel, sequential, rtol=1e-5, atol=1e-5)
    loop = torch.stack(
        [poutine.condition(model, data={k: v[s] for k, v in draws.items()})(x) for s in range(S)]
    )
    torch.testing.assert_close(loop, parallel, rtol=1e-5, atol=1e-5)
    pred = linear_fit.predict(x, num_samples=S, seed=4)
    torch.testing.assert_close(pred.loc, parallel, rtol=1e-5, atol=1e-5)
    scale = model.y_scale * draws["noise_scale"]
    torch.testing.assert_close(pred.variance, (scale**2)[:, None].expand(S, 9))


def test_seq2seq_predict_equals_a_loop_over_draws(seq2seq, series):
    x = series.x[:5]
    mask = torch.ones(5, PAST, dtype=torch.bool)
    mask[0, 3:] = False
    draws = {k: v.flatten(0, 1) for k, v in seq2seq.draws(S, seed=2).items()}
    model = seq2seq.model.eval()
    loop = torch.stack(
        [
            poutine.condition(model, data={k: v[s] for k, v in draws.items()})(x, mask=mask)
            for s in range(S)
        ]
    )
    pred = seq2seq.predict(x, mask, num_samples=S, seed=2)
    torch.testing.assert_close(pred.loc, loop, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_cls", [SequenceRegressor, Seq2Seq])
def test_every_part_latent_parallel_matches_sequential(model_cls):
    model = (
        model_cls(1, PAST, H, bayesian=ALL_PARTS, **TINY)
        if model_cls is Seq2Seq
        else (model_cls(1, PAST, horizon=H, bayesian=ALL_PARTS, **TINY))
    )
    x = torch.randn(4, PAST, 1)
    mask = torch.ones(4, PAST, dtype=torch.bool)
    mask[1, 2:] = False
    draws = _prior_draws(model, 5, x, None, mask)
    kwargs = dict(posterior_samples=draws, return_sites=["loc"])
    parallel = Predictive(model, parallel=True, **kwargs)(x, mask=mask)["loc"]
    sequential = Predictive(model, parallel=False, **kwargs)(x, mask=mask)["loc"]
    assert parallel.shape == (5, 4, H)
    torch.testing.assert_close(parallel, sequential, rtol=1e-5, atol=1e-5)
    assert parallel.std(0).min() > 0
