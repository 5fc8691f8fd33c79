"""Progress of the long loops when stderr is not a terminal (``probtransformer._progress``):
``fit > log 2>&1`` must show the loop moving, as plain lines, not stay silent."""

import re

import pytest
import torch

from probtransformer import _progress
from probtransformer.datasets import SequenceData
from probtransformer.inference import NUTS, ChEES, fit_mcmc, fit_svi
from probtransformer.models import SequenceClassifier

T, F, C, N = 4, 3, 2, 16
#: ``desc: n/total unit (p%), rate unit/s, elapsed mm:ss, ETA mm:ss[, postfix]``
LINE = re.compile(
    r"^(?P<desc>[\w ()]+): (?P<n>\d+)/(?P<total>\d+) (?P<unit>\w+) \(\d+%\), +[\d.?]+ \w+/s, "
    r"elapsed \d\d:\d\d, ETA [\d:?]+"
)


@pytest.fixture
def every_update(monkeypatch):
    """A line at every update, not every 30 s."""
    monkeypatch.setattr(_progress, "LINE_INTERVAL_S", 0.0)


def _tiny():
    g = torch.Generator().manual_seed(0)
    data = SequenceData(torch.randn(N, T, F, generator=g), torch.randint(C, (N,), generator=g))
    model = SequenceClassifier(F, C, T, d_model=8, num_heads=2, num_layers=1, d_ff=8)
    return model, data


def _lines(err: str, desc: str) -> list[re.Match]:
    assert "\r" not in err  # a log, not a redrawn bar
    matches = [LINE.match(line) for line in err.splitlines()]
    return [m for m in matches if m is not None and m["desc"] == desc]


def test_lines_say_step_total_rate_and_eta_then_the_end(every_update, capsys):
    bar = _progress.progress_bar(range(5), desc="loop", leave=False)
    for i in bar:
        bar.set_postfix(loss=f"{i}.5")
    lines = _lines(capsys.readouterr().err, "loop")
    assert [int(m["n"]) for m in lines] == [0, 1, 2, 3, 4, 5]  # the start, each step, the end
    assert {int(m["total"]) for m in lines} == {5} and {m["unit"] for m in lines} == {"steps"}
    assert lines[-1].string.endswith("loss=4.5")


def test_lines_are_at_most_one_per_interval(capsys):
    for _ in _progress.progress_bar(range(1000), desc="fast"):  # well under 30 s
        pass
    assert [int(m["n"]) for m in _lines(capsys.readouterr().err, "fast")] == [0, 1000]


def test_progress_false_writes_nothing(every_update, capsys):
    for _ in _progress.progress_bar(range(3), progress=False, desc="quiet"):
        pass
    assert capsys.readouterr().err == ""


def test_fit_svi_logs_steps_and_elbo_when_stderr_is_a_file(every_update, capsys):
    model, data = _tiny()
    fit_svi(model, data, num_steps=30, batch_size=8, seed=0)
    lines = _lines(capsys.readouterr().err, "SVI")
    assert int(lines[-1]["n"]) == int(lines[-1]["total"]) == 30
    assert re.search(r"elbo=-?[\d.e+]+$", lines[-1].string)


def test_fit_svi_progress_false_stays_silent(every_update, capsys):
    model, data = _tiny()
    fit_svi(model, data, num_steps=5, batch_size=8, seed=0, progress=False)
    assert capsys.readouterr().err == ""


def test_nuts_logs_its_transitions_when_stderr_is_a_file(every_update, capsys):
    model, data = _tiny()
    fit_mcmc(
        model, data, kernel=NUTS(max_tree_depth=2), num_chains=1, num_warmup=3, num_samples=2,
        map_steps=10,
    )  # fmt: skip
    lines = _lines(capsys.readouterr().err, "NUTS")
    assert int(lines[-1]["n"]) == int(lines[-1]["total"]) == 5
    assert lines[-1]["unit"] == "transitions" and lines[-1].string.endswith("stage=sample")


def test_chees_logs_its_transitions_when_stderr_is_a_file(every_update, capsys):
    model, data = _tiny()
    fit_mcmc(model, data, kernel=ChEES(), num_chains=2, num_warmup=3, num_samples=2, map_steps=10)
    lines = _lines(capsys.readouterr().err, "chees (eager)")
    assert int(lines[-1]["n"]) == int(lines[-1]["total"]) == 5
