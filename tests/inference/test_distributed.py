"""Data-parallel SVI on 2 gloo processes: the numbers of one process, checkpoints that resume
under another world size, and faults that end in clear errors instead of hangs.

The ranks are started as ``torchrun`` starts them (environment variables, one interpreter each),
running ``distributed_worker.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from probtransformer.cli import main
from probtransformer.inference import fit_svi
from probtransformer.inference.vi.checkpoint import load_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
import distributed_worker as worker  # noqa: E402

WORKER = Path(__file__).with_name("distributed_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(
    scenario: str, out: Path, dtype: str = "float32", world_size: int = 2, timeout: float = 150
) -> list[int]:
    """Start ``world_size`` ranks of ``scenario``; their exit codes (a hang fails the test)."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(out), dtype],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(world_size)
    ]
    try:
        return [p.wait(timeout=timeout) for p in ranks]
    finally:
        for p in ranks:
            p.kill()


def _assert_close(a: dict, b: dict, atol: float, rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name].double(), b[name].double(), rtol=rtol, atol=atol), (
            name,
            (a[name].double() - b[name].double()).abs().max(),
        )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    outer = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(outer)


# float64: the algorithm's numbers; float32: summing a batch in two halves rounds differently,
# and 22 Adam steps carry that to a few 1e-6 (the ELBO, about -2000 nats, to 1e-7 relative)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), [("float64", 1e-6, 0), ("float32", 2e-5, 1e-6)])
def test_two_ranks_take_the_steps_of_one_process_and_their_checkpoint_resumes_in_one(
    tmp_path, dtype, atol, rtol
):
    assert _run_ranks("equivalence", tmp_path, dtype) == [0, 0]
    with _default_dtype(getattr(torch, dtype)):
        # the single-process fit with the same global batches and seed
        single = worker.states(fit_svi(worker.model(), worker.data(), **worker.SETTINGS))
        # 22 steps of 16 of 48 rows: a reshuffle every 3 steps
        saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
        ranks = [r["states"] for r in saved]
        _assert_close(ranks[0], ranks[1], 0)  # every rank took the same steps
        _assert_close(ranks[0], single, atol, rtol)
        # only rank 0 wrote; the last checkpoint is at step 20, mid-epoch (cursor 32 of 48)
        meta, state = load_checkpoint(tmp_path / "ckpt")
        assert meta["step"] == 20 and state["cursor"] == 32
        resumed = fit_svi(
            worker.model(), worker.data(), resume_from=tmp_path / "ckpt", **worker.SETTINGS
        )
        _assert_close(worker.states(resumed), single, atol, rtol)
    # predict(distributed=True): each rank ran its share of 47 rows; every rank has them all
    for r in saved:
        predictions = r["predictions"]
        assert predictions["distributed"].shape == predictions["one_process"].shape
        assert predictions["distributed"].shape[:2] == (5, 47)
        difference = (predictions["distributed"] - predictions["one_process"]).abs().max()
        assert difference <= atol, difference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("scenario", "world_size"), [("cuda-nccl", 1), ("cuda-gloo", 2)])
def test_data_parallel_svi_on_a_gpu(tmp_path, scenario, world_size):
    """NCCL at world size 1, and gloo reducing CUDA tensors with 2 ranks on the one GPU. Two
    GPUs (NCCL, world size 2) are checked by hand: ``torchrun --nproc-per-node 2 -m
    probtransformer fit --dataset digits --device cuda --dropout 0`` gives the metrics of the
    same command without torchrun (float rounding aside)."""
    assert _run_ranks(scenario, tmp_path, world_size=world_size) == [0] * world_size
    single = worker.states(
        fit_svi(worker.model(), worker.data(), **worker.SETTINGS | {"device": "cuda"})
    )
    for r in range(world_size):
        _assert_close(torch.load(tmp_path / f"rank{r}.pt")["states"], single, 2e-5, 1e-6)


@pytest.mark.filterwarnings("ignore:num_warmup=30 is short")
def test_sharded_chains_give_the_draws_of_one_process(tmp_path):
    assert _run_ranks("chains", tmp_path) == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for kernel in ("chees", "mclmc"):
        single = worker.chains(kernel)
        assert single["samples.head.weight"].shape[:2] == (6, 10)  # (chain, draw, ...)
        _assert_close(ranks[0][kernel], ranks[1][kernel], 0)  # one Posterior on every rank
        _assert_close(ranks[0][kernel], single, 0)


def test_a_rank_that_dies_is_named_and_the_last_checkpoint_stays(tmp_path):
    codes = _run_ranks("lost", tmp_path)
    assert codes == [1, 17]
    error = (tmp_path / "rank0.txt").read_text()
    assert error.startswith(
        "RankLostError: rank 1 stopped answering (it died or hangs): the gradient all-reduce"
    ), error
    meta, _ = load_checkpoint(tmp_path / "ckpt")
    assert meta["step"] == 5 and len(meta["elbo"]) == 5


@pytest.mark.filterwarnings("ignore:num_warmup=20 is short")
def test_ranks_that_disagree_are_refused_on_every_rank_before_any_work(tmp_path):
    assert _run_ranks("mismatch", tmp_path) == [0, 0]
    expected = {
        "rows": "ValueError: rank 1's number of training sequences is not rank 0's (47 against 48)",
        "order": "ValueError: rank 1's training data is not rank 0's: every rank must run the same",
        "model": "ValueError: rank 1's model is not rank 0's",
        "mcmc": "ValueError: rank 1's training data is not rank 0's",
        "predict": "ValueError: rank 1's number of rows is not rank 0's (47 against 48): every",
        "seed": "ValueError: rank 1's seed is not rank 0's (1 against 0)",
        "resume": "ValueError: rank 1's checkpoint step is not rank 0's (4 against 3): every "
        "rank must resume from the same checkpoint",
        "resume on one rank": "ValueError: rank 1's setting resume_from given is not rank 0's",
        "one row": "True",
    }
    # an argument that only rank 1 gets wrong: its own error there, and rank 0 is told
    on_one_rank = [
        "RuntimeError: rank 1 failed in fit_svi's argument checks; its own error says why",
        "ValueError: lr must be a finite number > 0, got -1.0",
    ]
    for r in range(2):
        said = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert said.keys() == expected.keys() | {"lr on one rank"}
        for name, message in expected.items():
            assert said[name].startswith(message), (r, name, said[name])
        assert said["lr on one rank"] == on_one_rank[r]


def test_a_batch_the_world_size_does_not_divide_is_refused(tmp_path):
    assert _run_ranks("indivisible", tmp_path) == [1, 1]
    for r in range(2):
        assert (
            "ValueError: batch_size must be divisible by the world size 2 (each rank takes "
            in (tmp_path / f"rank{r}.txt").read_text()
        )


def test_distributed_without_a_process_group_is_refused():
    with pytest.raises(ValueError, match="needs a torch.distributed process group"):
        fit_svi(worker.model(), worker.data(), distributed=True, **worker.SETTINGS)
    with pytest.raises(TypeError, match="distributed must be True or False, got 1"):
        fit_svi(worker.model(), worker.data(), distributed=1, **worker.SETTINGS)
    post = fit_svi(worker.model(), worker.data(), **{**worker.SETTINGS, "num_steps": 1})
    with pytest.raises(ValueError, match="needs a torch.distributed process group"):
        post.predict(worker.data().x, distributed=True)


CLI_FIT = [
    "fit", "--num-steps", "30", "--d-model", "16", "--num-heads", "2", "--num-layers", "1",
    "--num-samples", "10", "--no-progress", "--dropout", "0", "--threads", "1",
]  # fmt: skip


def test_torchrun_runs_the_cli_fit_data_parallel(tmp_path, capsys):
    launched = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(_free_port()),
            "-m", "probtransformer", *CLI_FIT, "--out", str(tmp_path / "two"),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout.count("wrote ") == 1  # rank 0 alone evaluates, writes and prints
    assert main([*CLI_FIT, "--out", str(tmp_path / "one")]) == 0
    two, one = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("two", "one"))
    assert two.pop("world_size") == 2 and "world_size" not in one
    for key in ("nll", "accuracy", "ece", "brier"):
        assert two[key] == pytest.approx(one[key], abs=1e-5), key


def test_the_cli_refuses_what_torchrun_cannot_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*CLI_FIT, "--inference", "ensemble", "--out", str(tmp_path / "r")]) == 2
    assert "under torchrun, --inference must be one of svi, map, mc-dropout" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "r").exists()


def test_the_cli_reports_a_lost_rank_on_one_line(tmp_path, monkeypatch, capsys):
    from probtransformer.cli import fit as fit_command
    from probtransformer.inference.distributed import RankLostError

    def lost(args):
        raise RankLostError("rank 1 stopped answering: the gradient all-reduce failed", [1])

    monkeypatch.setattr(fit_command, "run", lost)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main([*CLI_FIT, "--out", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err == (
        "probtransformer: error: [rank 0] rank 1 stopped answering: the gradient all-reduce "
        "failed\n"
    )
