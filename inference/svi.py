"""Stochastic variational inference for models that follow the model protocol.

An SVI fit is a small state and one step on it, as in the ``posteriors`` library
(``vi/diag.py``): ``svi_init`` builds an ``SVIState`` (model copy, guide, ELBO, Adam and its
learning-rate schedule, mini-batch order, RNG and param-store state), ``svi_step`` advances it
by one mini-batch, and the caller owns the loop. ``fit_svi`` is that loop with a progress bar,
checkpoints (``inference.checkpoint``), Ctrl-C handling and a ``Posterior`` at the end.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import Trace_ELBO
from tqdm.auto import tqdm

from probtransformer.datasets import SequenceData
from probtransformer.inference._runtime import (
    is_invalid_parameter_error,
    reinitialised_copy,
    resolve_device,
    seeded,
)
from probtransformer.inference.checkpoint import (
    data_fingerprint,
    load_checkpoint,
    restore_svi_checkpoint,
    save_svi_checkpoint,
)
from probtransformer.inference.distributed import (
    DataParallel,
    agree,
    average_gradients,
    broadcast_state,
    check_same_fit,
    data_parallel,
    joined,
    together,
)
from probtransformer.inference.elbo import MeanFieldELBO, NonFiniteELBOError, non_finite_error
from probtransformer.inference.guides import GUIDES, build_guide, has_local_latents
from probtransformer.inference.inputs import (
    check_model,
    check_training_data,
    example_of,
)
from probtransformer.inference.posterior import Posterior
from probtransformer.inference.warm_start import warm_start
from probtransformer.validation import check_int


@dataclass(eq=False)
class SVIState:
    """Everything an SVI fit carries from one step to the next.

    Built by ``svi_init``, advanced in place by ``svi_step``, saved and restored by
    ``inference.checkpoint.save_svi_checkpoint`` / ``restore_svi_checkpoint``.

    Attributes:
        model: the fit's own re-initialised copy of the model, in training mode, on the device.
        guide: the variational guide (an autoguide, or ``AmortizedGuide`` for local latents).
        loss_fn: negative ELBO of a mini-batch, ``loss_fn(x, y, mask, num_data=N)`` -> scalar
            tensor (nats, full-data scale); a Pyro ``ELBOModule`` of ``model`` and ``guide``.
        params: the trainable parameters of ``loss_fn`` (model and guide), in optimizer order.
        optimizer: Adam over ``params``.
        scheduler: exponential decay of the learning rate, ``lr`` -> ``lr * lr_decay`` at step
            ``num_steps`` (steps past it keep decaying).
        data: the training split on the device.
        settings: ``guide``, ``num_steps``, ``batch_size`` (capped at ``N``), ``lr``,
            ``lr_decay``, ``num_particles``, ``init_scale``, ``seed``.
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


#: The settings ``_check_fit`` checks, in its order.
_CHECKED_SETTINGS = ("guide", "num_steps", "batch_size", "lr", "lr_decay", "num_particles")


def _check_fit(
    model, data, guide, num_steps, batch_size, lr, lr_decay, num_particles, distributed=False
) -> None:
    """The checks of ``svi_init``'s arguments, in the order their errors are reported."""
    check_model(model)
    check_training_data(model, data)
    if guide not in GUIDES:
        raise ValueError(f"guide must be one of {GUIDES}, got {guide!r}")
    for name, value in (
        ("num_steps", num_steps),
        ("batch_size", batch_size),
        ("num_particles", num_particles),
    ):
        check_int(name, value, type_error=True)
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if not (isinstance(lr_decay, (int, float)) and 0 < lr_decay <= 1):
        raise ValueError(f"lr_decay must be in (0, 1], got {lr_decay!r}")
    if not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True or False, got {distributed!r}")


def svi_init(model: torch.nn.Module, data: SequenceData, **settings) -> SVIState:
    """The state of an SVI fit before its first step.

    Deep-copies ``model`` and re-initialises it from ``seed`` on ``device``, then, under
    ``seed``: builds the guide, evaluates the ELBO once on the first ``batch_size`` sequences
    with Pyro's validation on (this creates the guide's parameters and checks model and guide),
    sets up Adam with an exponential learning-rate decay (``lr`` to ``lr * lr_decay`` at step
    ``num_steps``, decaying on past it), and draws the first mini-batch permutation.
    ``fit_svi`` is ``svi_init`` followed by ``num_steps`` calls of ``svi_step``.

    Args:
        model: a ``PyroModule`` following the model protocol; it is not modified.
        data: training split ``(N, ...)``; ``data.y`` required.
        **settings: ``fit_svi``'s keyword arguments ``guide``, ``num_steps``, ``batch_size``,
            ``lr``, ``lr_decay``, ``num_particles``, ``init_scale``, ``device``, ``seed``,
            ``init_from`` and ``distributed``, with its defaults and meanings.

    Returns:
        An ``SVIState`` with ``step == 0``; the caller's torch RNG and Pyro param store are
        left as they were.

    Raises:
        TypeError: an unknown keyword; TypeError/ValueError: bad model, data or settings (the
            message names the argument).
        NonFiniteELBOError: the first ELBO evaluation is non-finite.
    """
    try:
        bound = _INIT_SIGNATURE.bind(model, data, **settings)
    except TypeError as e:
        raise TypeError(f"svi_init(): {e}") from None
    bound.apply_defaults()
    given = bound.arguments
    checked = tuple(given[name] for name in _CHECKED_SETTINGS)
    with together(joined(given["distributed"]), "svi_init's argument checks"):
        _check_fit(model, data, *checked, given["distributed"])
    return _init(
        model,
        data,
        *checked,
        given["init_scale"],
        given["device"],
        given["seed"],
        given["init_from"],
        given["distributed"],
    )


def _init(
    model,
    data,
    guide,
    num_steps,
    batch_size,
    lr,
    lr_decay,
    num_particles,
    init_scale,
    device,
    seed,
    init_from=None,
    distributed=False,
    *,
    resuming=False,
) -> SVIState:
    """``svi_init`` on checked arguments (``resuming``: ``fit_svi`` restores a checkpoint next,
    which every rank of a data-parallel fit must do)."""
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
        scheduler = torch.optim.lr_scheduler.ExponentialLR(
            optimizer, gamma=lr_decay ** (1.0 / num_steps)
        )
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


def fit_svi(
    model: torch.nn.Module,
    data: SequenceData,
    *,
    guide: str = "normal",
    num_steps: int = 3000,
    batch_size: int = 128,
    lr: float = 3e-3,
    lr_decay: float = 0.1,
    num_particles: int = 1,
    init_scale: float = 1e-3,
    device: str | torch.device = "auto",
    seed: int = 0,
    init_from: Posterior | None = None,
    distributed: bool = False,
    progress: bool = True,
    checkpoint_every: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    resume_from: str | os.PathLike | None = None,
) -> Posterior:
    """Fit ``model`` to ``data`` by stochastic variational inference.

    The model is deep-copied and re-initialised from ``seed``, then trained with Adam on
    mini-batches (likelihood scaled by ``N / batch_size`` through the model's data plate) while
    the learning rate decays exponentially from ``lr`` to ``lr * lr_decay``. The mean-field guide
    uses ``TraceMeanField_ELBO`` (analytic KL terms where Pyro has them; Hoffman et al. 2013;
    as ``inference.elbo.MeanFieldELBO``, which skips the log densities that ELBO does not use),
    the others and models with local latents (stochastic attention, amortized guide)
    ``Trace_ELBO``; ``num_particles > 1`` vectorizes the particles. Pyro's validation (model
    and guide sites match, shapes, supports; on unless ``pyro.enable_validation(False)``)
    checks the first evaluation, which creates the guide; the steps after it skip those checks
    (shapes do not change between mini-batches, and non-finite values are caught each step).
    Point-estimate parameters of the model are optimised jointly (type-II MAP). Runs in its own
    param-store scope: the global Pyro param store is never read or written. The fit is
    ``svi_init`` followed by ``num_steps`` calls of ``svi_step``.

    Args:
        model: a ``PyroModule`` following the model protocol (``docs/protocol.md``).
        data: training split; ``data.y`` required.
        guide: ``"normal"`` | ``"lowrank"`` | ``"mvn"`` | ``"delta"`` (see ``build_guide``).
        num_steps: optimisation steps.
        batch_size: sequences per step (capped at ``len(data)``).
        lr: initial Adam learning rate.
        lr_decay: final learning rate as a fraction of ``lr``, in (0, 1].
        num_particles: ELBO particles per step.
        init_scale: initial guide standard deviation.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` ...
        seed: seeds initialisation, mini-batches and ELBO samples.
        init_from: a fitted ``Posterior`` of a model with the same class and config to start
            from (a warm start, e.g. from ``fit_map``): the model's point-estimate parameters
            start at its values, and the guide's locations at its posterior mean of each
            latent site (the point itself for MAP), in place of the prior draws; the guide's
            scales still start at ``init_scale``. ``record["init_from"]`` names its method.
        distributed: data-parallel SVI over the initialised default ``torch.distributed``
            process group (``torchrun``; gloo on CPU, NCCL on GPUs). Every rank calls
            ``fit_svi`` with the same model, data and settings (checked); each evaluates its
            slice of the global mini-batch the single-process fit draws (same permutation and
            seed), the gradients are all-reduced (the likelihood scaled by N over the global
            batch, the KL counted once), and every rank takes the same step and returns the
            same ``Posterior`` (the numbers of a single-process fit, up to float rounding, when
            nothing in the model draws per row: no dropout, no local latents; otherwise each
            rank's per-row draws start from rank 0's RNG state). ``batch_size`` must be
            divisible by the world size. Only rank 0 shows progress and writes checkpoints; a
            checkpoint resumes under any world size, or in one process.
        progress: show a tqdm bar with the running ELBO.
        checkpoint_every: write a checkpoint to ``checkpoint_dir`` every this many steps.
        checkpoint_dir: directory of the checkpoint (``inference.checkpoint``; replaced
            atomically each time). Ctrl-C also saves the state at the start of the step it
            interrupted.
        resume_from: a checkpoint directory of this fit (same model config, data and
            settings): continue from its step to the numbers an uninterrupted fit gives.

    Returns:
        A ``Posterior`` holding the fitted model and guide; ``record["elbo"]`` is the ELBO per
        step (nats, full-data scale).

    Raises:
        TypeError/ValueError: bad model, data or settings; ``resume_from`` not a checkpoint of
            this model, data and settings (the message names what differs).
        NonFiniteELBOError: the ELBO or a gradient became NaN/inf; names the step and site, and
            carries ``posterior``: the fit with the parameters of the last finite loss.
        KeyboardInterrupt: Ctrl-C; says where the state was saved when ``checkpoint_dir`` is set.
        ValueError: ``distributed=True`` without a process group, a batch size that the world
            size does not divide, or ranks with different data, model, settings or
            ``resume_from`` checkpoints (naming the rank and what differs).
        distributed.RankLostError: a peer rank died or stopped answering within the process
            group's timeout (naming it); the last checkpoint is left as it was.
    """
    settings = (guide, num_steps, batch_size, lr, lr_decay, num_particles)
    with together(joined(distributed), "fit_svi's argument checks"):
        _check_fit(model, data, *settings, distributed)
        if checkpoint_every is not None:
            check_int("checkpoint_every", checkpoint_every, type_error=True)
            if checkpoint_dir is None:
                raise ValueError("checkpoint_every needs checkpoint_dir: where to write them")
        for name, value in (("checkpoint_dir", checkpoint_dir), ("resume_from", resume_from)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name} must be a str or os.PathLike, got {type(value).__name__}")
        if resume_from is not None:
            load_checkpoint(resume_from)  # fail before any work when it is not a checkpoint

    start = time.perf_counter()
    state = _init(
        model, data, *settings, init_scale, device, seed, init_from, distributed,
        resuming=resume_from is not None,
    )  # fmt: skip
    if resume_from is not None:
        restore_svi_checkpoint(state, resume_from)
    writes = state.parallel is None or state.parallel.is_main
    # disable=None: no bar when output is not a terminal (logs stay readable)
    bar = tqdm(
        range(state.step, num_steps),
        desc="SVI",
        initial=state.step,
        total=num_steps,
        disable=None if progress and writes else True,
        leave=False,
    )
    try:
        for step in bar:
            value = svi_step(state)
            if step % 25 == 0 or step == num_steps - 1:
                bar.set_postfix(elbo=f"{value:.4g}")
            if checkpoint_every and writes and state.step % checkpoint_every == 0:
                save_svi_checkpoint(state, checkpoint_dir)
    except NonFiniteELBOError as e:
        e.posterior = _posterior(state, max(e.step - 1, 0), start)
        raise
    except KeyboardInterrupt as e:
        # the parameters are those at the start of the interrupted step
        where = ""
        if checkpoint_dir is not None and writes:
            save_svi_checkpoint(state, checkpoint_dir)
            where = f"; saved to {checkpoint_dir} (resume_from=...)"
        elif checkpoint_dir is not None:
            where = f"; only rank 0 writes checkpoints (to {checkpoint_dir}, when it stops too)"
        raise KeyboardInterrupt(f"fit_svi interrupted at step {state.step}{where}") from e
    return _posterior(state, num_steps, start)


#: ``svi_init``'s signature: ``fit_svi``'s without the arguments of the loop around the steps.
_INIT_SIGNATURE = inspect.signature(fit_svi).replace(
    parameters=[
        p
        for p in inspect.signature(fit_svi).parameters.values()
        if p.name not in ("progress", "checkpoint_every", "checkpoint_dir", "resume_from")
    ],
    return_annotation="SVIState",
)
svi_init.__signature__ = _INIT_SIGNATURE


def _posterior(state: SVIState, steps_done: int, start: float) -> Posterior:
    train = state.data
    record = dict(
        method="svi",
        x_range=[float(train.x.min()), float(train.x.max())],
        **state.settings,
        num_data=len(train),
        steps_done=steps_done,
        seconds=time.perf_counter() - start,
        elbo=list(state.elbo[:steps_done]),
    )
    if state.parallel is not None:
        record["world_size"] = state.parallel.world_size
    return Posterior(state.model, guide=state.guide, record=record, example=example_of(train))


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


__all__ = ["NonFiniteELBOError", "SVIState", "fit_svi", "svi_init", "svi_step"]
