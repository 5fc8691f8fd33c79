"""One rank of the data-parallel SVI tests, started by ``test_distributed.py`` as ``torchrun``
would start it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the environment).

Usage: ``python distributed_worker.py SCENARIO OUTDIR [DTYPE]``. Each rank writes what it
observed to ``OUTDIR/rank{r}.pt`` (its fitted parameters) or ``OUTDIR/rank{r}.txt`` (its error).
With DTYPE ``float64`` the problem is a token model in double precision (``model``/``data``), so
that the float32 rounding of summing a batch in two halves does not hide the algorithm's numbers.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed

from probtransformer.datasets import SequenceData
from probtransformer.inference import (
    ChEES,
    fit_mcmc,
    fit_svi,
    save_svi_checkpoint,
    svi_init,
    svi_step,
)
from probtransformer.inference.distributed import init_from_environment
from probtransformer.inference.vi import svi as svi_module
from probtransformer.models import CausalLM, SequenceClassifier

N = 48
SETTINGS = dict(num_steps=22, batch_size=16, lr=1e-2, seed=3, device="cpu", progress=False)


def data(n: int = N) -> SequenceData:
    """``n`` of 48 sequences: float (48, 5, 3) features, or in float64 (48, 5) token ids."""
    g = torch.Generator().manual_seed(0)
    if torch.get_default_dtype() == torch.float64:
        ids = torch.randint(0, 7, (N, 6), generator=g)
        return SequenceData(ids[:, :-1], ids[:, 1:])[:n]
    x = torch.randn(N, 5, 3, generator=g)  # (N, T, F)
    mask = torch.ones(N, 5, dtype=torch.bool)
    mask[::3, 3:] = False
    return SequenceData(x, (x[:, 0, 0] > 0).long(), mask)[:n]


def model() -> torch.nn.Module:
    """A classifier, or in float64 a language model, of d_model 8 without dropout."""
    tiny = dict(d_model=8, num_heads=2, num_layers=1, d_ff=8, dropout=0.0)
    if torch.get_default_dtype() == torch.float64:
        return CausalLM(7, 5, **tiny)
    return SequenceClassifier(3, 2, 5, **tiny)


def states(post) -> dict[str, torch.Tensor]:
    return {
        **{f"model.{k}": v for k, v in post.model.state_dict().items()},
        **{f"guide.{k}": v for k, v in post.guide.state_dict().items()},
        "elbo": torch.tensor(post.record["elbo"], dtype=torch.float64),
    }


#: Sharded chains: 6 chains from 3 ensemble starts (shares of 3 per rank), short runs.
CHAINS = dict(
    num_chains=6, num_starts=3, init="ensemble", num_warmup=30, num_samples=10, map_steps=20,
    device="cpu", seed=5, progress=False,
)  # fmt: skip


def chains(kernel: str, **options) -> dict[str, torch.Tensor]:
    """The draws and per-chain statistics of a short many-chain fit."""
    post = fit_mcmc(model(), data(), kernel=kernel, **CHAINS, **options)
    assert post.record.get("world_size") == (2 if options else None)
    stats = post.record["sample_stats"]
    return {
        **{f"samples.{k}": v for k, v in post.samples.items()},
        **{f"members.{k}": v for k, v in (post.members or {}).items()},
        "lp": torch.tensor(stats["lp"], dtype=torch.float64),
        "adapted_step_size": torch.tensor(post.record["adapted_step_size"]),
    }


def disagreements(rank: int, out: Path) -> dict[str, str]:
    """What each call says when rank 1's arguments differ from rank 0's (every call must fail
    on both ranks, or the next one would hang)."""
    train = data()
    permuted = train[torch.arange(N).flip(0)] if rank else train
    other = SequenceClassifier(3, 2, 5, d_model=8, num_heads=2, num_layers=1, d_ff=16, dropout=0)
    short = dict(num_warmup=20, num_samples=5, map_steps=5, device="cpu", progress=False)
    post = fit_svi(model(), train, **{**SETTINGS, "num_steps": 2})
    calls = {
        "rows": lambda: fit_svi(model(), data(N - rank), distributed=True, **SETTINGS),
        "order": lambda: fit_svi(model(), permuted, distributed=True, **SETTINGS),
        "model": lambda: fit_svi(other if rank else model(), train, distributed=True, **SETTINGS),
        "mcmc": lambda: fit_mcmc(
            model(), permuted, kernel=ChEES(), num_chains=2, distributed=True, **short
        ),
        "predict": lambda: post.predict(train.x[: N - rank], distributed=True),
        "seed": lambda: post.predict(train.x, seed=rank, distributed=True),
    }
    # rank 0 resumes from step 3 of one fit, rank 1 from step 4 of the same fit
    state = svi_init(model(), train, **{k: v for k, v in SETTINGS.items() if k != "progress"})
    for _ in range(3 + rank):
        svi_step(state)
    save_svi_checkpoint(state, out / f"ck{rank}")
    stale = {**SETTINGS, "resume_from": out / f"ck{rank}"}
    calls["resume"] = lambda: fit_svi(model(), train, distributed=True, **stale)
    alone = {**SETTINGS, "resume_from": out / f"ck{rank}"} if rank else SETTINGS
    calls["resume on one rank"] = lambda: fit_svi(model(), train, distributed=True, **alone)
    calls["lr on one rank"] = lambda: fit_svi(
        model(), train, distributed=True, **{**SETTINGS, "lr": -1.0 if rank else 1e-2}
    )
    said = {}
    for name, call in calls.items():
        try:
            call()
            said[name] = "no error"
        except (ValueError, RuntimeError) as e:  # RuntimeError: another rank's check failed
            said[name] = f"{type(e).__name__}: {e}"
    # fewer rows than ranks: every rank runs the one row, no empty share
    one = post.predict(train.x[:1], num_samples=3, distributed=True).probs
    said["one row"] = str(torch.equal(one, post.predict(train.x[:1], num_samples=3).probs))
    return said


def _die_at_step(step: int):
    real = svi_module.svi_step

    def svi_step(state):
        if state.step == step:
            os._exit(17)
        return real(state)

    return svi_step


def main(scenario: str, out: Path) -> None:
    if scenario == "cuda-gloo":  # gloo reducing CUDA tensors
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
    else:  # NCCL for "cuda-nccl", gloo on CPU otherwise
        rank = init_from_environment("cuda" if scenario == "cuda-nccl" else "cpu").rank
    try:
        if scenario == "equivalence":
            post = fit_svi(
                model(), data(), distributed=True, checkpoint_every=5,
                checkpoint_dir=out / "ckpt", **SETTINGS,
            )  # fmt: skip
            x = data().x[:47]  # shares of 24 and 23 rows
            predictions = {
                "distributed": post.predict(x, num_samples=5, distributed=True).probs,
                "one_process": post.predict(x, num_samples=5).probs,
            }
            torch.save({"states": states(post), "predictions": predictions}, out / f"rank{rank}.pt")
        elif scenario.startswith("cuda"):
            post = fit_svi(model(), data(), distributed=True, **{**SETTINGS, "device": "cuda"})
            torch.save({"states": states(post)}, out / f"rank{rank}.pt")
        elif scenario == "chains":
            torch.save(
                {kernel: chains(kernel, distributed=True) for kernel in ("chees", "mclmc")},
                out / f"rank{rank}.pt",
            )
        elif scenario == "mismatch":
            (out / f"rank{rank}.json").write_text(json.dumps(disagreements(rank, out)))
        elif scenario == "indivisible":
            fit_svi(model(), data(), distributed=True, **{**SETTINGS, "batch_size": 15})
        elif scenario == "lost":
            if rank == 1:
                svi_module.svi_step = _die_at_step(7)
            fit_svi(
                model(), data(), distributed=True, checkpoint_every=5,
                checkpoint_dir=out / "ckpt", **SETTINGS,
            )  # fmt: skip
    except Exception as e:
        (out / f"rank{rank}.txt").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        sys.exit(1)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[3:] == ["float64"]:
        torch.set_default_dtype(torch.float64)
    main(sys.argv[1], Path(sys.argv[2]))
