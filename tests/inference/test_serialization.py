import json
import shutil

import pyro
import pytest
import torch

from probtransformer.inference import FORMAT_VERSION, fit_svi, load_posterior
from probtransformer.models import SequenceClassifier


@pytest.fixture(scope="module")
def saved(small_posterior, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "posterior"
    small_posterior.save(path)
    return path


def test_layout_and_metadata(saved, small_posterior):
    assert sorted(p.name for p in saved.iterdir()) == ["posterior.json", "tensors.pt"]
    meta = json.loads((saved / "posterior.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["model_class"] == "probtransformer.models.classifier.SequenceClassifier"
    assert meta["config"] == small_posterior.model.config
    assert meta["guide"] == "normal"
    assert meta["record"]["elbo"] == small_posterior.record["elbo"]


def test_tensors_load_without_unpickling_objects(saved):
    tensors = torch.load(saved / "tensors.pt", weights_only=True)
    assert set(tensors) == {"model_state", "guide_state", "samples", "example"}
    assert all(isinstance(v, torch.Tensor) for v in tensors["model_state"].values())
    assert all(isinstance(v, torch.Tensor) for v in tensors["guide_state"].values())


def test_the_saved_example_row_does_not_carry_the_training_set(saved, small_posterior, digits):
    """The example is a one-row view of the training data; saving a view writes its whole
    storage, so it is copied first."""
    assert small_posterior.example.x.untyped_storage().nbytes() > 100_000  # a view of the data
    example = torch.load(saved / "tensors.pt", weights_only=True)["example"]
    assert example["x"].untyped_storage().nbytes() == example["x"].numel() * 4
    assert (saved / "tensors.pt").stat().st_size < 100_000


def test_round_trip_gives_identical_predictions(saved, small_posterior, digits):
    loaded = load_posterior(saved)
    assert isinstance(loaded.model, SequenceClassifier)
    assert loaded.latent_shapes == small_posterior.latent_shapes
    assert loaded.record == small_posterior.record
    x = digits.test.x[:16]
    before = small_posterior.predict(x, num_samples=8, seed=3).probs
    after = loaded.predict(x, num_samples=8, seed=3).probs
    assert torch.equal(before, after)
    att_before = small_posterior.attention(x[:2], num_samples=4, seed=1).samples
    att_after = loaded.attention(x[:2], num_samples=4, seed=1).samples
    assert torch.equal(att_before, att_after)
    draws_before, draws_after = small_posterior.draws(5, seed=2), loaded.draws(5, seed=2)
    assert all(torch.equal(v, draws_after[k]) for k, v in draws_before.items())


@pytest.mark.parametrize("guide", ["delta", "lowrank"])
def test_round_trip_for_other_guides(guide, digits, tmp_path):
    model = SequenceClassifier(8, 10, 8, d_model=8, num_heads=2, num_layers=1, d_ff=16)
    post = fit_svi(model, digits.train[:48], guide=guide, num_steps=5, progress=False)
    post.save(tmp_path / guide)
    loaded = load_posterior(tmp_path / guide)
    x = digits.test.x[:5]
    assert torch.equal(post.predict(x, num_samples=4).probs, loaded.predict(x, num_samples=4).probs)
    assert loaded.is_point_estimate == (guide == "delta")


def test_save_replaces_an_existing_posterior(small_posterior, tmp_path, digits):
    path = tmp_path / "p"
    other = fit_svi(
        SequenceClassifier(8, 10, 8, d_model=8, num_heads=2, num_layers=1, d_ff=16),
        digits.train[:32],
        num_steps=2,
        progress=False,
    )
    other.save(path)
    small_posterior.save(path)
    assert load_posterior(path).model.config == small_posterior.model.config
    assert [p.name for p in tmp_path.iterdir()] == ["p"]  # no staging directory left behind


def test_loading_leaves_the_global_param_store_alone(saved):
    pyro.param("user.value", torch.tensor(2.0))
    load_posterior(saved)
    assert set(pyro.get_param_store().keys()) == {"user.value"}


def test_newer_format_version_is_rejected(saved, tmp_path):
    copy = tmp_path / "newer"
    copy.mkdir()
    meta = json.loads((saved / "posterior.json").read_text())
    meta["format_version"] = FORMAT_VERSION + 1
    (copy / "posterior.json").write_text(json.dumps(meta))
    (copy / "tensors.pt").write_bytes((saved / "tensors.pt").read_bytes())
    with pytest.raises(ValueError, match="format_version"):
        load_posterior(copy)


def test_missing_directory_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_posterior(tmp_path / "does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="posterior.json"):
        load_posterior(tmp_path / "empty")


def test_unknown_model_class_is_rejected(saved, tmp_path):
    copy = tmp_path / "unknown"
    copy.mkdir()
    meta = json.loads((saved / "posterior.json").read_text())
    meta["model_class"] = "probtransformer.models.NoSuchModel"
    (copy / "posterior.json").write_text(json.dumps(meta))
    (copy / "tensors.pt").write_bytes((saved / "tensors.pt").read_bytes())
    with pytest.raises(ValueError, match="NoSuchModel"):
        load_posterior(copy)


@pytest.mark.parametrize("where", ["", ".", "folder"])
def test_save_never_deletes_files_it_did_not_write(small_posterior, tmp_path, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    own = [tmp_path / "notes.txt", tmp_path / "folder" / "paper.tex"]
    for path in own:
        path.write_text("the user's work")
    with pytest.raises(ValueError, match="refusing to replace"):
        small_posterior.save(where)
    assert all(path.read_text() == "the user's work" for path in own)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "notes.txt"]  # no staging


def test_save_rejects_a_file_and_a_non_path(small_posterior, tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        small_posterior.save(tmp_path / "a_file")
    with pytest.raises(TypeError, match="path must be a str"):
        small_posterior.save(None)
    with pytest.raises(TypeError, match="path must be a str"):
        load_posterior(None)


def test_unwritable_target_names_the_target(small_posterior):
    with pytest.raises(OSError, match="cannot save the posterior to /proc/nope"):
        small_posterior.save("/proc/nope")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize(
    "damage", ["bad_json", "nested_json", "truncated", "garbage", "other_model"]
)
def test_damaged_posteriors_raise_value_error(saved, small_posterior, tmp_path, digits, damage):
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    if damage == "bad_json":
        (copy / "posterior.json").write_text("{not json")
    elif damage == "nested_json":  # Python's parser raised RecursionError
        (copy / "posterior.json").write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "truncated":
        data = (copy / "tensors.pt").read_bytes()
        (copy / "tensors.pt").write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        (copy / "tensors.pt").write_bytes(b"\x80\x04garbage" * 10)
    else:  # tensors of a model of another size under this posterior.json
        other = fit_svi(
            SequenceClassifier(8, 10, 8, d_model=8, num_heads=2, num_layers=1, d_ff=16),
            digits.train[:64],
            num_steps=2,
            progress=False,
        )
        other.save(tmp_path / "other")
        shutil.copy(tmp_path / "other" / "tensors.pt", copy / "tensors.pt")
    with pytest.raises(ValueError, match="damaged"):
        load_posterior(copy)
