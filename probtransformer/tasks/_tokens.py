"""Tasks whose models read character ids ``(N, T)`` and predict at every step (tagging, language
modelling): batched token-level predictions, and their ``predict`` input files (``.npy`` of
token ids, ``.txt`` with one sequence per line)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from probtransformer.tasks._base import TOKEN_INFERENCE_DATA_ROWS, Task, read_table_data
from probtransformer.tasks._features import load_npy

#: The tagger's learning rate in the text recipe (``benchmarks/studies/text_recipe.py``, round
#: 4; the "Text models" section of ``benchmarks/BENCHMARKS.md``): a linear warm-up over the
#: first 10% of the steps lets 6e-2 train (it blew up without), and a cosine decay to 0 beat
#: holding the rate (validation boundary F1 0.934 against 0.918 at 3e-2 held). The library's
#: default, 3e-3 decaying tenfold, learns text too slowly.
TAGGER_FIT = {"lr": 6e-2, "lr_warmup": 0.1, "lr_schedule": "cosine", "lr_decay": 0.0}
#: The causal LM's: 3e-2 held constant. ``TAGGER_FIT`` lowered its test perplexity further
#: (5.54 against 5.79) but raised its ECE past the issue's calibration bound (0.0247 against
#: at most 0.0239).
LM_FIT = {"lr": 3e-2, "lr_decay": 1.0}

#: Sequences per ``predict`` call for token-level models: their ``Prediction.probs`` is
#: ``(S, N, T, V)`` (100 draws x 32 windows x 64 steps x 101 characters: about 80 MB).
TOKEN_BATCH = 32


def token_predictions(post, data, draws: dict, batch_size: int = TOKEN_BATCH) -> Iterator:
    """``(rows, Prediction)`` for successive batches of ``batch_size`` sequences of ``data``.

    Token-level predictions hold ``(S, N, T, V)`` probabilities; predicting a few sequences at a
    time keeps memory bounded (the caller keeps what it needs of each batch). ``draws`` are
    ``predict``'s ``num_samples``/``seed``: the same draws for every batch.
    """
    for start in range(0, len(data), batch_size):
        rows = data[start : start + batch_size]
        yield rows, post.predict(rows.x, rows.mask, **draws)


def real_steps(rows, value):
    """``value (N, T, ...)`` at the real steps of ``rows`` (all, without a mask): ``(M, ...)``."""
    if rows.mask is None:
        return value.reshape(-1, *value.shape[2:])
    return value[rows.mask]


class TokenTask(Task):
    """A token-level task: ``inference_data.nc`` covers the first 500 training and test
    sequences, and ``predict`` writes one CSV row per real (sequence, step).

    Class attributes:
        strip_whitespace: ``.txt`` inputs lose their whitespace, as the training text did.
    """

    inference_data_rows = TOKEN_INFERENCE_DATA_ROWS
    strip_whitespace: ClassVar[bool] = False

    @abc.abstractmethod
    def step_frame(self, index: dict, pred: Any, record: dict, names: Callable) -> Any:
        """The CSV rows of one batch, one per (sequence, step), padding included.

        Args:
            index: columns ``sequence``, ``step`` and ``token`` (flattened ``(n, T)``).
            pred: the batch's ``Prediction`` (``probs`` ``(S, n, T, V)``).
            record: the run's metrics.json.
            names: token ids -> their characters (or their ids as text without a vocabulary).
        """

    def predict_frame(
        self, path: Path, run: Any, draws: dict, *, warn: Callable[[str], None]
    ) -> Any:
        """See ``Task.predict_frame``; ``.npy`` of int token ids (N, T) or ``.txt`` inputs. A
        run fitted on ``--data`` reads ``.csv`` or ``.parquet`` tables of the same layout
        instead, its rows led by the sequence id."""
        import pandas as pd
        import torch

        from probtransformer.data import SequenceData

        post, ids = run.posterior, None
        if "table" in run.record:
            data, ids, id_column = read_table_data(path, run)
            x, mask = data.x.numpy(), None if data.mask is None else data.mask.numpy()
            vocab = run.record["table"]["vocab"]
        elif path.suffix.lower() == ".npy":
            x, mask = self._read_token_npy(path), None
            vocab = _run_vocab(run, required=False)
        elif path.suffix.lower() == ".txt":
            vocab = _run_vocab(run)
            x, mask = self._read_text(path, vocab, post.model.max_len, warn)
        else:
            raise ValueError(
                f"--input must be a .npy of int token ids (N, T) or a .txt file for a {self.name} "
                f"run, got {str(path)!r}"
            )

        def names(ids: list[int]) -> list[str]:
            return [vocab[i] for i in ids] if vocab else list(map(str, ids))

        tensors = (torch.from_numpy(x), None, None if mask is None else torch.from_numpy(mask))
        try:  # before any pass, naming the file (the model's messages call it x)
            post.model.validate(tensors[0], None, tensors[2])
        except ValueError as e:
            message = str(e)
            raise ValueError(
                f"{path}{message[1:]}" if message.startswith("x ") else message
            ) from None
        frames, offset = [], 0
        for rows, pred in token_predictions(post, SequenceData(*tensors), draws):
            n, steps = rows.x.shape
            keep = np.ones((n, steps), bool) if rows.mask is None else rows.mask.numpy()
            index = {
                "sequence": np.repeat(np.arange(offset, offset + n), steps),
                "step": np.tile(np.arange(steps), n),
                "token": names(rows.x.reshape(-1).tolist()),
            }
            frame = self.step_frame(index, pred, run.record, names)
            frames.append(frame[keep.reshape(-1)])
            offset += n
        out = pd.concat(frames, ignore_index=True)
        if ids is not None:  # the file's sequence ids for the row numbers
            out.insert(0, id_column, ids[out.pop("sequence").to_numpy()])
        return out

    def _read_token_npy(self, path: Path) -> np.ndarray:
        """Read int64 token ids of shape (N, T) from a .npy file (T may be below max_len).

        Raises:
            ValueError: not an integer .npy array, another shape, or no rows.
        """
        x = load_npy(path)
        if x.dtype.kind not in "iu":
            raise ValueError(
                f"{path} must hold integer token ids for a {self.name} run, got dtype {x.dtype}"
            )
        if x.ndim != 2 or 0 in x.shape:
            raise ValueError(
                f"{path} must hold token ids of shape (N, T) with N, T >= 1, got {x.shape}"
            )
        if x.dtype.kind == "u" and x.max() > np.iinfo(np.int64).max:  # before it wraps
            raise ValueError(
                f"{path} must hold token ids that fit int64, got values up to {int(x.max())}"
            )
        return x.astype(np.int64)

    def _read_text(
        self, path: Path, vocab: list[str], max_len: int, warn: Callable[[str], None]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (N, T) and mask of a text file with one sequence per line (whitespace
        removed with ``strip_whitespace``); ``warn`` names characters outside the vocabulary
        (mapped to <unk>).

        Raises:
            ValueError: not UTF-8 text, a blank line, a line longer than ``max_len``
                characters, or no sequence.
        """
        from probtransformer.datasets import encode_text

        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text: {e.reason}") from None
        sequences, unknown = [], 0
        for number, line in enumerate(lines, start=1):
            text = "".join(line.split()) if self.strip_whitespace else line
            if not text.strip():  # rows must keep the file's line numbers: refuse, do not skip
                raise ValueError(
                    f"{path} line {number} is blank: give one sequence per line, without blank "
                    "lines"
                )
            if len(text) > max_len:
                raise ValueError(
                    f"{path} line {number}: {len(text)} characters, but the model reads at most "
                    f"{max_len}; split the line"
                )
            ids, missing = encode_text(text, vocab)
            sequences.append(ids.numpy())
            unknown += missing
        if not sequences:
            raise ValueError(f"{path} holds no text")
        if unknown:
            warn(f"{unknown} character(s) of {path} are outside the vocabulary; read as <unk>")
        steps = max(map(len, sequences))
        x = np.zeros((len(sequences), steps), dtype=np.int64)
        mask = np.zeros((len(sequences), steps), dtype=bool)
        for i, ids in enumerate(sequences):
            x[i, : len(ids)], mask[i, : len(ids)] = ids, True
        return x, mask


def _run_vocab(run: Any, *, required: bool = True) -> list[str] | None:
    """The character vocabulary of a token run: the CausalLM's own, or the dataset's.

    Raises:
        ValueError: ``required`` and the run has neither.
    """
    vocab = getattr(run.posterior.model, "vocab", None)
    if vocab is None and "dataset" in run.record and "seed" in run.record:
        try:
            vocab = run.meta().get("vocab")
        except (ValueError, TypeError, ImportError):
            vocab = None
    if vocab is None and required:
        raise ValueError(
            "this run has no character vocabulary: give --input as a .npy of int token ids"
        )
    return vocab
