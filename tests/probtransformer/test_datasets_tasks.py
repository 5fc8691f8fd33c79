"""The datasets beyond "digits": digits-patches, the pydoc text sets, UCR/UEA and forecasting.

Every test here runs with networking off (the module-scoped `_offline` fixture): loading must
never download. The sktime / statsmodels datasets are skipped when the `datasets` extra is
missing; the missing-extra error itself is always checked by making their import fail.
"""

from __future__ import annotations

import builtins
import math
import socket
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch

from probtransformer import datasets
from probtransformer.datasets import DatasetSplits, SequenceData, available, load

SPLITS = ("train", "val", "test")
CORE = ("digits", "digits-patches", "pydoc-text", "pydoc-wordseg")
UCR = {  # name: (archive train, archive test, T, C, class names)
    "GunPoint": (50, 150, 150, 1, ["1", "2"]),
    "ItalyPowerDemand": (67, 1029, 24, 1, ["1", "2"]),
    "ArrowHead": (36, 175, 251, 1, ["0", "1", "2"]),
    "BasicMotions": (40, 40, 100, 6, ["badminton", "running", "standing", "walking"]),
    "JapaneseVowels": (270, 370, 29, 12, [str(c) for c in range(1, 10)]),
}
FORECASTS = {  # name: (n after preprocessing, L, H, F, season, test origins, frequency)
    "sunspots": (309, 32, 4, 1, 11, 60, "yearly"),
    "co2": (526, 36, 6, 1, 12, 48, "monthly"),
    "macrodata": (202, 16, 2, 4, 4, 40, "quarterly"),
}
CLASSIFICATION_KEYS = {
    "name", "task", "num_classes", "max_len", "in_features", "source", "class_names", "seed",
    "val_fraction", "holdout_classes", "ood",
}  # fmt: skip
FORECAST_KEYS = {
    "name", "task", "max_len", "context", "horizon", "in_features", "season", "frequency",
    "series", "features", "origins", "x_loc", "x_scale", "y_loc", "y_scale", "source", "seed",
    "val_fraction",
}  # fmt: skip


def _refuse(*args, **kwargs):
    raise OSError("networking is disabled in this test module")


@pytest.fixture(scope="module", autouse=True)
def _offline():
    """No socket may connect while any dataset of this module is loaded."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", _refuse)
        mp.setattr(socket.socket, "connect_ex", _refuse)
        yield


def _needs_extra(name: str) -> None:
    module = "sktime" if name in UCR else "statsmodels"
    pytest.importorskip(module)


def _pydoc_parts(val_fraction: float = 0.1) -> dict[str, str]:
    """The contiguous split written out independently of the loader."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    n_test = math.ceil(0.1 * len(text))
    rest = text[: len(text) - n_test]
    n_val = math.ceil(val_fraction * len(rest))
    return {
        "train": rest[: len(rest) - n_val],
        "val": rest[len(rest) - n_val :],
        "test": text[len(text) - n_test :],
    }


@pytest.fixture(scope="module")
def pydoc_text() -> DatasetSplits:
    return load("pydoc-text")


@pytest.fixture(scope="module")
def wordseg() -> DatasetSplits:
    return load("pydoc-wordseg")


# --- registry ------------------------------------------------------------------------------


def test_network_is_off_and_every_dataset_loads():
    with pytest.raises(OSError, match="networking is disabled"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    for name in available()["name"]:
        if name in UCR or name in FORECASTS:
            try:
                _needs_extra(name)
            except pytest.skip.Exception:
                continue
        splits = load(name)
        assert splits.meta["name"] == name
        for part in SPLITS:
            assert isinstance(getattr(splits, part), SequenceData)
        assert len(splits.train) > 0 and len(splits.test) > 0


def test_available_lists_every_dataset_with_its_extra():
    table = available().set_index("name")
    assert set(CORE) | set(UCR) | set(FORECASTS) == set(table.index)
    assert (table.loc[list(CORE), "extra"] == "").all()
    assert (table.loc[list(UCR) + list(FORECASTS), "extra"] == "datasets").all()
    assert table.loc["pydoc-text", "shape"] == "(N, 64) token ids"
    assert table.loc["pydoc-wordseg", "task"] == "tagging"
    assert table.loc["pydoc-text", "task"] == "language-modeling"
    assert set(table.loc[list(FORECASTS), "task"]) == {"forecasting"}
    assert "Dau et al. 2019" in table.loc["GunPoint", "source"]
    assert "statsmodels" in table.loc["co2", "source"]


def test_names_are_case_insensitive():
    assert load("DIGITS-Patches").meta["name"] == "digits-patches"
    assert load("Pydoc-Text").meta["name"] == "pydoc-text"
    with pytest.raises(ValueError, match=r"unknown dataset 'mnist'; available: \[.*'pydoc-text'"):
        load("mnist")
    with pytest.raises(TypeError, match="name must be a str"):
        load(3)


def test_case_insensitive_ucr_name():
    _needs_extra("GunPoint")
    assert load("gunpoint").meta["name"] == "GunPoint"


@pytest.mark.parametrize("name", ["pydoc-text", "pydoc-wordseg", "sunspots", "CO2"])
def test_holdout_classes_rejected_for_non_classification(name):
    with pytest.raises(ValueError, match=f"holdout_classes .*'{name.lower()}'"):
        load(name, holdout_classes=(1,))


@pytest.mark.parametrize("name", ["GunPoint", "JapaneseVowels", "sunspots", "co2", "macrodata"])
def test_missing_extra_raises_import_error(name, monkeypatch):
    real_import = builtins.__import__

    def failing_import(module, *args, **kwargs):
        if module.split(".")[0] in ("sktime", "statsmodels"):
            raise ModuleNotFoundError(f"No module named {module!r}")
        return real_import(module, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    expected = f"dataset '{name}' needs the optional extra: pip install 'probtransformer[datasets]'"
    with pytest.raises(ImportError) as info:
        load(name)
    assert str(info.value) == expected


# --- digits-patches --------------------------------------------------------------------------


def test_digits_patches_reassemble_to_the_digits_images():
    digits, patches = load("digits", seed=3), load("digits-patches", seed=3)
    meta = patches.meta
    assert CLASSIFICATION_KEYS | {"grid", "patch_size"} <= set(meta)
    assert (meta["num_classes"], meta["max_len"], meta["in_features"]) == (10, 16, 4)
    assert meta["grid"] == (4, 4) and meta["patch_size"] == 2
    assert meta["class_names"] == [str(c) for c in range(10)]
    for part in SPLITS:
        d, p = getattr(digits, part), getattr(patches, part)
        assert p.x.dtype == torch.float32 and p.x.shape == (len(d), 16, 4) and p.mask is None
        assert torch.equal(p.y, d.y)
        # (N, patch row, patch col, row in patch, col in patch) -> (N, 8, 8)
        images = p.x.reshape(-1, 4, 4, 2, 2).permute(0, 1, 3, 2, 4).reshape(-1, 8, 8)
        assert torch.equal(images, d.x)
    # patch 1 is rows 0-1, columns 2-3 of the image
    first = digits.test.x[0]
    assert patches.test.x[0, 1].tolist() == first[0:2, 2:4].reshape(-1).tolist()


def test_digits_patches_holdout():
    held = load("digits-patches", holdout_classes=(0,))
    assert len(held.meta["ood"]) == 178 and held.meta["ood"].x.shape[1:] == (16, 4)
    assert not (held.train.y == 0).any()


# --- pydoc-text --------------------------------------------------------------------------------


def test_pydoc_text_shapes_meta_and_vocab(pydoc_text):
    meta, parts = pydoc_text.meta, _pydoc_parts()
    assert {
        "name", "task", "vocab", "unk_id", "max_len", "num_classes", "source", "num_characters",
        "in_features",
    } <= set(meta)  # fmt: skip
    assert meta["task"] == "language-modeling" and meta["in_features"] is None
    assert meta["max_len"] == 64 and meta["unk_id"] == 0
    counts = Counter(parts["train"])
    expected = ["<unk>"] + sorted((c for c, k in counts.items() if k >= 5), key=ord)
    assert meta["vocab"] == expected and meta["num_classes"] == len(expected)
    assert meta["num_characters"] == {part: len(parts[part]) for part in SPLITS}
    assert sum(meta["num_characters"].values()) > 400_000
    for part in SPLITS:
        d = getattr(pydoc_text, part)
        assert len(d) == len(parts[part]) // 65
        assert d.x.dtype == d.y.dtype == torch.int64 and d.x.shape == d.y.shape == (len(d), 64)
        assert d.mask is None
        assert int(d.x.max()) < len(expected) and int(d.x.min()) >= 0


def test_pydoc_text_windows_are_the_contiguous_split(pydoc_text):
    """Each split's windows are its own text, in order: no character is shared across splits."""
    vocab, parts = pydoc_text.meta["vocab"], _pydoc_parts()
    for part in SPLITS:
        d = getattr(pydoc_text, part)
        ids, _ = datasets.encode_text(parts[part], vocab)
        windows = ids[: len(d) * 65].reshape(len(d), 65)
        assert torch.equal(d.x, windows[:, :-1]) and torch.equal(d.y, windows[:, 1:])
    assert sum(pydoc_text.meta["num_characters"].values()) == sum(map(len, parts.values()))


def test_pydoc_text_ignores_seed_and_val_fraction_moves_only_val(pydoc_text):
    again = load("pydoc-text", seed=7)
    for part in SPLITS:
        assert torch.equal(getattr(again, part).x, getattr(pydoc_text, part).x)
    no_val = load("pydoc-text", val_fraction=0.0)
    assert len(no_val.val) == 0 and no_val.val.x.shape == (0, 64)
    assert len(no_val.test) == len(pydoc_text.test)
    assert no_val.meta["num_characters"]["test"] == pydoc_text.meta["num_characters"]["test"]


def test_encode_decode_round_trip_and_unknowns(pydoc_text):
    vocab = pydoc_text.meta["vocab"]
    ids, unknown = datasets.encode_text("The assert statement.", vocab)
    assert ids.dtype == torch.int64 and ids.shape == (21,) and unknown == 0
    assert datasets.decode_text(ids, vocab) == "The assert statement."
    assert datasets.decode_text(ids.tolist(), vocab) == "The assert statement."
    ids, unknown = datasets.encode_text("a\u2603b\u00df", vocab)  # snowman, eszett (2 in train)
    assert unknown == 2 and ids.tolist()[1] == ids.tolist()[3] == 0
    assert datasets.decode_text(ids, vocab) == "a<unk>b<unk>"
    ids, unknown = datasets.encode_text("xyzx", ["<unk>", "x", "y"])
    assert ids.tolist() == [1, 2, 0, 1] and unknown == 1
    assert datasets.decode_text([], vocab) == ""
    with pytest.raises(ValueError, match="empty"):
        datasets.encode_text("", vocab)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, "):
        datasets.decode_text([1, len(vocab)], vocab)
    with pytest.raises(ValueError, match="ids must lie"):
        datasets.decode_text(torch.tensor([-1]), vocab)
    with pytest.raises(ValueError, match="1-D"):
        datasets.decode_text(torch.zeros(2, 2, dtype=torch.int64), vocab)
    with pytest.raises(TypeError, match="integers"):
        datasets.decode_text(torch.tensor([1.0]), vocab)
    with pytest.raises(TypeError, match="text must be a str"):
        datasets.encode_text(b"abc", vocab)
    with pytest.raises(ValueError, match="single characters"):
        datasets.encode_text("abc", ["<unk>", "ab"])


# --- pydoc-wordseg ---------------------------------------------------------------------------


def test_wordseg_shapes_and_meta(wordseg, pydoc_text):
    meta = wordseg.meta
    assert meta["task"] == "tagging" and meta["num_classes"] == 2
    assert meta["class_names"] == ["inside", "boundary"]
    assert meta["max_len"] == 64 and meta["in_features"] is None and meta["unk_id"] == 0
    assert meta["vocab"] == pydoc_text.meta["vocab"]
    space = meta["vocab"].index(" ")
    for part in SPLITS:
        d = getattr(wordseg, part)
        assert d.x.dtype == d.y.dtype == torch.int64 and d.mask.dtype == torch.bool
        assert d.x.shape == d.y.shape == d.mask.shape == (len(d), 64)
        assert not (d.x[d.mask] == space).any()
        assert (d.x[~d.mask] == 0).all() and (d.y[~d.mask] == 0).all()
        lengths = d.mask.sum(1)
        assert (lengths > 0).all()
        assert torch.equal(d.mask, torch.arange(64) < lengths[:, None])  # real steps first
        last = d.y[torch.arange(len(d)), lengths - 1]
        assert ((last == 1) | (lengths == 64)).all()  # whole words, or a long word's piece
    assert 5000 < len(wordseg.train) + len(wordseg.val) + len(wordseg.test) < 8000


def test_wordseg_labels_reconstruct_the_words(wordseg):
    vocab, parts = wordseg.meta["vocab"], _pydoc_parts()
    for part in SPLITS:
        d, words = getattr(wordseg, part), parts[part].split()
        assert wordseg.meta["num_words"][part] == len(words)
        ids, _ = datasets.encode_text("".join(words), vocab)
        assert torch.equal(d.x[d.mask], ids)  # packed in order, nothing lost
        ends = torch.nonzero(d.y[d.mask]).squeeze(1)
        assert torch.equal(ends, torch.tensor(np.cumsum([len(w) for w in words]) - 1))
    # decoded and cut at the boundaries: the words of the test text (unknown chars -> <unk>)
    d = wordseg.test
    cut = torch.nonzero(d.y[d.mask]).squeeze(1)[:-1] + 1
    decoded = [datasets.decode_text(w, vocab) for w in torch.tensor_split(d.x[d.mask], cut)]
    known = set(vocab[1:])
    words = ["".join(c if c in known else "<unk>" for c in w) for w in parts["test"].split()]
    assert decoded == words


def test_wordseg_long_words_are_cut_into_64_char_pieces(wordseg):
    words = _pydoc_parts()["train"].split()
    longest = max(words, key=len)
    assert len(longest) > 64
    d = wordseg.train
    full = d.mask.all(1) & (d.y[:, -1] == 0)
    assert full.any()  # a 64-char piece with no boundary at its end


# --- UCR/UEA -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(UCR))
def test_ucr_shapes_meta_and_archive_split(name):
    _needs_extra(name)
    n_train, n_test, t, c, class_names = UCR[name]
    splits = load(name)
    meta = splits.meta
    assert CLASSIFICATION_KEYS | {"x_loc", "x_scale"} <= set(meta)
    assert meta["task"] == "classification" and meta["class_names"] == class_names
    assert (meta["num_classes"], meta["max_len"], meta["in_features"]) == (len(class_names), t, c)
    assert len(meta["x_loc"]) == len(meta["x_scale"]) == c
    assert "UCR/UEA" in meta["source"]
    assert len(splits.test) == n_test and len(splits.train) + len(splits.val) == n_train
    assert len(splits.val) == math.ceil(0.1 * n_train)
    for part in SPLITS:
        d = getattr(splits, part)
        assert d.x.dtype == torch.float32 and d.x.shape[1:] == (t, c)
        assert d.y.dtype == torch.int64 and set(d.y.tolist()) <= set(range(len(class_names)))
        assert (d.mask is None) == (name != "JapaneseVowels")
    # standardized with the train split's real steps
    real = splits.train.x if splits.train.mask is None else splits.train.x[splits.train.mask]
    real = real.reshape(-1, c).double()
    assert torch.allclose(real.mean(0), torch.zeros(c, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(
        real.std(0, unbiased=False), torch.ones(c, dtype=torch.float64), atol=1e-3
    )
    # the test split is the archive's, in its order: undo the scaling to get the raw series
    from sktime.datasets import load_UCR_UEA_dataset

    raw, labels = load_UCR_UEA_dataset(name, split="test", return_type="nested_univ")
    first = np.stack([np.asarray(s, dtype=np.float64) for s in raw.iloc[0]], axis=1)
    x0 = splits.test.x[0, : len(first)].double().numpy()
    np.testing.assert_allclose(x0 * meta["x_scale"] + meta["x_loc"], first, rtol=1e-5, atol=1e-5)
    assert [class_names[i] for i in splits.test.y.tolist()] == [str(v) for v in labels]


def test_ucr_val_depends_on_seed_and_is_stratified():
    _needs_extra("BasicMotions")
    a, b = load("BasicMotions", seed=0), load("BasicMotions", seed=0)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.val.y, b.val.y)
    assert sorted(a.val.y.tolist()) == [0, 1, 2, 3]  # 4 val examples, one per class
    other = load("BasicMotions", seed=1)
    assert not torch.equal(other.val.x, a.val.x)
    assert torch.equal(other.test.y, a.test.y)  # the archive test split never moves


def test_japanese_vowels_mask_matches_lengths_and_padding_is_zero():
    _needs_extra("JapaneseVowels")
    from sktime.datasets import load_UCR_UEA_dataset

    splits = load("JapaneseVowels")
    raw, _ = load_UCR_UEA_dataset("JapaneseVowels", split="test", return_type="nested_univ")
    lengths = torch.tensor([len(s) for s in raw.iloc[:, 0]])
    assert torch.equal(splits.test.mask.sum(1), lengths)
    assert int(lengths.min()) == 7 and splits.meta["max_len"] == 29
    for part in SPLITS:
        d = getattr(splits, part)
        steps = d.mask.sum(1)
        assert torch.equal(d.mask, torch.arange(29) < steps[:, None])
        assert (d.x[~d.mask] == 0).all()
    held = load("JapaneseVowels", holdout_classes=(8,))
    ood = held.meta["ood"]
    assert ood.mask is not None and set(ood.y.tolist()) == {8}
    assert len(held.train) + len(held.val) + len(held.test) + len(ood) == 640


# --- forecasting -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORECASTS))
def test_forecast_windows_meta_and_splits(name):
    _needs_extra(name)
    n, context, horizon, f, season, k, frequency = FORECASTS[name]
    splits = load(name)
    meta = splits.meta
    assert FORECAST_KEYS <= set(meta)
    assert meta["task"] == "forecasting" and meta["frequency"] == frequency
    assert (meta["max_len"], meta["context"], meta["horizon"]) == (context, context, horizon)
    assert (meta["in_features"], meta["season"]) == (f, season)
    series, features, origins = meta["series"], meta["features"], meta["origins"]
    assert isinstance(series, pd.Series) and len(series) == n and not series.isna().any()
    assert isinstance(features, pd.DataFrame) and features.shape == (n, f)
    assert features.index.equals(series.index)
    all_origins = np.arange(context, n - horizon + 1)
    assert np.array_equal(origins["test"], all_origins[-k:])
    first_test = origins["test"][0]
    n_trainval = int((all_origins + horizon <= first_test).sum())
    assert len(origins["val"]) == math.ceil(0.1 * n_trainval)
    assert np.array_equal(
        np.concatenate([origins["train"], origins["val"]]),
        np.sort(np.concatenate([origins["train"], origins["val"]])),
    )  # chronological
    # no target period shared between splits
    targets = {p: {int(t) + h for t in origins[p] for h in range(horizon)} for p in SPLITS}
    assert not targets["train"] & targets["val"] and not targets["train"] & targets["test"]
    assert not targets["val"] & targets["test"]
    fx, fy = features.to_numpy(), series.to_numpy()
    for part in SPLITS:
        d, ts = getattr(splits, part), origins[part]
        assert d.x.dtype == d.y.dtype == torch.float32 and d.mask is None
        assert d.x.shape == (len(ts), context, f) and d.y.shape == (len(ts), horizon)
        expected_x = np.stack([fx[t - context : t] for t in ts])
        expected_y = np.stack([fy[t : t + horizon] for t in ts])
        np.testing.assert_allclose(d.x.numpy(), expected_x, rtol=1e-6)  # original units
        np.testing.assert_allclose(d.y.numpy(), expected_y, rtol=1e-6)
    train = splits.train
    np.testing.assert_allclose(meta["x_loc"], train.x.double().mean((0, 1)).numpy(), rtol=1e-5)
    np.testing.assert_allclose(meta["y_scale"], train.y.double().std(unbiased=False), rtol=1e-5)
    assert len(meta["x_scale"]) == f and isinstance(meta["y_loc"], float)
    assert load(name, seed=5).test.y.equal(splits.test.y)
    no_val = load(name, val_fraction=0.0)
    assert len(no_val.val) == 0 and no_val.val.x.shape == (0, context, f)
    assert len(no_val.train) == n_trainval


def test_forecast_series_specifics():
    _needs_extra("co2")
    sun = load("sunspots").meta["series"]
    assert sun.index[0] == 1700 and sun.index[-1] == 2008
    co2 = load("co2").meta
    assert co2["weeks_missing"] == 59 and co2["months_interpolated"] == 5
    assert (
        co2["series"].index.freqstr == "MS" and str(co2["series"].index[0].date()) == "1958-03-01"
    )
    macro = load("macrodata").meta
    assert list(macro["features"].columns) == [
        "realgdp_growth", "realcons_growth", "realinv_growth", "infl",
    ]  # fmt: skip
    assert str(macro["series"].index[0]) == "1959Q2" and str(macro["series"].index[-1]) == "2009Q3"
    assert macro["series"].equals(macro["features"]["realgdp_growth"])
    assert abs(macro["series"].iloc[0] - 400 * math.log(2778.801 / 2710.349)) < 1e-9


def test_forecast_val_fraction_too_large():
    _needs_extra("macrodata")
    with pytest.raises(ValueError, match="val_fraction=0.99 leaves no training window"):
        load("macrodata", val_fraction=0.99)
