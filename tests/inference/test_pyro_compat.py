"""The Pyro internals behind ``inference/_pyro_compat.py`` exist with the expected signatures.

A failure here after a Pyro upgrade means: re-check ``probtransformer/inference/_pyro_compat.py``
(the module lists what it uses and why) against the new Pyro sources.
"""

import inspect

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer.mcmc import HMC, MCMC, NUTS
from pyro.infer.mcmc import api as mcmc_api
from pyro.infer.mcmc import nuts as nuts_module
from pyro.nn import PyroModule, PyroSample

from probtransformer.inference import _pyro_compat as compat
from probtransformer.inference.mcmc.pyro_runner import RecordingHMC, RecordingNUTS

RECHECK = "re-check probtransformer/inference/_pyro_compat.py against this Pyro release"


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def _normal_model(y):
    loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y), subsample=torch.arange(len(y))):
        pyro.sample("y", dist.Normal(loc, 1.0), obs=y)


Y = torch.tensor([0.5, -0.2, 0.1])


def test_the_pyro_version_is_the_series_the_module_was_written_against():
    assert pyro.__version__.startswith(compat.PYRO_SERIES), (
        f"pyro {pyro.__version__} is installed; _pyro_compat was written against "
        f"{compat.PYRO_SERIES}x: {RECHECK}"
    )


def test_initialize_model_takes_and_returns_what_fit_mcmc_uses():
    assert _parameters(compat.initialize_model)[:3] == ["model", "model_args", "model_kwargs"]
    assert "init_strategy" in _parameters(compat.initialize_model), RECHECK

    def flagged(y):  # check_sampled_sites reads each site's infer flags from the prototype trace
        pyro.sample("loc", dist.Normal(0.0, 1.0), infer={"flag": True})

    with pyro.get_param_store().scope():
        initial, potential_fn, transforms, trace = compat.initialize_model(
            _normal_model, model_args=(Y,)
        )
        *_, flagged_trace = compat.initialize_model(flagged, model_args=(Y,))
    assert set(initial) == {"loc"} and initial["loc"].shape == ()
    assert callable(potential_fn) and isinstance(transforms, dict)
    assert trace.nodes["loc"]["value"].shape == ()
    assert flagged_trace.nodes["loc"]["infer"]["flag"], RECHECK


def test_site_is_subsample_tells_the_plate_site_from_sample_sites():
    trace = poutine.trace(_normal_model).get_trace(Y)
    flags = {name: compat.site_is_subsample(site) for name, site in trace.nodes.items()}
    assert flags["data"] and not flags["loc"] and not flags["y"], RECHECK


def test_pyro_samples_lists_a_modules_own_sample_attributes():
    class Module(PyroModule):
        def __init__(self):
            super().__init__()
            self.child = PyroModule()
            self.weight = PyroSample(dist.Normal(0.0, 1.0))
            self.child.bias = PyroSample(dist.Normal(0.0, 1.0))

        def forward(self):
            return self.weight, self.child.bias

    module = Module()
    assert list(compat.module_sample_attributes(module)) == ["weight"], RECHECK
    assert list(compat.module_sample_attributes(module.child)) == ["bias"], RECHECK
    trace = poutine.trace(module).get_trace()
    names = {
        compat.module_site_name(module, "weight"),
        compat.module_site_name(module.child, "bias"),
    }
    assert names == {"weight", "child.bias"} <= set(trace.nodes), RECHECK  # after a run


@pytest.mark.parametrize("kernel_class", [HMC, NUTS])
def test_the_hmc_kernel_state_read_for_sample_stats(kernel_class):
    assert _parameters(kernel_class._sample_r) == ["self", "name"], RECHECK
    assert _parameters(kernel_class._fetch_from_cache) == ["self"], RECHECK
    assert _parameters(kernel_class._kinetic_energy) == ["self", "r_unscaled"], RECHECK
    kernel = kernel_class(_normal_model)
    with pyro.get_param_store().scope():
        kernel.setup(3, Y)
        assert compat.num_warmup_transitions(kernel) == 3
        assert compat.num_transitions(kernel) == 0
        assert compat.num_divergences(kernel) == 0
        params = kernel.sample(kernel.initial_params)
        assert compat.num_transitions(kernel) == 1
        assert 0.0 <= compat.mean_accept_prob(kernel) <= 1.0
        energy = compat.potential_energy(kernel)
        # the cached potential energy is minus the log joint at the kept state
        loc = params["loc"]
        log_joint = dist.Normal(0.0, 1.0).log_prob(loc) + dist.Normal(loc, 1.0).log_prob(Y).sum()
        torch.testing.assert_close(energy, -log_joint)
        r = {("loc",): torch.tensor([2.0])}
        kinetic = compat.kinetic_energy(kernel, r)
    assert float(kinetic) > 0  # 0.5 rᵀ M⁻¹ r with a positive-definite M⁻¹


def test_nuts_build_tree_and_its_tree_fields():
    expected = ["self", "z", "r", "z_grads", "log_slice", "direction", "tree_depth"]
    assert _parameters(NUTS._build_tree)[: len(expected)] == expected, RECHECK
    fields = nuts_module._TreeInfo._fields
    assert {"diverging", "turning", "num_proposals"} <= set(fields), RECHECK


def test_the_hooks_fire_once_per_transition_and_per_top_level_doubling():
    kernel = RecordingNUTS(_normal_model, max_tree_depth=3)
    with pyro.get_param_store().scope():
        kernel.setup(0, Y)
        kernel.sample(kernel.initial_params)
    trees = kernel.transition_trees
    assert 1 <= len(trees) <= 3  # one per doubling, never the recursion's inner calls
    depth, n_steps = compat.doubling_summary(trees)
    assert kernel.draw_stats[0]["tree_depth"] == depth and n_steps >= 2**depth - 1
    hmc = RecordingHMC(_normal_model, num_steps=2)
    with pyro.get_param_store().scope():
        hmc.setup(0, Y)
        hmc.sample(hmc.initial_params)
    assert torch.isfinite(torch.tensor(hmc.draw_stats[0]["energy"]))  # on_momentum ran


def test_mcmc_sampler_protocol_structure_draws_then_diagnostics():
    assert hasattr(mcmc_api, "_MultiSampler") and hasattr(mcmc_api, "_UnarySampler"), RECHECK
    for sampler in (mcmc_api._MultiSampler, mcmc_api._UnarySampler):
        assert callable(sampler.run) and callable(sampler.terminate), RECHECK
    mcmc = MCMC(HMC(_normal_model, num_steps=2), num_samples=4, warmup_steps=2)
    assert not compat.runs_in_worker_processes(mcmc)
    recorder = compat.ChainRecorder(mcmc)
    with pyro.get_param_store().scope():
        mcmc.run(Y)
    assert recorder.structure == {"loc": torch.Size([])}
    assert len(recorder.draws[0]) == 4 and "divergences" in recorder.diagnostics[0]
    unflat = recorder.unflatten([0], 4)
    torch.testing.assert_close(unflat["loc"], mcmc.get_samples(group_by_chain=True)["loc"])
    compat.stop_workers(mcmc)  # in-process chains: nothing to stop, and no error


def test_messenger_subclasses_receive_sample_messages_through_pyro_sample():
    """``model_checks`` and ``posterior`` write handlers as Messenger subclasses with a
    ``_pyro_sample`` method (Pyro's documented extension protocol)."""
    seen = []

    class Spy(poutine.messenger.Messenger):
        def _pyro_sample(self, msg):
            keys = "infer" in msg and "cond_indep_stack" in msg
            seen.append((msg["name"], msg["is_observed"], keys))

    with Spy():
        _normal_model(Y)
    assert ("loc", False, True) in seen and ("y", True, True) in seen, RECHECK


def test_the_mean_field_elbo_internals_have_the_signatures_meanfieldelbo_uses():
    from pyro.infer import TraceMeanField_ELBO

    assert _parameters(TraceMeanField_ELBO._get_trace) == [
        "self",
        "model",
        "guide",
        "args",
        "kwargs",
    ], RECHECK
    assert _parameters(TraceMeanField_ELBO._differentiable_loss_particle) == [
        "self",
        "model_trace",
        "guide_trace",
    ], RECHECK
    expected = ["graph_type", "max_plate_nesting", "model", "guide", "args", "kwargs"]
    assert _parameters(compat.get_importance_trace)[: len(expected)] == expected, RECHECK
    assert _parameters(compat.check_mean_field_requirement) == ["model_trace", "guide_trace"]
    assert _parameters(compat.prune_subsample_sites) == ["trace"], RECHECK
    assert _parameters(compat.scale_and_mask) == ["tensor", "scale", "mask"], RECHECK
    assert _parameters(compat.is_validation_enabled) == [], RECHECK


def test_the_mean_field_elbo_internals_behave_as_meanfieldelbo_expects():
    def guide(y):
        pyro.sample("loc", dist.Normal(0.3, 0.5))

    with pyro.validation_enabled(True):
        assert compat.is_validation_enabled() is True
        model_trace, guide_trace = compat.get_importance_trace(
            "flat", 1, _normal_model, guide, (Y,), {}
        )
        compat.check_mean_field_requirement(model_trace, guide_trace)  # same order: no warning
    with pyro.validation_enabled(False):
        assert compat.is_validation_enabled() is False
    # the plate's subsample site is pruned, and every site's log density is computed
    assert "data" not in model_trace.nodes and "loc" in guide_trace.nodes
    loc = guide_trace.nodes["loc"]["value"]
    torch.testing.assert_close(
        model_trace.nodes["y"]["log_prob_sum"], dist.Normal(loc, 1.0).log_prob(Y).sum()
    )
    full = poutine.trace(_normal_model).get_trace(Y)
    assert "data" in full.nodes and "data" not in compat.prune_subsample_sites(full).nodes
    term = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.tensor([True, False, True])
    torch.testing.assert_close(
        compat.scale_and_mask(term, scale=2.0, mask=mask), torch.tensor([2.0, 0.0, 6.0])
    )
