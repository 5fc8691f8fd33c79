"""Tests of `probtransformer report` / `probtransformer.report.write_report` on one tiny run."""

import base64
import contextlib
import io
import json
import re
import shutil

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from probtransformer.cli import main
from probtransformer.inference import Posterior
from probtransformer.plots import risk_coverage_figure
from probtransformer.report import NO_GATES, SECTIONS, TASK_SECTIONS, write_report

TINY = [
    "--d-model", "8", "--num-heads", "2", "--num-layers", "1", "--d-ff", "16",
    "--num-steps", "50", "--num-train", "100", "--num-samples", "10", "--no-progress",
]  # fmt: skip
RUN_FILES = {"metrics.json", "inference_data.nc", "posterior", "attention.png", "reliability.png"}
RUN_FILES |= {"diagnostics.json"}  # written by fit since the restructure (issue 14)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
IMAGE = re.compile(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run directory with its report: (run_dir, report text, printed output)."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["fit", "--out", str(run_dir), *TINY]) == 0
        assert main(["report", str(run_dir)]) == 0
    return run_dir, (run_dir / "report.html").read_text(encoding="utf-8"), printed.getvalue()


def _images(text: str) -> list[bytes]:
    return [base64.b64decode(data, validate=True) for data in IMAGE.findall(text)]


def test_report_is_written_next_to_the_run(run):
    run_dir, _, printed = run
    assert f"wrote {run_dir / 'report.html'}" in printed
    assert {p.name for p in run_dir.iterdir()} == RUN_FILES | {"report.html"}  # no temp file


def test_report_has_every_section_in_order(run):
    _, text, _ = run
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    classification = TASK_SECTIONS["classification"]
    assert re.findall(r'<h2 id="([a-z-]+)"', text) == list(classification)
    assert list(classification) == [
        "metrics",
        "reliability",
        "risk-coverage",
        "attention",
        "head-importance",
        "diagnostics",
    ]
    for sections in TASK_SECTIONS.values():  # every task's sections, in the page order
        assert list(sections) == [key for key in SECTIONS if key in sections]


def test_report_images_are_embedded_pngs(run):
    _, text, _ = run
    images = _images(text)
    # reliability, risk-coverage, attention of two test sequences
    assert len(images) >= 4
    assert all(image[:8] == PNG_MAGIC for image in images)
    assert text.count("<img ") == len(images)  # every image is a data URI


def test_report_references_nothing_outside_itself(run):
    run_dir, text, _ = run
    assert "<style>" in text
    assert re.findall(r'src="(?!data:image/png;base64,)', text) == []
    hrefs = set(re.findall(r'href="([^"]*)"', text))
    assert hrefs == {f"#{key}" for key in TASK_SECTIONS["classification"]}
    for needle in ('src="http', "<script", "<link", "url(", "file:", '.png"', str(run_dir)):
        assert needle not in text, needle


def test_report_numbers_are_those_of_the_run(run):
    run_dir, text, _ = run
    record = json.loads((run_dir / "metrics.json").read_text())
    metrics = text[text.find('id="metrics"') : text.find('id="reliability"')]
    assert f"<td>{record['accuracy']:.4g}</td>" in metrics
    assert f"<td>{record['nll']:.4g}</td>" in metrics
    # the report draws the test predictions again with the run's seed and draws: same accuracy
    full = re.search(r'<td class="text">100%</td><td>([0-9.]+)</td><td>([0-9.]+)</td>', text)
    assert full is not None
    assert float(full.group(1)) == float(full.group(2)) == pytest.approx(record["accuracy"])
    assert "AURC" in text


def test_report_separates_test_metrics_from_run_settings(run):
    run_dir, text, _ = run
    record = json.loads((run_dir / "metrics.json").read_text())
    section = text[text.find('id="metrics"') : text.find('id="reliability"')]
    metrics, settings = section.split("<h3>Run settings</h3>")
    shown = re.findall(r'<tr><td class="text">([a-z_]+)</td>', metrics)
    assert shown == ["accuracy", "nll", "ece", "brier", "mean_epistemic"]  # metrics only
    listed = re.findall(r'<tr><td class="text">([a-z_]+)</td>', settings)
    assert listed[:2] == ["inference", "seconds"]
    assert sorted(listed) == sorted(set(record) - set(shown))  # every other key, once
    assert '<td class="text">guide</td><td>normal</td>' in settings


def test_report_wraps_long_lines(run):
    _, text, _ = run
    style = text[text.find("<style>") : text.find("</style>")]
    # verdict lines run to 200+ characters: wrapped in the page's width, not scrolled past it
    assert re.search(r"pre \{[^}]*white-space: pre-wrap", style)
    assert "overflow-x" not in style


def test_report_attention_table_and_diagnostics(run):
    _, text, _ = run
    attention = text[text.find('id="attention"') : text.find('id="head-importance"')]
    assert "<th>head 0</th><th>head 1</th>" in attention
    rows = re.findall(r'<td class="text">0</td><td>([0-9.]+)</td><td>([0-9.]+)</td>', attention)
    assert len(rows) == 1 and all(float(v) >= 0 for v in rows[0])
    diagnostics = text[text.find('id="diagnostics"') :]
    assert "verdict (svi" in diagnostics and "LOO" in diagnostics
    assert "mean_sd" in diagnostics


def test_report_without_head_gates_says_so(run):
    _, text, _ = run
    section = text[text.find('id="head-importance"') : text.find('id="diagnostics"')]
    assert NO_GATES in section
    assert "<img" not in section


def test_report_with_head_importance(run, tmp_path, monkeypatch):
    frame = pd.DataFrame(
        dict(layer=[0, 0], head=[0, 1], mean=[0.9, 0.1], lower=[0.8, 0.0], upper=[1.0, 0.3])
    )
    monkeypatch.setattr(Posterior, "head_importance", lambda self: frame, raising=False)
    monkeypatch.setattr(Posterior, "effective_num_heads", lambda self: 1.25, raising=False)
    run_dir = tmp_path / "run"
    shutil.copytree(run[0], run_dir)
    path = write_report(run_dir, num_samples=4)
    assert path == run_dir / "report.html"
    text = path.read_text(encoding="utf-8")
    section = text[text.find('id="head-importance"') : text.find('id="diagnostics"')]
    assert NO_GATES not in section
    assert len(_images(section)) == 1 and _images(section)[0][:8] == PNG_MAGIC
    assert "<th>lower</th>" in section and "<td>0.9</td>" in section
    assert "Effective number of heads: 1.25" in section


def test_report_when_head_importance_raises(run, tmp_path, monkeypatch):
    def no_gates(self):
        raise ValueError("this model has no head gates")

    monkeypatch.setattr(Posterior, "head_importance", no_gates, raising=False)
    run_dir = tmp_path / "run"
    shutil.copytree(run[0], run_dir)
    text = write_report(run_dir, num_samples=4, seed=3).read_text(encoding="utf-8")
    assert NO_GATES in text
    assert "(seed 3)" in text


def test_fit_over_a_reported_run_replaces_it(run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(run[0], run_dir)
    assert main(["fit", "--out", str(run_dir), *TINY, "--num-steps", "5", "--overwrite"]) == 0
    assert {p.name for p in run_dir.iterdir()} == RUN_FILES  # the stale report went with the run


@pytest.mark.parametrize("kind", ["absent", "empty", "file", "no-posterior"])
def test_report_of_a_non_run_directory(kind, tmp_path, capsys, one_error_line):
    target = tmp_path / "target"
    if kind == "empty":
        target.mkdir()
    elif kind == "file":
        target.write_text("x")
    elif kind == "no-posterior":
        target.mkdir()
        (target / "metrics.json").write_text("{}")
    assert main(["report", str(target)]) == 2
    words = "does not exist" if kind == "absent" else "is not a probtransformer run directory"
    assert words in one_error_line(capsys)
    assert not (target / "report.html").exists()


@pytest.mark.parametrize(
    "metrics_text, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"seed": 0}', "does not record dataset and seed"),
        ('{"dataset": "nope", "seed": 0}', "unknown dataset 'nope'"),
        ('{"dataset": "digits", "seed": 0, "num_train": 100000}', "records num_train 100000"),
    ],
)
def test_report_bad_metrics_file(metrics_text, message, run, tmp_path, capsys, one_error_line):
    copy = tmp_path / "run"
    shutil.copytree(run[0] / "posterior", copy / "posterior")
    (copy / "metrics.json").write_text(metrics_text)
    assert main(["report", str(copy)]) == 2
    assert message in one_error_line(capsys)
    assert not (copy / "report.html").exists()


def test_report_bad_arguments(tmp_path, capsys, one_error_line):
    assert main(["report", str(tmp_path), "--num-samples", "0"]) == 2
    assert "--num-samples" in one_error_line(capsys)
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        write_report(tmp_path, num_samples=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        write_report(tmp_path, seed="0")
    with pytest.raises(ValueError, match="is not a probtransformer run directory"):
        write_report(tmp_path)


def test_risk_coverage_figure():
    correct = np.array([True, True, False, True, False])
    good = np.array([0.1, 0.2, 0.9, 0.3, 0.8])  # errors ranked last: the oracle's AURC
    fig = risk_coverage_figure({"good": good, "bad": -good}, correct, title="t")
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels[0] == "good (AURC = 0.1300)" and labels[2] == "oracle (AURC = 0.1300)"
    assert labels[1].startswith("bad (AURC = ")
    np.testing.assert_allclose(fig.axes[0].get_lines()[0].get_ydata(), [0, 0, 0, 1 / 4, 2 / 5])
    with pytest.raises(ValueError, match="at least one"):
        risk_coverage_figure({}, correct)
    with pytest.raises(TypeError, match="scores must map"):
        risk_coverage_figure([good], correct)
    with pytest.raises(TypeError, match="correct must be a bool"):
        risk_coverage_figure({"good": good}, correct.astype(int))
