"""Fits trace a model once and reject Pyro's silent-wrong-model pitfalls, naming site and fix."""

from unittest import mock

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.mcmc import MCMC
from pyro.nn import PyroModule, PyroSample

from probtransformer.datasets import SequenceData
from probtransformer.inference import Posterior, fit_mcmc, fit_svi
from probtransformer.inference.model_checks import check_model_structure, module_sample_sites
from probtransformer.models import SequenceRegressor, TokenTagger

QUICK = dict(num_steps=2, progress=False)


class Regression(PyroModule):
    """y_n ~ N(w · x_n, 1): the correct form, and the three broken variants below."""

    likelihood_site = "y"

    def __init__(self) -> None:
        super().__init__()
        self.config = {}
        self.w = PyroSample(dist.Normal(0.0, 1.0).expand([2]).to_event(1))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        w = self.w  # read before the plate: one draw for the model
        with pyro.plate("data", num_data or len(x), subsample=torch.arange(len(x))):
            return pyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


class GlobalReadInPlate(Regression):
    def forward(self, x, y=None, mask=None, *, num_data=None):
        with pyro.plate("data", len(x)):
            return pyro.sample("y", dist.Normal((x * self.w).sum(-1), 1.0), obs=y)


class ObservedOutsidePlate(Regression):
    def forward(self, x, y=None, mask=None, *, num_data=None):
        w = self.w
        return pyro.sample("y", dist.Normal(x @ w, 1.0).to_event(1), obs=y)


class PerStepBatch(Regression):
    """(N, T) targets with the data plate moved to dim -2 and no ``.to_event(1)``."""

    def forward(self, x, y=None, mask=None, *, num_data=None):
        w = self.w
        with pyro.plate("data", len(x), dim=-2):
            return pyro.sample("y", dist.Normal(x * w, 1.0), obs=y)


@pytest.fixture
def data():
    x = torch.randn(6, 2)
    return SequenceData(x, x @ torch.tensor([1.0, -1.0]))


def test_a_correct_model_passes_and_fits(data):
    check_model_structure(Regression(), data)
    assert fit_svi(Regression(), data, **QUICK).record["steps_done"] == 2


@pytest.mark.parametrize(
    "model, words",
    [
        (GlobalReadInPlate, ["'w'", "once per data point", "before entering the plate"]),
        (ObservedOutsidePlate, ["'y'", "outside pyro.plate('data')", "mini-batches"]),
    ],
)
def test_pitfalls_are_rejected_with_site_and_fix(data, model, words):
    for fit in (fit_svi, fit_mcmc):
        options = QUICK if fit is fit_svi else dict(num_warmup=2, num_samples=2, progress=False)
        with pytest.raises(ValueError) as info:
            fit(model(), data, **options)
        for word in words:
            assert word in str(info.value)


def test_extra_batch_dims_on_the_likelihood_are_rejected():
    x = torch.randn(6, 2)
    data = SequenceData(x, x * 2)  # (N, T=2) targets
    with pytest.raises(ValueError, match=r"batch shape \(3, 2\) for 3 observations.*to_event"):
        fit_svi(PerStepBatch(), data, **QUICK)


def test_builtin_models_pass_and_the_callers_rng_is_untouched():
    x = torch.randint(0, 5, (4, 6))
    tagger = TokenTagger(None, 2, 6, vocab_size=5, d_model=8, num_heads=2, num_layers=1, d_ff=8)
    regressor = SequenceRegressor(3, 6, horizon=2, d_model=8, num_heads=2, num_layers=1, d_ff=8)
    tags, values = (
        SequenceData(x, (x > 2).long()),
        SequenceData(torch.randn(4, 6, 3), torch.randn(4, 2)),
    )
    torch.manual_seed(1)
    before = torch.rand(1)
    torch.manual_seed(1)
    check_model_structure(tagger, tags)
    check_model_structure(regressor, values)
    assert torch.equal(torch.rand(1), before)  # dropout in the trace drew from a forked RNG


def test_module_sample_sites_lists_full_names():
    tagger = TokenTagger(None, 2, 6, vocab_size=5, d_model=8, num_heads=2, num_layers=1, d_ff=8)
    names = module_sample_sites(tagger)
    assert "head.weight" in names
    assert "encoder.layers.0.attention.projection" in names


class LinearReadInPlate(Regression):
    """The common form: ``PyroModule[nn.Linear]`` with PyroSample weights, called in the plate
    (the per-data-point draw would otherwise fail deep inside torch with a shape error)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = PyroModule[torch.nn.Linear](2, 1)
        self.lin.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 2]).to_event(2))
        self.lin.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        with pyro.plate("data", len(x)):
            return pyro.sample("y", dist.Normal(self.lin(x)[..., 0], 1.0), obs=y)


def test_a_linear_layer_read_in_the_plate_is_named_before_torch_fails(data):
    with pytest.raises(ValueError, match="the global latent 'lin.weight'"):
        fit_svi(LinearReadInPlate(), data, **QUICK)


class BroadcastAgainstDraws(Regression):
    """``w.unsqueeze(-2)`` meant to put the rows' dim before the weight's: right for one draw
    ``(P,)``, but a ``(K, 1, P)`` draw becomes ``(K, 1, 1, P)`` and the likelihood ``(K, K, N)``."""

    def forward(self, x, y=None, mask=None, *, num_data=None):
        w = self.w
        with pyro.plate("data", num_data or len(x), subsample=torch.arange(len(x))):
            return pyro.sample("y", dist.Normal((x * w.unsqueeze(-2)).sum(-1), 1.0), obs=y)


class BroadcastFromTheRight(Regression):
    """The same model written to broadcast: ``(x * w).sum(-1)`` is ``(N,)`` or ``(K, N)``."""

    def forward(self, x, y=None, mask=None, *, num_data=None):
        w = self.w
        with pyro.plate("data", num_data or len(x), subsample=torch.arange(len(x))):
            return pyro.sample("y", dist.Normal((x * w).sum(-1), 1.0), obs=y)


DRAW_DIM_WORDS = r"'y' has batch shape \(2, 2, 3\).*expected batch shape \(2, 3\).*\(x \* w\)\.sum"


def test_a_latent_broadcast_against_the_draw_dim_is_refused_before_any_step(data):
    with mock.patch(
        "probtransformer.inference.vi.state.reinitialised_copy", side_effect=AssertionError("fit")
    ):
        with pytest.raises(ValueError, match=DRAW_DIM_WORDS):
            fit_svi(BroadcastAgainstDraws(), data, **QUICK)
    with mock.patch.object(MCMC, "run", side_effect=AssertionError("sampling started")):
        with pytest.raises(ValueError, match=DRAW_DIM_WORDS):
            fit_mcmc(BroadcastAgainstDraws(), data, num_chains=1, num_samples=5, progress=False)


def test_the_model_written_to_broadcast_passes_with_per_observation_log_likelihoods(data):
    post = fit_mcmc(
        BroadcastFromTheRight(), data, num_chains=2, num_warmup=50, num_samples=20, progress=False
    )
    assert post.log_likelihood(data).shape == (2, 20, len(data))
    idata = post.to_inference_data(data)
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "obs")
    assert idata.log_likelihood["y"].shape == (2, 20, len(data))


def test_the_prediction_engine_refuses_a_wrong_likelihood_shape_too(data):
    """A posterior built around the broadcasting model without a fit (loaded, or assembled):
    its vectorized pass raises instead of exporting (K, K, N) log-likelihoods."""
    w = torch.randn(1, 4, 2)
    post = Posterior(BroadcastAgainstDraws(), samples={"w": w}, record={}, example=data[:2])
    with pytest.raises(ValueError, match=r"'y' has batch shape \(4, 4, 6\)"):
        post.log_likelihood(data)


def test_a_model_that_cannot_run_under_vectorized_draws_is_fitted_with_a_warning(data):
    with pytest.warns(UserWarning, match="Regression fails under 2 vectorized posterior draws"):
        fit_svi(Regression(), data, **QUICK)  # `x @ w` with w (2, 1, 2): a torch shape error


class OutOfMemoryUnderDraws(Regression):
    """Runs for one draw, then cannot allocate the vectorized pass, as torch's CPU allocator
    says it."""

    def forward(self, x, y=None, mask=None, *, num_data=None):
        if self.w.dim() > 1:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")
        return super().forward(x, y, mask, num_data=num_data)


def test_running_out_of_memory_under_vectorized_draws_is_raised_not_called_a_broadcasting_fault(
    data,
):
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        fit_svi(OutOfMemoryUnderDraws(), data, **QUICK)


class SumsOverDraws(Regression):
    """``einsum("...p,np->n")``: right for one draw, but sums the (K, 1, P) draws into one."""

    def forward(self, x, y=None, mask=None, *, num_data=None):
        w = self.w
        with pyro.plate("data", num_data or len(x), subsample=torch.arange(len(x))):
            return pyro.sample("y", dist.Normal(torch.einsum("...p,np->n", w, x), 1.0), obs=y)


class AveragesOverDraws(Regression):
    """``.mean(0)`` over a leading dim that is the draw dim under vectorized draws."""

    def forward(self, x, y=None, mask=None, *, num_data=None):
        w = self.w
        loc = (x * w).sum(-1)
        loc = loc.mean(0) if loc.dim() > 1 else loc
        with pyro.plate("data", num_data or len(x), subsample=torch.arange(len(x))):
            return pyro.sample("y", dist.Normal(loc, 1.0), obs=y)


@pytest.mark.parametrize("model", [SumsOverDraws, AveragesOverDraws])
def test_a_forward_pass_that_mixes_the_draws_is_refused_before_any_step(data, model):
    """The right shape, the wrong numbers: every prediction would mix the posterior draws."""
    words = r"'y' does not follow each posterior draw.*\(x \* w\)\.sum"
    with mock.patch.object(MCMC, "run", side_effect=AssertionError("sampling started")):
        with pytest.raises(ValueError, match=words):
            fit_mcmc(model(), data, num_chains=1, num_samples=5, progress=False)
    with pytest.raises(ValueError, match=words):
        fit_svi(model(), data, **QUICK)
