"""Load on ``probtransformer serve``: throughput and latency at 1, 8 and 32 concurrent clients,
with batching on (the defaults) and off (``--max-batch-rows 1``), in one run (issue 17).

The batched and the unbatched server serve a run directory (default: the README's main job,
``runs/digits-svi``) in two subprocesses with the same options and threads but
``--max-batch-rows``; both stay up for the whole run and only the one being driven works. The
driver is async httpx in this process: ``C`` clients each send single-row ``/predict`` requests
(digits test rows in turn, the server's default ``num_samples`` 100 and seed 0) back to back for
``--seconds`` seconds. Each of ``--rounds`` rounds drives, per client count, the batched then
the unbatched server, so a change of load on this shared machine hits both alike. Reported per
(batching, clients), as the median over rounds: rows per second, p50 and p99 latency in ms, the
server's passes per request, and the driver's own CPU use (its process CPU seconds over wall
seconds, in cores: the driver shares the machine with the server); and per client count the
median over rounds of the batched/unbatched throughput ratio. The 1-minute load average is
recorded before each drive::

    python -m benchmarks.studies.serving_load                      # runs/digits-svi
    python -m benchmarks.studies.serving_load --run DIR --seconds 20 --rounds 5 --out results.json
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
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
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
    options = {"batched": args.batched, "unbatched": ["--max-batch-rows", "1"]}
    servers = {}
    try:
        for mode in args.modes:  # both stay up (idle when not driven) for the whole run
            servers[mode] = start_server(args.run, *options[mode])
            asyncio.run(drive(servers[mode][1], rows, 4, 3.0))  # warm-up
        for round_ in range(args.rounds):
            for clients in args.clients:
                for mode, (_, url) in servers.items():
                    load = os.getloadavg()[0]
                    before = passes(url)
                    figures = asyncio.run(drive(url, rows, clients, args.seconds))
                    figures["passes_per_request"] = (passes(url) - before) / figures["requests"]
                    row = {"round": round_, "batching": mode, "clients": clients, "load_1min": load}
                    results.append(row | figures)
                    print(json.dumps({k: _round(v) for k, v in results[-1].items()}), flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(30)
    summary = summarize(results, args.clients)
    for row in summary:
        print(json.dumps({k: _round(v) for k, v in row.items()}))
    record = {
        "command": "python -m benchmarks.studies.serving_load " + " ".join(sys.argv[1:]),
        "run": args.run,
        "batched_options": args.batched,
        "cpus": os.cpu_count(),
        "rows": results,
        "summary": summary,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


def summarize(results: list[dict], clients: list[int]) -> list[dict]:
    """Per (batching, clients): the median over rounds of each figure, and per clients the
    median over rounds of the batched/unbatched throughput ratio (each round drives both
    servers back to back, so a load change hits both)."""
    summary = []
    for c in clients:
        by_mode = {}
        for r in results:
            if r["clients"] == c:
                by_mode.setdefault(r["batching"], []).append(r)
        for mode, rs in by_mode.items():
            figures = ["rows_per_s", "p50_ms", "p99_ms", "driver_cpu_cores", "passes_per_request"]
            summary.append(
                {"batching": mode, "clients": c, "rounds": len(rs)}
                | {f: statistics.median(r[f] for r in rs) for f in figures}
            )
        if len(by_mode) == 2:
            ratios = [
                b["rows_per_s"] / u["rows_per_s"]
                for b, u in zip(by_mode["batched"], by_mode["unbatched"], strict=True)
            ]
            summary.append(
                {"clients": c, "throughput_ratio": statistics.median(ratios), "ratios": ratios}
            )
    return summary


def _round(value):
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


if __name__ == "__main__":
    main()
