"""Draw sources: where a ``Posterior``'s draws come from, and the explicit ``Draws`` they give.

A ``Posterior`` is a model plus one draw source. Each source answers ``draw(num_samples, seed)``
with a ``Draws``: the latent values of every draw, and for the baselines what else differs from
draw to draw. The prediction engine (``inference.posterior.prediction``) takes a ``Draws``
explicitly, as
Pyro's ``Predictive(model, posterior_samples=...)`` does, so every consumer of one set of draws
(the groups of ``to_inference_data``, a prediction reused by the CLI) sees the same draws.

- ``GuideDraws``: fresh draws of a fitted SVI guide, seeded (Hoffman et al. 2013).
- ``StoredDraws``: draws kept by a sampler, ``(chain, draw)`` dims, thinned evenly; local
  latents of the training rows included (``fit_mcmc``).
- ``EnsembleDraws``: a deep ensemble (Lakshminarayanan et al. 2017): each member's point
  estimate is one draw, with the model's own parameters per draw.
- ``DropoutDraws``: MC dropout (Gal & Ghahramani 2016): a MAP guide, each draw one forward pass
  with fresh dropout masks.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoDelta, AutoGuide

from probtransformer.data import SequenceData
from probtransformer.inference._runtime import pyro_scope, seeded
from probtransformer.inference.model_checks import DRAWS_DIM, DRAWS_PLATE
from probtransformer.validation import check_int

#: Guide draws when an export or diagnostic is not told how many (sample-based: all draws).
DEFAULT_NUM_SAMPLES = 100


@dataclass(frozen=True)
class Draws:
    """One explicit set of posterior draws, as the prediction engine consumes it.

    Attributes:
        latents: ``{site: (chain, draw, *shape)}`` on the model's device; local latents kept by
            a sampler as ``(chain, draw, N, *per_row)``.
        chains, per_chain: the ``(chain, draw)`` dims shared by every draw.
        states: ``{name: (chain, draw, *shape)}`` model parameters per draw (ensembles), or None.
        dropout: each draw runs alone with dropout on (MC dropout).
        modes: ``{site: (chain, draw, *shape)}`` the point each draw's network is linearized
            at for its likelihood (a Laplace posterior's GLM predictive), or None.
    """

    latents: dict[str, torch.Tensor]
    chains: int = 1
    per_chain: int = 1
    states: dict[str, torch.Tensor] | None = None
    dropout: bool = False
    modes: dict[str, torch.Tensor] | None = None

    @property
    def num(self) -> int:
        """Number of draws ``chains * per_chain``."""
        return self.chains * self.per_chain

    def without(self, sites) -> Draws:
        """These draws without the latents named in ``sites``."""
        kept = {k: v for k, v in self.latents.items() if k not in sites}
        return dataclasses.replace(self, latents=kept)


def check_num_samples(num_samples: object) -> None:
    """Raise ``ValueError`` unless ``num_samples`` is an int >= 1."""
    check_int("num_samples", num_samples)


def thin(value: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Evenly thin ``(chain, draw, ...)`` to ``ceil(num_samples / chain)`` draws per chain."""
    chains, draws = value.shape[:2]
    keep = min(draws, math.ceil(num_samples / chains))
    index = torch.linspace(0, draws - 1, keep).round().long().to(value.device)
    return value.index_select(1, index)


def _leading(tensors: dict[str, torch.Tensor]) -> tuple[int, int] | None:
    first = next(iter(tensors.values()), None)
    return None if first is None else tuple(first.shape[:2])


class DrawSource(abc.ABC):
    """Base of the draw sources. ``guide``, ``samples``, ``members``, ``mc_dropout`` and
    ``modes`` say what the source holds (what ``Posterior.save`` writes); ``draw`` gives the
    draws."""

    guide: AutoGuide | None = None
    samples: dict[str, torch.Tensor] | None = None
    members: dict[str, torch.Tensor] | None = None
    mc_dropout: bool = False
    modes: dict[str, torch.Tensor] | None = None

    def is_point_estimate(self, latent_shapes: dict) -> bool:
        """True when every draw is the same, so predictions need one draw."""
        return not latent_shapes

    def check(self, model: torch.nn.Module, latent_shapes: dict, local_shapes: dict) -> None:  # noqa: B027
        """Raise ``ValueError`` when what the source holds does not fit ``model`` (a guide
        always fits: it was built from the model)."""

    @abc.abstractmethod
    def draw(
        self, num_samples: int | None, seed: int, *, latent_shapes: dict, device: torch.device
    ) -> Draws:
        """``num_samples`` draws (None: the source's default), seeded by ``seed``.

        Raises:
            ValueError: ``num_samples`` not an int >= 1.
        """

    def describe(self) -> str:
        return type(self).__name__


class GuideDraws(DrawSource):
    """Fresh draws of a fitted autoguide; the guide's ``(num_samples, ...)`` draws form one
    chain. An ``AutoDelta`` (MAP) is a point estimate: one draw."""

    def __init__(self, guide: AutoGuide, example: SequenceData) -> None:
        self.guide = guide
        self.example = example

    def is_point_estimate(self, latent_shapes: dict) -> bool:
        return isinstance(self.guide, AutoDelta) or not latent_shapes

    def trace(self, num_samples: int, device: torch.device) -> poutine.Trace:
        """A trace of the guide with ``num_samples`` draws of every site (under the caller's
        RNG)."""
        ex = self.example.to(device)
        with pyro_scope(), torch.no_grad(), pyro.plate(DRAWS_PLATE, num_samples, dim=DRAWS_DIM):
            return poutine.trace(self.guide).get_trace(ex.x, ex.y, ex.mask)

    def draw(self, num_samples, seed, *, latent_shapes, device) -> Draws:
        num = DEFAULT_NUM_SAMPLES if num_samples is None else num_samples
        check_num_samples(num)
        if self.is_point_estimate(latent_shapes):
            num = 1
        with seeded(seed, device):
            trace = self.trace(num, device)
        latents = latents_of(trace, num, latent_shapes)
        return Draws({k: v[None] for k, v in latents.items()}, 1, num if latents else 1)

    def describe(self) -> str:
        return type(self.guide).__name__


class DropoutDraws(GuideDraws):
    """MC dropout: the MAP guide's point estimate, each draw one pass with dropout on."""

    mc_dropout = True

    def is_point_estimate(self, latent_shapes: dict) -> bool:
        return False

    def draw(self, num_samples, seed, *, latent_shapes, device) -> Draws:
        num = DEFAULT_NUM_SAMPLES if num_samples is None else num_samples
        check_num_samples(num)
        with seeded(seed, device):
            latents = latents_of(self.trace(num, device), num, latent_shapes)
        latents = {k: v[None] for k, v in latents.items()}
        return Draws(latents, 1, num, dropout=True)

    def describe(self) -> str:
        return f"{super().describe()} + MC dropout"


class StoredDraws(DrawSource):
    """Draws kept by a sampler, ``{site: (chain, draw, *shape)}``, thinned evenly per chain.
    ``modes`` (a Laplace posterior's GLM predictive): each draw's linearization point of some
    sites, ``(chain, draw, *shape)`` as well, thinned alike."""

    def __init__(
        self, samples: dict[str, torch.Tensor], modes: dict[str, torch.Tensor] | None = None
    ) -> None:
        self.samples = samples
        self.modes = modes

    def _thinned_modes(self, num_samples: int | None) -> dict[str, torch.Tensor] | None:
        if self.modes is None or num_samples is None:
            return self.modes
        return {name: thin(value, num_samples) for name, value in self.modes.items()}

    def check(self, model, latent_shapes, local_shapes) -> None:
        """Draws must cover every global latent site with ``(chain, draw, *site shape)`` and
        may hold local ones with ``(chain, draw, N, *per_row shape)``; ``(chain, draw)`` and
        ``N`` shared."""
        samples = self.samples
        if not set(latent_shapes) <= set(samples) <= set(latent_shapes) | set(local_shapes):
            may = ""
            if local_shapes:
                may = f" (and may hold its local latents {sorted(local_shapes)})"
            raise ValueError(
                f"samples must hold the model's latent sites {sorted(latent_shapes)}{may}, got "
                f"{sorted(samples)}"
            )
        leading = {tuple(value.shape[:2]) for value in samples.values()}
        rows = {value.shape[2] for name, value in samples.items() if name in local_shapes}
        for name, value in samples.items():
            if name in local_shapes:
                shape = local_shapes[name]
                wanted = (
                    f"(chain, draw, N, *{tuple(shape)}) with the N of the other local latents and"
                )
                ok = value.dim() >= 3 and value.shape[3:] == shape and len(rows) == 1
            else:
                wanted = f"(chain, draw, *{tuple(latent_shapes[name])}) with"
                ok = value.dim() >= 2 and value.shape[2:] == latent_shapes[name]
            if not ok or len(leading) > 1:
                raise ValueError(
                    f"samples[{name!r}] must have shape {wanted} the same (chain, draw) as the "
                    f"other sites, got {tuple(value.shape)}"
                )
        for name, value in (self.modes or {}).items():
            if name not in latent_shapes or value.shape != samples[name].shape:
                raise ValueError(
                    f"modes[{name!r}] must be a global latent site's linearization points "
                    f"shaped as its samples, got {tuple(value.shape)}"
                )

    def draw(self, num_samples, seed, *, latent_shapes, device) -> Draws:
        if num_samples is None:
            latents = dict(self.samples)
        else:
            check_num_samples(num_samples)
            if self.is_point_estimate(latent_shapes):
                num_samples = 1
            latents = {name: thin(value, num_samples) for name, value in self.samples.items()}
        modes = self._thinned_modes(num_samples)
        return Draws(latents, *(_leading(latents) or (1, 1)), modes=modes)

    def describe(self) -> str:
        return "samples"


class EnsembleDraws(StoredDraws):
    """A deep ensemble: each member's latents are ``samples`` and its model parameters
    ``members`` (``{name: (chain, draw, *shape)}``), copied into the model for its pass."""

    def __init__(
        self,
        samples: dict[str, torch.Tensor],
        members: dict[str, torch.Tensor],
        modes: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(samples, modes)
        self.members = members

    def check(self, model, latent_shapes, local_shapes) -> None:
        """Members must hold every parameter of the model with ``(chain, draw, *shape)``,
        ``(chain, draw)`` shared with each other and with ``samples``."""
        super().check(model, latent_shapes, local_shapes)
        members, state = self.members, dict(model.named_parameters())
        if set(members) != set(state):
            raise ValueError(
                f"members must hold every parameter of the model ({len(state)} in "
                f"named_parameters), got {len(members)} of which "
                f"{len(set(members) - set(state))} are not the model's"
            )
        leading = {tuple(v.shape[:2]) for v in (*members.values(), *self.samples.values())}
        for name, value in members.items():
            if value.dim() < 2 or value.shape[2:] != state[name].shape or len(leading) > 1:
                raise ValueError(
                    f"members[{name!r}] must have shape (chain, draw, "
                    f"*{tuple(state[name].shape)}) with the (chain, draw) of samples, got "
                    f"{tuple(value.shape)}"
                )

    def is_point_estimate(self, latent_shapes: dict) -> bool:
        return False

    def draw(self, num_samples, seed, *, latent_shapes, device) -> Draws:
        if num_samples is None:
            latents, states = dict(self.samples), dict(self.members)
        else:
            check_num_samples(num_samples)
            latents = {name: thin(value, num_samples) for name, value in self.samples.items()}
            states = {name: thin(value, num_samples) for name, value in self.members.items()}
        modes = self._thinned_modes(num_samples)
        return Draws(latents, *_leading({**latents, **states}), states=states, modes=modes)

    def describe(self) -> str:
        return f"samples, members={math.prod(_leading(self.members))}"


def latents_of(
    trace: poutine.Trace, num_samples: int, latent_shapes: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """``{site: (num_samples, *shape)}`` values of the global latent sites in ``trace``."""
    return {
        name: trace.nodes[name]["value"].detach().reshape(num_samples, *shape)
        for name, shape in latent_shapes.items()
    }


def draw_source(
    *,
    example: SequenceData,
    guide: AutoGuide | None = None,
    samples: dict[str, torch.Tensor] | None = None,
    members: dict[str, torch.Tensor] | None = None,
    mc_dropout: bool = False,
    modes: dict[str, torch.Tensor] | None = None,
) -> DrawSource:
    """The draw source of what a fit kept (the keywords of ``Posterior``).

    Raises:
        ValueError: neither or both of ``guide`` and ``samples``; ``members`` or ``modes``
            without ``samples``; ``mc_dropout`` with samples.
    """
    if (guide is None) == (samples is None):
        raise ValueError("a Posterior needs exactly one of guide or samples")
    if members is not None and samples is None:
        raise ValueError("members need samples: one latent draw per member")
    if modes is not None and samples is None:
        raise ValueError("modes need samples: one linearization point per draw")
    if guide is not None:
        return DropoutDraws(guide, example) if mc_dropout else GuideDraws(guide, example)
    if mc_dropout:
        raise ValueError("mc_dropout needs a guide (fit_mc_dropout), not samples")
    if members is None:
        return StoredDraws(samples, modes)
    return EnsembleDraws(samples, members, modes)


__all__ = [
    "DEFAULT_NUM_SAMPLES",
    "DrawSource",
    "Draws",
    "DropoutDraws",
    "EnsembleDraws",
    "GuideDraws",
    "StoredDraws",
    "draw_source",
    "latents_of",
    "thin",
]
