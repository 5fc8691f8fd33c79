"""Counting HMC/NUTS gradient evaluations in-process, shared by the benchmarks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pyro.ops.integrator


@contextlib.contextmanager
def count_gradients() -> Iterator[list[int]]:
    """Count calls of ``pyro.ops.integrator.potential_grad`` (one per leapfrog step, warm-up
    included) in this process; yields a one-element list holding the running count."""
    count = [0]
    original = pyro.ops.integrator.potential_grad

    def counted(potential_fn, z):
        count[0] += 1
        return original(potential_fn, z)

    pyro.ops.integrator.potential_grad = counted
    try:
        yield count
    finally:
        pyro.ops.integrator.potential_grad = original
