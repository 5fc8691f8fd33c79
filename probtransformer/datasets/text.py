"""Python's bundled pydoc prose as character data: "pydoc-text" (language modeling) and
"pydoc-wordseg" (word segmentation tagging), plus `encode_text` / `decode_text`."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import numpy as np
import torch

from probtransformer.data import DatasetSplits, SequenceData
from probtransformer.datasets._registry import entry_of, register
from probtransformer.datasets._splits import tail_count

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
    n_test = tail_count(TEXT_TEST_FRACTION, len(text))
    rest = text[: len(text) - n_test]
    n_val = tail_count(val_fraction, len(rest))
    return {
        "train": rest[: len(rest) - n_val],
        "val": rest[len(rest) - n_val :],
        "test": text[len(text) - n_test :],
    }


def _build_vocab(train_text: str) -> list[str]:
    """[UNK] + the characters seen >= MIN_CHAR_COUNT times in `train_text`, by code point."""
    counts = Counter(train_text)
    return [UNK] + sorted((c for c, k in counts.items() if k >= MIN_CHAR_COUNT), key=ord)


def _pydoc_parts(val_fraction: float) -> tuple[dict[str, str], list[str], dict[str, int]]:
    """The pydoc text split into train/val/test parts, its train vocabulary and char -> id table."""
    parts = _text_parts(_pydoc_text(), val_fraction)
    vocab = _build_vocab(parts["train"])
    return parts, vocab, _char_ids(vocab)


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
    _check_vocab_type(vocab)
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


def _check_vocab_type(vocab: list[str]) -> None:
    if not isinstance(vocab, list) or not all(isinstance(v, str) for v in vocab):
        raise TypeError("vocab must be a list of str")


def _char_ids(vocab: list[str]) -> dict[str, int]:
    """char -> id of the single-character entries of `vocab` (index 0, the unknown, excluded)."""
    _check_vocab_type(vocab)
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
    """The meta keys both pydoc datasets share."""
    return {
        "name": name,
        "task": entry_of(name).task,
        "vocab": vocab,
        "unk_id": 0,
        "max_len": TEXT_LEN,
        "in_features": None,
        "source": entry_of(name).source,
        "seed": seed,
        "val_fraction": val_fraction,
    }


@register(
    "pydoc-text",
    task="language-modeling",
    shape=f"(N, {TEXT_LEN}) token ids",
    source=_PYDOC_SOURCE.format(*sys.version_info[:2]),
)
def _load_pydoc_text(
    *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    parts, vocab, table = _pydoc_parts(val_fraction)
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


@register(
    "pydoc-wordseg",
    task="tagging",
    shape=f"(N, {TEXT_LEN}) token ids, (N, {TEXT_LEN}) tags, mask",
    source=_PYDOC_SOURCE.format(*sys.version_info[:2]) + "; spaces removed, word ends tagged",
)
def _load_pydoc_wordseg(
    *, seed: int, val_fraction: float, holdout_classes: tuple[int, ...]
) -> DatasetSplits:
    parts, vocab, table = _pydoc_parts(val_fraction)
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
