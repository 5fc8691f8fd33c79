"""Input validation catalogue: every public entry point x every model family x malformed input.

DESIGN.md (Conventions: errors): public entry points validate shapes, dtypes, finiteness, label
ranges and masks and raise ``ValueError``/``TypeError`` saying what was expected and what
arrived. Each entry point has one table below; a row is

    Case(case id, families, input builder, expected exception, words in the message)

expanded over the families it names (``TOKENS``, ``FEATURES``, ...). The words are matched
case-insensitively after ``str.format`` with the family's sizes (``{N}``, ``{T}``, ``{F}``,
``{C}`` classes, ``{V}`` vocabulary, ``{H}`` horizon; ``{F1}`` = F + 1, ``{T1}`` = T + 1,
``{T2}`` = 2T, ``{N1}`` = N - 1): the argument, what was expected and what arrived. Rows with
``raises=None`` are inputs that are accepted and converted (numpy, pandas, float64, int32 ids
through ``SequenceData``, non-contiguous views): they must give the same result as the plain
torch input (or as ``same_as``). Rows with ``xfail`` are inputs the library does not handle well
yet; the reason says what happens and where.

Data entry points (``fit_*``, ``log_likelihood``, ``to_inference_data``) take a
``SequenceData``; the builders construct it inside the ``pytest.raises`` block, so a check made
by the ``SequenceData`` constructor counts (it is the documented way in). "assigned" cases set a
malformed tensor on a built ``SequenceData`` (``data.x = ...``), which skips the constructor:
the entry point's own check must catch it.

``python tests/inference/test_validation.py`` prints every table, with the exception and the
message actually raised, as markdown for an issue note.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference import NUTS, fit_map, fit_mcmc, fit_svi
from probtransformer.models import (
    BayesianLinearRegression,
    CausalLM,
    Seq2Seq,
    SequenceClassifier,
    SequenceRegressor,
    TokenTagger,
    generate,
)

N, T, F, C, V, H = 6, 4, 3, 3, 5, 2  # rows, steps (= max_len), features, classes, vocab, horizon
SIZES = dict(d_model=8, num_heads=2, num_layers=1, d_ff=8, dropout=0.0)
LM_VOCAB = ["<unk>", "a", "b", "c", "d"]  # V tokens
FIT = dict(num_steps=2, batch_size=N, lr=1e-2, seed=0, progress=False)
MCMC = dict(
    kernel=NUTS(max_tree_depth=2),
    num_chains=1,
    num_warmup=0,
    num_samples=2,
    map_steps=1,
    progress=False,
)
DRAWS = dict(num_samples=2, seed=0)

FEATURES = ("classifier", "regressor", "regressor_h", "seq2seq")  # x (N, T, F) float
TOKENS = ("classifier_tokens", "tagger", "lm")  # x (N, T) int64 token ids
SEQUENCE = FEATURES + TOKENS
LINEAR = ("linear",)  # x (N, P) float, no mask
ALL = SEQUENCE + LINEAR
CLASSES = ("classifier", "classifier_tokens")  # y (N,) int64 classes
TAGS = ("tagger", "lm")  # y (N, T) int64 labels / next tokens
LABELS = CLASSES + TAGS
VALUES = ("regressor", "regressor_h", "seq2seq", "linear")  # y (N,) or (N, H) float
SCALAR_VALUES = ("regressor", "linear")  # y (N,)
HORIZON_VALUES = ("regressor_h", "seq2seq")  # y (N, H)

META = "meta"  # a device with no data: stands in for "another device than the model's"


# -- families: a model, its training data and (lazily) a tiny fitted posterior ---------------


class Kit:
    """One model family: ``model()`` builds a fresh model; ``data`` is well-formed training data;
    ``pmask`` the padding mask used for predictions (None for the linear model)."""

    def __init__(self, name: str, make_model: Callable[[], Any], data: SequenceData, **fmt):
        self.name = name
        self.make_model = make_model
        self.data = data
        self.cache: dict[str, Any] = {}
        self.fmt = dict(N=N, T=T, F=F, V=V, H=H, N1=N - 1, T1=T + 1, T2=2 * T, F1=F + 1, **fmt)

    def model(self):
        """The family's model, built once: every fit deep-copies it and re-initialises the copy
        from ``seed``, so reusing one instance keeps fits comparable (see
        ``test_fits_of_two_fresh_seq2seq_models_agree`` for why a fresh one is not)."""
        if "model" not in self.cache:
            self.cache["model"] = self.make_model()
        return self.cache["model"]

    @functools.cached_property
    def posterior(self):
        return fit_svi(self.model(), self.data, **FIT)

    @property
    def x(self) -> torch.Tensor:
        return self.data.x

    @property
    def y(self) -> torch.Tensor:
        return self.data.y

    @property
    def pmask(self) -> torch.Tensor | None:
        if self.data.x.dim() == 2 and self.data.x.is_floating_point():
            return None  # the linear model takes (N, P) rows, no mask
        return PAD_MASK if self.data.mask is None else self.data.mask


PAD_MASK = torch.ones(N, T, dtype=torch.bool)
PAD_MASK[1::2, -1] = False  # every other sequence ends with one padded step


def build_kits() -> dict[str, Kit]:
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(N, T, F, generator=g)
    ids = torch.randint(0, V, (N, T), generator=g)
    classes = torch.randint(0, C, (N,), generator=g)
    tags = torch.randint(0, C, (N, T), generator=g)
    next_ids = torch.randint(0, V, (N, T), generator=g)
    value = torch.randn(N, generator=g)
    values = torch.randn(N, H, generator=g)
    rows = torch.randn(N, F, generator=g)
    kits = [
        Kit(
            "classifier",
            lambda: SequenceClassifier(F, C, T, **SIZES),
            SequenceData(feats, classes, PAD_MASK),
            C=C,
        ),
        Kit(
            "classifier_tokens",
            lambda: SequenceClassifier(None, C, T, vocab_size=V, **SIZES),
            SequenceData(ids, classes, PAD_MASK),
            C=C,
        ),
        Kit(
            "tagger",
            lambda: TokenTagger(None, C, T, vocab_size=V, **SIZES),
            SequenceData(ids, tags, PAD_MASK),
            C=C,
        ),
        Kit("lm", lambda: CausalLM(LM_VOCAB, T, **SIZES), SequenceData(ids, next_ids), C=V),
        Kit("lm_int_vocab", lambda: CausalLM(V, T, **SIZES), SequenceData(ids, next_ids), C=V),
        Kit(
            "regressor",
            lambda: SequenceRegressor(F, T, **SIZES),
            SequenceData(feats, value, PAD_MASK),
        ),
        Kit(
            "regressor_h",
            lambda: SequenceRegressor(F, T, horizon=H, **SIZES),
            SequenceData(feats, values, PAD_MASK),
        ),
        Kit("seq2seq", lambda: Seq2Seq(F, T, H, **SIZES), SequenceData(feats, values, PAD_MASK)),
        Kit("linear", lambda: BayesianLinearRegression(F), SequenceData(rows, value)),
    ]
    return {kit.name: kit for kit in kits}


@pytest.fixture(scope="module")
def kits() -> dict[str, Kit]:
    return build_kits()


# -- the tables ------------------------------------------------------------------------------


class Args:
    """Positional and keyword arguments of one call."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


@dataclass(frozen=True)
class Case:
    id: str
    families: tuple[str, ...]
    build: Callable[[Kit], Any]  # the input: Args, a tuple of positional args, or one value
    raises: type[Exception] | None  # None: accepted, same result as same_as (default: plain)
    words: tuple[str, ...] = ()
    same_as: Callable[[Kit], Any] | None = None
    xfail: str | None = None


_KEEP = object()


def _pick(value, default):
    return default if value is _KEEP else value


def xm(k: Kit, x=_KEEP, mask=_KEEP, **kwargs) -> Args:
    """``(x, mask)`` of ``predict``/``attention``: the kit's, with replacements."""
    return Args(_pick(x, k.x), _pick(mask, k.pmask), **kwargs)


def sd(k: Kit, x=_KEEP, y=_KEEP, mask=_KEEP) -> SequenceData:
    """The kit's training data rebuilt through the constructor, with replacements."""
    return SequenceData(_pick(x, k.x), _pick(y, k.y), _pick(mask, k.data.mask))


def assigned(k: Kit, **changes) -> SequenceData:
    """The kit's data with tensors assigned after construction (skips the constructor checks)."""
    data = SequenceData(k.x, k.y, k.data.mask)
    for name, value in changes.items():
        setattr(data, name, value)
    return data


def with_nan(t: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    t = t.float().clone()
    t.view(-1)[0] = value
    return t


def meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=META)


def transposed_view(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (a transposed copy transposed back)."""
    view = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


def numpy_of(t: torch.Tensor | None):
    return None if t is None else t.numpy()


def pad_rows(k: Kit, *rows: int) -> torch.Tensor:
    mask = k.pmask.clone()
    mask[list(rows)] = False
    return mask


def double_len(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t], 1)


def longer(k: Kit) -> SequenceData:
    """The kit's data with every sequence (and per-step label) repeated: T = 2 max_len."""
    y = double_len(k.y) if k.name in TAGS else k.y
    return sd(k, x=double_len(k.x), y=y, mask=double_len(k.pmask))


def wrong_target_shape(y: torch.Tensor) -> torch.Tensor:
    """(N,) -> (N, 1); (N, T) or (N, H) -> (N,)."""
    return y[:, None] if y.dim() == 1 else y[:, 0].contiguous()


def restricted(cases: list[Case], families: tuple[str, ...]) -> list[Case]:
    out = []
    for case in cases:
        kept = tuple(f for f in case.families if f in families)
        if kept:
            out.append(dataclasses.replace(case, families=kept))
    return out


# fmt: off
PREDICT_CASES: list[Case] = [
    # feature sequences (N, T, F)
    Case("x-rank-2", FEATURES, lambda k: xm(k, x=k.x[..., 0]), ValueError,
         ("x must have shape (N, T, F={F})", "got shape ({N}, {T})")),
    Case("x-rank-4", FEATURES, lambda k: xm(k, x=k.x[..., None]), ValueError,
         ("x must have shape (N, T, F={F})", "got shape ({N}, {T}, {F}, 1)")),
    Case("x-feature-count", FEATURES, lambda k: xm(k, x=torch.randn(N, T, F + 1)), ValueError,
         ("x must have F={F} features", "got shape ({N}, {T}, {F1})")),
    Case("x-int-features", FEATURES, lambda k: xm(k, x=k.x.long()), TypeError,
         ("x must be a floating-point tensor", "int64")),
    Case("x-bool", FEATURES, lambda k: xm(k, x=k.x > 0), TypeError,
         ("x must be a floating-point tensor", "bool")),
    Case("x-nan", FEATURES, lambda k: xm(k, x=with_nan(k.x)), ValueError,
         ("x contains NaN or inf",)),
    Case("x-inf", FEATURES, lambda k: xm(k, x=with_nan(k.x, float("inf"))), ValueError,
         ("x contains NaN or inf",)),
    Case("N-0", FEATURES, lambda k: xm(k, x=k.x[:0], mask=k.pmask[:0]), ValueError,
         ("x must hold at least one sequence", "got shape (0, {T}, {F})")),
    Case("T-0", FEATURES, lambda k: xm(k, x=k.x[:, :0], mask=k.pmask[:, :0]), ValueError,
         ("at least one step", "got shape ({N}, 0, {F})")),
    Case("T-over-max_len", SEQUENCE,
         lambda k: xm(k, x=double_len(k.x), mask=double_len(k.pmask)), ValueError,
         ("x has T={T2} steps", "max_len={T}")),
    Case("x-list", SEQUENCE, lambda k: xm(k, x=k.x.tolist()), TypeError,
         ("x must be a torch.Tensor or numpy array", "got list")),
    Case("x-meta-device", ALL, lambda k: xm(k, x=meta_like(k.x)), ValueError, ("x", "meta")),
    # token ids (N, T)
    Case("ids-rank-1", TOKENS, lambda k: xm(k, x=k.x[0]), ValueError,
         ("x must hold token ids of shape (N, T)", "got shape ({T},)")),
    Case("ids-rank-3", TOKENS, lambda k: xm(k, x=k.x[..., None]), ValueError,
         ("x must hold token ids of shape (N, T)", "got shape ({N}, {T}, 1)")),
    Case("ids-float32", TOKENS, lambda k: xm(k, x=k.x.float()), TypeError,
         ("x must hold int64 token ids", "float32")),
    Case("ids-float64", TOKENS, lambda k: xm(k, x=k.x.double()), TypeError,
         ("x must hold int64 token ids", "float64")),
    Case("ids-nan", TOKENS, lambda k: xm(k, x=with_nan(k.x)), TypeError,
         ("x must hold int64 token ids", "float32")),
    Case("ids-above-vocab", TOKENS, lambda k: xm(k, x=k.x + V), ValueError,
         ("x must hold token ids in [0, {V})", "got values in [")),
    Case("ids-negative", TOKENS, lambda k: xm(k, x=k.x - V), ValueError,
         ("x must hold token ids in [0, {V})", "got values in [-")),
    Case("ids-int32", TOKENS, lambda k: xm(k, x=k.x.int()), TypeError,
         ("x must hold int64 token ids", "int32")),
    Case("ids-numpy-int32", TOKENS, lambda k: xm(k, x=k.x.int().numpy()), TypeError,
         ("x must hold int64 token ids", "int32")),
    Case("ids-N-0", TOKENS, lambda k: xm(k, x=k.x[:0], mask=k.pmask[:0]), ValueError,
         ("x must hold at least one sequence", "got shape (0, {T})")),
    Case("ids-T-0", TOKENS, lambda k: xm(k, x=k.x[:, :0], mask=k.pmask[:, :0]), ValueError,
         ("at least one step", "got shape ({N}, 0)")),
    # masks
    Case("mask-shape", SEQUENCE, lambda k: xm(k, mask=torch.ones(N, T + 1, dtype=torch.bool)),
         ValueError, ("mask must have shape (N, T)=({N}, {T})", "got ({N}, {T1})")),
    Case("mask-int", SEQUENCE, lambda k: xm(k, mask=k.pmask.long()), TypeError,
         ("mask must be a bool tensor", "int64")),
    Case("mask-float", SEQUENCE, lambda k: xm(k, mask=k.pmask.float()), TypeError,
         ("mask must be a bool tensor", "float32")),
    Case("mask-numpy-int", SEQUENCE, lambda k: xm(k, mask=k.pmask.long().numpy()), TypeError,
         ("mask must be a bool tensor", "int64")),
    Case("mask-list", SEQUENCE, lambda k: xm(k, mask=k.pmask.tolist()), TypeError,
         ("mask must be a torch.Tensor or numpy array", "got list")),
    Case("mask-all-padding", SEQUENCE, lambda k: xm(k, mask=torch.zeros(N, T, dtype=torch.bool)),
         ValueError, ("mask marks every step of sequence(s) 0, 1, 2, 3, 4", "padding")),
    Case("mask-one-sequence-all-padding", SEQUENCE, lambda k: xm(k, mask=pad_rows(k, 2)),
         ValueError, ("sequence(s) 2 as padding", "at least one real step")),
    Case("mask-meta-device", SEQUENCE, lambda k: xm(k, mask=meta_like(k.pmask)), ValueError,
         ("mask", "meta")),
    # the linear model: rows (N, P), no mask
    Case("rows-rank-1", LINEAR, lambda k: xm(k, x=k.x[:, 0]), ValueError,
         ("x must have shape (N >= 1, P={F})", "got ({N},)")),
    Case("rows-rank-3", LINEAR, lambda k: xm(k, x=k.x[..., None]), ValueError,
         ("x must have shape (N >= 1, P={F})", "got ({N}, {F}, 1)")),
    Case("rows-feature-count", LINEAR, lambda k: xm(k, x=torch.randn(N, F + 1)), ValueError,
         ("P={F}", "got ({N}, {F1})")),
    Case("rows-int", LINEAR, lambda k: xm(k, x=k.x.long()), TypeError,
         ("x must be a float tensor of shape (N, P={F})", "int64")),
    Case("rows-nan", LINEAR, lambda k: xm(k, x=with_nan(k.x)), ValueError,
         ("x contains NaN or inf",)),
    Case("rows-N-0", LINEAR, lambda k: xm(k, x=k.x[:0]), ValueError,
         ("x must have shape (N >= 1, P={F})", "got (0, {F})")),
    Case("rows-mask-given", LINEAR, lambda k: xm(k, mask=torch.ones(N, F, dtype=torch.bool)),
         ValueError, ("mask must be None",)),
    # accepted and converted: the same predictions as the plain torch input
    Case("x-numpy-float32", FEATURES + LINEAR, lambda k: xm(k, x=k.x.numpy()), None),
    Case("x-numpy-float64", FEATURES + LINEAR, lambda k: xm(k, x=k.x.double().numpy()), None),
    Case("x-float64", FEATURES + LINEAR, lambda k: xm(k, x=k.x.double()), None),
    Case("x-float16", FEATURES + LINEAR, lambda k: xm(k, x=k.x.half()), None,
         same_as=lambda k: xm(k, x=k.x.half().float())),
    Case("x-pandas", LINEAR, lambda k: xm(k, x=pd.DataFrame(k.x.numpy())), None),
    Case("ids-numpy-int64", TOKENS, lambda k: xm(k, x=k.x.numpy()), None),
    Case("ids-pandas", TOKENS, lambda k: xm(k, x=pd.DataFrame(k.x.numpy())), None),
    Case("x-non-contiguous", ALL, lambda k: xm(k, x=transposed_view(k.x)), None),
    Case("mask-non-contiguous", SEQUENCE, lambda k: xm(k, mask=transposed_view(k.pmask)), None),
    Case("mask-numpy-bool", SEQUENCE, lambda k: xm(k, mask=k.pmask.numpy()), None),
    Case("mask-pandas-bool", SEQUENCE, lambda k: xm(k, mask=pd.DataFrame(k.pmask.numpy())), None),
]
# fmt: on

# fmt: off
ATTENTION_CASES: list[Case] = [
    Case("x-rank-2", FEATURES, lambda k: xm(k, x=k.x[..., 0]), ValueError,
         ("x must have shape (N, T, F={F})", "got shape ({N}, {T})")),
    Case("x-nan", FEATURES, lambda k: xm(k, x=with_nan(k.x)), ValueError,
         ("x contains NaN or inf",)),
    Case("ids-float32", TOKENS, lambda k: xm(k, x=k.x.float()), TypeError,
         ("x must hold int64 token ids", "float32")),
    Case("ids-above-vocab", TOKENS, lambda k: xm(k, x=k.x + V), ValueError,
         ("x must hold token ids in [0, {V})", "got values in [")),
    Case("ids-int32", TOKENS, lambda k: xm(k, x=k.x.int()), TypeError,
         ("x must hold int64 token ids", "int32")),
    Case("N-0", SEQUENCE, lambda k: xm(k, x=k.x[:0], mask=k.pmask[:0]), ValueError,
         ("x must hold at least one sequence", "got shape (0, {T}")),
    Case("T-over-max_len", SEQUENCE,
         lambda k: xm(k, x=double_len(k.x), mask=double_len(k.pmask)), ValueError,
         ("x has T={T2} steps", "max_len={T}")),
    Case("mask-shape", SEQUENCE, lambda k: xm(k, mask=torch.ones(N, T + 1, dtype=torch.bool)),
         ValueError, ("mask must have shape (N, T)=({N}, {T})", "got ({N}, {T1})")),
    Case("mask-float", SEQUENCE, lambda k: xm(k, mask=k.pmask.float()), TypeError,
         ("mask must be a bool tensor", "float32")),
    Case("mask-all-padding", SEQUENCE, lambda k: xm(k, mask=torch.zeros(N, T, dtype=torch.bool)),
         ValueError, ("mask marks every step", "padding")),
    Case("x-meta-device", SEQUENCE, lambda k: xm(k, x=meta_like(k.x)), ValueError, ("x", "meta")),
    Case("mask-meta-device", SEQUENCE, lambda k: xm(k, mask=meta_like(k.pmask)), ValueError,
         ("mask", "meta")),
    Case("module-unknown", SEQUENCE, lambda k: xm(k, module="decoder"), ValueError,
         ("module must be one of", "'encoder.self'", "got 'decoder'")),
    Case("module-decoder-on-encoder-only", ("classifier",),
         lambda k: xm(k, module="decoder.cross"), ValueError,
         ("module must be one of ['encoder.self']", "got 'decoder.cross'")),
    Case("no-attention-modules", LINEAR, lambda k: xm(k), TypeError,
         ("BayesianLinearRegression declares no attention_modules",)),
    # accepted and converted
    Case("x-non-contiguous", SEQUENCE, lambda k: xm(k, x=transposed_view(k.x)), None),
    Case("mask-non-contiguous", SEQUENCE, lambda k: xm(k, mask=transposed_view(k.pmask)), None),
    Case("x-numpy", SEQUENCE, lambda k: xm(k, x=k.x.numpy(), mask=k.pmask.numpy()), None),
    Case("x-float64", FEATURES, lambda k: xm(k, x=k.x.double()), None),
    Case("cross-attention-non-contiguous", ("seq2seq",),
         lambda k: xm(k, x=transposed_view(k.x), module="decoder.cross"), None,
         same_as=lambda k: xm(k, module="decoder.cross")),
]
# fmt: on

# SequenceData inputs shared by fit_svi / fit_map / fit_mcmc / log_likelihood / to_inference_data.
# fmt: off
DATA_CASES: list[Case] = [
    Case("data-not-SequenceData", ALL, lambda k: (k.x, k.y, k.data.mask), TypeError,
         ("data must be a probtransformer.datasets.SequenceData", "got tuple")),
    # x: feature sequences
    Case("x-rank-2", FEATURES, lambda k: sd(k, x=k.x[..., 0]), ValueError,
         ("x must have shape (N, T, F={F})", "got shape ({N}, {T})")),
    Case("x-feature-count", FEATURES, lambda k: sd(k, x=torch.randn(N, T, F + 1)), ValueError,
         ("x must have F={F} features", "got shape ({N}, {T}, {F1})")),
    Case("x-int-features", FEATURES, lambda k: sd(k, x=k.x.long()), ValueError,
         ("integer x holds token ids and must be 2-D (N, T)", "got shape ({N}, {T}, {F})")),
    Case("x-nan", FEATURES + LINEAR, lambda k: sd(k, x=with_nan(k.x)), ValueError,
         ("x must be finite", "NaN")),
    Case("x-inf", FEATURES + LINEAR, lambda k: sd(k, x=with_nan(k.x, float("inf"))), ValueError,
         ("x must be finite", "NaN/inf")),
    Case("x-nan-assigned", FEATURES + LINEAR, lambda k: assigned(k, x=with_nan(k.x)), ValueError,
         ("x ", "NaN")),
    Case("T-0", SEQUENCE, lambda k: sd(k, x=k.x[:, :0], mask=k.pmask[:, :0]), ValueError,
         ("at least one step", "got shape ({N}, 0")),
    Case("T-over-max_len", SEQUENCE, longer, ValueError, ("x has T={T2} steps", "max_len={T}")),
    Case("x-meta-device", ALL, lambda k: sd(k, x=meta_like(k.x)), ValueError, ("x", "meta")),
    # x: token ids
    Case("ids-rank-3", TOKENS, lambda k: sd(k, x=k.x[..., None]), ValueError,
         ("integer x holds token ids and must be 2-D (N, T)", "got shape ({N}, {T}, 1)")),
    Case("ids-float", TOKENS, lambda k: sd(k, x=k.x.float()), TypeError,
         ("x must hold int64 token ids", "got shape ({N}, {T}) and dtype torch.float32")),
    Case("ids-above-vocab", TOKENS, lambda k: sd(k, x=k.x + V), ValueError,
         ("x must hold token ids in [0, {V})", "got values in [")),
    Case("ids-negative", TOKENS, lambda k: sd(k, x=k.x - V), ValueError,
         ("x must hold token ids in [0, {V})", "got values in [-")),
    Case("ids-int32-assigned", TOKENS, lambda k: assigned(k, x=k.x.int()), TypeError,
         ("x must hold int64 token ids", "int32")),
    # x: the linear model's rows
    Case("rows-rank-3", LINEAR, lambda k: sd(k, x=k.x[..., None]), ValueError,
         ("x must have shape (N >= 1, P={F})", "got ({N}, {F}, 1)")),
    Case("rows-feature-count", LINEAR, lambda k: sd(k, x=torch.randn(N, F + 1)), ValueError,
         ("P={F}", "got ({N}, {F1})")),
    Case("rows-int", LINEAR, lambda k: sd(k, x=k.x.long()), TypeError,
         ("x must be a float tensor of shape (N, P={F})", "int64")),
    Case("rows-mask-given", LINEAR, lambda k: sd(k, mask=torch.ones(N, F, dtype=torch.bool)),
         ValueError, ("mask must be None",)),
    # masks
    Case("mask-shape", SEQUENCE, lambda k: sd(k, mask=torch.ones(N, T + 1, dtype=torch.bool)),
         ValueError, ("mask must have shape (N, T)=({N}, {T})", "got ({N}, {T1})")),
    Case("mask-int", SEQUENCE, lambda k: sd(k, mask=k.pmask.long()), TypeError,
         ("mask must have dtype torch.bool", "int64")),
    Case("mask-float-assigned", SEQUENCE, lambda k: assigned(k, mask=k.pmask.float()), TypeError,
         ("mask", "bool", "float32")),
    Case("mask-all-padding", SEQUENCE, lambda k: sd(k, mask=torch.zeros(N, T, dtype=torch.bool)),
         ValueError, ("mask marks every step of sequence(s) 0, 1, 2, 3", "padding")),
    Case("mask-one-sequence-all-padding", SEQUENCE, lambda k: sd(k, mask=pad_rows(k, 2)),
         ValueError, ("sequence(s) 2 as padding",)),
    Case("mask-meta-device", SEQUENCE, lambda k: sd(k, mask=meta_like(k.pmask)), ValueError,
         ("mask", "meta")),
    # targets, every family
    Case("y-wrong-length", ALL, lambda k: sd(k, y=k.y[:-1]), ValueError,
         ("y must have first dim N={N}", "got shape ({N1}")),
    Case("y-nan", ALL, lambda k: sd(k, y=with_nan(k.y)), ValueError,
         ("y must be finite", "NaN")),
    Case("y-bool", ALL, lambda k: sd(k, y=k.y > 0), TypeError,
         ("y must be int64 classes or float values", "bool")),
    # targets: class labels (N,) and per-step labels (N, T)
    Case("labels-float", LABELS, lambda k: sd(k, y=k.y.float()), TypeError,
         ("y must be int64 class labels", "float32")),
    Case("labels-above-range", LABELS, lambda k: sd(k, y=k.y + k.fmt["C"]), ValueError,
         ("y must hold labels in [0, {C})", "got values in [")),
    Case("labels-negative", LABELS, lambda k: sd(k, y=k.y - k.fmt["C"]), ValueError,
         ("y must hold labels in [0, {C})", "got values in [-")),
    Case("labels-wrong-shape", CLASSES, lambda k: sd(k, y=wrong_target_shape(k.y)), ValueError,
         ("y must have shape (N,)=({N},)", "got ({N}, 1)")),
    Case("tags-wrong-shape", TAGS, lambda k: sd(k, y=wrong_target_shape(k.y)), ValueError,
         ("y must have shape (N, T)=({N}, {T})", "got ({N},)")),
    Case("labels-int32-assigned", LABELS, lambda k: assigned(k, y=k.y.int()), TypeError,
         ("y must be int64 class labels", "int32")),
    Case("labels-meta-device", LABELS, lambda k: sd(k, y=meta_like(k.y)), ValueError,
         ("y", "meta")),
    # targets: real values (N,) or (N, H)
    Case("targets-int", VALUES, lambda k: sd(k, y=k.y.round().long()), TypeError,
         ("y must be a float tensor", "int64")),
    Case("targets-wrong-shape", SCALAR_VALUES, lambda k: sd(k, y=wrong_target_shape(k.y)),
         ValueError, ("y must have shape (N,)=({N},)", "got ({N}, 1)")),
    Case("targets-wrong-shape", HORIZON_VALUES, lambda k: sd(k, y=wrong_target_shape(k.y)),
         ValueError, ("y must have shape (N, H)=({N}, {H})", "got ({N},)")),
    Case("targets-nan-assigned", VALUES, lambda k: assigned(k, y=with_nan(k.y)), ValueError,
         ("y ", "NaN")),
    Case("targets-meta-device", VALUES, lambda k: sd(k, y=meta_like(k.y)), ValueError,
         ("y", "meta")),
]
# fmt: on

# accepted and converted by SequenceData: the same fit / log-likelihood as the plain data
# fmt: off
DATA_ACCEPTED: list[Case] = [
    Case("numpy", ALL, lambda k: sd(k, x=k.x.numpy(), y=k.y.numpy(), mask=numpy_of(k.data.mask)),
         None),
    Case("pandas", TOKENS + LINEAR,
         lambda k: sd(k, x=pd.DataFrame(k.x.numpy()),
                      y=pd.DataFrame(k.y.numpy()) if k.y.dim() == 2 else pd.Series(k.y.numpy()),
                      mask=None if k.data.mask is None else pd.DataFrame(k.data.mask.numpy())),
         None),
    Case("x-float64", FEATURES + LINEAR, lambda k: sd(k, x=k.x.double()), None),
    Case("ids-int32", TOKENS, lambda k: sd(k, x=k.x.int()), None),
    Case("labels-int32", LABELS, lambda k: sd(k, y=k.y.int()), None),
    Case("targets-float64", VALUES, lambda k: sd(k, y=k.y.double()), None),
    Case("x-non-contiguous", ALL, lambda k: sd(k, x=transposed_view(k.x)), None),
]
# fmt: on

# fmt: off
FIT_CASES: list[Case] = [
    *DATA_CASES,
    Case("y-none", ALL, lambda k: sd(k, y=None), ValueError,
         ("data.y is None", "fitting needs observed targets")),
    Case("N-0", ALL, lambda k: k.data[:0], ValueError, ("data is empty (N = 0)",)),
]
# fmt: on

# fmt: off
EVAL_CASES: list[Case] = [
    *DATA_CASES,
    Case("N-0", SEQUENCE, lambda k: k.data[:0], ValueError,
         ("x must hold at least one sequence", "got shape (0, {T}")),
    Case("N-0", LINEAR, lambda k: k.data[:0], ValueError,
         ("x must have shape (N >= 1, P={F})", "got (0, {F})")),
]
# fmt: on

# fmt: off
LOG_LIKELIHOOD_CASES: list[Case] = [
    *EVAL_CASES,
    Case("y-none", ALL, lambda k: sd(k, y=None), ValueError, ("data.y is None",)),
    *DATA_ACCEPTED,
]
# fmt: on

# fmt: off
INFERENCE_DATA_CASES: list[Case] = [
    *EVAL_CASES,
    Case("y-none", ALL, lambda k: sd(k, y=None), ValueError,
         ("data.y is None", "the log-likelihood needs observed targets")),
    Case("test-not-SequenceData", ALL, lambda k: Args(k.data, test=(k.x, k.y)), TypeError,
         ("test must be a probtransformer.datasets.SequenceData", "got tuple")),
    Case("test-feature-count", FEATURES,
         lambda k: Args(k.data, test=sd(k, x=torch.randn(N, T, F + 1))), ValueError,
         ("x must have F={F} features", "got shape ({N}, {T}, {F1})")),
    Case("test-ids-above-vocab", TOKENS, lambda k: Args(k.data, test=sd(k, x=k.x + V)),
         ValueError, ("x must hold token ids in [0, {V})",)),
    Case("test-labels-above-range", LABELS, lambda k: Args(k.data, test=sd(k, y=k.y + k.fmt["C"])),
         ValueError, ("y must hold labels in [0, {C})",)),
    Case("attention_obs-negative", ALL, lambda k: Args(k.data, attention_obs=-1), ValueError,
         ("attention_obs must be an integer >= 0", "got -1")),
    Case("attention_obs-float", ALL, lambda k: Args(k.data, attention_obs=2.0), ValueError,
         ("attention_obs must be an integer >= 0", "got 2.0")),
    *DATA_ACCEPTED,
]
# fmt: on

# fmt: off
FIT_MAP_CASES: list[Case] = [
    *FIT_CASES,
    Case("guide-given", ALL, lambda k: Args(k.data, guide="normal"), TypeError,
         ("fit_map() got an unexpected keyword argument 'guide'",)),
    *DATA_ACCEPTED,
]
# fmt: on

MCMC_ACCEPTED_FAMILIES = ("classifier", "tagger", "linear")  # keeps the sampler runs few


FIT_SVI_CASES: list[Case] = [*FIT_CASES, *DATA_ACCEPTED]
FIT_MCMC_CASES: list[Case] = [
    *FIT_CASES,
    *restricted(DATA_ACCEPTED, MCMC_ACCEPTED_FAMILIES),
]

# fmt: off
GENERATE_CASES: list[Case] = [
    Case("prompt-float-ids", ("lm",), lambda k: torch.tensor([1.0, 2.0]), ValueError,
         ("prompt must be a non-empty str or a 1-D sequence of int token ids", "float32")),
    Case("prompt-float-list", ("lm",), lambda k: [1.0, 2.0], TypeError,
         ("prompt of token ids must hold ints", "got elements of type float")),
    Case("prompt-nan", ("lm",), lambda k: torch.tensor([float("nan")]), ValueError,
         ("prompt must be", "int token ids", "float32")),
    Case("prompt-3-d", ("lm",), lambda k: torch.tensor([[[1, 2]]]), ValueError,
         ("prompt must be", "1-D", "got shape (1, 1, 2)")),
    Case("prompt-scalar", ("lm",), lambda k: 3, TypeError,
         ("prompt must be", "1-D", "got int")),
    Case("prompt-empty-list", ("lm",), lambda k: [], ValueError,
         ("prompt must be a non-empty", "got shape (0,)")),
    Case("prompt-empty-ids", ("lm",), lambda k: torch.tensor([], dtype=torch.long), ValueError,
         ("prompt must be a non-empty", "got shape (0,)")),
    Case("prompt-empty-text", ("lm",), lambda k: "", ValueError,
         ("prompt must hold at least one character", "got ''")),
    Case("prompt-bool", ("lm",), lambda k: torch.tensor([True, False]), ValueError,
         ("prompt must be", "int token ids", "bool")),
    Case("prompt-ids-above-vocab", ("lm",), lambda k: [1, V], ValueError,
         ("prompt token ids must lie in [0, {V})", "got values in [1, {V}]")),
    Case("prompt-ids-negative", ("lm",), lambda k: [-1, 1], ValueError,
         ("prompt token ids must lie in [0, {V})", "got values in [-1, 1]")),
    Case("prompt-id-beyond-int64", ("lm",), lambda k: [1, 10**22], ValueError,
         ("prompt token ids must lie in [0, {V})", f"got values in [1, {10**22}]")),
    Case("prompt-numpy-uint64-id", ("lm",), lambda k: np.array([2**63], dtype=np.uint64),
         ValueError, ("prompt token ids must lie in [0, {V})", f"got values in [{2**63}, ")),
    Case("prompt-text-integer-vocab", ("lm_int_vocab",), lambda k: "ab", TypeError,
         ("integer vocabulary size", "give the prompt as a list or tensor of token ids")),
    Case("posterior-not-causal-lm", ("tagger",), lambda k: [1, 2], TypeError,
         ("generate needs the Posterior of a CausalLM", "got one of TokenTagger")),
    Case("prompt-none", ("lm",), lambda k: None, TypeError, ("prompt", "NoneType")),
    Case("prompt-bytes", ("lm",), lambda k: b"ab", TypeError, ("prompt", "bytes")),
    Case("prompt-meta-device", ("lm",), lambda k: meta_like(torch.tensor([1, 2])), ValueError,
         ("prompt", "meta")),
    # accepted: converted to int64 ids (documented: text, list or tensor of ids)
    Case("prompt-int32-ids", ("lm",), lambda k: torch.tensor([1, 2, 3], dtype=torch.int32), None),
    Case("prompt-numpy-int32", ("lm",), lambda k: np.array([1, 2, 3], dtype=np.int32), None),
    Case("prompt-pandas-series", ("lm",), lambda k: pd.Series([1, 2, 3]), None),
    Case("prompt-non-contiguous", ("lm",), lambda k: torch.tensor([[1, 0], [2, 0], [3, 0]])[:, 0],
         None),
    Case("prompt-text", ("lm",), lambda k: "abc", None),
    Case("prompt-longer-than-max_len", ("lm",), lambda k: [4, 4, 4, 1, 2, 3], None,
         same_as=lambda k: [4, 1, 2, 3][-T:]),  # documented: cut to its last max_len tokens
]
# fmt: on


# -- entry points: how to call each, its plain input, and what "the same result" means -------


def _same_prediction(a, b) -> None:
    fields = ("probs",) if hasattr(a, "probs") else ("samples", "loc", "variance")
    for name in fields:
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)


def _same_fit(a, b) -> None:
    assert a.record["elbo"] == b.record["elbo"]


def _same_samples(a, b) -> None:
    assert a.samples.keys() == b.samples.keys()
    for name in a.samples:
        torch.testing.assert_close(a.samples[name], b.samples[name], rtol=0, atol=0)


def _same_tensor(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _same_attention(a, b) -> None:
    assert a.module == b.module
    torch.testing.assert_close(a.samples, b.samples, rtol=0, atol=0)


def _same_inference_data(a, b) -> None:
    assert set(a.groups()) == set(b.groups())
    for group in ("log_likelihood", "posterior_predictive", "observed_data"):
        np.testing.assert_array_equal(a[group]["y"].values, b[group]["y"].values)
    if "predictions" in a.groups():
        np.testing.assert_array_equal(a.predictions["y"].values, b.predictions["y"].values)


def _same_generation(a, b) -> None:
    torch.testing.assert_close(a.token_ids, b.token_ids, rtol=0, atol=0)
    torch.testing.assert_close(a.entropy, b.entropy, rtol=0, atol=0)


@dataclass(frozen=True)
class Entry:
    name: str
    call: Callable[..., Any]  # (kit, *args, **kwargs)
    plain: Callable[[Kit], Any]  # the well-formed input
    same: Callable[[Any, Any], None]
    cases: list[Case]


ENTRIES = {
    e.name: e
    for e in [
        Entry(
            "fit_svi",
            lambda k, data, **kw: fit_svi(k.model(), data, **FIT, **kw),
            lambda k: k.data,
            _same_fit,
            FIT_SVI_CASES,
        ),
        Entry(
            "fit_map",
            lambda k, data, **kw: fit_map(k.model(), data, **FIT, **kw),
            lambda k: k.data,
            _same_fit,
            FIT_MAP_CASES,
        ),
        Entry(
            "fit_mcmc",
            lambda k, data, **kw: fit_mcmc(k.model(), data, **MCMC, **kw),
            lambda k: k.data,
            _same_samples,
            FIT_MCMC_CASES,
        ),
        Entry(
            "Posterior.predict",
            lambda k, x, mask=None, **kw: k.posterior.predict(x, mask, **DRAWS, **kw),
            lambda k: xm(k),
            _same_prediction,
            PREDICT_CASES,
        ),
        Entry(
            "Posterior.attention",
            lambda k, x, mask=None, **kw: k.posterior.attention(x, mask, **DRAWS, **kw),
            lambda k: xm(k),
            _same_attention,
            ATTENTION_CASES,
        ),
        Entry(
            "Posterior.log_likelihood",
            lambda k, data, **kw: k.posterior.log_likelihood(data, **DRAWS, **kw),
            lambda k: k.data,
            _same_tensor,
            LOG_LIKELIHOOD_CASES,
        ),
        Entry(
            "Posterior.to_inference_data",
            lambda k, data, **kw: k.posterior.to_inference_data(data, **DRAWS, **kw),
            lambda k: k.data,
            _same_inference_data,
            INFERENCE_DATA_CASES,
        ),
        Entry(
            "generate",
            lambda k, prompt, **kw: generate(
                k.posterior, prompt, max_new_tokens=2, num_samples=2, seed=0, **kw
            ),
            lambda k: [1, 2, 3],
            _same_generation,
            GENERATE_CASES,
        ),
    ]
}


def _invoke(entry: Entry, kit: Kit, inp) -> Any:
    if isinstance(inp, Args):
        return entry.call(kit, *inp.args, **inp.kwargs)
    return entry.call(kit, inp)


def _reference(entry: Entry, case: Case, kit: Kit) -> Any:
    if case.same_as is not None:
        return _invoke(entry, kit, case.same_as(kit))
    key = f"plain:{entry.name}"
    if key not in kit.cache:
        kit.cache[key] = _invoke(entry, kit, entry.plain(kit))
    return kit.cache[key]


def run_case(entry: Entry, case: Case, kit: Kit) -> None:
    """Run one row: the expected exception with every word in its message, or (accepted) the
    same result as the reference input."""
    if case.raises is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an accepted input must pass silently...
            warnings.filterwarnings("ignore", message=".*outside the vocabulary.*")  # ...but <unk>
            # torch warns once per process; see test_pandas_inputs_do_not_alias_read_only_memory
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            result = _invoke(entry, kit, case.build(kit))
        entry.same(result, _reference(entry, case, kit))
        return
    # failures are reported in one line (pytrace=False): formatting tracebacks that end deep in
    # torch (e.g. the 10k-line _meta_registrations.py) costs about a second per xfailed row
    try:
        _invoke(entry, kit, case.build(kit))
    except case.raises as e:
        error = e
    except Exception as e:  # noqa: BLE001 - the wrong kind of error is the finding
        pytest.fail(
            f"expected {case.raises.__name__}, got {type(e).__name__}: {e} ({_where(e)})",
            pytrace=False,
        )
    else:
        pytest.fail(f"expected {case.raises.__name__}, nothing was raised", pytrace=False)
    message = str(error)
    for word in case.words:
        expected = word.format(**kit.fmt)
        if expected.lower() not in message.lower():
            pytest.fail(f"{expected!r} not in the message {message!r}", pytrace=False)


def _where(error: BaseException) -> str:
    """``file:line`` of the innermost frame of the traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    return f"raised at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def params(cases: list[Case]) -> list:
    out, seen = [], set()
    for case in cases:
        marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
        for family in case.families:
            key = f"{case.id}-{family}"
            assert key not in seen, f"duplicate case {key}"
            seen.add(key)
            out.append(pytest.param(case, family, id=key, marks=marks))
    return out


# -- the tests: one table per entry point ----------------------------------------------------


@pytest.mark.parametrize(("case", "family"), params(FIT_SVI_CASES))
def test_fit_svi(kits, case, family):
    run_case(ENTRIES["fit_svi"], case, kits[family])


@pytest.mark.parametrize(("case", "family"), params(FIT_MAP_CASES))
def test_fit_map(kits, case, family):
    run_case(ENTRIES["fit_map"], case, kits[family])


@pytest.mark.parametrize(("case", "family"), params(FIT_MCMC_CASES))
def test_fit_mcmc(kits, case, family):
    run_case(ENTRIES["fit_mcmc"], case, kits[family])


@pytest.mark.parametrize(("case", "family"), params(PREDICT_CASES))
def test_predict(kits, case, family):
    run_case(ENTRIES["Posterior.predict"], case, kits[family])


@pytest.mark.parametrize(("case", "family"), params(ATTENTION_CASES))
def test_attention(kits, case, family):
    run_case(ENTRIES["Posterior.attention"], case, kits[family])


@pytest.mark.parametrize(("case", "family"), params(LOG_LIKELIHOOD_CASES))
def test_log_likelihood(kits, case, family):
    run_case(ENTRIES["Posterior.log_likelihood"], case, kits[family])


@pytest.mark.parametrize(("case", "family"), params(INFERENCE_DATA_CASES))
def test_to_inference_data(kits, case, family):
    run_case(ENTRIES["Posterior.to_inference_data"], case, kits[family])


@pytest.mark.parametrize(("case", "family"), params(GENERATE_CASES))
def test_generate(kits, case, family):
    run_case(ENTRIES["generate"], case, kits[family])


def test_every_family_is_in_every_fit_and_prediction_table():
    for name, entry in ENTRIES.items():
        if name == "generate":
            continue
        covered = {f for case in entry.cases for f in case.families}
        assert set(ALL) <= covered, (name, sorted(set(ALL) - covered))


def test_fits_of_two_fresh_seq2seq_models_agree(kits):
    """Found while building the catalogue (numpy vs torch data seemed to fit differently)."""
    kit = kits["seq2seq"]
    torch.manual_seed(1)
    first = fit_svi(kit.make_model(), kit.data, **FIT)
    torch.manual_seed(2)
    second = fit_svi(kit.make_model(), kit.data, **FIT)
    assert first.record["elbo"] == second.record["elbo"]


def test_pandas_inputs_do_not_alias_read_only_memory():
    targets = pd.Series(np.arange(N, dtype=np.float32))
    view = targets.to_numpy()
    if view.flags.writeable:
        pytest.skip("this pandas version hands out writable arrays")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = SequenceData(torch.zeros(N, T, F), targets)
    assert not np.shares_memory(data.y.numpy(), view)


# -- markdown for an issue note --------------------------------------------------------------


def _outcome(entry: Entry, case: Case, kit: Kit) -> tuple[str, str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = _invoke(entry, kit, case.build(kit))
    except Exception as e:  # noqa: BLE001 - reported, not handled
        text = " ".join(str(e).split())
        return type(e).__name__, text[:140] + ("..." if len(text) > 140 else "")
    if case.raises is not None:
        return "nothing raised", f"returned {result!r:.60}"
    return "accepted", "same result as " + ("`same_as`" if case.same_as else "the torch input")


def markdown() -> str:
    lines, kits = [], build_kits()
    for entry in ENTRIES.values():
        lines += [
            f"\n### {entry.name}\n",
            "| case | families | expected | got | message excerpt | status |",
            "|---|---|---|---|---|---|",
        ]
        for case in entry.cases:
            kit = kits[case.families[0]]
            got, message = _outcome(entry, case, kit)
            expected = case.raises.__name__ if case.raises else "accepted"
            status = "xfail" if case.xfail else "ok"
            families = ", ".join(case.families)
            message = message.replace("|", "\\|")
            lines.append(f"| {case.id} | {families} | {expected} | {got} | {message} | {status} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import pyro

    torch.set_num_threads(1)
    pyro.enable_validation(True)
    print(markdown())
