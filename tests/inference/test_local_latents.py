"""Local latents of a user's model (one value per training row) are kept by fit_mcmc.

Eight schools (Rubin 1981; Gelman et al., BDA3 §5.5), non-centred as posteriordb's
``eight_schools_noncentered``: ``theta_j = mu + tau * theta_trans_j``, ``theta_trans_j ~ N(0, 1)``
sampled inside the data plate. Each school's standard error ``sigma_j`` is its input ``x_j``.
"""

from unittest import mock

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer.mcmc import MCMC
from pyro.infer.reparam import TransformReparam
from pyro.nn import PyroModule, PyroSample

from probtransformer.datasets import SequenceData
from probtransformer.inference import Posterior, fit_mcmc, load_posterior
from probtransformer.models import register_model

Y = [28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]
SIGMA = [15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]

#: posteriordb eight_schools-eight_schools_noncentered reference (Stan, 10 x 1,000 draws):
#: posterior mean and sd of mu and tau.
REFERENCE = {"mu": (4.41, 3.31), "tau": (3.60, 3.20)}

#: Kept draws per chain (2 chains; 150 warm-up transitions each).
DRAWS = 150

#: 2 chains x 150 draws leave a Monte Carlo error of about 0.1-0.2 reference sd on these means
#: (tau's heavy tail the larger); half a reference sd is the tolerance.
TOLERANCE_SD = 0.5


@register_model  # saved posteriors of it may be loaded
class EightSchools(PyroModule):
    """``y_j ~ N(mu + tau * theta_trans_j, sigma_j)`` with ``x = sigma (J, 1)``, ``y (J,)``."""

    likelihood_site = "y"

    def __init__(self) -> None:
        super().__init__()
        self.config = {}
        self.mu = PyroSample(dist.Normal(0.0, 5.0))
        self.tau = PyroSample(dist.HalfCauchy(5.0))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        mu, tau = self.mu, self.tau  # (*draws); read before the data plate
        sigma = x[:, 0]  # (J,)
        with pyro.plate("data", num_data or len(x), subsample=torch.arange(len(x))):
            theta_trans = pyro.sample("theta_trans", dist.Normal(0.0, 1.0))  # (*draws, J)
            return pyro.sample("y", dist.Normal(mu + tau * theta_trans, sigma), obs=y)


class ReparamInsidePlate(EightSchools):
    """``TransformReparam`` entered inside the data plate: Pyro's initialisation then draws one
    ``theta_base`` for all schools, so HMC would sample a different model."""

    def forward(self, x, y=None, mask=None, *, num_data=None):
        mu, tau = self.mu, self.tau
        with pyro.plate("data", num_data or len(x), subsample=torch.arange(len(x))):
            with poutine.reparam(config={"theta": TransformReparam()}):
                affine = dist.transforms.AffineTransform(mu, tau)
                theta = pyro.sample(
                    "theta", dist.TransformedDistribution(dist.Normal(0.0, 1.0), affine)
                )
            return pyro.sample("y", dist.Normal(theta, x[:, 0]), obs=y)


@pytest.fixture(scope="module")
def schools() -> SequenceData:
    return SequenceData(torch.tensor(SIGMA)[:, None], torch.tensor(Y))


@pytest.fixture(scope="module")
def posterior(schools) -> Posterior:
    return fit_mcmc(
        EightSchools(), schools, num_chains=2, num_warmup=150, num_samples=DRAWS, progress=False
    )


def test_the_local_latent_is_kept_with_one_value_per_school(posterior):
    assert posterior.local_shapes == {"theta_trans": torch.Size([])}
    assert set(posterior.latent_shapes) == {"mu", "tau"}
    assert posterior.samples["theta_trans"].shape == (2, DRAWS, 8)
    assert posterior.samples["mu"].shape == (2, DRAWS)
    assert len(posterior.record["training_data_sha256"]) == 64


def test_arviz_has_it_with_the_obs_dim_and_the_posterior_matches_posteriordb(posterior, schools):
    idata = posterior.to_inference_data(schools)
    assert idata.posterior["theta_trans"].dims == ("chain", "draw", "obs")
    assert idata.posterior["theta_trans"].shape == (2, DRAWS, 8)
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "obs")
    for name, (mean, sd) in REFERENCE.items():
        assert abs(float(idata.posterior[name].mean()) - mean) < TOLERANCE_SD * sd, name


def test_the_training_log_likelihood_is_conditioned_on_the_kept_draws(posterior, schools):
    s = posterior.samples
    theta = s["mu"][..., None] + s["tau"][..., None] * s["theta_trans"]  # (chain, draw, 8)
    expected = dist.Normal(theta, schools.x[:, 0]).log_prob(schools.y)
    torch.testing.assert_close(posterior.log_likelihood(schools), expected)


def test_other_rows_draw_the_local_latent_afresh(posterior, schools):
    s = posterior.samples
    theta = s["mu"][..., None] + s["tau"][..., None] * s["theta_trans"]
    kept = dist.Normal(theta, schools.x[:, 0]).log_prob(schools.y)[..., :4]
    other = posterior.log_likelihood(schools[:4])  # the first four schools only: not the data
    assert other.shape == (2, DRAWS, 4)
    assert not torch.allclose(other, kept)
    prediction = posterior.predict(schools.x[:3], num_samples=50)
    assert prediction.samples.shape == (50, 3)
    assert torch.isfinite(prediction.samples).all()


def test_save_and_load_keep_the_local_draws(posterior, schools, tmp_path):
    posterior.save(tmp_path / "post")
    loaded = load_posterior(tmp_path / "post")
    assert loaded.local_shapes == posterior.local_shapes
    for name, value in posterior.samples.items():
        assert torch.equal(loaded.samples[name], value), name
    torch.testing.assert_close(loaded.log_likelihood(schools), posterior.log_likelihood(schools))


def test_local_draws_of_the_wrong_shape_are_refused(posterior):
    samples = dict(posterior.samples, theta_trans=posterior.samples["theta_trans"][..., None])
    with pytest.raises(ValueError, match=r"samples\['theta_trans'\] must have shape"):
        Posterior(posterior.model, samples=samples, record={}, example=posterior.example)


def test_a_mismatch_is_refused_before_the_first_transition(schools):
    with mock.patch.object(MCMC, "run", side_effect=AssertionError("sampling started")):
        with pytest.raises(ValueError, match=r"'theta_base': sampled \(\), kept \(2,\)"):
            fit_mcmc(ReparamInsidePlate(), schools, num_chains=1, num_samples=5, progress=False)
