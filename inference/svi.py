"""Stochastic variational inference for models that follow the model protocol."""

from __future__ import annotations

import math
import os
import time

import pyro
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO
from tqdm.auto import tqdm

from probtransformer.datasets import SequenceData
from probtransformer.inference._runtime import (
    is_invalid_parameter_error,
    pyro_scope,
    reinitialised_copy,
    resolve_device,
    seeded,
)
from probtransformer.inference.checkpoint import (
    check_compatible,
    data_fingerprint,
    load_checkpoint,
    save_checkpoint,
)
from probtransformer.inference.elbo import MeanFieldELBO
from probtransformer.inference.guides import GUIDES, build_guide, has_local_latents
from probtransformer.inference.model_checks import check_model_structure
from probtransformer.inference.posterior import Posterior, check_data, check_model, example_of


class NonFiniteELBOError(FloatingPointError):
    """The ELBO or its gradient became NaN/inf during a fit.

    Attributes:
        step: the optimisation step (0-based) at which it happened.
        site: the first sample site or parameter found non-finite, or None.
        posterior: the fit with the parameters whose loss was last finite (those of step
            ``step - 1``), set by ``fit_svi``; None when raised elsewhere.
    """

    def __init__(self, message: str, *, step: int, site: str | None) -> None:
        super().__init__(message)
        self.step = step
        self.site = site
        self.posterior: Posterior | None = None


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_data(model: torch.nn.Module, data: SequenceData) -> None:
    check_data(data)
    if data.y is None:
        raise ValueError("data.y is None: fitting needs observed targets")
    if len(data) == 0:
        raise ValueError("data is empty (N = 0): fitting needs at least one observation")
    if hasattr(model, "validate"):
        model.validate(data.x, data.y, data.mask)
    check_model_structure(model, data)


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
    param-store scope: the global Pyro param store is never read or written.

    Args:
        model: a ``PyroModule`` following the model protocol (DESIGN.md).
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
    """
    check_model(model)
    _check_data(model, data)
    if guide not in GUIDES:
        raise ValueError(f"guide must be one of {GUIDES}, got {guide!r}")
    for name, value in (
        ("num_steps", num_steps),
        ("batch_size", batch_size),
        ("num_particles", num_particles),
    ):
        _check_positive_int(name, value)
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if not (isinstance(lr_decay, (int, float)) and 0 < lr_decay <= 1):
        raise ValueError(f"lr_decay must be in (0, 1], got {lr_decay!r}")

    if checkpoint_every is not None:
        _check_positive_int("checkpoint_every", checkpoint_every)
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir: where to write checkpoints")
    for name, value in (("checkpoint_dir", checkpoint_dir), ("resume_from", resume_from)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"{name} must be a str or os.PathLike, got {type(value).__name__}")
    if resume_from is not None:
        load_checkpoint(resume_from)  # fail before any work when it is not a checkpoint

    device = resolve_device(device)
    model = reinitialised_copy(model, seed, device)
    model.train()
    train = data.to(device)
    n = len(train)
    batch_size = min(batch_size, n)
    # the amortized guide of local latents is not mean-field: its logits depend on the globals
    mean_field = guide == "normal" and not has_local_latents(model)
    elbo_cls = MeanFieldELBO if mean_field else Trace_ELBO
    elbo = elbo_cls(num_particles=num_particles, vectorize_particles=num_particles > 1)
    trace: list[float] = []
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
    identity = dict(  # what a checkpoint must share with this fit to resume it
        model_class=f"{type(model).__module__}.{type(model).__qualname__}",
        config=model.config,
        settings=settings,
        data=data_fingerprint(data),
    )
    start = time.perf_counter()
    with pyro_scope(), seeded(seed, device):
        autoguide = build_guide(guide, model, init_scale=init_scale)
        loss_fn = elbo(model, autoguide)

        def loss_at(step: int, args: tuple) -> torch.Tensor:
            try:
                return loss_fn(*args, num_data=n)
            except ValueError as e:
                if not is_invalid_parameter_error(e):
                    raise
                raise _non_finite(model, autoguide, args, n, step, math.nan) from e

        first = slice(0, batch_size)
        loss_at(0, (train.x[first], train.y[first], _mask(train, first)))  # creates guide params
        params = [p for p in loss_fn.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(params, lr=lr)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(
            optimizer, gamma=lr_decay ** (1.0 / num_steps)
        )
        order = torch.randperm(n, device=device)
        cursor, done = 0, 0
        if resume_from is not None:
            saved, state = load_checkpoint(resume_from)
            check_compatible(saved, identity, resume_from)
            model.load_state_dict(state["model_state"])
            autoguide.load_state_dict(state["guide_state"])
            optimizer.load_state_dict(state["optimizer_state"])
            scheduler.load_state_dict(state["scheduler_state"])
            order, cursor, done = state["order"].to(device), state["cursor"], saved["step"]
            trace = list(saved["elbo"])
            _set_rng_state(state["rng"], device)

        def checkpoint(step: int, rng: dict, order: torch.Tensor, cursor: int) -> None:
            """Save the state at the start of ``step`` (``step`` steps completed)."""
            save_checkpoint(
                checkpoint_dir,
                {**identity, "step": step, "elbo": trace[:step]},
                dict(
                    model_state=model.state_dict(),
                    guide_state=autoguide.state_dict(),
                    optimizer_state=optimizer.state_dict(),
                    scheduler_state=scheduler.state_dict(),
                    rng=rng,
                    order=order.cpu(),
                    cursor=cursor,
                ),
            )

        # disable=None: no bar when output is not a terminal (logs stay readable)
        bar = tqdm(
            range(done, num_steps),
            desc="SVI",
            initial=done,
            total=num_steps,
            disable=None if progress else True,
            leave=False,
        )
        step, at_start = done, (_get_rng_state(device), order, cursor)
        last_finite = [p.detach().clone() for p in params]
        try:
            for step in bar:
                at_start = (_get_rng_state(device), order, cursor)
                if cursor + batch_size > n:
                    order, cursor = torch.randperm(n, device=device), 0
                idx = order[cursor : cursor + batch_size]
                cursor += batch_size
                args = (train.x[idx], train.y[idx], _mask(train, idx))
                optimizer.zero_grad(set_to_none=True)
                with pyro.validation_enabled(False):  # checked by the first, validated call
                    loss = loss_at(step, args)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, math.inf)
                value = loss.item()
                if not (math.isfinite(value) and torch.isfinite(grad_norm)):
                    raise _non_finite(model, autoguide, args, n, step, value)
                with torch.no_grad():  # the parameters of the last finite loss, kept
                    torch._foreach_copy_(last_finite, params)
                optimizer.step()
                scheduler.step()
                trace.append(-value)
                if step % 25 == 0 or step == num_steps - 1:
                    bar.set_postfix(elbo=f"{-value:.4g}")
                if checkpoint_every and (step + 1) % checkpoint_every == 0:
                    checkpoint(step + 1, _get_rng_state(device), order, cursor)
        except NonFiniteELBOError as e:
            # back to the parameters whose loss was last finite (those of step - 1)
            with torch.no_grad():
                torch._foreach_copy_(params, last_finite)
            steps = max(step - 1, 0)
            e.posterior = _posterior(model, autoguide, train, trace, steps, start, settings)
            raise
        except KeyboardInterrupt as e:
            # the parameters are those at the start of ``step``
            if checkpoint_dir is not None:
                checkpoint(step, *at_start)
            where = f"; saved to {checkpoint_dir} (resume_from=...)" if checkpoint_dir else ""
            raise KeyboardInterrupt(f"fit_svi interrupted at step {step}{where}") from e
    return _posterior(model, autoguide, train, trace, num_steps, start, settings)


def _posterior(model, guide, train, trace, steps_done, start, settings) -> Posterior:
    record = dict(
        method="svi",
        x_range=[float(train.x.min()), float(train.x.max())],
        **settings,
        num_data=len(train),
        steps_done=steps_done,
        seconds=time.perf_counter() - start,
        elbo=list(trace[:steps_done]),
    )
    return Posterior(model, guide=guide, record=record, example=example_of(train))


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


def _non_finite(model, guide, args, num_data, step, value) -> NonFiniteELBOError:
    """Build the error for a non-finite step, naming the first offending site or parameter."""
    site = _first_non_finite_site(model, guide, args, num_data)
    what = "ELBO" if not math.isfinite(value) else "ELBO gradient"
    return NonFiniteELBOError(
        f"{what} became non-finite at step {step}"
        + (f" (first non-finite: {site})" if site else "")
        + "; try a lower lr, a smaller init_scale, or tighter priors",
        step=step,
        site=site,
    )


def _first_non_finite_site(model, guide, args, num_data) -> str | None:
    for name, param in list(model.named_parameters()) + list(guide.named_parameters()):
        if not torch.isfinite(param).all():
            return f"parameter {name!r}"
        if param.grad is not None and not torch.isfinite(param.grad).all():
            return f"gradient of parameter {name!r}"
    with torch.no_grad(), pyro.validation_enabled(False):
        guide_trace = poutine.trace(guide).get_trace(*args, num_data=num_data)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(
            *args, num_data=num_data
        )
        for trace in (guide_trace, model_trace):
            trace.compute_log_prob()
            for name, site in trace.nodes.items():
                if site["type"] != "sample":
                    continue
                if not torch.isfinite(site["value"]).all():
                    return f"sample site {name!r} (value)"
                if not torch.isfinite(site["log_prob_sum"]).all():
                    return f"sample site {name!r} (log density)"
    return None


__all__ = ["NonFiniteELBOError", "fit_svi"]
