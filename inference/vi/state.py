"""The state of an SVI fit and one step on it.

As in the ``posteriors`` library (``vi/diag.py``), a fit is a small state and a step:
``SVIState`` holds the model copy, guide, ELBO, Adam and its learning-rate schedule, mini-batch
order, RNG and param-store state; ``svi_step`` advances it by one mini-batch. ``inference.vi.svi``
builds the state (``svi_init``, whose signature is ``fit_svi``'s) and runs the loop around the
steps (``fit_svi``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import Trace_ELBO

from probtransformer.data import SequenceData
from probtransformer.inference._runtime import (
    is_invalid_parameter_error,
    reinitialised_copy,
    resolve_device,
    seeded,
)
from probtransformer.inference.distributed import (
    DataParallel,
    agree,
    average_gradients,
    broadcast_state,
    check_same_fit,
    data_parallel,
)
from probtransformer.inference.vi.checkpoint import data_fingerprint
from probtransformer.inference.vi.elbo import MeanFieldELBO, NonFiniteELBOError, non_finite_error
from probtransformer.inference.vi.guides import build_guide, has_local_latents
from probtransformer.inference.vi.schedule import lr_scheduler
from probtransformer.inference.vi.warm_start import warm_start


@dataclass(eq=False)
class SVIState:
    """Everything an SVI fit carries from one step to the next.

    Built by ``svi_init``, advanced in place by ``svi_step``, saved and restored by
    ``inference.vi.checkpoint.save_svi_checkpoint`` / ``restore_svi_checkpoint``.

    Attributes:
        model: the fit's own re-initialised copy of the model, in training mode, on the device.
        guide: the variational guide (an autoguide, or ``AmortizedGuide`` for local latents).
        loss_fn: negative ELBO of a mini-batch, ``loss_fn(x, y, mask, num_data=N)`` -> scalar
            tensor (nats, full-data scale); a Pyro ``ELBOModule`` of ``model`` and ``guide``.
        params: the trainable parameters of ``loss_fn`` (model and guide), in optimizer order.
        optimizer: Adam over ``params``.
        scheduler: the learning-rate schedule (``inference.vi.schedule.lr_scheduler``): warm-up,
            then ``lr`` -> ``lr * lr_decay`` at step ``num_steps``.
        data: the training split on the device.
        settings: ``guide``, ``num_steps``, ``batch_size`` (capped at ``N``), ``lr``,
            ``lr_decay``, ``lr_warmup``, ``lr_schedule``, ``num_particles``, ``init_scale``,
            ``seed``.
        fingerprint: ``checkpoint.data_fingerprint`` of the training data as given (on CPU).
        order: ``(N,)`` int64 permutation that the current epoch's mini-batches walk through.
        cursor: index in ``order`` where the next mini-batch starts.
        step: completed optimisation steps.
        elbo: ELBO of every completed step (nats, full-data scale), ``len(elbo) == step``.
        rng: torch RNG state (``"cpu"``, and ``"cuda"`` on a GPU) the next step starts from.
        param_store: the fit's own Pyro param-store state (``ParamStoreDict.get_state()``),
            entered for every evaluation so the global param store is never read or written.
        last_finite: copies of ``params`` from the start of the last step whose loss was finite.
        parallel: this process's place in a data-parallel fit (``inference.distributed``), or
            None for a single-process fit.
    """

    model: torch.nn.Module
    guide: torch.nn.Module
    loss_fn: Callable[..., torch.Tensor]
    params: list[torch.Tensor] = field(repr=False)
    optimizer: torch.optim.Optimizer = field(repr=False)
    scheduler: torch.optim.lr_scheduler.LRScheduler = field(repr=False)
    data: SequenceData = field(repr=False)
    settings: dict
    fingerprint: list[float]
    order: torch.Tensor = field(repr=False)
    cursor: int
    step: int
    elbo: list[float] = field(repr=False)
    rng: dict = field(repr=False)
    param_store: dict = field(repr=False)
    last_finite: list[torch.Tensor] = field(repr=False)
    parallel: DataParallel | None = None

    @property
    def device(self) -> torch.device:
        """Where the model, guide and data live."""
        return self.data.x.device


def initial_state(
    model,
    data,
    guide,
    num_steps,
    batch_size,
    lr,
    lr_decay,
    lr_warmup,
    lr_schedule,
    num_particles,
    init_scale,
    device,
    seed,
    init_from=None,
    distributed=False,
    *,
    resuming=False,
) -> SVIState:
    """The state before the first step, from arguments ``inference.vi.svi.svi_init`` has checked
    (see it for their meanings). ``resuming``: ``fit_svi`` restores a checkpoint next, which
    every rank of a data-parallel fit must do."""
    device = resolve_device(device)
    parallel = data_parallel(device) if distributed else None
    model = reinitialised_copy(model, seed, device)
    start = None if init_from is None else warm_start(model, init_from, device)
    model.train()
    train = data.to(device)
    n = len(train)
    batch_size = min(batch_size, n)
    # the amortized guide of local latents is not mean-field: its logits depend on the globals
    mean_field = guide == "normal" and not has_local_latents(model)
    elbo_cls = MeanFieldELBO if mean_field else Trace_ELBO
    elbo = elbo_cls(num_particles=num_particles, vectorize_particles=num_particles > 1)
    settings = dict(
        guide=guide,
        num_steps=num_steps,
        batch_size=batch_size,
        lr=lr,
        lr_decay=lr_decay,
        lr_warmup=lr_warmup,
        lr_schedule=lr_schedule,
        num_particles=num_particles,
        init_scale=init_scale,
        seed=seed,
    )
    if init_from is not None:
        settings["init_from"] = init_from.record.get("method", "posterior")
    if parallel is not None:
        check_same_fit(parallel, model, train, {**settings, "resume_from given": resuming})
        if batch_size % parallel.world_size:
            raise ValueError(
                f"batch_size must be divisible by the world size {parallel.world_size} (each "
                f"rank takes an equal slice of every batch), got {batch_size}"
                + (f" (all {n} training sequences: give a smaller one)" if batch_size == n else "")
            )
    with pyro.get_param_store().scope() as param_store, seeded(seed, device):
        autoguide = build_guide(guide, model, init_scale=init_scale, init_values=start)
        loss_fn = elbo(model, autoguide)
        first = torch.arange(batch_size, device=device)
        if parallel is not None:
            first = parallel.rows(first)
        args = (train.x[first], train.y[first], _mask(train, first))
        failure = None
        try:
            loss_fn(*args, num_data=n)  # creates the guide's parameters, validated
        except ValueError as e:
            if not is_invalid_parameter_error(e):
                raise
            failure = non_finite_error(model, autoguide, args, n, 0, math.nan)
            failure.__cause__ = e
        if parallel is not None:
            agree(parallel, failure, "the first ELBO evaluation")
        if failure is not None:
            raise failure
        params = [p for p in loss_fn.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(params, lr=lr)
        scheduler = lr_scheduler(optimizer, num_steps, lr_decay, lr_warmup, lr_schedule)
        order = torch.randperm(n, device=device)
        rng = _get_rng_state(device)
        if parallel is not None:  # rank 0's start, whatever the ranks' slices drew
            broadcast_state(parallel, [*params, order, *rng.values()])
    return SVIState(
        model=model,
        guide=autoguide,
        loss_fn=loss_fn,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        data=train,
        settings=settings,
        fingerprint=data_fingerprint(data),
        order=order,
        cursor=0,
        step=0,
        elbo=[],
        rng=rng,
        param_store=param_store,
        last_finite=[p.detach().clone() for p in params],
        parallel=parallel,
    )


def svi_step(state: SVIState) -> float:
    """One Adam step on the next mini-batch; updates ``state`` in place.

    Takes the next ``batch_size`` sequences of ``state.order`` (a fresh permutation when fewer
    than ``batch_size`` are left in the epoch), evaluates the negative ELBO without Pyro's
    validation (the first, validated evaluation in ``svi_init`` checked the shapes), steps
    Adam and the learning-rate schedule, and appends the ELBO to ``state.elbo``. Runs in the
    state's own RNG and param-store state: the caller's are left as they were. The order,
    cursor, RNG state, step count and ELBO trace change only when the step completes, so after
    an interruption (``KeyboardInterrupt``) they describe the start of the step.

    In a data-parallel fit (``state.parallel``) each rank evaluates its contiguous slice of the
    same global mini-batch, the loss divided by the world size; the gradients and losses are
    summed over the ranks (``distributed.average_gradients``), so every rank takes the step the
    single-process fit takes, and rank 0's RNG state is carried to the next step on every rank.

    Args:
        state: from ``svi_init`` (or restored from a checkpoint).

    Returns:
        The step's ELBO (nats, full-data scale: the likelihood scaled by ``N / batch_size``).

    Raises:
        NonFiniteELBOError: the ELBO or a gradient is NaN/inf; names the step and the first
            non-finite site or parameter. The parameters are then back at those of the last
            finite loss (the start of step ``error.step - 1``); ``state.step`` and
            ``state.elbo`` are unchanged.
    """
    data, n = state.data, len(state.data)
    batch_size = state.settings["batch_size"]
    order, cursor = state.order, state.cursor
    with _entered(state):
        if cursor + batch_size > n:
            order, cursor = torch.randperm(n, device=state.device), 0
        idx = order[cursor : cursor + batch_size]
        parallel = state.parallel
        if parallel is not None:
            idx = parallel.rows(idx)
        args = (data.x[idx], data.y[idx], _mask(data, idx))
        state.optimizer.zero_grad(set_to_none=True)
        try:
            with pyro.validation_enabled(False):  # checked by the first, validated call
                loss = state.loss_fn(*args, num_data=n)
        except ValueError as e:
            if not is_invalid_parameter_error(e):
                raise
            raise _rolled_back(state, args, math.nan) from e
        if parallel is None:
            loss.backward()
            value = loss.item()
        else:
            (loss / parallel.world_size).backward()
            value = average_gradients(parallel, state.params, loss / parallel.world_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(state.params, math.inf)
        if not (math.isfinite(value) and torch.isfinite(grad_norm)):
            raise _rolled_back(state, args, value)
        with torch.no_grad():  # the parameters of the last finite loss, kept
            torch._foreach_copy_(state.last_finite, state.params)
        state.optimizer.step()
        state.scheduler.step()
        rng = _get_rng_state(state.device)
        if parallel is not None:
            broadcast_state(parallel, list(rng.values()))
    state.order, state.cursor, state.rng = order, cursor + batch_size, rng
    state.step += 1
    state.elbo.append(-value)
    return -value


@contextlib.contextmanager
def _entered(state: SVIState) -> Iterator[None]:
    """Run the block in ``state``'s param store and from its RNG state; restore the caller's."""
    outer = _get_rng_state(state.device)
    _set_rng_state(state.rng, state.device)
    try:
        with pyro.get_param_store().scope(state.param_store):
            yield
    finally:
        _set_rng_state(outer, state.device)


def _rolled_back(state: SVIState, args: tuple, value: float) -> NonFiniteELBOError:
    """The error of a non-finite step, the parameters set back to those of the last finite loss."""
    error = non_finite_error(state.model, state.guide, args, len(state.data), state.step, value)
    with torch.no_grad():
        torch._foreach_copy_(state.params, state.last_finite)
    return error


def _get_rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _mask(data: SequenceData, idx) -> torch.Tensor | None:
    return None if data.mask is None else data.mask[idx]


__all__ = ["SVIState", "svi_step"]
