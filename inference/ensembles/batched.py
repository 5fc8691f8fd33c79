"""The M MAP fits of a deep ensemble as one batched optimisation through the draw dim.

``fit_ensemble(batched=True)`` (its default where the model allows it) starts member ``k`` as
``fit_map(seed=seed + k)`` starts: the model re-initialised from ``seed + k`` and the
``AutoDelta`` locations drawn under that seed (``svi_init``). Then every member is one draw of
the draw dim: latents as ``(M, D)`` unconstrained states, the model's plain parameters as
``(M, 1, *shape)`` tensors (``VectorizedDensity(parameters=...)``), so one forward and backward
pass serves all M. Adam is elementwise and each member's log joint depends only on its own
values, so the M fits are M separate MAP fits, except that they share each step's mini-batch
(drawn under ``seed``) and the members' dropout masks come from one stream: the members are
not the sequential ones number for number. The objective is ``fit_map``'s: the log joint
density of the constrained values (no log-Jacobian) with the likelihood scaled by N / B.

On CPU the gain is the draw dim's: one pass of M draws costs less than M passes (figures in
``benchmarks/BENCHMARKS.md``); on a GPU the M members cost about one.
"""

from __future__ import annotations

import time

import pyro
import torch

from probtransformer.data import SequenceData
from probtransformer.inference._runtime import seeded
from probtransformer.inference.inputs import example_of
from probtransformer.inference.mcmc.density import VectorizedDensity
from probtransformer.inference.mcmc.starts import map_fit
from probtransformer.inference.posterior.posterior import Posterior
from probtransformer.inference.vi.elbo import NonFiniteELBOError
from probtransformer.inference.vi.svi import svi_init


class MembersDoNotVectorize(ValueError):
    """The model's log joint under M members as draws differs from M separate evaluations, or
    fails: its plain parameters or latents do not broadcast through the draw dim."""


def fit_batched(
    model: torch.nn.Module, data: SequenceData, *, n_members: int, seed: int, progress: bool, **kw
) -> Posterior:
    """``fit_ensemble``'s batched path (see the module docstring); ``kw`` are ``fit_map``'s
    settings, already checked by ``fit_ensemble``.

    Raises:
        MembersDoNotVectorize: the model does not vectorize over members (the probe at the
            starting values names the site; ``fit_ensemble(batched=False)`` fits them one at a
            time).
        NonFiniteELBOError: a member's objective or gradient became NaN/inf (names it).
    """
    start = time.perf_counter()
    states = [svi_init(model, data, guide="delta", seed=seed + k, **kw) for k in range(n_members)]
    first = states[0]
    settings = first.settings
    train, device = first.data, first.device
    stacked = {
        name: torch.stack([dict(s.model.named_parameters())[name].detach() for s in states])
        for name, _ in first.model.named_parameters()
    }
    parameters = {
        name: value[:, None].clone().requires_grad_(True) for name, value in stacked.items()
    }
    try:
        density = VectorizedDensity(
            first.model, train.x, train.y, train.mask, parameters=parameters
        )
    except ValueError as e:  # no latent sites: the members are plain networks
        raise MembersDoNotVectorize(f"fit_ensemble batches latent sites only: {e}") from e
    medians = []
    for state in states:  # each guide's locations live in its own param store
        with pyro.get_param_store().scope(state.param_store):
            medians.append(state.guide.median())
    z = density.unconstrain(
        {site.name: torch.stack([m[site.name].detach() for m in medians]) for site in density.sites}
    )
    with seeded(seed, device):
        density.model.eval()  # the probe compares deterministic passes
        try:
            density.check(z)
        except ValueError as e:
            raise MembersDoNotVectorize(
                f"fit_ensemble cannot batch the members of {type(model).__name__} (their "
                f"latents and plain parameters arrive as (members, 1, *shape)): {e}; "
                "fit_ensemble(batched=False) fits them one at a time"
            ) from e
        density.model.train()
        z, final = map_fit(
            density,
            z,
            settings["num_steps"],
            progress=progress,
            lr=settings["lr"],
            lr_decay=settings["lr_decay"],
            lr_warmup=settings["lr_warmup"],
            lr_schedule=settings["lr_schedule"],
            batch_size=settings["batch_size"],
            check=_check_finite,
            desc="ensemble",
        )
    density.model.eval()
    seconds = time.perf_counter() - start
    values = density.constrain(z)
    samples = {name: value[None] for name, value in values.items()}  # (1, M, *shape)
    members = {name: value.detach()[:, 0][None] for name, value in parameters.items()}
    for name, value in members.items():  # the posterior's model holds member 0's values
        dict(density.model.named_parameters())[name].data.copy_(value[0, 0])
    record = dict(
        method="ensemble",
        guide="delta",
        **{k: v for k, v in settings.items() if k not in ("guide", "seed")},
        num_data=len(train),
        steps_done=settings["num_steps"],
        x_range=[float(train.x.min()), float(train.x.max())],
        seed=seed,
        n_members=n_members,
        batched=True,
        members=[
            dict(seed=seed + k, final_loss=-float(final[k]), seconds=seconds / n_members)
            for k in range(n_members)
        ],
        seconds=seconds,
    )
    return Posterior(
        density.model, samples=samples, members=members, record=record, example=example_of(train)
    )


def _check_finite(lp: torch.Tensor, leaves: list[torch.Tensor], step: int) -> None:
    """Raise ``NonFiniteELBOError`` naming the first member whose objective or gradient is not
    finite (``map_fit``'s check)."""
    bad = ~torch.isfinite(lp)
    for leaf in leaves:
        bad |= ~torch.isfinite(leaf.grad.reshape(len(lp), -1)).all(1)
    if bad.any():
        member = int(bad.nonzero()[0])
        raise NonFiniteELBOError(
            f"the MAP objective or its gradient of ensemble member {member} became "
            f"non-finite at step {step}: lower lr, or fit with batched=False to see the site",
            step=step,
            site=None,
        )


__all__ = ["MembersDoNotVectorize", "fit_batched"]
