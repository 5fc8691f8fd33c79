"""Load on ``probtransformer serve``: throughput and latency at 1, 8 and 32 concurrent clients,
with batching on (the defaults) and off (``--max-batch-rows 1``), in one run (issue 17).

The server serves a run directory (default: the README's main job, ``runs/digits-svi``) in a
subprocess with the same options and threads but ``--max-batch-rows``. The driver is async httpx
in this process: ``C`` clients each send single-row ``/predict`` requests (digits test rows in
turn, the server's default ``num_samples`` 100 and seed 0) back to back for ``--seconds``
seconds after a warm-up. Reported per (batching, clients): rows per second, p50 and p99 latency
in ms, the server's passes per request, and the driver's own CPU use (its process CPU seconds
over wall seconds, in cores: the driver shares the machine with the server). The 1-minute load
average is recorded before each level::

    python -m benchmarks.studies.serving_load                      # runs/digits-svi
    python -m benchmarks.studies.serving_load --run DIR --seconds 20 --out results.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from probtransformer import datasets


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(run_dir: str, *options: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [sys.executable, "-m", "probtransformer.cli", "serve", run_dir, "--port", str(port)]
    process = subprocess.Popen(
        [*command, *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start")


async def drive(url: str, rows: list, clients: int, seconds: float) -> dict:
    """``clients`` concurrent loops of single-row requests for ``seconds``; latencies in ms."""
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:

        async def client(k: int) -> None:
            i = k
            while time.perf_counter() < stop:
                start = time.perf_counter()
                answer = await http.post("/predict", json={"sequences": [rows[i % len(rows)]]})
                answer.raise_for_status()
                latencies.append(1000 * (time.perf_counter() - start))
                i += clients

        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(clients)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    ordered = sorted(latencies)
    return {
        "requests": len(latencies),
        "rows_per_s": len(latencies) / wall,
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "driver_cpu_cores": cpu / wall,
    }


def passes(url: str) -> int:
    return httpx.get(f"{url}/metadata").json()["batching"]["passes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="runs/digits-svi")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--out", default="benchmarks/results/serving_load.json")
    parser.add_argument(
        "--batched",
        nargs="*",
        default=[],
        metavar="OPTION",
        help="serve options of the batched server (default: none, the defaults), e.g. "
        "--batched=--max-wait-ms=20",
    )
    parser.add_argument(
        "--modes", nargs="+", default=["batched", "unbatched"], choices=["batched", "unbatched"]
    )
    args = parser.parse_args()
    rows = datasets.load("digits").test.x.tolist()
    results = []
    modes = {"batched": args.batched, "unbatched": ["--max-batch-rows", "1"]}
    for mode in args.modes:
        options = modes[mode]
        process, url = start_server(args.run, *options)
        try:
            asyncio.run(drive(url, rows, 4, 3.0))  # warm-up
            for clients in args.clients:
                load = os.getloadavg()[0]
                before = passes(url)
                figures = asyncio.run(drive(url, rows, clients, args.seconds))
                figures["passes_per_request"] = (passes(url) - before) / figures["requests"]
                row = {"batching": mode, "clients": clients, "load_1min": load, **figures}
                results.append(row)
                print(
                    json.dumps(
                        {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
                    ),
                    flush=True,
                )
        finally:
            process.terminate()
            process.wait(30)
    by = {(r["batching"], r["clients"]): r for r in results}
    ratios = {
        c: by[("batched", c)]["rows_per_s"] / by[("unbatched", c)]["rows_per_s"]
        for c in args.clients
        if ("batched", c) in by and ("unbatched", c) in by
    }
    print("throughput batched / unbatched:", {c: round(r, 2) for c, r in ratios.items()})
    record = {
        "command": "python -m benchmarks.studies.serving_load " + " ".join(sys.argv[1:]),
        "run": args.run,
        "batched_options": args.batched,
        "cpus": os.cpu_count(),
        "rows": results,
        "throughput_ratio": ratios,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
