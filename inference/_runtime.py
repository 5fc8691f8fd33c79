"""Execution context shared by every fit and prediction: device, seed, param-store scope."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pyro
import torch
from torch import nn

from probtransformer.validation import check_int


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; other values are checked and returned.

    Raises:
        ValueError: an unknown device string, or CUDA requested where none is available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:i]', got {device!r}") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
    return resolved


def is_invalid_parameter_error(error: ValueError) -> bool:
    """True for the ``ValueError`` torch's distribution validation raises on NaN/inf parameters
    ("Expected parameter ... but found invalid values"): non-finite numbers, not bad input."""
    return "invalid values" in str(error)


def is_out_of_memory(error: BaseException) -> bool:
    """True for torch failing to allocate memory, on the GPU (``torch.OutOfMemoryError``) or
    the CPU (a ``RuntimeError`` saying "can't allocate memory")."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    )


@contextlib.contextmanager
def pyro_scope() -> Iterator[None]:
    """Run Pyro code in a fresh param store that is discarded afterwards.

    ``PyroModule`` parameters live in their modules; inside the scope Pyro mirrors them into the
    fresh store, and the caller's global store is restored on exit, so two fits (or a fit and a
    user's own Pyro code) in one process never share or overwrite state.
    """
    with pyro.get_param_store().scope():
        yield


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's RNG (CPU and ``device``) for the block, restoring the outer state after."""
    check_int("seed", seed, minimum=None, type_error=True)
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def reinitialised_copy(model: nn.Module, seed: int, device: torch.device) -> nn.Module:
    """Deep copy of ``model``, every ``reset_parameters`` re-run under ``seed``, on ``device``."""
    model = copy.deepcopy(model)
    with seeded(seed, torch.device("cpu")):
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model.to(device)
