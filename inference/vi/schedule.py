"""The learning-rate schedules of ``fit_svi`` and the batched MAP fits: an optional linear
warm-up over a fraction of the steps, then an exponential or cosine decay from ``lr`` to
``lr * lr_decay``."""

from __future__ import annotations

import math

import torch

LR_SCHEDULES = ("exponential", "cosine")


def check_schedule(lr_decay, lr_warmup, lr_schedule) -> None:
    """Raise for a schedule ``lr_scheduler`` cannot build.

    Raises:
        ValueError: ``lr_schedule`` unknown; ``lr_decay`` outside (0, 1] (exponential) or
            [0, 1] (cosine); ``lr_warmup`` not a fraction in [0, 1).
        TypeError: ``lr_warmup`` not a number.
    """
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {lr_schedule!r}")
    lowest = 0 if lr_schedule == "cosine" else None
    number = isinstance(lr_decay, (int, float)) and not isinstance(lr_decay, bool)
    if not (number and (0 < lr_decay <= 1 or lr_decay == lowest)):
        interval = "[0, 1]" if lowest == 0 else "(0, 1] (0 only with lr_schedule='cosine')"
        raise ValueError(f"lr_decay must be in {interval}, got {lr_decay!r}")
    if not isinstance(lr_warmup, (int, float)) or isinstance(lr_warmup, bool):
        raise TypeError(
            f"lr_warmup must be a number (a fraction of num_steps), got {type(lr_warmup).__name__}"
        )
    if not 0 <= lr_warmup < 1:
        raise ValueError(f"lr_warmup must be a fraction of num_steps in [0, 1), got {lr_warmup}")


def lr_scheduler(
    optimizer: torch.optim.Optimizer,
    num_steps: int,
    lr_decay: float,
    lr_warmup: float = 0.0,
    lr_schedule: str = "exponential",
) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate at step ``t`` (0-based) as a fraction of ``lr``, with
    ``W = round(lr_warmup * num_steps)`` warm-up steps:

    - ``t < W``: ``(t + 1) / W``, a linear warm-up (Goyal et al. 2017; the Transformer's,
      Vaswani et al. 2017);
    - then, with ``u = (t - W) / (num_steps - W)``: ``lr_decay ** u``
      (``"exponential"``) or ``lr_decay + (1 - lr_decay) (1 + cos(pi u)) / 2`` (``"cosine"``,
      Loshchilov & Hutter 2017, without restarts). Steps past ``num_steps`` keep decaying
      (exponential) or stay at ``lr * lr_decay`` (cosine).

    Without warm-up the exponential schedule is torch's ``ExponentialLR``, step for step the
    numbers of fits before the warm-up existed.
    """
    warmup = round(lr_warmup * num_steps)
    if warmup == 0 and lr_schedule == "exponential":
        return torch.optim.lr_scheduler.ExponentialLR(
            optimizer, gamma=lr_decay ** (1.0 / max(num_steps, 1))
        )
    decaying = max(num_steps - warmup, 1)

    def factor(t: int) -> float:
        if t < warmup:
            return (t + 1) / warmup
        u = (t - warmup) / decaying
        if lr_schedule == "cosine":
            return lr_decay + (1 - lr_decay) * 0.5 * (1 + math.cos(math.pi * min(u, 1.0)))
        return lr_decay**u

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
