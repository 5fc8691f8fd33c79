"""Your own sequences from a pandas DataFrame, a CSV or a Parquet file.

Two layouts (``TableSchema.layout``):

- **long**: one row per (sequence id, time step): an ``id`` column, a ``time`` column
  (sortable: numbers or dates), feature columns, and a target column, constant within a
  sequence (classification) or one per step (tagging). Sequences may differ in length: they
  are padded at the end and masked.
- **wide**: one row per sequence, no ``id``/``time``: the feature columns, in their order, are
  the time steps of one channel, and the target is the sequence's.

Encoding, learned by ``TableSchema.learn`` on the training rows only and saved with a run
(``to_dict``/``from_dict``, plain JSON), so new data are encoded the same way:

- string or categorical labels become class indices ``0..C-1`` in sorted order
  (``class_names``); integer labels are treated the same way (their values are the names);
- a text feature (one column of strings) becomes token ids: in the long layout one token per
  step, in the wide layout one character per step; id 0 is ``"<unk>"`` (also the padding),
  then the training tokens in sorted order (``vocab``);
- numeric features are standardized with the mean and standard deviation of the real training
  steps (``x_loc``, ``x_scale``; ``scale=False`` keeps them as they are).

Every check names the source (file or "DataFrame"), the column and the row (the 0-based row
of the table; in a CSV file, line = row + 2) of the first offending value.
"""

from __future__ import annotations

import hashlib
import math
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from probtransformer.data import DatasetSplits, SequenceData
from probtransformer.datasets._splits import TEST_FRACTION, tail_count

#: Files larger than this are refused before they are read (``max_bytes`` overrides it): a
#: table is read whole into memory, and its tensors take a few times its size again.
MAX_TABLE_BYTES = 1 << 30

#: The token of unknown text and of padding, id 0 of every vocabulary.
UNK = "<unk>"

#: The names pandas gives columns without a header cell (its index, written by ``to_csv``).
_UNNAMED = re.compile(r"Unnamed: \d+")

TASKS = ("classification", "tagging", "regression")  # TableSchema's; from_table adds forecasting
LAYOUTS = ("long", "wide")
SUFFIXES = {".csv": "csv", ".csv.gz": "csv", ".parquet": "parquet", ".pq": "parquet"}


def read_table(
    path: str | Path, *, max_bytes: int = MAX_TABLE_BYTES, text_columns: tuple[str, ...] = ()
) -> pd.DataFrame:
    """The DataFrame of a ``.csv`` (or ``.csv.gz``) or ``.parquet`` file, read without
    executing anything; a CSV's ``text_columns`` are read as text (an id "0042" stays
    "0042").

    Raises:
        ValueError: the file does not exist, has another suffix, is empty, is larger than
            ``max_bytes`` (refused unread: the limit is named), is not UTF-8, or cannot be
            parsed.
        ImportError: a Parquet file without ``pyarrow`` installed.
    """
    path = Path(path)
    suffix = "".join(path.suffixes[-2:]).lower() if path.suffix.lower() == ".gz" else path.suffix
    kind = SUFFIXES.get(suffix.lower())
    if kind is None:
        raise ValueError(
            f"{path}: expected a .csv, .csv.gz or .parquet file, got suffix {suffix!r}"
        )
    if not path.is_file():
        raise ValueError(f"{path} does not exist or is not a file")
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(
            f"{path} holds {size / 2**20:,.0f} MiB, more than the {max_bytes / 2**20:,.0f} MiB "
            "a table may hold (max_bytes): it is read whole into memory; split it by sequence "
            "id, or sample it"
        )
    if size == 0:
        raise ValueError(f"{path} is empty: expected a header row and one row per step")
    try:
        if kind == "csv":
            frame = pd.read_csv(path, low_memory=False, dtype=dict.fromkeys(text_columns, str))
        else:
            try:
                import pyarrow  # noqa: F401
            except ImportError:
                raise ImportError(
                    f"reading {path} needs pyarrow: pip install 'probtransformer[parquet]'"
                ) from None
            frame = pd.read_parquet(path)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} cannot be read as {kind}: it is not UTF-8 text ({e.reason} at byte "
            f"{e.start}); save it as UTF-8"
        ) from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, OSError) as e:
        raise ValueError(f"{path} cannot be read as {kind}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # pyarrow's own errors (ArrowInvalid ...): a file, not a bug
        if type(e).__module__.startswith("pyarrow"):
            raise ValueError(f"{path} cannot be read as parquet: {e}") from None
        raise
    if frame.empty:
        raise ValueError(f"{path} has a header but no rows")
    return frame


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file, read in 1 MiB blocks (a run records its data file's)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class TableSchema:
    """How a table becomes ``SequenceData``: the columns, the layout and the learned encoding.

    Attributes:
        layout: "long" (a row per step) or "wide" (a row per sequence).
        features: the feature columns (wide: the steps, in order).
        target: the target column, or None (inputs only).
        id, time: the sequence id and time columns of the long layout (None when wide).
        task: "classification" (a class per sequence), "tagging" (a class per step) or
            "regression" (a number per sequence).
        max_len: T, the longest sequence of the table it was learned from (``from_table``:
            of every split); longer sequences are refused.
        class_names: the classes in index order (classification, tagging), else None.
        vocab: the token of each id for a text feature (``vocab[0] == "<unk>"``), else None.
        x_loc, x_scale: per numeric feature, the standardization (None: not scaled).
        x_min, x_max: per numeric feature, the range of the real training steps in the
            file's units (None: not scaled, or a run saved before they were recorded): what
            ``predict`` and ``serve`` compare new inputs with.
    """

    layout: str
    features: list[str]
    target: str | None
    id: str | None = None
    time: str | None = None
    task: str = "classification"
    max_len: int = 0
    class_names: list[str] | None = None
    vocab: list[str] | None = None
    x_loc: list[float] | None = None
    x_scale: list[float] | None = None
    x_min: list[float] | None = None
    x_max: list[float] | None = None
    source: str = field(default="DataFrame", compare=False)

    @classmethod
    def learn(
        cls,
        frame: pd.DataFrame,
        *,
        target: str | None,
        id: str | None = None,
        time: str | None = None,
        features: list[str] | None = None,
        task: str | None = None,
        scale: bool = True,
        source: str = "DataFrame",
    ) -> TableSchema:
        """The schema of ``frame`` (the training rows): columns checked, classes, vocabulary
        and scaling learned from it.

        Args:
            frame: the table, long (``id`` given) or wide (no ``id``).
            target: the target column (None: a schema for inputs only).
            id, time: long layout: the sequence id and the time column (both or neither).
            features: the feature columns (None: every column but target, id and time).
            task: None: "tagging" when the target varies within a sequence, "regression" for
                a float target with fractional values, else "classification".
            scale: standardize numeric features.
            source: what the messages call the table (a file name).

        Raises:
            ValueError: a missing column, a bad layout, mixed types, NaN or inf, and the
                other checks of ``encode`` (each names the column and row).
        """
        if (id is None) != (time is None):
            hint = " (one series over time is task='forecasting', --task forecasting)" * (
                id is None
            )
            raise ValueError(
                f"{source}: the long layout needs both id and time columns, got id={id!r}, "
                f"time={time!r}{hint}"
            )
        if task is not None and task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        layout = "wide" if id is None else "long"
        roles = {"target": target, "id": id, "time": time}
        named = [c for c in roles.values() if c is not None]
        if len(set(named)) < len(named):
            raise ValueError(
                f"{source}: the target, id and time columns must be different columns, got "
                + ", ".join(f"{role}={column!r}" for role, column in roles.items() if column)
            )
        _require(frame, named + list(features or []), source)
        inferred = features is None
        if inferred:
            features = [str(c) for c in frame.columns if c not in named]
            unnamed = [c for c in features if _UNNAMED.fullmatch(c)]
            if unnamed:
                raise ValueError(
                    f"{source}: column {unnamed[0]!r} has no name: the row index that pandas "
                    "writes unless to_csv(index=False)? Drop it, or list the feature columns "
                    "(--features / features=)"
                )
        features = list(features)
        if not features:
            raise ValueError(f"{source}: no feature column besides {named}")
        repeated = sorted({c for c in features if features.count(c) > 1})
        if repeated:
            raise ValueError(f"{source}: feature column {repeated[0]!r} is listed twice")
        for role, column in roles.items():
            if column is not None and column in features:
                raise ValueError(
                    f"{source}: the {role} column {column!r} is also listed as a feature: a "
                    "model would read its own " + ("label" if role == "target" else role)
                )
        kinds = {c: _column_kind(frame, c, source) for c in features}
        text = [c for c, k in kinds.items() if k == "text"]
        if text and (len(features) > 1):
            hint = (
                "list the features to use with --features (features=)"
                if inferred
                else "fit either the text column alone or the numeric ones"
            )
            raise ValueError(
                f"{source}: text column {text[0]!r} must be the only feature (token models "
                f"read one token per step), got features {features}: {hint}"
            )
        schema = cls(layout, features, target, id, time, source=source)
        if task is None and target is not None:
            task = _infer_task(frame, schema)
        schema.task = task or "classification"
        if layout == "wide" and schema.task == "tagging":
            raise ValueError(f"{source}: tagging needs the long layout (a target per step)")
        if target is not None and schema.task != "regression":
            labels = frame[target]
            _no_missing(labels, target, source)
            schema.class_names = sorted({str(v) for v in labels.to_numpy()}, key=_natural)
            if len(schema.class_names) < 2:
                raise ValueError(
                    f"{source}: column {target!r} holds one class ({schema.class_names[0]!r}): "
                    f"{schema.task} needs at least 2"
                )
        if text:
            tokens = _tokens(frame[text[0]], layout)
            schema.vocab = [UNK] + sorted(set().union(*tokens) - {UNK})
        data = schema.encode(frame, learning=True)
        schema.max_len = data.x.shape[1]
        if scale and not text:
            real = data.x.double() if data.mask is None else data.x[data.mask].double()
            real = real.reshape(-1, data.x.shape[-1])
            loc, sd = real.mean(0), real.std(0, correction=0)
            schema.x_loc = loc.tolist()
            schema.x_scale = torch.where(sd > 0, sd, torch.ones_like(sd)).tolist()
            schema.x_min, schema.x_max = real.min(0).values.tolist(), real.max(0).values.tolist()
        return schema

    def encode(self, frame: pd.DataFrame, *, learning: bool = False) -> SequenceData:
        """``frame`` as ``SequenceData`` with this schema's encoding.

        Returns:
            ``SequenceData``: x float32 (N, T, F) numeric steps or int64 (N, T) token ids,
            y int64 (N,) classes, int64 (N, T) tags or float32 (N,) values (None when the
            schema or the frame has no target), mask bool (N, T) when sequences are ragged.
            Sequences in order of first appearance (long layout).

        Raises:
            ValueError: a missing column; NaN or inf in a feature; a target missing; one
                sequence id with two targets (classification, regression); time steps out of
                order or duplicated; a class or a sequence longer than the schema knows; mixed
                types in a column. Each message names the source, column and row.
        """
        source = self.source
        with_target = self.target is not None and self.target in frame.columns
        _require(frame, [c for c in (self.id, self.time) if c] + self.features, source)
        if frame.empty:
            raise ValueError(f"{source} has no rows")
        text = self.vocab is not None
        for c in self.features:
            kind = _column_kind(frame, c, source)
            if (kind == "text") != text:
                want = "text" if text else "numbers"
                raise ValueError(f"{source}: column {c!r} must hold {want}, it holds {kind}")
        if with_target:
            _no_missing(frame[self.target], self.target, source)
        if self.layout == "wide":
            x, mask, y = self._wide(frame, with_target)
        else:
            x, mask, y = self._long(frame, with_target)
        if not learning and self.max_len and x.shape[1] > self.max_len:
            raise ValueError(
                f"{source}: a sequence of {x.shape[1]} steps, longer than the {self.max_len} "
                "the model was fitted on"
            )
        if not learning and self.max_len and x.shape[1] < self.max_len:
            pad = self.max_len - x.shape[1]
            x = np.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            mask = np.pad(mask, [(0, 0), (0, pad)])
            if y is not None and y.ndim == 2:
                y = np.pad(y, [(0, 0), (0, pad)])
        if self.x_loc is not None and not text:
            x = np.where(mask[..., None], (x - self.x_loc) / np.asarray(self.x_scale), 0.0)
        return SequenceData(
            torch.from_numpy(x.astype(np.int64 if text else np.float32)),
            None if y is None else torch.from_numpy(y),
            None if mask.all() else torch.from_numpy(mask),
        )

    def _labels(self, values: pd.Series, rows: np.ndarray) -> np.ndarray:
        """Targets as classes (int64) or values (float32); rows are the table rows."""
        if self.task == "regression":
            numbers = _numbers(values, self.target, self.source)
            return numbers.astype(np.float32)
        names = np.asarray([str(v) for v in values.to_numpy()])
        index = {name: i for i, name in enumerate(self.class_names or [])}
        unknown = [i for i, name in enumerate(names) if name not in index]
        if unknown:
            i = unknown[0]
            raise ValueError(
                f"{self.source}: column {self.target!r}, {_row(self.source, rows[i])}: class "
                f"{_show(names[i])} did not occur in the training data; known classes: "
                f"{self.class_names}"
            )
        return np.asarray([index[name] for name in names], dtype=np.int64)

    def _steps(self, frame: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
        """The feature values of ``frame`` (N, F) float64, or (N,) token ids."""
        if self.vocab is not None:
            ids = {token: i for i, token in enumerate(self.vocab)}
            return np.asarray(
                [ids.get(str(v), 0) for v in frame[self.features[0]].to_numpy()], dtype=np.int64
            )
        return np.stack([_numbers(frame[c], c, self.source, rows) for c in self.features], 1)

    def _wide(self, frame, with_target):
        rows = np.arange(len(frame))
        if self.vocab is not None:
            ids = {token: i for i, token in enumerate(self.vocab)}
            texts = [str(v) for v in frame[self.features[0]].to_numpy()]
            t = max(1, max(len(s) for s in texts))
            x = np.zeros((len(texts), t), dtype=np.int64)
            mask = np.zeros((len(texts), t), dtype=bool)
            for i, s in enumerate(texts):
                x[i, : len(s)] = [ids.get(ch, 0) for ch in s]
                mask[i, : len(s)] = True
        else:  # trailing NaN: a shorter sequence, padded
            values = frame[self.features].apply(pd.to_numeric, errors="coerce")
            mask = values.notna().to_numpy(copy=True)
            ragged = mask[:, 1:] & ~mask[:, :-1]  # a value after a missing one
            if ragged.any():
                i, j = (int(k) for k in np.argwhere(ragged)[0])
                raise ValueError(
                    f"{self.source}: column {self.features[j]!r}, {_row(self.source, i)}: "
                    "missing value inside a sequence (the wide layout pads shorter sequences "
                    "with missing values at the end only)"
                )
            x = np.stack(
                [_numbers(frame[c].where(mask[:, j], 0.0), c, self.source, rows)
                 for j, c in enumerate(self.features)], 1,
            )[..., None]  # (N, T = features, 1)  # fmt: skip
        y = self._labels(frame[self.target], rows) if with_target else None
        return x, mask, y

    def _long(self, frame, with_target):
        source, id_, time = self.source, self.id, self.time
        frame = frame.reset_index(drop=True)
        _no_missing(frame[id_], id_, source)
        _no_missing(frame[time], time, source)
        codes, ids = pd.factorize(frame[id_], sort=False)
        order = np.argsort(codes, kind="stable")  # rows of each sequence, in file order
        codes_sorted = codes[order]
        times = _times(frame[time], time, source)[order]
        same = codes_sorted[1:] == codes_sorted[:-1]
        back = same & ~(times[1:] > times[:-1])
        if back.any():
            k = int(np.flatnonzero(back)[0])
            a, b = order[k], order[k + 1]
            what = "duplicated" if times[k + 1] == times[k] else "out of order"
            shown = frame[time].to_numpy()
            raise ValueError(
                f"{source}: column {time!r}: sequence {_show(ids[codes[a]])} has time "
                f"{_show(shown[b])} at {_row(source, b)} after {_show(shown[a])} at "
                f"{_row(source, a)}: time steps {what} (sort by id, then time; one row per "
                "step)"
            )
        lengths = np.bincount(codes, minlength=len(ids))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        position = np.arange(len(order)) - np.repeat(starts, lengths)  # step of each sorted row
        n, t = len(ids), int(lengths.max())
        steps = self._steps(frame.iloc[order], order)
        x = np.zeros((n, t) + steps.shape[1:], dtype=steps.dtype)
        x[codes_sorted, position] = steps
        mask = np.zeros((n, t), dtype=bool)
        mask[codes_sorted, position] = True
        y = None
        if with_target:
            labels = self._labels(frame[self.target].iloc[order], order)
            if self.task == "tagging":
                y = np.zeros((n, t), dtype=np.int64)
                y[codes_sorted, position] = labels
            else:
                first = starts
                differs = labels != np.repeat(labels[first], lengths)
                if differs.any():
                    k = int(np.flatnonzero(differs)[0])
                    seq = codes_sorted[k]
                    raw = frame[self.target].to_numpy()
                    raise ValueError(
                        f"{source}: column {self.target!r}: sequence {_show(ids[seq])} has two "
                        f"targets, {_show(raw[order[first[seq]]])} at "
                        f"{_row(source, order[first[seq]])} and {_show(raw[order[k]])} at "
                        f"{_row(source, order[k])} (a {self.task} target is one per "
                        "sequence; --task tagging reads one per step)"
                    )
                y = labels[first]
        return x, mask, y

    def to_dict(self) -> dict[str, Any]:
        """The schema as plain JSON values (``from_dict`` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, value: Any) -> TableSchema:
        """A schema from ``to_dict``'s output (a run's ``table.json``), checked.

        Raises:
            ValueError: not a mapping of the schema's fields with values of their types.
        """
        if not isinstance(value, dict) or set(value) - set(cls.__dataclass_fields__):
            raise ValueError(f"a table schema must be a dict of {sorted(cls.__dataclass_fields__)}")
        try:
            schema = cls(**value)
        except TypeError:
            raise ValueError(f"a table schema needs {sorted(cls.__dataclass_fields__)}") from None
        strings = [schema.layout, schema.task, *schema.features]
        lists = [schema.features, schema.class_names, schema.vocab]
        if (
            schema.layout not in LAYOUTS
            or schema.task not in TASKS
            or not all(isinstance(s, str) for s in strings)
            or not all(v is None or isinstance(v, list) for v in lists)
            or not isinstance(schema.max_len, int)
        ):
            raise ValueError(f"not a valid table schema: {value!r:.200}")
        for name in ("x_loc", "x_scale", "x_min", "x_max"):
            numbers = getattr(schema, name)
            if numbers is not None and not (
                isinstance(numbers, list)
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in numbers)
                and all(math.isfinite(v) for v in numbers)
            ):
                raise ValueError(
                    f"table schema field {name!r} must be a list of finite numbers, one per "
                    f"feature, got {numbers!r:.80}"
                )
        return schema

    @property
    def meta(self) -> dict[str, Any]:
        """The meta keys the task's model is built from."""
        in_features = 1 if self.layout == "wide" else len(self.features)
        meta: dict[str, Any] = {
            "task": self.task,
            "max_len": self.max_len,
            "in_features": None if self.vocab else in_features,
        }
        if self.class_names is not None:
            meta |= {"num_classes": len(self.class_names), "class_names": self.class_names}
        if self.vocab is not None:
            meta |= {"vocab": self.vocab, "unk_id": 0}
        if self.x_loc is not None:
            meta |= {"x_loc": self.x_loc, "x_scale": self.x_scale}
        return meta


def from_table(
    table: pd.DataFrame | str | Path,
    *,
    target: str,
    id: str | None = None,
    time: str | None = None,
    features: list[str] | None = None,
    task: str | None = None,
    scale: bool = True,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = TEST_FRACTION,
    max_bytes: int = MAX_TABLE_BYTES,
    context: int | None = None,
    horizon: int | None = None,
) -> DatasetSplits:
    """Train/val/test splits of your own table, carved as the built-in datasets are.

    Sequences (not rows) are split: test = ``test_fraction`` of them, val =
    ``val_fraction`` of the rest, both stratified by class for classification and seeded by
    ``seed``. The schema (classes, vocabulary, scaling) is learned on the train split only and
    applied to all three.

    Args:
        table: a DataFrame, or the path of a ``.csv`` / ``.parquet`` file.
        target, id, time, features, task, scale: as ``TableSchema.learn``.
        seed: the random state of the splits.
        val_fraction: share of the non-test sequences used for validation, in [0, 1).
        test_fraction: share of the sequences held out for test, in (0, 1).
        max_bytes: the largest file read (``read_table``).
        context, horizon: ``task="forecasting"``: one series (a row per time step, no
            ``id``), cut into rolling-origin windows of ``context`` steps of the features
            (default: every column but ``time``, the target included) followed by
            ``horizon`` steps of the target, as the built-in forecasting datasets: the last
            ``test_fraction`` of the origins are test, val the last ``val_fraction`` of the
            rest, no target step shared between splits. The model standardizes inside
            (meta ``x_loc``, ``x_scale``, ``y_loc``, ``y_scale``), so inputs stay in the
            file's units.

    Returns:
        ``DatasetSplits`` whose meta holds name (the file name, or "DataFrame"), task,
        max_len, in_features, num_classes and class_names or vocab, x_loc/x_scale, seed,
        val_fraction, holdout_classes ``()``, ood None, and ``table``: the schema's
        ``to_dict()``.

    Raises:
        ValueError: every check of ``read_table`` and ``TableSchema``; a class with too few
            sequences to appear in train, val and test; fractions out of range.
        TypeError: ``table`` is neither a DataFrame nor a path.
    """
    if isinstance(table, (str, Path)):
        source = str(table)
        frame = read_table(table, max_bytes=max_bytes, text_columns=(id,) if id else ())
    elif isinstance(table, pd.DataFrame):
        source, frame = "DataFrame", table
        if frame.empty:
            raise ValueError("the DataFrame is empty: expected one row per step or sequence")
    else:
        raise TypeError(f"table must be a DataFrame or a file path, got {type(table).__name__}")
    if not 0 < test_fraction < 1 or not 0 <= val_fraction < 1:
        raise ValueError(
            f"test_fraction must lie in (0, 1) and val_fraction in [0, 1), got "
            f"{test_fraction} and {val_fraction}"
        )
    if task == "forecasting":
        if id is not None:
            raise ValueError(f"{source}: forecasting reads one series: leave out id, got {id!r}")
        return _forecast_table(
            frame, source, target, time, features, context, horizon, seed, val_fraction,
            test_fraction,
        )  # fmt: skip
    if context is not None or horizon is not None:
        raise ValueError(
            f"context and horizon window one series for task='forecasting' (--task "
            f"forecasting), got task={task!r}"
        )
    probe = TableSchema.learn(
        frame, target=target, id=id, time=time, features=features, task=task, scale=False,
        source=source,
    )  # fmt: skip
    ids = frame[id] if id is not None else pd.Series(np.arange(len(frame)))
    codes, _ = pd.factorize(ids, sort=False)
    whole = probe.encode(frame)  # every check over the whole table, before any split
    strata = whole.y.numpy() if probe.task == "classification" else None
    parts = _split(len(whole), strata, probe, seed, val_fraction, test_fraction)
    rows = {name: np.isin(codes, part) for name, part in parts.items()}
    schema = TableSchema.learn(
        frame[rows["train"]], target=target, id=id, time=time, features=probe.features,
        task=probe.task, scale=scale, source=source,
    )  # fmt: skip
    schema.max_len = probe.max_len  # the longest sequence of any split: the model's T
    if schema.class_names is not None and schema.class_names != probe.class_names:
        missing = sorted(set(probe.class_names) - set(schema.class_names))
        raise ValueError(
            f"{source}: column {target!r}: class {missing[0]!r} has no sequence in the training "
            "split"
        )
    data = {name: schema.encode(frame[r]) for name, r in rows.items()}
    meta = {
        "name": Path(source).name,
        "source": source,
        **schema.meta,
        "seed": seed,
        "val_fraction": val_fraction,
        "holdout_classes": (),
        "ood": None,
        "table": schema.to_dict(),
    }
    return DatasetSplits(data["train"], data["val"], data["test"], meta)


def read_series(
    frame: pd.DataFrame,
    source: str,
    *,
    target: str,
    time: str | None,
    features: list[str] | None = None,
) -> tuple[pd.Series, pd.DataFrame]:
    """One series of a forecasting table, checked: the ``target`` series and the feature
    table ``(T, F)`` (by default every column but ``time``, the target included), both
    indexed by ``time``.

    Raises:
        ValueError: no time column, a missing column, time steps missing, duplicated or out of
            order, text in a number column, or NaN/inf (each names the column and row).
    """
    if time is None:
        raise ValueError(
            f"{source}: forecasting needs the time column that orders the series: "
            "time='COL' (--time COL)"
        )
    _require(frame, [target, time, *(features or [])], source)
    features = features or [str(c) for c in frame.columns if c != time]
    _no_missing(frame[time], time, source)
    order = _times(frame[time], time, source)
    back = ~(order[1:] > order[:-1])
    times = frame[time].to_numpy()
    if back.any():
        k = int(np.flatnonzero(back)[0])
        what = "duplicated" if order[k + 1] == order[k] else "out of order"
        raise ValueError(
            f"{source}: column {time!r}: time {_show(times[k + 1])} at {_row(source, k + 1)} "
            f"after {_show(times[k])} at {_row(source, k)}: time steps {what} (one row per "
            "step, in time order)"
        )
    for c in [target, *features]:
        if _column_kind(frame, c, source) != "numbers":
            raise ValueError(f"{source}: forecasting reads numbers; column {c!r} holds text")
    values = {c: _numbers(frame[c], c, source) for c in dict.fromkeys([target, *features])}
    index = pd.Index(times, name=time)
    series = pd.Series(values[target], index=index, name=target)
    return series, pd.DataFrame({c: values[c] for c in features}, index=index)


def _forecast_table(
    frame, source, target, time, features, context, horizon, seed, val_fraction, test_fraction
) -> DatasetSplits:
    """``from_table`` of one series: the built-in forecasting windows (``forecasting``)."""
    from probtransformer.datasets.forecasting import _Forecast, _forecast_splits

    for name, value in (("context", context), ("horizon", horizon)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"forecasting needs {name} as a positive int, got {value!r}")
    series, table = read_series(frame, source, target=target, time=time, features=features)
    origins = len(frame) - context - horizon + 1
    test_origins = tail_count(test_fraction, max(origins, 0))
    if origins < 2 or origins - test_origins < horizon + 1:
        raise ValueError(
            f"{source}: {len(frame)} time steps are too few for windows of context {context} "
            f"and horizon {horizon} with a test part ({origins} origins)"
        )
    spec = _Forecast(context, horizon, 1, test_origins, "", None, "", source)
    meta = {
        "name": Path(source).name,
        "task": "forecasting",
        "max_len": context,
        "context": context,
        "horizon": horizon,
        "in_features": table.shape[1],
        "season": 1,
        "frequency": "",
        "source": source,
        "holdout_classes": (),
        "ood": None,
    }
    return _forecast_splits(series, table, spec, meta, seed, val_fraction)


def _split(n, strata, schema, seed, val_fraction, test_fraction) -> dict[str, np.ndarray]:
    """Sequence indices of train, val and test (stratified where ``strata`` is given)."""
    from sklearn.model_selection import train_test_split

    if strata is not None:
        counts = np.bincount(strata)
        rare = int(np.argmin(counts))
        need = 3 if val_fraction > 0 else 2
        if counts[rare] < need:
            raise ValueError(
                f"{schema.source}: column {schema.target!r}: class "
                f"{schema.class_names[rare]!r} has {counts[rare]} sequence(s); each class needs "
                f"at least {need} to appear in train, {'val, ' if need == 3 else ''}and test"
            )
    index = np.arange(n)
    classes = 0 if strata is None else len(np.unique(strata))  # a stratified part holds each
    n_test = max(tail_count(test_fraction, n), classes)
    if n_test >= n:
        raise ValueError(f"{schema.source}: {n} sequences are too few to split off a test part")
    stratify = None if strata is None else strata
    try:
        rest, test = train_test_split(index, test_size=n_test, stratify=stratify, random_state=seed)
        val = rest[:0]
        if val_fraction > 0:
            rest, val = train_test_split(
                rest,
                test_size=max(1, classes, tail_count(val_fraction, len(rest))),
                stratify=None if strata is None else strata[rest],
                random_state=seed,
            )
    except ValueError as e:  # too few sequences per class for the stratified shares
        raise ValueError(f"{schema.source}: {n} sequences cannot be split: {e}") from None
    return {"train": np.sort(rest), "val": np.sort(val), "test": np.sort(test)}


def _show(value: Any) -> str:
    """``repr`` of a table value, numpy scalars as Python ones."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def _require(frame: pd.DataFrame, columns: list, source: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(
            f"{source} has no column {missing[0]!r}; its columns: {list(map(str, frame.columns))}"
        )


def _row(source: str, row: int) -> str:
    """A row's name in messages: its 0-based position, and its line in a CSV file."""
    line = f" (line {int(row) + 2})" if source.lower().endswith(".csv") else ""
    return f"row {int(row)}{line}"


def _column_kind(frame: pd.DataFrame, column: str, source: str) -> str:
    """ "numbers" or "text"; a column holding both is refused, naming a row of each."""
    values = frame[column]
    if pd.api.types.is_bool_dtype(values) or pd.api.types.is_numeric_dtype(values):
        return "numbers"
    present = values.dropna()
    numeric = pd.to_numeric(present, errors="coerce").notna().to_numpy()
    is_str = np.asarray([isinstance(v, str) for v in present.to_numpy()])
    if numeric.all() and not is_str.any():
        return "numbers"
    if numeric.any() and (~numeric).any():
        first_number = present.index[np.flatnonzero(numeric)[0]]
        first_text = present.index[np.flatnonzero(~numeric)[0]]
        raise ValueError(
            f"{source}: column {column!r} mixes types: {_show(values.loc[first_number])} at "
            f"{_row(source, frame.index.get_loc(first_number))} is a number, "
            f"{_show(values.loc[first_text])} at {_row(source, frame.index.get_loc(first_text))} "
            "is not (a column holds numbers or text)"
        )
    return "text"


def _numbers(values: pd.Series, column: str, source: str, rows=None) -> np.ndarray:
    """A numeric column as float64, refusing NaN and inf with the first such row."""
    if not (pd.api.types.is_numeric_dtype(values) or pd.api.types.is_bool_dtype(values)):
        values = pd.to_numeric(values, errors="coerce")  # _column_kind checked it is numeric
    numbers = values.to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(numbers)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        row = i if rows is None else rows[i]
        written = _as_written(source, column, row) if np.isnan(numbers[i]) else None
        shown = numbers[i] if written is None else _show_written(written)
        raise ValueError(
            f"{source}: column {column!r}, {_row(source, row)}: {shown} (features and "
            "targets must be finite numbers; fill or drop missing steps first)"
        )
    return numbers


def _as_written(source: str, column: str, row: int) -> str | None:
    """The text of a cell of a CSV file as the file holds it, for messages: pandas reads
    "n/a", "NA", "-nan" ... as NaN, which the message should not show as "nan". None when
    ``source`` is not a CSV file (a DataFrame's NaN is what its owner wrote) or cannot be read
    again. Called on the way to an error only: it reads the column again."""
    if not source.lower().endswith((".csv", ".csv.gz")):
        return None
    try:
        raw = pd.read_csv(source, dtype=str, keep_default_na=False, usecols=[column])
        return str(raw[column].iloc[int(row)])
    except (ValueError, OSError, IndexError, KeyError):
        return None


def _show_written(text: str) -> str:
    """A cell's text in a message: quoted, an empty one said so."""
    return repr(text) if text.strip() else "an empty cell"


def _times(values: pd.Series, column: str, source: str) -> np.ndarray:
    """A time column as values that order as time does: numbers as they are; text as the
    numbers or the dates it spells (``pandas.to_datetime``: "12/25/2023" before
    "01/01/2024", not after as text).

    Raises:
        ValueError: text that is neither all numbers nor all dates, naming the first value
            that is not.
    """
    if pd.api.types.is_numeric_dtype(values) or pd.api.types.is_datetime64_any_dtype(values):
        return values.to_numpy()
    numbers = pd.to_numeric(values, errors="coerce")
    if numbers.notna().all():
        return numbers.to_numpy()
    text = values.astype(str)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # pandas' "inferring the format"
            dates = pd.to_datetime(text, errors="coerce")
    except (ValueError, TypeError, OverflowError):
        dates = pd.Series(pd.NaT, index=values.index)
    if dates.notna().all():
        return dates.to_numpy()
    bad = int(np.flatnonzero((numbers.isna() & dates.isna()).to_numpy())[0])
    raise ValueError(
        f"{source}: column {column!r}, {_row(source, bad)}: time {_show(values.iloc[bad])} is "
        "neither a number nor a date (times are ordered by their value: numbers, or dates "
        "pandas can read)"
    )


def _no_missing(values: pd.Series, column: str, source: str) -> None:
    missing = values.isna().to_numpy()
    if missing.any():
        row = int(np.flatnonzero(missing)[0])
        written = _as_written(source, column, row)
        shown = "" if written is None else f" ({_show_written(written)})"
        raise ValueError(f"{source}: column {column!r}, {_row(source, row)}: missing value{shown}")


def _infer_task(frame: pd.DataFrame, schema: TableSchema) -> str:
    """Tagging when the target varies within a sequence, regression for fractional numbers."""
    values = frame[schema.target]
    if pd.api.types.is_float_dtype(values):
        finite = values.dropna().to_numpy()
        if len(finite) and not np.all(np.mod(finite, 1) == 0):
            return "regression"
    if schema.layout == "long":
        varies = frame.groupby(schema.id, sort=False)[schema.target].nunique(dropna=False)
        if (varies > 1).mean() > 0.5:  # most sequences: one target per step
            return "tagging"
    return "classification"


def _tokens(values: pd.Series, layout: str) -> list[set[str]]:
    """The token sets of a text column: one token per cell (long) or its characters (wide)."""
    texts = [str(v) for v in values.dropna().to_numpy()]
    return [set(texts)] if layout == "long" else [set(s) for s in texts] or [set()]


def _natural(name: str):
    """Sort key of class names: numbers by value ("2" before "10"), then text."""
    try:
        return (0, float(name), "")
    except ValueError:
        return (1, math.inf, name)


__all__ = ["MAX_TABLE_BYTES", "TableSchema", "file_sha256", "from_table", "read_table"]
