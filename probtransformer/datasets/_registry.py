"""The dataset table: `register` a loader under a name, then `load(name)` and `available()`.

Loaders register themselves when their module is imported (`probtransformer.datasets` imports
them all), in the order `available()` lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real

import pandas as pd

from probtransformer.data import DatasetSplits
from probtransformer.validation import is_int

EXTRA = "datasets"  # the pip extra that installs sktime and statsmodels


@dataclass(frozen=True)
class _Entry:
    """A registered dataset: its loader and the row `available()` shows for it."""

    loader: Callable[..., DatasetSplits]
    task: str
    shape: str
    source: str
    extra: str = ""


_REGISTRY: dict[str, _Entry] = {}


def register(
    name: str, *, task: str, shape: str, source: str, extra: str = ""
) -> Callable[[Callable[..., DatasetSplits]], Callable[..., DatasetSplits]]:
    """Register a loader `f(*, seed, val_fraction, holdout_classes) -> DatasetSplits`."""

    def decorator(loader: Callable[..., DatasetSplits]) -> Callable[..., DatasetSplits]:
        _REGISTRY[name] = _Entry(loader, task, shape, source, extra)
        return loader

    return decorator


def entry_of(name: str) -> _Entry:
    """The registered entry (task, shape, source, extra) of the exact name `name`."""
    return _REGISTRY[name]


def missing_extra(name: str) -> ImportError:
    """The error for dataset `name` when sktime / statsmodels is not installed."""
    return ImportError(
        f"dataset '{name}' needs the optional extra: pip install 'probtransformer[{EXTRA}]'"
    )


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
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    if not isinstance(val_fraction, Real) or isinstance(val_fraction, bool):
        raise TypeError(f"val_fraction must be a float, got {type(val_fraction).__name__}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if not isinstance(holdout_classes, tuple | list) or not all(is_int(c) for c in holdout_classes):
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
