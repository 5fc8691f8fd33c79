"""MAP, MC dropout and deep ensembles behind the ``Posterior`` API
(``inference.ensembles.baselines``).

Tiny fits: a d_model-8 classifier with dropout 0.1 on 48 digits, 60 full-batch steps (< 1 s).
"""

import contextlib
import io
import json

import pytest
import torch

from probtransformer.cli import main
from probtransformer.inference import (
    Posterior,
    fit_ensemble,
    fit_map,
    fit_mc_dropout,
    fit_svi,
    load_posterior,
)
from probtransformer.inference.diagnostics._arviz import az
from probtransformer.inference.posterior.prediction import PredictionEngine
from probtransformer.models import SequenceClassifier

FIT = dict(num_steps=60, batch_size=48, lr=1e-2, progress=False)
TRAIN_ROWS, MEMBERS = 48, 3


def small_model(dropout: float = 0.1) -> SequenceClassifier:
    return SequenceClassifier(
        8, 10, 8, d_model=8, num_heads=2, num_layers=1, d_ff=16, dropout=dropout
    )


def dropouts(post: Posterior) -> list[torch.nn.Dropout]:
    return [m for m in post.model.modules() if isinstance(m, torch.nn.Dropout)]


@pytest.fixture(scope="module")
def train(digits):
    return digits.train[:TRAIN_ROWS]


@pytest.fixture(scope="module")
def x(digits):
    return digits.test.x[:12]


@pytest.fixture(scope="module")
def mc(train):
    return fit_mc_dropout(small_model(), train, seed=0, **FIT)


@pytest.fixture(scope="module")
def ensemble(train):
    # sequential: member k is fit_map(seed=k) bit for bit (test_batched_ensemble: the default)
    return fit_ensemble(small_model(), train, n_members=MEMBERS, seed=0, batched=False, **FIT)


# -- MAP --------------------------------------------------------------------------------------


def test_fit_map_is_fit_svi_with_the_delta_guide(train, x):
    post = fit_map(small_model(), train, seed=3, **FIT)
    same = fit_svi(small_model(), train, guide="delta", seed=3, **FIT)
    assert post.record["method"] == "map" and post.is_point_estimate
    assert post.record["elbo"] == same.record["elbo"]
    ignore = {"method", "seconds"}
    assert {k: v for k, v in post.record.items() if k not in ignore} == {
        k: v for k, v in same.record.items() if k not in ignore
    }
    assert torch.equal(post.predict(x).probs, same.predict(x).probs)
    assert post.predict(x).probs.shape == (1, len(x), 10)


def test_fit_map_refuses_guide_and_unknown_arguments(train):
    with pytest.raises(TypeError, match="'guide'"):
        fit_map(small_model(), train, guide="normal")
    with pytest.raises(TypeError, match="'steps'"):
        fit_map(small_model(), train, steps=5)


# -- MC dropout -------------------------------------------------------------------------------


def test_mc_dropout_draws_differ_and_are_seeded(mc, x):
    assert mc.record["method"] == "mc-dropout" and mc.record["dropout"] == [0.1]
    assert not mc.is_point_estimate
    pred = mc.predict(x, num_samples=16, seed=1)
    assert pred.probs.shape == (16, len(x), 10)
    for a, b in ((0, 1), (1, 2), (0, 15)):  # every pass has its own dropout masks
        assert (pred.probs[a] - pred.probs[b]).abs().max() > 1e-3
    assert (pred.epistemic > 0).all()
    assert torch.equal(mc.predict(x, num_samples=16, seed=1).probs, pred.probs)
    assert not torch.equal(mc.predict(x, num_samples=16, seed=2).probs, pred.probs)
    assert all(not m.training for m in dropouts(mc)) and not mc.model.training
    # the latent sites keep their MAP values in every draw
    draws = mc.draws(5)
    assert all(v.shape[:2] == (1, 5) and torch.equal(v[0, 0], v[0, 4]) for v in draws.values())


def test_mc_dropout_differs_from_the_dropout_off_prediction(mc, x):
    off = Posterior(mc.model, guide=mc.guide, record=mc.record, example=mc.example)
    assert off.is_point_estimate
    mean_on = mc.predict(x, num_samples=16).mean
    assert not torch.allclose(mean_on, off.predict(x).mean)


def test_mc_dropout_restores_eval_mode_on_errors(mc, x):
    def boom(trace):
        assert all(m.training for m in dropouts(mc))  # dropout on during the pass
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        PredictionEngine(mc.model).run(mc.draw(3), x, None, None, boom, seed=0, batch_size=8)
    assert all(not m.training for m in dropouts(mc))


def test_mc_dropout_needs_dropout(train):
    with pytest.raises(ValueError, match=r"no torch.nn.Dropout .*dropout=0.1\)"):
        fit_mc_dropout(small_model(dropout=0.0), train, **FIT)
    with pytest.raises(TypeError, match="'guide'"):
        fit_mc_dropout(small_model(), train, guide="delta")


# -- ensembles --------------------------------------------------------------------------------


def test_ensemble_members_are_independent_map_fits(ensemble, train, x):
    record = ensemble.record
    assert record["method"] == "ensemble" and record["n_members"] == MEMBERS
    assert [m["seed"] for m in record["members"]] == [0, 1, 2]
    assert all(m["final_loss"] > 0 and m["seconds"] > 0 for m in record["members"])
    assert record["seconds"] >= sum(m["seconds"] for m in record["members"])
    assert not ensemble.is_point_estimate
    pred = ensemble.predict(x)  # all members by default
    assert pred.probs.shape == (MEMBERS, len(x), 10)
    assert (pred.probs[0] - pred.probs[1]).abs().max() > 1e-3
    assert (pred.epistemic > 0).all()
    # member 1 is fit_map with seed 1, bit for bit, point-estimate parameters included
    member = fit_map(small_model(), train, seed=1, **FIT)
    assert torch.equal(pred.probs[1], member.predict(x).probs[0])
    params = dict(member.model.named_parameters())
    assert set(ensemble.members) == set(params)
    assert all(torch.equal(ensemble.members[k][0, 1], v) for k, v in params.items())
    # the point-estimate embedding differs between members, not only the latent sites
    embedding = ensemble.members["embedding.projection.weight"][0]  # (members, d_model, F)
    assert not torch.equal(embedding[0], embedding[1])
    # predictions leave the model with the first member's parameters
    assert all(
        torch.equal(ensemble.members[k][0, 0], v) for k, v in ensemble.model.named_parameters()
    )


def test_ensemble_num_samples_thins_never_more_than_members(ensemble, x):
    assert ensemble.predict(x, num_samples=2).probs.shape[0] == 2
    assert ensemble.predict(x, num_samples=100).probs.shape[0] == MEMBERS
    all_probs = ensemble.predict(x).probs
    assert torch.equal(ensemble.predict(x, num_samples=1).probs[0], all_probs[0])
    att = ensemble.attention(x[:2])
    assert att.samples.shape == (1, MEMBERS, 2, 1, 2, 8, 8)
    assert not torch.equal(att.samples[0, 0], att.samples[0, 1])


@pytest.mark.parametrize(
    "n_members, error", [(0, ValueError), (True, TypeError), ("3", TypeError), (2.0, TypeError)]
)
def test_ensemble_n_members_checked(n_members, error, train):
    with pytest.raises(error, match="n_members"):
        fit_ensemble(small_model(), train, n_members=n_members, **FIT)


# -- the rest of the Posterior API ------------------------------------------------------------


def test_inference_data_and_diagnose(ensemble, mc, train, capsys):
    idata = ensemble.to_inference_data(train, attention_obs=2)
    assert dict(idata.posterior.sizes)["chain"] == 1
    assert idata.posterior.sizes["draw"] == MEMBERS
    assert idata.log_likelihood["y"].shape == (1, MEMBERS, TRAIN_ROWS)
    assert idata.posterior["attention"].shape == (1, MEMBERS, 2, 1, 2, 8, 8)
    assert idata.attrs["method"] == "ensemble"
    idata = mc.to_inference_data(train, attention_obs=0, num_samples=6)
    assert (idata.posterior.sizes["chain"], idata.posterior.sizes["draw"]) == (1, 6)
    assert idata.log_likelihood["y"].shape == (1, 6, TRAIN_ROWS)

    table = ensemble.diagnose(train)
    out = capsys.readouterr().out
    assert "R-hat and ESS do not apply: ensemble draws are independently fitted members" in out
    assert "LOO: elpd_loo" in out and table["r_hat_max"].isna().all()
    mc.diagnose(train, num_samples=8)
    out = capsys.readouterr().out
    assert "R-hat and ESS do not apply: MC-dropout draws are forward passes" in out
    assert "PSIS k-hat of the guide" not in out  # a delta guide is no importance proposal
    with pytest.raises(ValueError, match="non-degenerate SVI guide"):
        mc.log_importance_weights(train)


def test_save_load_round_trip(ensemble, mc, x, tmp_path):
    ensemble.save(tmp_path / "ensemble")
    tensors = torch.load(tmp_path / "ensemble" / "tensors.pt", weights_only=True)
    assert set(tensors["members"]) == {name for name, _ in ensemble.model.named_parameters()}
    loaded = load_posterior(tmp_path / "ensemble")
    assert loaded.record == ensemble.record and loaded.members is not None
    assert torch.equal(loaded.predict(x).probs, ensemble.predict(x).probs)
    assert torch.equal(loaded.attention(x[:2]).samples, ensemble.attention(x[:2]).samples)
    assert "members=3" in repr(loaded) and "method='ensemble'" in repr(loaded)

    mc.save(tmp_path / "mc")
    assert "members" not in torch.load(tmp_path / "mc" / "tensors.pt", weights_only=True)
    loaded = load_posterior(tmp_path / "mc")
    assert loaded.mc_dropout and "MC dropout" in repr(loaded)
    assert torch.equal(
        loaded.predict(x, num_samples=8, seed=4).probs, mc.predict(x, num_samples=8, seed=4).probs
    )

    # a save from before MC dropout and ensembles (no "mc_dropout" key) still loads
    meta_path = tmp_path / "mc" / "posterior.json"
    meta = json.loads(meta_path.read_text())
    del meta["mc_dropout"]
    meta_path.write_text(json.dumps(meta))
    old = load_posterior(tmp_path / "mc")
    assert not old.mc_dropout and old.members is None and old.is_point_estimate


def test_posterior_checks_members_and_dropout(ensemble, mc):
    with pytest.raises(ValueError, match="members need samples"):
        Posterior(mc.model, guide=mc.guide, record={}, example=mc.example, members=ensemble.members)
    members = dict(ensemble.members)
    members.pop(next(iter(members)))
    with pytest.raises(ValueError, match="every parameter of the model"):
        Posterior(
            ensemble.model,
            samples=ensemble.samples,
            members=members,
            record={},
            example=ensemble.example,
        )
    no_dropout = small_model(dropout=0.0)
    with pytest.raises(ValueError, match="mc_dropout=True needs dropout"):
        Posterior(no_dropout, guide=mc.guide, record={}, example=mc.example, mc_dropout=True)


# -- command line -----------------------------------------------------------------------------

TINY = [
    "--num-train", "32", "--num-steps", "10", "--d-model", "8", "--num-heads", "2",
    "--num-layers", "1", "--d-ff", "16", "--no-progress",
]  # fmt: skip


def _fit(out, *args) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["fit", "--out", str(out), *TINY, *args]) == 0
    return printed.getvalue()


def test_cli_ensemble(tmp_path, capsys):
    printed = _fit(tmp_path / "run", "--inference", "ensemble", "--n-members", "2")
    assert "ensemble (2 MAP members)" in printed
    record = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (record["inference"], record["n_members"], record["member_seeds"]) == (
        "ensemble",
        2,
        [0, 1],
    )
    assert record["num_samples"] == 2 and record["mean_epistemic"] > 0
    assert len(record["member_final_losses"]) == 2
    post = load_posterior(tmp_path / "run" / "posterior")
    assert post.record["method"] == "ensemble" and post.members is not None
    assert az.from_netcdf(tmp_path / "run" / "inference_data.nc").posterior.sizes["draw"] == 2
    assert main(["diagnose", str(tmp_path / "run")]) == 0
    assert "ensemble draws are independently fitted members" in capsys.readouterr().out


def test_cli_mc_dropout(tmp_path):
    printed = _fit(tmp_path / "run", "--inference", "mc-dropout", "--num-samples", "5")
    assert "mc-dropout (MAP, dropout 0.1 kept on)" in printed
    record = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (record["inference"], record["guide"], record["dropout"]) == (
        "mc-dropout",
        "delta",
        [0.1],
    )
    assert record["num_samples"] == 5 and record["mean_epistemic"] > 0
    assert load_posterior(tmp_path / "run" / "posterior").mc_dropout


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--n-members", "2"],
            "--n-members applies to --inference ensemble, mile and mola, not svi",
        ),
        (["--inference", "map", "--n-members", "2"], "--n-members applies to --inference ensemble"),
        (["--inference", "ensemble", "--n-members", "0"], "integer >= 1"),
        (["--inference", "ensemble", "--guide", "normal"], "fits guide 'delta'"),
        (["--inference", "mc-dropout", "--dropout", "0"], "needs dropout in the model"),
        (["--inference", "ensemble", "--num-chains", "2"], "applies to --inference mcmc"),
    ],
)
def test_cli_refuses_inapplicable_options(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", *TINY, *args]) == 2
    out, err = capsys.readouterr()
    assert message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
