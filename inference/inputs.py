"""What every inference entry point checks first: the model protocol, the data type, and the
inputs, each validated once per call chain.

``check_inputs`` is the one validator of ``(x, y, mask)`` against a model: it runs the model's
own ``validate`` (shapes, dtypes, finiteness, label ranges, masks) and remembers what it has
validated, so one ``probtransformer fit`` (fit, test predictions, ArviZ export, diagnostics)
validates each split once. A tensor changed in place since is validated again (its version
counter moved).
"""

from __future__ import annotations

import hashlib
import json
import warnings
import weakref
from dataclasses import dataclass

import torch
from pyro.nn import PyroModule

from probtransformer.data import SequenceData
from probtransformer.inference.model_checks import check_model_structure
from probtransformer.validation import as_tensor

__all__ = [
    "as_inputs",
    "check_data",
    "check_inputs",
    "check_model",
    "check_training_data",
    "example_of",
    "rows_digest",
]


def check_model(model: object) -> None:
    """Reject objects that do not follow the model protocol (``docs/protocol.md``).

    Raises:
        TypeError: not a ``PyroModule``, or ``likelihood_site``/``config`` missing or mistyped.
    """
    if not isinstance(model, PyroModule):
        raise TypeError(f"model must be a pyro.nn.PyroModule, got {type(model).__name__}")
    if not isinstance(getattr(model, "likelihood_site", None), str):
        raise TypeError(f"{type(model).__name__} must define likelihood_site: str")
    if not isinstance(getattr(model, "config", None), dict):
        raise TypeError(f"{type(model).__name__} must define config: dict of constructor args")


def check_data(data: object, name: str = "data") -> None:
    """Raise ``TypeError`` unless ``data`` is a ``SequenceData``."""
    if not isinstance(data, SequenceData):
        raise TypeError(
            f"{name} must be a probtransformer.datasets.SequenceData (e.g. splits.train), "
            f"got {type(data).__name__}"
        )


def check_training_data(model: torch.nn.Module, data: object) -> None:
    """What every fit checks of its training data, before any work: a ``SequenceData`` with
    targets and at least one row, valid for the model (``check_inputs``), and a model whose
    structure Pyro would fit correctly (``model_checks.check_model_structure``).

    Raises:
        TypeError/ValueError: naming what is wrong and how to fix it.
    """
    check_data(data)
    if data.y is None:
        raise ValueError("data.y is None: fitting needs observed targets")
    if len(data) == 0:
        raise ValueError("data is empty (N = 0): fitting needs at least one observation")
    check_inputs(model, data.x, data.y, data.mask)
    check_model_structure(model, data)


def example_of(data: SequenceData) -> SequenceData:
    """The first (up to) two rows of ``data`` on CPU: enough to trace the model and guide."""
    return data[: min(2, len(data))].to("cpu")


def rows_digest(*tensors: torch.Tensor | None) -> str:
    """SHA-256 of the shapes, dtypes and values of ``tensors``, e.g. ``(x, y, mask)``: recognises
    the training data whose rows the local latents kept by a sample-based posterior belong to,
    and tells whether the ranks of a distributed fit hold the same data (None counts as a
    value)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        if tensor is None:
            digest.update(b"None")
            continue
        digest.update(f"{tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class _Rows:
    """Rows ``[start, stop)`` of a tensor ``root`` (a view's ``_base``, or the tensor itself) at
    the version the validation saw."""

    root: weakref.ref
    rows: range
    version: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Rows | None:
        """The rows ``tensor`` is of its root, or None for a view that is not a row range."""
        root = tensor if tensor._base is None else tensor._base
        rows = _row_range(tensor, root)
        return None if rows is None else cls(weakref.ref(root), rows, tensor._version)

    def holds(self, other: _Rows, start: int | None = None) -> bool:
        """True when ``other`` is rows of the same, unchanged root within these rows (and
        starting at row ``start`` of the root, when given)."""
        return (
            self.root() is not None
            and self.root() is other.root()
            and self.version == other.version
            and self.rows.start <= other.rows.start
            and other.rows.stop <= self.rows.stop
            and (start is None or other.rows.start == start)
        )


def _row_range(view: torch.Tensor, root: torch.Tensor) -> range | None:
    """The rows of ``root`` that ``view`` is (``root[i:j]``), or None for any other view."""
    if (
        root.dim() == 0
        or view.dtype != root.dtype
        or view.shape[1:] != root.shape[1:]
        or view.stride() != root.stride()
    ):
        return None
    offset = view.storage_offset() - root.storage_offset()
    step = root.stride(0) or 1
    if offset % step:
        return None
    return range(offset // step, offset // step + view.shape[0])


@dataclass(frozen=True)
class _Validated:
    """What one validation checked: the model's class and config, and the rows of ``x``, ``y``
    and ``mask`` (None: absent)."""

    model: tuple[type, str]
    x: _Rows
    y: _Rows | None
    mask: _Rows | None

    def covers(self, other: _Validated) -> bool:
        """True when ``other`` asks for nothing this validation did not check: the same model,
        rows of the same unchanged tensors (``SequenceData[i:j]`` of valid data is valid), with
        targets only if these had them, and a mask exactly when these had one."""
        n, offset = len(other.x.rows), other.x.rows.start - self.x.rows.start
        return (
            self.model == other.model
            and n > 0
            and self.x.holds(other.x)
            and (other.y is None or _holds(self.y, other.y, offset, n))
            and (self.mask is None) == (other.mask is None)
            and (other.mask is None or _holds(self.mask, other.mask, offset, n))
        )


def _holds(validated: _Rows | None, part: _Rows, offset: int, n: int) -> bool:
    """``part`` is the ``n`` rows of ``validated``'s that start ``offset`` rows into them."""
    return (
        validated is not None
        and len(part.rows) == n
        and validated.holds(part, validated.rows.start + offset)
    )


#: ``id`` of an ``x`` root -> what was validated with rows of it; entries are removed when the
#: root is freed (tensors compare elementwise, so they cannot be dictionary keys).
_VALIDATED: dict[int, list[_Validated]] = {}


def _model_key(model: torch.nn.Module) -> tuple[type, str]:
    return type(model), json.dumps(model.config, sort_keys=True, default=repr)


def check_inputs(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> None:
    """Validate ``(x, y, mask)`` for ``model`` with its ``validate`` method, once.

    A call whose tensors are the same rows (or a row range ``[i:j]``) of tensors validated
    before, unchanged since, for a model of the same class and config, returns at once; a
    validation with targets also covers a later call without them.

    Raises:
        TypeError/ValueError: from the model's ``validate`` (see its docstring).
    """
    parts = [None if t is None else _Rows.of(t) for t in (x, y, mask)]
    if any(p is None for p, t in zip(parts, (x, y, mask), strict=True) if t is not None):
        _validate(model, x, y, mask)  # not row ranges of anything: nothing to remember
        return
    stamp = _Validated(_model_key(model), *parts)
    root = stamp.x.root()
    entries = _VALIDATED.get(id(root), [])
    if any(entry.covers(stamp) for entry in entries):
        return
    _validate(model, x, y, mask)
    if not entries:
        weakref.finalize(root, _VALIDATED.pop, id(root), None)
    _VALIDATED[id(root)] = [*entries, stamp]


def _validate(model, x, y, mask) -> None:
    """The validation itself (``model.validate``, when the model defines one)."""
    if hasattr(model, "validate"):
        model.validate(x, y, mask)


def as_inputs(
    model: torch.nn.Module,
    x: object,
    mask: object = None,
    y: object = None,
    *,
    x_range: list[float] | None = None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(x, mask, y)`` as validated tensors on ``device``, features as float32.

    Arrays are converted (``validation.as_tensor``), validated (``check_inputs``), and features
    far outside ``x_range`` (the training range) get a warning: a preprocessing mismatch.

    Raises:
        TypeError/ValueError: not arrays, or malformed for the model.
    """
    x = as_tensor(x, "x")
    mask = None if mask is None else as_tensor(mask, "mask")
    y = None if y is None else as_tensor(y, "y")
    check_inputs(model, x, y, mask)
    if x.is_floating_point() and x.dtype != torch.float32:
        x = x.float()  # float64 (or half) features -> the model's float32
    _warn_out_of_range(x, x_range)
    return (
        x.to(device),
        None if mask is None else mask.to(device),
        None if y is None else y.to(device),
    )


class InputRangeWarning(UserWarning):
    """Features far outside the training range: inputs preprocessed unlike the training data."""


def _warn_out_of_range(x: torch.Tensor, x_range: list[float] | None) -> None:
    """Warn when features lie far outside the training range (a preprocessing mismatch)."""
    message = out_of_range_message(x, x_range)
    if message is not None:
        # stacklevel: as_inputs <- Posterior._inputs <- predict <- the caller
        warnings.warn(message, InputRangeWarning, stacklevel=5)


def out_of_range_message(
    x: torch.Tensor,
    x_range: list[float] | None,
    *,
    loc: list[float] | None = None,
    scale: list[float] | None = None,
    names: list[str] | None = None,
    low: list[float] | None = None,
    high: list[float] | None = None,
) -> str | None:
    """Why features ``x`` look preprocessed unlike the training data: they reach more than one
    training span ``x_range = [low, high]`` beyond it; None when they do not (or for token ids,
    or without a recorded range).

    Args:
        x: the model's inputs, ``(..., F)`` floats (or token ids: no check).
        x_range: ``[low, high]`` of the training inputs (``record["x_range"]``).
        loc, scale: ``(F,)``: the model's inputs are ``(raw - loc) / scale`` of a file's
            columns (a ``fit --data`` run). The message gives each far-off feature (up to 3,
            named by ``names``) in the file's units: its span, and its training range.
        low, high: ``(F,)`` with ``loc`` and ``scale``: each column's training range in the
            file's units; a feature is far off when it reaches more than its own span beyond
            it. Without them (runs saved before they were recorded), ``x_range`` with the
            standardization undone stands in, a bound on every column's range.
    """
    if not x_range or not x.is_floating_point() or x.numel() == 0:
        return None
    if loc is not None and scale is not None:
        return _raw_out_of_range_message(x, x_range, loc, scale, names, low, high)
    train_low, train_high = x_range
    span = max(train_high - train_low, 1e-12)
    got_low, got_high = float(x.min()), float(x.max())
    if got_low < train_low - span or got_high > train_high + span:
        return (
            f"x spans [{got_low:.4g}, {got_high:.4g}] but the training features spanned "
            f"[{train_low:.4g}, {train_high:.4g}]: check that the inputs are preprocessed as in "
            "training"
        )
    return None


def _raw_out_of_range_message(x, x_range, loc, scale, names, low, high) -> str | None:
    """``out_of_range_message`` per feature in the units of the file before standardization."""
    loc_ = torch.tensor(loc, dtype=torch.float64)
    scale_ = torch.tensor(scale, dtype=torch.float64)
    raw = x.reshape(-1, x.shape[-1]).double() * scale_ + loc_  # (M, F), the file's units
    got_low, got_high = raw.min(0).values, raw.max(0).values
    if low is not None and high is not None:  # (F,) each column's own training range
        train_low = torch.tensor(low, dtype=torch.float64)
        train_high = torch.tensor(high, dtype=torch.float64)
    else:  # the pooled range of the standardized features, undone: a bound on each column's
        train_low, train_high = loc_ + x_range[0] * scale_, loc_ + x_range[1] * scale_
    span = (train_high - train_low).clamp_min(1e-12)
    far = (got_low < train_low - span) | (got_high > train_high + span)
    if not far.any():
        return None
    parts = [
        f"{names[f] if names else f'feature {f}'} spans [{got_low[f]:.4g}, {got_high[f]:.4g}] "
        f"but its training values lay within [{train_low[f]:.4g}, {train_high[f]:.4g}]"
        for f in far.nonzero().flatten().tolist()[:3]
    ]
    return "; ".join(parts) + ": check that the inputs are preprocessed as in training"
