"""The K-chain log density compiled: the model's own pass, traced once to ATen ops.

``CompiledPass`` evaluates ``VectorizedDensity``'s row pass (priors, Jacobians, likelihood of
K chains) as one compiled graph. Nothing is written twice: ``make_fx`` runs the Pyro trace of
the model once at the fit's shapes and records the ATen operations it performs, as a pure
function of ``(z (K, D), rows (B,), *per-chain parameters)``; the data and the fixed point
estimates become constants of that graph. ``torch.compile`` (Inductor, ``dynamic=False``;
on CUDA ``mode="reduce-overhead"``, CUDA graphs) fuses the many small ops of a small
Transformer (attention's 8x8 products, LayerNorm over 8 features) that an eager pass pays
PyTorch's per-op cost for, and AOTAutograd compiles the backward pass.

Safety: Python control flow that depends on a latent value cannot be recorded (``make_fx``
refuses to read a traced value), so a model that branches on its latents, fails to trace or
fails to compile keeps the eager pass with a warning that names the error. Every compiled shape
is compared once with the eager pass, value and gradient, at the states it first sees; a
mismatch beyond ``VERIFY_RTOL`` also falls back to eager with a warning. Dropout in train mode
draws masks that a compiled graph would draw from another stream, so such a model stays eager.

When to compile (the ``compile=None`` rule of ``fit_mcmc``, ``attach``): compiling takes
10-60 s on CPU and repays it only where the compiled gradient is faster; on the 2-core machine
of ``benchmarks/BENCHMARKS.md`` ("Compiled K-chain density") it was 1.6-6.6x faster than eager
for 1-256 chains, but that depends on the model, the CPU and the device. So a
phase (MAP starts, sampling) is compiled when its gradient evaluations, timed eager, would
take at least ``PAYBACK_SECONDS``, and the compiled pass is kept only when it then times
faster than eager; otherwise the record's ``compile_failure`` says what each took.

References: ``torch.fx.experimental.proxy_tensor.make_fx``; ``torch.compile`` (Ansel et al.,
"PyTorch 2", ASPLOS 2024). NumPyro gets the same from ``jax.jit`` of its potential.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from probtransformer.inference.mcmc.density import VectorizedDensity

#: A phase is compiled when its gradient evaluations would take at least this long eager.
PAYBACK_SECONDS = 120.0

#: Compiled value and gradient against eager at the first states of a shape: relative to the
#: largest magnitude of each (float32 reorders sums; observed <= 2e-6).
VERIFY_RTOL = 1e-4

#: ``torch.compile``'s backend of the fits' compiled densities.
BACKEND = "inductor"

#: Distinct shapes compiled per density at most (a pass per row chunk, MAP's mini-batch):
#: a further shape runs eager instead of compiling again.
MAX_SHAPES = 4


class CompiledPass:
    """``VectorizedDensity._pass`` as compiled graphs, one per shape.

    Args:
        density: the density whose pass is compiled (its model, data and ``parameters``).
        backend: ``torch.compile``'s backend (None: ``BACKEND``, Inductor), or ``"fx"``: the
            traced graph run as it is, without ``torch.compile`` (what the tests check).
        progress: print a line to stderr while a shape compiles.

    Attributes:
        seconds: compile seconds so far (tracing, code generation and the first forward and
            backward pass, summed over shapes).
        shapes: ``[(K, B), ...]`` the chains and rows of each compiled graph.
        failure: why compiling was given up (None while it has not been): the density then
            evaluates eager.
    """

    def __init__(self, density: VectorizedDensity, *, backend: str | None = None, progress=False):
        self.density = density
        self.backend = backend or BACKEND
        self.progress = progress
        self.cuda = density.device.type == "cuda"
        self.seconds = 0.0
        self.shapes: list[tuple[int, int]] = []
        self.failure: str | None = None
        self._graphs: dict[tuple, torch.nn.Module] = {}

    def __call__(self, z, index, scale: float, *, first: bool, jac: bool) -> torch.Tensor:
        """``(K,)`` log density of one pass, as ``VectorizedDensity._pass``, differentiable
        with respect to ``z`` and the per-chain ``parameters``."""
        density = self.density
        if not torch.is_grad_enabled():  # a graph without its backward would compile again
            return density._pass(z, index, scale, first=first, jac=jac)
        parameters = density.parameters or {}
        key = (
            tuple(z.shape), len(index), float(scale), first, jac,
            tuple((name, tuple(p.shape)) for name, p in parameters.items()),
        )  # fmt: skip
        graph = self._graphs.get(key)
        if graph is None:
            if self.failure is not None or len(self._graphs) >= MAX_SHAPES:
                return density._pass(z, index, scale, first=first, jac=jac)
            graph = self._build(key, z, index, scale, first, jac)
            if graph is None:
                return density._pass(z, index, scale, first=first, jac=jac)
        if self.cuda:  # CUDA graphs: the previous call's outputs were copied out
            torch.compiler.cudagraph_mark_step_begin()
        return graph(z, index, *parameters.values())

    def _build(self, key, z, index, scale, first, jac) -> torch.nn.Module | None:
        """Trace, compile and verify the graph of ``key``; None (and eager from now on) when
        that fails."""
        density = self.density
        names = list((density.parameters or {}).keys())
        chains, rows = len(z), len(index)
        if self.progress:
            tqdm.write(
                f"compiling the log density of {chains} chains x {rows} rows ...", file=sys.stderr
            )
        start = time.perf_counter()
        every = density.parameters

        def pass_(z, index, *values):
            density.parameters = dict(zip(names, values, strict=True)) if names else every
            try:
                return density._pass(z, index, scale, first=first, jac=jac)
            finally:
                density.parameters = every

        how = {"mode": "reduce-overhead"} if self.cuda else {}
        values = [p.detach() for p in (every or {}).values()]
        try:
            traced = make_fx(pass_)(z.detach(), index, *values)
            _prepare(traced)
            graph = traced
            if self.backend != "fx":
                graph = torch.compile(traced, backend=self.backend, dynamic=False, **how)
            error = self._verify(graph, z, index, scale, first, jac)
        except (KeyboardInterrupt, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 -- any failure to trace or compile: eager
            root = e.__cause__ or e  # the density's ValueError wraps the tracer's error
            error = f"{type(root).__name__}: {str(root).splitlines()[0] if str(root) else ''}"
        self.seconds += time.perf_counter() - start
        if error is not None:
            self.failure = error
            warnings.warn(
                f"the log density of {type(density.model).__name__} did not compile ({error}); "
                "it is evaluated eager (compile=False skips the attempt)",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        self._graphs[key] = graph
        self.shapes.append((chains, rows))
        return graph

    def _verify(self, graph, z, index, scale, first, jac) -> str | None:
        """Run ``graph`` forward and backward once (the compile) and compare value and gradient
        with the eager pass at ``z``'s finite chains; the mismatch found, or None."""
        density = self.density
        finite = torch.isfinite(z).all(1)
        if not finite.any():
            return "no finite state to verify the compiled graph at"
        z = z.detach()
        parameters = [p.detach() for p in (density.parameters or {}).values()]
        results = []
        for evaluate in (
            lambda u: graph(u, index, *parameters),
            lambda u: density._pass(u, index, scale, first=first, jac=jac),
        ):
            u = z.clone().requires_grad_(True)
            with torch.enable_grad():
                lp = evaluate(u)
                (grad,) = torch.autograd.grad(lp[finite].sum(), u)
            results.append((lp.detach().clone()[finite], grad[finite].clone()))
        (lp, grad), (lp_eager, grad_eager) = results
        for name, ours, theirs in (("value", lp, lp_eager), ("gradient", grad, grad_eager)):
            good = torch.isfinite(theirs)
            if not torch.equal(good, torch.isfinite(ours)):
                return f"its {name} is not finite where the eager pass's is, or the reverse"
            if good.any():
                scale_of = theirs[good].abs().max().clamp_min(1e-6)
                error = float((ours[good] - theirs[good]).abs().max() / scale_of)
                if error > VERIFY_RTOL:
                    return f"its {name} differs from the eager pass by {error:.2g} relative"
        return None

    def reject(self, reason: str) -> None:
        """Drop the compiled graphs for good: the density evaluates eager, ``failure`` says
        why (``attach``: a compiled pass no faster than eager)."""
        self._graphs.clear()
        self.shapes.clear()
        self.failure = reason

    def record(self) -> dict:
        """The record's summary: ``density_path``, ``compile_seconds``, ``compiled_shapes``."""
        path = "compiled" if self._graphs else "eager"
        return dict(
            density_path=path,
            compile_seconds=round(self.seconds, 2),
            compiled_shapes=[list(s) for s in self.shapes],
            compile_failure=self.failure,
        )


def _prepare(traced: torch.fx.GraphModule) -> None:
    """Drop the traced graph's dead nodes before Inductor sees it.

    Pyro's trace leaves unused operations behind, among them an ``aten.nonzero`` (an output of
    data-dependent shape). With one in the graph, Inductor's vectorized CPU kernels (torch
    2.13, AVX2 and AVX-512 alike) return a wrong log density for 32 or more chains, a
    different one on each call (values up to 1e17); without it they agree with eager to 1e-6.
    ``benchmarks/BENCHMARKS.md`` ("Compiled K-chain density") has the bisection.
    """
    traced.graph.eliminate_dead_code()
    traced.recompile()


def compilable(model: torch.nn.Module) -> bool:
    """False where the model draws dropout masks (train mode with ``p > 0``): a compiled graph
    draws them from another random stream than the eager pass it is verified against."""
    return not any(
        m.training and getattr(m, "p", 0.0) > 0
        for m in model.modules()
        if isinstance(m, torch.nn.modules.dropout._DropoutNd)
    )


def seconds_per_call(evaluate: Callable[[], object], repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls of ``evaluate()`` (its result dropped), seconds."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        evaluate()
        best = min(best, time.perf_counter() - start)
    return best


def attach(
    compiled: CompiledPass, compile: bool | None, calls: int, evaluate: Callable[[], object]
) -> None:
    """Set ``compiled.density.compiled`` for a phase of ``calls`` gradient evaluations like
    ``evaluate()``: ``compiled`` when ``compile`` is True, or when it is None, the phase's
    eager gradients would take ``PAYBACK_SECONDS`` and the compiled pass then times faster
    than eager (else ``compiled.reject``); otherwise None (eager). A failed compile stays
    eager.

    Raises:
        ValueError: ``compile=True`` for a model that is not ``compilable``.
    """
    density = compiled.density
    density.compiled = None
    if compile is False or compiled.failure is not None:
        return
    if not compilable(density.model):
        if compile:
            raise ValueError(
                f"compile=True, but {type(density.model).__name__} draws dropout masks "
                "(train mode, p > 0), which a compiled graph cannot reproduce: set dropout=0 "
                "or compile=None"
            )
        return
    if compile:
        density.compiled = compiled
        return
    eager = seconds_per_call(evaluate)
    if calls * eager < PAYBACK_SECONDS:
        return
    density.compiled = compiled
    evaluate()  # compiles (or fails, and stays eager)
    if compiled.failure is None and (faster := seconds_per_call(evaluate)) >= eager:
        compiled.reject(
            f"compiled {1e3 * faster:.3g} ms per gradient, eager {1e3 * eager:.3g} ms: eager kept"
        )
        density.compiled = None


def check_compile(compile: object) -> None:
    """``compile`` is True, False or None (choose per phase).

    Raises:
        TypeError: anything else, named.
    """
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"compile must be True, False or None (choose), got {compile!r}")


__all__ = [
    "PAYBACK_SECONDS",
    "CompiledPass",
    "attach",
    "check_compile",
    "compilable",
    "seconds_per_call",
]
