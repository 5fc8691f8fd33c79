"""The log density of K chains in one pass: the chains are the model's draw dim.

``VectorizedDensity`` flattens a model's latents into one unconstrained vector per chain, a
``(K, D)`` tensor, and returns the log density of every chain and its gradient from one
vectorized forward and backward pass. Each latent enters the model as the prediction engine
gives it, ``(K, 1, *shape)`` inside ``pyro.plate("_draws", K, dim=-2)`` (local latents
``(K, N, *per_row)``), so every model that ``predict`` accepts is accepted here. The density is
that of Pyro's HMC kernels (``potential_fn`` of ``pyro.infer.mcmc.util.initialize_model``),
negated: the joint log density in the unconstrained space, log-Jacobians of the transforms
``biject_to(support)`` included (Stan's ``lp__``).

Before sampling, ``check`` compares the K-chain values of every site with K single-chain
evaluations: a model that mixes or drops the draw dim is refused, naming the site.

Rows are split into passes whose estimated activations (``engine.activation_bytes`` times K,
times 3 for the backward pass) fit a memory budget; the gradient is accumulated over passes.
The global latents' prior terms are counted once; the likelihood and local latents per row.
A random subset of rows gives an unbiased mini-batch estimate (likelihood scaled by N / B), as
the batched MAP fits of ensemble starts use it.

Reference: NumPyro's ``MCMC(chain_method="vectorized")`` vectorizes the potential over chains
with ``vmap``; here the model's own draw dim does it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine
from torch.distributions import biject_to
from torch.distributions.transforms import identity_transform

from probtransformer.attention import LOCAL_LATENT
from probtransformer.inference._runtime import is_invalid_parameter_error, pyro_scope
from probtransformer.inference.distributed import DataParallel, gather_rows
from probtransformer.inference.model_checks import (
    DRAWS_DIM,
    DRAWS_PLATE,
    _is_latent,
    in_data_plate,
)
from probtransformer.inference.posterior.prediction import DEFAULT_MEMORY_BUDGET, activation_bytes

#: Relative and absolute tolerance of the K-chain against single-chain comparison.
PROBE_RTOL, PROBE_ATOL = 1e-4, 1e-3


@dataclass(frozen=True)
class LatentSite:
    """One latent site in the flat layout.

    Attributes:
        name: the site name.
        shape: its single-chain value shape (local: ``(N, *per_row)``).
        unconstrained_shape: the shape of its unconstrained value.
        transform: ``biject_to(support)``, unconstrained -> constrained.
        local: sampled inside ``pyro.plate("data")`` (one value per row).
        offset, size: its slice of the flat ``(K, D)`` vector.
    """

    name: str
    shape: torch.Size
    unconstrained_shape: torch.Size
    transform: torch.distributions.Transform
    local: bool
    offset: int
    size: int


class VectorizedDensity:
    """Log density and gradient of K chains of ``model`` on fixed data, in one pass.

    Args:
        model: a model following the protocol, on ``x``'s device; its plain parameters are
            held fixed (point estimates). Samplers pass it in eval mode; in train mode its
            dropout draws fresh masks per chain on every call.
        x, y, mask: the full training data (``y`` required).
        memory_budget: bytes the intermediates of one pass may take (None: all rows at once).
        parameters: ``{name: (K, 1, *shape)}`` values of some of the model's plain parameters,
            one per chain, used in place of them (``torch.func.functional_call``); the batched
            MAP fits of ``fit_ensemble`` optimise them with the latents. Every call then takes
            exactly K chains.
        temperature: ``T > 0``: the likelihood enters as ``p(y | θ)^(1 / T)`` (a tempered
            posterior, "cold" for T < 1; Wenzel et al. 2020); 1 is the Bayesian posterior.

    Attributes:
        sites: the ``LatentSite`` layout; ``dim``: ``D``, the unconstrained scalars per chain.

    Raises:
        ValueError: the model has no latent sites, or latents of stochastic attention (their
            per-logit draws are not part of a fixed-dimension state).
    """

    def __init__(
        self,
        model,
        x,
        y,
        mask,
        *,
        memory_budget: int | None = DEFAULT_MEMORY_BUDGET,
        parameters: dict[str, torch.Tensor] | None = None,
        temperature: float = 1.0,
    ):
        self.model = model
        self.parameters = parameters
        self.temperature = temperature
        self.x, self.y, self.mask = x, y, mask
        self.num_rows = x.shape[0]
        self.device = x.device
        with pyro_scope(), torch.no_grad(), poutine.block(), pyro.validation_enabled(False):
            # the layout only: values whose density is not finite are named by the start checks
            trace = poutine.trace(model).get_trace(x[:1], y[:1], None if mask is None else mask[:1])
        sites, offset = [], 0
        for name, site in trace.nodes.items():
            if not _is_latent(site, model.likelihood_site):
                continue
            if site["infer"].get(LOCAL_LATENT):
                raise ValueError(
                    f"the site {name!r} is a local latent of stochastic attention (one per "
                    "attention logit): the many-chain kernels sample a fixed-size state; use "
                    "kernel='nuts' (non-centred local latents) or fit_svi"
                )
            local = in_data_plate(site)
            transform = biject_to(site["fn"].support)
            value = site["value"]
            shape = (self.num_rows, *value.shape[1:]) if local else value.shape
            unconstrained = transform.inv(value).shape
            if local:
                unconstrained = (self.num_rows, *unconstrained[1:])
            size = math.prod(unconstrained)
            sites.append(
                LatentSite(
                    name, torch.Size(shape), torch.Size(unconstrained), transform, local, offset,
                    size,
                )
            )  # fmt: skip
            offset += size
        if not sites:
            raise ValueError(
                f"{type(model).__name__} has no latent sample sites: there is nothing to sample"
            )
        self.sites: tuple[LatentSite, ...] = tuple(sites)
        self.dim = offset
        self.memory_budget = memory_budget
        #: ``CompiledPass`` that evaluates the row passes (None: the eager Pyro trace).
        self.compiled = None

    # -- layout ------------------------------------------------------------------------------

    def unflatten(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{site: (K, *shape)}`` unconstrained values of the flat ``z`` ``(K, D)``."""
        return {
            s.name: z[:, s.offset : s.offset + s.size].reshape(len(z), *s.unconstrained_shape)
            for s in self.sites
        }

    def flatten(self, unconstrained: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flat ``(K, D)`` vector of ``{site: (K, *unconstrained_shape)}``."""
        return torch.cat(
            [unconstrained[s.name].reshape(len(unconstrained[s.name]), -1) for s in self.sites],
            dim=1,
        )

    def constrain(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{site: (K, *shape)}`` constrained values of ``z`` ``(K, D)``."""
        unconstrained = self.unflatten(z).values()
        return {s.name: s.transform(u) for s, u in zip(self.sites, unconstrained, strict=True)}

    def unconstrain(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flat ``(K, D)`` of constrained ``{site: (K, *shape)}`` values."""
        return self.flatten({s.name: s.transform.inv(values[s.name]) for s in self.sites})

    # -- density -----------------------------------------------------------------------------

    def log_density(
        self,
        z: torch.Tensor,
        *,
        grad: bool = True,
        rows: torch.Tensor | None = None,
        jacobian: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log density of every chain, and its gradient.

        Args:
            z: ``(K, D)`` unconstrained states, one row per chain.
            grad: also return the gradient.
            rows: indices of a mini-batch of rows (None: every row); the likelihood (and local
                latents' terms) of B rows is scaled by N / B. Models with local latents need
                every row.
            jacobian: add the log-Jacobians of the transforms (False: the density of the
                constrained values, for MAP fits).

        Returns:
            ``(log_density (K,), gradient (K, D) or None)``, in nats, on ``z``'s device. A chain
            whose state is not finite, or whose values leave a site's support (an overflowed
            trajectory: ``exp`` of a large negative number is 0, not a positive scale), gets
            NaN in both; the other chains are evaluated as usual.

        Raises:
            ValueError: ``z`` not ``(K, D)``; the model fails under K vectorized draws (names
                the shapes).
        """
        if z.dim() != 2 or z.shape[1] != self.dim:
            raise ValueError(f"z must be (K, {self.dim}), got {tuple(z.shape)}")
        total = torch.full((len(z),), math.nan, device=z.device, dtype=z.dtype)
        gradient = torch.full_like(z, math.nan) if grad else None
        finite = torch.isfinite(z).all(1)
        if not finite.any():
            return total, gradient
        if self.compiled is not None:  # K fixed: a non-finite chain is evaluated at 0, then NaN
            lp, g = self._log_density(z.where(finite[:, None], 0.0), grad, rows, jacobian)
            return lp.where(finite, total), g.where(finite[:, None], gradient) if grad else None
        try:
            with self._chains(finite):
                lp, g = self._log_density(z[finite], grad, rows, jacobian)
        except ValueError as e:
            if not is_invalid_parameter_error(e):
                raise
            if int(finite.sum()) == 1:
                return total, gradient
            # a chain's values are outside a support (Pyro validates the priors' values): one
            # chain at a time, that chain NaN
            parts = []
            for k in range(len(z)):
                with self._chains(torch.arange(k, k + 1, device=z.device)):
                    parts.append(
                        self.log_density(z[k : k + 1], grad=grad, rows=rows, jacobian=jacobian)
                    )
            total = torch.cat([lp for lp, _ in parts])
            return total, torch.cat([g for _, g in parts]) if grad else None
        total[finite] = lp
        if grad:
            gradient[finite] = g
        return total, gradient

    def _log_density(self, z, grad: bool, rows, jacobian: bool):
        """``log_density`` of finite states ``z`` ``(K, D)``, row passes within the budget."""
        chains = z.shape[0]
        z = z.detach().requires_grad_(grad)
        index = torch.arange(self.num_rows, device=self.device) if rows is None else rows
        scale = self.num_rows / len(index)
        total = torch.zeros(chains, device=z.device, dtype=z.dtype)
        gradient = torch.zeros_like(z) if grad else None
        step = self._rows_per_pass(chains)
        for i, start in enumerate(range(0, len(index), step)):
            with torch.set_grad_enabled(grad):
                lp = self._evaluate(z, index[start : start + step], scale, i == 0, jacobian)
            if grad:
                (g,) = torch.autograd.grad(lp.sum(), z)
                gradient += g
            total += lp.detach()
        return total, gradient

    def log_joint(
        self, z: torch.Tensor, rows: torch.Tensor | None = None, *, jacobian: bool = True
    ) -> torch.Tensor:
        """``(K,)`` log density of finite states ``z`` ``(K, D)`` (``rows`` and ``jacobian`` as
        in ``log_density``), differentiable with respect to ``z`` and ``parameters``: the
        objective of optimisers that also fit the plain parameters. Non-finite values are
        returned as they are."""
        index = torch.arange(self.num_rows, device=self.device) if rows is None else rows
        scale = self.num_rows / len(index)
        step = self._rows_per_pass(len(z))
        return sum(
            self._evaluate(z, index[start : start + step], scale, i == 0, jacobian)
            for i, start in enumerate(range(0, len(index), step))
        )

    def site_log_densities(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{site: (K,)}`` each sample site's summed log density (every row), no gradient;
        ``"jacobian"`` holds the log-Jacobians."""
        with torch.no_grad():
            values, jac = self._condition(z, torch.arange(self.num_rows, device=self.device))
            trace = self._trace(values, torch.arange(self.num_rows, device=self.device), len(z))
            out = {
                name: _per_chain(site["log_prob"], len(z))
                for name, site in trace.nodes.items()
                if site["type"] == "sample"
            }
        return {**out, "jacobian": jac}

    def _rows_per_pass(self, chains: int) -> int:
        if self.memory_budget is None:
            return self.num_rows
        per_row = 3 * activation_bytes(self.model, self.x) * chains  # forward + backward
        return max(1, min(self.num_rows, self.memory_budget // per_row))

    def _condition(self, z, index) -> tuple[dict, torch.Tensor]:
        """Constrained values shaped for a pass over rows ``index``, and the log-Jacobians."""
        chains = len(z)
        values, jac = {}, torch.zeros(chains, device=z.device, dtype=z.dtype)
        for site, u in zip(self.sites, self.unflatten(z).values(), strict=True):
            value = site.transform(u)
            if site.transform is not identity_transform:
                jac = jac + site.transform.log_abs_det_jacobian(u, value).reshape(chains, -1).sum(1)
            if site.local:
                values[site.name] = value[:, index]
            else:
                values[site.name] = value.reshape(chains, 1, *site.shape)
        return values, jac

    def _trace(self, values: dict, index, chains: int) -> poutine.Trace:
        """One vectorized trace with log probabilities. Distribution validation is off, as in
        Pyro's ``MCMC(disable_validation=True)``: a chain whose trajectory overflows (a scale of
        inf or NaN) gets a non-finite log density of its own (a divergent transition, or a
        named error at the initial state) instead of a ``ValueError`` that stops every chain."""
        x = self.x[index]
        args = (x, self.y[index], None if self.mask is None else self.mask[index])
        with pyro_scope(), pyro.validation_enabled(False):
            try:
                with pyro.plate(DRAWS_PLATE, chains, dim=DRAWS_DIM):
                    model = poutine.condition(self._model(self.parameters), data=values)
                    trace = poutine.trace(model).get_trace(*args)
            except RuntimeError as e:
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                raise ValueError(
                    f"the model fails on inputs of shape {tuple(x.shape)} under {chains} "
                    f"vectorized chains ({str(e).splitlines()[0]}): a model must let each latent "
                    "(chains, 1, *shape) broadcast from the right (docs/protocol.md)"
                ) from e
            trace.compute_log_prob()
        return trace

    def _evaluate(self, z, index, scale: float, first: bool, jac: bool) -> torch.Tensor:
        """``_pass``, compiled when ``compiled`` is set."""
        evaluate = self._pass if self.compiled is None else self.compiled
        return evaluate(z, index, scale, first=first, jac=jac)

    def _pass(self, z, index, scale: float, *, first: bool, jac: bool) -> torch.Tensor:
        """``(K,)`` log density of one pass: global priors (and Jacobians) on the first pass
        only, the per-row terms scaled by ``scale`` (the likelihood by ``scale / temperature``).
        """
        chains = len(z)
        values, jacobian = self._condition(z, index)
        trace = self._trace(values, index, chains)
        lp = jacobian if (first and jac) else torch.zeros_like(jacobian)
        likelihood = self.model.likelihood_site
        for site in trace.nodes.values():
            if site["type"] != "sample":
                continue
            if in_data_plate(site):
                weight = scale / self.temperature if site["name"] == likelihood else scale
                lp = lp + weight * _per_chain(site["log_prob"], chains)
            elif first:
                lp = lp + _per_chain(site["log_prob"], chains)
        return lp

    # -- checks ------------------------------------------------------------------------------

    def check(self, z: torch.Tensor) -> None:
        """Refuse a model whose K-chain log density differs from K single-chain evaluations.

        Every sample site's vectorized log density at the states ``z`` (K >= 2) must equal the
        one Pyro computes for that chain alone, where both are finite.

        Raises:
            ValueError: naming the first site that differs (with both values), and the fix.
        """
        together = self.site_log_densities(z)
        together.pop("jacobian")
        for k in range(len(z)):
            single = self._single_chain(z, k)
            for name, value in together.items():
                alone = single.get(name)
                if alone is None or not (torch.isfinite(value[k]) and torch.isfinite(alone)):
                    continue  # non-finite: named for the chains' own starts (fit_mcmc)
                if not torch.isclose(value[k], alone, rtol=PROBE_RTOL, atol=PROBE_ATOL):
                    raise ValueError(
                        f"the site {name!r} does not follow each chain: under {len(z)} "
                        f"vectorized chains chain {k} has log density {float(value[k]):.6g}, "
                        f"alone it has {float(alone):.6g}. The forward pass mixes or drops the "
                        "draw dim (a sum or mean over it, an einsum that drops it, a reshape "
                        "across it): each latent arrives as (chains, 1, *shape); keep the "
                        "leading dims and broadcast from the right (docs/protocol.md)"
                    )

    def _single_chain(self, z: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
        """``{site: ()}`` log densities of chain ``k`` of ``z`` (K, D) alone, no draw plate."""
        values = {}
        for site, u in zip(self.sites, self.unflatten(z[k : k + 1]).values(), strict=True):
            values[site.name] = site.transform(u[0])
        args = (self.x, self.y, self.mask)
        parameters = None
        if self.parameters is not None:
            parameters = {name: value[k, 0] for name, value in self.parameters.items()}
        with pyro_scope(), torch.no_grad():
            try:
                model = poutine.condition(self._model(parameters), data=values)
                trace = poutine.trace(model).get_trace(*args)
                trace.compute_log_prob()
            except ValueError as e:
                if is_invalid_parameter_error(e):
                    return {}
                raise
        return {
            name: site["log_prob"].sum()
            for name, site in trace.nodes.items()
            if site["type"] == "sample"
        }

    def sharded(self, parallel: DataParallel) -> Callable[[torch.Tensor], tuple]:
        """``log_density`` with the K chains split over the ranks of ``parallel``.

        Every rank holds the same ``z (K, D)``; it evaluates its contiguous share of the chains
        (``DataParallel.share``; per-chain ``parameters`` cut to them), and the log densities
        ``(K,)`` and gradients ``(K, D)`` are all-gathered in chain order, so every rank gets
        what ``log_density(z)`` gives, and the samplers' cross-chain statistics are computed
        from the same numbers on every rank.
        """

        def log_density(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            chains = torch.arange(len(z), device=z.device)[parallel.share(len(z))]
            with self._chains(chains):
                lp, grad = self.log_density(z[chains])
            every = gather_rows(parallel, {"lp": lp, "grad": grad}, len(z), dim=0)
            return every["lp"], every["grad"]

        return log_density

    @contextlib.contextmanager
    def _chains(self, index: torch.Tensor) -> Iterator[None]:
        """Evaluate only the chains ``index`` (a bool mask or indices): ``parameters`` cut to
        them for the block."""
        every = self.parameters
        if every is not None and not (index.dtype == torch.bool and bool(index.all())):
            self.parameters = {name: value[index] for name, value in every.items()}
        try:
            yield
        finally:
            self.parameters = every

    def _model(self, parameters: dict[str, torch.Tensor] | None):
        """The model, or a call of it with ``parameters`` in place of its own."""
        if parameters is None:
            return self.model
        return lambda *args: torch.func.functional_call(self.model, parameters, args, strict=False)


def _per_chain(log_prob: torch.Tensor, chains: int) -> torch.Tensor:
    """Sum a site's ``log_prob`` over every dim but the draw plate's (dim -2): ``(K,)``."""
    if log_prob.dim() < 2:
        return log_prob.sum().expand(chains)
    draws = log_prob.dim() + DRAWS_DIM
    others = [d for d in range(log_prob.dim()) if d != draws]
    summed = log_prob.sum(dim=others) if others else log_prob
    return summed.expand(chains)


__all__ = ["LatentSite", "VectorizedDensity"]
