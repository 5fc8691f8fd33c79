"""Prior specifications for Bayesian Transformer components.

A spec is a small frozen dataclass that says *what* the prior is; layers ask it to build the Pyro
distribution for a given shape **on a given device** each time a latent is sampled, so a model
moved with ``.to(device)`` samples its priors there too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pyro.distributions as dist
import torch


def _check_positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


@dataclass(frozen=True)
class Normal:
    """Independent Normal prior on every entry of a weight tensor.

    With ``fan_in=True`` the standard deviation is ``scale / sqrt(fan_in)``, the variance-preserving
    choice of Neal (1996, "Bayesian Learning for Neural Networks") that keeps activations O(1)
    whatever the layer width.

    Args:
        scale: prior standard deviation (before the fan-in correction); > 0.
        loc: prior mean.
        fan_in: divide ``scale`` by ``sqrt(fan_in)``.

    Raises:
        ValueError: ``scale`` is not a finite positive number.
    """

    scale: float = 1.0
    loc: float = 0.0
    fan_in: bool = True

    def __post_init__(self) -> None:
        _check_positive("Normal.scale", self.scale)
        if not math.isfinite(self.loc):
            raise ValueError(f"Normal.loc must be finite, got {self.loc}")

    def std(self, fan_in: int) -> float:
        """Prior standard deviation for a weight whose layer has ``fan_in`` inputs."""
        return self.scale / math.sqrt(fan_in) if self.fan_in else self.scale

    def distribution(
        self, shape: tuple[int, ...], *, fan_in: int, device: torch.device
    ) -> dist.TorchDistribution:
        """The prior as one event of shape ``shape`` (``batch_shape == ()``)."""
        loc = torch.full(shape, float(self.loc), device=device)
        return dist.Normal(loc, self.std(fan_in)).to_event(len(shape))


@dataclass(frozen=True)
class LogitScalePrior:
    """LogNormal prior on a per-head inverse temperature of the attention logits.

    Attention logits become ``tau_h * q·k / sqrt(d_head)``; ``log tau_h ~ Normal(loc, scale)``.
    The posterior of ``tau_h`` says how sharp head ``h`` attends: large values mean near-hard
    selection, values near 0 mean near-uniform averaging over the visible keys.

    Args:
        loc: mean of ``log tau``; 0 puts the prior median at the usual ``1 / sqrt(d_head)`` scaling.
        scale: standard deviation of ``log tau``; > 0.

    Raises:
        ValueError: ``scale`` is not a finite positive number.
    """

    loc: float = 0.0
    scale: float = 0.5

    def __post_init__(self) -> None:
        _check_positive("LogitScalePrior.scale", self.scale)
        if not math.isfinite(self.loc):
            raise ValueError(f"LogitScalePrior.loc must be finite, got {self.loc}")

    def distribution(self, num_heads: int, *, device: torch.device) -> dist.TorchDistribution:
        """The prior over the ``(num_heads,)`` vector of inverse temperatures, one event."""
        loc = torch.full((num_heads,), float(self.loc), device=device)
        return dist.LogNormal(loc, self.scale).to_event(1)


_SPECS = {cls.__name__: cls for cls in (Normal, LogitScalePrior)}


def to_config(spec: Normal | LogitScalePrior | None) -> dict | None:
    """A JSON-serialisable description of a prior spec (``{"type": ..., **fields}``)."""
    if spec is None:
        return None
    return {"type": type(spec).__name__, **dataclasses.asdict(spec)}


def from_config(config: dict | None) -> Normal | LogitScalePrior | None:
    """Inverse of :func:`to_config`.

    Raises:
        ValueError: unknown spec type.
    """
    if config is None:
        return None
    fields = dict(config)
    kind = fields.pop("type", None)
    if kind not in _SPECS:
        raise ValueError(f"unknown prior spec type {kind!r}; expected one of {sorted(_SPECS)}")
    return _SPECS[kind](**fields)
