"""Stochastic variational inference for models that follow the model protocol.

An SVI fit is a small state and one step on it, as in the ``posteriors`` library
(``vi/diag.py``): ``svi_init`` builds an ``SVIState`` (``inference.vi.state``: model copy,
guide, ELBO, Adam and its learning-rate schedule, mini-batch order, RNG and param-store state),
``svi_step`` advances it by one mini-batch, and the caller owns the loop. ``fit_svi`` is that
loop with a progress bar, checkpoints (``inference.vi.checkpoint``), Ctrl-C handling and a
``Posterior`` at the end.
"""

from __future__ import annotations

import inspect
import math
import os
import time

import torch

from probtransformer._progress import progress_bar
from probtransformer.data import SequenceData
from probtransformer.inference.distributed import joined, together
from probtransformer.inference.inputs import check_model, check_training_data, example_of
from probtransformer.inference.posterior.posterior import Posterior
from probtransformer.inference.vi.checkpoint import (
    load_checkpoint,
    restore_svi_checkpoint,
    save_svi_checkpoint,
)
from probtransformer.inference.vi.elbo import NonFiniteELBOError
from probtransformer.inference.vi.guides import GUIDES
from probtransformer.inference.vi.schedule import check_schedule
from probtransformer.inference.vi.state import SVIState, initial_state, svi_step
from probtransformer.validation import check_int

#: The settings ``_check_fit`` checks, in its order.
_CHECKED_SETTINGS = (
    "guide", "num_steps", "batch_size", "lr", "lr_decay", "lr_warmup", "lr_schedule",
    "num_particles",
)  # fmt: skip


def _check_fit(
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
    distributed=False,
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
    check_schedule(lr_decay, lr_warmup, lr_schedule)
    if not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True or False, got {distributed!r}")


def svi_init(model: torch.nn.Module, data: SequenceData, **settings) -> SVIState:
    """The state of an SVI fit before its first step.

    Deep-copies ``model`` and re-initialises it from ``seed`` on ``device``, then, under
    ``seed``: builds the guide, evaluates the ELBO once on the first ``batch_size`` sequences
    with Pyro's validation on (this creates the guide's parameters and checks model and guide),
    sets up Adam with the learning-rate schedule (``inference.vi.schedule.lr_scheduler``: an
    optional warm-up, then ``lr`` decaying to ``lr * lr_decay`` at step ``num_steps``), and
    draws the first mini-batch permutation.
    ``fit_svi`` is ``svi_init`` followed by ``num_steps`` calls of ``svi_step``.

    Args:
        model: a ``PyroModule`` following the model protocol; it is not modified.
        data: training split ``(N, ...)``; ``data.y`` required.
        **settings: ``fit_svi``'s keyword arguments ``guide``, ``num_steps``, ``batch_size``,
            ``lr``, ``lr_decay``, ``lr_warmup``, ``lr_schedule``, ``num_particles``,
            ``init_scale``, ``device``, ``seed``, ``init_from`` and ``distributed``, with its
            defaults and meanings.

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
    return initial_state(
        model,
        data,
        *checked,
        given["init_scale"],
        given["device"],
        given["seed"],
        given["init_from"],
        given["distributed"],
    )


def fit_svi(
    model: torch.nn.Module,
    data: SequenceData,
    *,
    guide: str = "normal",
    num_steps: int = 3000,
    batch_size: int = 128,
    lr: float = 3e-3,
    lr_decay: float = 0.1,
    lr_warmup: float = 0.0,
    lr_schedule: str = "exponential",
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
    the learning rate rises linearly over the first ``lr_warmup`` of the steps, then decays
    from ``lr`` to ``lr * lr_decay`` (``inference.vi.schedule.lr_scheduler``). The mean-field guide
    uses ``TraceMeanField_ELBO`` (analytic KL terms where Pyro has them; Hoffman et al. 2013;
    as ``inference.vi.elbo.MeanFieldELBO``, which skips the log densities that ELBO does not use),
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
        lr_decay: final learning rate as a fraction of ``lr``, in (0, 1] (exponential) or
            [0, 1] (cosine); 1 holds it constant after the warm-up.
        lr_warmup: the fraction of ``num_steps``, in [0, 1), over which the rate rises
            linearly to ``lr`` (``lr * (t + 1) / W`` at step ``t`` of the
            ``W = round(lr_warmup * num_steps)`` warm-up steps); it lets a higher ``lr`` train
            without the first steps' blow-up (the tagger's recipe, ``BENCHMARKS.md``).
        lr_schedule: ``"exponential"`` or ``"cosine"``: the decay after the warm-up.
        num_particles: ELBO particles per step.
        init_scale: initial guide standard deviation (unconstrained space). Adam moves each
            log-scale by at most about ``lr`` per step, so the guide's sds can grow to about
            ``init_scale * exp(sum of the step sizes)`` and no further: 0.033 from 1e-3 with
            the defaults (3,000 steps, lr 3e-3 decaying to 3e-4), a fraction 0.09 of the
            digits classifier's prior sd, which is what the main job fits (early-stopped VI,
            its ELBO still rising; ``benchmarks/BENCHMARKS.md``, issue 44). Fewer steps from
            1e-3 leave a point estimate (``diagnose`` WARNs); 0.1 lets the sds reach the
            ELBO's optimum.
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
        progress: show a tqdm bar with the running ELBO (on a terminal; otherwise a line on
            stderr every 30 s with the step, ELBO, rate and ETA: ``_progress.progress_bar``).
        checkpoint_every: write a checkpoint to ``checkpoint_dir`` every this many steps.
        checkpoint_dir: directory of the checkpoint (``inference.vi.checkpoint``; replaced
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
    settings = (guide, num_steps, batch_size, lr, lr_decay, lr_warmup, lr_schedule, num_particles)
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
    state = initial_state(
        model, data, *settings, init_scale, device, seed, init_from, distributed,
        resuming=resume_from is not None,
    )  # fmt: skip
    if resume_from is not None:
        restore_svi_checkpoint(state, resume_from)
    writes = state.parallel is None or state.parallel.is_main
    bar = progress_bar(
        range(state.step, num_steps),
        progress=progress and writes,
        desc="MAP" if guide == "delta" else "SVI",  # AutoDelta: a point estimate
        initial=state.step,
        total=num_steps,
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
        else:
            where = "; nothing was saved (checkpoint_every=N keeps the state every N steps)"
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


__all__ = ["NonFiniteELBOError", "SVIState", "fit_svi", "svi_init", "svi_step"]
