"""Tests of the `probtransformer` command line, run in-process through `main`.

One tiny SVI run (module-scoped) is shared by the fit, diagnose and predict tests.
"""

import contextlib
import inspect
import io
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

import probtransformer.inference
import probtransformer.plots
from probtransformer import datasets, metrics
from probtransformer.cli import main
from probtransformer.inference import NonFiniteELBOError, fit_svi, load_posterior
from probtransformer.inference._arviz import az
from probtransformer.models import SequenceClassifier

TINY = [
    "--num-steps", "30", "--d-model", "16", "--num-heads", "2", "--num-layers", "1",
    "--num-samples", "10", "--no-progress",
]  # fmt: skip
NUM_SAMPLES = 10
RUN_FILES = {"metrics.json", "inference_data.nc", "posterior", "attention.png", "reliability.png"}
METRIC_KEYS = {"accuracy", "nll", "ece", "brier", "mean_epistemic", "num_train", "num_test"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T, F, C = 8, 8, 10  # digits: 8 steps of 8 pixels, 10 classes
PRED_COLUMNS = [f"prob_{c}" for c in range(C)] + ["predicted", "entropy", "aleatoric", "epistemic"]


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


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("probtransformer: error: ")
    return lines[0]


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
    for option, default in (
        ("--num-steps N optimisation steps", fit["num_steps"].default),
        ("--lr LR initial Adam learning rate", fit["lr"].default),
        ("--d-model N model width", model["d_model"].default),
        ("--num-heads N heads per layer", model["num_heads"].default),
    ):
        assert f"{option} (default: {default})" in text
    assert "one of: digits" in text


def test_map_fit_uses_default_out_and_replaces_a_previous_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    previous = tmp_path / "runs" / "digits-map"
    (previous / "posterior").mkdir(parents=True)
    (previous / "metrics.json").write_text("{}")
    (previous / "notes.txt").write_text("the user's own file")
    fast = [a if a != "30" else "5" for a in TINY]
    assert main(["fit", "--inference", "map", *fast]) == 2  # never deletes files it did not write
    assert "notes.txt" in _one_error_line(capsys)
    (previous / "notes.txt").unlink()
    assert main(["fit", "--inference", "map", *fast]) == 0
    assert "wrote runs/digits-map" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "runs").iterdir()} == {"digits-map"}
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
        (["--inference", "mcmc"], {}, "--inference"),
        (["--guide", "flow"], {}, "--guide"),
        (["--num-steps", "0"], {}, "integer >= 1"),
        (["--num-samples", "-3"], {}, "integer >= 1"),
        (["--device", "tpu"], {}, "--device"),
        (["--lr", "fast"], {}, "argument --lr: invalid float"),
        (["--inference", "map", "--guide", "normal"], {}, "guide 'delta'"),
        (["--bayesian", "attention,wings"], {}, "unknown ['wings']"),
        (["--d-model", "15", "--num-heads", "2"], {}, "multiple of num_heads"),
        (["--dropout", "1.5"], {}, "dropout must be in [0, 1)"),
        (["--lr", "-1"], {}, "lr must be a finite number > 0"),
        (["--out", "taken"], {"taken": "a file"}, "not a directory"),
        (["--out", "taken/run"], {"taken": "a file"}, "not a writable directory"),
        (["--out", "mine"], {"mine/notes.txt": "keep me"}, "not a probtransformer run directory"),
    ],
)
def test_fit_bad_arguments(args, files, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    before = _listing(tmp_path)
    assert main(["fit", *TINY, *args]) == 2
    assert message in _one_error_line(capsys)
    assert _listing(tmp_path) == before  # no run directory, no staging directory


def test_failed_fit_writes_nothing(tmp_path, monkeypatch, capsys):
    def diverge(*args, **kwargs):
        raise NonFiniteELBOError("ELBO became non-finite at step 3", step=3, site=None)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(probtransformer.inference, "fit_svi", diverge)
    assert main(["fit", *TINY]) == 1
    assert "ELBO became non-finite at step 3" in _one_error_line(capsys)
    assert _listing(tmp_path) == set()


def test_failed_write_keeps_the_previous_run(tmp_path, monkeypatch, capsys):
    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.chdir(tmp_path)
    previous = tmp_path / "runs" / "digits-svi"
    (previous / "posterior").mkdir(parents=True)
    (previous / "metrics.json").write_text("{}")
    before = _listing(tmp_path)
    monkeypatch.setattr(probtransformer.plots, "save_figure", disk_full)
    assert main(["fit", *TINY, "--num-steps", "2"]) == 2
    assert "No space left on device" in _one_error_line(capsys)
    assert _listing(tmp_path) == before  # old run intact, staging directory removed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_fit_cuda_without_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--device", "cuda", *TINY]) == 2
    assert "CUDA is not available" in _one_error_line(capsys)
    assert _listing(tmp_path) == set()


def _row(value: str = "0.5", width: int = T * F) -> list[str]:
    return [value] * width


def _csv(*rows: list[str]) -> str:
    return "\n".join(",".join(row) for row in rows) + "\n"


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.npy", None, "does not exist"),
        ("x.txt", "1,2,3\n", ".npy or .csv"),
        ("x.csv", _csv(_row(), _row()[:-1] + [""]), "line 2, column 64: missing value"),
        ("x.csv", _csv(_row(), _row(width=T * F - 1)), "expected 64 columns"),
        ("x.csv", _csv(_row(), _row() + ["1"]), "expected 64 columns"),
        ("x.csv", _csv(_row(), ["0.5", "dark"] + _row(width=T * F - 2)), "not a number: 'dark'"),
        ("x.csv", _csv(_row(), _row("nan")), "64 NaN/inf"),
        ("x.csv", _csv([f"p{i}" for i in range(T * F)]), "no data rows"),
        ("x.npy", np.zeros((3, T * F), np.float32), "shape (N, T, F=8)"),
        ("x.npy", np.zeros((3, T, F - 1), np.float32), "shape (N, T, F=8)"),
        ("x.npy", np.zeros((0, T, F), np.float32), "shape (N, T, F=8)"),
        ("x.npy", np.full((2, T, F), np.nan, np.float32), "128 NaN/inf"),
        ("x.npy", np.zeros((2, T + 1, F), np.float32), "max_len=8"),
        ("x.npy", np.array([{"a": 1}], dtype=object), "cannot read"),
        ("x.npy", np.zeros((2, T, F), np.int64), "floating-point features"),
        ("x.npy", "not an array\n", "cannot read"),
    ],
)
def test_predict_bad_input(name, content, message, run, tmp_path, capsys):
    path = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(path, content, allow_pickle=True)
    elif content is not None:
        path.write_text(content)
    before = _listing(tmp_path)
    args = ["predict", str(run[0]), "--input", str(path), "--output", str(tmp_path / "p.csv")]
    assert main(args) == 2
    assert message in _one_error_line(capsys)
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("output", ["no/p.csv", "folder"])
def test_predict_unwritable_output_names_the_option(output, run, splits, tmp_path, capsys):
    (tmp_path / "folder").mkdir()
    np.save(tmp_path / "x.npy", splits.test.x[:2].numpy())
    args = ["predict", str(run[0]), "--input", str(tmp_path / "x.npy")]
    assert main([*args, "--output", str(tmp_path / output)]) == 2
    assert "cannot write --output" in _one_error_line(capsys)


def test_predict_csv_with_pandas_default_header(run, splits, tmp_path):
    flat = splits.test.x[:5].reshape(5, T * F).numpy()
    pd.DataFrame(flat).to_csv(tmp_path / "x.csv", index=False)  # header 0,1,...,63
    args = ["predict", str(run[0]), "--input", str(tmp_path / "x.csv")]
    assert main([*args, "--output", str(tmp_path / "p.csv")]) == 0
    assert len(pd.read_csv(tmp_path / "p.csv")) == 5


@pytest.mark.parametrize("command", ["diagnose", "predict"])
@pytest.mark.parametrize("run_dir", ["empty", "absent"])
def test_not_a_run_directory(command, run_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    np.save(tmp_path / "x.npy", np.zeros((1, T, F), np.float32))
    extra = ["--input", str(tmp_path / "x.npy")] if command == "predict" else []
    assert main([command, str(tmp_path / run_dir), *extra]) == 2
    assert "is not a probtransformer run directory" in _one_error_line(capsys)


@pytest.mark.parametrize(
    "metrics_text, message",
    [('{"dataset": "nope", "seed": 0}', "unknown dataset 'nope'"), ("{not json", "not valid JSON")],
)
def test_diagnose_bad_metrics_file(metrics_text, message, run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run[0] / "posterior", copy / "posterior")
    (copy / "metrics.json").write_text(metrics_text)
    assert main(["diagnose", str(copy)]) == 2
    assert message in _one_error_line(capsys)


def test_missing_command_and_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in _one_error_line(capsys)
    done = subprocess.run(
        [sys.executable, "-m", "probtransformer.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert all(command in done.stdout for command in ("fit", "diagnose", "predict"))
