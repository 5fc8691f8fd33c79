"""A key-value cache for decoding causal models one step at a time.

Inside ``decoding(cache)`` a causal model's forward pass takes only the steps that are new since
the last pass: the embedding gives them positions from ``cache.offset`` on, each self-attention
module attends from them to its cached keys and values plus their own, and each causal
convolution reads the steps before them from the cache. The outputs equal those of a pass over
the whole sequence at the new steps (up to floating-point rounding). The cache keeps every
module's tensors with their draw dims, so one cache serves a vectorized pass over posterior
draws; a pass that gives each draw its own parameters (ensembles, MC dropout) needs one cache
per draw.

The caller advances ``offset`` after each pass (``advance``) and starts again with ``reset``
when the window would outgrow the model's ``max_len``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_ACTIVE: contextvars.ContextVar[KVCache | None] = contextvars.ContextVar("kv_cache", default=None)


class KVCache:
    """Per-module tensors of the steps decoded so far.

    Attributes:
        offset: steps already in the cache: the position of the first new step.
    """

    def __init__(self) -> None:
        self.offset = 0
        self._store: dict[int, tuple[tuple[torch.Tensor, ...], int]] = {}  # buffers, steps

    def reset(self) -> None:
        """Forget every step (the next pass starts at position 0)."""
        self.offset = 0
        self._store.clear()

    def advance(self, steps: int) -> None:
        """Count the ``steps`` new steps of the pass just run as cached."""
        self.offset += steps

    def _extended(self, module, new: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The module's cached tensors joined with ``new`` along the step dim (-2), stored.

        Each tensor lives in a buffer with room to grow (its capacity doubles when full), and
        the steps so far are a view of it: a step copies only the new steps, where joining
        with ``torch.cat`` would copy the whole cache every step."""
        entry = self._store.get(id(module))
        steps = new[0].shape[-2]
        if entry is None:
            if self.offset:
                raise RuntimeError(
                    f"{type(module).__name__} has no cached steps, but the cache holds "
                    f"{self.offset}: every pass inside decoding() must run the same modules"
                )
            buffers, length = (), 0
        else:
            buffers, length = entry
            if length != self.offset:
                raise RuntimeError(
                    f"{type(module).__name__} ran twice in one pass, or the cache was not "
                    f"advanced: it holds {length} steps, the offset says {self.offset}"
                )
        if not buffers or length + steps > buffers[0].shape[-2]:
            capacity = max(2 * (length + steps), 16)
            grown = []
            for i, n in enumerate(new):
                buffer = n.new_empty(*n.shape[:-2], capacity, n.shape[-1])
                if length:
                    buffer[..., :length, :] = buffers[i][..., :length, :]
                grown.append(buffer)
            buffers = tuple(grown)
        for buffer, n in zip(buffers, new, strict=True):
            buffer[..., length : length + steps, :] = n
        self._store[id(module)] = (buffers, length + steps)
        return tuple(buffer[..., : length + steps, :] for buffer in buffers)

    def keys_values(self, module, k: torch.Tensor, v: torch.Tensor):
        """``(k, v)`` of every step so far, ``(s, N, H, offset + Tq, d_head)``, given the new
        steps' ``(s, N, H, Tq, d_head)``."""
        return self._extended(module, (k, v))

    def preceding(self, module, h: torch.Tensor, steps: int) -> torch.Tensor:
        """``h (s, N, T, d)`` of the new steps with the ``steps`` steps before them prepended
        (zeros before position 0), ``(s, N, steps + T, d)``; for causal convolutions."""
        (full,) = self._extended(module, (h,))
        missing = steps + h.shape[-2] - full.shape[-2]
        window = full[..., -(steps + h.shape[-2]) :, :]
        if missing > 0:
            zeros = window.new_zeros(*window.shape[:-2], missing, window.shape[-1])
            window = torch.cat([zeros, window], dim=-2)
        return window


def active() -> KVCache | None:
    """The cache of the enclosing ``decoding`` block, or None."""
    return _ACTIVE.get()


def offset() -> int:
    """Position of the first step of the current pass: ``active().offset``, or 0."""
    cache = _ACTIVE.get()
    return 0 if cache is None else cache.offset


@contextlib.contextmanager
def decoding(cache: KVCache | None) -> Iterator[None]:
    """Run the forward passes in the block against ``cache`` (None: no cache, full passes)."""
    token = _ACTIVE.set(cache)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
