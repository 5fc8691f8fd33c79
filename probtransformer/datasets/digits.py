"""scikit-learn's 8x8 digit images as sequences: of rows ("digits") or of 2x2 patches
("digits-patches")."""

from __future__ import annotations

import numpy as np

from probtransformer.data import DatasetSplits
from probtransformer.datasets._registry import entry_of, register
from probtransformer.datasets._splits import classification_splits

PATCH_SIZE = 2  # side of a square patch of "digits-patches", in pixels
_CLASS_NAMES = [str(c) for c in range(10)]


def _digit_images() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 images, float32 (N, 8, 8) in [0, 1], and their labels, int64 (N,) in 0..9."""
    from sklearn.datasets import load_digits  # here: registering the loader imports nothing

    bunch = load_digits()  # bundled with scikit-learn: no download
    return bunch.images.astype(np.float32) / 16.0, bunch.target.astype(np.int64)


@register(
    "digits",
    task="classification",
    shape="(1797, 8, 8)",
    source="scikit-learn load_digits (UCI ML hand-written digits, 1,797 8x8 images)",
)
def _load_digits(
    *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    x, y = _digit_images()  # x (N, 8, 8): 8 steps (image rows) of 8 pixels
    meta = {
        "name": "digits",
        "task": "classification",
        "num_classes": 10,
        "max_len": 8,
        "in_features": 8,
        "source": entry_of("digits").source,
        "class_names": list(_CLASS_NAMES),
    }
    return classification_splits(x, y, meta, seed, val_fraction, holdout_classes)


@register(
    "digits-patches",
    task="classification",
    shape="(1797, 16, 4) 2x2 pixel patches",
    source="scikit-learn load_digits (UCI ML hand-written digits), 8x8 images as 16 2x2 patches",
)
def _load_digits_patches(
    *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    images, y = _digit_images()  # (N, 8, 8), (N,)
    n, side, p = len(images), images.shape[1], PATCH_SIZE
    g = side // p
    # (N, patch row, row in patch, patch col, col in patch) -> (N, patch row, patch col, ...)
    x = images.reshape(n, g, p, g, p).transpose(0, 1, 3, 2, 4).reshape(n, g * g, p * p)
    meta = {
        "name": "digits-patches",
        "task": "classification",
        "num_classes": 10,
        "max_len": g * g,
        "in_features": p * p,
        "grid": (g, g),
        "patch_size": p,
        "source": entry_of("digits-patches").source,
        "class_names": list(_CLASS_NAMES),
    }
    return classification_splits(
        np.ascontiguousarray(x), y, meta, seed, val_fraction, holdout_classes
    )
