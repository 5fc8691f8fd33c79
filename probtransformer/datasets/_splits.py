"""Split rules shared by the loaders: the fixed test share, and val carved from training.

Every loader keeps a fixed test part and carves its validation part from the training part
deterministically (a seeded stratified split, or the chronological tail), taking
`tail_count(val_fraction, n)` of the n training items.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from sklearn.model_selection import train_test_split

from probtransformer.data import DatasetSplits, SequenceData

TEST_FRACTION = 0.25  # fixed 75/25 train/test split; val is then carved from the train part


def tail_count(fraction: float, n: int) -> int:
    """ceil(fraction * n): how many of n items a share takes, as `train_test_split` rounds."""
    return math.ceil(fraction * n)


def check_holdout(holdout_classes: tuple[int, ...], num_classes: int) -> tuple[int, ...]:
    """Sorted unique holdout classes; ValueError if one is out of range or < 2 classes stay."""
    holdout = tuple(sorted(set(holdout_classes)))
    if any(not 0 <= c < num_classes for c in holdout):
        raise ValueError(f"holdout_classes must lie in [0, {num_classes}), got {holdout_classes}")
    if len(holdout) > num_classes - 2:
        raise ValueError(
            f"holdout_classes must leave at least 2 of {num_classes} classes, got {holdout}"
        )
    return holdout


def carve_val(
    train_idx: np.ndarray, y: np.ndarray, num_classes: int, seed: int, val_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """Split `train_idx` into (train, val) rows: stratified on `y`, val = ceil(fraction * n)."""
    n_val = tail_count(val_fraction, len(train_idx))
    if val_fraction > 0 and min(n_val, len(train_idx) - n_val) < num_classes:
        raise ValueError(
            f"val_fraction={val_fraction} splits {len(train_idx)} training examples into "
            f"{len(train_idx) - n_val} train / {n_val} val; a stratified split needs at least "
            f"{num_classes} (one per class) in each"
        )
    if val_fraction == 0:
        return train_idx, train_idx[:0]
    train_idx, val_idx = train_test_split(
        train_idx, test_size=val_fraction, stratify=y[train_idx], random_state=seed
    )
    return train_idx, val_idx


def classification_splits(
    x: np.ndarray,
    y: np.ndarray,
    meta: dict[str, Any],
    seed: int,
    val_fraction: float,
    holdout_classes: tuple[int, ...],
) -> DatasetSplits:
    """Stratified train/test split, stratified val carved from train, holdout classes removed."""
    holdout = check_holdout(holdout_classes, meta["num_classes"])
    idx = np.arange(len(y))
    train_idx, test_idx = train_test_split(
        idx, test_size=TEST_FRACTION, stratify=y, random_state=seed
    )
    train_idx, val_idx = carve_val(train_idx, y, meta["num_classes"], seed, val_fraction)
    return assemble_classification(
        x, y, None, meta, (train_idx, val_idx, test_idx), holdout, seed, val_fraction
    )


def assemble_classification(
    x: np.ndarray,
    y: np.ndarray,
    mask: np.ndarray | None,
    meta: dict[str, Any],
    rows: tuple[np.ndarray, np.ndarray, np.ndarray],
    holdout: tuple[int, ...],
    seed: int,
    val_fraction: float,
) -> DatasetSplits:
    """Build the splits from (train, val, test) row indices; holdout-class rows go to ood."""
    is_ood = np.isin(y, holdout)

    def split(r: np.ndarray) -> SequenceData:
        return SequenceData(
            torch.from_numpy(x[r]),
            torch.from_numpy(y[r]),
            None if mask is None else torch.from_numpy(mask[r]),
        )

    meta = {
        **meta,
        "seed": seed,
        "val_fraction": val_fraction,
        "holdout_classes": holdout,
        "ood": split(np.flatnonzero(is_ood)) if holdout else None,
    }
    train, val, test = (split(r[~is_ood[r]]) for r in rows)
    return DatasetSplits(train, val, test, meta)
