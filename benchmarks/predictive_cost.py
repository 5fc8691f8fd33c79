"""Posterior predictive cost: S draws in one vectorized pass against a loop of one pass per draw.

The model is the default digits ``SequenceClassifier`` (d_model 64, 4 heads, 2 layers; latent
attention projections, logit scales and head) fitted by ``fit_svi`` (mean-field ``AutoNormal``)
for a few hundred steps: the fit's quality does not matter here, only the shapes. It is fitted
once per results directory and seed, saved with ``Posterior.save`` under
``<results>/tmp/`` and loaded by every row. Each row predicts the 450-row digits test split
with ``S`` in {1, 10, 100} posterior draws (row keys ``S10-vectorized``, ``S10-loop``) in one
of two modes:

- ``vectorized``: ``Posterior.predict(x, num_samples=S)``: the guide draws all ``S`` draws at
  once and the model, conditioned on them, runs once per row batch for all draws (a
  ``pyro.plate`` over draws; rows and draws split to fit the default 1 GiB memory budget);
- ``loop``: the loop a user writes: the same ``S`` draws (``Posterior.draws`` with the same
  seed), then for each draw one forward pass of the model conditioned on it
  (``poutine.condition``) over all 450 rows, reading the likelihood's class probabilities.
  This is what ``pyro.infer.Predictive(..., parallel=False)`` runs per draw, without its two
  extra unconditioned passes (to find the plate nesting and site shapes), so a fair loop; with
  ``guide=`` instead of the draws it would draw different numbers, and the two modes could
  not be checked against each other.

Before a row is timed, both modes predict with its ``S`` and the same seed, and their
``(S, 450, 10)`` probabilities must agree within ``ATOL`` (the row records the largest
difference). Time: wall seconds of one call for all 450 rows, draws included, median over
repeats after an untimed pilot call that sizes the repeats to ``ctx.budget_s`` (3 to 10).
Peak memory: a process's peak only ever rises, so every row runs in its own subprocess
(``python -m benchmarks.predictive_cost --measure S MODE --posterior DIR``, printing the
row's measurements as JSON) that loads the posterior, warms up on two rows with one draw, then
reads the rise of its peak resident set size over the pilot and timed calls: ``VmHWM`` of
``/proc/self/status`` (Linux), the peak of this process's own memory. (``ru_maxrss`` of
``getrusage`` does not do here: Linux carries the parent's peak over into a child started by
fork and exec, so a child's ``ru_maxrss`` starts at the suite's peak.) On CUDA the row also
has the rise of ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, which
its table shows. The subprocess uses the caller's number of torch threads. Quick
mode: S in {1, 10}, a 10-step fit, 2 repeats.

Run::

    python -m benchmarks.run --only predictive
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from pyro import poutine

from benchmarks._suite import Context, budgeted_steps, fmt
from probtransformer.datasets import load
from probtransformer.inference import Posterior, fit_svi, load_posterior
from probtransformer.inference._runtime import pyro_scope
from probtransformer.models import SequenceClassifier

NAME = "predictive"
TITLE = "Posterior predictive: vectorized draws vs a loop over draws"

NUM_DRAWS = (1, 10, 100)
QUICK_NUM_DRAWS = (1, 10)
MODES = ("vectorized", "loop")
DATASET = "digits"
FIT_STEPS = 300
QUICK_FIT_STEPS = 10
MAX_REPEATS = 10
MIN_REPEATS = 3
QUICK_REPEATS = 2
#: Largest difference allowed between the two modes' probabilities.
ATOL = 1e-5
#: Speed-up from which the reading calls vectorizing worthwhile (and its inverse, a loss).
WORTHWHILE = 1.2
#: Share of the remaining budget the timed repeats may plan for.
BUDGET_SHARE = 0.8
REPO = Path(__file__).resolve().parents[1]


def row_key(num_draws: int, mode: str) -> str:
    return f"S{num_draws}-{mode}"


def parse_key(key: str) -> tuple[int, str]:
    """``"S10-loop"`` -> ``(10, "loop")``."""
    draws, mode = key.split("-")
    return int(draws.removeprefix("S")), mode


def row_keys(ctx: Context) -> list[str]:
    draws = QUICK_NUM_DRAWS if ctx.quick else NUM_DRAWS
    return [row_key(s, mode) for s in draws for mode in MODES]


def predict_vectorized(post: Posterior, x: torch.Tensor, num_draws: int, seed: int) -> torch.Tensor:
    """``(S, N, C)`` class probabilities from ``Posterior.predict`` (all draws per pass)."""
    return post.predict(x, num_samples=num_draws, seed=seed).probs


def predict_loop(post: Posterior, x: torch.Tensor, num_draws: int, seed: int) -> torch.Tensor:
    """``(S, N, C)`` class probabilities of the same draws, one forward pass per draw."""
    draws = {name: value[0] for name, value in post.draws(num_draws, seed=seed).items()}
    probs = []
    with pyro_scope(), torch.no_grad():
        for s in range(num_draws):
            model = poutine.condition(post.model, data={k: v[s] for k, v in draws.items()})
            trace = poutine.trace(model).get_trace(x)
            likelihood = trace.nodes[post.model.likelihood_site]["fn"]
            probs.append(likelihood.probs.reshape(len(x), -1))
    return torch.stack(probs).cpu()


PREDICTORS = {"vectorized": predict_vectorized, "loop": predict_loop}


def evaluation_inputs(seed: int, device: torch.device) -> torch.Tensor:
    """Features of the digits test split, on ``device``."""
    return load(DATASET, seed=seed).test.x.to(device)


def fitted_posterior(ctx: Context) -> Path:
    """Directory of the saved posterior of ``ctx`` (quick or not, seed, device), fitted and
    saved on first use."""
    steps = QUICK_FIT_STEPS if ctx.quick else FIT_STEPS
    suffix = "-cuda" if ctx.device == "cuda" else ""
    path = ctx.results / "tmp" / f"predictive-{DATASET}-svi{steps}-seed{ctx.seed}{suffix}"
    if not path.exists():  # Posterior.save moves a complete directory into place
        splits = load(DATASET, seed=ctx.seed)
        meta = splits.meta
        model = SequenceClassifier(meta["in_features"], meta["num_classes"], meta["max_len"])
        post = fit_svi(
            model, splits.train, num_steps=steps, seed=ctx.seed, device=ctx.device, progress=False
        )
        post.save(path)
    return path


@functools.cache
def _loaded(path: Path, device: str) -> Posterior:
    return load_posterior(path, device=device)


@functools.cache
def max_abs_difference(path: Path, num_draws: int, device: str, seed: int) -> float:
    """Largest difference between the two modes' probabilities (once per process and ``S``)."""
    post = _loaded(path, device)
    x = evaluation_inputs(seed, post.device)
    vectorized = predict_vectorized(post, x, num_draws, seed)
    loop = predict_loop(post, x, num_draws, seed)
    return float((vectorized - loop).abs().max())


def _resident_mib() -> dict[str, float]:
    """This process's current (``VmRSS``) and peak (``VmHWM``) resident set size in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) / 2**10 for key in ("VmRSS", "VmHWM")}  # kB


def measure(
    num_draws: int,
    mode: str,
    posterior: Path,
    *,
    device: str,
    seed: int,
    budget_s: float,
    max_repeats: int,
) -> dict:
    """Time and peak memory of ``mode`` with ``num_draws`` draws; run in a fresh process."""
    start = time.perf_counter()
    post = load_posterior(posterior, device=device)
    x = evaluation_inputs(seed, post.device)
    predict = PREDICTORS[mode]
    predict(post, x[:2], 1, seed)  # one-time allocations and lazy set-up land in the baseline
    cuda = post.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(post.device)
        cuda_before = torch.cuda.memory_allocated(post.device)
    before = _resident_mib()
    pilot = time.perf_counter()
    predict(post, x, num_draws, seed)  # results come back on CPU: device work is finished
    pilot_s = time.perf_counter() - pilot
    remaining = BUDGET_SHARE * (budget_s - (time.perf_counter() - start))
    repeats = budgeted_steps(
        pilot_s, remaining, max_steps=max_repeats, min_steps=min(MIN_REPEATS, max_repeats)
    )
    times = []
    for _ in range(repeats):
        call = time.perf_counter()
        predict(post, x, num_draws, seed)
        times.append(time.perf_counter() - call)
    result = dict(
        rows=len(x),
        times_s=times,
        pilot_s=pilot_s,
        repeats=repeats,
        rss_before_mib=before["VmRSS"],
        peak_rss_before_mib=before["VmHWM"],
        peak_rss_rise_mib=_resident_mib()["VmHWM"] - before["VmHWM"],
    )
    if cuda:
        peak = torch.cuda.max_memory_allocated(post.device) - cuda_before
        result["cuda_peak_mib"] = peak / 2**20
    return result


def _measure_in_subprocess(
    num_draws: int, mode: str, posterior: Path, ctx: Context, budget_s: float
) -> dict:
    command = [
        sys.executable,
        "-m",
        "benchmarks.predictive_cost",
        "--measure",
        str(num_draws),
        mode,
        "--posterior",
        str(posterior),
        "--device",
        ctx.device,
        "--seed",
        str(ctx.seed),
        "--budget-s",
        f"{budget_s:.1f}",
        "--max-repeats",
        str(QUICK_REPEATS if ctx.quick else MAX_REPEATS),
        "--threads",
        str(torch.get_num_threads()),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_row(key: str, ctx: Context) -> dict:
    """Check that the modes agree at the row's ``S``, then measure the row's mode alone."""
    num_draws, mode = parse_key(key)
    start = time.perf_counter()
    path = fitted_posterior(ctx)
    difference = max_abs_difference(path, num_draws, ctx.device, ctx.seed)
    if difference > ATOL:
        raise RuntimeError(
            f"vectorized and loop probabilities differ by up to {difference:.3g} at S="
            f"{num_draws} (tolerance {ATOL}): the two modes do not compute the same thing"
        )
    budget_s = ctx.budget_s - (time.perf_counter() - start)
    measured = _measure_in_subprocess(num_draws, mode, path, ctx, budget_s)
    record = _loaded(path, ctx.device).record
    return dict(
        num_draws=num_draws,
        mode=mode,
        device=ctx.device,
        median_s=statistics.median(measured["times_s"]),
        min_s=min(measured["times_s"]),
        max_s=max(measured["times_s"]),
        **measured,
        max_abs_difference=difference,
        tolerance=ATOL,
        fit_steps=record["steps_done"],
        fit_seconds=record["seconds"],
        seconds=time.perf_counter() - start,
    )


def _memory(row: dict) -> float:
    """Peak memory of a row in MiB: the CUDA allocation on CUDA, the RSS rise otherwise."""
    return row.get("cuda_peak_mib", row["peak_rss_rise_mib"])


def _memory_label(rows: dict[str, dict]) -> str:
    cuda = any("cuda_peak_mib" in row for row in rows.values())
    return "CUDA peak MiB" if cuda else "peak RSS rise MiB"


def _by_draws(rows: dict[str, dict]) -> dict[int, dict[str, dict]]:
    """``{S: {mode: row}}``, ``S`` ascending."""
    table: dict[int, dict[str, dict]] = {}
    for row in rows.values():
        table.setdefault(row["num_draws"], {})[row["mode"]] = row
    return dict(sorted(table.items()))


def _speed_up(pair: dict[str, dict]) -> float | None:
    if set(MODES) <= set(pair):
        return pair["loop"]["median_s"] / pair["vectorized"]["median_s"]
    return None


def _table(by_draws: dict[int, dict[str, dict]], memory: str) -> list[str]:
    lines = [
        f"| S | vectorized s | loop s | speed-up (loop / vectorized) | vectorized {memory} "
        f"| loop {memory} | repeats (vect., loop) | max abs. difference |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for num_draws, pair in by_draws.items():
        vectorized, loop = pair.get("vectorized", {}), pair.get("loop", {})
        lines.append(
            f"| {num_draws} | {fmt(vectorized.get('median_s'))} | {fmt(loop.get('median_s'))} "
            f"| {fmt(_speed_up(pair), 2)} "
            f"| {fmt(_memory(vectorized), 1) if vectorized else ''} "
            f"| {fmt(_memory(loop), 1) if loop else ''} "
            f"| {vectorized.get('repeats', '')}, {loop.get('repeats', '')} "
            f"| {max(row['max_abs_difference'] for row in pair.values()):.1e} |"
        )
    return lines


def _reading(by_draws: dict[int, dict[str, dict]]) -> list[str]:
    complete = {s: pair for s, pair in by_draws.items() if _speed_up(pair) is not None}
    if not complete:
        return []
    largest = max(complete)
    vectorized, loop = complete[largest]["vectorized"], complete[largest]["loop"]
    speed_up = _speed_up(complete[largest])
    faster = f"{speed_up:.2f}x faster" if speed_up >= 1 else f"{1 / speed_up:.2f}x slower"
    lines = [
        f"- At S={largest} the vectorized call takes {vectorized['median_s']:.3f} s against "
        f"{loop['median_s']:.3f} s for the loop ({faster}); its peak memory is "
        f"{_memory(vectorized):.1f} MiB against {_memory(loop):.1f} MiB."
    ]
    if len(complete) > 1:
        smallest = min(complete)
        lines.append(
            f"- From S={smallest} to S={largest} the speed-up goes from "
            f"{_speed_up(complete[smallest]):.2f} to {speed_up:.2f}, the vectorized peak memory "
            f"from {_memory(complete[smallest]['vectorized']):.1f} to "
            f"{_memory(vectorized):.1f} MiB and the loop's from "
            f"{_memory(complete[smallest]['loop']):.1f} to {_memory(loop):.1f} MiB."
        )
    if speed_up >= WORTHWHILE:
        lines.append(
            f"- Vectorizing pays at S={largest}: one pass per row batch replaces {largest} "
            "passes, each with its own Python, Pyro and kernel-launch overhead."
        )
    elif speed_up > 1 / WORTHWHILE:
        lines.append(
            f"- Vectorizing gains little time at S={largest}: both modes do the same arithmetic, "
            "which dominates a pass here, while the batched pass holds the activations of many "
            "draws at once and pays for it in memory."
        )
    else:
        lines.append(f"- The loop is faster at S={largest}.")
    worst = max(row["max_abs_difference"] for pair in by_draws.values() for row in pair.values())
    lines.append(
        f"- The two modes' probabilities agree within {worst:.1e} (tolerance {ATOL:.0e}) at "
        "every S: the same draws give the same predictions."
    )
    return lines


def markdown(rows: dict[str, dict], ctx: Context) -> str:
    if not rows:
        return "No rows measured yet."
    by_draws = _by_draws(rows)
    first = next(iter(rows.values()))
    missing = [key for key in row_keys(ctx) if key not in rows]
    out = [
        f"Posterior predictive of the default digits `SequenceClassifier` (fit_svi, "
        f"{first['fit_steps']} steps) for the {first['rows']} rows of the digits test split, "
        f"device {first['device']}: `Posterior.predict` (all draws in one batched pass) against "
        "a loop of one conditioned forward pass per draw over the same draws "
        "(`benchmarks/predictive_cost.py`). Wall seconds per call, median over repeats; peak "
        "memory of each configuration measured alone in a fresh process.",
        "",
        *_table(by_draws, _memory_label(rows)),
        "",
        "Reading:",
        "",
        *_reading(by_draws),
    ]
    if missing:
        out += ["", f"Rows still to measure: {', '.join(missing)}."]
    return "\n".join(out)


def plot(rows: dict[str, dict], ctx: Context) -> list[Path]:
    """Time and peak memory against S, one line per mode."""
    if not rows:
        return []
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    time_ax, memory_ax = fig.subplots(1, 2)
    for mode in MODES:
        group = sorted(
            (row for row in rows.values() if row["mode"] == mode), key=lambda r: r["num_draws"]
        )
        if not group:
            continue
        draws = [row["num_draws"] for row in group]
        median = np.array([row["median_s"] for row in group])
        spread = np.stack(
            [median - [row["min_s"] for row in group], [row["max_s"] for row in group] - median]
        )
        time_ax.errorbar(draws, median, yerr=spread, marker="o", capsize=3, label=mode)
        memory_ax.plot(draws, [_memory(row) for row in group], marker="o", label=mode)
    first = next(iter(rows.values()))
    draws = sorted({row["num_draws"] for row in rows.values()})
    calls = f"seconds per call ({first['rows']} rows)"
    for ax, label in ((time_ax, calls), (memory_ax, _memory_label(rows))):
        ax.set_xscale("log")
        ax.set_xticks(draws, [str(s) for s in draws])
        ax.set_xlabel("posterior draws S")
        ax.set_ylabel(label)
        ax.legend()
    time_ax.set_yscale("log")
    fig.suptitle(f"Posterior predictive: vectorized vs loop ({first['device']})")
    path = ctx.cache(NAME).with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return [path]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.predictive_cost",
        description="Measure one configuration of the predictive section in this process "
        "(used by `python -m benchmarks.run --only predictive`); prints JSON.",
    )
    parser.add_argument(
        "--measure", nargs=2, metavar=("S", "MODE"), required=True, help=f"MODE: {MODES}"
    )
    parser.add_argument("--posterior", type=Path, required=True, help="a saved posterior")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--max-repeats", type=int, default=MAX_REPEATS)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.measure[1] not in MODES:
        parser.error(f"MODE must be one of {MODES}, got {args.measure[1]!r}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    result = measure(
        int(args.measure[0]),
        args.measure[1],
        args.posterior,
        device=args.device,
        seed=args.seed,
        budget_s=args.budget_s,
        max_repeats=args.max_repeats,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
