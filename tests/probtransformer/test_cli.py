"""Tests of the `probtransformer` command line, run in-process through `main`.

One tiny SVI run and one tiny MCMC run (module-scoped) are shared by the fit, diagnose and
predict tests.
"""

import argparse
import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import probtransformer.inference
import probtransformer.plots
from probtransformer import datasets, metrics
from probtransformer.block import BAYESIAN_PARTS
from probtransformer.cli import main, mcmc_preset, options
from probtransformer.cli.options import mile_preset
from probtransformer.inference import (
    NonFiniteELBOError,
    fit_mcmc,
    fit_svi,
    load_posterior,
)
from probtransformer.inference.diagnostics._arviz import az
from probtransformer.inference.mcmc.chees import CHEES_TARGET_ACCEPT
from probtransformer.inference.mcmc.pyro_runner import RecordingNUTS
from probtransformer.models import SequenceClassifier
from probtransformer.models._config import usable_memory
from probtransformer.tasks.tagging import TaggingTask

TINY = [
    "--num-steps", "30", "--d-model", "16", "--num-heads", "2", "--num-layers", "1",
    "--num-samples", "10", "--no-progress",
]  # fmt: skip
NUM_SAMPLES = 10
#: The methods that read the SVI options, as the errors of the others name them.
SVI_METHODS = "svi, map, mc-dropout, ensemble, mile, laplace and mola"
RUN_FILES = {"metrics.json", "inference_data.nc", "posterior", "attention.png", "reliability.png"}
RUN_FILES |= {"diagnostics.json"}  # written by fit since the restructure (issue 14)
METRIC_KEYS = {"accuracy", "nll", "ece", "brier", "mean_epistemic", "num_train", "num_test"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T, F, C = 8, 8, 10  # digits: 8 steps of 8 pixels, 10 classes
PRED_COLUMNS = [f"prob_{c}" for c in range(C)] + ["predicted", "entropy", "aleatoric", "epistemic"]
# The preset's model (every part latent) at toy sizes; the preset itself runs for minutes
TINY_MCMC_MODEL = ["--d-model", "8", "--num-heads", "2", "--d-ff", "16"]
# NUTS: about 3 s
MCMC_CHAINS, MCMC_WARMUP, MCMC_DRAWS, MCMC_TRAIN, MCMC_DEPTH = 2, 6, 5, 24, 3
TINY_MCMC = [
    "--inference", "mcmc", "--kernel", "nuts", "--num-train", str(MCMC_TRAIN),
    "--num-warmup", str(MCMC_WARMUP), "--num-draws", str(MCMC_DRAWS),
    "--max-tree-depth", str(MCMC_DEPTH), *TINY_MCMC_MODEL, "--no-progress",
]  # fmt: skip
# ChEES, the preset's kernel (no --kernel): 4 chains from 2 MAP starts
CHEES_CHAINS, CHEES_STARTS, CHEES_WARMUP, CHEES_DRAWS = 4, 2, 8, 4
TINY_CHEES = [
    "--inference", "mcmc", "--num-train", str(MCMC_TRAIN), "--num-chains", str(CHEES_CHAINS),
    "--num-starts", str(CHEES_STARTS), "--num-warmup", str(CHEES_WARMUP),
    "--num-draws", str(CHEES_DRAWS), "--map-steps", "20", *TINY_MCMC_MODEL, "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def splits() -> datasets.DatasetSplits:
    """The digits splits that `probtransformer fit` loads with its default seed 0."""
    return datasets.load("digits", seed=0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run directory, printed output) of one tiny `probtransformer fit`."""
    root = tmp_path_factory.mktemp("cli")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["fit", "--out", str(root / "run"), *TINY])
    assert status == 0
    return root / "run", printed.getvalue()


@pytest.fixture(scope="module")
def mcmc_run(tmp_path_factory):
    """(run directory, printed output) of one tiny `probtransformer fit --inference mcmc`."""
    root = tmp_path_factory.mktemp("cli-mcmc")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["fit", "--out", str(root / "run"), *TINY_MCMC])
    assert status == 0
    return root / "run", printed.getvalue()


@pytest.fixture(scope="module")
def chees_run(tmp_path_factory):
    """(run directory, printed output) of one tiny `fit --inference mcmc` with the preset's
    kernel (ChEES) and init (an ensemble of MAP starts)."""
    root = tmp_path_factory.mktemp("cli-chees")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["fit", "--out", str(root / "run"), *TINY_CHEES])
    assert status == 0
    return root / "run", printed.getvalue()


def _listing(path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*")}


# -- fit --------------------------------------------------------------------------------------


def test_fit_writes_run_directory(run):
    run_dir, _ = run
    assert {p.name for p in run_dir.parent.iterdir()} == {"run"}  # no staging dirs left
    assert {p.name for p in run_dir.iterdir()} == RUN_FILES
    assert {p.name for p in (run_dir / "posterior").iterdir()} == {
        "posterior.json",
        "tensors.pt",
    }
    for name in ("attention.png", "reliability.png"):
        assert (run_dir / name).read_bytes()[:8] == PNG_MAGIC


def test_fit_metrics_are_those_of_the_test_split(run, splits):
    run_dir, _ = run
    record = json.loads((run_dir / "metrics.json").read_text())
    assert METRIC_KEYS | {"seconds"} <= set(record)
    assert record["num_train"] == len(splits.train) == 1212
    assert record["num_test"] == len(splits.test) == 450
    assert 0 <= record["accuracy"] <= 1 and 0 <= record["ece"] <= 1
    assert 0 <= record["brier"] <= 2 and record["nll"] > 0
    assert record["mean_epistemic"] >= 0 and record["seconds"] > 0
    assert (record["dataset"], record["inference"], record["guide"]) == ("digits", "svi", "normal")
    assert (record["num_steps"], record["num_samples"], record["seed"]) == (30, NUM_SAMPLES, 0)
    fit_defaults = inspect.signature(fit_svi).parameters  # the optimiser's settings recorded
    assert (record["lr"], record["lr_decay"], record["batch_size"]) == tuple(
        fit_defaults[name].default for name in ("lr", "lr_decay", "batch_size")
    )

    # the same numbers from the saved posterior's test-split predictive (same draws and seed)
    pred = load_posterior(run_dir / "posterior").predict(
        splits.test.x, num_samples=NUM_SAMPLES, seed=0
    )
    probs = pred.mean.double()
    probs = probs / probs.sum(-1, keepdim=True)
    expected = metrics.classification_report(probs, splits.test.y)
    expected["ece"] = metrics.ece(probs, splits.test.y, n_bins=15)
    for key, value in expected.items():
        assert record[key] == pytest.approx(value, abs=1e-6), key
    assert record["mean_epistemic"] == pytest.approx(float(pred.epistemic.mean()), abs=1e-6)


def test_fit_prints_the_metrics(run):
    run_dir, printed = run
    record = json.loads((run_dir / "metrics.json").read_text())
    for key in ("accuracy", "nll", "ece", "brier", "mean_epistemic"):
        assert re.search(rf"^\s+{key}\s+{record[key]:.4f}", printed, re.MULTILINE), printed
    assert f"{record['num_train']} train / {record['num_test']} test" in printed


def test_fit_records_its_threads_and_why(run, mcmc_run):
    record = json.loads((run[0] / "metrics.json").read_text())
    # the d_model-16 model on 128 rows: one thread, whatever the machine
    assert record["threads"] == 1 and "too small" in record["threads_chosen"]
    record = json.loads((mcmc_run[0] / "metrics.json").read_text())
    assert (record["threads"], record["threads_chosen"]) == (1, "the mcmc preset")


def test_fit_threads_given_or_from_the_environment_are_kept(monkeypatch):
    from probtransformer.cli.threads import fit_threads

    given = argparse.Namespace(threads=2, threads_from=None, batch_size=None)
    assert fit_threads(given, None, range(10)) == (2, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    unset = argparse.Namespace(threads=None, threads_from=None, batch_size=None)
    assert fit_threads(unset, None, range(10)) == (torch.get_num_threads(), "OMP_NUM_THREADS")


def test_fit_inference_data_netcdf(run, splits):
    run_dir, _ = run
    idata = az.from_netcdf(run_dir / "inference_data.nc")
    assert {"posterior", "log_likelihood", "predictions"} <= set(idata.groups())
    log_lik = idata.log_likelihood["y"]
    assert dict(log_lik.sizes) == {"chain": 1, "draw": NUM_SAMPLES, "obs": len(splits.train)}
    assert (log_lik.values <= 0).all()  # log-probabilities of categorical labels
    assert idata.predictions["y"].sizes["test_obs"] == len(splits.test)
    assert "head.weight" in idata.posterior and "attention" in idata.posterior


def test_fit_help_shows_the_library_defaults(capsys):
    assert main(["fit", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    model = inspect.signature(SequenceClassifier.__init__).parameters
    fit = inspect.signature(fit_svi).parameters
    mcmc = inspect.signature(fit_mcmc).parameters
    preset, nuts = mcmc_preset(), mcmc_preset("nuts")
    for option, default, task in (
        ("--num-steps N optimisation steps", fit["num_steps"].default, TaggingTask),
        ("--lr LR initial Adam learning rate, in (0, 10]", fit["lr"].default, TaggingTask),
        (
            "--lr-decay F final learning rate as a fraction of --lr, in (0, 1] ([0, 1] with "
            "--lr-schedule cosine); 1 holds it constant",
            fit["lr_decay"].default,
            TaggingTask,
        ),
        (
            "--lr-warmup F fraction of the steps over which the learning rate rises linearly "
            "to --lr, in [0, 1)",
            fit["lr_warmup"].default,
            TaggingTask,
        ),
    ):
        key = option.split()[0][2:].replace("-", "_")
        assert f"{option} (default: {default}; tagging" in text
        shown = task.fit_preset[key]
        assert f"tagging: {shown}" in text or f"tagging, language-modeling: {shown}" in text
    # the text models' own defaults of model options
    dropout = "dropout probability, in [0, 1) (default: 0.1; tagging, language-modeling: 0.0; mcmc:"
    assert dropout in text
    # MCMC-only options: the preset kernel's value first, then kernels whose preset differs
    assert CHEES_TARGET_ACCEPT == 0.651 and mcmc["map_steps"].default == 1000
    for option, shown in (
        (
            "--kernel {nuts,hmc,chees,mclmc,adjusted-mclmc}",
            f"default: chees; mile: {mile_preset()['kernel']}",
        ),
        ("--num-chains N", f"default: {preset['num_chains']}; nuts, hmc: {nuts['num_chains']}"),
        (
            "--num-draws N",
            f"default: {preset['num_draws']}; nuts, hmc: {nuts['num_draws']}; "
            f"mile: {mile_preset()['num_draws']}",
        ),
        ("--num-starts M", f"default: {preset['num_starts']}"),
        ("--init {prior,map,ensemble}", "default: ensemble"),
        ("--target-accept-prob P", "default: 0.651; nuts, hmc: 0.8; adjusted-mclmc: 0.9"),
        ("--max-tree-depth N", "default: 6"),  # NUTS only: its preset
        ("--trajectory-length L", "default: 10 leapfrog steps; hmc: 0.5"),  # chees, then hmc
        ("--jit-compile, --no-jit-compile", "default: True"),  # NUTS and HMC only
        ("--map-steps N", "default: 1000"),
    ):
        # the option's last parenthesis: before the next option or group title ("model:")
        found = re.search(rf"{re.escape(option)} .*?\((default: [^()]*)\)(?= --| model:)", text)
        assert found and found.group(1) == shown, (option, found and found.group(1))
    mile = mile_preset()
    for option, default, mcmc_default, mile_default in (
        ("--d-model N model width", model["d_model"].default, preset["d_model"], mile["d_model"]),
        (
            "--num-heads N heads per layer",
            model["num_heads"].default,
            preset["num_heads"],
            mile["num_heads"],
        ),
    ):
        shown = f"default: {default}; mcmc: {mcmc_default}; mile: {mile_default}"
        assert re.search(rf"{re.escape(option)}[^(]*\({shown}\)", text)
    assert re.search(r"--num-train N [^(]*\(default: all\)", text)  # mcmc too: every row
    assert "posterior draws for predictions (default: 100; mcmc: every kept draw)" in text
    assert "one of: digits" in text


def test_map_fit_never_replaces_a_run_unasked(tmp_path, monkeypatch, capsys, one_error_line):
    monkeypatch.chdir(tmp_path)
    previous = tmp_path / "runs" / "digits-map"
    (previous / "posterior").mkdir(parents=True)
    (previous / "metrics.json").write_text("{}")
    (previous / "notes.txt").write_text("the user's own file")
    fast = [a if a != "30" else "5" for a in TINY]
    # the default --out holds a run: the fit goes to the first free runs/digits-map-N
    (tmp_path / "runs" / "digits-map-2").mkdir()  # taken, though empty
    assert main(["fit", "--inference", "map", *fast]) == 0
    printed = capsys.readouterr()
    assert "runs/digits-map holds an earlier run; this fit writes runs/digits-map-3" in printed.err
    assert "wrote runs/digits-map-3" in printed.out
    assert {p.name for p in previous.iterdir()} == {"posterior", "metrics.json", "notes.txt"}
    assert {p.name for p in (tmp_path / "runs" / "digits-map-3").iterdir()} == RUN_FILES
    # a given --out that holds a run is refused before fitting, naming --overwrite
    before = _listing(tmp_path)
    assert main(["fit", "--inference", "map", "--out", "runs/digits-map", *fast]) == 2
    assert "holds an earlier run; give --overwrite to replace it" in one_error_line(capsys)
    assert _listing(tmp_path) == before
    replace = ["fit", "--inference", "map", "--out", "runs/digits-map", "--overwrite", *fast]
    assert main(replace) == 2  # --overwrite never deletes files it did not write
    assert "notes.txt" in one_error_line(capsys)
    (previous / "notes.txt").unlink()
    assert main(replace) == 0
    printed = capsys.readouterr()
    assert "wrote runs/digits-map" in printed.out
    assert "--out runs/digits-map holds an earlier run; this fit replaces it" in printed.err
    assert {p.name for p in previous.iterdir()} == RUN_FILES
    record = json.loads((previous / "metrics.json").read_text())
    assert (record["inference"], record["guide"], record["num_steps"]) == ("map", "delta", 5)
    assert record["num_samples"] == 1 and record["mean_epistemic"] == 0.0  # a point estimate

    assert main(["diagnose", str(previous)]) == 0
    assert "LOO: a point estimate has one draw" in capsys.readouterr().out


# -- diagnose -----------------------------------------------------------------------------------


def test_diagnose_prints_table_verdict_and_loo(run, capsys, splits):
    run_dir, _ = run
    assert main(["diagnose", str(run_dir), "--num-samples", "20"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^head\.weight\s+160\s", out, re.MULTILINE)  # (d_model 16) x (10 classes)
    assert "verdict (svi, 1 chain(s) x 20 draws):" in out
    loo = re.search(r"^(ok|WARN)\s+LOO: elpd_loo (-?[\d.]+) .* of (\d+) ", out, re.MULTILINE)
    assert loo, out
    assert int(loo.group(3)) == len(splits.train)  # LOO over the reloaded training split
    assert float(loo.group(2)) < 0


# -- mcmc ---------------------------------------------------------------------------------------


def test_mcmc_fit_writes_run_directory(mcmc_run):
    run_dir, printed = mcmc_run
    assert {p.name for p in run_dir.parent.iterdir()} == {"run"}  # no staging dirs left
    assert {p.name for p in run_dir.iterdir()} == RUN_FILES
    for name in ("attention.png", "reliability.png"):
        assert (run_dir / name).read_bytes()[:8] == PNG_MAGIC
    header = f"mcmc (nuts, {MCMC_CHAINS} chain(s) x {MCMC_DRAWS} draws after {MCMC_WARMUP} warmup)"
    assert header in printed
    assert f"{MCMC_TRAIN} train / 450 test" in printed
    assert re.search(rf"^\s+divergences\s+\d+ of {MCMC_CHAINS * MCMC_DRAWS}$", printed, re.M)
    assert "PARTIAL" not in printed


def test_mcmc_fit_uses_the_preset_model(mcmc_run):
    post = load_posterior(mcmc_run[0] / "posterior")
    preset = mcmc_preset("nuts")
    assert preset["bayesian"] == BAYESIAN_PARTS  # every part latent: nothing fitted by MAP
    config = post.model.config
    for key in ("num_layers", "dropout"):  # left unset: the preset's
        assert config[key] == preset[key], key
    assert (config["d_model"], config["num_heads"], config["d_ff"]) == (8, 2, 16)  # given
    assert set(config["bayesian"]) == set(BAYESIAN_PARTS)
    assert post.record["point_estimates"] is None
    assert post.record["jit_compile"] is preset["jit_compile"] is True  # NUTS's preset
    assert post.samples["head.weight"].shape == (MCMC_CHAINS, MCMC_DRAWS, C, 8)


def test_mcmc_preset_is_the_quality_classifier_on_every_row():
    """The preset model is benchmarks/quality.py's classifier (d_model 32, 4 heads, 1 layer,
    d_ff 64), fully Bayesian, without dropout (MCMC runs in eval mode), on every training row."""
    for kernel in ("chees", "mclmc", "nuts", "hmc"):
        preset = mcmc_preset(kernel)
        model = {key: preset[key] for key in ("d_model", "num_heads", "num_layers", "d_ff")}
        assert model == dict(d_model=32, num_heads=4, num_layers=1, d_ff=64), kernel
        assert (preset["dropout"], preset["bayesian"]) == (0.0, BAYESIAN_PARTS)
        assert "num_train" not in preset and preset["threads"] == 1
        assert preset["kernel"] == kernel
    assert mcmc_preset()["kernel"] == "chees"
    assert mcmc_preset()["init"] == "ensemble"


def test_mcmc_preset_holds_only_the_options_of_its_kernel():
    chees, mclmc, nuts, hmc = map(mcmc_preset, ("chees", "mclmc", "nuts", "hmc"))
    assert chees["num_chains"] % chees["num_starts"] == 0  # whole superchains
    assert chees["num_chains"] // chees["num_starts"] >= 2  # nested R-hat within superchains
    assert {"max_tree_depth", "trajectory_length", "jit_compile"}.isdisjoint(chees)
    assert {"max_tree_depth", "trajectory_length", "jit_compile", "target_accept_prob"}.isdisjoint(
        mclmc
    )
    assert {"init", "num_starts", "trajectory_length"}.isdisjoint(nuts)
    assert {"init", "num_starts", "max_tree_depth"}.isdisjoint(hmc)
    assert (nuts["max_tree_depth"], hmc["trajectory_length"]) == (6, 0.5)
    with pytest.raises(ValueError, match="kernel must be one of"):
        mcmc_preset("gibbs")


@pytest.mark.parametrize(
    "given, starts",
    [([], 2), (["--num-chains", "3"], None), (["--init", "map"], None), (["--num-starts", "1"], 1)],
)
def test_the_preset_num_starts_yields_to_the_users_chains_or_init(given, starts):
    """The preset's 2 starts fit its own 4 chains; with --num-chains 3 or --init map they would
    be refused, so the library default (one start per chain, one for map) takes over."""
    from probtransformer.cli import build_parser
    from probtransformer.cli.options import with_mcmc_preset

    args = build_parser().parse_args(["fit", "--inference", "mcmc", *given])
    assert with_mcmc_preset(args).num_starts == starts


@pytest.mark.parametrize("given, jit", [([], False), (["--jit-compile"], True)])
def test_token_models_run_nuts_uncompiled_unless_told(given, jit):
    """PyTorch's JIT cannot run the token models' traced density under Pyro's NUTS."""
    from probtransformer.cli import build_parser
    from probtransformer.cli.options import with_mcmc_preset

    args = build_parser().parse_args(["fit", "--inference", "mcmc", "--kernel", "nuts", *given])
    assert with_mcmc_preset(args, jit=False).jit_compile is jit
    assert with_mcmc_preset(args).jit_compile is True  # the classifier's preset


def test_cli_kernel_and_schedule_names_are_the_library_ones():
    from probtransformer.inference.mcmc import registry
    from probtransformer.inference.vi import schedule

    assert options.LR_SCHEDULES == schedule.LR_SCHEDULES
    assert options.KERNELS == tuple(registry.KERNELS)
    assert options.MANY_CHAIN_KERNELS == registry.MANY_CHAIN_KERNELS
    assert options.INITS == tuple(registry.STARTS)
    for name, kernels in options.KERNEL_OPTIONS.items():  # the kernels whose objects read them
        if name not in ("init", "num_starts"):
            fields = {
                k: {f.name for f in dataclasses.fields(c)} for k, c in registry.KERNELS.items()
            }
            assert kernels == tuple(k for k in fields if name in fields[k]), name


def test_mcmc_fit_metrics(mcmc_run, splits):
    run_dir, _ = mcmc_run
    record = json.loads((run_dir / "metrics.json").read_text())
    assert METRIC_KEYS | {"seconds"} <= set(record)
    expected = dict(
        inference="mcmc",
        kernel="nuts",
        num_chains=MCMC_CHAINS,
        num_warmup=MCMC_WARMUP,
        num_draws=MCMC_DRAWS,
        max_tree_depth=MCMC_DEPTH,
        target_accept_prob=0.8,
        jit_compile=True,
        partial=False,
        chains_kept=MCMC_CHAINS,
        draws_per_chain=MCMC_DRAWS,
        num_train=MCMC_TRAIN,
        num_test=len(splits.test),
        num_samples=MCMC_CHAINS * MCMC_DRAWS,  # predictions use every kept draw
        threads=1,
    )
    assert {key: record[key] for key in expected} == expected
    assert "guide" not in record and "lr" not in record

    # the same numbers from the saved posterior's draws on the test split
    post = load_posterior(run_dir / "posterior")
    pred = post.predict(splits.test.x, num_samples=MCMC_CHAINS * MCMC_DRAWS, seed=0)
    assert pred.probs.shape == (MCMC_CHAINS * MCMC_DRAWS, len(splits.test), C)
    probs = pred.mean.double()
    report = metrics.classification_report(probs / probs.sum(-1, keepdim=True), splits.test.y)
    for key, value in report.items():
        assert record[key] == pytest.approx(value, abs=1e-6), key
    diverging = np.asarray(post.record["sample_stats"]["diverging"])
    assert diverging.shape == (MCMC_CHAINS, MCMC_DRAWS)
    assert record["divergences"] == int(diverging.sum())


def test_mcmc_fit_inference_data_has_sample_stats(mcmc_run):
    idata = az.from_netcdf(mcmc_run[0] / "inference_data.nc")
    assert {"posterior", "sample_stats", "log_likelihood", "predictions"} <= set(idata.groups())
    stats = idata.sample_stats
    sizes = {"chain": MCMC_CHAINS, "draw": MCMC_DRAWS}
    for name in ("diverging", "energy", "tree_depth", "acceptance_rate", "step_size", "lp"):
        assert dict(stats[name].sizes) == sizes, name
    assert stats["diverging"].dtype == bool
    assert np.isfinite(stats["energy"]).all()
    assert ((stats["tree_depth"] >= 1) & (stats["tree_depth"] <= MCMC_DEPTH)).all()
    assert (stats["n_steps"] <= 2**MCMC_DEPTH - 1).all()
    assert dict(idata.log_likelihood["y"].sizes) == {**sizes, "obs": MCMC_TRAIN}
    assert dict(idata.posterior["attention"].sizes)["chain"] == MCMC_CHAINS


def test_diagnose_mcmc_run(mcmc_run, capsys):
    assert main(["diagnose", str(mcmc_run[0])]) == 0
    out = capsys.readouterr().out
    draws = MCMC_CHAINS * MCMC_DRAWS
    table = re.search(r"^head\.weight\s+80\s+\S+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert table, out  # (d_model 8) x (10 classes), with R-hat and bulk/tail ESS numbers
    assert float(table.group(1)) > 0.9 and 0 < float(table.group(2)) <= 1.5 * draws
    assert f"verdict (mcmc, {MCMC_CHAINS} chain(s) x {MCMC_DRAWS} draws):" in out
    assert re.search(r"^(ok|WARN)\s+max R-hat [\d.]+ \(flag > 1.01\)$", out, re.M)
    assert re.search(r"^(ok|WARN)\s+min bulk ESS \d+ ", out, re.M)
    assert re.search(rf"^(ok|WARN)\s+divergent transitions: \d+ of {draws}\b", out, re.M)
    assert re.search(r"^(ok|WARN)\s+E-BFMI per chain [\d.]+, [\d.]+ ", out, re.M)
    assert f"transitions at max_tree_depth={MCMC_DEPTH}:" in out
    loo = re.search(r"LOO: elpd_loo .* of (\d+) ", out)
    assert loo and int(loo.group(1)) == MCMC_TRAIN  # LOO over the rows the chains saw


def test_mcmc_hmc_kernel(tmp_path):
    out = tmp_path / "hmc"
    args = ["--kernel", "hmc", "--trajectory-length", "0.05", "--num-chains", "1"]
    args += ["--no-jit-compile"]
    common = ["--inference", "mcmc", "--num-train", "16", "--num-warmup", "3", "--num-draws", "3"]
    assert main(["fit", "--out", str(out), *common, *args, "--no-progress"]) == 0
    record = json.loads((out / "metrics.json").read_text())
    assert (record["kernel"], record["trajectory_length"]) == ("hmc", 0.05)
    assert record["jit_compile"] is False and "max_tree_depth" not in record
    stats = az.from_netcdf(out / "inference_data.nc").sample_stats
    assert dict(stats.sizes) == {"chain": 1, "draw": 3}
    # Pyro's HMC takes max(1, int(trajectory_length / step_size)) leapfrog steps
    expected = np.maximum(1, (0.05 / stats["step_size"].values).astype(int))
    np.testing.assert_array_equal(stats["n_steps"].values, expected)
    assert (stats["tree_depth"] == 0).all()


def test_chees_fit_takes_the_preset_kernel_and_init(chees_run):
    run_dir, printed = chees_run
    header = (
        f"mcmc (chees, {CHEES_CHAINS} chain(s) x {CHEES_DRAWS} draws after {CHEES_WARMUP} "
        f"warmup, {CHEES_STARTS} ensemble start(s))"
    )
    assert header in printed
    assert re.search(rf"^\s+divergences\s+\d+ of {CHEES_CHAINS * CHEES_DRAWS}$", printed, re.M)
    assert {p.name for p in run_dir.iterdir()} == RUN_FILES
    record = json.loads((run_dir / "metrics.json").read_text())
    expected = dict(
        kernel="chees",
        init="ensemble",  # the preset's
        num_chains=CHEES_CHAINS,
        num_starts=CHEES_STARTS,
        num_warmup=CHEES_WARMUP,
        num_draws=CHEES_DRAWS,
        target_accept_prob=CHEES_TARGET_ACCEPT,
        chains_kept=CHEES_CHAINS,
        draws_per_chain=CHEES_DRAWS,
        num_samples=CHEES_CHAINS * CHEES_DRAWS,  # predictions use every kept draw
        num_train=MCMC_TRAIN,
        threads=1,
    )
    assert {key: record[key] for key in expected} == expected
    assert {"jit_compile", "max_tree_depth"}.isdisjoint(record)  # NUTS's, not ChEES's
    assert record["trajectory_length"] is None  # ChEES's initial one: 10 leapfrog steps
    # every leapfrog step is one gradient of every chain
    assert record["chain_gradients"] > 0 and record["chain_gradients"] % CHEES_CHAINS == 0
    # ensemble starts adapt each superchain apart: one step size and length per start
    assert len(record["adapted_step_size"]) == len(record["adapted_trajectory_length"])
    assert len(record["adapted_step_size"]) == CHEES_STARTS
    assert min(record["adapted_step_size"] + record["adapted_trajectory_length"]) > 0

    post = load_posterior(run_dir / "posterior")
    per_start = CHEES_CHAINS // CHEES_STARTS
    assert post.record["superchain"] == [k // per_start for k in range(CHEES_CHAINS)]
    assert post.samples["head.weight"].shape == (CHEES_CHAINS, CHEES_DRAWS, C, 8)
    stats = az.from_netcdf(run_dir / "inference_data.nc").sample_stats
    assert dict(stats["n_steps"].sizes) == {"chain": CHEES_CHAINS, "draw": CHEES_DRAWS}
    assert (stats["n_steps"] >= 1).all() and "tree_depth" not in stats


def test_diagnose_chees_run_has_nested_r_hat(chees_run, capsys):
    assert main(["diagnose", str(chees_run[0])]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\bnested_r_hat_max\b", out), out  # two superchains of two chains
    assert f"verdict (mcmc, {CHEES_CHAINS} chain(s) x {CHEES_DRAWS} draws" in out


@pytest.mark.filterwarnings("ignore:num_warmup=")
def test_mclmc_kernel(tmp_path, capsys):
    out = tmp_path / "mclmc"
    args = ["--kernel", "mclmc", "--init", "prior", "--num-starts", "1", "--num-chains", "2"]
    args += ["--num-warmup", "30", "--num-draws", "3", "--num-train", "16", *TINY_MCMC_MODEL]
    assert main(["fit", "--out", str(out), "--inference", "mcmc", *args, "--no-progress"]) == 0
    assert "mcmc (mclmc, 2 chain(s) x 3 draws after 30 warmup, 1 prior start(s))" in (
        capsys.readouterr().out
    )
    record = json.loads((out / "metrics.json").read_text())
    assert (record["kernel"], record["init"], record["num_starts"]) == ("mclmc", "prior", 1)
    assert "target_accept_prob" not in record  # unadjusted: no acceptance target
    assert record["adapted_step_size"] > 0 and record["adapted_L"] > 0
    post = load_posterior(out / "posterior")
    assert post.record["unadjusted"] is True
    assert post.samples["head.weight"].shape == (2, 3, C, 8)


@pytest.mark.filterwarnings("ignore:num_warmup=")
def test_mile_fits_an_ensemble_then_chains_per_member(tmp_path, capsys):
    out = tmp_path / "mile"
    args = ["--n-members", "2", "--chains-per-member", "2", "--num-steps", "20"]
    args += ["--num-warmup", "30", "--num-draws", "3", "--thinning", "2", "--temperature", "0.5"]
    args += ["--num-train", "40", *TINY_MCMC_MODEL, "--no-progress"]
    assert main(["fit", "--out", str(out), "--inference", "mile", *args]) == 0
    printed = capsys.readouterr().out
    assert "mile (mclmc, 4 chain(s) x 3 draws after 30 warmup, 2 per member of 2)" in printed
    assert "convergence (R-hat, ESS, E-BFMI)" in printed
    record = json.loads((out / "metrics.json").read_text())
    assert (record["inference"], record["kernel"], record["init"]) == ("mile", "mclmc", "ensemble")
    assert (record["n_members"], record["chains_per_member"], record["thinning"]) == (2, 2, 2)
    assert record["temperature"] == 0.5 and record["ensemble_num_steps"] == 20
    assert len(record["adapted_step_size"]) == 2  # tuned per member
    assert main(["diagnose", str(out)]) == 0
    verdict = capsys.readouterr().out
    assert "info  2 modes (chains started from 2 ensemble members, 2 chain(s) each)" in verdict
    assert "info  temperature 0.5" in verdict


@pytest.mark.parametrize(
    "inference, args, message",
    [
        ("mile", ["--num-chains", "4"], "--num-chains applies to --inference mcmc, not mile"),
        (
            "mile",
            ["--kernel", "nuts"],
            "--inference mile runs --kernel chees or mclmc or adjusted-mclmc, not nuts",
        ),
        ("mile", ["--init", "prior"], "--init applies to --inference mcmc, not mile"),
        ("ensemble", ["--thinning", "5"], "--thinning applies to --inference mile, not ensemble"),
        ("map", ["--chains-per-member", "2"], "--chains-per-member applies to --inference mile"),
        ("svi", ["--temperature", "0.5"], "--temperature applies to --inference mcmc, not svi"),
        ("mile", ["--temperature", "0"], "expected a number > 0, finite, got '0'"),
        ("map", ["--init-scale", "0.1"], "--init-scale applies to --inference svi, not map"),
    ],
)
def test_mile_options_are_checked(
    inference, args, message, tmp_path, monkeypatch, capsys, one_error_line
):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", *TINY, "--inference", inference, *args]) == 2
    assert message in one_error_line(capsys)
    assert _listing(tmp_path) == set()


def test_laplace_fit_writes_a_run_that_loads_back(tmp_path, capsys):
    """A MAP fit of 16 rows, then the full-GGN Laplace approximation of the head with the prior
    precision the evidence chooses: the summary names the evidence, the scale it chose per
    site beside the model's prior, and whether its maximization converged."""
    out = tmp_path / "laplace"
    args = ["--inference", "laplace", "--num-train", "16", "--prior-precision", "marglik"]
    assert main(["fit", "--out", str(out), *TINY, *args]) == 0
    printed = capsys.readouterr().out
    how = "laplace (full GGN of 2 site(s) around a MAP fit, prior precision marglik, glm"
    assert how in printed
    record = json.loads((out / "metrics.json").read_text())
    assert (record["inference"], record["mode_method"], record["hessian"]) == (
        "laplace", "map", "full",
    )  # fmt: skip
    assert record["laplace_subset"] == ["head.weight", "head.bias"]
    assert record["model_prior_scale"] == pytest.approx({"head.weight": 0.75, "head.bias": 0.75})
    (evidence,), (chosen,) = record["log_evidence"], record["prior_scale"]
    assert np.isfinite(evidence) and set(chosen) == {"head.weight", "head.bias"}
    assert f"log evidence   {evidence:.1f} nats" in printed
    for site in ("head.weight", "head.bias"):
        assert f"prior scale of {site}: {chosen[site]:.3g} (the evidence chose); model 0.75" in (
            printed
        )
    converged = "evidence maximization converged" if record["evidence_converged"] == [True] else (
        "WARN  evidence maximization did not converge (member 1 of 1)"
    )  # fmt: skip
    assert converged in printed
    post = load_posterior(out / "posterior")
    assert post.record["method"] == "laplace" and post.record["predictive"] == "glm"
    assert post.samples["head.weight"].shape == (1, 100, C, 16)  # fit_laplace's 100 draws
    assert set(post.source.modes) == {"head.weight", "head.bias"}  # saved for the GLM predictive


def test_the_laplace_summary_says_which_members_evidence_did_not_converge():
    """Two MoLA members, the second's evidence maximization stopped short; then a fixed prior."""
    from probtransformer.cli.fit_summary import _laplace_lines

    record = dict(
        log_evidence=[-120.04, -131.5],
        prior_scale=[{"head.weight": 0.5, "head.bias": 1.0}, {"head.weight": 0.25, "head.bias": 2}],
        model_prior_scale={"head.weight": 0.75, "head.bias": 0.75},
        evidence_converged=[True, False],
        prior_precision="marglik",
    )
    assert _laplace_lines(record) == [
        "  log evidence   -120.0, -131.5 nats (per member)",
        "  prior scale of head.weight: 0.5, 0.25 (the evidence chose); model 0.75",
        "  prior scale of head.bias: 1, 2 (the evidence chose); model 0.75",
        "WARN  evidence maximization did not converge (member 2 of 2): its prior scales are the "
        "last iterate's",
    ]
    record |= dict(evidence_converged=[None, None], prior_precision=4.0)
    lines = _laplace_lines(record)
    assert lines[1] == "  prior scale of head.weight: 0.5, 0.25 (fixed); model 0.75"
    assert lines[-1] == "  evidence not maximized: --prior-precision 4.0"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--hessian", "kfac"],
            "--hessian: invalid choice: 'kfac' (choose from *full*, *kron*, *diag*)",
        ),
        (["--predictive", "mc"], "--predictive: invalid choice: 'mc' (choose from *glm*, *nn*)"),
        (
            ["--laplace-subset", "ffn"],
            "--laplace-subset: invalid choice: 'ffn' (choose from *head*, *attention*, *all*)",
        ),
        (
            ["--prior-precision", "0"],
            "--prior-precision: expected marglik, prior or a number > 0, finite, got '0'",
        ),
        (
            ["--prior-precision", "evidence"],
            "--prior-precision: expected marglik, prior or a number > 0, finite, got 'evidence'",
        ),
    ],
)
def test_bad_laplace_option_values_name_the_expected_ones(
    args, message, tmp_path, monkeypatch, capsys, one_error_line
):
    """``*`` stands for the quotes some Python versions put around argparse's choices."""
    monkeypatch.chdir(tmp_path)
    assert main(["fit", *TINY, "--inference", "laplace", *args]) == 2
    pattern = re.escape(message).replace(r"\*", "'?")
    assert re.search(pattern, one_error_line(capsys))
    assert _listing(tmp_path) == set()


@pytest.mark.parametrize(
    "inference, args, message",
    [
        (
            "map",
            ["--hessian", "diag"],
            "--hessian applies to --inference laplace and mola, not map",
        ),
        (
            "ensemble",
            ["--laplace-subset", "all", "--prior-precision", "prior"],
            "--laplace-subset, --prior-precision apply to --inference laplace and mola, not "
            "ensemble",
        ),
        ("svi", ["--predictive", "nn"], "--predictive applies to --inference laplace and mola"),
        (
            "laplace",
            ["--n-members", "3"],
            "--n-members applies to --inference ensemble, mile and mola, not laplace",
        ),
        ("mola", ["--num-chains", "2"], "--num-chains applies to --inference mcmc, not mola"),
        ("laplace", ["--guide", "normal"], "--inference laplace fits guide 'delta'"),
        (
            "mola",
            ["--checkpoint-every", "5"],
            "--checkpoint-every applies to --inference svi and map, not mola",
        ),
    ],
)
def test_laplace_options_are_refused_by_the_methods_that_do_not_read_them(
    inference, args, message, tmp_path, monkeypatch, capsys, one_error_line
):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", *TINY, "--inference", inference, *args]) == 2
    assert message in one_error_line(capsys)
    assert _listing(tmp_path) == set()


def test_fit_help_lists_laplace_and_mola_with_their_defaults(capsys):
    assert main(["fit", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--inference {svi,map,mcmc,mile,mc-dropout,ensemble,laplace,mola}" in text
    assert "laplace: a MAP fit, then a Gaussian around it" in text
    assert "mola: the ensemble, then one Laplace approximation per member" in text
    fit = inspect.signature(probtransformer.inference.fit_laplace).parameters
    for option, name in (
        ("--laplace-subset {head,attention,all}", "subset"),
        ("--hessian {full,kron,diag}", "hessian"),
        ("--prior-precision P", "prior_precision"),
        ("--predictive {glm,nn}", "predictive"),
    ):
        start = text.index(f"{option} ", text.index("laplace and mola only:"))
        shown = text[start : text.index(")", text.index("(default:", start)) + 1]
        assert shown.endswith(f"(default: {fit[name].default})"), shown


def _interrupt_after(monkeypatch, calls: int) -> None:
    """Make the NUTS kernel raise KeyboardInterrupt (as Ctrl-C does) on its ``calls``-th step."""
    sample = RecordingNUTS.sample
    count = iter(range(1, 10**6))

    def interrupted(self, params):
        if next(count) == calls:
            raise KeyboardInterrupt
        return sample(self, params)

    monkeypatch.setattr(RecordingNUTS, "sample", interrupted)


def test_mcmc_interrupted_writes_a_partial_run(tmp_path, monkeypatch, capsys):
    kept = 2  # the Ctrl-C lands on the third kept draw
    _interrupt_after(monkeypatch, MCMC_WARMUP + kept + 1)
    out = tmp_path / "partial"
    # one chain: in-process on any machine (two chains run in worker processes on > 2 cores)
    assert main(["fit", "--out", str(out), *TINY_MCMC, "--num-chains", "1"]) == 130
    printed = capsys.readouterr().out
    assert f"PARTIAL: sampling was interrupted; the run holds the 1 x {kept} draws" in printed
    assert {p.name for p in out.iterdir()} == RUN_FILES
    record = json.loads((out / "metrics.json").read_text())
    assert (record["partial"], record["draws_per_chain"], record["num_draws"]) == (
        True,
        kept,
        MCMC_DRAWS,
    )
    assert record["num_samples"] == kept
    stats = az.from_netcdf(out / "inference_data.nc").sample_stats
    assert dict(stats.sizes) == {"chain": 1, "draw": kept}

    assert main(["diagnose", str(out)]) == 0
    assert "PARTIAL: sampling was interrupted" in capsys.readouterr().out


def test_an_interrupted_run_says_so_at_once_and_a_second_ctrl_c_keeps_the_posterior(
    tmp_path, monkeypatch, capsys
):
    from probtransformer.cli import fit as fit_command

    _interrupt_after(monkeypatch, MCMC_WARMUP + 2)  # one kept draw, then Ctrl-C

    def impatient(*args, **kwargs):
        raise KeyboardInterrupt  # the user presses Ctrl-C again while the run is written

    monkeypatch.setattr(fit_command, "write_run", impatient)
    out = tmp_path / "partial"
    assert main(["fit", "--out", str(out), *TINY_MCMC, "--num-chains", "1"]) == 130
    err = capsys.readouterr().err
    assert "sampling was interrupted; evaluating and writing the draws kept so far" in err
    assert "Ctrl-C again stops, keeping only the posterior" in err
    assert f"nothing was written to {out}" in " ".join(err.split())
    assert not out.exists()
    kept = load_posterior(tmp_path / "partial.posterior")
    assert kept.record["partial"] is True and kept.samples["head.weight"].shape[:2] == (1, 1)


def test_an_error_while_the_fit_is_evaluated_keeps_the_fit(tmp_path, monkeypatch, capsys):
    """Too many draws for memory (as torch reports it) after minutes of fitting: one line, exit
    2, nothing written to the run directory, and the posterior saved next to it."""
    from probtransformer.tasks import classification

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: 8000000000000 bytes")

    monkeypatch.setattr(classification.ClassificationTask, "evaluate", out_of_memory)
    out = tmp_path / "run"
    assert main(["fit", "--out", str(out), *TINY, "--num-train", "64"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("error:") == 1 and "evaluating it failed (DefaultCPUAllocator" in err
    kept = tmp_path / "run.posterior"
    assert f"nothing was written to {out}, and the fitted posterior is kept in {kept}" in err
    assert not out.exists() and load_posterior(kept).record["steps_done"] == 30


def test_a_bug_while_the_fit_is_evaluated_keeps_the_fit_and_its_traceback(tmp_path, monkeypatch):
    from probtransformer.tasks import classification

    def bug(*args, **kwargs):
        raise KeyError("metric")

    monkeypatch.setattr(classification.ClassificationTask, "evaluate", bug)
    out = tmp_path / "run"
    with pytest.raises(KeyError) as raised:
        main(["fit", "--out", str(out), *TINY, "--num-train", "64"])
    kept = tmp_path / "run.posterior"
    assert f"the fitted posterior is kept in {kept}" in raised.value.__notes__[0]
    assert not out.exists() and load_posterior(kept).record["method"] == "svi"


def test_sizes_that_do_not_fit_in_memory_get_one_line(monkeypatch, tmp_path, capsys):
    from probtransformer.tasks import classification

    def huge(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: 51200000000 bytes")

    monkeypatch.setattr(classification.ClassificationTask, "build_model", huge)
    assert main(["fit", "--out", str(tmp_path / "run"), *TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("probtransformer: error: out of memory: DefaultCPUAllocator")
    assert err.rstrip().endswith("(lower --num-samples or the model's sizes)")
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_a_model_too_large_for_memory_is_refused_before_it_is_built(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["fit", "--out", str(out), *TINY, "--d-model", "100000000"]) == 2
    assert "more than the" in capsys.readouterr().err and not out.exists()


def test_a_model_too_large_to_fit_is_refused_before_it_is_built(tmp_path, capsys):
    # weights (about 2 * 16 * d_ff in one block) fill a quarter of memory: the model alone
    # fits once, but not the 8 copies fitting holds, and nothing is allocated to find out
    d_ff = usable_memory() // (4 * 4 * 2 * 16)
    out = tmp_path / "run"
    assert main(["fit", "--out", str(out), *TINY, "--d-ff", str(d_ff)]) == 2
    err = capsys.readouterr().err
    assert "fitting holds 8 copies of each" in err and not out.exists()


def test_absurd_thread_counts_are_refused_before_anything_runs(capsys):
    assert main(["fit", "--threads", "100000000"]) == 2
    assert "--threads: expected an integer in [1, 1024], got '100000000'" in capsys.readouterr().err


def test_ctrl_c_while_the_fit_is_evaluated_keeps_the_fit(tmp_path, monkeypatch, capsys):
    """Minutes of fitting are not lost to a Ctrl-C during the test predictions: the posterior
    is saved next to the run directory, which is not written."""
    from probtransformer.tasks import classification

    def impatient(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(classification.ClassificationTask, "evaluate", impatient)
    out = tmp_path / "run"
    (tmp_path / "run.posterior").write_text("someone's file")  # never replaced
    schedule = ["--lr-decay", "0", "--lr-warmup", "0.2", "--lr-schedule", "cosine"]
    schedule += ["--init-scale", "0.05"]
    assert main(["fit", "--out", str(out), *TINY, "--num-train", "64", *schedule]) == 130
    err = " ".join(capsys.readouterr().err.split())
    kept = tmp_path / "run.posterior-2"
    assert f"nothing was written to {out}, and the fitted posterior is kept in {kept}" in err
    assert not out.exists() and (tmp_path / "run.posterior").read_text() == "someone's file"
    post = load_posterior(kept)
    assert post.record["method"] == "svi" and post.record["steps_done"] == 30
    settings = (post.record[k] for k in ("lr_decay", "lr_warmup", "lr_schedule", "init_scale"))
    assert tuple(settings) == (0.0, 0.2, "cosine", 0.05)  # the options reached fit_svi

    assert post.predict(torch.zeros(2, T, F), num_samples=3).probs.shape == (3, 2, C)
    assert post.record["dataset"] == "digits" and post.record["class_names"][:2] == ["0", "1"]
    np.save(tmp_path / "x.npy", np.zeros((2, T, F), np.float32))  # predict takes the kept fit
    args = ["predict", str(kept), "--input", str(tmp_path / "x.npy"), "--num-samples", "3"]
    assert main([*args, "--output", str(tmp_path / "p.csv")]) == 0
    assert list(pd.read_csv(tmp_path / "p.csv").columns) == PRED_COLUMNS
    assert main(["diagnose", str(kept), "--num-samples", "3"]) == 0  # and diagnose


def test_an_exponential_decay_to_zero_is_refused_naming_the_options(capsys):
    assert main(["fit", *TINY, "--lr-decay", "0"]) == 2
    err = capsys.readouterr().err
    assert "--lr-decay 0 needs --lr-schedule cosine" in err
    assert "the schedule is exponential, the default" in err
    assert main(["fit", *TINY, "--lr-decay", "0", "--lr-schedule", "exponential"]) == 2
    assert "the schedule is exponential\n" in capsys.readouterr().err


def test_ctrl_c_while_the_arguments_are_parsed_is_one_line(monkeypatch, capsys, one_stop_line):
    def impatient(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("argparse.ArgumentParser.parse_args", impatient)
    assert main(["fit"]) == 130
    assert "nothing was written" in one_stop_line(capsys)


def test_a_task_presets_decay_gives_way_to_another_schedule():
    # the tagger's preset decays to 0 on a cosine schedule; --lr-schedule exponential alone
    # takes the library's default decay rather than refusing a --lr-decay 0 never given
    from probtransformer.cli._common import CLIError
    from probtransformer.cli.parser import build_parser
    from probtransformer.inference import fit_svi
    from probtransformer.tasks._tokens import TAGGER_FIT

    with_svi_preset, parser = options.with_svi_preset, build_parser()
    args = with_svi_preset(parser.parse_args(["fit", "--lr-schedule", "exponential"]), TAGGER_FIT)
    assert args.lr_decay is None  # fit_svi's default applies
    assert inspect.signature(fit_svi).parameters["lr_decay"].default > 0
    assert args.lr == TAGGER_FIT["lr"] and args.lr_warmup == TAGGER_FIT["lr_warmup"]
    args = with_svi_preset(parser.parse_args(["fit"]), TAGGER_FIT)
    assert (args.lr_decay, args.lr_schedule) == (0.0, "cosine")  # the preset as a whole
    given = parser.parse_args(["fit", "--lr-schedule", "exponential", "--lr-decay", "0"])
    with pytest.raises(CLIError, match="--lr-decay 0 needs --lr-schedule cosine"):
        with_svi_preset(given, TAGGER_FIT)


def test_a_batch_larger_than_the_data_is_warned_about(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["fit", "--out", out, *TINY, "--num-train", "64", "--batch-size", "500"]) == 0
    assert "--batch-size 500 exceeds the 64 training rows" in capsys.readouterr().err


def test_ctrl_c_mid_fit_without_checkpoints_says_nothing_was_saved(
    tmp_path, monkeypatch, capsys, one_stop_line
):
    def impatient(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.optim.Adam, "step", impatient)
    assert main(["fit", "--out", str(tmp_path / "run"), *TINY]) == 130
    line = one_stop_line(capsys)
    assert "interrupted at step 0; nothing was saved (--checkpoint-every N keeps" in line
    assert not (tmp_path / "run").exists()


def test_mcmc_interrupted_before_a_draw_writes_nothing(
    tmp_path, monkeypatch, capsys, one_stop_line
):
    _interrupt_after(monkeypatch, 2)  # during warmup
    monkeypatch.chdir(tmp_path)
    assert main(["fit", *TINY_MCMC, "--num-chains", "1"]) == 130
    assert "interrupted before the first draw" in one_stop_line(capsys)
    assert _listing(tmp_path) == set()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--lr", "0.1"],
            f"--lr applies to --inference {SVI_METHODS}, not mcmc",
        ),
        (
            ["--lr-decay", "1"],
            f"--lr-decay applies to --inference {SVI_METHODS}, not mcmc",
        ),
        (["--num-steps", "5", "--batch-size", "8"], "--num-steps, --batch-size apply to"),
        (
            ["--guide", "normal"],
            f"--guide applies to --inference {SVI_METHODS}, not mcmc",
        ),
        (["--kernel", "hmc", "--max-tree-depth", "4"], "--max-tree-depth applies to --kernel nuts"),
        (
            ["--trajectory-length", "2"],
            "--trajectory-length applies to --kernel hmc and chees, not nuts",
        ),
        (["--init", "map"], "--init applies to --kernel chees, mclmc and adjusted-mclmc, not nuts"),
        (
            ["--num-starts", "1"],
            "--num-starts applies to --kernel chees, mclmc and adjusted-mclmc, not nuts",
        ),
        (["--num-train", "1213"], "--num-train 1213 exceeds the 1212 rows"),
        (["--num-warmup", "-1"], "integer >= 0"),
        (["--num-draws", "0"], "integer >= 1"),
        (["--kernel", "gibbs"], "invalid choice: 'gibbs'"),
        (["--target-accept-prob", "1.5"], "--target-accept-prob: expected a number in (0, 1)"),
        (["--num-warmup", "1_0"], "--num-warmup: expected an integer >= 0, got '1_0'"),
        (["--trajectory-length", "0"], "--trajectory-length: expected a number in (0, 1000]"),
        (["--trajectory-length", "1e308"], "--trajectory-length: expected a number in (0, 1000]"),
    ],
)
def test_mcmc_bad_arguments(args, message, tmp_path, monkeypatch, capsys, one_error_line):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", *TINY_MCMC, *args]) == 2
    assert message in one_error_line(capsys)
    assert _listing(tmp_path) == set()


@pytest.mark.parametrize(
    "args, message",
    [
        # refused by the CLI in its options' names (the library would name its parameters)
        (["--num-chains", "3"], "got --num-chains 3 and --num-starts 2"),
        (["--init", "map"], "so --num-starts must be 1, got 2"),
        # refused by the CLI: the option does not apply to the kernel
        (["--jit-compile"], "--jit-compile applies to --kernel nuts and hmc, not chees"),
        (["--no-jit-compile"], "--jit-compile applies to --kernel nuts and hmc, not chees"),
        (["--max-tree-depth", "4"], "--max-tree-depth applies to --kernel nuts, not chees"),
        (
            ["--kernel", "mclmc", "--target-accept-prob", "0.7"],
            "--target-accept-prob applies to --kernel nuts, hmc, chees and adjusted-mclmc, "
            "not mclmc",
        ),
        (
            ["--kernel", "mclmc", "--trajectory-length", "1"],
            "--trajectory-length applies to --kernel hmc and chees, not mclmc",
        ),
        (["--kernel", "nuts", "--num-starts", "2"], "--num-starts applies to --kernel chees"),
        (["--init", "best"], "invalid choice: 'best'"),
        (["--num-starts", "0"], "integer >= 1"),
        (["--map-steps", "-1"], "integer >= 0"),
    ],
)
def test_many_chain_bad_arguments(args, message, tmp_path, monkeypatch, capsys, one_error_line):
    """TINY_CHEES has 4 chains from 2 starts: the ensemble init of the preset."""
    monkeypatch.chdir(tmp_path)
    assert main(["fit", *TINY_CHEES, *args]) == 2
    assert message in one_error_line(capsys)
    assert _listing(tmp_path) == set()


@pytest.mark.parametrize(
    "inference, args, message",
    [
        ("svi", ["--num-chains", "2"], "--num-chains applies to --inference mcmc, not svi"),
        ("map", ["--kernel", "nuts"], "--kernel applies to --inference mcmc, not map"),
        ("svi", ["--no-jit-compile"], "--jit-compile applies to --inference mcmc"),
        ("svi", ["--num-warmup", "5", "--num-draws", "5"], "--num-warmup, --num-draws apply to"),
    ],
)
def test_svi_refuses_mcmc_options(
    inference, args, message, tmp_path, monkeypatch, capsys, one_error_line
):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", *TINY, "--inference", inference, *args]) == 2
    assert message in one_error_line(capsys)
    assert _listing(tmp_path) == set()


# -- predict ------------------------------------------------------------------------------------


def _write_csv(path, rows: np.ndarray, header: bool = True) -> None:
    text = ",".join(f"pixel_{i}" for i in range(rows.shape[1])) + "\n" if header else ""
    path.write_text(text + "\n".join(",".join(map(repr, row.tolist())) for row in rows) + "\n")


def test_predict_npy_and_csv_give_the_same_csv(run, splits, tmp_path, capsys):
    run_dir, _ = run
    x = splits.test.x[:7].numpy()  # (7, T, F)
    np.save(tmp_path / "x.npy", x)
    _write_csv(tmp_path / "x.csv", x.reshape(7, T * F))
    common = ["predict", str(run_dir), "--num-samples", str(NUM_SAMPLES), "--input"]
    assert main([*common, str(tmp_path / "x.npy"), "--output", str(tmp_path / "a.csv")]) == 0
    assert main([*common, str(tmp_path / "x.csv"), "--output", str(tmp_path / "b.csv")]) == 0
    assert capsys.readouterr().out.splitlines() == [f"wrote {tmp_path / f'{n}.csv'}" for n in "ab"]
    assert main([*common, str(tmp_path / "x.npy")]) == 0  # to stdout
    from_stdout = pd.read_csv(io.StringIO(capsys.readouterr().out))

    frame = pd.read_csv(tmp_path / "a.csv")
    assert list(frame.columns) == PRED_COLUMNS and len(frame) == 7
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "b.csv"), frame)
    pd.testing.assert_frame_equal(from_stdout, frame)
    probs = frame[PRED_COLUMNS[:C]].to_numpy()  # (7, C)
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(frame["predicted"], probs.argmax(1))
    np.testing.assert_allclose(frame["entropy"], frame["aleatoric"] + frame["epistemic"], atol=1e-5)
    expected = load_posterior(run_dir / "posterior").predict(x, num_samples=NUM_SAMPLES).mean
    np.testing.assert_allclose(probs, expected.numpy(), atol=1e-6)


def test_predict_csv_without_header(run, splits, tmp_path):
    run_dir, _ = run
    _write_csv(tmp_path / "x.csv", splits.test.x[:3].reshape(3, T * F).numpy(), header=False)
    args = ["predict", str(run_dir), "--input", str(tmp_path / "x.csv")]
    assert main([*args, "--output", str(tmp_path / "p.csv")]) == 0
    assert len(pd.read_csv(tmp_path / "p.csv")) == 3


# -- bad arguments and files --------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, files, message",
    [
        (["--dataset", "nope"], {}, "invalid choice: 'nope'"),
        (["--inference", "nuts"], {}, "invalid choice: 'nuts'"),
        (
            ["--inference", "mcmc"],
            {},
            f"--num-steps applies to --inference {SVI_METHODS}, not mcmc",
        ),
        (["--guide", "flow"], {}, "--guide"),
        (["--num-steps", "0"], {}, "integer >= 1"),
        (["--num-samples", "-3"], {}, "integer >= 1"),
        (["--device", "tpu"], {}, "--device"),
        (["--lr", "fast"], {}, "argument --lr: expected a number in (0, 10], got 'fast'"),
        (["--inference", "map", "--guide", "normal"], {}, "guide 'delta'"),
        (["--bayesian", "attention,wings"], {}, "unknown ['wings']"),
        (["--d-model", "15", "--num-heads", "2"], {}, "multiple of num_heads"),
        (["--dropout", "1.5"], {}, "argument --dropout: expected a number in [0, 1), got '1.5'"),
        (["--lr", "-1"], {}, "argument --lr: expected a number in (0, 10], got '-1'"),
        (["--lr", "1_0"], {}, "argument --lr: expected a number in (0, 10], got '1_0'"),
        (["--seed", "-1"], {}, "--seed: expected an integer in [0, 4294967295], got '-1'"),
        (["--num-layers", "100000"], {}, "--num-layers: expected an integer in [1, 1024]"),
        (["--out", ""], {}, "--out must name a directory, got an empty string"),
        (["--out", "taken"], {"taken": "a file"}, "not a directory"),
        (["--out", "taken/run"], {"taken": "a file"}, "not a writable directory"),
        (["--out", "mine"], {"mine/notes.txt": "keep me"}, "not a probtransformer run directory"),
    ],
)
def test_fit_bad_arguments(args, files, message, tmp_path, monkeypatch, capsys, one_error_line):
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    before = _listing(tmp_path)
    assert main(["fit", *TINY, *args]) == 2
    assert message in one_error_line(capsys)
    assert _listing(tmp_path) == before  # no run directory, no staging directory


def test_a_diverged_fit_keeps_its_last_finite_state(tmp_path, monkeypatch, capsys, one_error_line):
    def diverge(*args, **kwargs):  # a real fit whose next step would have been NaN
        error = NonFiniteELBOError("ELBO became non-finite at step 30", step=30, site=None)
        error.posterior = fit_svi(*args, **kwargs)
        raise error

    monkeypatch.setattr(probtransformer.inference, "fit_svi", diverge)
    out = tmp_path / "run"
    assert main(["fit", "--out", str(out), *TINY, "--num-train", "64"]) == 1
    line = one_error_line(capsys)
    kept = tmp_path / "run.posterior"
    assert f"the fit diverged; nothing was written to {out}, and its last finite state is " in line
    assert f"kept in {kept}" in line and not out.exists()
    post = load_posterior(kept)
    assert post.record["dataset"] == "digits" and post.record["steps_done"] == 30
    np.save(tmp_path / "x.npy", np.zeros((2, T, F), np.float32))  # predict takes it
    assert (
        main(["predict", str(kept), "--input", str(tmp_path / "x.npy"), "--num-samples", "3"]) == 0
    )


def test_failed_fit_writes_nothing(tmp_path, monkeypatch, capsys, one_error_line):
    def diverge(*args, **kwargs):
        from probtransformer.inference.vi.elbo import NON_FINITE_ADVICE

        message = f"ELBO became non-finite at step 3; {NON_FINITE_ADVICE}"
        raise NonFiniteELBOError(message, step=3, site=None)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(probtransformer.inference, "fit_svi", diverge)
    assert main(["fit", *TINY]) == 1
    line = one_error_line(capsys)  # the advice names the CLI's option, not fit_svi's
    assert "ELBO became non-finite at step 3; try a lower --lr" in line
    assert _listing(tmp_path) == set()


def test_failed_write_keeps_the_previous_run(tmp_path, monkeypatch, capsys, one_error_line):
    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.chdir(tmp_path)
    previous = tmp_path / "runs" / "digits-svi"
    (previous / "posterior").mkdir(parents=True)
    (previous / "metrics.json").write_text("{}")
    before = _listing(tmp_path)
    monkeypatch.setattr(probtransformer.plots, "save_figure", disk_full)
    assert main(["fit", *TINY, "--num-steps", "2", "--out", str(previous), "--overwrite"]) == 2
    notice, error = capsys.readouterr().err.splitlines()
    assert "holds an earlier run; this fit replaces it once it is written" in notice
    assert "No space left on device" in error
    assert _listing(tmp_path) == before  # old run intact, staging directory removed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_fit_cuda_without_cuda(tmp_path, monkeypatch, capsys, one_error_line):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--device", "cuda", *TINY]) == 2
    assert "CUDA is not available" in one_error_line(capsys)
    assert _listing(tmp_path) == set()


def _row(value: str = "0.5", width: int = T * F) -> list[str]:
    return [value] * width


def _csv(*rows: list[str]) -> str:
    return "\n".join(",".join(row) for row in rows) + "\n"


def _npz() -> bytes:
    archive = io.BytesIO()
    np.savez(archive, x=np.zeros((2, T, F), np.float32))
    return archive.getvalue()


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.npy", None, "does not exist"),
        ("x.txt", "1,2,3\n", ".npy or .csv"),
        ("x.csv", _csv(_row(), _row()[:-1] + [""]), "line 2, column 64: missing value"),
        ("x.csv", _csv(_row(), _row(width=T * F - 1)), "expected 64 columns"),
        ("x.csv", _csv(_row(), _row() + ["1"]), "expected 64 columns"),
        ("x.csv", _csv(_row(), ["0.5", "dark"] + _row(width=T * F - 2)), "not a number: 'dark'"),
        ("x.csv", _csv(_row(), _row("nan")), "64 NaN/inf values, the first at sequence 1, step 0"),
        ("x.csv", "\ufeff" + _csv(_row(), _row()[:-1] + ["inf"]), "1 NaN/inf value, the first at"),
        ("x.csv", _csv([f"p{i}" for i in range(T * F)]), "no data rows (its first line, 'p0,p1"),
        ("x.csv", "hello world\n", "no data rows (its first line, 'hello world', is a header)"),
        ("x.npy", np.zeros((3, T * F), np.float32), "shape (N, T, F=8)"),
        ("x.npy", np.zeros((3, T, F - 1), np.float32), "shape (N, T, F=8)"),
        ("x.npy", np.zeros((0, T, F), np.float32), "shape (N, T, F=8)"),
        ("x.npy", np.full((2, T, F), np.nan, np.float32), "128 NaN/inf"),
        ("x.npy", np.zeros((2, T + 1, F), np.float32), "max_len=8"),
        ("x.npy", np.array([{"a": 1}], dtype=object), "cannot read"),
        ("x.npy", np.zeros((2, T, F), np.int64), "floating-point features"),
        ("x.npy", "not an array\n", "x.npy is not a .npy file (it does not start with numpy"),
        ("x.npy", "", "x.npy is empty (0 bytes)"),
        ("x.npy", _npz(), "x.npy is a .npz archive"),
        ("x.csv", ";".join(_row()) + "\n", "line 1: numbers separated by ';'; separate the 64"),
    ],
)
def test_predict_bad_input(name, content, message, run, tmp_path, capsys, one_error_line):
    path = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(path, content, allow_pickle=True)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    before = _listing(tmp_path)
    args = ["predict", str(run[0]), "--input", str(path), "--output", str(tmp_path / "p.csv")]
    assert main(args) == 2
    assert message in one_error_line(capsys)
    assert _listing(tmp_path) == before


@pytest.mark.parametrize(
    "output, words",
    [("no/p.csv", "cannot write --output"), ("folder", "it is a directory"), ("", "empty string"),
     ("p.txt", "name a .csv file, got"), ("x.csv", "is the input file: writing it would destroy")],
)  # fmt: skip
def test_predict_unwritable_output_names_the_option(
    output, words, run, splits, tmp_path, capsys, one_error_line
):
    (tmp_path / "folder").mkdir()
    flat = splits.test.x[:2].reshape(2, T * F).numpy()
    np.savetxt(tmp_path / "x.csv", flat, delimiter=",")
    before = (tmp_path / "x.csv").read_bytes()
    args = ["predict", str(run[0]), "--input", str(tmp_path / "x.csv")]
    assert main([*args, "--output", str(tmp_path / output) if output else ""]) == 2
    assert words in one_error_line(capsys)
    assert (tmp_path / "x.csv").read_bytes() == before


def test_predict_csv_with_pandas_default_header(run, splits, tmp_path):
    flat = splits.test.x[:5].reshape(5, T * F).numpy()
    pd.DataFrame(flat).to_csv(tmp_path / "x.csv", index=False)  # header 0,1,...,63
    args = ["predict", str(run[0]), "--input", str(tmp_path / "x.csv")]
    assert main([*args, "--output", str(tmp_path / "p.csv")]) == 0
    assert len(pd.read_csv(tmp_path / "p.csv")) == 5


@pytest.mark.parametrize("command", ["diagnose", "predict"])
@pytest.mark.parametrize("run_dir", ["empty", "absent"])
def test_not_a_run_directory(command, run_dir, tmp_path, capsys, one_error_line):
    (tmp_path / "empty").mkdir()
    np.save(tmp_path / "x.npy", np.zeros((1, T, F), np.float32))
    extra = ["--input", str(tmp_path / "x.npy")] if command == "predict" else []
    assert main([command, str(tmp_path / run_dir), *extra]) == 2
    words = "does not exist" if run_dir == "absent" else "is not a probtransformer run directory"
    assert words in one_error_line(capsys)


@pytest.mark.parametrize(
    "metrics_text, message",
    [('{"dataset": "nope", "seed": 0}', "unknown dataset 'nope'"), ("{not json", "not valid JSON")],
)
def test_diagnose_bad_metrics_file(metrics_text, message, run, tmp_path, capsys, one_error_line):
    copy = tmp_path / "run"
    shutil.copytree(run[0] / "posterior", copy / "posterior")
    (copy / "metrics.json").write_text(metrics_text)
    assert main(["diagnose", str(copy)]) == 2
    assert message in one_error_line(capsys)


@pytest.mark.parametrize("command", ["diagnose", "predict", "report"])
def test_a_run_from_a_newer_format_version_is_refused(
    command, run, splits, tmp_path, capsys, one_error_line
):
    copy = tmp_path / "run"
    shutil.copytree(run[0], copy)
    meta_file = copy / "posterior" / "posterior.json"
    meta = json.loads(meta_file.read_text())
    meta["format_version"] += 1
    meta_file.write_text(json.dumps(meta))
    np.save(tmp_path / "x.npy", splits.test.x[:2].numpy())
    extra = ["--input", str(tmp_path / "x.npy")] if command == "predict" else []
    assert main([command, str(copy), *extra]) == 2
    assert "newer" in one_error_line(capsys)


def test_checkpointed_fit_resumes_to_the_same_run(tmp_path, capsys, one_error_line):
    args = ["fit", *TINY, "--num-train", "64"]
    assert main([*args, "--checkpoint-every", "10", "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a.checkpoint").is_dir()
    resumed = ["--resume-from", str(tmp_path / "a.checkpoint"), "--out", str(tmp_path / "b")]
    assert main([*args, *resumed]) == 0
    first, second = (json.loads((tmp_path / r / "metrics.json").read_text()) for r in "ab")
    assert first["nll"] == second["nll"] and first["accuracy"] == second["accuracy"]
    capsys.readouterr()
    assert main(["fit", *TINY_MCMC, "--resume-from", str(tmp_path / "a.checkpoint")]) == 2
    assert "--resume-from applies to --inference svi and map" in one_error_line(capsys)
    assert main([*args, "--resume-from", str(tmp_path / "nowhere"), "--out", "c"]) == 2
    assert "nowhere" in one_error_line(capsys)


def test_missing_command_and_help(capsys, one_error_line):
    assert main([]) == 2
    assert "COMMAND" in one_error_line(capsys)
    for module in ("probtransformer.cli", "probtransformer"):  # torchrun -m needs the second
        done = subprocess.run(
            [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        commands = ("fit", "diagnose", "predict", "report", "generate", "serve")
        assert all(command in done.stdout for command in commands)


def test_an_option_whose_help_names_its_default_shows_it_once(capsys):
    assert main(["fit", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "checkpoint directory (default: OUT.checkpoint) --resume-from" in help_text


def test_mc_dropout_without_dropout_names_the_option(tmp_path, monkeypatch, capsys, one_error_line):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--inference", "mc-dropout", "--dropout", "0", *TINY]) == 2
    assert "give --dropout P with 0 < P < 1" in one_error_line(capsys)
    assert not (tmp_path / "runs").exists()


def test_fit_attention_prior_flags_build_the_model_and_the_report_shows_head_gates(tmp_path):
    out = tmp_path / "run"
    flags = ["--head-gates", "--local-window", "1", "--stochastic-attention"]
    assert main(["fit", "--out", str(out), *TINY, "--num-train", "64", *flags]) == 0
    post = load_posterior(out / "posterior")
    config = post.model.config
    assert config["head_prior"] == {"type": "HeadGatePrior", "global_scale": 0.1}
    kinds = [spec["type"] for spec in config["attention_prior"]]
    assert kinds == ["LogitScalePrior", "StochasticAttentionPrior", "AttentionLogitPrior"]
    assert config["attention_prior"][2]["guidance"]["width"] == 1
    assert len(post.head_importance()) == 2  # one layer of two heads
    assert main(["report", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert "effective number of heads" in html.lower()


def test_local_window_must_be_a_non_negative_integer(tmp_path, capsys, one_error_line):
    assert main(["fit", "--out", str(tmp_path / "run"), "--local-window", "-1"]) == 2
    assert "--local-window: expected an integer >= 0, got '-1'" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_fit_records_the_diagnose_verdict_as_json(run, capsys):
    run_dir, _ = run
    recorded = json.loads((run_dir / "diagnostics.json").read_text())
    assert (recorded["format_version"], recorded["seed"], recorded["num_train"]) == (1, 0, 1212)
    assert main(["diagnose", str(run_dir)]) == 0  # recomputed: the same draws, the same verdict
    out = capsys.readouterr().out
    assert out.rstrip("\n").endswith("\n" + "\n".join(recorded["verdict"]))
    assert recorded["verdict"][0] == "verdict (svi, 1 chain(s) x 100 draws):"
    variables = [row["variable"] for row in recorded["table"]]
    assert variables[-1] == "attention" and "head.weight" in variables
    for row in recorded["table"]:
        assert re.search(rf"^{re.escape(row['variable'])}\s+{row['size']}\s", out, re.MULTILINE)
        assert row["r_hat_max"] is None and row["mean_sd"] > 0  # SVI: no R-hat, a spread
    assert recorded["warnings"] == [line for line in recorded["verdict"] if line.startswith("WARN")]
    assert recorded["ok"] is (not recorded["warnings"])
    assert recorded["loo"]["n"] == 1212 and recorded["loo"]["elpd_loo"] < 0
    assert isinstance(recorded["guide_k_hat"], float)


def test_a_run_written_before_diagnostics_json_still_reads(tmp_path, capsys):
    saved = Path(__file__).parents[1] / "fixtures" / "main-0fadaf9" / "run"
    assert not (saved / "diagnostics.json").exists()
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    assert main(["diagnose", str(run_dir), "--num-samples", "10"]) == 0
    out = capsys.readouterr().out
    assert "verdict (svi, 1 chain(s) x 10 draws):" in out
    assert re.search(r"LOO: elpd_loo .* of 60 ", out)  # the 60 training rows of that fit
    np.save(tmp_path / "x.npy", np.zeros((2, T, F), np.float32))
    assert main(["predict", str(run_dir), "--input", str(tmp_path / "x.npy")]) == 0
    frame = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert list(frame.columns) == PRED_COLUMNS and len(frame) == 2
    assert main(["report", str(run_dir), "--num-samples", "2"]) == 0
    html = (run_dir / "report.html").read_text(encoding="utf-8")
    sections = re.findall(r'<h2 id="([a-z-]+)"', html)
    assert sections[:3] == ["metrics", "reliability", "risk-coverage"]


def test_files_next_to_the_run_directory_are_named_after_it_for_out_dot(tmp_path, monkeypatch):
    from probtransformer.cli import fit as fit_command

    (tmp_path / "e").mkdir()
    monkeypatch.chdir(tmp_path / "e")
    assert fit_command._kept_path(Path(".")) == tmp_path / "e.posterior"
    assert fit_command._sibling(Path("."), ".checkpoint") == tmp_path / "e.checkpoint"


def test_sigterm_stops_a_command_as_ctrl_c_does(monkeypatch, capsys):
    """Batch schedulers send SIGTERM: it stops the command through the Ctrl-C path, so what
    Ctrl-C keeps (MCMC's draws, a checkpoint) is kept; the exit status says SIGTERM."""
    import signal
    import time

    from probtransformer.cli import diagnose as diagnose_command

    def run(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises before this ends
        return 0

    monkeypatch.setattr(diagnose_command, "run", run)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["diagnose", "some-run"]) == 143
    assert capsys.readouterr().err == "probtransformer: stopped: by SIGTERM; nothing was written\n"
    assert signal.getsignal(signal.SIGTERM) is before

    def run_keeping_work(args):  # as fit after partial sampling, or generate: it says so itself
        try:
            run(args)
        except KeyboardInterrupt:
            return 130

    monkeypatch.setattr(diagnose_command, "run", run_keeping_work)
    assert main(["diagnose", "some-run"]) == 143


def test_a_collapsed_svi_fit_is_flagged_with_its_metrics(tmp_path, capsys):
    """30 steps from init_scale 1e-3 keep no spread (issue 44): fit's summary and metrics.json
    say so, not only diagnose; from init_scale 0.3 the guide keeps it and nothing is said."""
    for scale, flagged in (("0.001", True), ("0.3", False)):
        out = tmp_path / scale
        assert (
            main(["fit", "--out", str(out), *TINY, "--num-train", "64", "--init-scale", scale]) == 0
        )
        printed = capsys.readouterr().out
        warnings = json.loads((out / "metrics.json").read_text()).get("warnings", [])
        assert ("WARN  guide sd / prior sd" in printed) is flagged
        assert [w.startswith("WARN  guide sd / prior sd") for w in warnings] == [True] * flagged
