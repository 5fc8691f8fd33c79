"""Data parallelism on ``torch.distributed``: what a fit needs from the process group.

The engine is PyTorch's own: ``torchrun`` starts the processes and sets ``RANK``/``WORLD_SIZE``,
``init_process_group`` joins them (gloo on CPU, NCCL on GPUs), and gradients are averaged with one
``all_reduce`` per step, as ``DistributedDataParallel`` and Pyro's Horovod example do. Nothing
here starts processes or speaks its own protocol.

Every collective runs through ``_collective``: a peer that died or stopped answering (the group's
timeout) becomes a ``RankLostError`` naming the ranks that did not answer, not a hang.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from probtransformer.inference.inputs import rows_digest

#: The process group's timeout when the CLI creates it: a lost rank is noticed within it.
DEFAULT_TIMEOUT = timedelta(seconds=60)

#: Seconds a rank waits for its peers to say they are alive after a collective failed.
_ROLL_CALL_SECONDS = 3.0


class RankLostError(RuntimeError):
    """A collective failed because a peer rank died, or did not answer within the timeout.

    Attributes:
        lost: the ranks that did not answer the roll call after the failure (empty when the
            process group's store could not be reached either).
    """

    def __init__(self, message: str, lost: Sequence[int]) -> None:
        super().__init__(message)
        self.lost = tuple(lost)


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the default process group.

    Attributes:
        rank: this process's rank, in ``[0, world_size)``.
        world_size: number of processes in the group.
        backend: ``"gloo"`` or ``"nccl"``.
    """

    rank: int
    world_size: int
    backend: str

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes checkpoints, the posterior and progress."""
        return self.rank == 0

    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of a global mini-batch ``(B,)`` of row indices."""
        size = batch.shape[0] // self.world_size
        return batch[self.rank * size : (self.rank + 1) * size]

    def share(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` rows (or chains); shares differ in size by at
        most one, and rank order is row order."""
        return _share(n, self.rank, self.world_size)


def _share(n: int, rank: int, world_size: int) -> slice:
    """Rows ``[ceil(n rank / world_size), ceil(n (rank + 1) / world_size))``."""
    return slice(-(-n * rank // world_size), -(-n * (rank + 1) // world_size))


def data_parallel(device: torch.device) -> DataParallel:
    """The default process group as a ``DataParallel``, checked for use on ``device``.

    Raises:
        ValueError: no process group is initialised (``distributed=True`` outside ``torchrun``
            and ``init_process_group``), or an NCCL group with a CPU device.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "distributed=True needs a torch.distributed process group, and none is initialised: "
            "launch the script with torchrun and call "
            "torch.distributed.init_process_group() first (`torchrun -m probtransformer fit` "
            "does both)"
        )
    backend = str(dist.get_backend())
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"the process group's backend is nccl, which reduces CUDA tensors only, but the fit "
            f"runs on {device}: fit on cuda, or initialise the group with backend='gloo'"
        )
    return DataParallel(dist.get_rank(), dist.get_world_size(), backend)


def init_from_environment(device_type: str) -> DataParallel | None:
    """Join the process group ``torchrun`` describes in the environment; None outside it.

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (set by ``torchrun``; the rendezvous
    address comes from ``MASTER_ADDR``/``MASTER_PORT``). NCCL on CUDA, with this process's GPU
    the ``LOCAL_RANK``-th; gloo on CPU. The group's timeout is ``DEFAULT_TIMEOUT``. A group the
    caller initialised already is used as it is.

    Raises:
        ValueError: ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` are not integers, or there are fewer
            GPUs than local ranks.
    """
    if dist.is_initialized():  # joined already, by the caller
        return data_parallel(torch.device(device_type))
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as e:
        raise ValueError(f"WORLD_SIZE, RANK and LOCAL_RANK must be integers: {e}") from None
    backend = "gloo"
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK {local_rank} needs GPU {local_rank}, but this machine has "
                f"{torch.cuda.device_count()}: start at most that many processes per node"
            )
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    dist.init_process_group(backend, timeout=DEFAULT_TIMEOUT, world_size=world, rank=rank)
    return data_parallel(torch.device(device_type))


@contextlib.contextmanager
def _collective(parallel: DataParallel, what: str) -> Iterator[None]:
    """Turn a failed collective into a ``RankLostError`` naming the ranks that are gone."""
    try:
        yield
    except RuntimeError as e:  # gloo raises plain RuntimeErrors, NCCL DistBackendErrors
        lost = _roll_call(parallel)
        if lost is None:
            who = "a peer rank stopped answering (which one could not be told)"
        elif lost:
            who = f"rank {', '.join(map(str, lost))} stopped answering (it died or hangs)"
        else:
            who = (
                "every rank is alive, but they ran different collectives (did every rank run "
                "the same command with the same arguments?)"
            )
        raise RankLostError(
            f"{who}: the {what} failed ({str(e).splitlines()[0]})", lost or ()
        ) from e


def _roll_call(parallel: DataParallel) -> list[int] | None:
    """Ranks that do not say they are alive in the group's store within a few seconds (None:
    the store cannot be reached)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"probtransformer/alive/{parallel.rank}", "1")
        deadline = time.monotonic() + _ROLL_CALL_SECONDS
        keys = [f"probtransformer/alive/{r}" for r in range(parallel.world_size)]
        while time.monotonic() < deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if not missing:
                return []
            time.sleep(0.1)
        return missing
    except (RuntimeError, AttributeError):
        return None


def check_same(parallel: DataParallel, advice: str, **values: object) -> None:
    """Refuse to go on when the ranks disagree on any of ``values``.

    Every rank loads its own data and runs its own copy of the command; a rank that read another
    file, another checkpoint or other arguments would otherwise be mixed in silently. Integers
    are compared as they are (and reported); anything else by a 52-bit hash of its JSON (give
    tensors as ``inputs.rows_digest`` of them).

    Raises:
        ValueError: on every rank, naming the first rank and value that differ from rank 0's,
            followed by ``advice``.
    """
    names = list(values)
    mine = torch.tensor([_comparable(v) for v in values.values()], dtype=torch.float64)
    mine = _on_group_device(parallel, mine)
    every = [torch.empty_like(mine) for _ in range(parallel.world_size)]
    with _collective(parallel, "check that the ranks agree"):
        dist.all_gather(every, mine)
    first = every[0].cpu()
    for rank, other in enumerate(every):
        for name, value, reference in zip(names, other.cpu(), first, strict=True):
            if value != reference:
                plain = _is_count(values[name])
                both = f" ({int(value)} against {int(reference)})" if plain else ""
                raise ValueError(f"rank {rank}'s {name} is not rank 0's{both}: {advice}")


def check_same_fit(parallel: DataParallel, model, data, settings: dict) -> None:
    """``check_same`` of what every rank of a fit must share: the number of training sequences,
    every byte of them, the model's class and config, and the fit's ``settings``.

    Raises:
        ValueError: naming the first rank and item that differ from rank 0's.
    """
    check_same(
        parallel,
        "every rank must run the same command on the same training data",
        **{
            "number of training sequences": len(data),
            "training data": rows_digest(data.x, data.y, data.mask),
            "model": [type(model).__qualname__, getattr(model, "config", None)],
            **{f"setting {name}": value for name, value in settings.items()},
        },
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**52


def _comparable(value: object) -> float:
    """``value`` as a float64 that equals another rank's exactly when the values are equal."""
    if _is_count(value):
        return float(value)
    text = json.dumps(value, sort_keys=True, default=str)
    return float(int(hashlib.sha256(text.encode()).hexdigest()[:13], 16))


def joined(distributed: object) -> DataParallel | None:
    """The default process group when ``distributed`` is True and one is initialised, else
    None (``data_parallel`` then raises, on every rank alike, when one is needed)."""
    if distributed is not True or not (dist.is_available() and dist.is_initialized()):
        return None
    return DataParallel(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))


@contextlib.contextmanager
def together(parallel: DataParallel | None, what: str) -> Iterator[None]:
    """Run a rank's own checks (``what``) so that a ``TypeError``/``ValueError``/``OSError`` on
    one rank fails every rank (``agree``), instead of leaving the others waiting in the next
    collective. No-op without ``parallel``. The block must not run collectives itself."""
    if parallel is None:
        yield
        return
    failure = None
    try:
        yield
    except (TypeError, ValueError, OSError) as e:
        failure = e
    agree(parallel, failure, what)
    if failure is not None:
        raise failure


def agree(parallel: DataParallel, failure: BaseException | None, what: str) -> None:
    """Make one rank's failure every rank's: the others would wait for it in the next collective.

    Raises:
        RuntimeError: on the ranks that did not fail when another did, naming it (the rank that
            failed raises its own error after this returns).
    """
    mine = _on_group_device(parallel, torch.tensor([0 if failure is None else 1]))
    every = [torch.empty_like(mine) for _ in range(parallel.world_size)]
    with _collective(parallel, f"agreement on {what}"):
        dist.all_gather(every, mine)
    failed = [rank for rank, flag in enumerate(every) if int(flag)]
    if failed and failure is None:
        raise RuntimeError(
            f"rank {', '.join(map(str, failed))} failed in {what}; its own error says why"
        )


def average_gradients(
    parallel: DataParallel, params: Sequence[torch.Tensor], loss: torch.Tensor
) -> float:
    """All-reduce the gradients of ``params`` and ``loss`` (one buffer); returns the summed loss.

    Each rank's ``loss`` is its slice's negative ELBO divided by ``world_size`` (likelihood
    scaled by N over the slice, so by N over the global batch after the division; the KL
    counted once in total), so the sums are the single-process gradient and loss.
    """
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
    with _collective(parallel, "gradient all-reduce"):
        dist.all_reduce(flat := _on_group_device(parallel, flat))
    flat = flat.to(loss.device)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return float(flat[-1])


def gather_rows(
    parallel: DataParallel, out: dict[str, torch.Tensor], n: int, dim: int = 2
) -> dict[str, torch.Tensor]:
    """All-gather each rank's ``share(n)`` of rows (dim ``dim``) into the whole, in row order.

    Shares differ in size by at most one row: each is padded to the largest for the all-gather
    and cut back after it.
    """
    sizes = [len(range(n)[_share(n, r, parallel.world_size)]) for r in range(parallel.world_size)]
    whole = {}
    with _collective(parallel, "all-gather of the ranks' shares"):
        for key, value in out.items():
            pad = list(value.shape)
            pad[dim] = max(sizes) - value.shape[dim]
            padded = _on_group_device(parallel, torch.cat([value, value.new_zeros(pad)], dim))
            every = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(every, padded)
            pieces = [t.narrow(dim, 0, m) for t, m in zip(every, sizes, strict=True)]
            whole[key] = torch.cat(pieces, dim).to(value.device)
    return whole


def broadcast_state(parallel: DataParallel, tensors: Sequence[torch.Tensor]) -> None:
    """Copy rank 0's ``tensors`` (parameters, RNG states) to every rank, in place."""
    with _collective(parallel, "broadcast from rank 0"), torch.no_grad():
        for t in tensors:
            moved = _on_group_device(parallel, t)
            dist.broadcast(moved, src=0)
            if moved is not t:
                t.copy_(moved)


def _on_group_device(parallel: DataParallel, t: torch.Tensor) -> torch.Tensor:
    """``t`` where the backend reduces it: CUDA for NCCL, as it is for gloo."""
    if parallel.backend == "nccl" and t.device.type != "cuda":
        return t.to(torch.device("cuda", torch.cuda.current_device()))
    return t


__all__ = [
    "DEFAULT_TIMEOUT",
    "DataParallel",
    "RankLostError",
    "agree",
    "average_gradients",
    "broadcast_state",
    "check_same",
    "check_same_fit",
    "data_parallel",
    "gather_rows",
    "init_from_environment",
    "joined",
    "together",
]
