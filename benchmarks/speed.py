"""SVI step time against a deterministic step of the same network, by model width and length.

For each ``d_model`` in {32, 64, 128} and sequence length ``T`` in {8, 32, 128} (row keys
``d64-T32``), the contenders of ``benchmarks.studies.svi_overhead.build_contenders`` train on one
mini-batch of 128 sequences of 8 features (the digits training split at ``T = 8``, seeded
random sequences otherwise; see ``make_batch``; seed 0 as in ``svi_overhead``, ``ctx.seed`` is
not used), all in one process (``svi_overhead``'s docstring has the details):

- ``svi``: one ``fit_svi(guide="normal")`` step (``AutoNormal``, ``MeanFieldELBO``) of the
  default ``SequenceClassifier`` (4 heads, 2 layers, ``d_ff = 2 d_model``, latent attention
  projections, logit scales and head);
- ``svi-pyro``: the same step with Pyro's ``TraceMeanField_ELBO`` (``fit_svi`` before
  ``MeanFieldELBO``), shown for reference;
- ``deterministic``: the same classifier with ``bayesian=()`` trained by cross-entropy;
- ``torch``: ``torch.nn.TransformerEncoder`` of the same size.

``svi_overhead.time_contenders`` runs every contender for a warm-up, then ``rounds`` rounds of
``steps_per_round`` steps each, the contenders alternating within a round (order rotating) so
that drift in the machine's load reaches all of them. Per row: each contender's median wall
ms/step over rounds; the SVI/deterministic and SVI/torch ratios, each the median over rounds of
that round's ratio, with their min-max over rounds (the round spread); and the same
SVI/deterministic ratio in CPU time of the process, which leaves out time spent waiting for a
core. On CUDA every timed round ends with a device synchronisation.

Steps per round come from a timed pilot (one step of each contender after one untimed step) so
that a row keeps within ``ctx.budget_s``: 5 rounds of at most 30 steps (``svi_overhead``'s
defaults) and at least 1; the row records what it ran. Quick mode: rows ``d32-T8`` and
``d32-T32``, 1 round of 3 steps, no pilot. Threads are whatever the calling process set
(recorded in the row); ``svi_overhead``'s module docstring explains why one thread gives
steadier figures on a shared machine.

Targets: SVI/deterministic at most 1.5 at the digits default size (``d64-T8``) and at most 1.2
at ``d64-T32``.

Run::

    python -m benchmarks.run --only speed
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from benchmarks._suite import Context, budgeted_steps, fmt
from benchmarks.studies.svi_overhead import (
    SEED,
    build_contenders,
    make_batch,
    time_contenders,
    warmup_steps,
)
from probtransformer.inference._runtime import pyro_scope, resolve_device

NAME = "speed"
TITLE = "SVI step overhead by model size"

D_MODELS = (32, 64, 128)
SEQ_LENS = (8, 32, 128)
QUICK_KEYS = ("d32-T8", "d32-T32")
BATCH_SIZE = 128
ROUNDS = 5
MAX_STEPS = 30  # per round
MIN_STEPS = 1
PILOT_WARMUP = 1
QUICK_ROUNDS = 1
QUICK_STEPS = 3
#: Share of the remaining budget the timed rounds may plan for (the pilot's step time drifts).
BUDGET_SHARE = 0.8
#: Row key -> largest SVI/deterministic ratio that meets the target.
TARGETS = {"d64-T8": 1.5, "d64-T32": 1.2}
#: Relative change of a ratio under which the reading calls it flat.
FLAT = 0.05
#: How the reading names a row's d_model or T.
LABELS = {"d_model": "d_model {}", "seq_len": "T={}"}
#: A row's median SVI/deterministic ratio and its min and max over rounds.
RATIO_KEYS = ("ratio", "ratio_min", "ratio_max")


def row_key(d_model: int, seq_len: int) -> str:
    return f"d{d_model}-T{seq_len}"


def parse_key(key: str) -> tuple[int, int]:
    """``"d64-T32"`` -> ``(64, 32)``."""
    width, length = key.split("-")
    return int(width.removeprefix("d")), int(length.removeprefix("T"))


def row_keys(ctx: Context) -> list[str]:
    if ctx.quick:
        return list(QUICK_KEYS)
    return [row_key(d, t) for d in D_MODELS for t in SEQ_LENS]


def _steps_per_round(step_s: float, budget_s: float) -> int:
    """Steps per round so that warm-up plus ``ROUNDS`` rounds fit ``budget_s``, where
    ``step_s`` is one step of every contender."""
    rounds_and_warmup = ROUNDS + 1 / 3  # warm-up: max(5, steps // 3) <= 5 + steps / 3 steps
    return budgeted_steps(
        step_s * rounds_and_warmup,
        budget_s - warmup_steps(0) * step_s,
        max_steps=MAX_STEPS,
        min_steps=MIN_STEPS,
    )


def _round_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def run_row(key: str, ctx: Context) -> dict:
    """Time the contenders of ``build_contenders`` at the row's ``d_model`` and ``T``."""
    d_model, seq_len = parse_key(key)
    start = time.perf_counter()
    device = resolve_device(ctx.device)
    batch = make_batch(seq_len, BATCH_SIZE, device)
    pilot_step_s = None
    with pyro_scope():
        contenders = build_contenders(d_model, seq_len, batch, device)
        if ctx.quick:
            rounds, steps = QUICK_ROUNDS, QUICK_STEPS
        else:
            pilot = time_contenders(
                contenders, rounds=1, steps_per_round=1, device=device, warmup=PILOT_WARMUP
            )
            pilot_step_s = sum(timing.wall[0] for timing in pilot.values()) / 1e3
            remaining = ctx.budget_s - (time.perf_counter() - start)
            rounds, steps = ROUNDS, _steps_per_round(pilot_step_s, BUDGET_SHARE * remaining)
        times = time_contenders(contenders, rounds=rounds, steps_per_round=steps, device=device)
    wall = {name: timing.wall for name, timing in times.items()}
    cpu = {name: timing.cpu for name, timing in times.items()}
    ms_per_step = {name: statistics.median(values) for name, values in wall.items()}
    ratio = _round_ratios(wall["svi"], wall["deterministic"])
    ratio_torch = _round_ratios(wall["svi"], wall["torch"])
    return dict(
        d_model=d_model,
        seq_len=seq_len,
        batch_size=len(batch.x),
        data=batch.source,
        device=str(device),
        seed=SEED,
        ms_per_step=ms_per_step,
        ratio=statistics.median(ratio),
        ratio_min=min(ratio),
        ratio_max=max(ratio),
        ratio_torch=statistics.median(ratio_torch),
        ratio_torch_min=min(ratio_torch),
        ratio_torch_max=max(ratio_torch),
        cpu_ratio=statistics.median(_round_ratios(cpu["svi"], cpu["deterministic"])),
        rounds=rounds,
        steps_per_round=steps,
        warmup_steps=warmup_steps(steps),
        pilot_step_s=pilot_step_s,
        seconds=time.perf_counter() - start,
        round_wall_ms=wall,
        round_cpu_ms=cpu,
    )


def _grid(rows: dict[str, dict]) -> list[str]:
    lines = [
        "| d_model \\ T | " + " | ".join(str(t) for t in SEQ_LENS) + " |",
        "|---|" + "---:|" * len(SEQ_LENS),
    ]
    for d in D_MODELS:
        cells = [fmt(rows.get(row_key(d, t), {}).get("ratio"), 2) for t in SEQ_LENS]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return lines


def _with_spread(row: dict, ratio: str) -> str:
    """``"1.38 (0.88-1.66)"``: the row's ``ratio`` and its min-max over rounds."""
    return f"{row[ratio]:.2f} ({row[ratio + '_min']:.2f}-{row[ratio + '_max']:.2f})"


def _full_table(rows: dict[str, dict]) -> list[str]:
    names = list(dict.fromkeys(name for row in rows.values() for name in row["ms_per_step"]))
    header = [f"{name} ms/step" for name in names] + [
        "svi/deterministic (rounds min-max)",
        "svi/torch (min-max)",
        "CPU-time svi/deterministic",
        "rounds x steps",
        "seconds",
    ]
    lines = ["| row | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for key, row in rows.items():
        cells = [fmt(row["ms_per_step"].get(name), 1) for name in names] + [
            _with_spread(row, "ratio"),
            _with_spread(row, "ratio_torch"),
            fmt(row["cpu_ratio"], 2),
            f"{row['rounds']} x {row['steps_per_round']}",
            fmt(row["seconds"], 0),
        ]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


def _targets(rows: dict[str, dict]) -> list[str]:
    lines = []
    for key, limit in TARGETS.items():
        row = rows.get(key)
        if row is None:
            lines.append(f"- {key}: SVI/deterministic <= {limit}: row not measured.")
            continue
        verdict = "met" if row["ratio"] <= limit else "not met"
        lines.append(
            f"- {key}: SVI/deterministic <= {limit}: {_with_spread(row, 'ratio')}, **{verdict}**."
        )
    return lines


def _trend(first: float, last: float) -> str:
    change = last / first - 1
    if abs(change) < FLAT:
        return f"stays near {first:.2f} ({last:.2f})"
    return f"{'falls' if change < 0 else 'rises'} from {first:.2f} to {last:.2f}"


def _trends(rows: dict[str, dict], fixed: str, varied: str) -> list[str]:
    """For each value of ``fixed``, how the ratio changes from the smallest to the largest
    ``varied`` measured."""
    groups: dict[int, list[dict]] = {}
    for row in rows.values():
        groups.setdefault(row[fixed], []).append(row)
    lines = []
    for value, group in sorted(groups.items()):
        if len(group) > 1:
            low = min(group, key=lambda r: r[varied])
            high = max(group, key=lambda r: r[varied])
            lines.append(
                f"- {LABELS[fixed].format(value)}: from {LABELS[varied].format(low[varied])} to "
                f"{LABELS[varied].format(high[varied])} the ratio "
                f"{_trend(low['ratio'], high['ratio'])}."
            )
    return lines


def _overhead_growth(rows: dict[str, dict]) -> list[str]:
    """The absolute overhead at the cheapest and the dearest deterministic step, compared."""
    steps = {key: row["ms_per_step"] for key, row in rows.items()}
    small, large = (f(steps, key=lambda key: steps[key]["deterministic"]) for f in (min, max))
    extra = {key: steps[key]["svi"] - steps[key]["deterministic"] for key in (small, large)}
    lines = [
        f"- Absolute overhead (SVI minus deterministic ms/step): {extra[small]:.1f} ms at "
        f"{small} (cheapest deterministic step, {steps[small]['deterministic']:.1f} ms) and "
        f"{extra[large]:.1f} ms at {large} (dearest, {steps[large]['deterministic']:.1f} ms)."
    ]
    if extra[small] > 0 and extra[large] > 0:
        extra_growth = extra[large] / extra[small]
        step_growth = steps[large]["deterministic"] / steps[small]["deterministic"]
        if abs(extra_growth / step_growth - 1) < FLAT:
            relation = "about as fast as"
        else:
            relation = "more slowly than" if extra_growth < step_growth else "faster than"
        lines.append(
            f"  The overhead grows x{extra_growth:.1f} while the deterministic step grows "
            f"x{step_growth:.1f}: it grows {relation} the network's own work."
        )
    return lines


def _reading(rows: dict[str, dict]) -> list[str]:
    """Sentences on how the ratio and the absolute overhead change, from the rows."""
    lines = _trends(rows, "d_model", "seq_len") + _trends(rows, "seq_len", "d_model")
    return lines + (_overhead_growth(rows) if len(rows) > 1 else [])


def _span(values) -> str:
    """``"low to high"`` of ``values``, or the one value when they are all equal."""
    values = sorted(values)
    return str(values[0]) if values[0] == values[-1] else f"{values[0]} to {values[-1]}"


def _conditions(rows: dict[str, dict]) -> str:
    """Device and, where ``benchmarks.run`` recorded them, threads, dates and load."""
    first = next(iter(rows.values()))
    parts = [f"Device {first['device']}"]
    if "torch_threads" in first:
        parts.append(f"torch threads {first['torch_threads']} of {first['cpus']} CPUs")
    if all("measured" in row for row in rows.values()):
        parts.append(
            f"measured {_span(row['measured'] for row in rows.values())}, load average "
            f"{_span(row['load_average'] for row in rows.values())} at the rows' ends"
        )
    return "; ".join(parts) + "."


def markdown(rows: dict[str, dict], ctx: Context) -> str:
    order = [key for key in row_keys(ctx) if key in rows]
    rows = {key: rows[key] for key in order + sorted(set(rows) - set(order))}
    missing = [key for key in row_keys(ctx) if key not in rows]
    out = [
        f"SVI step time / deterministic step time of the same `SequenceClassifier` "
        f"(batch {BATCH_SIZE}, 8 features, 4 heads, 2 layers, d_ff = 2 d_model; "
        f"`benchmarks/speed.py`, timing from `benchmarks/studies/svi_overhead.py`). "
        f"Median over rounds of the per-round ratio of wall ms/step.",
        "",
    ]
    if not rows:
        return "\n".join([*out, "No rows measured yet."])
    out += [
        _conditions(rows),
        "",
        *_grid(rows),
        "",
        "Targets:",
        "",
        *_targets(rows),
        "",
        *_full_table(rows),
        "",
        "Reading:",
        "",
        *_reading(rows),
    ]
    if missing:
        out += ["", f"Rows still to measure: {', '.join(missing)}."]
    return "\n".join(out)


def plot(rows: dict[str, dict], ctx: Context) -> list[Path]:
    """SVI/deterministic ratio against T, one line per d_model, round spread as error bars."""
    if not rows:
        return []
    fig = Figure(figsize=(5.5, 4), layout="constrained")
    ax = fig.add_subplot()
    for d in D_MODELS:
        group = sorted(
            (row for row in rows.values() if row["d_model"] == d), key=lambda r: r["seq_len"]
        )
        if not group:
            continue
        lengths = [row["seq_len"] for row in group]
        ratio, low, high = (np.array([row[k] for row in group]) for k in RATIO_KEYS)
        spread = np.stack([ratio - low, high - ratio])
        ax.errorbar(lengths, ratio, yerr=spread, marker="o", capsize=3, label=f"d_model {d}")
    for key, limit in TARGETS.items():
        ax.plot(parse_key(key)[1], limit, "k_", markersize=14)
    ax.plot([], [], "k_", markersize=14, label="target (d_model 64)")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(SEQ_LENS, [str(t) for t in SEQ_LENS])
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("SVI / deterministic step time")
    ax.set_title(f"SVI step overhead ({next(iter(rows.values()))['device']})")
    ax.legend()
    path = ctx.cache(NAME).with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return [path]
