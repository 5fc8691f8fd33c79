"""Pyro's private and internal API used by ``probtransformer.inference``, kept in one place.

Written against pyro-ppl 1.9.x (checked on 1.9.2). Pyro does not promise these names
across releases: when Pyro is upgraded, re-check this module against the new sources;
``tests/inference/test_pyro_compat.py`` pins the version range and checks that every attribute,
method and function used here exists with the signature this module expects.

What is used, and why:

- ``pyro.infer.mcmc.util.initialize_model``: the unconstrained initial values and the
  transforms of a model's latents, as the HMC kernels compute them (before sampling starts).
- ``pyro.poutine.util.site_is_subsample``: tells the sites a ``pyro.plate(subsample=...)``
  adds to a trace from sample sites (``guides``).
- The mean-field ELBO's internals (``elbo.MeanFieldELBO``): ``TraceMeanField_ELBO._get_trace``
  and ``_differentiable_loss_particle``, the two methods it overrides;
  ``pyro.infer.enum.get_importance_trace``, the validated model/guide trace pair;
  ``pyro.infer.trace_mean_field_elbo._check_mean_field_requirement``, the check that model and
  guide sample their sites in the same order; ``pyro.poutine.util.prune_subsample_sites``,
  which drops the plate sites from a trace; ``pyro.distributions.util.scale_and_mask``, a
  site's ``scale`` and ``mask`` applied to a log density; and
  ``pyro.infer.util.is_validation_enabled``, whether ``pyro.enable_validation`` is on.
- ``PyroModule._pyro_samples``: the ``PyroSample`` attributes a module declares.
- HMC/NUTS kernel state (``HMC._fetch_from_cache``, ``_kinetic_energy``, ``_mean_accept_prob``,
  ``_divergences``, ``_t``, ``_warmup_steps``) and hooks (``HMC._sample_r``, called once per
  transition right after the momentum draw; ``NUTS._build_tree``, recursive, returning the
  ``diverging``/``turning``/``num_proposals`` fields of its tree), read for per-draw statistics.
- ``MCMC.sampler.run``: the generator through which each chain sends its ``{site: shape}``
  structure, then one flat unconstrained vector per kept draw, then the kernel's
  ``diagnostics()``; wrapped so that draws survive a Ctrl-C. The sampler is Pyro's
  ``_MultiSampler`` when chains run in worker processes.

Effect handlers written as ``poutine.messenger.Messenger`` subclasses with a ``_pyro_sample``
method follow Pyro's documented extension protocol and stay where they are used.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from pyro.distributions.util import scale_and_mask
from pyro.infer.enum import get_importance_trace
from pyro.infer.mcmc.util import initialize_model
from pyro.infer.trace_mean_field_elbo import (
    _check_mean_field_requirement as check_mean_field_requirement,
)
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import prune_subsample_sites, site_is_subsample

#: The Pyro release series this module was written against.
PYRO_SERIES = "1.9."


def module_sample_attributes(module: torch.nn.Module) -> Iterator[str]:
    """Names of the ``PyroSample`` attributes declared on ``module`` itself (not submodules)."""
    yield from getattr(module, "_pyro_samples", {})


def module_site_name(module: torch.nn.Module, attribute: str) -> str:
    """The full sample-site name of ``module``'s ``PyroSample`` attribute ``attribute`` (its
    path in the model, e.g. ``"encoder.layers.0.attention.head_local_scale"``)."""
    return module._pyro_get_fullname(attribute)


class MomentumHook:
    """Mixin for Pyro's ``HMC``/``NUTS``: calls ``self.on_momentum(r_unscaled)`` (the class
    using it defines that method) once per transition, right after the momentum refresh (Pyro's
    ``HMC._sample_r``).

    ``r_unscaled`` is ``{site group: momentum}`` before the mass-matrix scaling, the argument of
    ``kinetic_energy``.
    """

    def _sample_r(self, name):
        r, r_unscaled = super()._sample_r(name)
        self.on_momentum(r_unscaled)
        return r, r_unscaled


class TreeHook:
    """Mixin for Pyro's ``NUTS``: calls ``self.on_doubling(tree)`` (the class using it defines
    that method) with every top-level doubling of the trajectory, a Pyro ``_TreeInfo`` (the
    outermost calls of the recursive ``NUTS._build_tree``)."""

    _nesting = 0

    def _build_tree(self, *args, **kwargs):
        self._nesting += 1
        try:
            tree = super()._build_tree(*args, **kwargs)
        finally:
            self._nesting -= 1
        if self._nesting == 0:
            self.on_doubling(tree)
        return tree


def potential_energy(kernel) -> torch.Tensor | None:
    """The kernel's cached potential energy (minus the log density, unconstrained space) of its
    current state, or None before the first evaluation."""
    return kernel._fetch_from_cache()[1]


def kinetic_energy(kernel, r_unscaled: dict) -> torch.Tensor:
    """Kinetic energy of the unscaled momentum ``r_unscaled`` under the kernel's mass matrix."""
    return kernel._kinetic_energy(r_unscaled)


def mean_accept_prob(kernel) -> float:
    """The kernel's running mean acceptance probability (over warm-up, then over kept draws)."""
    return kernel._mean_accept_prob


def num_divergences(kernel) -> int:
    """Divergent transitions the kernel has counted after warm-up."""
    return len(kernel._divergences)


def num_transitions(kernel) -> int:
    """Transitions the kernel has made, warm-up included."""
    return kernel._t


def num_warmup_transitions(kernel) -> int:
    """The kernel's warm-up length, as given to ``setup``."""
    return kernel._warmup_steps


def doubling_summary(trees: list) -> tuple[int, int]:
    """``(tree_depth, n_steps)`` of one NUTS transition from its top-level subtrees.

    The depth counts the doublings that were kept (the last one is dropped when it diverged or
    turned, as Stan reports it); ``n_steps`` counts every leapfrog step taken.
    """
    last = trees[-1]
    depth = len(trees) - int(bool(last.diverging or last.turning))
    return depth, sum(int(tree.num_proposals) for tree in trees)


def runs_in_worker_processes(mcmc) -> bool:
    """True when ``mcmc`` runs its chains in worker processes (Pyro's ``_MultiSampler``)."""
    return type(mcmc.sampler).__name__ == "_MultiSampler"


class ChainRecorder:
    """Keeps what each chain of ``mcmc`` sends to the parent process, so that an interrupted run
    loses nothing: wraps ``mcmc.sampler.run``, whose first item per chain is the chain's
    ``{site: shape}`` structure, then one flat unconstrained vector per kept draw, then the
    kernel's ``diagnostics()``.

    Attributes:
        structure: ``{site: torch.Size}`` of the sampled sites (None before the first chain).
        draws: ``{chain: [flat draw, ...]}``.
        diagnostics: ``{chain: kernel.diagnostics()}`` of the chains that finished.
    """

    def __init__(self, mcmc) -> None:
        self.structure: dict | None = None
        self.draws: dict[int, list[torch.Tensor]] = {}
        self.diagnostics: dict[int, dict] = {}
        inner = mcmc.sampler.run

        def run(*args, **kwargs):
            for item, chain in inner(*args, **kwargs):
                if isinstance(item, torch.Tensor):
                    self.draws.setdefault(chain, []).append(item.clone())
                elif chain in self.draws or chain in self.diagnostics:
                    self.diagnostics[chain] = item
                else:
                    self.structure = item
                yield item, chain

        mcmc.sampler.run = run

    def unflatten(self, chains: list[int], length: int) -> dict[str, torch.Tensor]:
        """``{site: (len(chains), length, *shape)}`` unconstrained draws of ``chains``, each cut
        to its first ``length`` draws."""
        flat = torch.stack([torch.stack(self.draws[c][:length]) for c in chains])
        samples, position = {}, 0
        for name in sorted(self.structure):
            shape = self.structure[name]
            size = shape.numel()
            samples[name] = flat[..., position : position + size].reshape(
                len(chains), length, *shape
            )
            position += size
        return samples


def stop_workers(mcmc) -> None:
    """Shut down ``mcmc``'s worker processes (after a Ctrl-C; a no-op for in-process chains)."""
    mcmc.sampler.terminate(True)


__all__ = [
    "PYRO_SERIES",
    "ChainRecorder",
    "MomentumHook",
    "TreeHook",
    "check_mean_field_requirement",
    "doubling_summary",
    "get_importance_trace",
    "initialize_model",
    "is_validation_enabled",
    "kinetic_energy",
    "mean_accept_prob",
    "module_sample_attributes",
    "module_site_name",
    "num_divergences",
    "num_transitions",
    "num_warmup_transitions",
    "potential_energy",
    "prune_subsample_sites",
    "runs_in_worker_processes",
    "scale_and_mask",
    "site_is_subsample",
    "stop_workers",
]
