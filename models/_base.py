"""What every built-in model shares: input checks and the alignment of draw dims with plates."""

from __future__ import annotations

import torch

from probtransformer.layers import align_draws, draw_batch_shape

__all__ = ["align_draws", "check_sequence_inputs", "draw_batch_shape"]


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} and dtype {t.dtype}"


def check_sequence_inputs(
    x: torch.Tensor,
    y: torch.Tensor | None,
    mask: torch.Tensor | None,
    *,
    in_features: int,
    max_len: int,
    num_classes: int | None = None,
) -> None:
    """Validate ``(x, y, mask)`` for a feature-sequence model.

    Raises:
        TypeError: wrong type or dtype.
        ValueError: wrong rank or size, an empty batch, non-finite features, labels out of range,
            a mask of the wrong shape, or a sequence that is all padding.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of shape (N, T, F), got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape (N, T, F={in_features}), got {_describe(x)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor of features, got {_describe(x)}")
    N, T, F = x.shape
    if N == 0 or T == 0:
        raise ValueError(
            f"x must hold at least one sequence of at least one step, got {_describe(x)}"
        )
    if F != in_features:
        raise ValueError(f"x must have F={in_features} features per step, got {_describe(x)}")
    if T > max_len:
        raise ValueError(f"x has T={T} steps but the model was built for max_len={max_len}")
    if not torch.isfinite(x).all():
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
            if y.dtype != torch.int64:
                raise TypeError(f"y must be int64 class labels of shape ({N},), got {_describe(y)}")
            if tuple(y.shape) != (N,):
                raise ValueError(f"y must have shape (N,)=({N},), got {tuple(y.shape)}")
            if y.min() < 0 or y.max() >= num_classes:
                raise ValueError(
                    f"y must hold labels in [0, {num_classes}), got values in "
                    f"[{int(y.min())}, {int(y.max())}]"
                )
