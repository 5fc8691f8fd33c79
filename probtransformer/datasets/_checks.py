"""Input checks shared by the dataset modules: integers, tensor conversion, finiteness."""

from __future__ import annotations

from numbers import Integral
from typing import Any

import numpy as np
import pandas as pd
import torch


def is_int(value: Any) -> bool:
    """True for a Python or numpy integer; False for bool, which is an int subclass."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def as_tensor(value: Any, name: str) -> torch.Tensor:
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


def check_finite(t: torch.Tensor, name: str) -> None:
    """Raise ValueError if a floating tensor holds NaN or inf (integer tensors pass)."""
    if t.is_floating_point() and t.numel() and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} must be finite, got {bad} NaN/inf entries")
