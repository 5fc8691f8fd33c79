"""CUDA against CPU: wall time of an SVI fit and a NUTS fit of the digits classifier, and
chain-gradients per second of the many-chain density for K = 1, 4, 16, 64, 256 and 1024.

Two fits, each run once on CUDA and once on the CPU, in one process:

- ``svi``: ``fit_svi`` (mean-field guide, batch 128, library defaults otherwise) of the default
  ``SequenceClassifier`` (d_model 64, 2 layers, 4 heads; attention and head latent) on the full
  digits training split, for ``--svi-steps`` steps.
- ``nuts``: ``fit_mcmc(kernel="nuts")`` of the small fully Bayesian classifier that
  ``probtransformer fit --inference mcmc`` uses (d_model 8, 1 layer, 2 heads, d_ff 16, every
  part latent) on the first ``--num-train`` training rows: one chain of ``--num-warmup`` +
  ``--num-draws`` transitions of at most ``2**--max-tree-depth - 1`` leapfrog steps, log density
  JIT-traced. One chain keeps the sampler in this process (Pyro would otherwise start a worker
  process per chain, and on CUDA each would create its own CUDA context).

A timing is the wall time of the ``fit_*`` call, CUDA work included (``torch.cuda.synchronize``
before the clock stops): model copy, optimisation or sampling, JIT tracing. Before the timed
runs a two-step SVI fit on each device creates the CUDA context and loads the kernels, so the
table does not count that start-up. The chains on the two devices follow different random
streams, so they adapt different step sizes and take trajectories of different lengths: the
table therefore also gives the time per unit of work, ms per SVI step and ms per gradient
evaluation of the log density (every leapfrog step of warmup and sampling, counted by wrapping
``pyro.ops.integrator.potential_grad``). Each fit also reports its test-split accuracy (from
20 posterior draws) as a check that both devices fitted something sensible; at ``--quick``
sizes it is near chance. CPU fits run on ``--threads`` intra-op threads (default 1: the models
are made of many small operations, where a second thread on a shared 2-core machine made NUTS
2.5x slower).

The ratio columns are CUDA / CPU: below 1 the GPU is faster. For models this small the GPU
may well lose: each operation is tiny, so kernel launches and Pyro's Python bookkeeping, not
arithmetic, set the pace.

Usage::

    python -m benchmarks.studies.gpu_check          # CUDA and CPU; CPU only (exit 0) without CUDA
    python -m benchmarks.studies.gpu_check --device cuda  # exit 2 when CUDA is not available
    python -m benchmarks.studies.gpu_check --quick  # tiny sizes: a smoke run (about 15 s on CPU)

The table is printed and written to ``benchmarks/results/gpu_check.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._pyro_gradients import count_gradients
from probtransformer import metrics
from probtransformer.block import BAYESIAN_PARTS
from probtransformer.datasets import DatasetSplits, load
from probtransformer.inference import NUTS, Posterior, fit_mcmc, fit_svi
from probtransformer.models import SequenceClassifier

RESULTS = Path(__file__).parents[1] / "results" / "gpu_check.md"
SEED = 0
PREDICT_DRAWS = 20  # posterior draws behind the reported test accuracy
SMALL_MODEL = dict(d_model=8, num_heads=2, num_layers=1, d_ff=16, dropout=0.0)  # the CLI preset
FULL = dict(svi_steps=300, num_train=200, num_warmup=30, num_draws=30, max_tree_depth=6)
QUICK = dict(svi_steps=20, num_train=50, num_warmup=5, num_draws=5, max_tree_depth=3)


@dataclass(frozen=True)
class Timing:
    """One fit on one device.

    Attributes:
        seconds: wall time of the fit call (s).
        units: SVI steps, or gradient evaluations of the log density (NUTS).
        accuracy: test-split accuracy of its posterior predictive.
    """

    seconds: float
    units: int
    accuracy: float

    @property
    def ms_per_unit(self) -> float:
        return 1000 * self.seconds / max(self.units, 1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fit: Callable[[], Posterior], device: torch.device) -> tuple[Posterior, float]:
    """``fit()`` and its wall time on ``device`` (s)."""
    _synchronize(device)
    start = time.perf_counter()
    post = fit()
    _synchronize(device)
    return post, time.perf_counter() - start


def _accuracy(post: Posterior, splits: DatasetSplits) -> float:
    test = splits.test
    pred = post.predict(test.x, test.mask, num_samples=PREDICT_DRAWS, seed=SEED)
    return metrics.accuracy(pred.mean, test.y)


def _warm_up(model: SequenceClassifier, device: torch.device, splits: DatasetSplits) -> None:
    """A two-step SVI fit: creates the CUDA context and loads kernels outside the timings."""
    fit_svi(model, splits.train[:32], num_steps=2, device=device, seed=SEED, progress=False)
    _synchronize(device)


def run_device(device: torch.device, splits: DatasetSplits, sizes: dict) -> dict[str, Timing]:
    """Time the SVI and the NUTS fit on ``device``.

    Returns:
        ``{"svi": Timing, "nuts": Timing}``.
    """
    meta = splits.meta
    shape = (meta["in_features"], meta["num_classes"], meta["max_len"])
    default_model = SequenceClassifier(*shape)
    small_model = SequenceClassifier(*shape, **SMALL_MODEL, bayesian=BAYESIAN_PARTS)
    _warm_up(small_model, device, splits)
    train = splits.train[: sizes["num_train"]]
    print(f"{device}: svi ...", flush=True)
    post, seconds = _timed(
        lambda: fit_svi(
            default_model,
            splits.train,
            num_steps=sizes["svi_steps"],
            device=device,
            seed=SEED,
            progress=False,
        ),
        device,
    )
    svi = Timing(seconds, len(post.record["elbo"]), _accuracy(post, splits))
    print(f"{device}: svi {svi.seconds:.1f} s; nuts ...", flush=True)
    with count_gradients() as gradients:
        post, seconds = _timed(
            lambda: fit_mcmc(
                small_model,
                train,
                kernel=NUTS(max_tree_depth=sizes["max_tree_depth"], jit_compile=True),
                num_chains=1,
                num_warmup=sizes["num_warmup"],
                num_samples=sizes["num_draws"],
                device=device,
                seed=SEED,
                progress=False,
            ),
            device,
        )
    nuts = Timing(seconds, gradients[0], _accuracy(post, splits))
    print(f"{device}: nuts {nuts.seconds:.1f} s, {nuts.units} gradients", flush=True)
    return {"svi": svi, "nuts": nuts}


def _cell(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def report(
    cpu: dict[str, Timing],
    cuda: dict[str, Timing] | None,
    sizes: dict,
    *,
    threads: int,
    note: str,
) -> str:
    """The results as a markdown document (header lines, then one table row per fit)."""
    gpu = torch.cuda.get_device_name() if cuda is not None else "none"
    lines = [
        "# CUDA vs CPU: `python -m benchmarks.studies.gpu_check`",
        "",
        f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda or 'none'}); GPU: {gpu}; CPU: "
        f"{platform.processor() or platform.machine()}, {threads} intra-op thread(s).",
    ]
    if note:
        lines += ["", note]
    lines += [
        "",
        f"- svi: fit_svi, default classifier (d_model 64, 2 layers), full training split, "
        f"{sizes['svi_steps']} steps of batch 128; unit: one step",
        f"- nuts: fit_mcmc NUTS, d_model-8 classifier with every part latent, "
        f"{sizes['num_train']} training rows, 1 chain x ({sizes['num_warmup']} warmup + "
        f"{sizes['num_draws']} draws), max_tree_depth {sizes['max_tree_depth']}, JIT; unit: one "
        "gradient of the log density (leapfrog step)",
        "",
        "| fit | CPU s | CUDA s | CUDA / CPU | units CPU, CUDA | CPU ms/unit | CUDA ms/unit "
        "| CUDA / CPU per unit | test acc CPU, CUDA |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, on_cpu in cpu.items():
        on_cuda = cuda[name] if cuda is not None else None
        lines.append(
            " | ".join(
                [
                    f"| {name}",
                    f"{on_cpu.seconds:.1f}",
                    _cell(on_cuda and on_cuda.seconds, ".1f"),
                    _cell(on_cuda and on_cuda.seconds / on_cpu.seconds, ".2f"),
                    f"{on_cpu.units}, {_cell(on_cuda and on_cuda.units, 'd')}",
                    f"{on_cpu.ms_per_unit:.2f}",
                    _cell(on_cuda and on_cuda.ms_per_unit, ".2f"),
                    _cell(on_cuda and on_cuda.ms_per_unit / on_cpu.ms_per_unit, ".2f"),
                    f"{on_cpu.accuracy:.3f}, {_cell(on_cuda and on_cuda.accuracy, '.3f')} |",
                ]
            )
        )
    return "\n".join(lines) + "\n"


def chain_gradient_table(per_device: dict[str, dict]) -> str:
    """Markdown: chain-gradients per second of the many-chain density for each K and device
    (``benchmarks.studies.many_chains.chain_gradients``)."""
    ks = [k for k in next(iter(per_device.values())) if k != "pyro"]
    lines = [
        "",
        "Chain-gradients per second of `VectorizedDensity.log_density` (K chains of the "
        "780-latent classifier, 100 training rows, one call), and of Pyro's `potential_fn` "
        "(one chain):",
        "",
        "| device | Pyro potential_fn | " + " | ".join(f"K = {k}" for k in ks) + " |",
        "|---|---:|" + "---:|" * len(ks),
    ]
    for device, figures in per_device.items():
        cells = [f"{figures[k]:,.0f}" for k in ks]
        lines.append(f"| {device} | {figures['pyro']:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compiled_table(rates: dict[int, dict]) -> str:
    """Markdown: eager against compiled chain-gradients per second on CUDA (CUDA graphs,
    ``benchmarks.studies.compiled_density.torch_rates``)."""
    ks = list(rates)
    rows = {
        "eager, chain-gradients / s": [f"{r['eager']:,.0f}" for r in rates.values()],
        "compiled (reduce-overhead), chain-gradients / s": [
            f"{r['compiled']:,.0f}" for r in rates.values()
        ],
        "compiled / eager": [f"{r['compiled'] / r['eager']:.2f}" for r in rates.values()],
        "compile s": [f"{r['compile_seconds']:.1f}" for r in rates.values()],
        "path (verified against eager)": [r["path"] for r in rates.values()],
    }
    lines = [
        "",
        "The K-chain density eager and compiled on CUDA (`fit_mcmc(compile=True)`):",
        "",
        "| | " + " | ".join(f"K = {k}" for k in ks) + " |",
        "|---|" + "---:|" * len(ks),
    ]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows.items()]
    return "\n".join(lines) + "\n"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.gpu_check",
        description="Wall time of an SVI and a NUTS fit of the digits classifier on CUDA and CPU.",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: CUDA and CPU, CPU only without CUDA; cuda: fail without CUDA; cpu: CPU only "
        "(default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU intra-op threads (default: %(default)s)"
    )
    for name, default in FULL.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            help=f"default: {default} ({QUICK[name]} with --quick)",
        )
    parser.add_argument("--out", type=Path, default=RESULTS, help="markdown file to write")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; returns the exit status (0, or 2 when CUDA was required and is missing)."""
    args = _parse(argv)
    cuda_available = torch.cuda.is_available()
    if args.device == "cuda" and not cuda_available:
        print(
            f"gpu_check: error: --device cuda requested but CUDA is not available (torch "
            f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); install a "
            "CUDA build of torch on a machine with an NVIDIA GPU, or drop --device cuda",
            file=sys.stderr,
        )
        return 2
    note = ""
    if args.device == "auto" and not cuda_available:
        note = (
            f"CUDA is not available (torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda or 'none'}): timing the CPU only."
        )
        print(note, flush=True)
    sizes = {
        name: getattr(args, name) if getattr(args, name) is not None else default
        for name, default in (QUICK if args.quick else FULL).items()
    }
    torch.set_num_threads(args.threads)
    splits = load("digits", seed=SEED)
    cuda = None
    if args.device != "cpu" and cuda_available:
        cuda = run_device(torch.device("cuda"), splits, sizes)
    cpu = run_device(torch.device("cpu"), splits, sizes)
    from benchmarks.studies.many_chains import KS, chain_gradients

    ks = KS[:3] if args.quick else KS
    per_device = {}
    if cuda is not None:
        per_device["cuda"] = chain_gradients(torch.device("cuda"), ks)
    per_device["cpu"] = chain_gradients(torch.device("cpu"), ks)
    text = report(cpu, cuda, sizes, threads=args.threads, note=note)
    text += chain_gradient_table(per_device)
    if cuda is not None:
        from benchmarks.studies.compiled_density import torch_rates

        compiled_ks = (1, 16, 64) if args.quick else (1, 16, 64, 256, 1024)
        text += compiled_table(
            torch_rates(compiled_ks, seconds=2.0, backend="inductor", device="cuda")
        )
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
