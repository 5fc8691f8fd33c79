"""`probtransformer fit | predict | report | diagnose | generate` for every task family:
tagging, language modeling, forecasting (SequenceRegressor and Seq2Seq) and the classification
sets beyond digits (2-D patches, ragged sequences with a mask).

Every fit is tiny (d_model 8, one layer, 10 steps, 4 draws, a few training rows): the tests check
the run directory, the metrics and the commands, not the quality of the fits.
"""

import contextlib
import importlib
import io
import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch

import probtransformer.tasks.language_modeling
from probtransformer import datasets, metrics
from probtransformer.block import BAYESIAN_PARTS
from probtransformer.cli import main
from probtransformer.inference import load_posterior
from probtransformer.inference.diagnostics._arviz import az
from probtransformer.report import TASK_SECTIONS

TINY = [
    "--d-model", "8", "--num-heads", "2", "--num-layers", "1", "--d-ff", "16",
    "--num-steps", "10", "--num-samples", "4", "--no-progress",
]  # fmt: skip
DRAWS = 4
COMMON_FILES = {"metrics.json", "inference_data.nc", "posterior", "attention.png"}
COMMON_FILES |= {"diagnostics.json"}  # written by fit since the restructure (issue 14)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SAMPLE_TOKENS = 12  # generated characters per samples.json entry (fit writes 80)
IMAGE = re.compile(r'<img [^>]*src="data:image/png;base64,')


def _fit(out, *args) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["fit", "--out", str(out), *TINY, *args]) == 0
    return printed.getvalue()


def _record(run_dir) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def _finite(record: dict, keys) -> None:
    for key in keys:
        assert isinstance(record[key], float) and math.isfinite(record[key]), key


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """(run directory, printed output) of a tiny pydoc-text fit on 32 windows."""
    out = tmp_path_factory.mktemp("lm") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(probtransformer.tasks.language_modeling, "SAMPLE_TOKENS", SAMPLE_TOKENS)
        printed = _fit(out, "--dataset", "pydoc-text", "--num-train", "32")
    return out, printed


@pytest.fixture(scope="module")
def tagging_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tagging") / "run"
    return out, _fit(out, "--dataset", "pydoc-wordseg", "--num-train", "32")


@pytest.fixture(scope="module")
def forecast_run(tmp_path_factory):
    pytest.importorskip("statsmodels")
    out = tmp_path_factory.mktemp("forecast") / "run"
    return out, _fit(out, "--dataset", "sunspots")


# -- tagging ------------------------------------------------------------------------------------


def test_tagging_run_directory_and_metrics(tagging_run):
    run_dir, printed = tagging_run
    assert {p.name for p in run_dir.iterdir()} == COMMON_FILES | {"reliability.png"}
    assert (run_dir / "reliability.png").read_bytes()[:8] == PNG_MAGIC
    record = _record(run_dir)
    _finite(record, ("accuracy", "nll", "ece", "boundary_f1", "mean_epistemic"))
    assert (record["task"], record["model"], record["num_train"]) == ("tagging", "TokenTagger", 32)
    assert record["class_names"] == ["inside", "boundary"]
    assert 0 <= record["accuracy"] <= 1 and 0 <= record["boundary_f1"] <= 1
    assert record["nll"] > 0 and record["mean_epistemic"] >= 0
    assert re.search(r"^\s+boundary_f1\s+[\d.]+$", printed, re.MULTILINE), printed

    # the metrics are over the real (masked) characters of the test split only
    splits = datasets.load("pydoc-wordseg")
    test = splits.test
    assert record["num_test_tokens"] == int(test.mask.sum())
    post = load_posterior(run_dir / "posterior")
    assert post.model.config["vocab_size"] == len(splits.meta["vocab"])
    probs = post.predict(test.x, test.mask, num_samples=DRAWS, seed=0).mean
    flat, labels = metrics.token_level(probs, test.y, test.mask)
    assert record["accuracy"] == pytest.approx(metrics.accuracy(flat, labels), abs=1e-6)
    assert record["nll"] == pytest.approx(metrics.nll(flat, labels), abs=1e-5)
    from sklearn.metrics import f1_score

    f1 = f1_score(labels, flat.argmax(1), pos_label=1, zero_division=0.0)
    assert record["boundary_f1"] == pytest.approx(f1, abs=1e-6)


def test_tagging_predict_text_and_token_ids(tagging_run, tmp_path, capsys):
    run_dir, _ = tagging_run
    (tmp_path / "words.txt").write_text("Thisisatest\nhello world\n")
    assert main(["predict", str(run_dir), "--input", str(tmp_path / "words.txt")]) == 0
    frame = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)
    assert list(frame.columns) == [
        "sequence", "step", "token", "prob_inside", "prob_boundary", "predicted", "entropy",
        "aleatoric", "epistemic",
    ]  # fmt: skip
    # one row per real character; whitespace removed as in training
    assert "".join(frame["token"]) == "Thisisatesthelloworld"
    assert frame.groupby("sequence").size().tolist() == [11, 10]
    np.testing.assert_allclose(frame["prob_inside"] + frame["prob_boundary"], 1, atol=1e-5)

    np.save(tmp_path / "ids.npy", np.array([[5, 6, 7], [8, 9, 10]]))
    out = tmp_path / "p.csv"
    args = ["predict", str(run_dir), "--input", str(tmp_path / "ids.npy"), "--output", str(out)]
    assert main(args) == 0
    assert len(pd.read_csv(out)) == 6


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("x.npy", np.zeros((2, 3), np.float32), "must hold integer token ids"),
        ("x.npy", np.zeros(3, np.int64), "shape (N, T)"),
        ("ids.npy", np.full((1, 3), 10_000), "ids.npy must hold token ids in [0, "),
        ("ids.npy", np.full((1, 3), 2**63, np.uint64), f"fit int64, got values up to {2**63}"),
        (
            "ids.npy",
            np.zeros((1, 65), np.int64),
            "ids.npy has T=65 steps but the model was built for max_len=64",
        ),
        ("x.npy", "5,6,7\n", "x.npy is not a .npy file"),
        ("x.csv", "1,2,3\n", ".npy of int token ids (N, T) or a .txt file"),
        ("x.txt", "abc\n\ndef\n", "line 2 is blank"),
        ("x.txt", "a" * 65 + "\n", "line 1: 65 characters, but the model reads at most 64"),
        ("x.txt", "\n  \n", "line 1 is blank"),
    ],
)
def test_tagging_predict_bad_input(
    name, content, message, tagging_run, tmp_path, capsys, one_error_line
):
    path = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(path, content)
    else:
        path.write_text(content)
    assert main(["predict", str(tagging_run[0]), "--input", str(path)]) == 2
    assert message in one_error_line(capsys)


# -- language modeling --------------------------------------------------------------------------


def test_language_model_run_directory_and_metrics(lm_run):
    run_dir, printed = lm_run
    assert {p.name for p in run_dir.iterdir()} == COMMON_FILES | {"samples.json"}
    record = _record(run_dir)
    _finite(record, ("perplexity", "nll", "accuracy", "mean_epistemic"))
    assert (record["task"], record["model"]) == ("language-modeling", "CausalLM")
    assert record["perplexity"] == pytest.approx(math.exp(record["nll"]))
    assert record["perplexity"] >= 1 and 0 <= record["accuracy"] <= 1
    test = datasets.load("pydoc-text").test
    assert (record["num_test"], record["num_test_tokens"]) == (len(test), test.y.numel())
    assert "perplexity" in printed and "sample 1:" in printed

    # accumulated 32 windows at a time: the same numbers as one pass over the whole test split
    post = load_posterior(run_dir / "posterior")
    probs = post.predict(test.x, num_samples=DRAWS, seed=0).mean  # (715, 64, 101)
    assert record["perplexity"] == pytest.approx(metrics.perplexity(probs, test.y), rel=1e-5)
    flat, labels = metrics.token_level(probs, test.y)
    assert record["accuracy"] == pytest.approx(metrics.accuracy(flat, labels), abs=1e-6)

    samples = json.loads((run_dir / "samples.json").read_text())
    assert (samples["strategy"], samples["max_new_tokens"]) == ("greedy", SAMPLE_TOKENS)
    assert len(samples["samples"]) == 3
    for sample in samples["samples"]:
        assert len(sample["prompt"]) >= 32 and sample["continuation"]
        assert sample["mean_entropy"] >= 0 and sample["mean_epistemic"] >= 0


def _generate(run_dir, capsys, *args) -> tuple[int, str, str]:
    status = main(["generate", str(run_dir), *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_generate_prints_text_and_per_token_table(lm_run, tmp_path, capsys):
    run_dir, _ = lm_run
    status, out, err = _generate(
        run_dir, capsys, "--prompt", "The object", "--max-new-tokens", "7", "--num-samples", "3"
    )
    assert (status, err) == (0, "")
    assert re.search(r"^step\s+token\s+entropy\s+aleatoric\s+epistemic$", out, re.MULTILINE)
    assert len(re.findall(r"^\s+\d+  '", out, re.MULTILINE)) == 7
    assert "mean over 7 tokens: entropy" in out

    csv = tmp_path / "gen.csv"
    status, out, err = _generate(
        run_dir, capsys, "--prompt", "The object", "--max-new-tokens", "7",
        "--num-samples", "3", "--output", str(csv),
    )  # fmt: skip
    assert (status, err) == (0, "")
    frame = pd.read_csv(csv, keep_default_na=False, dtype={"token": str})
    assert list(frame.columns) == ["token_id", "token", "entropy", "aleatoric", "epistemic"]
    assert len(frame) == 7
    assert out.startswith("The object" + "".join(frame["token"]) + "\n")
    assert f"wrote {csv}" in out
    np.testing.assert_allclose(frame["entropy"], frame["aleatoric"] + frame["epistemic"], atol=1e-5)


def test_generate_refuses_an_unwritable_output_before_decoding(
    lm_run, tmp_path, monkeypatch, capsys, one_error_line
):
    generation = importlib.import_module("probtransformer.models.generate")
    monkeypatch.setattr(generation, "_decode", None)  # decoding would fail: it must not start
    args = ["generate", str(lm_run[0]), "--prompt", "The", "--output", str(tmp_path / "no/a.csv")]
    assert main(args) == 2
    assert f"cannot write --output {tmp_path / 'no/a.csv'}" in one_error_line(capsys)


def test_ctrl_c_during_generate_keeps_the_tokens_so_far(lm_run, tmp_path, monkeypatch, capsys):
    generation = importlib.import_module("probtransformer.models.generate")  # not the function
    args = ["--prompt", "The", "--max-new-tokens", "7", "--num-samples", "3", "--output"]
    assert _generate(lm_run[0], capsys, *args, str(tmp_path / "all.csv"))[0] == 0
    decode = generation._decode

    def impatient(*a, **k):  # Ctrl-C while the fourth token is decoded
        for i, step in enumerate(decode(*a, **k)):
            if i == 3:
                raise KeyboardInterrupt
            yield step

    monkeypatch.setattr(generation, "_decode", impatient)
    status, out, err = _generate(lm_run[0], capsys, *args, str(tmp_path / "part.csv"))
    assert status == 130
    stopped = "interrupted after 3 generated token(s); the output above holds them"
    assert err == f"probtransformer: stopped: {stopped}\n"
    part, whole = (
        pd.read_csv(tmp_path / f"{n}.csv", keep_default_na=False) for n in ("part", "all")
    )
    pd.testing.assert_frame_equal(part, whole.iloc[:3])  # the tokens of the uninterrupted run
    assert "mean over 3 tokens" in out


def test_generate_sampling_is_seeded(lm_run, capsys):
    args = ["--prompt", "a", "--max-new-tokens", "6", "--num-samples", "3", "--strategy"]
    texts = []
    for seed in ("1", "1", "2"):
        status, out, _ = _generate(
            lm_run[0], capsys, *args, "sample", "--thompson", "--top-k", "5", "--seed", seed
        )
        assert status == 0
        texts.append(out.split("\nstep")[0])
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-p", "0"], "argument --top-p: expected a number in (0, 1], got '0'"),
        (["--top-p", "1.5"], "argument --top-p: expected a number in (0, 1], got '1.5'"),
        (["--top-k", "0"], "argument --top-k: expected an integer >= 1, got '0'"),
        (["--temperature", "0"], "argument --temperature: expected a number > 0, finite, got '0'"),
        (["--temperature", "inf"], "argument --temperature: expected a number > 0, finite, got"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1, got"),
        (["--num-samples", "-1"], "argument --num-samples: expected an integer >= 1, got '-1'"),
        (["--strategy", "beam"], "invalid choice: 'beam'"),
        (["--top-k", "two"], "argument --top-k: expected an integer >= 1, got 'two'"),
    ],
)
def test_generate_bad_options(args, message, lm_run, capsys, one_error_line):
    assert main(["generate", str(lm_run[0]), "--prompt", "The", *args]) == 2
    assert message in one_error_line(capsys)


def test_generate_warns_about_characters_outside_the_vocabulary(lm_run, capsys):
    status, out, err = _generate(
        lm_run[0], capsys, "--prompt", "naïve ☃", "--max-new-tokens", "2", "--num-samples", "2"
    )
    assert status == 0 and out.startswith("naïve ☃")
    assert err.splitlines() == [
        "probtransformer: warning: 2 prompt character(s) are outside the vocabulary and were "
        "mapped to <unk>"
    ]


def test_generate_refuses_other_runs(tagging_run, tmp_path, capsys, one_error_line):
    assert main(["generate", str(tagging_run[0]), "--prompt", "The"]) == 2
    assert "is a tagging run (TokenTagger); generate needs a language-model run" in (
        one_error_line(capsys)
    )
    assert main(["generate", str(tmp_path), "--prompt", "The"]) == 2
    assert "is not a probtransformer run directory" in one_error_line(capsys)


def test_language_model_predict_text(lm_run, tmp_path, capsys):
    (tmp_path / "x.txt").write_text("def f(x):\n  return ☃\n")
    assert main(["predict", str(lm_run[0]), "--input", str(tmp_path / "x.txt")]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("probtransformer: warning: 1 character(s) of ") and "<unk>" in err
    frame = pd.read_csv(io.StringIO(out), keep_default_na=False, dtype={"token": str})
    assert list(frame.columns) == [
        "sequence", "step", "token", "predicted", "prob_predicted", "entropy", "aleatoric",
        "epistemic",
    ]  # fmt: skip
    assert frame.groupby("sequence").size().tolist() == [9, 10]  # no padding rows
    assert frame["token"].iloc[-1] == "<unk>"
    assert ((frame["prob_predicted"] > 0) & (frame["prob_predicted"] <= 1)).all()


def test_token_run_reports(lm_run, tagging_run):
    for run_dir, task in ((lm_run[0], "language-modeling"), (tagging_run[0], "tagging")):
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["report", str(run_dir), "--num-samples", "2"]) == 0
        text = (run_dir / "report.html").read_text(encoding="utf-8")
        assert re.findall(r'<h2 id="([a-z-]+)"', text) == list(TASK_SECTIONS[task])
        assert "verdict (svi" in text
    samples = text_of(lm_run[0], "samples", "attention")
    assert samples.count("<tr>") == 4  # header and 3 samples
    reliability = text_of(tagging_run[0], "reliability", "attention")
    assert len(IMAGE.findall(reliability)) == 1 and "test characters" in reliability


def text_of(run_dir, section: str, following: str) -> str:
    text = (run_dir / "report.html").read_text(encoding="utf-8")
    return text[text.find(f'id="{section}"') : text.find(f'id="{following}"')]


# -- forecasting --------------------------------------------------------------------------------


def test_forecast_run_directory_and_metrics(forecast_run):
    run_dir, printed = forecast_run
    assert {p.name for p in run_dir.iterdir()} == COMMON_FILES | {
        "predictions.csv",
        "forecast.png",
    }
    assert (run_dir / "forecast.png").read_bytes()[:8] == PNG_MAGIC
    record = _record(run_dir)
    _finite(record, ("rmse", "mae", "interval_coverage", "interval_width", "crps"))
    assert (record["task"], record["model"]) == ("forecasting", "SequenceRegressor")
    assert 0 <= record["interval_coverage"] <= 1 and record["interval_prob"] == 0.9
    assert record["crps"] > 0 and record["interval_width"] >= 0
    assert 0 < record["mae"] <= record["rmse"]
    assert (record["num_test"], record["horizon"], record["num_test_forecasts"]) == (60, 4, 240)
    assert re.search(r"^\s+interval_coverage\s+[\d.]+ \(90% predictive interval\)$", printed, re.M)
    config = load_posterior(run_dir / "posterior").model.config
    meta = datasets.load("sunspots").meta
    assert (config["horizon"], config["pooling"]) == (4, "last")
    # every part latent (the task's preset): point-estimate parts memorised the Nile windows
    assert sorted(config["bayesian"]) == sorted(BAYESIAN_PARTS)
    assert config["y_loc"] == pytest.approx([meta["y_loc"]] * 4)

    frame = pd.read_csv(run_dir / "predictions.csv")
    assert list(frame.columns) == ["origin", "step", "period", "mean", "lower", "upper", "y"]
    assert len(frame) == 240 and frame["step"].tolist()[:5] == [1, 2, 3, 4, 1]
    assert frame["origin"].iloc[0] == meta["origins"]["test"][0]
    assert frame["period"].iloc[0] == meta["series"].index[frame["origin"].iloc[0]]
    error = frame["mean"] - frame["y"]
    assert record["rmse"] == pytest.approx(float(np.sqrt((error**2).mean())), rel=1e-5)
    inside = (frame["lower"] <= frame["y"]) & (frame["y"] <= frame["upper"])
    assert record["interval_coverage"] == pytest.approx(inside.mean())
    assert (frame["lower"] <= frame["upper"]).all()
    # the coverage verdict: its band from 240 test points, a WARN only outside it
    low, high = record["interval_coverage_band"]
    assert (low, high) == pytest.approx(metrics.coverage_band(0.9, 240))
    far = not low <= record["interval_coverage"] <= high
    coverage = [w for w in record["warnings"] if "predictive interval" in w]
    assert [w.startswith("WARN") for w in coverage] == [True] * far
    # besides: the 10-step fit's collapsed guide
    assert all("guide sd / prior sd" in w for w in set(record["warnings"]) - set(coverage))
    flag = "WARN" if far else "ok  "
    assert re.search(
        rf"^  {flag}  90% predictive interval covers [\d.]+ of 240 test", printed, re.M
    )


def test_diagnose_flags_a_forecast_whose_interval_covers_too_little(forecast_run, tmp_path, capsys):
    """The verdict reads the test-split coverage from metrics.json: 0.39 of 240 points is far
    below a 90% interval's band."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(forecast_run[0], run_dir)
    record = _record(run_dir) | {"interval_coverage": 0.39}
    (run_dir / "metrics.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["diagnose", str(run_dir), "--num-samples", "10"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^WARN  90% predictive interval covers 0.390 of 240 test points", out, re.M)


def test_forecast_report_has_the_fan_chart(forecast_run, capsys):
    run_dir, _ = forecast_run
    assert main(["report", str(run_dir)]) == 0
    text = (run_dir / "report.html").read_text(encoding="utf-8")
    assert re.findall(r'<h2 id="([a-z-]+)"', text) == list(TASK_SECTIONS["forecasting"])
    section = text_of(run_dir, "forecast", "attention")
    assert len(IMAGE.findall(section)) == 1 and 'alt="forecast fan chart"' in section
    assert section.count("<tr>") == 1 + 4  # header, one coverage row per horizon step
    record = _record(run_dir)
    assert f"<td>{record['crps']:.4g}</td>" in text_of(run_dir, "metrics", "forecast")

    assert main(["diagnose", str(run_dir), "--num-samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "noise_scale" in out and "LOO: elpd_loo" in out


def test_forecast_predict_npy_and_csv(forecast_run, tmp_path):
    run_dir, _ = forecast_run
    x = datasets.load("sunspots").test.x[:3].numpy()  # (3, 32, 1)
    np.save(tmp_path / "x.npy", x)
    pd.DataFrame(x.reshape(3, -1)).to_csv(tmp_path / "x.csv", index=False)
    for name in ("x.npy", "x.csv"):
        out = tmp_path / f"{name}.out.csv"
        args = ["predict", str(run_dir), "--input", str(tmp_path / name), "--output", str(out)]
        assert main(args) == 0
    frame = pd.read_csv(tmp_path / "x.npy.out.csv")
    assert len(frame) == 3 and {"mean[0]", "mean[3]", "lower[3]", "upper[3]"} <= set(frame)
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "x.csv.out.csv"), frame)


def test_forecast_predict_refuses_text(forecast_run, tmp_path, capsys, one_error_line):
    (tmp_path / "x.txt").write_text("1 2 3\n")
    assert main(["predict", str(forecast_run[0]), "--input", str(tmp_path / "x.txt")]) == 2
    assert "must be a .npy or .csv file for a forecasting run" in one_error_line(capsys)


def test_seq2seq_forecasting(tmp_path, monkeypatch):
    pytest.importorskip("statsmodels")
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["fit", "--dataset", "macrodata", "--model", "seq2seq", *TINY]) == 0
    run_dir = tmp_path / "runs" / "macrodata-seq2seq-svi"  # never replaces the default model's
    assert "macrodata (Seq2Seq)" in printed.getvalue()
    record = _record(run_dir)
    assert record["model"] == "Seq2Seq"
    _finite(record, ("rmse", "mae", "interval_coverage", "interval_width", "crps"))
    assert 0 <= record["interval_coverage"] <= 1 and record["crps"] > 0
    config = load_posterior(run_dir / "posterior").model.config
    assert (config["horizon"], config["max_len"]) == (2, 16) and len(config["x_loc"]) == 4
    assert len(pd.read_csv(run_dir / "predictions.csv")) == 40 * 2
    idata = az.from_netcdf(run_dir / "inference_data.nc")
    assert dict(idata.log_likelihood["y"].sizes) == {"chain": 1, "draw": DRAWS, "obs": 128}


@pytest.mark.filterwarnings("ignore:num_warmup=2 is short")
def test_mcmc_preset_fits_every_training_row_of_a_forecasting_split(tmp_path):
    """The preset (ChEES from MAP-ensemble starts) on the whole training split; its model sizes
    cut to toy ones here."""
    pytest.importorskip("statsmodels")
    out = tmp_path / "run"
    args = ["--inference", "mcmc", "--num-chains", "2", "--num-starts", "2", "--num-warmup", "2"]
    args += ["--num-draws", "2", "--map-steps", "5", "--dataset", "macrodata", "--no-progress"]
    args += ["--d-model", "8", "--num-heads", "2", "--d-ff", "16"]
    assert main(["fit", "--out", str(out), *args]) == 0
    record = _record(out)
    assert (record["num_train"], record["num_samples"]) == (128, 4)  # every row; 2 x 2 draws
    assert (record["kernel"], record["init"], record["num_starts"]) == ("chees", "ensemble", 2)
    _finite(record, ("rmse", "crps"))


# -- classification beyond digits, and options per task -------------------------------------


def test_digits_patches_use_2d_positions(tmp_path):
    out = tmp_path / "run"
    _fit(out, "--dataset", "digits-patches", "--num-train", "64")
    record = _record(out)
    assert {p.name for p in out.iterdir()} == COMMON_FILES | {"reliability.png"}
    assert (record["task"], record["model"], record["num_test"]) == (
        "classification",
        "SequenceClassifier",
        450,
    )
    _finite(record, ("accuracy", "nll", "ece", "brier", "mean_epistemic"))
    assert load_posterior(out / "posterior").model.config["grid"] == [4, 4]


def test_ragged_classification_uses_the_mask(tmp_path):
    pytest.importorskip("sktime")
    out = tmp_path / "run"
    _fit(out, "--dataset", "JapaneseVowels", "--num-train", "60")
    record = _record(out)
    test = datasets.load("JapaneseVowels").test
    assert test.mask is not None and not test.mask.all()
    post = load_posterior(out / "posterior")
    probs = post.predict(test.x, test.mask, num_samples=DRAWS, seed=0).mean.double()
    probs = probs / probs.sum(-1, keepdim=True)
    assert record["accuracy"] == pytest.approx(metrics.accuracy(probs, test.y), abs=1e-6)
    assert record["nll"] == pytest.approx(metrics.nll(probs, test.y), abs=1e-6)
    unmasked = post.predict(test.x, num_samples=DRAWS, seed=0).mean
    assert not torch.allclose(unmasked, probs.float(), atol=1e-4)  # the mask matters


@pytest.mark.parametrize("dataset", ["digits", "pydoc-text", "pydoc-wordseg"])
def test_model_option_is_forecasting_only(dataset, tmp_path, monkeypatch, capsys, one_error_line):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--dataset", dataset, "--model", "seq2seq", *TINY]) == 2
    task = {"digits": "classification", "pydoc-text": "language-modeling"}.get(dataset, "tagging")
    assert f"--model seq2seq applies to forecasting datasets, not {dataset} ({task})" in (
        one_error_line(capsys)
    )
    assert list(tmp_path.iterdir()) == []


def test_num_train_beyond_a_text_split(tmp_path, capsys, one_error_line):
    assert main(["fit", "--dataset", "pydoc-text", "--num-train", "6000", *TINY]) == 2
    assert "--num-train 6000 exceeds the 5795 rows of the pydoc-text training split" in (
        one_error_line(capsys)
    )


def test_help_lists_the_tasks_and_generate_defaults(capsys):
    assert main(["fit", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--model {auto,seq2seq}" in text and "(default: auto)" in text
    names = text.replace("- ", "-")  # argparse wraps lines after hyphens
    assert all(name in names for name in ("pydoc-text", "pydoc-wordseg", "sunspots", "GunPoint"))
    assert "the first N 64-character windows" in text
    assert main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for option, default in (
        ("--max-new-tokens N tokens to generate", 100),
        ("--temperature T > 0; below 1 sharpens, above 1 flattens", 1.0),
        ("--num-samples S posterior draws", 100),
        ("--seed N seeds the draws and sampling", 0),
    ):
        assert f"{option} (default: {default})" in text
    assert "--top-p P keep the nucleus of probability mass P, in (0, 1] (default: None)" in text


@pytest.mark.slow
def test_nile_forecast_interval_covers_near_nominal(tmp_path):
    """Issue 44's Nile forecast, with fit's defaults: its 90% interval covered 0.39 of the 95
    test points while the embedding, feed-forward and norms were point estimates (they fitted
    the 43 training windows to RMSE 11, so the noise scale came out near 37 instead of ~140).
    About 3 minutes on one thread."""
    nile = pytest.importorskip("statsmodels.datasets.nile")
    nile.load_pandas().data.to_csv(tmp_path / "nile.csv", index=False)
    out = tmp_path / "run"
    args = ["--data", str(tmp_path / "nile.csv"), "--target", "volume", "--time", "year"]
    args += ["--task", "forecasting", "--context", "20", "--horizon", "5", "--threads", "1"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["fit", "--out", str(out), "--no-progress", *args]) == 0
    record = _record(out)
    assert record["num_test_forecasts"] == 95 and record["warnings"] == []
    assert 0.8 <= record["interval_coverage"] <= 0.97
    assert re.search(r"^  ok    90% predictive interval covers", printed.getvalue(), re.M)
