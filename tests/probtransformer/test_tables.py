"""Your own data: DataFrame, CSV and Parquet tables to the tensors the built-in loaders give,
and every bad input refused with the file, column and row named."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest
import torch

from probtransformer import datasets
from probtransformer.datasets import SequenceData
from probtransformer.datasets.tables import TableSchema, from_table, read_table


def long_frame(data: SequenceData, class_names=None) -> pd.DataFrame:
    """``data`` written out in the long layout: a row per real step."""
    n, t, f = data.x.shape
    mask = torch.ones(n, t, dtype=torch.bool) if data.mask is None else data.mask
    seq, step = torch.nonzero(mask, as_tuple=True)
    frame = pd.DataFrame(data.x[seq, step].numpy(), columns=[f"f{i}" for i in range(f)])
    frame.insert(0, "series", [f"s{i:04d}" for i in seq.tolist()])
    frame.insert(1, "t", step.numpy())
    labels = data.y[seq].numpy()
    frame["label"] = labels if class_names is None else [class_names[i] for i in labels]
    return frame


def wide_frame(data: SequenceData) -> pd.DataFrame:
    """Channel 0 of ``data`` in the wide layout: a row per sequence, a column per step, padded
    steps missing."""
    x = data.x[..., 0].numpy().astype(np.float64)
    if data.mask is not None:
        x = np.where(data.mask.numpy(), x, np.nan)
    frame = pd.DataFrame(x, columns=[f"t{i}" for i in range(x.shape[1])])
    frame["label"] = data.y.numpy()
    return frame


def write(frame: pd.DataFrame, path):
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path)
    return path


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits", seed=0).test


@pytest.mark.parametrize("suffix", ["", ".csv", ".parquet"])
def test_digits_round_trip_in_the_long_and_wide_layouts(digits, tmp_path, suffix):
    long, wide = long_frame(digits), wide_frame(digits)
    if suffix:
        read = SequenceData.from_csv if suffix == ".csv" else SequenceData.from_parquet
        got = read(write(long, tmp_path / f"long{suffix}"), target="label", id="series", time="t")
        got_wide = read(write(wide, tmp_path / f"wide{suffix}"), target="label")
    else:
        got = SequenceData.from_pandas(long, target="label", id="series", time="t")
        got_wide = SequenceData.from_pandas(wide, target="label")
    assert torch.equal(got.x, digits.x) and torch.equal(got.y, digits.y) and got.mask is None
    assert torch.equal(got_wide.x, digits.x[..., :1]) and torch.equal(got_wide.y, digits.y)


def test_a_ragged_ucr_set_round_trips_with_its_mask(tmp_path):
    pytest.importorskip("sktime")
    splits = datasets.load("JapaneseVowels", seed=0)
    test, names = splits.test, splits.meta["class_names"]
    for path in (tmp_path / "jv.csv", tmp_path / "jv.parquet"):
        schema_free = SequenceData.from_csv if path.suffix == ".csv" else SequenceData.from_parquet
        got = schema_free(
            write(long_frame(test, names), path), target="label", id="series", time="t"
        )
        assert torch.equal(got.mask, test.mask) and torch.equal(got.y, test.y)
        torch.testing.assert_close(got.x, test.x)  # padded steps 0 in both
    got = SequenceData.from_pandas(wide_frame(test), target="label")
    assert torch.equal(got.mask, test.mask)
    torch.testing.assert_close(got.x, test.x[..., :1])


def test_splits_learn_classes_and_scaling_from_train_only(digits):
    frame = long_frame(digits, class_names=[f"digit {i}" for i in range(10)])
    splits = from_table(frame, target="label", id="series", time="t", seed=3)
    meta = splits.meta
    assert meta["class_names"] == [f"digit {i}" for i in range(10)]
    assert meta["task"] == "classification" and meta["in_features"] == 8 and meta["max_len"] == 8
    assert len(splits.train) + len(splits.val) + len(splits.test) == len(digits)
    assert len(splits.test) == 113  # ceil(0.25 * 450) sequences, as the built-in loaders
    real = splits.train.x.reshape(-1, 8).double()
    torch.testing.assert_close(real.mean(0), torch.zeros(8, dtype=torch.double), atol=1e-5, rtol=0)
    schema = TableSchema.from_dict(json.loads(json.dumps(meta["table"])))
    again = SequenceData.from_pandas(frame, schema=schema)  # predict's path: the saved schema
    assert again.x.shape == digits.x.shape
    one_train_row = frame["series"].isin(frame["series"].unique()[:1])
    assert torch.equal(schema.encode(frame[one_train_row]).x[0], again.x[0])
    with pytest.raises(ValueError, match="not a valid table schema"):
        TableSchema.from_dict({**meta["table"], "layout": "diagonal"})


def test_text_columns_become_tokens_and_tags_a_target_per_step():
    frame = pd.DataFrame(
        {
            "sentence": [0, 0, 0, 1, 1, 2, 2, 2, 2] * 4,
            "position": [0, 1, 2, 0, 1, 0, 1, 2, 3] * 4,
            "word": ["the", "cat", "sat", "a", "dog", "the", "dog", "ran", "off"] * 4,
            "tag": ["DET", "NOUN", "VERB", "DET", "NOUN", "DET", "NOUN", "VERB", "ADP"] * 4,
        }
    )
    frame["sentence"] += np.repeat(np.arange(4) * 3, 9)
    data = SequenceData.from_pandas(frame, target="tag", id="sentence", time="position")
    schema = TableSchema.learn(frame, target="tag", id="sentence", time="position")
    assert schema.task == "tagging" and schema.vocab[0] == "<unk>"
    assert schema.class_names == ["ADP", "DET", "NOUN", "VERB"]
    assert data.x.dtype == torch.int64 and data.x.shape == (12, 4)
    assert [schema.vocab[i] for i in data.x[0, :3]] == ["the", "cat", "sat"]
    assert data.mask[1].tolist() == [True, True, False, False] and data.y[2, 3] == 0  # ADP
    unseen = frame.assign(word=frame["word"].replace("cat", "lion"))
    assert schema.encode(unseen).x[0, 1] == 0  # an unknown word: <unk>
    wide = pd.DataFrame({"text": ["abc", "ab", "cab", "b"], "y": ["x", "y", "x", "y"]})
    chars = SequenceData.from_pandas(wide, target="y")
    assert chars.x.shape == (4, 3) and chars.mask.sum(1).tolist() == [3, 2, 3, 1]


def _frame() -> pd.DataFrame:
    """A small long table: 12 sequences of 3 steps, 2 features, classes a/b."""
    return pd.DataFrame(
        {
            "id": np.repeat(np.arange(12), 3),
            "time": np.tile([1, 2, 3], 12),
            "u": np.linspace(0, 1, 36),
            "v": np.cos(np.arange(36.0)),
            "label": np.repeat(list("ab") * 6, 3),
        }
    )


def _bad(frame, row, column, value):
    bad = frame.copy()
    if value is not None and not isinstance(value, (float, int)):
        bad[column] = bad[column].astype(object)
    bad.loc[row, column] = value
    return bad


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.drop(columns="v"), r"data.csv has no column 'v'; its columns: \['id'"),
        (lambda f: _bad(f, 7, "u", np.nan), r"column 'u', row 7 \(line 9\): an empty cell"),
        (lambda f: _bad(f, 7, "u", "n/a"), r"column 'u', row 7 \(line 9\): 'n/a' \(features"),
        (lambda f: _bad(f, 8, "v", np.inf), r"column 'v', row 8 \(line 10\): inf"),
        (lambda f: _bad(f, 4, "label", None), r"column 'label', row 4 \(line 6\): missing value"),
        (lambda f: _bad(f, 4, "label", "NA"), r"'label', row 4 \(line 6\): missing value \('NA'\)"),
        (
            lambda f: _bad(f, 5, "label", "a"),
            r"column 'label': sequence '1' has two targets, 'b' at row 3 \(line 5\) and 'a' at "
            r"row 5 \(line 7\)",
        ),
        (
            lambda f: _bad(f, 10, "time", 0),
            r"column 'time': sequence '3' has time 0 at row 10 \(line 12\) after 1 at row 9 .*"
            r"time steps out of order",
        ),
        (lambda f: _bad(f, 10, "time", 1), r"sequence '3' has time 1 .* time steps duplicated"),
        (
            lambda f: _bad(f, 13, "v", "high"),
            r"column 'v' mixes types: .* at row 0 \(line 2\) is a number, 'high' at row 13 "
            r"\(line 15\) is not",
        ),
        (
            lambda f: _bad(f, slice(33, 35), "label", "c"),
            r"column 'label': class 'c' has 1 sequence\(s\); each class needs at least 3",
        ),
    ],
    ids=["missing-column", "empty", "n/a", "inf", "missing-target", "NA-target", "two-targets",
         "order", "duplicate", "mixed-types", "rare-class"],
)  # fmt: skip
def test_bad_input_names_the_file_the_column_and_the_row(tmp_path, change, message):
    path = tmp_path / "data.csv"
    change(_frame()).to_csv(path, index=False)
    with pytest.raises(ValueError, match=message):
        from_table(path, target="label", id="id", time="time", features=["u", "v"])


def test_a_class_unseen_in_training_is_refused_when_encoding_new_data():
    frame = _frame()
    schema = TableSchema.learn(frame, target="label", id="id", time="time")
    new = _bad(frame, slice(0, 2), "label", "z")
    with pytest.raises(ValueError, match=r"row 0: class 'z' did not occur in the training data"):
        schema.encode(new)
    longer = pd.concat([frame, frame.iloc[:1].assign(time=9)], ignore_index=True)
    with pytest.raises(ValueError, match="a sequence of 4 steps, longer than the 3"):
        schema.encode(longer)


def test_empty_and_oversized_files_are_refused_unread(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty.csv is empty"):
        read_table(empty)
    header = tmp_path / "header.csv"
    header.write_text("id,time,u\n")
    with pytest.raises(ValueError, match="has a header but no rows"):
        read_table(header)
    huge = tmp_path / "huge.csv"
    with open(huge, "wb") as f:  # a sparse 2 GB file: no disk, no memory
        f.truncate(2 * 2**30)
    with pytest.raises(ValueError, match=r"2,048 MiB, more than the 1,024 MiB a table may hold"):
        from_table(huge, target="label")
    assert os.path.getsize(huge) == 2 * 2**30
    with pytest.raises(
        ValueError, match=r"expected a .csv, .csv.gz or .parquet file, got suffix '.xlsx'"
    ):
        read_table(tmp_path / "book.xlsx")
    with pytest.raises(TypeError, match="table must be a DataFrame or a file path, got list"):
        from_table([1, 2], target="label")


def test_every_split_is_padded_to_the_longest_sequence_of_the_table():
    frame = _frame()
    longest = frame[frame["id"] == 11].assign(time=[4, 5, 6])
    frame = pd.concat([frame, longest], ignore_index=True)  # sequence 11: 6 steps
    splits = from_table(frame, target="label", id="id", time="time")
    assert splits.meta["max_len"] == 6
    assert {part.x.shape[1] for part in (splits.train, splits.val, splits.test)} == {6}


def test_a_series_round_trips_to_the_built_in_forecasting_windows(tmp_path):
    pytest.importorskip("statsmodels")
    built_in = datasets.load("sunspots", seed=0)
    series = built_in.meta["series"]
    path = tmp_path / "sunspots.csv"
    pd.DataFrame({"year": series.index, "spots": series.to_numpy()}).to_csv(path, index=False)
    origins = len(series) - 32 - 4 + 1
    splits = from_table(
        path, target="spots", time="year", task="forecasting", context=32, horizon=4,
        test_fraction=59.5 / origins,
    )  # fmt: skip
    for ours, theirs in zip(
        (splits.train, splits.val, splits.test),
        (built_in.train, built_in.val, built_in.test),
        strict=True,
    ):
        assert torch.equal(ours.x, theirs.x) and torch.equal(ours.y, theirs.y)
    for key in ("x_loc", "x_scale", "y_loc", "y_scale", "horizon", "max_len"):
        assert splits.meta[key] == pytest.approx(built_in.meta[key])
    frame = pd.read_csv(path)
    with pytest.raises(ValueError, match=r"column 'year': time 1750 at row 51 after 1750"):
        from_table(
            frame.assign(year=frame["year"].where(frame.index != 51, 1750)), target="spots",
            time="year", task="forecasting", context=32, horizon=4,
        )  # fmt: skip
    with pytest.raises(ValueError, match="40 time steps are too few for windows of context 32"):
        from_table(frame[:40], target="spots", time="year", task="forecasting", context=32,
                   horizon=4)  # fmt: skip
    with pytest.raises(ValueError, match="forecasting needs horizon as a positive int"):
        from_table(frame, target="spots", time="year", task="forecasting", context=32)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(id="label"), r"the target, id and time columns must be different columns, got "
                           r"target='label', id='label'"),
        (dict(features=["u", "u"]), r"feature column 'u' is listed twice"),
        (dict(features=["u", "label"]), r"the target column 'label' is also listed as a feature"),
        (dict(features=["u", "time"]), r"the time column 'time' is also listed as a feature"),
    ],
    ids=["target-is-id", "repeated-feature", "target-as-feature", "time-as-feature"],
)  # fmt: skip
def test_columns_in_two_roles_are_refused(options, message):
    columns = dict(target="label", id="id", time="time") | options
    with pytest.raises(ValueError, match=message):
        TableSchema.learn(_frame(), **columns)


def test_a_written_index_column_and_a_single_class_are_refused(tmp_path):
    path = tmp_path / "indexed.csv"
    _frame().to_csv(path)  # pandas writes its index as a column without a name
    with pytest.raises(ValueError, match=r"column 'Unnamed: 0' has no name: .*index=False"):
        from_table(path, target="label", id="id", time="time")
    with pytest.raises(ValueError, match=r"column 'label' holds one class \('b'\): .* at least 2"):
        TableSchema.learn(_frame().assign(label="b"), target="label", id="id", time="time")


def test_ids_stay_text_and_text_times_order_as_dates(tmp_path):
    frame = _frame()
    frame["id"] = frame["id"].map("{:04d}".format)  # "0001": not the number 1
    start = pd.Timestamp("2023-12-30")
    frame["time"] = [
        (start + pd.Timedelta(days=int(t))).strftime("%m/%d/%Y") for t in frame["time"]
    ]
    path = tmp_path / "dated.csv.gz"
    frame.to_csv(path, index=False)  # 12/31/2023 then 01/01/2024: out of order as text
    splits = from_table(path, target="label", id="id", time="time")
    reference = from_table(_frame(), target="label", id="id", time="time")
    assert torch.equal(splits.train.x, reference.train.x)
    assert splits.meta["table"]["id"] == "id"
    wrong = frame.assign(time=frame["time"].where(frame.index != 4, "soon"))
    with pytest.raises(
        ValueError, match=r"column 'time', row 4: time 'soon' is neither a number nor a date"
    ):
        from_table(wrong, target="label", id="id", time="time")


def test_each_column_is_judged_against_its_own_training_range():
    """Two columns on different scales (issue 44's walk: a in [7, 188], b in [10, 2500]): the
    range reported and checked is each column's own, not the pooled standardized range undone
    (which let a = 500 pass and reported b down to -99)."""
    from probtransformer.inference.inputs import out_of_range_message
    from probtransformer.tasks._base import table_scaling, training_range

    rng = np.random.default_rng(0)
    n = 40
    frame = pd.DataFrame(
        dict(
            id=np.repeat(np.arange(n), 2), t=np.tile([0, 1], n),
            a=rng.uniform(7, 188, 2 * n), b=rng.exponential(300, 2 * n).clip(10, 2500),
            y=np.repeat(np.arange(n) % 2, 2),
        )
    )  # fmt: skip
    schema = TableSchema.learn(frame, target="y", id="id", time="t")
    record = dict(table=json.loads(json.dumps(schema.to_dict())))  # as a run saves it
    scaling = table_scaling(record)
    x = schema.encode(frame).x  # (N, T, 2) standardized
    x_range = [float(x.min()), float(x.max())]
    assert training_range(x_range, scaling) == {
        "a": pytest.approx([frame["a"].min(), frame["a"].max()]),
        "b": pytest.approx([frame["b"].min(), frame["b"].max()]),
    }
    loc, scale = torch.tensor(schema.x_loc), torch.tensor(schema.x_scale)
    far = (torch.tensor([[[500.0, 100.0]]]) - loc) / scale  # a: 2.7x its max, b: inside
    message = out_of_range_message(far.float(), x_range, **scaling)
    assert message is not None and message.startswith("a spans [500, 500]")
    assert "b spans" not in message
    inside = (torch.tensor([[[100.0, 2000.0]]]) - loc) / scale
    assert out_of_range_message(inside.float(), x_range, **scaling) is None


def test_a_schema_with_text_for_a_number_names_the_field():
    schema = TableSchema(layout="wide", features=["a"], target="y", x_loc=[0.0], x_scale=[1.0])
    tampered = schema.to_dict() | {"x_loc": "os.system"}
    with pytest.raises(ValueError, match="table schema field 'x_loc' must be a list of finite"):
        TableSchema.from_dict(tampered)


def test_a_forecast_without_a_time_column_names_the_option():
    frame = pd.DataFrame(dict(year=np.arange(40), volume=np.arange(40.0)))
    with pytest.raises(ValueError, match=r"time='COL' \(--time COL\)"):
        from_table(frame, target="volume", task="forecasting", context=8, horizon=2)
