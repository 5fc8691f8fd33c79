"""Datasets as CPU torch tensors: one `SequenceData` per split, `load` and `available`.

A dataset is registered once with `_register` (name -> loader + one-line description), so
`load(name)` and `available()` pick it up. Every loader returns `DatasetSplits` with a fixed
test split and a validation part carved deterministically from the training part. Nothing is
downloaded: the data ship with scikit-learn, CPython (`pydoc_data`), or, for the optional
`datasets` extra (`pip install 'probtransformer[datasets]'`), sktime and statsmodels, which are
imported only when one of their datasets is loaded. `encode_text` / `decode_text` map text to
and from the character ids of the text datasets.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections import Counter
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
    """List the datasets `load` knows, without loading any.

    Returns:
        DataFrame with one row per dataset and columns name, task ("classification",
        "language-modeling", "tagging" or "forecasting"), shape (a string such as
        "(N, 64) token ids"), source, and extra: "" for datasets that need only the core
        dependencies, "datasets" for those that need `pip install 'probtransformer[datasets]'`.
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
    """Load a dataset as train/val/test `SequenceData` splits. Nothing is downloaded.

    Datasets (see `available()`; names are case-insensitive, e.g. "gunpoint" finds "GunPoint"):

    - "digits", classification: scikit-learn's 1,797 8x8 digit images, x float32 (N, 8, 8)
      (8 steps = image rows of 8 pixels, scaled to [0, 1]), y int64 (N,) in 0..9.
    - "digits-patches", classification: the same images and the same split rows as "digits"
      (same seed), each cut into 16 non-overlapping 2x2 patches in row-major patch order, a
      patch flattened row-major to 4 pixels in [0, 1]: x float32 (N, 16, 4). Extra meta:
      grid=(4, 4) (patch rows, patch cols), patch_size=2.
    - "pydoc-text", language-modeling: the English prose shipped with Python in
      `pydoc_data.topics.topics` (values joined in sorted key order with "\\n", ~465k
      characters), character level. Contiguous split: the last 10% of characters (ceil) are
      test, the last `val_fraction` (ceil) of the rest is val, the remainder train (the seed
      does not matter). Vocabulary from the train text only: id 0 = "<unk>", then every
      character occurring at least 5 times in train, by code point; other characters -> 0.
      Non-overlapping 65-character windows of each split (incomplete tail dropped):
      x = window[:-1], y = window[1:], both int64 (N, 64), mask None. Extra meta: vocab
      (list[str], index = id), unk_id=0, num_characters ({split: characters}); in_features
      is None. See `encode_text` / `decode_text`.
    - "pydoc-wordseg", tagging: word segmentation on the same text, split boundaries and
      vocabulary. Each split's text is split on whitespace; whole consecutive words are packed
      greedily into sequences of at most 64 characters with the spaces removed (a word longer
      than 64 characters is cut into 64-character pieces). x int64 (N, 64) token ids (pad 0),
      y int64 (N, 64) tags: 1 = a word boundary follows this character (last character of a
      word; of a long word's last piece only), else 0 (pad 0); mask bool (N, 64), True = real
      character. Extra meta: vocab, unk_id=0, class_names=["inside", "boundary"],
      num_words ({split: words}).
    - "GunPoint", "ItalyPowerDemand", "ArrowHead", "BasicMotions" (6 channels),
      "JapaneseVowels" (12 channels, lengths 7-29), classification, extra "datasets": the
      UCR/UEA archive copies bundled with sktime. The archive's own train/test split; val is
      carved stratified from the archive train part with the seed. x float32 (N, T, C), each
      channel standardized with the mean/std over all real steps of the returned train split
      (meta x_loc, x_scale); ragged sets are padded with 0 to the longest series with mask
      bool (N, T), others have mask None. Labels: sorted unique label strings -> 0..C-1
      (meta class_names).
    - "sunspots" (yearly 1700-2008, context 32, horizon 4, season 11, 60 test origins),
      "co2" (Mauna Loa, weekly resampled to monthly means, remaining gaps linearly
      interpolated; context 36, horizon 6, season 12, 48 test origins), "macrodata" (US
      quarterly 1959Q2-2009Q3, features = annualised % growth 400*diff(log) of realgdp,
      realcons, realinv, and infl; target = realgdp growth; context 16, horizon 2, season 4,
      40 test origins), forecasting, extra "datasets": statsmodels' bundled data. A window at
      origin t (position in the preprocessed series) has x = features[t-L:t], float32 (L, F),
      and y = target[t:t+H], float32 (H,), in original units (not standardized); origins
      L <= t <= n-H. Test = the last K origins; train+val = the origins whose target window
      ends at or before the first test origin; val = the last `val_fraction` (ceil) of those,
      and train = the earlier origins whose target window ends at or before the first val
      origin (so no target period is shared between splits). Extra meta: context, horizon,
      season, frequency, series (the target as a pandas Series with its year/date index),
      features (DataFrame), origins ({split: int positions}), x_loc/x_scale (per feature)
      and y_loc/y_scale from the train windows; co2 adds weeks_missing and
      months_interpolated.

    Args:
        name: one of `available()["name"]`, e.g. "digits" (case-insensitive).
        seed: random state of the splits (a non-negative int below 2**32); only the
            classification splits are random.
        val_fraction: share of the training part used for validation, in [0, 1); 0 gives an
            empty val split.
        holdout_classes: classification only: classes removed from train, val and test; all
            their examples are returned in `meta["ood"]` for out-of-distribution evaluation.
            Labels keep their original ids and `meta["num_classes"]` is unchanged.

    Returns:
        DatasetSplits; `meta` has name, task, max_len, in_features, source, seed,
        val_fraction, plus: for classification num_classes, class_names, holdout_classes
        (sorted tuple) and ood (SequenceData, or None without holdout classes); the
        dataset-specific keys listed above.

    Raises:
        ValueError: for an unknown name (the message lists the available ones), a seed /
            val_fraction / holdout class out of range, holdout_classes given for a dataset
            that is not a classification set, or a val_fraction leaving fewer train or val
            examples than classes (or no training window).
        TypeError: for a name, seed, val_fraction or holdout class of the wrong type.
        ImportError: for a dataset of the "datasets" extra when sktime / statsmodels is not
            installed (the message says `pip install 'probtransformer[datasets]'`).
        FileNotFoundError: if the installed sktime does not bundle a UCR/UEA dataset
            (it is never downloaded).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    key = _resolve_name(name)
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
    entry = _REGISTRY[key]
    if holdout_classes and entry.task != "classification":
        raise ValueError(
            f"holdout_classes applies to classification datasets only; {key!r} is a "
            f"{entry.task} dataset, got holdout_classes={tuple(holdout_classes)}"
        )
    return entry.loader(
        seed=int(seed), val_fraction=float(val_fraction), holdout_classes=tuple(holdout_classes)
    )


def _resolve_name(name: str) -> str:
    """The registered spelling of `name` (exact match first, then case-insensitive)."""
    if name in _REGISTRY:
        return name
    folded = {key.casefold(): key for key in _REGISTRY}
    if name.casefold() in folded:
        return folded[name.casefold()]
    raise ValueError(f"unknown dataset {name!r}; available: {sorted(_REGISTRY, key=str.casefold)}")


# ---------------------------------------------------------------------------------------------
# Classification: digits, digits-patches (UCR/UEA below)
# ---------------------------------------------------------------------------------------------


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


PATCH_SIZE = 2


@_register(
    "digits-patches",
    task="classification",
    shape="(1797, 16, 4) 2x2 pixel patches",
    source="scikit-learn load_digits (UCI ML hand-written digits), 8x8 images as 16 2x2 patches",
)
def _load_digits_patches(
    *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    bunch = load_digits()
    images = bunch.images.astype(np.float32) / 16.0  # (N, 8, 8)
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
        "source": _REGISTRY["digits-patches"].source,
        "class_names": [str(c) for c in range(10)],
    }
    return _classification_splits(
        np.ascontiguousarray(x),
        bunch.target.astype(np.int64),
        meta,
        seed,
        val_fraction,
        holdout_classes,
    )


def _classification_splits(
    x: np.ndarray,
    y: np.ndarray,
    meta: dict[str, Any],
    seed: int,
    val_fraction: float,
    holdout_classes: tuple[int, ...],
) -> DatasetSplits:
    """Stratified train/test split, stratified val carved from train, holdout classes removed."""
    holdout = _check_holdout(holdout_classes, meta["num_classes"])
    idx = np.arange(len(y))
    train_idx, test_idx = train_test_split(
        idx, test_size=TEST_FRACTION, stratify=y, random_state=seed
    )
    train_idx, val_idx = _carve_val(train_idx, y, meta["num_classes"], seed, val_fraction)
    return _assemble_classification(
        x, y, None, meta, (train_idx, val_idx, test_idx), holdout, seed, val_fraction
    )


def _check_holdout(holdout_classes: tuple[int, ...], num_classes: int) -> tuple[int, ...]:
    holdout = tuple(sorted(set(holdout_classes)))
    if any(not 0 <= c < num_classes for c in holdout):
        raise ValueError(f"holdout_classes must lie in [0, {num_classes}), got {holdout_classes}")
    if len(holdout) > num_classes - 2:
        raise ValueError(
            f"holdout_classes must leave at least 2 of {num_classes} classes, got {holdout}"
        )
    return holdout


def _carve_val(
    train_idx: np.ndarray, y: np.ndarray, num_classes: int, seed: int, val_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """Split `train_idx` into (train, val) rows: stratified on `y`, val = ceil(fraction * n)."""
    n_val = math.ceil(val_fraction * len(train_idx))  # how train_test_split rounds test_size
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


def _assemble_classification(
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


# ---------------------------------------------------------------------------------------------
# Text: pydoc-text (character language modeling), pydoc-wordseg (word segmentation tagging)
# ---------------------------------------------------------------------------------------------

TEXT_LEN = 64  # x/y length of a language-modeling window; max length of a wordseg sequence
TEXT_TEST_FRACTION = 0.1  # last 10% of the characters
MIN_CHAR_COUNT = 5  # characters seen fewer times in the train text map to <unk>
UNK = "<unk>"
_PYDOC_SOURCE = (
    "English prose of Python's bundled documentation topics (pydoc_data.topics.topics, "
    "Python {}.{}), joined in sorted key order"
)


def _pydoc_text() -> str:
    from pydoc_data.topics import topics  # ships with CPython

    return "\n".join(topics[k] for k in sorted(topics))


def _text_parts(text: str, val_fraction: float) -> dict[str, str]:
    """Contiguous split: last 10% (ceil) test; last `val_fraction` (ceil) of the rest val."""
    n_test = math.ceil(TEXT_TEST_FRACTION * len(text))
    rest = text[: len(text) - n_test]
    n_val = math.ceil(val_fraction * len(rest))
    return {
        "train": rest[: len(rest) - n_val],
        "val": rest[len(rest) - n_val :],
        "test": text[len(text) - n_test :],
    }


def _build_vocab(train_text: str) -> list[str]:
    counts = Counter(train_text)
    return [UNK] + sorted((c for c, k in counts.items() if k >= MIN_CHAR_COUNT), key=ord)


def encode_text(text: str, vocab: list[str]) -> tuple[torch.Tensor, int]:
    """Map each character of `text` to its id in `vocab`.

    Args:
        text: a non-empty string.
        vocab: list of str, index = id: vocab[0] is the unknown token (e.g. "<unk>", as in
            `load("pydoc-text").meta["vocab"]`), every other entry a single character.

    Returns:
        (ids, num_unknown): int64 tensor (len(text),), characters missing from the vocabulary
        mapped to 0; and how many characters were unknown.

    Raises:
        TypeError: if `text` is not a str or `vocab` not a list of str.
        ValueError: if `text` is empty, or `vocab` is empty, has a multi-character entry after
            index 0 or repeats a character.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text:
        raise ValueError("text must not be empty")
    return _encode(text, _char_ids(vocab))


def decode_text(ids: torch.Tensor | np.ndarray | list[int], vocab: list[str]) -> str:
    """Join the vocabulary entries of `ids` (id 0 gives vocab[0], e.g. "<unk>").

    Args:
        ids: 1-D int tensor / numpy array or a list of ints.
        vocab: list of str, index = id (see `encode_text`).

    Returns:
        The decoded string.

    Raises:
        TypeError: if `ids` is not integer or `vocab` not a list of str.
        ValueError: if `ids` is not 1-D or an id lies outside [0, len(vocab)).
    """
    if not isinstance(vocab, list) or not all(isinstance(v, str) for v in vocab):
        raise TypeError("vocab must be a list of str")
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {arr.shape}")
    bad = (arr < 0) | (arr >= len(vocab))
    if bad.any():
        raise ValueError(
            f"ids must lie in [0, {len(vocab)}) (the vocabulary size), got {int(arr[bad][0])}"
        )
    return "".join(vocab[i] for i in arr.tolist())


def _char_ids(vocab: list[str]) -> dict[str, int]:
    if not isinstance(vocab, list) or not all(isinstance(v, str) for v in vocab):
        raise TypeError("vocab must be a list of str")
    if not vocab:
        raise ValueError("vocab must not be empty (vocab[0] is the unknown token)")
    if any(len(v) != 1 for v in vocab[1:]):
        raise ValueError("vocab entries after index 0 must be single characters")
    table = {c: i for i, c in enumerate(vocab[1:], start=1)}
    if len(table) != len(vocab) - 1:
        raise ValueError("vocab must not repeat a character")
    return table


def _encode(text: str, table: dict[str, int]) -> tuple[torch.Tensor, int]:
    """Ids of `text` (possibly empty) under `table` (char -> id; missing -> 0)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    uniq, inverse = np.unique(codes, return_inverse=True)
    lookup = np.array([table.get(chr(c), 0) for c in uniq.tolist()], dtype=np.int64)
    ids = lookup[inverse.reshape(-1)] if len(codes) else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(ids), int((ids == 0).sum())


def _text_meta(name: str, vocab: list[str], seed: int, val_fraction: float) -> dict[str, Any]:
    return {
        "name": name,
        "task": _REGISTRY[name].task,
        "vocab": vocab,
        "unk_id": 0,
        "max_len": TEXT_LEN,
        "in_features": None,
        "source": _REGISTRY[name].source,
        "seed": seed,
        "val_fraction": val_fraction,
    }


@_register(
    "pydoc-text",
    task="language-modeling",
    shape=f"(N, {TEXT_LEN}) token ids",
    source=_PYDOC_SOURCE.format(*sys.version_info[:2]),
)
def _load_pydoc_text(
    *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    parts = _text_parts(_pydoc_text(), val_fraction)
    vocab = _build_vocab(parts["train"])
    table = _char_ids(vocab)
    splits = {}
    for part, text in parts.items():
        ids, _ = _encode(text, table)
        n = len(ids) // (TEXT_LEN + 1)
        windows = ids[: n * (TEXT_LEN + 1)].reshape(n, TEXT_LEN + 1)
        splits[part] = SequenceData(windows[:, :-1].clone(), windows[:, 1:].clone())
    if len(splits["train"]) == 0:
        raise ValueError(f"val_fraction={val_fraction} leaves no training window in pydoc-text")
    meta = _text_meta("pydoc-text", vocab, seed, val_fraction)
    meta["num_classes"] = len(vocab)
    meta["num_characters"] = {part: len(text) for part, text in parts.items()}
    return DatasetSplits(splits["train"], splits["val"], splits["test"], meta)


@_register(
    "pydoc-wordseg",
    task="tagging",
    shape=f"(N, {TEXT_LEN}) token ids, (N, {TEXT_LEN}) tags, mask",
    source=_PYDOC_SOURCE.format(*sys.version_info[:2]) + "; spaces removed, word ends tagged",
)
def _load_pydoc_wordseg(
    *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    parts = _text_parts(_pydoc_text(), val_fraction)
    vocab = _build_vocab(parts["train"])
    table = _char_ids(vocab)
    splits, num_words = {}, {}
    for part, text in parts.items():
        words = text.split()
        num_words[part] = len(words)
        splits[part] = _segmentation_split(words, table)
    if len(splits["train"]) == 0:
        raise ValueError(f"val_fraction={val_fraction} leaves no training text in pydoc-wordseg")
    meta = _text_meta("pydoc-wordseg", vocab, seed, val_fraction)
    meta["num_classes"] = 2
    meta["class_names"] = ["inside", "boundary"]
    meta["num_words"] = num_words
    return DatasetSplits(splits["train"], splits["val"], splits["test"], meta)


def _segmentation_split(words: list[str], table: dict[str, int]) -> SequenceData:
    """Pack whole words greedily into <= TEXT_LEN characters; tag 1 on each word's last char."""
    units = []  # (length, ends a word) of each word or piece of a long word
    for w in words:
        for start in range(0, len(w), TEXT_LEN):
            piece = len(w[start : start + TEXT_LEN])
            units.append((piece, start + TEXT_LEN >= len(w)))
    ids, _ = _encode("".join(words), table)
    labels = np.zeros(len(ids), dtype=np.int64)
    seq_of_char = np.zeros(len(ids), dtype=np.int64)
    seq_starts, seq, pos, fill = [], -1, 0, TEXT_LEN
    for length, ends_word in units:
        if fill + length > TEXT_LEN:
            seq, fill = seq + 1, 0
            seq_starts.append(pos)
        seq_of_char[pos : pos + length] = seq
        if ends_word:
            labels[pos + length - 1] = 1
        pos, fill = pos + length, fill + length
    n = len(seq_starts)
    col = np.arange(len(ids)) - np.asarray(seq_starts, dtype=np.int64)[seq_of_char]
    x = np.zeros((n, TEXT_LEN), dtype=np.int64)
    y = np.zeros((n, TEXT_LEN), dtype=np.int64)
    mask = np.zeros((n, TEXT_LEN), dtype=bool)
    x[seq_of_char, col] = ids.numpy()
    y[seq_of_char, col] = labels
    mask[seq_of_char, col] = True
    return SequenceData(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(mask))


# ---------------------------------------------------------------------------------------------
# UCR/UEA classification (sktime, optional extra)
# ---------------------------------------------------------------------------------------------

EXTRA = "datasets"
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


def _missing_extra(name: str) -> ImportError:
    return ImportError(
        f"dataset '{name}' needs the optional extra: pip install 'probtransformer[{EXTRA}]'"
    )


def _load_ucr(
    name: str, *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    try:
        import sktime.datasets as sktime_datasets
    except ImportError as err:
        raise _missing_extra(name) from err
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
    holdout = _check_holdout(holdout_classes, num_classes)
    idx = np.arange(len(y))
    train_idx, val_idx = _carve_val(idx[:n_train], y, num_classes, seed, val_fraction)
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
        "source": _REGISTRY[name].source,
        "class_names": class_names,
        "x_loc": loc.tolist(),
        "x_scale": scale.tolist(),
    }
    ragged = not mask.all()
    return _assemble_classification(
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
    _register(_name, task="classification", shape=_shape, source=_UCR_SOURCE, extra=EXTRA)(
        functools.partial(_load_ucr, _name)
    )


# ---------------------------------------------------------------------------------------------
# Forecasting: sunspots, co2, macrodata (statsmodels)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Forecast:
    context: int
    horizon: int
    season: int
    test_origins: int
    frequency: str
    shape: str
    source: str


_FORECASTS = {
    "sunspots": _Forecast(
        context=32,
        horizon=4,
        season=11,
        test_origins=60,
        frequency="yearly",
        shape="(N, 32, 1) -> (N, 4)",
        source="statsmodels datasets.sunspots: yearly mean sunspot numbers 1700-2008 (NOAA "
        "National Geophysical Data Center, ngdc.noaa.gov/stp/solar/solarda3.html)",
    ),
    "co2": _Forecast(
        context=36,
        horizon=6,
        season=12,
        test_origins=48,
        frequency="monthly",
        shape="(N, 36, 1) -> (N, 6)",
        source="statsmodels datasets.co2: weekly Mauna Loa CO2 (ppm) 1958-2001 (Keeling & "
        "Whorf 2004, SIO flask network, CDIAC), resampled to monthly means",
    ),
    "macrodata": _Forecast(
        context=16,
        horizon=2,
        season=4,
        test_origins=40,
        frequency="quarterly",
        shape="(N, 16, 4) -> (N, 2)",
        source="statsmodels datasets.macrodata: US quarterly macroeconomic data 1959Q1-2009Q3 "
        "(FRED, Federal Reserve Bank of St. Louis; Bureau of Labor Statistics)",
    ),
}


def _load_forecast(
    name: str, *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    try:
        import statsmodels.datasets as sm_datasets
    except ImportError as err:
        raise _missing_extra(name) from err
    spec = _FORECASTS[name]
    extra_meta: dict[str, Any] = {}
    if name == "sunspots":
        raw = sm_datasets.sunspots.load_pandas().data
        series = pd.Series(
            raw["SUNACTIVITY"].to_numpy(dtype=np.float64),
            index=pd.Index(raw["YEAR"].to_numpy().astype(np.int64), name="year"),
            name="SUNACTIVITY",
        )
        features = series.to_frame()
    elif name == "co2":
        weekly = sm_datasets.co2.load_pandas().data["co2"].astype(np.float64)
        monthly = weekly.resample("MS").mean()  # mean of the weeks present in each month
        gaps = monthly.isna()
        series = monthly.interpolate(method="linear")  # months with no observed week
        series.index.name = "month"
        extra_meta = {
            "weeks_missing": int(weekly.isna().sum()),
            "months_interpolated": int(gaps.sum()),
        }
        features = series.to_frame()
    else:
        raw = sm_datasets.macrodata.load_pandas().data
        index = pd.period_range(
            f"{int(raw['year'].iloc[0])}Q{int(raw['quarter'].iloc[0])}", periods=len(raw), freq="Q"
        )
        if not (
            (index.year == raw["year"].to_numpy()).all()
            and (index.quarter == raw["quarter"].to_numpy()).all()
        ):
            raise ValueError("macrodata: the quarters are not contiguous")
        growth = {
            f"{col}_growth": 400.0 * np.diff(np.log(raw[col].to_numpy(dtype=np.float64)))
            for col in ("realgdp", "realcons", "realinv")
        }
        features = pd.DataFrame(
            {**growth, "infl": raw["infl"].to_numpy(dtype=np.float64)[1:]},
            index=pd.PeriodIndex(index[1:], name="quarter"),
        )
        series = features["realgdp_growth"].copy()
    meta = {
        "name": name,
        "task": "forecasting",
        "max_len": spec.context,
        "context": spec.context,
        "horizon": spec.horizon,
        "in_features": features.shape[1],
        "season": spec.season,
        "frequency": spec.frequency,
        "source": _REGISTRY[name].source,
        **extra_meta,
    }
    return _forecast_splits(series, features, spec, meta, seed, val_fraction)


def _forecast_splits(
    series: pd.Series,
    features: pd.DataFrame,
    spec: _Forecast,
    meta: dict[str, Any],
    seed: int,
    val_fraction: float,
) -> DatasetSplits:
    """Rolling-origin windows: chronological train / val / test origins without shared targets."""
    context, horizon = spec.context, spec.horizon
    origins = np.arange(context, len(series) - horizon + 1)
    test = origins[-spec.test_origins :]
    trainval = origins[origins + horizon <= test[0]]
    n_val = math.ceil(val_fraction * len(trainval))
    val = trainval[len(trainval) - n_val :]
    train = trainval[trainval + horizon <= val[0]] if n_val else trainval
    if len(train) == 0:
        raise ValueError(
            f"val_fraction={val_fraction} leaves no training window in {meta['name']} "
            f"({len(trainval)} origins before the test part, horizon {horizon})"
        )
    fx = features.to_numpy(dtype=np.float64)
    fy = series.to_numpy(dtype=np.float64)

    def windows(ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = fx[ts[:, None] + np.arange(-context, 0)]  # (n, L, F)
        y = fy[ts[:, None] + np.arange(horizon)]  # (n, H)
        return x, y

    parts = {"train": train, "val": val, "test": test}
    data = {part: windows(ts) for part, ts in parts.items()}
    x_train, y_train = data["train"]
    flat = x_train.reshape(-1, fx.shape[1])
    meta = {
        **meta,
        "series": series,
        "features": features,
        "origins": {part: ts.astype(np.int64) for part, ts in parts.items()},
        "x_loc": flat.mean(axis=0).tolist(),
        "x_scale": flat.std(axis=0).tolist(),
        "y_loc": float(y_train.mean()),
        "y_scale": float(y_train.std()),
        "seed": seed,
        "val_fraction": val_fraction,
    }
    splits = {
        part: SequenceData(
            torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32))
        )
        for part, (x, y) in data.items()
    }
    return DatasetSplits(splits["train"], splits["val"], splits["test"], meta)


for _name, _spec in _FORECASTS.items():
    _register(_name, task="forecasting", shape=_spec.shape, source=_spec.source, extra=EXTRA)(
        functools.partial(_load_forecast, _name)
    )


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    """Convert a tensor, numpy array or pandas object: floats -> float32, ints -> int64."""
    if isinstance(value, pd.DataFrame | pd.Series):
        value = value.to_numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"{name} must hold numbers or bools, got numpy dtype {value.dtype}")
        # a copy where numpy's memory is read-only (pandas) or strided
        value = torch.from_numpy(np.require(value, requirements=["C", "W"]))
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, numpy array or pandas DataFrame, "
            f"got {type(value).__name__}"
        )
    if value.device.type == "meta":
        raise ValueError(
            f"{name} is on the 'meta' device, which holds shapes but no values: create it on "
            "'cpu' or 'cuda'"
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
