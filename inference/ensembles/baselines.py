"""Baselines behind the same ``Posterior`` API: MAP, MC dropout and deep ensembles.

Each is ``fit_*(model, data, **settings)`` like ``fit_svi`` and returns a ``Posterior``, so
predictions, attention, ArviZ export, diagnostics and saving work the same way. All three build
on ``fit_map``, which is ``fit_svi(guide="delta")``: the same settings, defaults and checks.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import torch

from probtransformer.data import SequenceData
from probtransformer.inference.ensembles.batched import MembersDoNotVectorize, fit_batched
from probtransformer.inference.inputs import check_model
from probtransformer.inference.posterior.posterior import Posterior
from probtransformer.inference.posterior.prediction import dropout_modules
from probtransformer.inference.vi.guides import has_local_latents
from probtransformer.inference.vi.svi import fit_svi
from probtransformer.validation import check_int

#: ``fit_svi``'s options that only the sequential ensemble (one ``fit_map`` per member) takes.
_CHECKPOINT_OPTIONS = ("checkpoint_every", "checkpoint_dir", "resume_from")

#: ``fit_svi``'s signature without ``guide``: what ``fit_map`` and ``fit_mc_dropout`` accept.
_MAP_SIGNATURE = inspect.signature(fit_svi).replace(
    parameters=[p for p in inspect.signature(fit_svi).parameters.values() if p.name != "guide"]
)


def fit_map(model: torch.nn.Module, data: SequenceData, **kwargs) -> Posterior:
    """Maximum a posteriori fit: ``fit_svi(model, data, guide="delta", **kwargs)``.

    An ``AutoDelta`` guide puts a point mass on every latent site; SVI with it maximises the log
    joint density ``log p(data, theta)`` (prior included), while the model's plain parameters are
    optimised jointly as in every SVI fit. The model is deep-copied and re-initialised from
    ``seed``: two calls with the same settings give the same numbers on one machine.

    Args:
        model: a ``PyroModule`` following the model protocol (``docs/protocol.md``).
        data: training split; ``data.y`` required.
        **kwargs: every keyword argument of ``fit_svi`` except ``guide`` (``num_steps``,
            ``batch_size``, ``lr``, ``lr_decay``, ``num_particles``, ``init_scale``, ``device``,
            ``seed``, ``progress``), with its defaults.

    Returns:
        A point-estimate ``Posterior`` (``is_point_estimate``; predictions use one draw, so
        ``probs`` is ``(1, N, C)`` and the epistemic part is 0 — except for models with local
        latents, stochastic attention, whose logits keep their amortized guide);
        ``record["method"] == "map"``, ``record["elbo"]`` the log joint per step (nats,
        full-data scale).

    Raises:
        TypeError: ``guide=`` given (MAP is always the point mass), an unknown keyword, or a
            bad model or data; ValueError: bad settings (see ``fit_svi``).
        NonFiniteELBOError: the objective or a gradient became NaN/inf.
    """
    if "guide" in kwargs:
        raise TypeError(
            "fit_map() got an unexpected keyword argument 'guide': MAP always uses the point-mass "
            "AutoDelta guide; use fit_svi(guide=...) for another variational family"
        )
    try:
        _MAP_SIGNATURE.bind(model, data, **kwargs)
    except TypeError as e:
        raise TypeError(f"fit_map(): {e}") from None
    posterior = fit_svi(model, data, guide="delta", **kwargs)
    posterior.record["method"] = "map"
    return posterior


fit_map.__signature__ = _MAP_SIGNATURE


def fit_mc_dropout(model: torch.nn.Module, data: SequenceData, **kwargs) -> Posterior:
    """Monte Carlo dropout (Gal & Ghahramani 2016, "Dropout as a Bayesian approximation").

    Fits the model by MAP (``fit_map``; its dropout modules are active during training as in
    any fit), then keeps the model's own ``torch.nn.Dropout`` modules active at prediction: each
    posterior draw is one forward pass with fresh dropout masks, all other modules in eval mode.
    Draws are reproducible through the ``seed`` of ``predict``/``attention``/... and differ from
    each other. The latent sites hold their MAP values in every draw (``draws`` repeats them);
    the spread comes from the masks. Attention weights are recorded before attention dropout, so
    the first layer's attention is the same in every draw.

    Args:
        model: a ``PyroModule`` following the model protocol with at least one
            ``torch.nn.Dropout`` of ``p > 0`` (e.g. ``SequenceClassifier(..., dropout=0.1)``).
        data: training split; ``data.y`` required.
        **kwargs: the keyword arguments of ``fit_map`` (those of ``fit_svi`` except ``guide``).

    Returns:
        A ``Posterior`` with ``mc_dropout=True`` (not a point estimate): ``predict(x,
        num_samples=S)`` runs ``S`` passes, ``probs (S, N, C)``; ``to_inference_data`` has one
        chain of ``S`` draws. ``record["method"] == "mc-dropout"``, ``record["dropout"]`` the
        dropout probabilities in the model, plus ``fit_map``'s record.

    Raises:
        ValueError: the model has no ``nn.Dropout`` with ``p > 0``; bad settings (``fit_svi``).
        TypeError: ``guide=``, an unknown keyword, or a bad model or data.
        NonFiniteELBOError: the MAP objective or a gradient became NaN/inf.
    """
    check_model(model)
    modules = dropout_modules(model)
    if not modules:
        raise ValueError(
            f"MC dropout needs dropout in the model: {type(model).__name__} has no "
            "torch.nn.Dropout module with p > 0; build it with dropout > 0, e.g. "
            "SequenceClassifier(..., dropout=0.1)"
        )
    fitted = fit_map(model, data, **kwargs)
    record = dict(fitted.record, method="mc-dropout", dropout=sorted({m.p for m in modules}))
    return Posterior(
        fitted.model, guide=fitted.guide, record=record, example=fitted.example, mc_dropout=True
    )


fit_mc_dropout.__signature__ = _MAP_SIGNATURE


def fit_ensemble(
    model: torch.nn.Module,
    data: SequenceData,
    *,
    n_members: int = 5,
    seed: int = 0,
    progress: bool = True,
    batched: bool | None = None,
    **kwargs,
) -> Posterior:
    """Deep ensemble (Lakshminarayanan, Pritzel & Blundell 2017) of ``n_members`` MAP fits.

    Member ``k`` is a MAP fit started as ``fit_map(model, data, seed=seed + k, **kwargs)``
    starts: its own re-initialised copy of the model and its own ``AutoDelta`` locations. The
    members are the posterior draws. Both their latent values and their point-estimate
    parameters (the model's plain ``nn.Parameter``s: embedding, FFN, LayerNorm by default)
    differ, so the ``Posterior`` keeps every member's parameters (``members``) and copies them
    into the model for that member's forward pass.

    Batched (``inference.ensembles.batched``): the M fits run as one optimisation through the
    draw dim, members as draws (latents ``(M, 1, *shape)``, plain parameters too), sharing each
    step's mini-batch; one pass of M members costs less than M passes. Sequential: member ``k``
    is ``fit_map(..., seed=seed + k)`` with its own mini-batch order. The two start alike but
    are not equal number for number (shared batches and dropout stream);
    ``benchmarks/BENCHMARKS.md`` compares their quality and seconds.

    Args:
        model: a ``PyroModule`` following the model protocol.
        data: training split; ``data.y`` required.
        n_members: ensemble size ``M``.
        seed: member ``k`` is fitted with seed ``seed + k``.
        progress: show a tqdm bar (one per member when sequential).
        batched: True: the batched path (ValueError when the model cannot take it); False: the
            sequential fits (with ``checkpoint_dir``/``resume_from``, member ``k`` checkpoints
            to and resumes from its subdirectory ``member-k``); None: batched unless checkpoint
            options are given or the probe at the starting values finds the model does not
            vectorize over members (then sequential, with ``record["batched"]`` False and the
            reason in ``record["batched_skipped"]``).
        **kwargs: the other keyword arguments of ``fit_map`` (``fit_svi``'s except ``guide``).

    Returns:
        A ``Posterior`` with ``samples {site: (1, M, *shape)}`` and ``members {name: (1, M,
        *shape)}``: one chain of ``M`` draws. ``predict`` uses every member by default; a
        smaller ``num_samples`` thins them evenly, never more draws than members.
        ``record["method"] == "ensemble"``, ``record["members"]`` each member's ``seed``,
        ``final_loss`` (negative log joint of its last step, nats) and ``seconds`` (batched:
        the total over M); ``record["seconds"]`` the total; ``record["batched"]``.

    Raises:
        TypeError: ``n_members`` not an int, ``batched`` not a bool or None, ``guide=``, an
            unknown keyword, bad model or data; ``batched=True`` with checkpoint options.
        ValueError: ``n_members < 1``; a model with local latents (stochastic attention); bad
            settings (``fit_svi``); ``batched=True`` and a model that does not vectorize over
            members (names the site); ``distributed=True``.
        NonFiniteELBOError: a member's objective or gradient became NaN/inf.
    """
    check_int("n_members", n_members, type_error=True)
    if has_local_latents(model):
        raise ValueError(
            "fit_ensemble keeps each member's point estimates but not an amortized guide, so the "
            "local latents of stochastic attention would be drawn from their prior: fit such "
            "models with fit_svi, fit_mc_dropout or fit_mcmc"
        )
    if batched is not None and not isinstance(batched, bool):
        raise TypeError(f"batched must be True, False or None, got {batched!r}")
    try:
        _MAP_SIGNATURE.bind(model, data, **kwargs)
    except TypeError as e:
        raise TypeError(f"fit_ensemble(): {e}") from None
    if kwargs.get("distributed") is True:
        raise ValueError(
            "fit_ensemble does not run data-parallel (its members would be fitted whole on "
            "every rank): run it in one process, or run one fit_map(distributed=True) per member"
        )
    checkpointing = sorted(k for k in kwargs if k in _CHECKPOINT_OPTIONS)
    if batched and checkpointing:
        raise TypeError(
            f"fit_ensemble(batched=True) does not checkpoint; got {', '.join(checkpointing)}: "
            "pass batched=False to checkpoint each member's fit"
        )
    skipped = "checkpoint options given" if checkpointing else None
    if batched is not False and not checkpointing:
        try:
            return fit_batched(
                model, data, n_members=n_members, seed=seed, progress=progress, **kwargs
            )
        except MembersDoNotVectorize as e:
            if batched:
                raise
            skipped = " ".join(str(e).split())
    start = time.perf_counter()
    fits = [
        fit_map(model, data, seed=seed + k, progress=progress, **_member_checkpoints(kwargs, k))
        for k in range(n_members)
    ]
    seconds = time.perf_counter() - start
    draws = [fit.draws(1) for fit in fits]  # {site: (1, 1, *shape)} each
    samples = {site: torch.cat([d[site] for d in draws], dim=1) for site in draws[0]}
    states = [dict(fit.model.named_parameters()) for fit in fits]
    members = {name: torch.stack([s[name].detach() for s in states])[None] for name in states[0]}
    record = {k: v for k, v in fits[0].record.items() if k not in ("elbo", "seconds")}
    record.update(
        method="ensemble",
        seed=seed,
        n_members=n_members,
        batched=False,
        **({"batched_skipped": skipped} if skipped and batched is None else {}),
        members=[
            dict(
                seed=fit.record["seed"],
                final_loss=-fit.record["elbo"][-1],
                seconds=fit.record["seconds"],
            )
            for fit in fits
        ],
        seconds=seconds,
    )
    first = fits[0]
    return Posterior(
        first.model, samples=samples, members=members, record=record, example=first.example
    )


def _member_checkpoints(kwargs: dict, k: int) -> dict:
    """``kwargs`` with ``checkpoint_dir`` and ``resume_from`` pointing at member ``k``'s own
    subdirectory ``member-k``: one directory for all members would keep only the last."""
    out = dict(kwargs)
    for key in ("checkpoint_dir", "resume_from"):
        if out.get(key) is not None:
            out[key] = Path(out[key]) / f"member-{k}"
    return out


__all__ = ["fit_ensemble", "fit_map", "fit_mc_dropout"]
