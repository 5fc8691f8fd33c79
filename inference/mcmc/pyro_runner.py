"""Pyro's HMC and NUTS kernels for ``fit_mcmc(kernel=NUTS() | HMC())``: per-draw sampler
statistics recovered from the kernels' hooks, the initial-density check, and the run that
collects what the chains send (Ctrl-C included)."""

from __future__ import annotations

import math
import sys
import warnings

import pyro
import torch
from pyro import poutine
from pyro.infer.autoguide.initialization import InitMessenger, init_to_uniform
from pyro.infer.mcmc import HMC, MCMC, NUTS
from pyro.infer.reparam import LocScaleReparam

from probtransformer._progress import progress_bar
from probtransformer.attention import LOCAL_LATENT
from probtransformer.inference._pyro_compat import (
    ChainRecorder,
    MomentumHook,
    TreeHook,
    doubling_summary,
    initialize_model,
    kinetic_energy,
    mean_accept_prob,
    num_divergences,
    num_transitions,
    num_warmup_transitions,
    potential_energy,
    runs_in_worker_processes,
    stop_workers,
)
from probtransformer.inference._runtime import pyro_scope, seeded
from probtransformer.inference.mcmc.kernel import PyroKernel
from probtransformer.inference.model_checks import check_sampled_sites
from probtransformer.inference.vi.guides import has_local_latents

#: Per-draw statistics under ArviZ's ``sample_stats`` names.
SAMPLE_STATS = (
    "diverging",
    "acceptance_rate",
    "step_size",
    "tree_depth",
    "n_steps",
    "energy",
    "lp",
)


class _SampleStats(MomentumHook):
    """Mixin for Pyro's ``HMC``/``NUTS`` that records one set of statistics per kept draw.

    Pyro keeps the energy, tree depth and per-transition acceptance probability in locals of
    ``sample``; they are recovered here from the kernel's hooks (``on_momentum`` at the start of
    each transition, ``on_doubling`` at every top-level doubling; see ``_pyro_compat``) and
    returned by ``diagnostics()`` under ``"sample_stats"``, which Pyro sends back from worker
    processes too.

    ``energy`` is the Hamiltonian at the start of the transition (after the momentum refresh),
    the quantity E-BFMI is defined on (Betancourt 2016); ``lp`` is minus the potential energy of
    the kept draw (log density in the unconstrained space, Jacobians included, as Stan's lp__).
    """

    def setup(self, warmup_steps, *args, **kwargs):
        self.draw_stats: list[dict] = []
        super().setup(warmup_steps, *args, **kwargs)

    def on_momentum(self, r_unscaled: dict) -> None:
        energy = potential_energy(self)
        if energy is not None:
            self.transition_energy = float(kinetic_energy(self, r_unscaled) + energy)

    def sample(self, params):
        previous_mean = mean_accept_prob(self)
        divergences = num_divergences(self)
        step_size = float(self.step_size)
        self.transition_energy = math.nan
        self.transition_trees: list = []
        z = super().sample(params)
        t, warmup = num_transitions(self), num_warmup_transitions(self)
        n = t - warmup if t > warmup else t
        # Pyro keeps a running mean of the acceptance probability; invert one update of it.
        accept = mean_accept_prob(self) * n - previous_mean * (n - 1)
        energy = potential_energy(self)
        if self.transition_trees:  # NUTS: the doubling loop's tree_depth and leapfrog count
            depth, n_steps = doubling_summary(self.transition_trees)
        else:  # HMC: a fixed trajectory
            depth, n_steps = 0, int(self.num_steps)
        if t > warmup:
            self.draw_stats.append(
                dict(
                    diverging=num_divergences(self) > divergences,
                    acceptance_rate=min(max(accept, 0.0), 1.0),
                    step_size=step_size,
                    tree_depth=depth,
                    n_steps=n_steps,
                    energy=self.transition_energy,
                    lp=-float(energy) if energy is not None else math.nan,
                )
            )
        return z

    def diagnostics(self):
        return {**super().diagnostics(), "sample_stats": _columns(self.draw_stats)}


def _columns(draw_stats: list[dict]) -> dict[str, list]:
    return {k: [d[k] for d in draw_stats] for k in SAMPLE_STATS}


class RecordingHMC(_SampleStats, HMC):
    """Pyro's ``HMC`` that also reports per-draw ``sample_stats`` (see ``_SampleStats``)."""


class RecordingNUTS(_SampleStats, TreeHook, NUTS):
    """Pyro's ``NUTS`` that also reports per-draw ``sample_stats`` (see ``_SampleStats``)."""

    def on_doubling(self, tree) -> None:
        self.transition_trees.append(tree)


class _LineHook:
    """Pyro MCMC's ``hook_fn`` when stderr is no terminal: a chain's progress as plain lines
    (``_progress.progress_bar``). Pickled into the worker process of each chain when Pyro runs
    them in parallel; its bar is made where it runs."""

    def __init__(self, kernel: str, transitions: int) -> None:
        self.kernel, self.transitions = kernel, transitions
        self._bar = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_bar": None}

    def __call__(self, kernel, params, stage: str, i: int) -> None:
        if self._bar is None:  # a chain's first transition
            self._bar = progress_bar(
                total=self.transitions, desc=self.kernel.upper(), unit="transitions"
            )
        self._bar.set_postfix(stage=stage.lower())  # "warmup [1]": Pyro names the chain
        self._bar.update(1)
        if self._bar.n >= self.transitions:  # the chain's last transition
            self._bar.close()
            self._bar = None


def run_pyro_kernel(
    model,
    train,
    kept,
    kernel: PyroKernel,
    *,
    num_chains: int,
    num_warmup: int,
    num_samples: int,
    seed: int,
    progress: bool,
):
    """Pyro's NUTS or HMC; ``(samples, sample_stats, {"partial", "parallel"})``. Stochastic
    attention's per-logit draws are still among the samples."""
    args = (train.x, train.y, train.mask)
    device = train.x.device
    density = _non_centred(model)
    with pyro_scope(), seeded(seed, device):
        transforms, *sampled = check_initial_density(density, args)
        check_sampled_sites(*sampled, *kept, len(train))  # uses no random numbers
        sampler = kernel.pyro_kernel(density)
        partial = False
        # Pyro's bar needs a terminal; in a log each chain writes plain lines (_LineHook)
        lines = progress and not sys.stderr.isatty()
        transitions = num_warmup + num_samples
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="num_chains=.*Chains will be drawn")
            mcmc = MCMC(
                sampler,
                num_samples=num_samples,
                warmup_steps=num_warmup,
                num_chains=num_chains,
                mp_context="spawn" if device.type == "cuda" else None,
                disable_progbar=not progress or lines,
                hook_fn=_LineHook(kernel.name, transitions) if lines else None,
            )
            received = ChainRecorder(mcmc)
            try:
                mcmc.run(*args)
            except KeyboardInterrupt:
                partial = True
                stop_workers(mcmc)
            except RuntimeError as e:  # the density ran without the JIT in check_initial_density
                if not kernel.jit_compile:
                    raise
                raise ValueError(
                    f"the PyTorch JIT could not run {type(model).__name__}'s traced log density "
                    f"({e}); fit again with jit_compile=False (the CLI's --no-jit-compile)"
                ) from e
    samples, stats = _collect(received, sampler, transforms)
    return samples, stats, dict(partial=partial, parallel=runs_in_worker_processes(mcmc))


def _non_centred(model):
    """``model`` with its local latents (stochastic attention) sampled non-centred,
    ``z = loc + scale · ε`` with ``ε ~ N(0, 1)`` (``LocScaleReparam``): the centred form gives HMC
    a funnel between the noise scales and the logits (Betancourt & Girolami 2015)."""
    if not has_local_latents(model):
        return model
    return poutine.reparam(
        model, config=lambda msg: LocScaleReparam(0.0) if msg["infer"].get(LOCAL_LATENT) else None
    )


def check_initial_density(model, args) -> tuple[dict, dict, poutine.Trace]:
    """``(transforms, initial, trace)``: the unconstrained-space transforms of the model's
    latents, their initial unconstrained values (the sites the sampler returns) and Pyro's
    prototype trace. Raises when the model has no latents, or naming the site when uniform
    initial values give a non-finite log density (Pyro itself only says it gave up)."""
    try:
        initial, _, transforms, trace = initialize_model(
            model, model_args=args, init_strategy=init_to_uniform
        )
    except (RuntimeError, ValueError) as e:
        site = _first_non_finite_site(model, args)
        if site is None:
            raise
        raise ValueError(
            f"the model's log density is not finite at its initial parameters: site {site!r}; "
            "check its prior and likelihood parameters (and the data) for NaN/inf"
        ) from e
    if not initial:
        raise ValueError(
            f"{type(model).__name__} has no latent sample sites: there is nothing for HMC to "
            "sample; make some parts Bayesian, or fit a point estimate with "
            "fit_svi(guide='delta')"
        )
    return transforms, initial, trace


def _first_non_finite_site(model, args) -> str | None:
    with torch.no_grad(), pyro.validation_enabled(False):
        trace = poutine.trace(InitMessenger(init_to_uniform)(model)).get_trace(*args)
        for name, site in trace.nodes.items():
            if site["type"] != "sample":
                continue
            value = site["value"]
            log_prob = site["fn"].log_prob(value)
            if not (torch.isfinite(value).all() and torch.isfinite(log_prob).all()):
                return name
    return None


def _collect(received: ChainRecorder, kernel, transforms) -> tuple[dict, dict]:
    """``({site: (chain, draw, ...)}, sample_stats)`` of what the chains sent, constrained;
    chains cut to a common length."""
    chains = sorted(c for c, draws in received.draws.items() if draws)
    if not chains or received.structure is None:
        return {}, {}
    length = min(len(received.draws[c]) for c in chains)
    samples = received.unflatten(chains, length)
    for name, value in samples.items():
        if name in transforms:
            samples[name] = transforms[name].inv(value)
    per_chain = []
    for c in chains:
        if c in received.diagnostics:
            per_chain.append(received.diagnostics[c]["sample_stats"])
        elif len(getattr(kernel, "draw_stats", ())) >= length:  # interrupted, in-process
            per_chain.append(_columns(kernel.draw_stats))
        else:
            per_chain = None  # interrupted in a worker process: its statistics are lost
            break
    stats = {}
    if per_chain is not None:
        stats = {k: [chain[k][:length] for chain in per_chain] for k in SAMPLE_STATS}
    return samples, stats


__all__ = [
    "RecordingHMC",
    "RecordingNUTS",
    "SAMPLE_STATS",
    "check_initial_density",
    "run_pyro_kernel",
]
