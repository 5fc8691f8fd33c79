"""How many intra-op CPU threads ``fit`` gives torch when ``--threads`` is not set.

The models here are made of hundreds of small tensor operations per step. At each one, torch's
intra-op threads split the work and wait for each other; when one of them has lost its core to
another process, all of them wait. ``benchmarks/studies/svi_threads.py`` measured ms per SVI
step on 2 cores (``benchmarks/BENCHMARKS.md``, "Intra-op threads"): with other work on the
machine, two threads were 3.4-46x slower than one at every size measured, up to d_model 256
with mini-batches of 512 sequences; the main job (d_model 64, batch 128, 3,000 steps) took 75
minutes with two threads on a loaded machine, 5 with one at load 5-7. So the default is one
thread, unless the work per step is large enough for more threads to pay (``MIN_PARALLEL_WORK``)
and cores are idle to run them: then one thread per idle core.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

#: Multiply-adds of one forward pass of a mini-batch below which ``fit`` uses one thread: just
#: above the largest size measured (the d_model-256, 2-layer classifier on 512 sequences of 8
#: steps, 4.3e9), where two threads still lost 3.7x on a shared machine. The main job: 6.9e7.
MIN_PARALLEL_WORK = 5e9


def forward_work(config: Mapping[str, Any], batch_rows: int) -> float | None:
    """Multiply-adds of one forward pass of ``batch_rows`` sequences through the encoder of a
    model with ``config`` (``model.config``): per layer and step, the four attention
    projections (4 d_model²), the feed-forward sublayer (2 d_model d_ff) and the attention
    scores and mixing (2 T d_model). None when ``config`` has no Transformer sizes."""
    d, t = config.get("d_model"), config.get("max_len")
    if not d or not t:
        return None
    layers = config.get("num_layers", 1) + config.get("num_decoder_layers", 0)
    d_ff = config.get("d_ff", 2 * d)
    return float(batch_rows * t * layers * (4 * d * d + 2 * d * d_ff + 2 * t * d))


def default_threads(
    config: Mapping[str, Any], batch_rows: int, *, cores: int, load: float
) -> tuple[int, str]:
    """The intra-op threads for fitting a model of ``config`` on ``batch_rows`` rows per step.

    Args:
        config: the model's ``config`` (``d_model``, ``max_len``, ``num_layers``, ``d_ff``).
        batch_rows: sequences per step (the mini-batch, or every training row).
        cores: the cores torch would use (``torch.get_num_threads()`` before any setting: the
            physical cores, or ``OMP_NUM_THREADS``).
        load: the 1-minute load average (runnable processes; ``os.getloadavg()[0]``).

    Returns:
        ``(threads, why)``: 1 below ``MIN_PARALLEL_WORK`` multiply-adds per forward pass (or for
        a model without Transformer sizes), otherwise the cores not taken by the load (at least
        1); ``why`` says which, in a few words.
    """
    work = forward_work(config, batch_rows)
    if work is None or work < MIN_PARALLEL_WORK:
        size = "" if work is None else f"{work / 1e9:.2g}G multiply-adds per step, "
        return 1, f"{size}too small for more threads to pay"
    idle = max(1, min(cores, round(cores - load)))
    return idle, f"{work / 1e9:.2g}G multiply-adds per step; {idle} of {cores} cores idle"


def machine_load() -> float:
    """The 1-minute load average; 0 where the system does not report it (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def fit_threads(args: argparse.Namespace, model, train) -> tuple[int, str]:
    """``(threads, why)`` of a ``fit``: ``--threads`` or the preset's (``args.threads_from``
    says which), else ``OMP_NUM_THREADS``'s, else ``default_threads`` for ``model`` and the
    rows of one step of ``train``."""
    import torch

    if args.threads is not None:
        return args.threads, getattr(args, "threads_from", None) or "--threads"
    if os.environ.get("OMP_NUM_THREADS"):  # the user's setting for torch: keep it
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    from probtransformer.cli.library_defaults import DEFAULTS

    batch_size = args.batch_size
    if batch_size is None:  # fit_svi's default; mcmc and mile always come with --threads
        batch_size = int(DEFAULTS["fit"]["batch_size"])
    threads, why = default_threads(
        getattr(model, "config", {}),
        min(batch_size, len(train)),
        cores=torch.get_num_threads(),
        load=machine_load(),
    )
    return threads, f"{why}; --threads N sets it"


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)``, then restore torch's setting."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


__all__ = [
    "MIN_PARALLEL_WORK",
    "default_threads",
    "fit_threads",
    "forward_work",
    "intra_op_threads",
    "machine_load",
]
