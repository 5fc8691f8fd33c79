"""``fit_laplace``/``fit_mola`` against known answers: the conjugate linear regression's analytic
posterior and evidence, a GGN built from ``torch.func`` references, MoLA of one member."""

import pyro
import pytest
import torch

import probtransformer.inference.laplace.curvature as curvature
from probtransformer.data import SequenceData
from probtransformer.inference import Posterior, fit_ensemble, fit_laplace, fit_map, fit_mola
from probtransformer.inference.inputs import example_of
from probtransformer.inference.laplace.blocks import KronBlock
from probtransformer.inference.laplace.curvature import Subset, ggn
from probtransformer.inference.laplace.evidence import GRADIENT_TOLERANCE
from probtransformer.inference.posterior.linearized import with_output
from probtransformer.models import BayesianLinearRegression, SequenceClassifier

FIT = dict(num_steps=60, batch_size=48, lr=1e-2, progress=False)
TRAIN_ROWS = 48


def small_model(dropout: float = 0.0) -> SequenceClassifier:
    return SequenceClassifier(
        8, 10, 8, d_model=8, num_heads=2, num_layers=1, d_ff=16, dropout=dropout
    )


@pytest.fixture(scope="module")
def train(digits):
    return digits.train[:TRAIN_ROWS]


@pytest.fixture(scope="module")
def mapped(train):
    return fit_map(small_model(), train, seed=0, **FIT)


# -- Bayesian linear regression: exact -----------------------------------------------------------


def regression(n: int = 40, p: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, p, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3 + 0.7 * torch.randn(n, generator=g)
    model = BayesianLinearRegression(p, prior_scale=1.5, noise_scale=0.7)
    return model, SequenceData(x, y)


def at_mode(model, data, mean: torch.Tensor) -> Posterior:
    """A MAP posterior whose point is ``mean`` (weight then bias): the analytic mode."""
    samples = {"weight": mean[:-1].float()[None, None], "bias": mean[-1].float()[None, None]}
    return Posterior(model, samples=samples, record={"method": "map"}, example=example_of(data))


def test_laplace_of_the_linear_regression_is_its_analytic_posterior_and_evidence():
    model, data = regression()
    exact = model.analytic_posterior(data.x, data.y)
    post = fit_laplace(
        model, data, ensemble=at_mode(model, data, exact.mean), subset="all",
        prior_precision="prior", num_samples=20_000, predictive="nn",
    )  # fmt: skip
    theta = torch.cat([post.samples["weight"][0], post.samples["bias"][0, :, None]], -1).double()
    assert torch.allclose(theta.mean(0), exact.mean, atol=0.01)
    assert torch.allclose(theta.T.cov(), exact.covariance_matrix, atol=2e-3, rtol=0.05)
    # the evidence: y ~ N(0, s^2 I + a^2 X X^T) in closed form (Bishop 2006, eq. 3.86)
    X = model.design(data.x.double())
    marginal = torch.distributions.MultivariateNormal(
        torch.zeros(len(X), dtype=torch.float64),
        covariance_matrix=0.7**2 * torch.eye(len(X), dtype=torch.float64) + 1.5**2 * X @ X.T,
    )
    summary = post.record["laplace"][0]
    # the model runs in float32: the log-likelihood carries its rounding
    assert summary["log_evidence"] == pytest.approx(
        float(marginal.log_prob(data.y.double())), abs=1e-4
    )
    assert summary["prior_scale"] == pytest.approx({"weight": 1.5, "bias": 1.5})


def test_the_gaussian_itself_matches_the_analytic_covariance_exactly():
    model, data = regression()
    exact = model.analytic_posterior(data.x, data.y)
    flat = Subset({"weight": torch.Size([3]), "bias": torch.Size([])})
    mode = {"weight": exact.mean[:3].float(), "bias": exact.mean[3].float()}
    found = ggn(model, flat, mode, data.x, data.y, None, structure="full")
    (block,) = found.blocks
    precision = block.ggn + torch.eye(4, dtype=torch.float64) / 1.5**2
    assert torch.allclose(torch.linalg.inv(precision), exact.covariance_matrix, atol=1e-6)
    (diagonal,) = ggn(model, flat, mode, data.x, data.y, None, structure="diag").blocks
    assert torch.allclose(diagonal.ggn, block.ggn.diagonal(), atol=1e-8)


def test_marglik_maximizes_the_evidence():
    model, data = regression()
    exact = model.analytic_posterior(data.x, data.y)
    start = at_mode(model, data, exact.mean)
    fixed = fit_laplace(model, data, ensemble=start, subset="all", prior_precision="prior")
    tuned = fit_laplace(model, data, ensemble=start, subset="all")
    best = tuned.record["laplace"][0]
    assert best["evidence_converged"] and best["evidence_gradient"] <= GRADIENT_TOLERANCE
    assert best["log_evidence"] > fixed.record["laplace"][0]["log_evidence"]
    for scale in (0.5, 1.0, 3.0):  # any other single scale has less evidence
        other = fit_laplace(model, data, ensemble=start, subset="all", prior_precision=scale**-2)
        assert other.record["laplace"][0]["log_evidence"] < best["log_evidence"]


def test_laplace_around_a_map_fit_approaches_the_analytic_posterior():
    model, data = regression()
    exact = model.analytic_posterior(data.x, data.y)
    post = fit_laplace(
        model, data, subset="all", prior_precision="prior", num_samples=4000, predictive="nn",
        num_steps=1500, lr=0.05, progress=False,
    )  # fmt: skip
    theta = torch.cat([post.samples["weight"][0], post.samples["bias"][0, :, None]], -1).double()
    assert torch.allclose(theta.mean(0), exact.mean, atol=0.03)
    assert torch.allclose(theta.T.cov().diagonal(), exact.covariance_matrix.diagonal(), rtol=0.15)


# -- the GGN of a classifier against torch.func references --------------------------------------


def reference_ggn(model, sites, mode, data) -> torch.Tensor:
    """``sum_n J_n^T H_n J_n`` with ``J`` from one ``jacrev`` over all rows and ``H_n`` the
    Hessian of the cross-entropy in the logits from ``torch.func.hessian``."""
    flat = Subset(sites)
    fixed = {k: v for k, v in mode.items() if k not in sites}

    def logits(theta):
        fn = curvature.likelihood_fn(model, {**fixed, **flat.unflatten(theta)}, data.x, data.mask)
        return fn.logits

    theta0 = flat.flatten(mode)
    with torch.no_grad():
        curvature.likelihood_fn(model, mode, data.x[:1], None)  # params into the param store
    jac = torch.func.jacrev(logits)(theta0).double()  # (N, C, d)
    f = logits(theta0).detach().double()

    def cross_entropy(row_logits, label):
        return torch.nn.functional.cross_entropy(row_logits[None], label[None])

    total = torch.zeros(flat.dim, flat.dim, dtype=torch.float64)
    for n in range(len(f)):
        hessian = torch.func.hessian(cross_entropy)(f[n], data.y[n])
        total += jac[n].T @ hessian @ jac[n]
    return total


@pytest.mark.parametrize("subset", ["head", "all"])
def test_ggn_matches_a_torch_func_reference_in_any_chunking(mapped, train, subset, monkeypatch):
    model, rows = mapped.model, train[:10]
    post = fit_laplace(model, rows, ensemble=mapped, subset=subset, num_samples=2)
    sites = {name: mapped.latent_shapes[name] for name in post.record["subset"]}
    mode = {k: v[0, 0] for k, v in mapped.draws(1).items()}
    with curvature.pyro_scope():
        expected = reference_ggn(model, sites, mode, rows).detach()
    flat = Subset(sites)
    found = ggn(model, flat, mode, rows.x, rows.y, rows.mask, structure="full")
    (block,) = found.blocks
    assert torch.allclose(block.ggn, expected, atol=1e-6, rtol=1e-4)  # float32 Jacobians
    monkeypatch.setattr(curvature, "JACOBIAN_BYTES", 1)  # one row per chunk
    (one_by_one,) = ggn(model, flat, mode, rows.x, rows.y, rows.mask, structure="diag").blocks
    assert torch.allclose(one_by_one.ggn, expected.diagonal(), atol=1e-6, rtol=1e-4)
    # kron: one block per site, each of the exact GGN's trace; the 1-dim sites exact
    kron = ggn(model, flat, mode, rows.x, rows.y, rows.mask, structure="kron").blocks
    start = 0
    for shape, size, block in zip(sites.values(), flat.sizes, kron, strict=True):
        part = expected[start : start + size, start : start + size]
        if len(shape) < 2:
            assert torch.allclose(block.ggn, part, atol=1e-6, rtol=1e-4)
        else:
            assert float(block.ggn_eigenvalues.sum()) == pytest.approx(
                float(part.trace()), rel=1e-4
            )
        start += size
    expected_log_lik = -torch.nn.functional.cross_entropy(
        mapped.predict(rows.x, rows.mask).probs[0].log(), rows.y, reduction="sum"
    )
    assert found.log_likelihood == pytest.approx(float(expected_log_lik), rel=1e-4)


# -- predictives, MoLA, settings ------------------------------------------------------------------


def test_glm_and_network_predictives_agree_for_the_last_layer_only(mapped, train, digits):
    head = fit_laplace(mapped.model, train, ensemble=mapped, subset="head", num_samples=20)
    assert head.record["glm_nn_disagreement"] < 1e-5
    x = digits.test.x[:16]
    network = fit_laplace(
        mapped.model, train, ensemble=mapped, subset="head", num_samples=20, predictive="nn"
    )
    assert torch.allclose(head.predict(x).probs, network.predict(x).probs, atol=1e-5)
    attention = fit_laplace(mapped.model, train, ensemble=mapped, subset="attention", num_samples=8)
    assert attention.record["glm_nn_disagreement"] > 1e-4  # a nonlinear subset: they differ
    # the GLM's logits are f(theta*) + J (theta - theta*), J from a jacrev reference
    draws = attention.draw(8)
    prediction = attention.predict(x, draws=draws)
    sites = {name: mapped.latent_shapes[name] for name in attention.record["subset"]}
    flat = Subset(sites)
    mode = {k: v[0, 0] for k, v in mapped.draws(1).items()}
    fixed = {k: v for k, v in mode.items() if k not in sites}

    def logits(theta):
        return curvature.likelihood_fn(
            mapped.model, {**fixed, **flat.unflatten(theta)}, x, None
        ).logits

    with curvature.pyro_scope():
        with torch.no_grad():
            logits(flat.flatten(mode))
        jac = torch.func.jacrev(logits)(flat.flatten(mode))
        f0 = logits(flat.flatten(mode)).detach()
    delta = flat.flatten({k: draws.latents[k][0] for k in sites}) - flat.flatten(mode)
    expected = torch.softmax(f0 + torch.einsum("ncd,sd->snc", jac, delta), -1)
    assert torch.allclose(prediction.probs, expected, atol=1e-5)


def test_mola_of_one_member_is_plain_laplace(train, digits):
    settings = dict(num_samples=10, seed=4)
    plain = fit_laplace(small_model(), train, **settings, **FIT)
    one = fit_ensemble(small_model(), train, n_members=1, seed=4, batched=False, **FIT)
    mixture = fit_laplace(small_model(), train, ensemble=one, **settings)
    assert mixture.record["method"] == plain.record["method"] == "laplace"
    for key in ("log_evidence", "prior_precision", "condition_number", "log_likelihood"):
        assert mixture.record["laplace"][0][key] == pytest.approx(plain.record["laplace"][0][key])
    for site, value in plain.samples.items():
        assert torch.allclose(mixture.samples[site], value)
    x = digits.test.x[:8]
    assert torch.allclose(mixture.predict(x).probs, plain.predict(x).probs, atol=1e-6)


def test_mola_keeps_one_gaussian_per_member(train):
    post = fit_mola(small_model(), train, n_members=3, num_samples=12, **FIT)
    assert post.record["method"] == "mola" and len(post.record["laplace"]) == 3
    assert post.samples["head.weight"].shape[:2] == (3, 4)
    assert post.members is not None and post.source.modes is not None
    assert post.record["seconds"] >= post.record["laplace_seconds"] > 0


def test_kron_is_exact_when_every_row_has_rank_one():
    # one output per row: the weight's (1, P) rows V_r = sqrt(w) x_r^T have rank one
    model, data = regression()
    model = BayesianLinearRegression(3, prior_scale=1.5, noise_scale=0.7, fit_intercept=False)
    flat = Subset({"weight": torch.Size([3])})
    mode = {"weight": torch.tensor([1.0, -2.0, 0.5])}
    (full,) = ggn(model, flat, mode, data.x, data.y, None, structure="full").blocks
    # a (3,) site has one dim: kron treats it as a full block; as (1, 3) it factors exactly
    kron = KronBlock(*_kron_factors(data.x.double() / 0.7))
    delta = torch.full((3,), 0.4, dtype=torch.float64)
    assert torch.allclose(kron.covariance(delta), full.covariance(delta), atol=1e-7)
    assert float(kron.logdet(delta)) == pytest.approx(float(full.logdet(delta)), rel=1e-7)
    draws = kron.sample(torch.randn(20_000, 3, dtype=torch.float64), delta)
    assert torch.allclose(draws.T.cov(), full.covariance(delta), atol=2e-3)


def _kron_factors(rows: torch.Tensor):
    v = rows[:, None, :]  # (N, out=1, in=3)
    return (
        torch.einsum("roi,rpi->op", v, v),
        torch.einsum("roi,roj->ij", v, v),
        v.pow(2).sum(),
    )


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        (dict(hessian="kfac"), ValueError, "hessian must be one of"),
        (dict(predictive="probit"), ValueError, "predictive must be one of"),
        (dict(prior_precision="auto"), ValueError, "'marglik', 'prior' or a number"),
        (dict(prior_precision=-1.0), ValueError, "finite number > 0"),
        (dict(prior_precision=[1.0]), TypeError, "'marglik', 'prior' or a number"),
        (dict(subset="embedding"), ValueError, "subset must be one of"),
        (dict(subset=["head.weight", "nope"]), ValueError, r"\['nope'\], which are not latent"),
        (
            dict(subset=["encoder.layers.0.attention.logit_scale"]),
            ValueError,
            "real support",
        ),
        (dict(subset=7), TypeError, "subset must be one of"),
        (dict(subset="all", max_memory=1000), ValueError, "above max_memory=1,000"),
        (dict(num_samples=0), ValueError, "num_samples"),
        (dict(ensemble="ens"), TypeError, "ensemble must be a Posterior"),
        (dict(num_steps=5), TypeError, "takes no fit_map settings"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(mapped, train, settings, error, match):
    settings = {"ensemble": mapped, **settings}
    with pytest.raises(error, match=match):
        fit_laplace(small_model(), train, **settings)


def test_an_ensemble_of_another_method_is_refused(train, small_posterior):
    with pytest.raises(ValueError, match="fit_ensemble or fit_map"):
        fit_laplace(small_model(), train, ensemble=small_posterior)


def test_a_likelihood_without_a_ggn_is_refused():
    with pytest.raises(ValueError, match="Categorical, Normal or Student-t"):
        curvature.natural_output(torch.distributions.Poisson(torch.ones(3)))


def test_masked_positions_add_no_curvature_and_wrappers_survive_linearization():
    logits = torch.randn(2, 3, 4)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    fn = pyro.distributions.Categorical(logits=logits).mask(mask).to_event(1)
    out = curvature.natural_output(fn)
    assert out.kind == "categorical" and torch.equal(out.mask, mask.float())
    shifted = with_output(fn, logits + 1.0)  # the same likelihood: softmax is shift-invariant
    y = torch.zeros(2, 3, dtype=torch.long)
    assert shifted.event_shape == fn.event_shape
    assert torch.allclose(shifted.log_prob(y), fn.log_prob(y))
    normal = pyro.distributions.StudentT(5.0, torch.zeros(3), 2.0).to_event(1)
    fisher = curvature.natural_output(normal).weight[..., 0]
    assert torch.allclose(fisher, torch.full((3,), 6 / (8 * 4.0)))  # (nu+1)/((nu+3) sigma^2)


def test_settings_the_model_decides_are_refused_before_any_fit(train, monkeypatch):
    def no_fit(*args, **kwargs):
        raise AssertionError("fit_map ran before the settings were checked")

    monkeypatch.setattr("probtransformer.inference.laplace.fit.fit_map", no_fit)
    with pytest.raises(ValueError, match="not latent sites"):
        fit_laplace(small_model(), train, subset=["nope"], **FIT)
    with pytest.raises(ValueError, match="above max_memory"):
        fit_laplace(small_model(), train, subset="all", max_memory=1000, **FIT)
    with pytest.raises(ValueError, match="draw fewer"):
        fit_laplace(small_model(), train, num_samples=10**9, **FIT)
    with pytest.raises(TypeError, match="seed"):
        fit_laplace(small_model(), train, seed="a", **FIT)


def test_an_ensemble_of_another_configuration_is_refused(mapped, train):
    other = SequenceClassifier(8, 10, 8, d_model=8, num_heads=2, num_layers=1, d_ff=8)
    with pytest.raises(ValueError, match="pass the model the ensemble was fitted with"):
        fit_laplace(other, train, ensemble=mapped)


def test_a_prior_precision_too_small_for_float64_is_a_value_error(mapped, train):
    with pytest.raises(ValueError, match="not positive definite"):
        fit_laplace(small_model(), train, ensemble=mapped, prior_precision=1e-300)


def test_glm_attention_comes_from_the_weight_draws(mapped, train, digits):
    x = digits.test.x[:4]
    glm = fit_laplace(small_model(), train, ensemble=mapped, subset="attention", num_samples=8)
    network = fit_laplace(
        small_model(), train, ensemble=mapped, subset="attention", num_samples=8, predictive="nn"
    )
    spread = glm.attention(x).samples.std(1).max()
    assert spread > 1e-3  # not the mode's attention in every draw
    assert torch.allclose(glm.attention(x).samples, network.attention(x).samples)


def test_fit_mola_refuses_a_bad_subset_before_fitting_its_ensemble(train, monkeypatch):
    def no_fit(*args, **kwargs):
        raise AssertionError("fit_ensemble ran before the subset was checked")

    monkeypatch.setattr("probtransformer.inference.laplace.fit.fit_ensemble", no_fit)
    with pytest.raises(ValueError, match="not latent sites"):
        fit_mola(small_model(), train, subset=["nope"], **FIT)
