"""MeanFieldELBO gives Pyro's TraceMeanField_ELBO loss and gradients while skipping the latent
sites' log densities."""

import pyro
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO

from probtransformer.inference._runtime import pyro_scope
from probtransformer.inference.vi.elbo import MeanFieldELBO
from probtransformer.inference.vi.guides import build_guide
from probtransformer.models import SequenceClassifier, SequenceRegressor


def _data(regression: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 5, 3, generator=g)
    y = x[:, :, 0].mean(1) if regression else torch.randint(0, 4, (12,), generator=g)
    return x, y


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize(
    "model",
    [
        SequenceClassifier(3, 4, 5, d_model=8, num_heads=2, num_layers=1),
        # the latent noise scale is positive: its AutoNormal site has no analytic KL, so it
        # takes the log p - log q estimate
        SequenceRegressor(3, 5, d_model=8, num_heads=2, num_layers=1),
    ],
)
def test_loss_and_gradients_equal_pyros_trace_mean_field_elbo(model, validate):
    x, y = _data(isinstance(model, SequenceRegressor))
    with pyro_scope():
        guide = build_guide("normal", model, init_scale=0.1)
        ours, pyros = MeanFieldELBO()(model, guide), TraceMeanField_ELBO()(model, guide)
        pyros(x, y, None, num_data=100)  # creates the guide's parameters
        params = [p for p in pyros.parameters() if p.requires_grad]
        results = []
        for loss_fn in (ours, pyros):
            pyro.set_rng_seed(1)
            with pyro.validation_enabled(validate):
                loss = loss_fn(x, y, None, num_data=100)
            results.append((loss, torch.autograd.grad(loss, params)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
