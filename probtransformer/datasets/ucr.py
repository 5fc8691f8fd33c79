"""UCR/UEA time series classification sets from the copies bundled with sktime (optional extra).

Needs `pip install 'probtransformer[datasets]'`; sktime is imported only when one of these sets
is loaded, and a set the installed sktime does not bundle is never downloaded.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pandas as pd

from probtransformer.data import DatasetSplits
from probtransformer.datasets._registry import EXTRA, entry_of, missing_extra, register
from probtransformer.datasets._splits import assemble_classification, carve_val, check_holdout

_UCR_SOURCE = (
    "UCR/UEA time series classification archive (Dau et al. 2019, 'The UCR time series "
    "archive'; Bagnall et al. 2018, 'The UEA multivariate time series classification archive'), "
    "copy bundled with sktime"
)
_UCR_SHAPES = {
    "GunPoint": "(200, 150, 1)",
    "ItalyPowerDemand": "(1096, 24, 1)",
    "ArrowHead": "(211, 251, 1)",
    "BasicMotions": "(80, 100, 6)",
    "JapaneseVowels": "(640, 29, 12) ragged, mask",
}


def _load_ucr(
    name: str, *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    """The archive's train/test split of `name`; val carved stratified from its train part."""
    try:
        import sktime.datasets as sktime_datasets
    except ImportError as err:
        raise missing_extra(name) from err
    # read the copy inside the sktime wheel; with a path that lacks `name`, sktime would
    # try to download it, so check first
    data_dir = os.path.join(os.path.dirname(sktime_datasets.__file__), "data")
    if not os.path.isdir(os.path.join(data_dir, name)):
        raise FileNotFoundError(
            f"dataset {name!r}: the installed sktime does not bundle it under {data_dir} "
            "(it is never downloaded)"
        )
    series, labels = [], []
    for part in ("train", "test"):
        nested, y = sktime_datasets.load_UCR_UEA_dataset(
            name, split=part, return_type="nested_univ", extract_path=data_dir
        )
        series.append(_nested_to_arrays(nested, name))
        labels.append(np.asarray(y).astype(str))
    n_train = len(series[0])
    all_series = series[0] + series[1]
    lengths = np.array([len(s) for s in all_series])
    t_max, channels = int(lengths.max()), all_series[0].shape[1]
    x = np.zeros((len(all_series), t_max, channels), dtype=np.float64)
    for i, s in enumerate(all_series):
        x[i, : len(s)] = s
    mask = np.arange(t_max)[None, :] < lengths[:, None]  # (N, T), True = real step
    class_names = sorted(set(labels[0]) | set(labels[1]))
    y = np.searchsorted(class_names, np.concatenate(labels)).astype(np.int64)
    num_classes = len(class_names)
    holdout = check_holdout(holdout_classes, num_classes)
    idx = np.arange(len(y))
    train_idx, val_idx = carve_val(idx[:n_train], y, num_classes, seed, val_fraction)
    test_idx = idx[n_train:]
    # standardize each channel over the real steps of the returned train split
    fit_rows = train_idx[~np.isin(y[train_idx], holdout)]
    real = x[fit_rows][mask[fit_rows]]  # (steps, C)
    loc, scale = real.mean(axis=0), real.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    x = np.where(mask[..., None], (x - loc) / scale, 0.0).astype(np.float32)
    meta = {
        "name": name,
        "task": "classification",
        "num_classes": num_classes,
        "max_len": t_max,
        "in_features": channels,
        "source": entry_of(name).source,
        "class_names": class_names,
        "x_loc": loc.tolist(),
        "x_scale": scale.tolist(),
    }
    ragged = not mask.all()
    return assemble_classification(
        x,
        y,
        mask if ragged else None,
        meta,
        (train_idx, val_idx, test_idx),
        holdout,
        seed,
        val_fraction,
    )


def _nested_to_arrays(nested: pd.DataFrame, name: str) -> list[np.ndarray]:
    """sktime "nested_univ" frame (cases x channels, a pd.Series per cell) -> (T_i, C) arrays."""
    out = []
    for i, row in enumerate(nested.to_numpy()):
        channels = [np.asarray(cell, dtype=np.float64) for cell in row]
        if len({len(c) for c in channels}) != 1:
            raise ValueError(f"dataset {name!r}: case {i} has channels of different lengths")
        out.append(np.stack(channels, axis=1))
    return out


for _name, _shape in _UCR_SHAPES.items():
    register(_name, task="classification", shape=_shape, source=_UCR_SOURCE, extra=EXTRA)(
        functools.partial(_load_ucr, _name)
    )
