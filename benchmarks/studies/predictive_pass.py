"""Time of one predictive pass over cached posterior draws: ``Posterior.predict(x, draws=...)`` of
a run directory at 1, 16 and 32 digits test rows, S = 100 draws (what ``probtransformer serve``
computes per batch).

Each figure is the best of ``--repeats`` timings of ``--calls`` calls, in ms per pass. To compare
two versions of the library, run this script from both checkouts in turn (several times each,
alternating, so load changes hit both alike)::

    python -m benchmarks.studies.predictive_pass --threads 2
    (cd ../before && PYTHONPATH=. python -m benchmarks.studies.predictive_pass --threads 2 \\
        --run ../main/runs/digits-svi)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import probtransformer
from probtransformer import datasets
from probtransformer.rundir import read_run


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="runs/digits-svi")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    post = read_run(args.run).posterior
    x = datasets.load("digits").test.x
    draws = post.draw(args.draws, seed=0)
    ms = {}
    for n in args.rows:
        post.predict(x[:n], seed=0, draws=draws)  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.calls):
                post.predict(x[:n], seed=0, draws=draws)
            best = min(best, (time.perf_counter() - start) / args.calls)
        ms[n] = round(1000 * best, 2)
    result = {"library": probtransformer.__file__, "threads": args.threads, "ms_per_pass": ms}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
