"""The task layer (`probtransformer.tasks`): every registered task builds its model from its
dataset's meta, `task_of` finds the task of a fitted model, and a fifth task registered here is
used by `probtransformer fit | predict | report` with no edit to the CLI or the report."""

import contextlib
import dataclasses
import io
import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from probtransformer import datasets
from probtransformer.cli import fit_parser, main
from probtransformer.models import (
    CausalLM,
    Seq2Seq,
    SequenceClassifier,
    SequenceRegressor,
    TokenTagger,
    register_model,
)
from probtransformer.report import SECTIONS, TASK_SECTIONS
from probtransformer.rundir import run_files
from probtransformer.tasks import TASKS, Task, register, task_for_dataset, task_of
from probtransformer.tasks.classification import ClassificationTask

TINY = dict(d_model=8, num_heads=2, num_layers=1, d_ff=16)
#: One dataset per built-in task, with the model class its task builds.
DATASETS = {
    "classification": ("digits", SequenceClassifier),
    "tagging": ("pydoc-wordseg", TokenTagger),
    "language-modeling": ("pydoc-text", CausalLM),
    "forecasting": ("sunspots", SequenceRegressor),
}


def test_the_four_task_families_are_registered_in_order():
    assert list(TASKS) == ["classification", "tagging", "language-modeling", "forecasting"]
    assert all(isinstance(task, Task) and TASKS[task.name] is task for task in TASKS.values())


@pytest.mark.parametrize("name", list(DATASETS))
def test_each_task_builds_its_model_from_the_dataset_meta(name):
    dataset, cls = DATASETS[name]
    if name == "forecasting":
        pytest.importorskip("statsmodels")
    meta = datasets.load(dataset).meta
    task = task_for_dataset(dataset)
    assert task is TASKS[name] is task_for_dataset(meta)
    model = task.build_model(meta, dict(TINY))
    assert type(model) is cls
    assert task_of(model) is task  # a CausalLM is a TokenTagger, yet language modelling
    config = model.config
    assert {key: config[key] for key in TINY} == TINY
    assert config["max_len"] == meta["max_len"]
    if name in ("classification", "tagging"):
        assert config["num_classes"] == meta["num_classes"]
    if name == "tagging":
        assert config["vocab_size"] == len(meta["vocab"])
    if name == "language-modeling":
        assert list(config["vocab"]) == list(meta["vocab"])
    if name == "forecasting":
        assert (config["horizon"], config["pooling"]) == (meta["horizon"], "last")
        assert config["y_loc"] == pytest.approx([meta["y_loc"]] * meta["horizon"])


def test_forecasting_builds_seq2seq_and_other_tasks_refuse_it():
    pytest.importorskip("statsmodels")
    meta = datasets.load("macrodata").meta
    model = TASKS["forecasting"].build_model(meta, dict(TINY), model="seq2seq")
    assert type(model) is Seq2Seq and task_of(model) is TASKS["forecasting"]
    assert (model.config["horizon"], model.config["max_len"]) == (2, 16)
    digits = datasets.load("digits").meta
    with pytest.raises(ValueError, match="model must be one of \\('auto',\\) for classification"):
        TASKS["classification"].build_model(digits, {}, model="seq2seq")


def test_unknown_tasks_datasets_and_models_are_refused():
    with pytest.raises(ValueError, match="has task 'ranking', which probtransformer fit does not"):
        task_for_dataset({"name": "toy", "task": "ranking"})
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        task_for_dataset("nope")
    with pytest.raises(ValueError, match="must hold 'task'"):
        task_for_dataset({"name": "toy"})
    with pytest.raises(TypeError, match="name or a meta dict, got int"):
        task_for_dataset(3)
    with pytest.raises(ValueError, match="does not write runs of a Linear"):
        task_of(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already registered"):
        register(ClassificationTask())
    with pytest.raises(TypeError, match="Task instance, got str"):
        register("classification")


# -- a fifth task, registered by a test: the CLI and the report use it unchanged ----------------


@register_model
class ToyClassifier(SequenceClassifier):
    """A classifier of its own task family (same model, another class)."""


NOTE_FILE = "toy-note.txt"


class ToyTask(ClassificationTask):
    """Classification plus one file of its own and one report section of its own."""

    name = "toy-classification"
    files = (*ClassificationTask.files, NOTE_FILE)
    sections = {**ClassificationTask.sections, "toy": "Toy section"}

    def model_classes(self):
        return (ToyClassifier,)

    def build_model(self, meta, options, *, model="auto"):
        self.check_model_choice(model)
        return ToyClassifier(meta["in_features"], meta["num_classes"], meta["max_len"], **options)

    def evaluate(self, post, splits, draws):
        evaluation = super().evaluate(post, splits, draws)
        write = evaluation.write

        def write_with_note(staging, record):
            write(staging, record)
            (staging / NOTE_FILE).write_text(f"accuracy {record['accuracy']:.6f}\n")

        return dataclasses.replace(evaluation, write=write_with_note)

    def report(self, context):
        sections, used = super().report(context)
        return {**sections, "toy": f"<p>toy run of {context.record['dataset']}</p>"}, used


@pytest.fixture
def toy_task(monkeypatch):
    """ToyTask registered, and a dataset "digits-toy" (digits under the toy task) listed."""
    task = ToyTask()
    monkeypatch.setitem(TASKS, task.name, task)
    available, load = datasets.available, datasets.load

    def toy_available():
        table = available()
        row = table[table["name"] == "digits"].assign(name="digits-toy", task=task.name)
        return pd.concat([table, row], ignore_index=True)

    def toy_load(name, **kwargs):
        if name != "digits-toy":
            return load(name, **kwargs)
        splits = load("digits", **kwargs)
        meta = {**splits.meta, "name": name, "task": task.name}
        return dataclasses.replace(splits, meta=meta)

    monkeypatch.setattr(datasets, "available", toy_available)
    monkeypatch.setattr(datasets, "load", toy_load)
    names = fit_parser.DATASET_NAMES
    monkeypatch.setitem(names.__dict__, "_names", toy_available()["name"].tolist())
    return task


def test_a_registered_task_is_found_by_dataset_and_by_model(toy_task):
    assert task_for_dataset("digits-toy") is toy_task
    assert task_for_dataset({"name": "digits-toy", "task": "toy-classification"}) is toy_task
    toy = ToyClassifier(8, 10, 8, **TINY)
    assert task_of(toy) is toy_task  # its own class is nearer than SequenceClassifier
    assert task_of(SequenceClassifier(8, 10, 8, **TINY)) is TASKS["classification"]
    assert NOTE_FILE in run_files()
    assert TASK_SECTIONS["toy-classification"] == (
        "metrics",
        "reliability",
        "risk-coverage",
        "toy",
        "attention",
        "head-importance",
        "diagnostics",
    )
    assert SECTIONS["toy"] == "Toy section"


def test_the_cli_fits_predicts_and_reports_a_registered_task(toy_task, tmp_path):
    out = tmp_path / "run"
    args = ["--num-train", "60", "--num-steps", "10", "--num-samples", "4", "--no-progress"]
    args += ["--d-model", "8", "--num-heads", "2", "--num-layers", "1", "--d-ff", "16"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["fit", "--dataset", "digits-toy", "--out", str(out), *args]) == 0
        assert main(["report", str(out), "--num-samples", "2"]) == 0
    record = json.loads((out / "metrics.json").read_text())
    assert (record["task"], record["model"], record["num_train"]) == (
        "toy-classification",
        "ToyClassifier",
        60,
    )
    files = {p.name for p in out.iterdir()}
    assert files == {
        "metrics.json",
        "inference_data.nc",
        "posterior",
        "attention.png",
        "diagnostics.json",
        "reliability.png",
        NOTE_FILE,
        "report.html",
    }
    assert (out / NOTE_FILE).read_text() == f"accuracy {record['accuracy']:.6f}\n"
    assert re.search(rf"^\s+accuracy\s+{record['accuracy']:.4f}$", printed.getvalue(), re.M)
    html = (out / "report.html").read_text(encoding="utf-8")
    assert re.findall(r'<h2 id="([a-z-]+)"', html) == list(TASK_SECTIONS["toy-classification"])
    assert "<p>toy run of digits-toy</p>" in html

    x = datasets.load("digits").test.x[:3].numpy()
    np.save(tmp_path / "x.npy", x)
    frame_path = tmp_path / "p.csv"
    input_args = ["--input", str(tmp_path / "x.npy"), "--output", str(frame_path)]
    assert main(["predict", str(out), *input_args]) == 0
    frame = pd.read_csv(frame_path)
    probs = frame[[f"prob_{c}" for c in range(10)]].to_numpy()
    assert probs.shape == (3, 10)
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
