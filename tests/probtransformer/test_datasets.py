import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.datasets import load_digits

from probtransformer.datasets import DatasetSplits, SequenceData, available, load

N_DIGITS, N_TEST = 1797, 450


@pytest.fixture(scope="module")
def splits() -> DatasetSplits:
    return load("digits")


def _rows(d: SequenceData) -> set[bytes]:
    return {row.numpy().tobytes() for row in d.x}


def test_digits_shapes_dtypes_and_meta(splits):
    train, val, test = splits.train, splits.val, splits.test
    assert len(train) + len(val) + len(test) == N_DIGITS
    assert len(test) == N_TEST
    assert len(val) == 135  # ceil(0.1 * 1347)
    for d in (train, val, test):
        assert d.x.dtype == torch.float32 and d.x.shape[1:] == (8, 8)
        assert d.y.dtype == torch.int64 and d.y.shape == (len(d),)
        assert d.mask is None
        assert d.num_steps == 8 and d.in_features == 8
    meta = splits.meta
    assert meta["name"] == "digits" and meta["task"] == "classification"
    assert (meta["num_classes"], meta["max_len"], meta["in_features"]) == (10, 8, 8)
    assert meta["class_names"] == [str(c) for c in range(10)]
    assert "load_digits" in meta["source"]
    assert meta["ood"] is None and meta["holdout_classes"] == ()


def test_digits_pixels_scaled_to_unit_interval(splits):
    x = torch.cat([splits.train.x, splits.val.x, splits.test.x])
    assert x.min() == 0.0 and x.max() == 1.0
    # each step is one image row: the rows of the first test example match the raw image / 16
    raw = load_digits()
    images = {img.astype(np.float32).tobytes(): img for img in raw.images / 16.0}
    first = splits.test.x[0].numpy()
    np.testing.assert_allclose(first, images[first.tobytes()])


def test_test_split_is_stratified(splits):
    overall = np.bincount(load_digits().target, minlength=10) / N_DIGITS
    in_test = np.bincount(splits.test.y.numpy(), minlength=10) / N_TEST
    in_val = np.bincount(splits.val.y.numpy(), minlength=10) / len(splits.val)
    assert np.abs(in_test - overall).max() < 0.02
    assert np.abs(in_val - overall).max() < 0.02


def test_splits_deterministic_per_seed(splits):
    again = load("digits", seed=0)
    assert torch.equal(again.test.x, splits.test.x) and torch.equal(again.val.y, splits.val.y)
    other = load("digits", seed=1)
    assert not torch.equal(other.test.x, splits.test.x)


def test_val_is_carved_from_train_without_overlap(splits):
    full_train = load("digits", val_fraction=0.0)
    assert len(full_train.val) == 0 and full_train.val.x.shape == (0, 8, 8)
    assert len(full_train.train) == N_DIGITS - N_TEST
    train, val, test = _rows(splits.train), _rows(splits.val), _rows(splits.test)
    assert not train & val and not train & test and not val & test
    assert train | val == _rows(full_train.train)
    assert torch.equal(full_train.test.x, splits.test.x)  # val_fraction never moves the test split


def test_holdout_classes_go_to_ood(splits):
    held = load("digits", holdout_classes=(9, 3))
    assert held.meta["holdout_classes"] == (3, 9)
    for d in (held.train, held.val, held.test):
        assert not torch.isin(d.y, torch.tensor([3, 9])).any()
    ood = held.meta["ood"]
    assert isinstance(ood, SequenceData)
    assert sorted(ood.y.unique().tolist()) == [3, 9]
    assert len(ood) == 183 + 180  # every example of classes 3 and 9
    # in-distribution test examples are those of the plain split, holdout rows removed
    keep = ~torch.isin(splits.test.y, torch.tensor([3, 9]))
    assert torch.equal(held.test.x, splits.test.x[keep])
    total = len(held.train) + len(held.val) + len(held.test) + len(ood)
    assert total == N_DIGITS


def test_available_lists_digits():
    table = available()
    assert isinstance(table, pd.DataFrame)
    assert list(table.columns) == ["name", "task", "shape", "source", "extra"]
    row = table.set_index("name").loc["digits"]
    assert row["task"] == "classification" and row["extra"] == ""


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"name": "mnist"}, ValueError, "available: \\[.*'digits'"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"seed": -1}, ValueError, "seed"),
        ({"val_fraction": "0.1"}, TypeError, "val_fraction"),
        ({"val_fraction": 1.0}, ValueError, "val_fraction"),
        ({"val_fraction": 0.005}, ValueError, "val_fraction=0.005 .* 7 val"),
        ({"val_fraction": 0.995}, ValueError, "6 train"),
        ({"holdout_classes": (10,)}, ValueError, "holdout_classes"),
        ({"holdout_classes": (1.0,)}, TypeError, "holdout_classes"),
        ({"holdout_classes": tuple(range(9))}, ValueError, "at least 2"),
    ],
)
def test_load_rejects_bad_arguments(kwargs, error, match):
    kwargs = {"name": "digits", **kwargs}
    name = kwargs.pop("name")
    with pytest.raises(error, match=match):
        load(name, **kwargs)


def _toy(n: int = 6, t: int = 4, f: int = 3) -> SequenceData:
    x = torch.arange(n * t * f, dtype=torch.float32).reshape(n, t, f)
    mask = torch.arange(t).expand(n, t) < torch.arange(1, n + 1).clamp(max=t)[:, None]
    return SequenceData(x, torch.arange(n), mask)


def test_indexing_returns_sequence_data():
    d = _toy()
    one = d[2]
    assert isinstance(one, SequenceData) and one.x.shape == (1, 4, 3)
    assert one.y.tolist() == [2] and one.mask.shape == (1, 4)
    assert d[-1].y.tolist() == [5]
    part = d[1:4]
    assert part.x.shape == (3, 4, 3) and part.y.tolist() == [1, 2, 3]
    picked = d[torch.tensor([5, 0])]
    assert picked.y.tolist() == [5, 0] and torch.equal(picked.mask[1], d.mask[0])
    chosen = d[d.y % 2 == 0]
    assert chosen.y.tolist() == [0, 2, 4]
    assert d[np.array([1, 3])].y.tolist() == [1, 3]
    moved = d.to("cpu")
    assert torch.equal(moved.x, d.x) and torch.equal(moved.mask, d.mask)
    with pytest.raises(IndexError, match="out of range"):
        d[6]
    with pytest.raises(TypeError, match="index"):
        d[torch.tensor([0.0, 1.0])]
    with pytest.raises(ValueError, match="bool index"):
        d[torch.tensor([True, False])]


def test_conversions_from_numpy_and_pandas():
    d = SequenceData(np.zeros((3, 5, 2)), np.array([0, 1, 2], dtype=np.int32))
    assert d.x.dtype == torch.float32 and d.y.dtype == torch.int64
    table = SequenceData(pd.DataFrame({"a": [1.0, 2.0], "b": [3.0, 4.0]}), np.array([0.5, 1.5]))
    assert table.x.shape == (2, 2) and table.y.dtype == torch.float32
    assert table.num_steps is None and table.in_features == 2
    tokens = SequenceData(torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32))
    assert tokens.x.dtype == torch.int64 and tokens.num_steps == 3 and tokens.in_features is None
    empty = SequenceData(torch.zeros(0, 8, 8), torch.zeros(0, dtype=torch.int64))
    assert len(empty) == 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"mask": torch.ones(4, 3, dtype=torch.bool)},
            ValueError,
            r"mask must have shape \(N, T\)=\(4, 5\)",
        ),
        ({"mask": torch.ones(4, 5)}, TypeError, "mask must have dtype torch.bool"),
        ({"x": torch.full((4, 5, 2), float("nan"))}, ValueError, "x must be finite"),
        ({"x": torch.tensor([[[1.0, float("inf")]]])}, ValueError, "x must be finite"),
        ({"y": torch.zeros(3, dtype=torch.int64)}, ValueError, "y must have first dim N=4"),
        ({"x": torch.zeros(4, 5, 2, 1)}, ValueError, "x must be 3-D"),
        ({"x": torch.zeros(4, 5, 2, dtype=torch.int64)}, ValueError, "token ids"),
        ({"x": [[1.0, 2.0]]}, TypeError, "x must be a torch.Tensor"),
        ({"y": torch.tensor([float("nan")] * 4)}, ValueError, "y must be finite"),
    ],
)
def test_malformed_inputs_raise_naming_the_argument(kwargs, error, match):
    args = {"x": torch.zeros(4, 5, 2), "y": None, "mask": None, **kwargs}
    with pytest.raises(error, match=match):
        SequenceData(**args)
