"""NUTS effective samples per second: ``fit_mcmc`` against NumPyro on the identical model.

A short, budgeted version of ``benchmarks/studies/nuts_vs_numpyro.py`` (whose functions it
calls): the
fully Bayesian ``SequenceClassifier`` (d_model 8, 2 heads, 1 layer, d_ff 16; all 780 weights
latent) on the first 100 digits training rows, sampled by NUTS three ways, one row each:

- ``pyro``: ``fit_mcmc(kernel="nuts")``, the default ``jit_compile=False``;
- ``pyro-jit``: ``fit_mcmc(kernel="nuts", jit_compile=True)``; the PyTorch JIT's tracing is
  inside its seconds (it cannot be separated);
- ``numpyro``: NumPyro's NUTS on the port of the model in ``benchmarks/_numpyro_classifier.py``;
  the time JAX spends tracing and compiling is measured apart and left out of its seconds.

Every row samples with the same settings: one chain of ``num_warmup`` + ``num_samples``
transitions (warmup = draws), at most ``max_tree_depth`` 6 doublings (63 leapfrog steps per
transition, as ``probtransformer fit --inference mcmc``; the standalone script allows 10),
step size and diagonal mass matrix adapted during warmup, target acceptance 0.8, the chain
started from a uniform(-2, 2) draw of the unconstrained space. The draws are sized once per
process for the slowest row, ``pyro``: a pilot ``fit_mcmc`` run (4 warmup + 4 draws) gives its
seconds per gradient, and the draws are the largest of ``DRAWS`` whose worst case (every
transition at the depth cap) fits ``BUDGET_SHARE`` of ``ctx.budget_s`` (at the default 300 s
and about 6 ms per gradient: 200 warmup + 200 draws, about 4 minutes for the ``pyro`` row
on the shared 2-core machine, 40-70 % of that for the others). Rows of one process
therefore share their settings; rows cached by different processes may not, and the ratios
ours / NumPyro are given only between rows whose settings match.

Before the first row of a process, ``nuts_vs_numpyro.check_log_density`` checks that the two
models give the same log joint, potential energy and gradient (relative difference at most
1e-5) at three points; the row fails otherwise. Each row then reports (``nuts_vs_numpyro.figures``)
wall and CPU seconds of warmup + sampling, gradient evaluations (leapfrog steps, warmup
included) and their rate, bulk ESS (ArviZ) of the log density and the median over the first
100 test rows of the bulk ESS of the predictive probability of the true class (functions of
the posterior that head permutations leave unchanged), ESS per second, and the test accuracy
and NLL of the posterior predictive mean as a sanity check.

Threads: torch uses what the calling process set (``benchmarks.run --threads``, default 1;
recorded in the row); XLA is limited to one thread when this module first imports JAX
(``xla_one_thread`` in the row is false when JAX was imported earlier in the process, so the
limit could not apply). Without NumPyro and JAX the ``numpyro`` row is recorded as skipped and
the log-density check is not run.

Quick mode (``--quick``, a smoke run; figures meaningless): 10 training and test rows, 10
warmup + 10 draws, tree depth 3, no pilot, and no log-density check (JAX compiles its
operations one by one there, 15-20 s; ``python -m benchmarks.studies.nuts_vs_numpyro --check`` runs
it alone). The ``pyro`` rows take about 2 s each; the ``numpyro`` row 40-55 s on the shared
2-core machine, nearly all of it NumPyro compiling its sampler.

Run::

    pip install -e ".[bench]"
    python -m benchmarks.run --only nuts
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from benchmarks._suite import Context, budgeted_steps, fmt
from benchmarks.studies.nuts_vs_numpyro import (
    MODEL,
    RTOL,
    check_log_density,
    figures,
    import_numpyro_port,
    load_data,
    run_numpyro,
    run_ours,
)
from probtransformer.models import SequenceClassifier

NAME = "nuts"
TITLE = "NUTS: `fit_mcmc` against NumPyro (ESS per second)"
BUDGET_S = 300.0

#: Row key -> how the tables name the sampler.
SAMPLERS = {
    "pyro": "`fit_mcmc`",
    "pyro-jit": "`fit_mcmc`, `jit_compile=True`",
    "numpyro": "NumPyro",
}
OURS = ("pyro", "pyro-jit")
SKIPPED = "skipped: pip install -e .[bench]"

TRAIN_ROWS = 100
TEST_ROWS = 100
NUM_CHAINS = 1
MAX_TREE_DEPTH = 6
#: Draws per chain to choose from (warmup as many): a coarse ladder, so that processes whose
#: pilots differ a little still pick the same size and their rows stay comparable.
DRAWS = (50, 75, 100, 150, 200, 300, 400)
#: Warmup transitions and draws of the pilot run.
PILOT_DRAWS = 4
#: Share of the row budget the worst case of sampling may take at the pilot's pace. The rest
#: covers the log-density check (about 20 s), predictions and ESS, and a slower pace under the
#: shared machine's load (a pilot at 5.9 ms per gradient was followed by 9.0 ms while sampling).
BUDGET_SHARE = 0.6
#: Mean leapfrog steps per draw, as a share of the depth cap, above which the reading says
#: that trajectories were cut short.
NEAR_CAP = 0.9
QUICK_SETTINGS = dict(
    train_rows=10, test_rows=10, num_chains=1, num_warmup=10, num_samples=10, max_tree_depth=3
)

#: Figures whose ratio ours / NumPyro the reading quotes.
RATIOS_READ = (
    "gradients",
    "gradients_per_second",
    "gradients_per_cpu_second",
    "ess_lp",
    "ess_lp_per_second",
    "ess_pred_median",
    "ess_pred_median_per_second",
)
#: Table rows: label, figure key, decimals, whether ours / NumPyro is meaningful.
METRICS = (
    ("wall s, warmup + sampling", "seconds", 1, True),
    ("CPU s, warmup + sampling", "cpu_seconds", 1, True),
    ("JAX compile s (not in the seconds above)", "compile_seconds", 1, False),
    ("gradient evaluations (leapfrog steps, warmup + sampling)", "gradients", 0, True),
    ("**gradient evaluations / s**", "gradients_per_second", 0, True),
    ("gradient evaluations / CPU s", "gradients_per_cpu_second", 0, True),
    ("leapfrog steps per kept draw (mean)", "steps_per_draw", 1, True),
    ("adapted step size", "step_size", 4, False),
    ("divergent transitions (kept draws)", "divergences", 0, False),
    ("bulk ESS, log density", "ess_lp", 1, True),
    ("**bulk ESS / s, log density**", "ess_lp_per_second", 3, True),
    ("bulk ESS / CPU s, log density", "ess_lp_per_cpu_second", 3, True),
    ("bulk ESS, p(true class), median over test rows", "ess_pred_median", 1, True),
    ("**bulk ESS / s, p(true class), median**", "ess_pred_median_per_second", 3, True),
    ("bulk ESS / CPU s, p(true class), median", "ess_pred_median_per_cpu_second", 3, True),
    ("test accuracy of the predictive mean", "accuracy", 2, False),
    ("test NLL of the predictive mean (nats)", "nll", 3, False),
    ("row wall s, all in (check, pilot, compiling, predictions)", "seconds_total", 0, False),
)


def row_keys(ctx: Context) -> list[str]:
    return list(SAMPLERS)


@functools.cache
def _numpyro() -> tuple[object, dict] | None:
    """The NumPyro port and the versions and XLA threading it runs with; None if not installed."""
    jax_was_imported = "jax" in sys.modules
    try:
        port = import_numpyro_port()
    except ImportError:
        return None
    import jax
    import numpyro

    return port, dict(
        jax=jax.__version__, numpyro=numpyro.__version__, xla_one_thread=not jax_was_imported
    )


@functools.cache
def _check(ctx: Context) -> dict:
    """``check_log_density`` on the rows' training data, once per process."""
    if ctx.quick:
        return dict(status="skipped in quick mode")
    numpyro = _numpyro()
    if numpyro is None:
        return dict(status="skipped: NumPyro not installed")
    train, _ = load_data(TRAIN_ROWS, TEST_ROWS, ctx.seed)
    start = time.perf_counter()
    results = check_log_density(SequenceClassifier(**MODEL), train, numpyro[0], seed=ctx.seed)
    return dict(
        status="passed",
        points=[point for point, *_ in results],
        max_rel_error=max(max(row[3:]) for row in results),
        tolerance=RTOL,
        seconds=time.perf_counter() - start,
    )


@functools.cache
def _settings(ctx: Context) -> tuple[dict, dict]:
    """``(settings, sizing)``: what every row of this process samples with, and how the draws
    were chosen (pilot of ``fit_mcmc``, the slowest row)."""
    if ctx.quick:
        return dict(QUICK_SETTINGS, seed=ctx.seed), dict(pilot="none (quick mode)")
    start = time.perf_counter()
    train, test = load_data(TRAIN_ROWS, TEST_ROWS, ctx.seed)
    pilot = run_ours(
        SequenceClassifier(**MODEL),
        train,
        test,
        num_chains=NUM_CHAINS,
        num_warmup=PILOT_DRAWS,
        num_samples=PILOT_DRAWS,
        max_tree_depth=MAX_TREE_DEPTH,
        seed=ctx.seed,
    )
    gradient_s = pilot.seconds / pilot.gradients
    worst_transition_s = gradient_s * (2**MAX_TREE_DEPTH - 1) * NUM_CHAINS
    transitions = budgeted_steps(
        worst_transition_s,
        BUDGET_SHARE * ctx.budget_s - (time.perf_counter() - start),
        max_steps=2 * DRAWS[-1],
        min_steps=2 * DRAWS[0],
    )
    draws = max(d for d in DRAWS if 2 * d <= transitions)
    settings = dict(
        train_rows=TRAIN_ROWS,
        test_rows=TEST_ROWS,
        num_chains=NUM_CHAINS,
        num_warmup=draws,
        num_samples=draws,
        max_tree_depth=MAX_TREE_DEPTH,
        seed=ctx.seed,
    )
    sizing = dict(
        pilot=f"fit_mcmc, {PILOT_DRAWS} warmup + {PILOT_DRAWS} draws",
        pilot_gradients=pilot.gradients,
        pilot_ms_per_gradient=1e3 * gradient_s,
        worst_case_seconds=2 * draws * worst_transition_s,
        budget_s=ctx.budget_s,
    )
    return settings, sizing


def _plain(values: dict) -> dict:
    """JSON values: NaN becomes None."""
    return {k: None if isinstance(v, float) and np.isnan(v) else v for k, v in values.items()}


def run_row(key: str, ctx: Context) -> dict:
    """Sample with the row's sampler; the settings are shared by every row of the process."""
    load_before = round(os.getloadavg()[0], 2)
    numpyro = _numpyro()
    if key == "numpyro" and numpyro is None:
        return dict(sampler=SAMPLERS[key], status=SKIPPED)
    check = _check(ctx)
    settings, sizing = _settings(ctx)
    train, test = load_data(settings["train_rows"], settings["test_rows"], ctx.seed)
    model = SequenceClassifier(**MODEL)
    sizes = dict(
        num_chains=settings["num_chains"],
        num_warmup=settings["num_warmup"],
        num_samples=settings["num_samples"],
        max_tree_depth=settings["max_tree_depth"],
        seed=settings["seed"],
    )
    if key == "numpyro":
        port, numpyro_info = numpyro
        cfg = port.ClassifierConfig.from_model_config(model.config)
        run = run_numpyro(port, cfg, train, test, **sizes)
    else:
        run = run_ours(model, train, test, **sizes, jit_compile=key == "pyro-jit")
        numpyro_info = {}
    return dict(
        sampler=SAMPLERS[key],
        status="ok",
        settings=settings,
        sizing=sizing,
        check=check,
        **_plain(figures(run, test)),
        **numpyro_info,
        load_average_before=load_before,
    )


# --- tables -------------------------------------------------------------------------------------


def _describe(settings: dict) -> str:
    return (
        f"{settings['num_chains']} chain of {settings['num_warmup']} warmup + "
        f"{settings['num_samples']} draws, max tree depth {settings['max_tree_depth']} (at most "
        f"{2 ** settings['max_tree_depth'] - 1} leapfrog steps per transition), first "
        f"{settings['train_rows']} digits training rows, first {settings['test_rows']} test "
        f"rows, seed {settings['seed']}"
    )


def _comparable(rows: dict[str, dict]) -> list[str]:
    """Our rows whose settings match the NumPyro row's."""
    theirs = rows.get("numpyro", {})
    if theirs.get("status") != "ok":
        return []
    return [
        key
        for key in OURS
        if rows.get(key, {}).get("status") == "ok" and rows[key]["settings"] == theirs["settings"]
    ]


def _cell(row: dict, key: str, digits: int) -> str:
    if row.get("status") != "ok":
        return ""
    if key == "compile_seconds" and row[key] is None:
        return "in wall s"
    return fmt(row.get(key), digits)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else ""


def _table(rows: dict[str, dict], keys: list[str], comparable: list[str]) -> list[str]:
    header = [SAMPLERS[k] for k in keys] + [f"{SAMPLERS[k]} / NumPyro" for k in comparable]
    lines = ["| | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    statuses = [rows[k]["status"] for k in keys] + [""] * len(comparable)
    lines.append("| status | " + " | ".join(statuses) + " |")
    for label, metric, digits, has_ratio in METRICS:
        cells = [_cell(rows[k], metric, digits) for k in keys]
        cells += [
            _ratio(rows[k][metric], rows["numpyro"][metric]) if has_ratio else ""
            for k in comparable
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _settings_lines(rows: dict[str, dict], ok: list[str]) -> list[str]:
    if all(rows[k]["settings"] == rows[ok[0]]["settings"] for k in ok):
        first = rows[ok[0]]
        sizing = first["sizing"]
        sized = (
            f"; sized from a pilot of {sizing['pilot_ms_per_gradient']:.1f} ms per gradient "
            f"({sizing['pilot']}) for a worst case of {sizing['worst_case_seconds']:.0f} s of "
            f"sampling within the {sizing['budget_s']:.0f} s row budget"
            if "pilot_ms_per_gradient" in sizing
            else ""
        )
        return [f"Settings of every row: {_describe(first['settings'])}{sized}."]
    lines = ["The rows ran with different settings (cached by different processes):", ""]
    lines += [f"- {SAMPLERS[k]}: {_describe(rows[k]['settings'])}." for k in ok]
    return lines


def _check_line(rows: dict[str, dict], ok: list[str]) -> str:
    checks = [rows[k]["check"] for k in ok]
    passed = [c for c in checks if c["status"] == "passed"]
    if passed:
        worst = max(c["max_rel_error"] for c in passed)
        return (
            f"Log-density check (`nuts_vs_numpyro.check_log_density`: log joint, potential and "
            f"gradient at {len(passed[0]['points'])} points): passed, largest relative difference "
            f"{worst:.1e} (tolerance {passed[0]['tolerance']:.0e})."
        )
    return "Log-density check: " + "; ".join(sorted({c["status"] for c in checks})) + "."


def _conditions(rows: dict[str, dict], ok: list[str]) -> str:
    parts = []
    for k in ok:
        row = rows[k]
        part = f"{SAMPLERS[k]} {row.get('measured', 'unrecorded time')}, load average "
        part += f"{row['load_average_before']} before"
        if "load_average" in row:
            part += f" and {row['load_average']} after"
        if "torch_threads" in row and k in OURS:
            part += f", {row['torch_threads']} torch thread(s)"
        if k == "numpyro":
            threads = "1 XLA thread" if row["xla_one_thread"] else "XLA threads not limited"
            part += f", jax {row['jax']}, numpyro {row['numpyro']}, {threads}"
        parts.append(part)
    return "Measured: " + "; ".join(parts) + "."


def _no_ratio_reason(rows: dict[str, dict]) -> str:
    theirs = rows.get("numpyro")
    if theirs is None:
        return "no NumPyro row yet (`python -m benchmarks.run --only nuts/numpyro`)."
    if theirs["status"] != "ok":
        return f"the NumPyro row was {theirs['status']}."
    if not any(rows.get(k, {}).get("status") == "ok" for k in OURS):
        return "no row of ours yet (`python -m benchmarks.run --only nuts`)."
    return (
        "our rows and NumPyro's ran with different settings; "
        "`python -m benchmarks.run --only nuts --force` measures all three in one process."
    )


def _reading(rows: dict[str, dict], comparable: list[str]) -> list[str]:
    theirs = rows.get("numpyro")
    lines = []
    for key in comparable:
        ours = rows[key]
        ratio = {metric: ours[metric] / theirs[metric] for metric in RATIOS_READ}
        lines.append(
            f"- {SAMPLERS[key]} evaluates {ratio['gradients_per_second']:.2f}x as many "
            f"gradients per second as NumPyro ({1e3 / ours['gradients_per_second']:.2f} against "
            f"{1e3 / theirs['gradients_per_second']:.2f} ms each; "
            f"{ratio['gradients_per_cpu_second']:.2f}x per CPU second) and reaches "
            f"{ratio['ess_lp_per_second']:.2f}x its bulk ESS per second on the log density, "
            f"{ratio['ess_pred_median_per_second']:.2f}x on p(true class) (median over test "
            f"rows). Its ESS per gradient is {ratio['ess_lp'] / ratio['gradients']:.2f}x "
            f"NumPyro's on the log density and {ratio['ess_pred_median'] / ratio['gradients']:.2f}"
            "x on p(true class): both run the same algorithm on the same density, so these "
            "depart from 1 by the chance of one short chain each, which the ESS-per-second "
            "ratios carry too; the gradient rates are the steadier figures."
        )
    if comparable and theirs["compile_seconds"]:
        with_compile = theirs["ess_lp"] / (theirs["seconds"] + theirs["compile_seconds"])
        ratios = ", ".join(
            f"{SAMPLERS[k]} {rows[k]['ess_lp_per_second'] / with_compile:.2f}x" for k in comparable
        )
        lines.append(
            f"- NumPyro compiled for {theirs['compile_seconds']:.1f} s before sampling (not in "
            f"its seconds); counted in, ESS per second on the log density is {ratios} NumPyro's."
        )
    ok = [row for row in rows.values() if row["status"] == "ok"]
    if not ok:
        return lines
    shares = ", ".join(f"{row['sampler']} {row['cpu_seconds'] / row['seconds']:.2f}" for row in ok)
    lines.append(
        f"- CPU s / wall s of sampling: {shares}. Below 1 the process waited for a core (the "
        "machine is shared); rows measured at different loads compare better per CPU second."
    )
    caps = {row["sampler"]: 2 ** row["settings"]["max_tree_depth"] - 1 for row in ok}
    steps = ", ".join(
        f"{row['sampler']} {row['steps_per_draw']:.0f} of at most {caps[row['sampler']]}"
        for row in ok
    )
    line = f"- Leapfrog steps per kept draw: {steps}."
    if any(row["steps_per_draw"] >= NEAR_CAP * caps[row["sampler"]] for row in ok):
        line += (
            " Near the cap trajectories end before they turn back (this posterior takes about "
            "500 steps per draw at depth 10), so ESS per draw is lower than in the standalone "
            "run, for every sampler alike."
        )
    return [*lines, line]


def markdown(rows: dict[str, dict], ctx: Context) -> str:
    keys = [k for k in SAMPLERS if k in rows]
    missing = [k for k in SAMPLERS if k not in rows]
    out = [
        "NUTS on the fully Bayesian `SequenceClassifier` (d_model 8, 2 heads, 1 layer, d_ff 16: "
        "780 latent weights), `fit_mcmc` against NumPyro's NUTS on an identical port "
        "(`benchmarks/nuts.py`, functions of `benchmarks/studies/nuts_vs_numpyro.py`). Seconds are "
        "warmup + sampling; bulk ESS from ArviZ.",
        "",
    ]
    if ctx.quick:
        out += ["Quick run: smoke-test sizes, the figures mean nothing.", ""]
    if not keys:
        return "\n".join([*out, "No rows measured yet."])
    comparable = _comparable(rows)
    ok = [k for k in keys if rows[k]["status"] == "ok"]
    if ok:
        out += [*_settings_lines(rows, ok), "", _check_line(rows, ok), ""]
        out += [_conditions(rows, ok), ""]
    out += [*_table(rows, keys, comparable), ""]
    if not comparable:
        out += [f"No ratios ours / NumPyro: {_no_ratio_reason(rows)}", ""]
    reading = _reading(rows, comparable)
    if reading:
        out += ["Reading:", "", *reading, ""]
    if missing:
        out += [f"Not measured yet: {', '.join(missing)}.", ""]
    out.append(
        "The standalone comparison at full length (2 chains x (100 warmup + 100 draws), max "
        "tree depth 10, about 40 minutes: `python -m benchmarks.studies.nuts_vs_numpyro`) is in "
        "the "
        'section "HMC / NUTS" of `benchmarks/BENCHMARKS.md`.'
    )
    return "\n".join(out)


def plot(rows: dict[str, dict], ctx: Context) -> list[Path]:
    """Bulk ESS per second of each sampler, log density and median p(true class), log scale."""
    ok = {k: rows[k] for k in SAMPLERS if rows.get(k, {}).get("status") == "ok"}
    if not ok:
        return []
    fig = Figure(figsize=(5.5, 3.5), layout="constrained")
    ax = fig.add_subplot()
    positions = np.arange(len(ok))
    for offset, (metric, label) in zip(
        (-0.2, 0.2),
        (
            ("ess_lp_per_second", "log density"),
            ("ess_pred_median_per_second", "p(true class), median"),
        ),
        strict=True,
    ):
        ax.bar(positions + offset, [row[metric] for row in ok.values()], 0.4, label=label)
    ax.set_xticks(positions, [k for k in ok])
    ax.set_yscale("log")
    ax.set_ylabel("bulk ESS / s")
    settings = next(iter(ok.values()))["settings"]
    ax.set_title(
        f"NUTS, {settings['num_warmup']} + {settings['num_samples']} transitions, "
        f"depth <= {settings['max_tree_depth']}"
    )
    ax.legend()
    path = ctx.cache(NAME).with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return [path]
