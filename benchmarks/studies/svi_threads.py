"""Intra-op threads for SVI: ms per ``svi_step`` with 1 thread against more, quiet and loaded.

For each model width (d_model; 4 heads, 2 layers, d_ff = 2 d_model: the digits default is 64)
and mini-batch size, one ``svi_init`` state of a ``SequenceClassifier`` on synthetic digits-shaped
data (T=8 steps of F=8 features, 10 classes) takes ``--steps`` steps with each thread count in
turn (``torch.set_num_threads``), the order rotating from round to round so drift in the load
reaches all of them; a figure is the median over ``--rounds`` rounds of ms/step. Then the same
again with ``--busy`` processes spinning (``while True: pass``), each taking a core: what a
machine shared with other work looks like to the fit. Each row ends with the ratio of the
multi-thread time to the one-thread time, measured in the same process: above 1, one thread
is faster.

This measured ``cli.threads.default_threads``'s rule; the table is in
``benchmarks/BENCHMARKS.md`` ("Intra-op threads").

Usage::

    python -m benchmarks.studies.svi_threads                      # 1 vs all cores, 0 and 1 busy
    python -m benchmarks.studies.svi_threads --d-model 32 64 256 --batch-size 32 128 512
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import time
from collections.abc import Iterator

import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference import svi_init, svi_step
from probtransformer.models import SequenceClassifier

SEQ_LEN, IN_FEATURES, NUM_CLASSES, NUM_DATA = 8, 8, 10, 1212  # digits' training split


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """``n`` processes that each keep one core busy for the duration of the block."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(n)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        for proc in procs:
            proc.terminate()
            proc.join()


def ms_per_step(d_model: int, batch_size: int, threads: tuple[int, ...], steps: int, rounds: int):
    """Median ms/step of ``svi_step`` per thread count, the counts alternating within rounds."""
    g = torch.Generator().manual_seed(0)
    data = SequenceData(
        torch.randn(NUM_DATA, SEQ_LEN, IN_FEATURES, generator=g),
        torch.randint(NUM_CLASSES, (NUM_DATA,), generator=g),
    )
    model = SequenceClassifier(IN_FEATURES, NUM_CLASSES, SEQ_LEN, d_model=d_model, d_ff=2 * d_model)
    state = svi_init(model, data, batch_size=batch_size, num_steps=10**6, device="cpu")
    times: dict[int, list[float]] = {n: [] for n in threads}
    previous = torch.get_num_threads()
    try:
        for r in range(rounds):
            for n in threads[r % len(threads) :] + threads[: r % len(threads)]:
                torch.set_num_threads(n)
                svi_step(state)  # warm the pool of this thread count
                start = time.perf_counter()
                for _ in range(steps):
                    svi_step(state)
                times[n].append(1e3 * (time.perf_counter() - start) / steps)
    finally:
        torch.set_num_threads(previous)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    threads = tuple(dict.fromkeys(args.threads))
    print(f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    header = " ".join(f"{n}thr ms" for n in threads)
    print(f"busy load d_model batch {header} ratio(max/1)")
    for busy in args.busy:
        with busy_cores(busy):
            for d_model in args.d_model:
                for batch_size in args.batch_size:
                    ms = ms_per_step(d_model, batch_size, threads, args.steps, args.rounds)
                    row = " ".join(f"{ms[n]:7.1f}" for n in threads)
                    ratio = ms[max(threads)] / ms[min(threads)]
                    load = os.getloadavg()[0]  # 1-minute load average, this process included
                    print(
                        f"{busy:4d} {load:4.1f} {d_model:7d} {batch_size:5d} {row} {ratio:6.2f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
