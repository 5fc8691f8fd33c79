"""Input validation shared by every entry point: the one integer check, the one conversion of
arrays to tensors, and the input checks of the built-in models (sequences of features or token
ids, masks, class labels, real-valued targets).

Each check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong value, shape or
range) naming what was expected and what arrived. The protocol-level checks that need a Pyro
trace (where latents are read, the likelihood's shape) are ``inference.model_checks``.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any

import numpy as np
import torch

__all__ = [
    "as_tensor",
    "check_finite",
    "check_flag",
    "check_int",
    "check_labels",
    "check_positive",
    "check_probability",
    "check_num_classes",
    "check_sequence_inputs",
    "described",
    "check_sizes",
    "check_values",
    "is_int",
    "value_and_type",
]


def check_int(
    name: str, value: object, *, minimum: int | None = 1, type_error: bool = False
) -> None:
    """Raise unless ``value`` is a Python ``int`` (bools refused) ``>= minimum``.

    Args:
        name: the argument's name, for the message.
        value: what arrived.
        minimum: the smallest value accepted (None: any int).
        type_error: a value that is not an int raises ``TypeError`` ("``name`` must be an int")
            instead of ``ValueError`` ("``name`` must be an integer >= ``minimum``"): the
            library's fit settings use the first form, sizes and counts the second.

    Raises:
        TypeError: ``type_error`` and ``value`` is not an int.
        ValueError: ``value`` is below ``minimum`` (or not an int, without ``type_error``).
    """
    ok_type = isinstance(value, int) and not isinstance(value, bool)
    if type_error:
        if not ok_type:
            raise TypeError(f"{name} must be an int, got {value_and_type(value)}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
    elif not ok_type or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{name} must be an integer{bound}, got {value_and_type(value)}")


def check_num_classes(num_classes: object) -> None:
    """Raise ``ValueError`` unless ``num_classes`` is a Python ``int`` >= 2 (bools refused): a
    categorical likelihood needs at least two classes."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be >= 2 (an integer), got {num_classes!r}")


def is_int(value: Any) -> bool:
    """True for a Python or numpy integer; False for bool, which is an int subclass."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def as_tensor(value: Any, name: str, *, normalize: bool = False) -> torch.Tensor:
    """The one conversion of user arrays to tensors.

    A numpy array or pandas object becomes a tensor (copied where its memory is read-only or
    strided), numpy float64 becoming float32; a tensor is returned as it is. With ``normalize``
    (dataset construction), every float becomes float32 and every integer int64; without it,
    other dtypes are left for the model's own checks to name.

    Args:
        value: a ``torch.Tensor``, ``numpy.ndarray``, or pandas object (``to_numpy``).
        name: the argument's name, for messages.

    Raises:
        TypeError: not an array or tensor, a numpy array of non-numbers, or complex values.
        ValueError: a tensor on PyTorch's ``meta`` device (shapes without values).
    """
    if hasattr(value, "to_numpy"):
        value = value.to_numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"{name} must hold numbers or bools, got numpy dtype {value.dtype}")
        if value.dtype == np.float64:
            value = value.astype(np.float32)
        value = torch.from_numpy(np.require(value, requirements=["C", "W"]))
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor or numpy array (or a pandas object), "
            f"got {type(value).__name__}"
        )
    if value.device.type == "meta":
        raise ValueError(
            f"{name} is on the 'meta' device, which holds shapes but no values: create it on "
            "'cpu' or 'cuda'"
        )
    if value.is_complex():
        raise TypeError(f"{name} must be real, got {value.dtype}")
    if not normalize or value.dtype == torch.bool:
        return value
    return value.to(torch.float32 if value.is_floating_point() else torch.int64)


def check_finite(t: torch.Tensor, name: str) -> None:
    """Raise ValueError if a floating tensor holds NaN or inf (integer tensors pass)."""
    if t.is_floating_point() and t.numel() and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} must be finite, got {bad} NaN/inf entries")


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} and dtype {t.dtype}"


def check_sizes(**sizes: object) -> None:
    """Raise ``ValueError`` unless every value is an int ``>= 1`` (bools refused)."""
    for name, value in sizes.items():
        check_int(name, value)


def int_text(value: int) -> str:
    """``value`` for a message: in full up to 100 bits, else its order of magnitude (a JSON
    body may hold thousands of digits, which a message should not echo)."""
    if value.bit_length() <= 100:
        return str(value)
    return f"{'-' if value < 0 else ''}about 10^{int(value.bit_length() * math.log10(2))}"


def value_and_type(value: object) -> str:
    """``value`` for an error message, with its type when that is what is wrong (a NumPy
    integer prints like an int)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return repr(value)
    return f"{value!r} of type {type(value).__name__} (pass a Python int)"


def described(value: object) -> str:
    """``value`` for an error message, with its type (``np.float64(0.5)`` prints like 0.5)."""
    return f"{value!r} of type {type(value).__name__}"


def check_sequence_inputs(
    x: torch.Tensor,
    y: torch.Tensor | None,
    mask: torch.Tensor | None,
    *,
    in_features: int | None,
    max_len: int,
    num_classes: int | None = None,
    vocab_size: int | None = None,
) -> None:
    """Validate ``(x, y, mask)`` for a sequence model.

    ``x`` is ``(N, T, F)`` float features, or with ``vocab_size`` ``(N, T)`` int64 token ids in
    ``[0, vocab_size)``. With ``num_classes``, ``y`` must be ``(N,)`` int64 labels (models with
    other targets check ``y`` themselves: ``check_labels``, ``check_values``).

    Raises:
        TypeError: wrong type or dtype.
        ValueError: wrong rank or size, an empty batch, non-finite features, token ids or labels
            out of range, a mask of the wrong shape, or a sequence that is all padding.
    """
    if not isinstance(x, torch.Tensor):
        expected = "(N, T) token ids" if vocab_size else "(N, T, F)"
        raise TypeError(f"x must be a torch.Tensor of shape {expected}, got {type(x).__name__}")
    if vocab_size is not None:
        if x.dim() != 2:
            raise ValueError(f"x must hold token ids of shape (N, T), got {_describe(x)}")
        if x.dtype != torch.int64:
            raise TypeError(f"x must hold int64 token ids of shape (N, T), got {_describe(x)}")
    else:
        if x.dim() != 3:
            raise ValueError(f"x must have shape (N, T, F={in_features}), got {_describe(x)}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor of features, got {_describe(x)}")
    N, T = x.shape[:2]
    if N == 0 or T == 0:
        raise ValueError(
            f"x must hold at least one sequence of at least one step, got {_describe(x)}"
        )
    if vocab_size is None and x.shape[2] != in_features:
        raise ValueError(f"x must have F={in_features} features per step, got {_describe(x)}")
    if T > max_len:
        raise ValueError(f"x has T={T} steps but the model was built for max_len={max_len}")
    if vocab_size is not None:
        if x.min() < 0 or x.max() >= vocab_size:
            raise ValueError(
                f"x must hold token ids in [0, {vocab_size}), got values in "
                f"[{int(x.min())}, {int(x.max())}]"
            )
    elif not torch.isfinite(x).all():
        raise ValueError("x contains NaN or inf values")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = _describe(mask) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"mask must be a bool tensor of shape (N, T)=({N}, {T}), got {got}")
        if tuple(mask.shape) != (N, T):
            raise ValueError(f"mask must have shape (N, T)=({N}, {T}), got {tuple(mask.shape)}")
        if mask.device != x.device:
            raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
        empty = (~mask.any(dim=1)).nonzero().flatten()
        if len(empty):
            rows = ", ".join(map(str, empty[:5].tolist())) + (", ..." if len(empty) > 5 else "")
            raise ValueError(
                f"mask marks every step of sequence(s) {rows} as padding: each sequence needs "
                "at least one real step"
            )
    if y is not None:
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
        if y.device != x.device:
            raise ValueError(f"y is on {y.device} but x is on {x.device}")
        if num_classes is not None:
            check_labels(y, (N,), num_classes, dims="(N,)")


def check_labels(
    y: torch.Tensor, shape: tuple[int, ...], num_classes: int, *, dims: str = ""
) -> None:
    """``y`` must be int64 of ``shape`` (named ``dims``, e.g. ``"(N, T)"``) with values in
    ``[0, num_classes)``.

    Raises:
        TypeError: not int64. ValueError: wrong shape or a label out of range.
    """
    if not isinstance(y, torch.Tensor) or y.dtype != torch.int64:
        got = _describe(y) if isinstance(y, torch.Tensor) else type(y).__name__
        raise TypeError(f"y must be int64 class labels of shape {dims}={shape}, got {got}")
    if tuple(y.shape) != shape:
        raise ValueError(f"y must have shape {dims}={shape}, got {tuple(y.shape)}")
    if y.numel() and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(
            f"y must hold labels in [0, {num_classes}), got values in "
            f"[{int(y.min())}, {int(y.max())}]"
        )


def check_values(y: torch.Tensor, shape: tuple[int, ...], *, dims: str = "") -> None:
    """``y`` must be a finite float tensor of ``shape`` (named ``dims``, e.g. ``"(N, H)"``).

    Raises:
        TypeError: not floating point. ValueError: wrong shape, NaN or inf.
    """
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        got = _describe(y) if isinstance(y, torch.Tensor) else type(y).__name__
        raise TypeError(f"y must be a float tensor of shape {dims}={shape}, got {got}")
    if tuple(y.shape) != shape:
        raise ValueError(f"y must have shape {dims}={shape}, got {tuple(y.shape)}")
    if not torch.isfinite(y).all():
        raise ValueError("y contains NaN or inf values: drop or impute those targets first")


def check_probability(name: str, value: object) -> None:
    """``value`` is a float in (0, 1).

    Raises:
        ValueError: anything else, named.
    """
    if not (isinstance(value, float) and 0 < value < 1):
        raise ValueError(f"{name} must be a float in (0, 1), got {described(value)}")


def check_positive(name: str, value: object, *, none: bool = False) -> None:
    """``value`` is a finite number > 0 (or None, where ``none``).

    Raises:
        ValueError: anything else, named.
    """
    if none and value is None:
        return
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value < math.inf):
        raise ValueError(f"{name} must be a finite number > 0, got {described(value)}")


def check_flag(name: str, value: object, *, none: bool = False) -> None:
    """``value`` is a Python bool (or None, where ``none``).

    Raises:
        TypeError: anything else (``np.True_`` too), named.
    """
    if not (isinstance(value, bool) or (none and value is None)):
        allowed = "True, False or None" if none else "a Python bool"
        raise TypeError(f"{name} must be {allowed}, got {described(value)}")
