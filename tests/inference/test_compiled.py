"""The compiled K-chain log density (``inference.mcmc.compiled``) against the eager Pyro trace.

Equality is checked on every built-in model (masks, token inputs, horizons, the decoder's
cross-attention), a model with local latents, per-chain plain parameters, mini-batches and a
non-finite chain: value and gradient within 1e-5 relative to the largest magnitude (float32).
The default tests run the graph that ``make_fx`` traced from the model as it is (backend
``"fx"``): that trace is what could be wrong. Inductor's code
generation of the same graphs is checked by the slow tests (``-m slow``; 10-20 s per model).
"""

from __future__ import annotations

import math
import time
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroSample

from probtransformer.block import BAYESIAN_PARTS
from probtransformer.datasets import SequenceData
from probtransformer.inference import NUTS, ChEES, fit_mcmc
from probtransformer.inference.mcmc import compiled
from probtransformer.inference.mcmc.compiled import CompiledPass, attach, compilable
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.starts import prior_states
from probtransformer.models import (
    BayesianLinearRegression,
    CausalLM,
    Seq2Seq,
    SequenceClassifier,
    SequenceRegressor,
    TokenTagger,
)
from tests.inference.test_local_latents import SIGMA, EightSchools, Y

RTOL = 1e-5
MAX_LEN, V, C, F, H, N = 5, 7, 3, 2, 3, 10  # steps, vocabulary, classes, features, horizon, rows
SIZES = dict(d_model=4, num_heads=2, num_layers=1, d_ff=4, dropout=0.0, bayesian=BAYESIAN_PARTS)

pytestmark = pytest.mark.filterwarnings("ignore:num_warmup=.*is short:UserWarning")


def _data(tokens: bool, targets: str, masked: bool = True) -> SequenceData:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (N, MAX_LEN), generator=g) if tokens else torch.randn(N, MAX_LEN, F)
    lengths = torch.randint(2, MAX_LEN + 1, (N,), generator=g)
    mask = (torch.arange(MAX_LEN) < lengths[:, None]) if masked else None
    if targets == "class":
        y = torch.randint(0, C, (N,), generator=g)
    elif targets == "tags":
        y = torch.randint(0, C, (N, MAX_LEN), generator=g)
    elif targets == "next":
        y = torch.randint(0, V, (N, MAX_LEN), generator=g)
    else:
        y = torch.randn(N, H, generator=g)
    return SequenceData(x, y, mask)


def _schools() -> tuple[EightSchools, SequenceData]:
    return EightSchools(), SequenceData(torch.tensor(SIGMA)[:, None], torch.tensor(Y))


BUILT_IN = {
    "classifier": lambda: (SequenceClassifier(F, C, MAX_LEN, **SIZES), _data(False, "class")),
    "tagger": lambda: (
        TokenTagger(None, C, MAX_LEN, vocab_size=V, **SIZES),
        _data(True, "tags"),
    ),
    "causal_lm": lambda: (CausalLM(V, MAX_LEN, **SIZES), _data(True, "next", masked=False)),
    "regressor": lambda: (
        SequenceRegressor(F, MAX_LEN, horizon=H, pooling="last", **SIZES),
        _data(False, "values"),
    ),
    "seq2seq": lambda: (
        Seq2Seq(F, MAX_LEN, H, num_decoder_layers=1, **SIZES),
        _data(False, "values"),
    ),
    "linear_regression": lambda: (
        BayesianLinearRegression(3),
        SequenceData(torch.randn(N, 3, generator=torch.Generator().manual_seed(1)), torch.ones(N)),
    ),
    "eight_schools": _schools,  # local latents: one per school
}


def _density(name: str, **options) -> VectorizedDensity:
    model, data = BUILT_IN[name]()
    return VectorizedDensity(model.eval(), data.x, data.y, data.mask, **options)


def _states(density: VectorizedDensity, chains: int = 3) -> torch.Tensor:
    torch.manual_seed(0)
    return prior_states(density, chains)


def assert_same_density(density, z, backend: str = "fx", **options) -> CompiledPass:
    """Compiled and eager ``log_density(z, **options)``: same non-finite entries, values and
    gradients within ``RTOL`` of the largest magnitude of each."""
    eager = density.log_density(z, **options)
    density.compiled = CompiledPass(density, backend=backend)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback fails the test
            ours = density.log_density(z, **options)
    finally:
        pass_, density.compiled = density.compiled, None
    assert pass_.record()["density_path"] == "compiled", pass_.record()
    for a, b in zip(ours, eager, strict=True):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        good = torch.isfinite(b)
        error = (a[good] - b[good]).abs().max() / b[good].abs().max()
        assert error <= RTOL, f"{float(error):.3g} relative"
    return pass_


@pytest.mark.parametrize("name", BUILT_IN)
def test_the_compiled_density_equals_the_eager_one(name):
    density = _density(name)
    assert_same_density(density, _states(density))


def test_mini_batch_rows_and_the_objective_without_jacobians():
    density = _density("classifier")
    assert_same_density(density, _states(density), rows=torch.arange(4), jacobian=False)


def test_several_row_passes_compile_a_graph_each():
    """A memory budget of a few rows splits the rows into passes: the first with the priors,
    the others the likelihood only, and the last one shorter."""
    density = _density("classifier", memory_budget=1)
    assert density._rows_per_pass(3) < N
    compiled_pass = assert_same_density(density, _states(density))
    assert len(compiled_pass.shapes) >= 2


def test_per_chain_plain_parameters_and_their_gradients():
    """Point-estimate parts held per chain (MAP starts, ensembles): the compiled graph takes
    them as inputs, and ``log_joint``'s gradient reaches them as the eager one does."""
    model = SequenceClassifier(F, C, MAX_LEN, **{**SIZES, "bayesian": ("head",)}).eval()
    data = _data(False, "class")
    torch.manual_seed(0)
    parameters = {
        name: (p.detach() + 0.1 * torch.randn(3, 1, *p.shape)).requires_grad_(True)
        for name, p in model.named_parameters()
    }
    density = VectorizedDensity(model, data.x, data.y, data.mask, parameters=parameters)
    z = _states(density)
    assert_same_density(density, z)
    grads = []
    for backend in (None, "fx"):
        density.compiled = None if backend is None else CompiledPass(density, backend=backend)
        lp = density.log_joint(z, jacobian=False)
        grads.append(torch.autograd.grad(lp.sum(), list(parameters.values())))
    density.compiled = None
    for ours, eager in zip(grads[1], grads[0], strict=True):
        assert torch.allclose(ours, eager, rtol=RTOL, atol=RTOL * eager.abs().max())


def test_a_non_finite_chain_is_nan_and_leaves_the_others_alone():
    density = _density("classifier")
    z = _states(density, 4)
    z[2, 0] = math.nan
    assert_same_density(density, z)
    density.compiled = CompiledPass(density, backend="fx")
    lp, grad = density.log_density(z)
    assert torch.isnan(lp[2]) and torch.isnan(grad[2]).all()
    assert torch.isfinite(lp[[0, 1, 3]]).all()


class BranchesOnALatent(PyroModule):
    """``y ~ N(w x, 1)`` that reads ``w`` into Python: no graph can hold that branch."""

    likelihood_site = "y"

    def __init__(self) -> None:
        super().__init__()
        self.config = {}
        self.w = PyroSample(dist.Normal(0.0, 1.0))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        w = self.w
        scale = 1.0 if float(w.detach().abs().max()) < 10 else 2.0
        with pyro.plate("data", num_data or len(x), subsample=torch.arange(len(x))):
            return pyro.sample("y", dist.Normal(w * x[:, 0], scale), obs=y)


def test_a_model_that_branches_on_a_latent_stays_eager_with_a_warning():
    x = torch.randn(N, 1)
    density = VectorizedDensity(BranchesOnALatent(), x, x[:, 0], None)
    z = _states(density)
    eager = density.log_density(z)
    density.compiled = CompiledPass(density, backend="fx")
    with pytest.warns(RuntimeWarning, match="BranchesOnALatent did not compile .*eager"):
        lp, grad = density.log_density(z)
    assert torch.equal(lp, eager[0]) and torch.equal(grad, eager[1])
    assert density.compiled.record()["density_path"] == "eager"
    assert "RuntimeError" in density.compiled.record()["compile_failure"]
    density.log_density(z)  # no second attempt, no second warning: the filter is "error"


def test_a_graph_that_disagrees_with_the_eager_pass_is_refused(monkeypatch):
    """The check at the first states catches a compiled value that is off (a stand-in for a
    miscompile: the traced graph's output scaled)."""
    density = _density("classifier")
    trace = compiled.make_fx

    def off_by_a_little(function):
        return trace(lambda *inputs: function(*inputs) * (1 + 1e-3))

    monkeypatch.setattr(compiled, "make_fx", off_by_a_little)
    density.compiled = CompiledPass(density, backend="fx")
    with pytest.warns(RuntimeWarning, match="value differs from the eager pass by 0.001"):
        density.log_density(_states(density))
    assert density.compiled.failure is not None


def test_dropout_in_train_mode_is_not_compilable():
    model = SequenceClassifier(F, C, MAX_LEN, d_model=4, num_heads=2, d_ff=4, dropout=0.1)
    assert not compilable(model.train()) and compilable(model.eval())
    data = _data(False, "class")
    density = VectorizedDensity(model.train(), data.x, data.y, data.mask)
    with pytest.raises(ValueError, match="compile=True, but SequenceClassifier draws dropout"):
        attach(CompiledPass(density), True, 100, lambda: None)
    attach(CompiledPass(density), None, 10**9, lambda: None)  # the rule: eager
    assert density.compiled is None


def test_the_rule_compiles_only_a_phase_that_repays_it(monkeypatch):
    density = _density("classifier")
    compiled_pass = CompiledPass(density)
    attach(compiled_pass, None, 10, lambda: None)  # 10 calls of nothing: not worth it
    assert density.compiled is None
    monkeypatch.setattr(compiled, "PAYBACK_SECONDS", 0.0)

    def gradient(eager_seconds, compiled_seconds):  # a phase's evaluation, timed by the rule
        return lambda: time.sleep(eager_seconds if density.compiled is None else compiled_seconds)

    attach(compiled_pass, None, 10, gradient(0.02, 0.0))  # compiled faster: kept
    assert density.compiled is compiled_pass and compiled_pass.failure is None
    attach(compiled_pass, False, 10**9, lambda: None)
    assert density.compiled is None
    attach(compiled_pass, None, 10, gradient(0.0, 0.02))  # compiled slower: eager for good
    assert density.compiled is None
    assert "ms per gradient, eager" in compiled_pass.failure
    assert compiled_pass.record()["density_path"] == "eager"
    attach(compiled_pass, None, 10, gradient(0.02, 0.0))
    assert density.compiled is None


@pytest.fixture
def fx_backend(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "fx")


@pytest.mark.parametrize("kernel", ["chees", "mclmc"])
def test_fit_mcmc_records_the_compiled_path(fx_backend, kernel):
    model, data = BUILT_IN["classifier"]()
    post = fit_mcmc(
        model, data, kernel=kernel, num_chains=4, num_starts=2, init="ensemble", map_steps=5,
        num_warmup=3, num_samples=2, compile=True, progress=False,
    )  # fmt: skip
    record = post.record
    assert record["density_path"] == "compiled" and record["compile_failure"] is None
    assert record["compile_seconds"] > 0
    assert [2, N] in record["compiled_shapes"] and [4, N] in record["compiled_shapes"]
    eager = fit_mcmc(
        model, data, kernel=kernel, num_chains=4, num_warmup=3, num_samples=2, compile=False,
        progress=False,
    )  # fmt: skip
    assert eager.record["density_path"] == "eager" and eager.record["compile_seconds"] == 0


def test_compile_is_checked():
    model, data = BUILT_IN["linear_regression"]()
    with pytest.raises(TypeError, match="compile must be True, False or None"):
        ChEES(compile="yes")
    with pytest.raises(TypeError, match="unexpected keyword argument 'compile'"):
        NUTS(compile=True)
    with (
        pytest.raises(
            ValueError,
            match="compile applies to kernel='chees'/'mclmc'/'adjusted-mclmc', not 'nuts'",
        ),
        pytest.warns(DeprecationWarning),
    ):
        fit_mcmc(model, data, kernel="nuts", compile=True, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILT_IN)
def test_inductor_compiles_every_built_in_model_to_the_same_density(name):
    density = _density(name)
    assert_same_density(density, _states(density, 4), backend="inductor")


@pytest.mark.slow
def test_inductor_stays_equal_to_eager_over_many_chains_and_calls():
    """The 780-latent classifier at K = 64, where Inductor's vectorized CPU kernels returned
    a different wrong value on each call while the traced graph kept a dead ``aten.nonzero``
    (``compiled._prepare`` drops it): every call equal."""
    from benchmarks.studies.nuts_vs_numpyro import MODEL, load_data

    train, _ = load_data(100, 1, 0)
    model = SequenceClassifier(**MODEL).eval()
    density = VectorizedDensity(model, train.x, train.y, train.mask)
    z = _states(density, 64)
    lp, grad = density.log_density(z)
    density.compiled = CompiledPass(density, backend="inductor")
    for _ in range(5):
        ours, our_grad = density.log_density(z)
        assert density.compiled.failure is None
        torch.testing.assert_close(ours, lp, rtol=RTOL, atol=RTOL * float(lp.abs().max()))
        torch.testing.assert_close(our_grad, grad, rtol=RTOL, atol=RTOL * float(grad.abs().max()))
