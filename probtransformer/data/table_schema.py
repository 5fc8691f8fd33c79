"""How your own table becomes ``SequenceData``: ``TableSchema``, its layouts and its encoding.

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

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from probtransformer.data.sequence import SequenceData
from probtransformer.data.table_columns import (
    _column_kind,
    _natural,
    _no_missing,
    _numbers,
    _require,
    _row,
    _show,
    _times,
    _tokens,
)

#: The token of unknown text and of padding, id 0 of every vocabulary.
UNK = "<unk>"

#: The names pandas gives columns without a header cell (its index, written by ``to_csv``).
_UNNAMED = re.compile(r"Unnamed: \d+")

TASKS = ("classification", "tagging", "regression")  # TableSchema's; from_table adds forecasting
LAYOUTS = ("long", "wide")


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
