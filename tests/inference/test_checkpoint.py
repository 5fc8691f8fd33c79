"""Checkpoints and resume of fit_svi, and the last finite state kept by the NaN guard."""

from __future__ import annotations

import json

import pytest
import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference import NonFiniteELBOError, fit_svi
from probtransformer.inference.vi.checkpoint import CHECKPOINT_VERSION
from probtransformer.models import SequenceClassifier

TINY = dict(d_model=8, num_heads=2, num_layers=1, d_ff=8)
SETTINGS = dict(num_steps=30, batch_size=16, lr=1e-2, seed=3, progress=False)


@pytest.fixture(scope="module")
def data() -> SequenceData:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, 3, generator=g)
    mask = torch.ones(40, 5, dtype=torch.bool)
    mask[::3, 3:] = False
    return SequenceData(x, (x[:, 0, 0] > 0).long(), mask)


def _model() -> SequenceClassifier:
    return SequenceClassifier(3, 2, 5, **TINY)


@pytest.fixture(scope="module")
def uninterrupted(data):
    return fit_svi(_model(), data, **SETTINGS)


def _interrupt_at_call(monkeypatch, calls: int) -> None:
    """Ctrl-C inside the ``calls``-th optimiser step."""
    original, seen = torch.optim.Adam.step, []

    def step(self, *args, **kwargs):
        seen.append(1)
        if len(seen) == calls:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", step)


def _states(post) -> dict[str, torch.Tensor]:
    return {**post.model.state_dict(), **post.guide.state_dict()}


def _largest_difference(a, b) -> float:
    sa, sb = _states(a), _states(b)
    assert sa.keys() == sb.keys()
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


def test_ctrl_c_saves_and_resume_matches_the_uninterrupted_fit(
    data, uninterrupted, tmp_path, monkeypatch
):
    path = tmp_path / "ckpt"
    _interrupt_at_call(monkeypatch, 17)  # during step 16 (0-based): 16 steps completed
    with pytest.raises(KeyboardInterrupt, match=f"step 16; saved to {path}"):
        fit_svi(_model(), data, checkpoint_dir=path, **SETTINGS)
    monkeypatch.undo()
    assert json.loads((path / "checkpoint.json").read_text())["step"] == 16
    resumed = fit_svi(_model(), data, resume_from=path, **SETTINGS)
    assert _largest_difference(resumed, uninterrupted) == 0.0
    assert resumed.record["elbo"] == uninterrupted.record["elbo"]
    x = data.x[:6]
    torch.testing.assert_close(
        resumed.predict(x, num_samples=5).probs, uninterrupted.predict(x, num_samples=5).probs
    )


def test_periodic_checkpoints_resume_to_the_same_numbers(
    data, uninterrupted, tmp_path, monkeypatch
):
    path = tmp_path / "ckpt"
    settings = {**SETTINGS, "num_steps": 30}
    # a fit killed during step 20 (no Ctrl-C handler runs): its last checkpoint is step 20
    original, calls = torch.optim.lr_scheduler.ExponentialLR.step, []

    def step(self, *args, **kwargs):
        calls.append(1)  # call 1 is the scheduler's own, at construction; k + 2 is step k's
        if len(calls) == 22:
            raise RuntimeError("killed")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.lr_scheduler.ExponentialLR, "step", step)
    with pytest.raises(RuntimeError, match="killed"):
        fit_svi(_model(), data, checkpoint_every=10, checkpoint_dir=path / "x", **settings)
    monkeypatch.undo()
    meta = json.loads((path / "x" / "checkpoint.json").read_text())
    assert meta["step"] == 20 and meta["format_version"] == CHECKPOINT_VERSION
    assert len(meta["elbo"]) == 20
    resumed = fit_svi(_model(), data, resume_from=path / "x", **settings)
    assert _largest_difference(resumed, uninterrupted) == 0.0
    # a finished fit's checkpoint resumes to itself
    full = fit_svi(_model(), data, checkpoint_every=10, checkpoint_dir=path / "y", **settings)
    again = fit_svi(_model(), data, resume_from=path / "y", **settings)
    assert _largest_difference(full, again) == 0.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(model=dict(d_model=16)), "its config is"),
        (dict(settings=dict(lr=2e-2)), "its settings are"),
        (dict(settings=dict(num_steps=40)), "its settings are"),
        (dict(data=True), "its data is"),
    ],
)
def test_resume_refuses_another_model_settings_or_data(data, tmp_path, change, message):
    path = tmp_path / "ckpt"
    fit_svi(_model(), data, checkpoint_every=10, checkpoint_dir=path, **SETTINGS)
    model = SequenceClassifier(3, 2, 5, **{**TINY, **change.get("model", {})})
    other = data[:30] if change.get("data") else data
    with pytest.raises(ValueError, match=message):
        fit_svi(model, other, resume_from=path, **{**SETTINGS, **change.get("settings", {})})


class _Touch:
    """Unpickles to a call that creates ``path``: the marker that loading ran code."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_bad_checkpoints_and_arguments(data, tmp_path):
    path = tmp_path / "ckpt"
    fit_svi(_model(), data, checkpoint_every=10, checkpoint_dir=path, **SETTINGS)
    with pytest.raises(FileNotFoundError, match="not an SVI checkpoint"):
        fit_svi(_model(), data, resume_from=tmp_path / "missing", **SETTINGS)
    meta = json.loads((path / "checkpoint.json").read_text())
    (path / "checkpoint.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version 99.*upgrade"):
        fit_svi(_model(), data, resume_from=path, **SETTINGS)
    (path / "checkpoint.json").write_text(json.dumps(meta))
    (path / "state.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="damaged"):
        fit_svi(_model(), data, resume_from=path, **SETTINGS)
    marker = tmp_path / "ran"
    torch.save({"step": _Touch(marker)}, path / "state.pt")  # a stranger's pickle
    with pytest.raises(ValueError, match="holds pickled objects, not only tensors: refused") as e:
        fit_svi(_model(), data, resume_from=path, **SETTINGS)
    assert not marker.exists() and "weights_only" not in str(e.value)  # no advice to unpickle
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_dir"):
        fit_svi(_model(), data, checkpoint_every=5, **SETTINGS)
    with pytest.raises(ValueError, match="checkpoint_every must be >= 1"):
        fit_svi(_model(), data, checkpoint_every=0, checkpoint_dir=path, **SETTINGS)
    with pytest.raises(TypeError, match="resume_from must be a str"):
        fit_svi(_model(), data, resume_from=3, **SETTINGS)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not one"):
        fit_svi(_model(), data, checkpoint_every=5, checkpoint_dir=tmp_path / "other", **SETTINGS)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_non_finite_elbo_keeps_the_last_finite_state(data):
    with pytest.raises(NonFiniteELBOError, match="non-finite at step") as info:
        fit_svi(_model(), data, num_steps=50, lr=1e4, init_scale=1.0, progress=False)
    error = info.value
    assert error.step >= 1 and "lower lr" in str(error)
    kept = error.posterior
    assert kept is not None and kept.record["steps_done"] == error.step - 1
    assert len(kept.record["elbo"]) == error.step - 1
    for value in {**kept.model.state_dict(), **kept.guide.state_dict()}.values():
        assert torch.isfinite(value).all()
