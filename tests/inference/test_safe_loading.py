"""Loading a run never executes code the run names: only registered model classes are rebuilt,
from a config checked against their constructor (issue 14, fault 1)."""

import collections
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroSample

from probtransformer.cli import main
from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_svi, load_posterior
from probtransformer.models import (
    BayesianLinearRegression,
    SequenceClassifier,
    register_model,
    registry,
)
from probtransformer.models.registry import ENTRY_POINT_GROUP, class_path, model_from_config

FIXTURE_RUN = Path(__file__).parents[1] / "fixtures" / "main-0fadaf9" / "run"
LINEAR = "probtransformer.models.linear.BayesianLinearRegression"


class _Regression(PyroModule):
    """``y_n ~ N(w · x_n, noise²)`` with ``w ~ N(0, I)``: the README's "Your own model" protocol."""

    likelihood_site = "y"

    def __init__(self, in_features: int, *, noise: float = 1.0) -> None:
        super().__init__()
        self.config = {"in_features": in_features, "noise": noise}
        self.noise = noise
        self.w = PyroSample(dist.Normal(0.0, 1.0).expand([in_features]).to_event(1))

    def forward(self, x, y=None, mask=None, *, num_data=None):
        w = self.w  # (*draws, P): read before the data plate
        loc = (w * x).sum(-1)  # (*draws, N)
        N = len(x)
        with pyro.plate("data", num_data or N, subsample=torch.arange(N)):
            pyro.sample("y", dist.Normal(loc, self.noise), obs=y)
        return loc


@register_model
class RegisteredRegression(_Regression):
    """A user's model registered with the decorator."""


class UnregisteredRegression(_Regression):
    """The same model, not registered."""


class EntryPointRegression(_Regression):
    """The same model, offered by an (emulated) installed entry point."""


class _EntryPoint:
    """What ``importlib.metadata.entry_points`` yields: ``name``, ``value`` and ``load()``."""

    def __init__(self, name: str, obj: object) -> None:
        self.name, self.value, self._obj = name, f"user_package:{name}", obj

    def load(self) -> object:
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


@pytest.fixture
def regression_data() -> SequenceData:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 2, generator=g)
    return SequenceData(x, x @ torch.tensor([1.0, -2.0]) + 0.1 * torch.randn(20, generator=g))


def _crafted_run(tmp_path: Path, model_class: str, config: dict) -> Path:
    """The fixture run of main 0fadaf9 with ``posterior.json`` naming ``model_class``."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, run)
    meta_path = run / "posterior" / "posterior.json"
    meta = json.loads(meta_path.read_text())
    meta.update(model_class=model_class, config=config)
    meta_path.write_text(json.dumps(meta))
    return run


def _attacks(marker: Path) -> list[tuple[str, dict]]:
    return [
        ("os.system", {"command": f"touch {marker}"}),
        ("builtins.eval", {"source": f"open({str(marker)!r}, 'w')"}),
        ("collections.OrderedDict", {}),
    ]


@pytest.mark.parametrize("attack", range(3))
def test_crafted_run_executes_nothing_and_raises_value_error(tmp_path, attack):
    marker = tmp_path / "pwned"
    model_class, config = _attacks(marker)[attack]
    run = _crafted_run(tmp_path, model_class, config)
    with pytest.raises(ValueError, match="not a registered model class") as info:
        load_posterior(run / "posterior")
    assert repr(model_class) in str(info.value)
    assert "@probtransformer.models.register_model" in str(info.value)
    assert not marker.exists()


def test_a_named_module_is_never_imported(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    (tmp_path / "pwnmodule.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nclass Model:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run = _crafted_run(tmp_path, "pwnmodule.Model", {})
    with pytest.raises(ValueError, match="'pwnmodule.Model'"):
        load_posterior(run / "posterior")
    assert "pwnmodule" not in sys.modules
    assert not marker.exists()


@pytest.mark.parametrize("command", ["diagnose", "predict"])
def test_crafted_run_through_the_cli_fails_in_one_line(tmp_path, capsys, command):
    marker = tmp_path / "pwned"
    run = _crafted_run(tmp_path, "os.system", {"command": f"touch {marker}"})
    np.save(tmp_path / "x.npy", np.zeros((1, 8, 8), np.float32))
    extra = ["--input", str(tmp_path / "x.npy")] if command == "predict" else []
    status = main([command, str(run), *extra])
    err = capsys.readouterr().err
    assert status == 2
    assert len(err.strip().splitlines()) == 1
    assert "'os.system'" in err and "not a registered model class" in err
    assert not marker.exists()


def test_unknown_and_missing_config_keys_are_named():
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]"):
        model_from_config(LINEAR, {"in_features": 2, "bogus": 1})
    with pytest.raises(ValueError, match=r"missing required keys \['in_features'\]"):
        model_from_config(LINEAR, {"noise_scale": 1.0})
    with pytest.raises(ValueError, match="must be a dict with str keys, got list"):
        model_from_config(LINEAR, [2])
    with pytest.raises(ValueError, match="must be a str class path, got NoneType"):
        model_from_config(None, {"in_features": 2})


def test_config_keys_are_checked_for_a_saved_run(tmp_path):
    meta = json.loads((FIXTURE_RUN / "posterior" / "posterior.json").read_text())
    config = {**meta["config"], "extra_option": 1}
    del config["num_classes"]
    run = _crafted_run(tmp_path, meta["model_class"], config)
    with pytest.raises(ValueError) as info:
        load_posterior(run / "posterior")
    message = str(info.value)
    assert "unknown keys ['extra_option']" in message
    assert "missing required keys ['num_classes']" in message
    assert str(run / "posterior") in message


def test_constructor_errors_are_value_errors_naming_the_run():
    with pytest.raises(ValueError, match="cannot rebuild the BayesianLinearRegression of run-7"):
        model_from_config(LINEAR, {"in_features": 0}, source="run-7")
    with pytest.raises(ValueError, match="cannot rebuild the SequenceClassifier"):
        model_from_config(
            class_path(SequenceClassifier),
            {"in_features": 8, "num_classes": 10, "max_len": 8, "weight_prior": {"type": "Nope"}},
        )


def test_built_in_models_rebuild_from_their_config():
    model = BayesianLinearRegression(3, prior_scale=2.0, fit_intercept=False)
    rebuilt = model_from_config(class_path(BayesianLinearRegression), model.config)
    assert type(rebuilt) is BayesianLinearRegression
    assert rebuilt.config == model.config
    classifier = SequenceClassifier(8, 10, 8, d_model=8, num_heads=2, num_layers=1, d_ff=16)
    config = json.loads(json.dumps(classifier.config))  # as read back from posterior.json
    rebuilt = model_from_config(class_path(SequenceClassifier), config)
    assert type(rebuilt) is SequenceClassifier
    assert rebuilt.config == classifier.config


def test_registered_user_model_saves_and_loads(regression_data, tmp_path):
    post = fit_svi(
        RegisteredRegression(2, noise=0.5), regression_data, num_steps=20, progress=False
    )
    post.save(tmp_path / "post")
    meta = json.loads((tmp_path / "post" / "posterior.json").read_text())
    assert meta["model_class"] == class_path(RegisteredRegression)
    loaded = load_posterior(tmp_path / "post")
    assert type(loaded.model) is RegisteredRegression
    assert loaded.model.config == {"in_features": 2, "noise": 0.5}
    x = torch.randn(4, 2)
    before = post.predict(x, num_samples=6, seed=3)
    after = loaded.predict(x, num_samples=6, seed=3)
    assert before.loc.shape == (6, 4)
    assert torch.equal(before.loc, after.loc)


def test_unregistered_user_model_is_refused_before_writing(regression_data, tmp_path):
    post = fit_svi(UnregisteredRegression(2), regression_data, num_steps=2, progress=False)
    with pytest.raises(ValueError, match="not registered.*@probtransformer.models.register_model"):
        post.save(tmp_path / "post")
    assert list(tmp_path.iterdir()) == []


def test_register_model_returns_the_class_and_refuses_others():
    assert register_model(RegisteredRegression) is RegisteredRegression
    with pytest.raises(TypeError, match="PyroModule subclass, got OrderedDict"):
        register_model(collections.OrderedDict)
    with pytest.raises(TypeError, match="PyroModule subclass, got function"):
        register_model(lambda: None)
    with pytest.raises(TypeError, match="PyroModule subclass, got Linear"):
        register_model(torch.nn.Linear(2, 2))


def test_entry_points_are_read_only_for_unknown_names(monkeypatch):
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    groups = []

    def entry_points(*, group):
        groups.append(group)
        return [
            _EntryPoint("broken", ImportError("no module named user_package")),
            _EntryPoint("not_a_model", len),
            _EntryPoint("regression", EntryPointRegression),
        ]

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", entry_points)
    model_from_config(LINEAR, {"in_features": 2})
    model_from_config(class_path(RegisteredRegression), {"in_features": 2})
    assert groups == []  # registered names never read the installed entry points
    with pytest.warns(UserWarning, match="skipped the entry point") as caught:
        model = model_from_config(class_path(EntryPointRegression), {"in_features": 3})
    assert groups == [ENTRY_POINT_GROUP]
    assert type(model) is EntryPointRegression
    assert model.config == {"in_features": 3, "noise": 1.0}
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert "broken" in messages[0] and "ImportError" in messages[0]
    assert "not_a_model" in messages[1] and "builtin_function_or_method" in messages[1]
    with pytest.raises(ValueError, match="not a registered model class"):
        with pytest.warns(UserWarning, match="skipped the entry point"):
            model_from_config("user_package.Missing", {})
    assert groups == [ENTRY_POINT_GROUP] * 2


class _Touch:
    """A pickled object whose unpickling would create ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_tensors_file_holding_pickled_objects_is_refused_unread(tmp_path):
    marker = tmp_path / "pwned"
    run = _crafted_run(tmp_path, LINEAR, {"in_features": 3})
    torch.save({"model_state": {}, "payload": _Touch(marker)}, run / "posterior" / "tensors.pt")
    with pytest.raises(ValueError, match="holds pickled objects, not only tensors: refused"):
        load_posterior(run / "posterior")
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"hello\n", b"garbage", "/etc/passwd"])
def test_a_tensors_file_that_is_not_a_torch_file_is_named(tmp_path, content):
    """Text, random bytes and a link to a system file make torch's readers fail with KeyError,
    UnpicklingError or IndexError: each is one ValueError saying what the file is not."""
    run = _crafted_run(tmp_path, LINEAR, {"in_features": 3})
    tensors = run / "posterior" / "tensors.pt"
    if isinstance(content, bytes):
        tensors.write_bytes(content)
    else:
        tensors.unlink()
        tensors.symlink_to(content)
    with pytest.raises(ValueError, match="is not a saved posterior's tensors"):
        load_posterior(run / "posterior")


def test_a_config_that_does_not_match_the_tensors_is_refused_before_building(tmp_path):
    """The classifier of the fixture run, with a d_model a thousand times larger in its config:
    compared on the meta device (no memory), refused before the real model is built."""
    run = _crafted_run(tmp_path, "probtransformer.models.classifier.SequenceClassifier", {})
    meta_path = run / "posterior" / "posterior.json"
    saved = json.loads((FIXTURE_RUN / "posterior" / "posterior.json").read_text())
    meta = json.loads(meta_path.read_text())
    meta["config"] = {**saved["config"], "d_model": 8_000}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"config does not match its tensors.pt: .* shape"):
        load_posterior(run / "posterior")


@pytest.mark.parametrize(
    "change, words",
    [
        # 200,000 layers took minutes to build even on the meta device (a fresh user's attack)
        (dict(num_layers=200_000), r"asks for num_layers=200000 but its tensors.pt holds 1 layer"),
        # the sinusoidal table is not saved: 1e9 positions reached the allocator
        (dict(max_len=10**9), r"max_len must be <= 65536 .* got 1000000000"),
        # weights that no machine here holds: refused before anything is allocated
        (dict(d_model=8_000_000), r"d_model=8000000, .* GiB of memory this process may use"),
    ],
)
def test_a_config_asking_for_huge_unsaved_sizes_is_refused_at_once(tmp_path, change, words):
    run = _crafted_run(tmp_path, "probtransformer.models.classifier.SequenceClassifier", {})
    meta_path = run / "posterior" / "posterior.json"
    saved = json.loads((FIXTURE_RUN / "posterior" / "posterior.json").read_text())
    meta = json.loads(meta_path.read_text())
    meta["config"] = {**saved["config"], **change}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=words):
        load_posterior(run / "posterior")


def test_a_run_directory_loads_its_posterior(tmp_path):
    # every CLI command takes the run directory: load_posterior does too
    post = load_posterior(FIXTURE_RUN)
    saved = load_posterior(FIXTURE_RUN / "posterior")
    assert post.record == saved.record and type(post.model) is type(saved.model)
    state, saved_state = post.model.state_dict(), saved.model.state_dict()
    assert all(torch.equal(state[key], saved_state[key]) for key in saved_state)
    other = tmp_path / "notes"
    other.mkdir()
    with pytest.raises(FileNotFoundError, match=r"notes is not a saved posterior \(no "):
        load_posterior(other)


@pytest.mark.parametrize(
    "x_range", [[float("nan"), 1.0], [0.0, float("inf")], [1.0, 0.0], [0, "1"]]
)
def test_a_training_range_that_would_silence_the_range_warning_is_refused(tmp_path, x_range):
    """NaN bounds compare false, so a run with them never warned of inputs out of range."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, run)
    meta_path = run / "posterior" / "posterior.json"
    meta = json.loads(meta_path.read_text())
    meta["record"]["x_range"] = x_range
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"record.x_range must be finite \[low, high\]"):
        load_posterior(run / "posterior")


def test_a_nan_written_into_the_tensors_is_named_at_load(tmp_path):
    """It was blamed on the inputs ("are the inputs scaled as in training?") at predict time."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, run)
    path = run / "posterior" / "tensors.pt"
    tensors = torch.load(path, weights_only=True)
    name = next(k for k, v in tensors["model_state"].items() if v.is_floating_point())
    tensors["model_state"][name].view(-1)[0] = float("nan")
    torch.save(tensors, path)
    with pytest.raises(ValueError, match=rf"tensors.pt is damaged: model_state\['{name}'\] holds"):
        load_posterior(run / "posterior")
