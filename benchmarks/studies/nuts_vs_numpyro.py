"""NUTS in ``fit_mcmc`` (Pyro) against NumPyro's NUTS on the same Bayesian Transformer.

The sampler users would pick instead: the same fully Bayesian ``SequenceClassifier`` (d_model 8,
2 heads, 1 layer, d_ff 16; every part latent: 780 weights) written once more for NumPyro
(``benchmarks/_numpyro_classifier.py``: same sites, priors, architecture and likelihood), on the
first 100 digits training rows. Before sampling, ``check_log_density`` evaluates the two log
joint densities, the two potential energies the samplers move on (unconstrained space, Jacobians
included) and their gradients at the same points (a prior draw of the Pyro model and an
``init_to_uniform`` draw, the samplers' starting law; also with padding masks) and stops unless
they agree to 1e-5 relative: both samplers target the same function.

Both run NUTS with the same settings: diagonal mass matrix and step size adapted during
``--num-warmup`` (Stan's windows), target acceptance 0.8, at most ``--max-tree-depth`` (10)
doublings, chains started from uniform draws in (-2, 2) of the unconstrained space, chains one
after another (NumPyro ``chain_method="sequential"``; ``fit_mcmc`` runs them in-process when the
machine has no more cores than chains), one CPU thread each (``torch.set_num_threads(1)``; XLA
without its multi-threaded Eigen and with one intra-op thread), in one process.

Measured, for each:

- wall seconds of warmup + sampling: ``fit_mcmc`` end to end (nothing is compiled: the default
  ``jit_compile=False``); NumPyro's ``MCMC.run`` less the time JAX spent tracing, lowering and
  compiling (``jax.monitoring`` time spans, overlaps counted once), which is reported apart
  (with ``chain_method="sequential"`` NumPyro compiles its sampling loop again for each chain);
- gradient evaluations (leapfrog steps of warmup and sampling) per second;
- bulk ESS (ArviZ, rank-normalised split R-hat's ESS) of the log density (``lp``: minus the
  potential energy of each kept draw), and of the test predictive probability of the true class
  for each of the first 100 test rows (min and median over rows): functions of the posterior
  that head permutations and sign flips leave unchanged. Per-weight ESS is misleading here (the
  posterior is symmetric under swapping heads and hidden units, so a weight's chain can mix
  across modes or stay in one); its minimum over the 780 weights is given for reference;
- ESS per second and the ratio ours / NumPyro (> 1: ``fit_mcmc`` gives more effective draws per
  second).

Reproduce (about 30 minutes of one CPU core, 26 of them in ``fit_mcmc``; ``--quick``, a smoke
run of 10 warmup and 10 kept draws per chain, about a minute)::

    pip install -e ".[bench]"
    python -m benchmarks.studies.nuts_vs_numpyro

The table is printed and written to ``benchmarks/results/nuts_vs_numpyro.md``.
``--check`` only runs the log-density check; ``--jit-compile`` gives ``fit_mcmc`` the PyTorch
JIT (its tracing time then counts in its seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import os
import platform
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import arviz as az
import numpy as np
import pyro
import pyro.ops.integrator
import torch
from pyro import poutine
from pyro.infer.autoguide.initialization import InitMessenger, init_to_uniform
from pyro.infer.mcmc.util import initialize_model

from benchmarks._pyro_gradients import count_gradients
from probtransformer.datasets import SequenceData, load
from probtransformer.inference import NUTS, fit_mcmc
from probtransformer.models import SequenceClassifier

#: The classifier under test: small enough for NUTS on 2 cores, every part latent.
MODEL = dict(
    in_features=8,
    num_classes=10,
    max_len=8,
    d_model=8,
    num_heads=2,
    num_layers=1,
    d_ff=16,
    dropout=0.0,
    bayesian=("embedding", "attention", "ffn", "norm", "head"),
)
#: Agreement required of the two log densities and of their gradients (relative, in norm). The
#: port agrees to about 1e-7 in float32; a tanh instead of an erf GELU already differs by 1e-4 in
#: the gradient (1e-6 in the log density).
RTOL = 1e-5
RESULTS = Path(__file__).parents[1] / "results" / "nuts_vs_numpyro.md"
_XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def import_numpyro_port():
    """Limit XLA to one thread, then import JAX, NumPyro and the port (benchmark extra only)."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_XLA_ONE_THREAD}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        from benchmarks import _numpyro_classifier
    except ImportError as e:
        raise ImportError('this benchmark needs NumPyro and JAX: pip install -e ".[bench]"') from e
    return _numpyro_classifier


@dataclass
class Run:
    """What one sampler produced: draws, per-draw statistics, timings (seconds)."""

    samples: dict[str, np.ndarray]  # {site: (chain, draw, *shape)}, constrained space
    lp: np.ndarray  # (chain, draw) minus the potential energy
    n_steps: np.ndarray  # (chain, draw) leapfrog steps of each kept draw
    diverging: np.ndarray  # (chain, draw) bool
    step_size: float  # adapted step size, mean over chains
    gradients: int | None  # leapfrog steps of warmup + sampling (None: not observed)
    seconds: float  # wall clock of warmup + sampling, JAX's compiling taken out
    cpu_seconds: float  # CPU time of the process in the same phases
    compile_seconds: float  # JAX's compile time (wall) outside ``seconds``; NaN: inside
    probs: np.ndarray  # (chain, draw, N_test, C) test predictive probabilities


def load_data(train_rows: int, test_rows: int, seed: int) -> tuple[SequenceData, SequenceData]:
    """The first ``train_rows`` training and ``test_rows`` test rows of the digits split."""
    splits = load("digits", seed=seed)
    return splits.train[:train_rows], splits.test[:test_rows]


# --- the two log densities are one function ----------------------------------------------------


def _pyro_potential(model: SequenceClassifier, data: SequenceData):
    """``(potential_fn, transforms)`` of ``model`` as Pyro's HMC kernels build them."""
    _, potential_fn, transforms, _ = initialize_model(
        model, model_args=(data.x, data.y, data.mask), init_strategy=init_to_uniform
    )
    return potential_fn, transforms


def _test_points(model: SequenceClassifier, data: SequenceData, seed: int) -> dict[str, dict]:
    """Constrained parameter values: a prior draw, and a draw of the samplers' initial law."""
    pyro.set_rng_seed(seed)
    points = {}
    for label, traced in (
        ("prior draw", model),
        ("uniform(-2, 2) unconstrained draw", InitMessenger(init_to_uniform)(model)),
    ):
        trace = poutine.trace(traced).get_trace(data.x, data.y, data.mask)
        points[label] = {
            name: site["value"].detach()
            for name, site in trace.nodes.items()
            if site["type"] == "sample" and not site["is_observed"] and name != "data"
        }
    return points


def check_log_density(model: SequenceClassifier, data: SequenceData, port, *, seed: int = 0):
    """Evaluate both models' log densities and gradients at the same points; raise if they differ.

    Compares, at each point of ``_test_points`` (and once more at the prior draw with padding
    masks: row ``i`` keeps its first ``1 + i % T`` steps): the log joint ``log p(theta, y | x)``
    in the constrained space (Pyro trace vs ``numpyro.infer.util.log_density``), the potential
    energy in the unconstrained space (Pyro's ``initialize_model`` vs
    ``numpyro.infer.util.potential_energy``) and its gradient (relative error in norm).

    Returns:
        Rows ``(point, log joint ours, log joint NumPyro, rel. error, potential rel. error,
        gradient rel. error)``.

    Raises:
        AssertionError: a relative error above ``RTOL``.
    """
    model = model.eval()
    cfg = port.ClassifierConfig.from_model_config(model.config)
    points = _test_points(model, data, seed)
    N, T = data.x.shape[:2]
    mask = torch.arange(T)[None, :] < 1 + torch.arange(N)[:, None] % T  # (N, T)
    cases = [(label, point, data) for label, point in points.items()]
    cases.append(
        ("prior draw, padding masks", points["prior draw"], SequenceData(data.x, data.y, mask))
    )
    rows = []
    for label, point, case_data in cases:
        row = (label, *_compare_densities(model, port.model, cfg, case_data, point))
        rows.append(row)
        assert max(row[3:]) <= RTOL, f"log densities differ at the {label}: {row}"
    return rows


def _compare_densities(model, numpyro_model, cfg, data: SequenceData, point: dict):
    """``(log joint ours, NumPyro, rel. error, potential rel. error, gradient rel. error)``."""
    import jax
    import jax.numpy as jnp
    from numpyro.infer.util import log_density, potential_energy, unconstrain_fn

    args = (data.x, data.y, data.mask)
    nargs = tuple(None if a is None else jnp.asarray(a.numpy()) for a in args)
    nmodel = functools.partial(numpyro_model, cfg)
    ours = float(
        poutine.trace(poutine.condition(model, data=point)).get_trace(*args).log_prob_sum()
    )
    values = {k: jnp.asarray(v.numpy()) for k, v in point.items()}
    theirs = float(log_density(nmodel, nargs, {}, values)[0])
    potential_fn, transforms = _pyro_potential(model, data)
    z = {k: transforms[k](v) if k in transforms else v for k, v in point.items()}
    grads, pe = pyro.ops.integrator.potential_grad(potential_fn, z)
    unconstrained = unconstrain_fn(nmodel, nargs, {}, values)
    pe_np, grads_np = jax.value_and_grad(lambda u: potential_energy(nmodel, nargs, {}, u))(
        unconstrained
    )
    assert set(grads) == set(grads_np), (sorted(grads), sorted(grads_np))
    ours_g = np.concatenate([grads[k].numpy().ravel() for k in sorted(grads)])
    theirs_g = np.concatenate([np.asarray(grads_np[k]).ravel() for k in sorted(grads)])
    return (
        ours,
        theirs,
        abs(ours - theirs) / abs(theirs),
        abs(float(pe) - float(pe_np)) / abs(float(pe_np)),
        float(np.linalg.norm(ours_g - theirs_g) / np.linalg.norm(theirs_g)),
    )


# --- the two samplers ---------------------------------------------------------------------------


def run_ours(
    model,
    train,
    test,
    *,
    num_chains,
    num_warmup,
    num_samples,
    max_tree_depth,
    seed,
    jit_compile=False,
) -> Run:
    """``fit_mcmc(kernel="nuts")`` on CPU; test probabilities from ``Posterior.predict``.

    With ``jit_compile`` the PyTorch JIT's tracing is part of ``seconds`` (not separable).
    """
    with count_gradients() as count:
        start, start_cpu = time.perf_counter(), time.process_time()
        post = fit_mcmc(
            model,
            train,
            kernel=NUTS(max_tree_depth=max_tree_depth, jit_compile=jit_compile),
            num_chains=num_chains,
            num_warmup=num_warmup,
            num_samples=num_samples,
            device="cpu",
            seed=seed,
            progress=False,
        )
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    stats = post.record["sample_stats"]
    pred = post.predict(test.x, test.mask, num_samples=num_chains * num_samples, seed=seed)
    return Run(
        samples={k: v.numpy() for k, v in post.samples.items()},
        lp=np.asarray(stats["lp"], dtype=np.float64),
        n_steps=np.asarray(stats["n_steps"]),
        diverging=np.asarray(stats["diverging"], dtype=bool),
        step_size=float(np.mean(np.asarray(stats["step_size"])[:, -1])),
        gradients=None if post.record["parallel"] else count[0],
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        compile_seconds=np.nan if jit_compile else 0.0,  # the JIT's tracing is in ``seconds``
        probs=pred.probs.numpy().reshape(num_chains, num_samples, *pred.probs.shape[1:]),
    )


@dataclass
class _Spans:
    """``(start, end)`` intervals of one clock; ``seconds`` counts overlaps once."""

    intervals: list[tuple[float, float]]

    @property
    def seconds(self) -> float:
        total, reach = 0.0, -np.inf
        for start, end in sorted(self.intervals):
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total


@contextlib.contextmanager
def _jax_compile_spans() -> Iterator[tuple[_Spans, _Spans]]:
    """Wall-clock and process-CPU intervals of JAX's tracing, lowering and XLA compiling.

    JAX reports each such event's start (a scalar event) and its wall-clock span at the end
    (``jax.monitoring``); events nest (a jitted function traced inside another), so the CPU
    clock's start times are kept on a stack.
    """
    import jax.monitoring

    wall, cpu, cpu_starts = _Spans([]), _Spans([]), []

    def compiling(event: str) -> bool:
        return event.startswith("/jax/core/compile/")

    def on_start(event: str, value: float, **kwargs) -> None:
        if compiling(event):
            cpu_starts.append(time.process_time())

    def on_end(event: str, start: float, end: float, **kwargs) -> None:
        if compiling(event):
            wall.intervals.append((start, end))
            cpu.intervals.append((cpu_starts.pop(), time.process_time()))

    jax.monitoring.register_scalar_listener(on_start)
    jax.monitoring.register_event_time_span_listener(on_end)
    try:
        yield wall, cpu
    finally:
        jax.monitoring.unregister_scalar_listener(on_start)
        jax.monitoring.unregister_event_time_span_listener(on_end)


def run_numpyro(
    port,
    cfg,
    train,
    test,
    *,
    num_chains,
    num_warmup,
    num_samples,
    max_tree_depth,
    seed,
    chain_method="sequential",
) -> Run:
    """NumPyro NUTS, chains in sequence (or ``chain_method="vectorized"``: all chains in one
    ``vmap``); JAX's compile time is measured and taken out."""
    import jax
    import jax.numpy as jnp
    from numpyro.infer import MCMC, NUTS, init_to_uniform

    kernel = NUTS(
        functools.partial(port.model, cfg),
        step_size=1.0,
        adapt_step_size=True,
        adapt_mass_matrix=True,
        dense_mass=False,
        target_accept_prob=0.8,
        max_tree_depth=max_tree_depth,
        init_strategy=init_to_uniform(radius=2.0),
    )
    mcmc = MCMC(
        kernel,
        num_warmup=num_warmup,
        num_samples=num_samples,
        num_chains=num_chains,
        chain_method=chain_method,
        progress_bar=False,
    )
    x, y = jnp.asarray(train.x.numpy()), jnp.asarray(train.y.numpy())
    fields = ("num_steps", "potential_energy", "diverging", "adapt_state.step_size")
    # Keep the warmup transitions too (for their leapfrog steps), as ``MCMC.warmup(...,
    # collect_warmup=True)`` does, but in one ``run``: one compiled loop per chain, as users get.
    mcmc._set_collection_params(0, num_warmup + num_samples, num_warmup + num_samples)
    with _jax_compile_spans() as (compile_wall, compile_cpu):
        start, start_cpu = time.time(), time.process_time()
        mcmc.run(jax.random.PRNGKey(seed), x, y, extra_fields=fields)
        jax.block_until_ready(mcmc.get_samples())
        seconds, cpu_seconds = time.time() - start, time.process_time() - start_cpu
    kept = slice(num_warmup, None)
    extra = {
        k: np.asarray(v)[:, kept] for k, v in mcmc.get_extra_fields(group_by_chain=True).items()
    }
    samples = {k: np.asarray(v)[:, kept] for k, v in mcmc.get_samples(group_by_chain=True).items()}
    num_steps = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["num_steps"])
    return Run(
        samples=samples,
        lp=-extra["potential_energy"].astype(np.float64),
        n_steps=extra["num_steps"],
        diverging=extra["diverging"].astype(bool),
        step_size=float(extra["adapt_state.step_size"][:, -1].mean()),
        gradients=int(num_steps.sum()),
        seconds=seconds - compile_wall.seconds,
        cpu_seconds=cpu_seconds - compile_cpu.seconds,
        compile_seconds=compile_wall.seconds,
        probs=port.predictive_probs(cfg, samples, test.x.numpy()),
    )


# --- figures ------------------------------------------------------------------------------------


def _bulk_ess(values: np.ndarray) -> np.ndarray:
    """Bulk ESS of ``(chain, draw, *shape)`` per element, ``shape`` kept (NaN: constant)."""
    dataset = az.convert_to_dataset({"v": values})
    return az.ess(dataset, method="bulk")["v"].values


def figures(run: Run, test: SequenceData) -> dict[str, float]:
    """ESS, ESS per second and sanity figures of one run."""
    truth = test.y.numpy()
    p_true = np.take_along_axis(run.probs, truth[None, None, :, None], axis=-1)[..., 0]
    ess_pred = _bulk_ess(p_true)  # (N_test,)
    ess_weights = np.concatenate([_bulk_ess(v).ravel() for v in run.samples.values()])
    mean = run.probs.mean((0, 1))  # (N_test, C)
    out = dict(
        seconds=run.seconds,
        cpu_seconds=run.cpu_seconds,
        compile_seconds=run.compile_seconds,
        gradients=np.nan if run.gradients is None else run.gradients,
        steps_per_draw=float(run.n_steps.mean()),
        divergences=int(run.diverging.sum()),
        step_size=run.step_size,
        ess_lp=float(_bulk_ess(run.lp)),
        rhat_lp=float(az.rhat(run.lp)) if run.lp.shape[0] > 1 else np.nan,
        ess_pred_min=float(np.nanmin(ess_pred)),
        ess_pred_median=float(np.nanmedian(ess_pred)),
        ess_weight_min=float(np.nanmin(ess_weights)),
        num_weights=ess_weights.size,
        accuracy=float((mean.argmax(-1) == truth).mean()),
        nll=float(-np.log(mean[np.arange(len(truth)), truth]).mean()),
    )
    for key in ("gradients", "ess_lp", "ess_pred_min", "ess_pred_median", "ess_weight_min"):
        out[f"{key}_per_second"] = out[key] / run.seconds
        out[f"{key}_per_cpu_second"] = out[key] / run.cpu_seconds
    return out


def format_table(
    ours: dict, theirs: dict, check_rows: list, settings: str, *, ours_label: str
) -> str:
    """The markdown table (ratio column: ours / NumPyro) with settings and the check result."""
    rows = [
        ("wall seconds, warmup + sampling", "seconds", "{:.1f}"),
        ("CPU seconds, warmup + sampling", "cpu_seconds", "{:.1f}"),
        (
            "JIT compile wall seconds (not in the rows above; n/a: in them)",
            "compile_seconds",
            "{:.1f}",
        ),
        ("gradient evaluations (leapfrog steps, warmup + sampling)", "gradients", "{:.0f}"),
        ("gradient evaluations / s", "gradients_per_second", "{:.0f}"),
        ("gradient evaluations / CPU s", "gradients_per_cpu_second", "{:.0f}"),
        ("leapfrog steps per kept draw (mean)", "steps_per_draw", "{:.1f}"),
        ("adapted step size (mean over chains)", "step_size", "{:.3g}"),
        ("divergent transitions (kept draws)", "divergences", "{:d}"),
        ("bulk ESS, log density", "ess_lp", "{:.0f}"),
        ("**bulk ESS / s, log density**", "ess_lp_per_second", "{:.2f}"),
        ("bulk ESS / CPU s, log density", "ess_lp_per_cpu_second", "{:.2f}"),
        ("split R-hat, log density", "rhat_lp", "{:.3f}"),
        ("bulk ESS, p(true class), min over test rows", "ess_pred_min", "{:.0f}"),
        ("bulk ESS, p(true class), median over test rows", "ess_pred_median", "{:.0f}"),
        ("**bulk ESS / s, p(true class), min**", "ess_pred_min_per_second", "{:.2f}"),
        ("**bulk ESS / s, p(true class), median**", "ess_pred_median_per_second", "{:.2f}"),
        ("bulk ESS / CPU s, p(true class), median", "ess_pred_median_per_cpu_second", "{:.2f}"),
        (f"bulk ESS, per-weight min ({ours['num_weights']} weights)", "ess_weight_min", "{:.1f}"),
        ("bulk ESS / s, per-weight min", "ess_weight_min_per_second", "{:.3f}"),
        ("test accuracy of the posterior predictive mean", "accuracy", "{:.2f}"),
        ("test NLL of the posterior predictive mean (nats)", "nll", "{:.3f}"),
    ]
    no_ratio = {"compile_seconds", "divergences", "rhat_lp", "accuracy", "nll", "step_size"}
    lines = [
        f"| | ours ({ours_label}) | NumPyro NUTS | ours / NumPyro |",
        "|---|---:|---:|---:|",
    ]
    for label, key, fmt in rows:
        a, b = ours[key], theirs[key]
        cells = [_fmt(fmt, a), _fmt(fmt, b)]
        ratio = "" if key in no_ratio or not (b and np.isfinite(a)) else f"{a / b:.2f}"
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")
    total = (
        ours["ess_lp"] / ours["seconds"],
        theirs["ess_lp"] / (theirs["seconds"] + theirs["compile_seconds"]),
    )
    check = "; ".join(
        f"{label}: log joint {a:.2f} vs {b:.2f} (rel. {r:.1e}), potential rel. {p:.1e}, "
        f"gradient rel. {g:.1e}"
        for label, a, b, r, p, g in check_rows
    )
    return "\n".join(
        [
            settings,
            "",
            *lines,
            "",
            f"Counting NumPyro's compile time too, ours / NumPyro in ESS/s of the log density is "
            f"{total[0] / total[1]:.2f}.",
            "",
            f"Log-density check (same parameters, both models): {check}.",
        ]
    )


def _fmt(fmt: str, value) -> str:
    if isinstance(value, float) and not np.isfinite(value):
        return "n/a"
    return fmt.format(int(value) if fmt == "{:d}" else value)


# --- entry point --------------------------------------------------------------------------------


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.nuts_vs_numpyro", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--num-chains", type=int, default=2)
    parser.add_argument("--num-warmup", type=int, default=100)
    parser.add_argument("--num-samples", type=int, default=100)
    parser.add_argument("--train-rows", type=int, default=100)
    parser.add_argument("--test-rows", type=int, default=100)
    parser.add_argument("--max-tree-depth", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--jit-compile", action="store_true", help="fit_mcmc(jit_compile=True) for ours"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 10 warmup, 10 draws, tree depth <= 5"
    )
    parser.add_argument("--check", action="store_true", help="only the log-density check")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_warmup, args.num_samples, args.max_tree_depth = 10, 10, 5
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """Check the densities, run both samplers, print and write the table; return the figures."""
    args = _parse(argv)
    port = import_numpyro_port()
    import jax
    import numpyro

    torch.set_num_threads(1)
    train, test = load_data(args.train_rows, args.test_rows, args.seed)
    model = SequenceClassifier(**MODEL)
    check_rows = check_log_density(model, train, port, seed=args.seed)
    for row in check_rows:
        print(
            f"log-density check, {row[0]}: log joint ours {row[1]:.4f}, NumPyro {row[2]:.4f}; "
            f"rel. errors: log joint {row[3]:.1e}, potential {row[4]:.1e}, "
            f"gradient {row[5]:.1e}"
        )
    if args.check:
        return {}
    sizes = dict(
        num_chains=args.num_chains,
        num_warmup=args.num_warmup,
        num_samples=args.num_samples,
        max_tree_depth=args.max_tree_depth,
        seed=args.seed,
    )
    cfg = port.ClassifierConfig.from_model_config(model.config)
    load_before = os.getloadavg()[0]
    print(f"ours (fit_mcmc): {sizes} ...", flush=True)
    run = run_ours(model, train, test, **sizes, jit_compile=args.jit_compile)
    # Posterior.predict keeps the (chain, draw) order and computes what the port computes:
    assert np.allclose(
        port.predictive_probs(cfg, run.samples, test.x.numpy()), run.probs, atol=1e-4
    )
    if run.gradients is None:
        print(
            "warning: fit_mcmc ran the chains in parallel processes (this machine has more cores "
            "than chains): its wall time is not comparable with NumPyro's sequential chains"
        )
    ours = figures(run, test)
    print(f"  {run.seconds:.1f} s; NumPyro: {sizes} ...", flush=True)
    theirs = figures(run_numpyro(port, cfg, train, test, **sizes), test)
    print(f"  {theirs['seconds'] + theirs['compile_seconds']:.1f} s", flush=True)
    load_after = os.getloadavg()[0]
    flags = " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in vars(args).items()
        if k in sizes or k in ("train_rows", "test_rows")
    ) + (" --jit-compile" if args.jit_compile else "")
    settings = (
        f"`python -m benchmarks.studies.nuts_vs_numpyro {flags}` — "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPU cores, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, pyro {pyro.__version__}, jax {jax.__version__}, "
        f"numpyro {numpyro.__version__}, one thread each, 1-minute load average "
        f"{load_before:.1f} before and {load_after:.1f} after; digits, {len(train)} training rows, "
        f"{len(test)} test rows; SequenceClassifier d_model 8, 2 heads, 1 layer, d_ff 16, fully "
        "Bayesian."
    )
    ours_label = "`fit_mcmc`, Pyro NUTS" + (", `jit_compile=True`" if args.jit_compile else "")
    table = format_table(ours, theirs, check_rows, settings, ours_label=ours_label)
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table + "\n")
    print(f"written to {args.output}")
    return {"ours": ours, "numpyro": theirs}


if __name__ == "__main__":
    main()
