"""The batched deep ensemble: M MAP fits as one optimisation through the draw dim
(``inference.ensembles.batched``, ``fit_ensemble(batched=...)``)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroSample

from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_ensemble, load_posterior
from probtransformer.inference.ensembles.batched import MembersDoNotVectorize
from probtransformer.models import SequenceClassifier

MEMBERS = 3


def small_model(dropout: float = 0.0) -> SequenceClassifier:
    return SequenceClassifier(
        in_features=8, num_classes=10, max_len=8, d_model=8, num_heads=2, d_ff=16, dropout=dropout
    )


@pytest.fixture(scope="module")
def train(digits):
    return digits.train[:40]


@pytest.mark.parametrize(
    "schedule",
    # 10 steps: over 30, the larger rates of this schedule amplify rounding past 1e-5 (as
    # lr_decay=0.5 on the default schedule does), though both fits take the same rates
    [{}, dict(num_steps=10, lr_warmup=0.2, lr_schedule="cosine", lr_decay=0.0)],
    ids=["exponential", "warmup-cosine"],
)
def test_batched_members_equal_the_sequential_ones_when_nothing_random_differs(train, schedule):
    """Full-batch steps and no dropout: the only differences left are rounding, so every
    member's latents and point-estimate parameters equal its sequential fit within 1e-5
    (both fits on the same learning-rate schedule)."""
    fit = dict(num_steps=30, batch_size=len(train), lr=1e-2, n_members=MEMBERS, progress=False)
    fit |= schedule
    batched = fit_ensemble(small_model(), train, batched=True, **fit)
    sequential = fit_ensemble(small_model(), train, batched=False, **fit)
    assert (batched.record["batched"], sequential.record["batched"]) == (True, False)
    assert set(batched.samples) == set(sequential.samples)
    for name, value in batched.samples.items():
        assert value.shape == sequential.samples[name].shape == (1, MEMBERS, *value.shape[2:])
        torch.testing.assert_close(value, sequential.samples[name], rtol=0, atol=1e-5)
    assert set(batched.members) == set(sequential.members)
    for name, value in batched.members.items():
        torch.testing.assert_close(value, sequential.members[name], rtol=0, atol=1e-5)
    for b, s in zip(batched.record["members"], sequential.record["members"], strict=True):
        assert b["seed"] == s["seed"]
        assert b["final_loss"] == pytest.approx(s["final_loss"], rel=1e-5)
    # the members differ from each other (their own starts), latents and plain parameters
    embedding = batched.members["embedding.projection.weight"][0]
    assert (embedding[0] - embedding[1]).abs().max() > 1e-2
    # the model holds member 0's plain parameters
    for name, value in batched.model.named_parameters():
        assert torch.equal(value, batched.members[name][0, 0])


def test_batched_ensemble_with_dropout_and_mini_batches_predicts_saves_and_loads(train, tmp_path):
    post = fit_ensemble(
        small_model(dropout=0.1), train, n_members=MEMBERS, num_steps=20, batch_size=16,
        lr=1e-2, seed=3, progress=False,
    )  # fmt: skip
    record = post.record
    assert record["batched"] is True and "batched_skipped" not in record
    assert [m["seed"] for m in record["members"]] == [3, 4, 5]
    assert record["num_steps"] == 20 and record["batch_size"] == 16
    probs = post.predict(train.x[:5]).probs
    assert probs.shape == (MEMBERS, 5, 10)
    assert (probs[0] - probs[1]).abs().max() > 1e-3
    post.save(tmp_path / "run")
    loaded = load_posterior(tmp_path / "run")
    assert torch.equal(loaded.predict(train.x[:5]).probs, probs)


class PlainWeightRegression(PyroModule):
    """A plain weight used as ``x @ w``: right for one member, but ``(M, 1, P)`` members do
    not broadcast through it."""

    likelihood_site = "y"

    def __init__(self) -> None:
        super().__init__()
        self.config = {}
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.b = PyroSample(dist.Normal(0.0, 1.0))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        loc = x @ self.w + self.b
        with pyro.plate("data", num_data or len(x), subsample=torch.arange(len(x))):
            return pyro.sample("y", dist.Normal(loc, 1.0), obs=y)


@pytest.fixture
def regression() -> SequenceData:
    x = torch.randn(12, 2, generator=torch.Generator().manual_seed(0))
    return SequenceData(x, x @ torch.tensor([1.0, -1.0]))


def test_a_model_whose_members_do_not_vectorize(regression):
    fit = dict(n_members=2, num_steps=3, batch_size=12, progress=False)
    words = r"cannot batch .*\(members, 1, \*shape\)\): the model fails on .*batched=False"
    with pytest.raises(MembersDoNotVectorize, match=words):
        fit_ensemble(PlainWeightRegression(), regression, batched=True, **fit)
    post = fit_ensemble(PlainWeightRegression(), regression, **fit)  # batched=None: sequential
    assert post.record["batched"] is False
    assert "cannot batch the members of PlainWeightRegression" in post.record["batched_skipped"]
    assert post.members["w"].shape == (1, 2, 2)


def test_an_ensemble_of_plain_networks_is_fitted_one_member_at_a_time(train):
    model = SequenceClassifier(8, 10, 8, d_model=8, num_heads=2, d_ff=16, bayesian=())
    post = fit_ensemble(model, train, n_members=2, num_steps=3, progress=False)
    assert post.record["batched"] is False
    assert "batches latent sites only" in post.record["batched_skipped"]
    assert post.predict(train.x[:3]).probs.shape == (2, 3, 10)


def test_sequential_members_checkpoint_and_resume_in_their_own_directories(train, tmp_path):
    fit = dict(n_members=2, batched=False, num_steps=6, batch_size=16, progress=False)
    first = fit_ensemble(
        small_model(), train, checkpoint_every=3, checkpoint_dir=tmp_path / "ck", **fit
    )
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["member-0", "member-1"]
    resumed = fit_ensemble(small_model(), train, resume_from=tmp_path / "ck", **fit)
    assert [m["final_loss"] for m in resumed.record["members"]] == [
        m["final_loss"] for m in first.record["members"]
    ]


@pytest.mark.parametrize(
    "options, error, words",
    [
        (dict(batched="yes"), TypeError, "batched must be True, False or None"),
        (dict(batched=0), TypeError, "batched must be True, False or None, got 0"),
        (dict(batched=True, checkpoint_every=5), TypeError, "does not checkpoint"),
        (dict(num_stepz=5), TypeError, "fit_ensemble\\(\\): .*num_stepz"),
    ],
)
def test_bad_batched_settings_are_refused(train, options, error, words):
    with pytest.raises(error, match=words):
        fit_ensemble(small_model(), train, n_members=2, num_steps=2, progress=False, **options)
