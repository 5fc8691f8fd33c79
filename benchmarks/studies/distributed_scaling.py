"""Data-parallel SVI on this machine, and what it implies for 8 GPUs (issue 18).

Three measurements, each in the same run, with the 1-minute load average before and after:

1. **Throughput.** ``fit_svi`` on the digits training split with the README's model (d_model 64,
   2 layers), global batches of ``--batch-size`` rows: training sequences per second of the
   steps after ``WARMUP_STEPS``, for 1 process (1 thread, and 2 threads) and for 2 gloo
   processes of 1 thread each (``fit_svi(distributed=True)``, each rank a slice of the batch),
   at ``--batch-size`` and at ``THROUGHPUT_LARGE_BATCH`` rows.
2. **All-reduce time against model size.** 2 gloo processes time ``all_reduce`` of one float32
   buffer, median of ``REPEATS``, for the gradient sizes of the digits classifier at d_model
   16 to 256 (mean-field guide: a location and a scale per latent, and the point estimates).
3. **Compute per step.** For the same models: FLOPs of one SVI step (guide draw, forward and
   backward pass; ``torch.utils.flop_counter``) over its ``--batch-size`` rows, per row, and the
   CPU seconds of one step.

From these, ``plan`` gives the communication volume per step against the compute per step and
the per-GPU tokens per step at which 8 GPUs on a 100 Gb/s link keep >= 80% scaling efficiency
(printed with the assumptions it takes)::

    python -m benchmarks.studies.distributed_scaling            # about 3 minutes
    python -m benchmarks.studies.distributed_scaling --steps 60 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

WARMUP_STEPS = 3
REPEATS = 20
#: A second global batch for the throughput runs: most of the 1,212 digits training rows, so
#: the per-row work outweighs each step's fixed cost (guide draws, KL, Pyro's tracing).
THROUGHPUT_LARGE_BATCH = 1024
D_MODELS = (16, 32, 64, 128, 256)

#: The plan's assumptions: a 100 Gb/s link per node, 8 GPUs, a ring all-reduce (each rank sends
#: and receives 2 (W - 1) / W of the buffer), 20 microseconds per ring hop, and the float32
#: throughput a GPU sustains on these small matmuls (an assumption until ``gpu_check`` on a GPU
#: measures it).
LINK_BYTES_PER_S = 100e9 / 8
GPUS = 8
HOP_LATENCY_S = 20e-6
GPU_FLOPS = 20e12
TARGET_EFFICIENCY = 0.8


def _digits_model(d_model: int = 64):
    from probtransformer import datasets
    from probtransformer.tasks import task_for_dataset

    splits = datasets.load("digits", seed=0)
    options = {} if d_model == 64 else {"d_model": d_model, "d_ff": 2 * d_model}
    return task_for_dataset("digits").build_model(splits.meta, options), splits.train


def _throughput(steps: int, batch_size: int, distributed: bool) -> dict:
    """Sequences per second of ``steps`` SVI steps after the warm-up, on this rank."""
    from probtransformer.inference import svi_init, svi_step

    model, train = _digits_model()
    state = svi_init(
        model, train, num_steps=steps, batch_size=batch_size, device="cpu",
        distributed=distributed,
    )  # fmt: skip
    for _ in range(WARMUP_STEPS):
        svi_step(state)
    start = time.perf_counter()
    for _ in range(steps):
        svi_step(state)
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, sequences_per_s=steps * batch_size / seconds)


def _all_reduce_times(sizes: list[int]) -> list[float]:
    """Median seconds of one all-reduce of ``n`` float32 elements, for each size."""
    import torch.distributed as dist

    times = []
    for n in sizes:
        buffer = torch.randn(n)
        for _ in range(3):
            dist.all_reduce(buffer)
        runs = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            runs.append(time.perf_counter() - start)
        times.append(statistics.median(runs))
    return times


def _worker(task: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    if task == "throughput":
        result = _throughput(args.steps, args.batch_size, world > 1)
    else:
        result = {"seconds": _all_reduce_times(json.loads(args.sizes))}
    if world == 1 or dist.get_rank() == 0:
        print(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def _launch(task: str, world: int, threads: int, args: argparse.Namespace, **extra) -> dict:
    """Run ``_worker(task)`` in ``world`` processes (``torchrun``'s environment); rank 0's JSON."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.update(WORLD_SIZE=str(world), OMP_NUM_THREADS=str(threads))
    command = [sys.executable, "-m", "benchmarks.studies.distributed_scaling", "--worker", task]
    command += ["--threads", str(threads), "--steps", str(args.steps)]
    command += [
        f"--{k.replace('_', '-')}={v}" for k, v in {"batch_size": args.batch_size, **extra}.items()
    ]
    ranks = [
        subprocess.Popen(command, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    outputs = [p.communicate(timeout=1800)[0] for p in ranks]
    if any(p.returncode for p in ranks):
        raise RuntimeError(f"{task} with {world} processes failed")
    return json.loads(outputs[0].strip().splitlines()[-1])


def compute_per_step(batch_size: int) -> list[dict]:
    """Per d_model: gradient elements, training FLOPs per row, CPU seconds per step (1 thread)."""
    from torch.utils.flop_counter import FlopCounterMode

    from probtransformer.inference import svi_init, svi_step

    rows = []
    for d_model in D_MODELS:
        model, train = _digits_model(d_model)
        state = svi_init(model, train, num_steps=10, batch_size=batch_size, device="cpu")
        elements = sum(p.numel() for p in state.params)
        with FlopCounterMode(display=False) as counter:
            svi_step(state)
        for _ in range(WARMUP_STEPS):
            svi_step(state)
        start = time.perf_counter()
        for _ in range(5):
            svi_step(state)
        rows.append(
            dict(
                d_model=d_model,
                gradient_elements=elements,
                flops_per_row=counter.get_total_flops() / batch_size,
                cpu_seconds_per_step=(time.perf_counter() - start) / 5,
            )
        )
    return rows


def plan(models: list[dict], steps_per_row: int) -> list[dict]:
    """Per model: the all-reduce volume and time on 8 GPUs, and the rows per GPU per step at
    which compute is at least ``TARGET_EFFICIENCY`` of compute plus communication (no overlap:
    one all-reduce after the backward pass)."""
    out = []
    for m in models:
        volume = 2 * (GPUS - 1) / GPUS * 4 * m["gradient_elements"]  # bytes each rank sends
        comm = volume / LINK_BYTES_PER_S + 2 * (GPUS - 1) * HOP_LATENCY_S
        # efficiency = compute / (compute + comm) >= target  <=>  compute >= comm * t / (1 - t)
        compute_needed = comm * TARGET_EFFICIENCY / (1 - TARGET_EFFICIENCY)
        rows = compute_needed * GPU_FLOPS / m["flops_per_row"]
        out.append(
            dict(
                d_model=m["d_model"],
                bytes_per_rank_per_step=volume,
                all_reduce_ms=1e3 * comm,
                compute_ms_needed=1e3 * compute_needed,
                rows_per_gpu_needed=rows,
                tokens_per_gpu_needed=rows * steps_per_row,
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per throughput run")
    parser.add_argument("--batch-size", type=int, default=128, help="global mini-batch (rows)")
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=("throughput", "all_reduce"), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/distributed_scaling.json")
    args = parser.parse_args()
    if args.worker:
        return _worker(args.worker, args)

    load_before = os.getloadavg()[0]
    throughput = {}
    for batch_size in (args.batch_size, THROUGHPUT_LARGE_BATCH):
        runs = dict(
            one_thread=_launch("throughput", 1, 1, args, batch_size=batch_size),
            two_threads=_launch("throughput", 1, 2, args, batch_size=batch_size),
            two_processes=_launch("throughput", 2, 1, args, batch_size=batch_size),
        )
        for name in ("two_threads", "two_processes"):
            runs[f"{name}_speedup"] = (
                runs[name]["sequences_per_s"] / runs["one_thread"]["sequences_per_s"]
            )
        throughput[f"batch {batch_size}"] = runs
    models = compute_per_step(args.batch_size)
    sizes = [m["gradient_elements"] for m in models]
    reduce_s = _launch("all_reduce", 2, 1, args, sizes=json.dumps(sizes))["seconds"]
    for m, seconds in zip(models, reduce_s, strict=True):
        m["all_reduce_ms_2_gloo"] = 1e3 * seconds
        m["all_reduce_share_of_step"] = seconds / (seconds + m["cpu_seconds_per_step"] / 2)
    steps_per_row = 8  # digits: 8 steps of 8 pixels
    result = dict(
        load_before=load_before,
        load_after=os.getloadavg()[0],
        batch_size=args.batch_size,
        steps=args.steps,
        throughput=throughput,
        models=models,
        plan_assumptions=dict(
            gpus=GPUS,
            link_gbit_per_s=LINK_BYTES_PER_S * 8 / 1e9,
            hop_latency_us=HOP_LATENCY_S * 1e6,
            gpu_float32_tflops=GPU_FLOPS / 1e12,
            target_efficiency=TARGET_EFFICIENCY,
        ),
        plan=plan(models, steps_per_row),
    )
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
