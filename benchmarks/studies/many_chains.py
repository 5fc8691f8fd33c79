"""Many-chain ChEES-HMC against NumPyro's NUTS on the 780-latent classifier, and the cost of a
chain-gradient against K.

Two parts, each in one process:

- ``chain_gradients(device, ks)``: chain-gradients per second of ``VectorizedDensity`` (log
  density and gradient of K chains in one call) for each K, against Pyro's ``potential_fn``
  (one chain, the gradient ``fit_mcmc(kernel=NUTS())`` pays) on the same model and rows.
  ``benchmarks.studies.gpu_check`` prints it for CUDA and CPU.
- ``compare``: the sampler rows, on the fully Bayesian ``SequenceClassifier`` of the NUTS
  benchmark (d_model 8, 2 heads, 1 layer, d_ff 16: 780 latents), first 100 digits training rows,
  first 100 test rows, one CPU thread:
  - NumPyro NUTS, one chain (``chain_method="sequential"``; compile time taken out);
  - NumPyro NUTS, K chains, ``chain_method="vectorized"`` (compile time taken out);
  - ``fit_mcmc(kernel=ChEES())``, K chains from M ensemble starts; its seconds count the
    starts (batched MAP fits) and the warm-up.

  Figures per row: chain-gradients (leapfrog steps of every chain, warm-up included) per
  second; pooled bulk ESS (ArviZ, all chains) of ``lp`` and of the test predictive probability of
  the true class (median over rows), and per second; nested R-hat of ``lp`` when there are
  superchains; test accuracy and NLL of the predictive mean.

Reproduce::

    pip install -e ".[bench]"
    python -m benchmarks.studies.many_chains            # about 10 minutes of one core
    python -m benchmarks.studies.many_chains --quick    # smoke run

The table is printed and written to ``benchmarks/results/many_chains.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyro
import torch

from benchmarks.quality import CHEES_MODEL
from benchmarks.studies.nuts_vs_numpyro import (
    MODEL,
    Run,
    figures,
    import_numpyro_port,
    load_data,
    run_numpyro,
)
from probtransformer import metrics
from probtransformer.inference import MCLMC, ChEES, EnsembleStarts, PriorStarts, fit_mcmc
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.registry import STARTS
from probtransformer.inference.mcmc.starts import prior_states
from probtransformer.models import SequenceClassifier

RESULTS = Path(__file__).parents[1] / "results" / "many_chains.md"
KS = (1, 4, 16, 64, 256, 1024)


def chain_gradients(
    device: torch.device, ks: Sequence[int] = KS, *, train_rows: int = 100, seconds: float = 2.0
) -> dict:
    """``{"pyro": chain-gradients/s of potential_fn, K: chain-gradients/s}`` on ``device``.

    Each K is timed for about ``seconds`` after one untimed call (CUDA synchronised).
    """
    train, _ = load_data(train_rows, 1, 0)
    train = train.to(device)
    model = SequenceClassifier(**MODEL).to(device).eval()
    density = VectorizedDensity(model, train.x, train.y, train.mask)
    out = {}
    _, potential_fn, _, _ = pyro.infer.mcmc.util.initialize_model(
        model, model_args=(train.x, train.y, train.mask)
    )
    with pyro.get_param_store().scope():
        z = {
            s.name: u[0]
            for s, u in zip(
                density.sites, density.unflatten(prior_states(density, 1)).values(), strict=True
            )
        }
    out["pyro"] = 1 / _timed(
        lambda: pyro.ops.integrator.potential_grad(potential_fn, z), device, seconds
    )
    for k in ks:
        states = prior_states(density, k)
        out[k] = k / _timed(lambda s=states: density.log_density(s), device, seconds)
    return out


def _timed(call, device: torch.device, seconds: float) -> float:
    """Seconds per call: one untimed call, then calls until ``seconds`` have passed."""
    call()
    _sync(device)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or n < 2:
        call()
        n += 1
    _sync(device)
    return (time.perf_counter() - start) / n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_chees(
    model, train, test, *, num_chains, num_starts, num_warmup, num_samples, seed, compile=None
) -> Run:
    """``fit_mcmc(kernel=ChEES(compile=compile), starts=EnsembleStarts(M))``; seconds include
    starts,
    warm-up and compiling (``torch_compile_seconds`` says how much of them)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    post = fit_mcmc(
        model,
        train,
        kernel=ChEES(compile=compile),
        starts=EnsembleStarts(num_starts),
        num_chains=num_chains,
        num_warmup=num_warmup,
        num_samples=num_samples,
        map_steps=500,
        device="cpu",
        seed=seed,
        progress=False,
    )
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    stats = post.record["sample_stats"]
    pred = post.predict(test.x, test.mask, num_samples=None, seed=seed)
    run = Run(
        samples={k: v.numpy() for k, v in post.samples.items()},
        lp=np.asarray(stats["lp"], dtype=np.float64),
        n_steps=np.asarray(stats["n_steps"]),
        diverging=np.asarray(stats["diverging"], dtype=bool),
        step_size=float(post.record["adapted_step_size"]),
        gradients=int(post.record["chain_gradients"]),
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        compile_seconds=math.nan if post.record["density_path"] == "compiled" else 0.0,
        probs=pred.probs.reshape(num_chains, -1, *pred.probs.shape[1:]).numpy(),
    )
    run.superchain = post.record["superchain"]
    run.density_path = post.record["density_path"]
    run.torch_compile_seconds = post.record["compile_seconds"]
    return run


def regression_bias(*, num_chains: int = 32, num_samples: int = 500, seed: int = 0) -> dict:
    """Bias of ``chees`` and ``mclmc`` on the analytic linear regression, in standard errors.

    The correlated regression of the correctness tests (50 rows, 3 features, intercept;
    posterior correlations down to -0.72). For each kernel and coefficient: the error of the
    posterior mean in Monte Carlo standard errors (``(mean - exact) / MCSE``, MCSE from
    arviz-stats' mean ESS over all chains), and the ratio of the sampled to the exact
    posterior sd. Returns ``{kernel: {"z_mean": [...], "sd_ratio": [...], "ess": [...],
    "energy_error_var_per_dim": ...}}``.
    """
    from arviz_stats.base import array_stats

    from probtransformer.datasets import SequenceData
    from probtransformer.models import BayesianLinearRegression

    g = torch.Generator().manual_seed(0)
    z = torch.randn(50, 3, generator=g)
    x = torch.stack([z[:, 0], 0.7 * z[:, 0] + 0.71 * z[:, 1], 0.5 + 0.7 * z[:, 2]], -1)
    y = x @ torch.tensor([0.8, -0.5, 0.3]) + 0.2 + torch.randn(50, generator=g)
    model, data = BayesianLinearRegression(3), SequenceData(x=x, y=y)
    exact = model.analytic_posterior(x, y)
    mean, sd = exact.mean.numpy(), exact.variance.sqrt().numpy()
    out = {}
    for kernel in (ChEES(), MCLMC()):
        post = fit_mcmc(
            model, data, kernel=kernel, num_chains=num_chains, starts=PriorStarts(4),
            num_warmup=500, num_samples=num_samples, seed=seed, progress=False,
        )  # fmt: skip
        draws = torch.cat([post.samples["weight"], post.samples["bias"][..., None]], -1)
        draws = draws.double().numpy()  # (chain, draw, 4)
        ess = array_stats.ess(np.moveaxis(draws, -1, 0), method="mean")  # (4,)
        est = draws.mean((0, 1))
        out[kernel.name] = dict(
            z_mean=((est - mean) / (draws.std((0, 1)) / np.sqrt(ess))).tolist(),
            sd_ratio=(draws.std((0, 1)) / sd).tolist(),
            ess=ess.tolist(),
            chain_gradients=post.record["chain_gradients"],
            energy_error_var_per_dim=post.record.get("energy_error_var_per_dim"),
        )
    return out


def convergence(
    *,
    num_chains: int,
    num_starts: int,
    num_warmup: int,
    num_samples: int,
    train_rows: int,
    test_rows: int,
    seed: int = 0,
    init: str = "ensemble",
    bayesian: Sequence[str] = MODEL["bayesian"],
    progress: bool = False,
    full_mass: bool = False,
    sizes: dict = MODEL,
) -> dict:
    """The convergence row: ChEES from ``init`` starts on the classifier of the NUTS benchmark
    (digits, ``seed``), judged as ``diagnose`` judges many chains. Every part is latent by
    default (780 latents); with fewer ``bayesian`` parts the others are point estimates (one
    shared MAP fit for prior starts, one per start for MAP and ensemble starts).

    Returns nested R-hat, R-hat and pooled bulk ESS of ``lp`` and of the log-likelihoods of the
    first ``diagnostics.PROBE_OBS`` training rows (worst over the rows), the largest weight-space
    R-hat and nested R-hat (information only: head and neuron symmetries), the seconds of the
    fit (MAP starts, warm-up, sampling), its chain-gradients and divergences, and test accuracy
    and NLL of the predictive mean.
    """
    train, test = load_data(train_rows, test_rows, seed)
    starts_options = {} if init == "map" else {"num_starts": num_starts}  # one MAP fit
    start = time.perf_counter()
    post = fit_mcmc(
        SequenceClassifier(**{**sizes, "bayesian": tuple(bayesian)}), train,
        kernel=ChEES(full_mass=full_mass), starts=STARTS[init](**starts_options),
        num_chains=num_chains, num_warmup=num_warmup, num_samples=num_samples, map_steps=500,
        seed=seed, progress=progress,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    table = post.diagnose(train, verbose=False)
    predictive = table.attrs["predictive"]
    weights = table.drop(index="attention", errors="ignore")
    mean = post.predict(test.x, test.mask, num_samples=None, seed=seed).mean
    return dict(
        sizes={k: v for k, v in sizes.items() if k != "bayesian"},
        init=init,
        full_mass=full_mass,
        bayesian=list(bayesian),
        latents=sum(v[0, 0].numel() for v in post.samples.values()),
        num_chains=num_chains,
        num_starts=num_starts,
        num_warmup=num_warmup,
        num_samples=num_samples,
        train_rows=len(train),
        seconds=seconds,
        start_seconds=post.record["start_seconds"],
        chain_gradients=post.record["chain_gradients"],
        divergences=int(np.asarray(post.record["sample_stats"]["diverging"]).sum()),
        lp=predictive["lp"],
        probe_log_lik=predictive["probe_log_lik"],
        weight_r_hat_max=float(weights["r_hat_max"].max()),
        weight_nested_r_hat_max=float(weights["nested_r_hat_max"].max()),
        accuracy=metrics.accuracy(mean, test.y),
        nll=metrics.nll(mean, test.y),
        verdict=table.attrs["verdict"],
    )


def curvature_spectrum(*, train_rows: int = 100, adam_steps: int = 3000, seed: int = 0) -> dict:
    """The geometry a mass matrix faces on the 780-latent classifier: the eigenvalues of the
    negative Hessian of the log density at a point ``adam_steps`` Adam steps (lr 0.01) into a
    MAP fit from a small random start, raw and scaled by the Hessian's diagonal (what an ideal
    diagonal metric sees). The Hessian comes from central differences (h = 1e-3) of the K-chain
    gradient, 200 perturbed chains per call.

    Returns quantiles (0, 1, 10, 50, 90, 99, 100 %) of both spectra, the count of negative
    eigenvalues and the sd of the narrowest direction."""
    train, _ = load_data(train_rows, 1, seed)
    pyro.set_rng_seed(seed)
    density = VectorizedDensity(SequenceClassifier(**MODEL).eval(), train.x, train.y, train.mask)
    dim = density.dim
    z = (0.1 * torch.randn(1, dim)).requires_grad_()
    optimizer = torch.optim.Adam([z], lr=1e-2)
    for _ in range(adam_steps):
        _, grad = density.log_density(z.detach())
        optimizer.zero_grad()
        z.grad = -grad
        optimizer.step()
    z0, h, eye = z.detach(), 1e-3, torch.eye(dim)
    hessian = torch.zeros(dim, dim, dtype=torch.float64)
    for lo in range(0, dim, 200):
        step = h * eye[lo : lo + 200]
        _, up = density.log_density(z0 + step)
        _, down = density.log_density(z0 - step)
        hessian[lo : lo + 200] = ((down - up) / (2 * h)).double()
    hessian = 0.5 * (hessian + hessian.T)
    raw = torch.linalg.eigvalsh(hessian)
    scale = torch.diag(hessian).clamp_min(1e-6).rsqrt()
    scaled = torch.linalg.eigvalsh(scale[:, None] * hessian * scale)
    levels = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0)

    def quantiles(values):
        return [float(values[round(q * (len(values) - 1))]) for q in levels]

    return dict(
        latents=dim,
        train_rows=train_rows,
        adam_steps=adam_steps,
        quantile_levels=list(levels),
        eigenvalues=quantiles(raw),
        eigenvalues_diagonal_scaled=quantiles(scaled),
        negative=int((raw < 0).sum()),
        narrowest_sd=float(raw[-1].rsqrt()),
    )


def bias_markdown(bias: dict, command: str) -> str:
    names = ["weight[0]", "weight[1]", "weight[2]", "bias"]
    lines = [
        "#### Bias on the analytic linear regression",
        "",
        f"Command: `{command}`. (mean - exact) / MCSE and sampled sd / exact sd per coefficient.",
        "",
        "| kernel | " + " | ".join(f"{n}: z, sd ratio" for n in names) + " | chain-gradients |",
        "|---|" + "---:|" * (len(names) + 1),
    ]
    for kernel, row in bias.items():
        cells = [f"{z:+.2f}, {r:.3f}" for z, r in zip(row["z_mean"], row["sd_ratio"], strict=True)]
        lines.append(f"| {kernel} | " + " | ".join(cells) + f" | {row['chain_gradients']:,} |")
    return "\n".join(lines) + "\n"


def nested_rhat(values: np.ndarray, superchain: Sequence[int]) -> float:
    """Nested R-hat (Margossian et al. 2024) of ``(chain, draw)`` values (arviz-stats)."""
    from arviz_stats.base import array_stats

    return float(array_stats.rhat_nested(values, np.asarray(superchain)))


def compare(args) -> dict[str, dict]:
    """The three sampler rows (see the module docstring)."""
    port = import_numpyro_port()
    train, test = load_data(args.train_rows, args.test_rows, args.seed)
    model = SequenceClassifier(**MODEL)
    cfg = port.ClassifierConfig.from_model_config(model.config)
    nuts = dict(num_warmup=args.num_warmup, num_samples=args.num_samples, max_tree_depth=6)
    rows = {}
    print("NumPyro NUTS, 1 chain ...", flush=True)
    rows["NumPyro NUTS, 1 chain"] = figures(
        run_numpyro(port, cfg, train, test, num_chains=1, seed=args.seed, **nuts), test
    )
    print(f"NumPyro NUTS, {args.num_chains} chains vectorized ...", flush=True)
    vectorized = run_numpyro(
        port, cfg, train, test, num_chains=args.num_chains, seed=args.seed,
        chain_method="vectorized", **nuts,
    )  # fmt: skip
    rows[f"NumPyro NUTS, {args.num_chains} chains vectorized"] = figures(vectorized, test)
    print(f"fit_mcmc chees, {args.num_chains} chains ...", flush=True)
    chees = run_chees(
        model, train, test, num_chains=args.num_chains, num_starts=args.num_starts,
        num_warmup=args.chees_warmup, num_samples=args.chees_samples, seed=args.seed,
        compile=COMPILE[args.compile],
    )  # fmt: skip
    row = figures(chees, test)
    row["density_path"] = chees.density_path
    row["torch_compile_seconds"] = chees.torch_compile_seconds
    row["nested_rhat_lp"] = nested_rhat(chees.lp, chees.superchain)
    rows[f"fit_mcmc chees, {args.num_chains} chains, {args.num_starts} ensemble starts"] = row
    return rows


KEYS = (
    ("seconds", "wall s (starts + warm-up + sampling; JAX compile out, torch's in)", ".1f"),
    ("density_path", "fit_mcmc's log density", "s"),
    ("torch_compile_seconds", "of which torch.compile s", ".1f"),
    ("gradients", "chain-gradients", ",.0f"),
    ("gradients_per_second", "**chain-gradients / s**", ",.0f"),
    ("steps_per_draw", "leapfrog steps per kept draw (mean)", ".1f"),
    ("divergences", "divergent transitions (kept draws)", "d"),
    ("ess_lp", "pooled bulk ESS, lp", ".1f"),
    ("ess_lp_per_second", "**pooled bulk ESS / s, lp**", ".3f"),
    ("ess_pred_median", "pooled bulk ESS, p(true class), median over test rows", ".1f"),
    ("ess_pred_median_per_second", "**pooled bulk ESS / s, p(true class)**", ".3f"),
    ("rhat_lp", "R-hat, lp", ".3f"),
    ("nested_rhat_lp", "nested R-hat, lp", ".3f"),
    ("accuracy", "test accuracy", ".3f"),
    ("nll", "test NLL (nats)", ".3f"),
)


def markdown(rows: dict, grads_cpu: dict, args, load: tuple[float, float]) -> str:
    names = list(rows)
    lines = [
        "### Many-chain samplers: ChEES-HMC against NumPyro NUTS",
        "",
        f"Command: `python -m benchmarks.studies.many_chains {' '.join(args.argv)}`; "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; load average {load[0]:.2f} "
        f"before, {load[1]:.2f} after; one thread (torch and XLA).",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for key, label, fmt in KEYS:
        cells = []
        for name in names:
            value = rows[name].get(key, float("nan"))
            cells.append(
                ""
                if value is None or (isinstance(value, float) and np.isnan(value))
                else format(value, fmt)
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Chain-gradients per second of one vectorized call (`VectorizedDensity.log_density`, "
        f"CPU, one thread); Pyro's `potential_fn` (one chain): {grads_cpu['pyro']:,.0f}/s.",
        "",
        "| K | " + " | ".join(str(k) for k in grads_cpu if k != "pyro") + " |",
        "|---|" + "---:|" * (len(grads_cpu) - 1),
        "| chain-gradients / s | "
        + " | ".join(f"{v:,.0f}" for k, v in grads_cpu.items() if k != "pyro")
        + " |",
    ]
    return "\n".join(lines) + "\n"


#: ``--compile`` -> ``fit_mcmc(compile=...)``.
COMPILE = {"auto": None, "on": True, "off": False}


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.many_chains")
    parser.add_argument("--num-chains", type=int, default=64)
    parser.add_argument("--num-starts", type=int, default=8)
    parser.add_argument("--num-warmup", type=int, default=150, help="NumPyro NUTS warm-up")
    parser.add_argument("--num-samples", type=int, default=150, help="NumPyro NUTS draws")
    parser.add_argument("--chees-warmup", type=int, default=200)
    parser.add_argument("--chees-samples", type=int, default=50)
    parser.add_argument("--train-rows", type=int, default=100)
    parser.add_argument("--test-rows", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--bias", action="store_true", help="only the bias of chees and mclmc on the regression"
    )
    parser.add_argument(
        "--convergence",
        action="store_true",
        help="only the convergence row (ChEES on --train-rows digits; nested R-hat of the probe "
        "log-likelihoods)",
    )
    parser.add_argument(
        "--init", choices=("prior", "map", "ensemble"), default="ensemble", help="--convergence"
    )
    parser.add_argument(
        "--bayesian",
        nargs="+",
        default=list(MODEL["bayesian"]),
        help="--convergence: the latent parts (the others are MAP point estimates)",
    )
    parser.add_argument("--progress", action="store_true", help="--convergence: a progress bar")
    parser.add_argument(
        "--full-mass", action="store_true", help="--convergence: ChEES adapts a dense metric"
    )
    parser.add_argument(
        "--classifier",
        choices=("nuts", "quality"),
        default="nuts",
        help="--convergence: the NUTS benchmark's classifier (d_model 8, 780 latents) or the "
        "quality benchmark's (d_model 32, 4 heads; 9,230 latents when every part is)",
    )
    parser.add_argument(
        "--curvature",
        action="store_true",
        help="only the Hessian spectrum of the 780-latent classifier near a MAP point",
    )
    parser.add_argument(
        "--compile",
        choices=tuple(COMPILE),
        default="auto",
        help="the ChEES row's fit_mcmc(compile=...): on (True), off (False), auto (None)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.num_chains, args.num_starts = 8, 2
        args.num_warmup = args.num_samples = args.chees_warmup = args.chees_samples = 10
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parse(argv)
    torch.set_num_threads(1)
    if args.bias:
        bias = regression_bias()
        text = bias_markdown(bias, "python -m benchmarks.studies.many_chains --bias")
        print(text)
        return bias
    if args.curvature:
        spectrum = curvature_spectrum(train_rows=args.train_rows, seed=args.seed)
        print(json.dumps(spectrum, indent=1))
        return spectrum
    if args.convergence:
        row = convergence(
            num_chains=args.num_chains, num_starts=args.num_starts, num_warmup=args.chees_warmup,
            num_samples=args.chees_samples, train_rows=args.train_rows,
            test_rows=args.test_rows, seed=args.seed, init=args.init, bayesian=args.bayesian,
            progress=args.progress, full_mass=args.full_mass,
            sizes=MODEL if args.classifier == "nuts" else {**MODEL, **CHEES_MODEL},
        )  # fmt: skip
        print(json.dumps(row, indent=1, default=str))
        return row
    before = os.getloadavg()[0]
    grads = chain_gradients(
        torch.device("cpu"), KS[:4] if args.quick else KS[:5], seconds=0.5 if args.quick else 3.0
    )
    rows = compare(args)
    text = markdown(rows, grads, args, (before, os.getloadavg()[0]))
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    return rows


if __name__ == "__main__":
    main()
