"""`SequenceData`, one split of a dataset as CPU tensors, and `DatasetSplits`, all splits of one.

Kept apart from the dataset registry (`probtransformer.datasets`, which re-exports both) so that
inference, the tasks and the scikit-learn wrappers use them without loading any dataset's
loader: `import probtransformer.inference` imports neither scikit-learn's dataset loaders nor
sktime nor statsmodels. Reading a table (`SequenceData.from_pandas`, `from_csv`,
`from_parquet`) imports `probtransformer.data.table_schema` / `table_files` when called.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from probtransformer.validation import as_tensor, check_finite, is_int

if TYPE_CHECKING:
    from probtransformer.data.table_schema import TableSchema


@dataclass(eq=False)
class SequenceData:
    """One split of a dataset: inputs, optional targets and optional padding mask.

    Numpy arrays and pandas DataFrames are converted to tensors; floating inputs become float32
    and integer inputs int64. N = 0 is allowed (an empty split, e.g. `val_fraction=0`).

    Attributes:
        x: float32 (N, T, F) step features, int64 (N, T) token ids, or float32 (N, P) features
            for non-sequence models.
        y: targets or None: int64 (N,) classes, int64 (N, T) tags/tokens, float32 (N,) or (N, H)
            values.
        mask: bool (N, T), True = real step, or None = every step is real.

    Raises:
        TypeError: if an argument is not an array, has an unsupported dtype, or `mask` is not bool.
        ValueError: if `x` is not 2-D or 3-D (token ids: 2-D), float `x`/`y` hold NaN or inf, or
            the first dim of `y`/`mask` differs from N, or `mask` is not (N, T).
    """

    x: torch.Tensor
    y: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.x = as_tensor(self.x, "x", normalize=True)
        if self.x.dtype == torch.bool:
            raise TypeError("x must be float features or int64 token ids, got dtype torch.bool")
        if self.x.ndim not in (2, 3):
            raise ValueError(
                f"x must be 3-D (N, T, F) or 2-D (N, T) / (N, P), got shape {tuple(self.x.shape)}"
            )
        if not self.x.is_floating_point() and self.x.ndim != 2:
            raise ValueError(
                f"integer x holds token ids and must be 2-D (N, T), got shape {tuple(self.x.shape)}"
            )
        check_finite(self.x, "x")
        n = self.x.shape[0]
        if self.y is not None:
            self.y = as_tensor(self.y, "y", normalize=True)
            if self.y.ndim == 0 or self.y.shape[0] != n:
                raise ValueError(
                    f"y must have first dim N={n} (same as x), got shape {tuple(self.y.shape)}"
                )
            if self.y.dtype == torch.bool:
                raise TypeError("y must be int64 classes or float values, got dtype torch.bool")
            check_finite(self.y, "y")
        if self.mask is not None:
            self.mask = as_tensor(self.mask, "mask", normalize=True)
            if self.mask.dtype != torch.bool:
                raise TypeError(f"mask must have dtype torch.bool, got {self.mask.dtype}")
            t = self.x.shape[1]
            if tuple(self.mask.shape) != (n, t):
                raise ValueError(
                    f"mask must have shape (N, T)=({n}, {t}), got {tuple(self.mask.shape)}"
                )

    def __len__(self) -> int:
        return self.x.shape[0]

    @classmethod
    def from_pandas(
        cls,
        frame: pd.DataFrame,
        *,
        target: str | None = None,
        id: str | None = None,
        time: str | None = None,
        features: list[str] | None = None,
        task: str | None = None,
        schema: TableSchema | None = None,
        source: str = "DataFrame",
    ) -> SequenceData:
        """One split from a DataFrame, long (``id`` and ``time`` given: a row per step) or
        wide (a row per sequence); see ``data.table_schema``.

        Args:
            frame: the table.
            target, id, time, features, task: the columns and task (``TableSchema.learn``).
            schema: encode with this schema (a fitted run's, so new data get its classes,
                vocabulary and scaling); None learns one from ``frame``, unscaled.
            source: what error messages call the table.

        Returns:
            ``SequenceData``: x float32 (N, T, F) or int64 (N, T) token ids, y (N,) or
            (N, T) or None, mask bool (N, T) when sequences are ragged.

        Raises:
            ValueError: a missing column, NaN or inf, a target missing or two per sequence,
                time steps out of order or duplicated, mixed types: each names the column
                and the row.
        """
        from probtransformer.data.table_schema import TableSchema

        if not isinstance(frame, pd.DataFrame):
            raise TypeError(f"frame must be a pandas DataFrame, got {type(frame).__name__}")
        if schema is None:
            schema = TableSchema.learn(
                frame, target=target, id=id, time=time, features=features, task=task,
                scale=False, source=source,
            )  # fmt: skip
        else:
            schema = dataclasses.replace(schema, source=source)
        return schema.encode(frame)

    @classmethod
    def from_csv(cls, path: str | Path, **options: Any) -> SequenceData:
        """``from_pandas`` of a CSV file (``data.table_files.read_table``: refused above
        ``MAX_TABLE_BYTES``, empty files refused)."""
        from probtransformer.data.table_files import read_table

        schema = options.get("schema")
        id_ = options.get("id") if schema is None else schema.id
        frame = read_table(_suffixed(path, ".csv", ".csv.gz"), text_columns=(id_,) if id_ else ())
        return cls.from_pandas(frame, source=str(path), **options)

    @classmethod
    def from_parquet(cls, path: str | Path, **options: Any) -> SequenceData:
        """``from_pandas`` of a Parquet file (needs ``pyarrow``)."""
        from probtransformer.data.table_files import read_table

        path = _suffixed(path, ".parquet", ".pq")
        return cls.from_pandas(read_table(path), source=str(path), **options)

    def __getitem__(self, index: int | slice | torch.Tensor | np.ndarray) -> SequenceData:
        """Select examples; an int keeps a batch dim of 1.

        Args:
            index: int, slice, or a 1-D int64 index / bool (N,) mask (tensor or numpy array).

        Returns:
            SequenceData with the selected rows of `x`, `y` and `mask`.

        Raises:
            IndexError: if an int index is out of range.
            TypeError: if `index` is of another kind.
            ValueError: if a bool mask does not have shape (N,) or an index is not 1-D.
        """
        index = self._normalize_index(index)
        return SequenceData(
            self.x[index],
            None if self.y is None else self.y[index],
            None if self.mask is None else self.mask[index],
        )

    def _normalize_index(self, index: Any) -> slice | torch.Tensor:
        n = len(self)
        if is_int(index):
            if not -n <= index < n:
                raise IndexError(f"index {index} is out of range for {n} examples")
            start = int(index) % n
            return slice(start, start + 1)
        if isinstance(index, slice):
            return index
        if isinstance(index, np.ndarray):
            index = torch.from_numpy(index)
        if not isinstance(index, torch.Tensor):
            raise TypeError(
                f"index must be an int, slice, or int64/bool tensor, got {type(index).__name__}"
            )
        if index.dtype == torch.bool:
            if tuple(index.shape) != (n,):
                raise ValueError(
                    f"a bool index must have shape (N,)=({n},), got {tuple(index.shape)}"
                )
            return index
        if index.is_floating_point() or index.is_complex():
            raise TypeError(f"a tensor index must be int64 or bool, got {index.dtype}")
        if index.ndim != 1:
            raise ValueError(f"a tensor index must be 1-D, got shape {tuple(index.shape)}")
        return index.long()

    def to(self, device: torch.device | str) -> SequenceData:
        """Return a copy with every tensor on `device` (e.g. "cuda")."""
        return SequenceData(
            self.x.to(device),
            None if self.y is None else self.y.to(device),
            None if self.mask is None else self.mask.to(device),
        )

    @property
    def num_steps(self) -> int | None:
        """T, the sequence length; None for non-sequence (N, P) float features."""
        if self.x.is_floating_point() and self.x.ndim == 2:
            return None
        return self.x.shape[1]

    @property
    def in_features(self) -> int | None:
        """F for (N, T, F) features, P for (N, P) features, None for (N, T) token ids."""
        if not self.x.is_floating_point():
            return None
        return self.x.shape[-1]

    def __repr__(self) -> str:
        def describe(t: torch.Tensor | None) -> str:
            return "None" if t is None else f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}"

        return (
            f"SequenceData(x={describe(self.x)}, y={describe(self.y)}, mask={describe(self.mask)})"
        )


@dataclass(eq=False)
class DatasetSplits:
    """The splits of one dataset.

    Attributes:
        train: training examples (the validation part already removed).
        val: validation examples carved from the training part (possibly empty).
        test: held-out test examples, for final figures.
        meta: name, task, num_classes or vocab, max_len, in_features, source, plus
            dataset-specific keys (see `load`).
    """

    train: SequenceData
    val: SequenceData
    test: SequenceData
    meta: dict[str, Any]


def _suffixed(path: str | Path, *suffixes: str) -> Path:
    """``path``, refused unless it ends in one of ``suffixes``."""
    path = Path(path)
    if not path.name.lower().endswith(suffixes):
        raise ValueError(f"{path}: expected a {' or '.join(suffixes)} file")
    return path
