"""The compiled K-chain log density against the eager one and NumPyro's, in one process.

On the 780-latent classifier of the NUTS benchmark (d_model 8, 2 heads, 1 layer, d_ff 16, every
part latent), first 100 digits training rows, one thread (torch and XLA):

- ``eager``: ``VectorizedDensity.log_density`` of K chains (the Pyro trace);
- ``compiled``: the same with ``inference.mcmc.compiled.CompiledPass`` (Inductor by default); its
  compile seconds (trace, code generation and the check against eager) and the growth of the
  process's peak resident memory while it compiled;
- NumPyro: ``jax.jit(jax.value_and_grad(potential_fn))`` of one chain (what its NUTS pays per
  leapfrog step), and ``jax.jit(jax.vmap(...))`` of K chains (``chain_method="vectorized"``);
  compile time taken out.

Each figure is chain-gradients per second (value and gradient of every chain), timed for about
``--seconds`` after an untimed call. The break-even is the chain-gradients after which the
compile time is repaid: compile seconds / (eager - compiled seconds per chain-gradient).

Reproduce::

    pip install -e ".[bench]"
    python -m benchmarks.studies.compiled_density            # about 5 minutes of one core
    python -m benchmarks.studies.compiled_density --ks 1 64 --seconds 1   # quicker
    python -m benchmarks.studies.compiled_density --predictive   # the predictive pass only
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import os
import resource
import sys
import time
from collections.abc import Sequence

import torch
import torch._inductor.config

from benchmarks.studies.many_chains import _timed
from benchmarks.studies.nuts_vs_numpyro import MODEL, import_numpyro_port, load_data
from probtransformer.inference.mcmc.compiled import CompiledPass
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.starts import prior_states
from probtransformer.models import SequenceClassifier

KS = (1, 16, 64, 256)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def torch_rates(ks: Sequence[int], *, seconds: float, backend: str, device="cpu") -> dict:
    """``{K: {"eager", "compiled", "compile_seconds", "compile_peak_mib", "max_error"}}``."""
    train, _ = load_data(100, 1, 0)
    train = train.to(device)
    model = SequenceClassifier(**MODEL).to(device).eval()
    density = VectorizedDensity(model, train.x, train.y, train.mask)
    out = {}
    for k in ks:
        torch.manual_seed(k)
        z = prior_states(density, k)
        row = {"eager": k / _timed(lambda z=z: density.log_density(z), density.device, seconds)}
        lp, grad = density.log_density(z)
        density.compiled = CompiledPass(density, backend=backend)
        before = _peak_mib()
        ours, our_grad = density.log_density(z)  # compiles and checks against eager
        row["compile_seconds"] = density.compiled.seconds
        row["compile_peak_mib"] = _peak_mib() - before
        row["path"] = density.compiled.record()["density_path"]
        row["max_error"] = max(
            float((ours - lp).abs().max() / lp.abs().max()),
            float((our_grad - grad).abs().max() / grad.abs().max()),
        )
        row["compiled"] = k / _timed(lambda z=z: density.log_density(z), density.device, seconds)
        density.compiled = None
        saved = 1 / row["eager"] - 1 / row["compiled"]  # seconds per chain-gradient
        row["break_even"] = row["compile_seconds"] / saved if saved > 0 else float("inf")
        out[k] = row
        print(k, row, flush=True)
    return out


def numpyro_rates(ks: Sequence[int], *, seconds: float) -> dict:
    """``{"single": chain-gradients/s of one jitted chain, K: of K vmapped chains}``."""
    port = import_numpyro_port()
    import jax
    import jax.numpy as jnp
    from numpyro.infer.util import initialize_model

    train, _ = load_data(100, 1, 0)
    cfg = port.ClassifierConfig.from_model_config(SequenceClassifier(**MODEL).config)
    x, y = jnp.asarray(train.x.numpy()), jnp.asarray(train.y.numpy())
    info, potential_fn, _, _ = initialize_model(
        jax.random.PRNGKey(0), functools.partial(port.model, cfg), model_args=(x, y)
    )
    one = jax.jit(jax.value_and_grad(potential_fn))
    z = info.z

    def block(result):
        jax.block_until_ready(result)

    out = {"single": 1 / _timed(lambda: block(one(z)), torch.device("cpu"), seconds)}
    many = jax.jit(jax.vmap(jax.value_and_grad(potential_fn)))
    for k in ks:
        zk = jax.tree_util.tree_map(
            lambda v, k=k: v + 0.01 * jax.random.normal(jax.random.PRNGKey(k), (k, *v.shape)), z
        )
        out[k] = k / _timed(lambda zk=zk: block(many(zk)), torch.device("cpu"), seconds)
    return out


def predictive_seconds(draws: Sequence[int] = (1, 10, 100), repeats: int = 5) -> dict:
    """``{S: (eager s, compiled s)}`` of the digits default model's forward pass and likelihood
    over its 450 test rows for ``S`` draws, without gradient: what a compiled ``predict`` pass
    would save (traced and compiled as ``CompiledPass`` does)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from probtransformer.datasets import load
    from probtransformer.inference.mcmc.compiled import _prepare

    test = load("digits").test
    model = SequenceClassifier(test.x.shape[2], 10, test.x.shape[1]).eval()
    density = VectorizedDensity(model, test.x, test.y, test.mask)
    index = torch.arange(len(test))
    out = {}

    def eager(z):
        return density._pass(z, index, 1.0, first=True, jac=True)

    for num in draws:
        z = prior_states(density, num)
        with torch.no_grad():
            traced = make_fx(eager)(z)
            _prepare(traced)
            compiled = torch.compile(traced, dynamic=False)
            times = [_best_of(lambda f=f, z=z: f(z), repeats) for f in (eager, compiled)]
        out[num] = tuple(times)
        print(num, out[num], flush=True)
    return out


def _best_of(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def markdown(ours: dict, theirs: dict, command: str, load: tuple[float, float]) -> str:
    ks = list(ours)
    single = theirs["single"]
    head = "| | " + " | ".join(f"K = {k}" for k in ks) + " |"
    rows = [
        ("eager (Pyro trace), chain-gradients / s", [ours[k]["eager"] for k in ks], ",.0f"),
        ("**compiled**, chain-gradients / s", [ours[k]["compiled"] for k in ks], ",.0f"),
        ("compiled / eager", [ours[k]["compiled"] / ours[k]["eager"] for k in ks], ".2f"),
        ("**compiled / NumPyro single chain**", [ours[k]["compiled"] / single for k in ks], ".2f"),
        ("NumPyro vectorized, chain-gradients / s", [theirs[k] for k in ks], ",.0f"),
        ("compile s (trace + codegen + check)", [ours[k]["compile_seconds"] for k in ks], ".1f"),
        ("peak memory growth compiling, MiB", [ours[k]["compile_peak_mib"] for k in ks], ".0f"),
        ("break-even, chain-gradients", [ours[k]["break_even"] for k in ks], ",.0f"),
        ("max rel. error, value / gradient", [ours[k]["max_error"] for k in ks], ".1e"),
    ]  # fmt: skip
    lines = [
        f"Command: `{command}`; {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; load average "
        f"{load[0]:.2f} before, {load[1]:.2f} after; one thread; NumPyro's single jitted chain: "
        f"{single:,.0f} chain-gradients/s.",
        "",
        head,
        "|---|" + "---:|" * len(ks),
    ]
    for label, values, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(format(v, fmt) for v in values) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.compiled_density")
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument(
        "--predictive", action="store_true", help="only the predictive pass, eager vs compiled"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch._inductor.config.force_disable_caches = True  # compile seconds from cold, every run
    if args.predictive:
        return predictive_seconds()
    before = os.getloadavg()[0]
    theirs = numpyro_rates(args.ks, seconds=args.seconds)
    ours = torch_rates(args.ks, seconds=args.seconds, backend=args.backend)
    argv = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python -m benchmarks.studies.compiled_density", *argv])
    text = markdown(ours, theirs, command, (before, os.getloadavg()[0]))
    print(text)
    return {"torch": ours, "numpyro": theirs}


if __name__ == "__main__":
    main()
