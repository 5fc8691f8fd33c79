"""Datasets as CPU torch tensors: one `SequenceData` per split, `load` and `available`.

A dataset is registered once with `_register` (name -> loader + one-line description), so
`load(name)` and `available()` pick it up. Every loader returns `DatasetSplits` with a fixed
test split and a validation part carved deterministically from the training part.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

TEST_FRACTION = 0.25  # fixed 75/25 train/test split; val is then carved from the train part


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
        self.x = _as_tensor(self.x, "x")
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
        _check_finite(self.x, "x")
        n = self.x.shape[0]
        if self.y is not None:
            self.y = _as_tensor(self.y, "y")
            if self.y.ndim == 0 or self.y.shape[0] != n:
                raise ValueError(
                    f"y must have first dim N={n} (same as x), got shape {tuple(self.y.shape)}"
                )
            if self.y.dtype == torch.bool:
                raise TypeError("y must be int64 classes or float values, got dtype torch.bool")
            _check_finite(self.y, "y")
        if self.mask is not None:
            self.mask = _as_tensor(self.mask, "mask")
            if self.mask.dtype != torch.bool:
                raise TypeError(f"mask must have dtype torch.bool, got {self.mask.dtype}")
            t = self.x.shape[1]
            if tuple(self.mask.shape) != (n, t):
                raise ValueError(
                    f"mask must have shape (N, T)=({n}, {t}), got {tuple(self.mask.shape)}"
                )

    def __len__(self) -> int:
        return self.x.shape[0]

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
        if isinstance(index, Integral) and not isinstance(index, bool):
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


@dataclass(frozen=True)
class _Entry:
    loader: Callable[..., DatasetSplits]
    task: str
    shape: str
    source: str
    extra: str = ""


_REGISTRY: dict[str, _Entry] = {}


def _register(
    name: str, *, task: str, shape: str, source: str, extra: str = ""
) -> Callable[[Callable[..., DatasetSplits]], Callable[..., DatasetSplits]]:
    """Register a loader `f(*, seed, val_fraction, holdout_classes) -> DatasetSplits`."""

    def decorator(loader: Callable[..., DatasetSplits]) -> Callable[..., DatasetSplits]:
        _REGISTRY[name] = _Entry(loader, task, shape, source, extra)
        return loader

    return decorator


def available() -> pd.DataFrame:
    """List the datasets `load` knows.

    Returns:
        DataFrame with one row per dataset and columns name, task, shape, source, extra.
    """
    rows = [
        {"name": name, "task": e.task, "shape": e.shape, "source": e.source, "extra": e.extra}
        for name, e in _REGISTRY.items()
    ]
    return pd.DataFrame(rows, columns=["name", "task", "shape", "source", "extra"])


def load(
    name: str,
    *,
    seed: int = 0,
    val_fraction: float = 0.1,
    holdout_classes: tuple[int, ...] = (),
) -> DatasetSplits:
    """Load a dataset as train/val/test `SequenceData` splits.

    The test split is fixed for a seed (stratified 75/25 for classification); the validation part
    is `val_fraction` of the training part, stratified, with the same seed.

    Args:
        name: one of `available()["name"]`, e.g. "digits".
        seed: random state of the splits (a non-negative int below 2**32).
        val_fraction: share of the training part used for validation, in [0, 1); 0 gives an
            empty val split.
        holdout_classes: classification only: classes removed from train, val and test; all
            their examples are returned in `meta["ood"]` for out-of-distribution evaluation.
            Labels keep their original ids and `meta["num_classes"]` is unchanged.

    Returns:
        DatasetSplits; `meta` has name, task, num_classes, max_len, in_features, source,
        class_names, seed, val_fraction, holdout_classes (sorted tuple) and ood (SequenceData,
        or None without holdout classes).

    Raises:
        ValueError: for an unknown name, a seed / val_fraction / holdout class out of range, or a
            val_fraction leaving fewer train or val examples than classes.
        TypeError: for a seed, val_fraction or holdout class of the wrong type.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown dataset {name!r}; available: {sorted(_REGISTRY)}")
    if not isinstance(seed, Integral) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    if not isinstance(val_fraction, Real) or isinstance(val_fraction, bool):
        raise TypeError(f"val_fraction must be a float, got {type(val_fraction).__name__}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if not isinstance(holdout_classes, tuple | list) or not all(
        isinstance(c, Integral) and not isinstance(c, bool) for c in holdout_classes
    ):
        raise TypeError(f"holdout_classes must be a tuple of ints, got {holdout_classes!r}")
    return _REGISTRY[name].loader(
        seed=int(seed), val_fraction=float(val_fraction), holdout_classes=tuple(holdout_classes)
    )


@_register(
    "digits",
    task="classification",
    shape="(1797, 8, 8)",
    source="scikit-learn load_digits (UCI ML hand-written digits, 1,797 8x8 images)",
)
def _load_digits(
    *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    bunch = load_digits()  # bundled with scikit-learn: no download
    x = bunch.images.astype(np.float32) / 16.0  # (N, 8, 8): 8 steps (image rows) of 8 pixels
    y = bunch.target.astype(np.int64)  # (N,)
    meta = {
        "name": "digits",
        "task": "classification",
        "num_classes": 10,
        "max_len": 8,
        "in_features": 8,
        "source": _REGISTRY["digits"].source,
        "class_names": [str(c) for c in range(10)],
    }
    return _classification_splits(x, y, meta, seed, val_fraction, holdout_classes)


def _classification_splits(
    x: np.ndarray,
    y: np.ndarray,
    meta: dict[str, Any],
    seed: int,
    val_fraction: float,
    holdout_classes: tuple[int, ...],
) -> DatasetSplits:
    """Stratified train/test split, stratified val carved from train, holdout classes removed."""
    num_classes = meta["num_classes"]
    holdout = tuple(sorted(set(holdout_classes)))
    if any(not 0 <= c < num_classes for c in holdout):
        raise ValueError(f"holdout_classes must lie in [0, {num_classes}), got {holdout_classes}")
    if len(holdout) > num_classes - 2:
        raise ValueError(
            f"holdout_classes must leave at least 2 of {num_classes} classes, got {holdout}"
        )
    idx = np.arange(len(y))
    train_idx, test_idx = train_test_split(
        idx, test_size=TEST_FRACTION, stratify=y, random_state=seed
    )
    val_idx = idx[:0]
    n_val = math.ceil(val_fraction * len(train_idx))  # how train_test_split rounds test_size
    if val_fraction > 0 and min(n_val, len(train_idx) - n_val) < num_classes:
        raise ValueError(
            f"val_fraction={val_fraction} splits {len(train_idx)} training examples into "
            f"{len(train_idx) - n_val} train / {n_val} val; a stratified split needs at least "
            f"{num_classes} (one per class) in each"
        )
    if val_fraction > 0:
        train_idx, val_idx = train_test_split(
            train_idx, test_size=val_fraction, stratify=y[train_idx], random_state=seed
        )
    is_ood = np.isin(y, holdout)

    def split(rows: np.ndarray) -> SequenceData:
        return SequenceData(torch.from_numpy(x[rows]), torch.from_numpy(y[rows]))

    meta = {
        **meta,
        "seed": seed,
        "val_fraction": val_fraction,
        "holdout_classes": holdout,
        "ood": split(idx[is_ood]) if holdout else None,
    }
    train, val, test = (split(rows[~is_ood[rows]]) for rows in (train_idx, val_idx, test_idx))
    return DatasetSplits(train, val, test, meta)


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    """Convert a tensor, numpy array or pandas object: floats -> float32, ints -> int64."""
    if isinstance(value, pd.DataFrame | pd.Series):
        value = value.to_numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"{name} must hold numbers or bools, got numpy dtype {value.dtype}")
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, numpy array or pandas DataFrame, "
            f"got {type(value).__name__}"
        )
    if value.is_complex():
        raise TypeError(f"{name} must be real, got {value.dtype}")
    if value.is_floating_point():
        return value.to(torch.float32)
    if value.dtype == torch.bool:
        return value
    return value.to(torch.int64)


def _check_finite(t: torch.Tensor, name: str) -> None:
    if t.is_floating_point() and t.numel() and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} must be finite, got {bad} NaN/inf entries")
