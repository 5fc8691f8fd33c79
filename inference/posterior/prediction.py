"""The prediction engine: runs a model for an explicit set of posterior draws, vectorized.

As Pyro's ``Predictive`` (``posterior_samples=...``), the engine never chooses draws: it takes a
``Draws`` (``inference.posterior.draws``), conditions the model on them under a plate over draws
at dim
``-2`` (the model's data plate is dim ``-1``), and lets a ``read`` function pick outputs from the
trace. Rows, and if need be draws, are split into passes whose estimated intermediates fit a
memory budget. MC dropout and ensembles run one pass per draw (dropout masks and member
parameters cannot be vectorized over draws).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

import pyro
import torch
from pyro import poutine
from torch import nn

from probtransformer.attention import amortized
from probtransformer.inference._runtime import is_invalid_parameter_error, pyro_scope, seeded
from probtransformer.inference.model_checks import DRAWS_DIM, DRAWS_PLATE, check_draw_batch_shape
from probtransformer.inference.posterior.draws import Draws
from probtransformer.inference.posterior.linearized import natural_output, with_output
from probtransformer.inference.vi.guides import AmortizedGuide
from probtransformer.validation import check_int

#: Rows per vectorized forward pass in ``predict``/``attention``/``log_likelihood``.
DEFAULT_BATCH_SIZE = 256

#: Bytes the intermediate tensors of one forward pass of ``predict``/``attention``/
#: ``pointwise`` may take (256 MiB): rows, and if need be draws, are split into passes to fit.
#: Larger passes are not faster on a CPU: 100 draws of the digits classifier on 450 rows took
#: 4.7 s in passes of up to 1 GiB and 3.4 s of up to 256 MiB or 64 MiB (memory traffic; see
#: ``benchmarks/predictive_cost.py``).
DEFAULT_MEMORY_BUDGET = 2**28

#: ``read(trace) -> {name: (S, n, ...)}``: what a pass returns from the model's trace.
Reader = Callable[[poutine.Trace], dict[str, torch.Tensor]]


def model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters (or buffers) live; CPU for a model with neither."""
    return next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device


class PredictionEngine:
    """Vectorized forward passes of ``model`` over explicit draws.

    Args:
        model: the fitted model (in eval mode).
        guide: the fit's guide when it is amortized (stochastic attention's local latents come
            from it); otherwise ignored.
        local_sites: names of kept local latents ``(S, N, *per_row)``: each row batch is
            conditioned on its rows of them.
    """

    def __init__(self, model: nn.Module, *, guide=None, local_sites=()) -> None:
        self.model = model
        self.amortized_guide = guide if isinstance(guide, AmortizedGuide) else None
        self.local_sites = frozenset(local_sites)
        self.device = model_device(model)

    def run(
        self,
        draws: Draws,
        x: torch.Tensor,
        y: torch.Tensor | None,
        mask: torch.Tensor | None,
        read: Reader,
        *,
        seed: int,
        batch_size: int = DEFAULT_BATCH_SIZE,
        memory_budget: int | None = DEFAULT_MEMORY_BUDGET,
    ) -> dict[str, torch.Tensor]:
        """Run the model on ``(x, y, mask)`` for every draw; outputs ``(chain, draw, n, ...)``.

        Each forward pass holds at most ``batch_size`` rows, and the rows and draws of a pass are
        chosen so that the estimated intermediates (``activation_bytes``) fit ``memory_budget``
        bytes (None: no limit). ``seed`` seeds what the passes draw (regression samples,
        stochastic attention, dropout masks).

        Raises:
            ValueError: a bad ``batch_size`` or ``memory_budget``; non-finite outputs; a
                likelihood whose batch shape is not ``(S, n)``.
        """
        check_int("batch_size", batch_size)
        if memory_budget is not None and (
            isinstance(memory_budget, bool)
            or not isinstance(memory_budget, int)
            or memory_budget < 1
        ):
            raise ValueError(
                f"memory_budget must be a number of bytes >= 1 or None, got {memory_budget!r}"
            )
        num, step = draws.num, draws.num
        if memory_budget is not None:
            cost = activation_bytes(self.model, x)  # per draw and row
            step = max(1, min(num, memory_budget // cost))
            batch_size = max(1, min(batch_size, memory_budget // (cost * step)))
        flat = _flatten_chains(draws.latents)
        states = None if draws.states is None else _flatten_chains(draws.states)
        modes = None if draws.modes is None else _flatten_chains(draws.modes)
        if draws.dropout:
            # A vectorized pass would reuse one dropout mask for all draws wherever a tensor
            # has no draw dim yet: draw s runs alone, with dropout on (MC dropout); the model's
            # dropout mode is restored afterwards, also on errors.
            step = 1
        passes = []
        with (
            seeded(seed, self.device),
            _dropout_active(self.model, draws.dropout),
            _parameters_kept(self.model, states),
        ):
            for start, stop in _passes(num, step, states):
                if states is not None:
                    _set_parameters(self.model, {k: v[start] for k, v in states.items()})
                some = {k: v[start:stop] for k, v in flat.items()}
                linearized = None if modes is None else {k: v[start:stop] for k, v in modes.items()}
                passes.append(self._run_vectorized(some, x, y, mask, read, batch_size, linearized))
        out = {key: torch.cat([p[key] for p in passes]) for key in passes[0]}
        return {k: v.reshape(draws.chains, draws.per_chain, *v.shape[1:]) for k, v in out.items()}

    def _run_vectorized(
        self,
        flat_draws: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor | None,
        mask: torch.Tensor | None,
        read: Reader,
        batch_size: int,
        modes: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run the model once per row batch for all draws at once; ``read`` picks the outputs.

        Local latents in ``flat_draws`` (``(S, N, *per_row)``, ``x`` being the training data)
        condition each batch on its rows. Each output of ``read`` has dims ``(S, n, ...)``;
        batches are joined along ``n`` on CPU. ``modes`` (``{site: (S, *shape)}``): the
        likelihood is taken at the network linearized around them (``linearized_output``); the
        rest of the trace (attention) is the network's at the draws.
        """
        num = next(iter(flat_draws.values())).shape[0] if flat_draws else 1
        local = {k: v for k, v in flat_draws.items() if k in self.local_sites}
        condition = {
            k: v.reshape(num, 1, *v.shape[1:]) for k, v in flat_draws.items() if k not in local
        }
        pieces: dict[str, list[torch.Tensor]] = {}
        with pyro_scope(), torch.no_grad():
            for start in range(0, x.shape[0], batch_size):
                rows = slice(start, start + batch_size)
                args = (
                    x[rows],
                    None if y is None else y[rows],
                    None if mask is None else mask[rows],
                )
                rows_condition = {**condition, **{k: v[:, rows] for k, v in local.items()}}
                linearized = None
                if modes is not None:
                    if start == 0:  # mirrors the plain parameters into the param store, which
                        self.trace(rows_condition, num, args)  # jvp cannot do itself
                    linearized = self.linearized_output(rows_condition, modes, num, args)
                # the pass at the draws after the linearized one: what the modules keep of a
                # pass (attention weights) is the network's at the draws
                trace = self.trace(rows_condition, num, args, first_row=start)
                if linearized is not None:
                    node = trace.nodes[self.model.likelihood_site]
                    node["fn"] = with_output(node["fn"], linearized)
                for key, value in read(trace).items():
                    pieces.setdefault(key, []).append(value.cpu())
        return {
            key: torch.cat([v.expand(num, *v.shape[1:]) for v in values], dim=1)
            for key, values in pieces.items()
        }

    def trace(
        self,
        condition: dict[str, torch.Tensor],
        num: int,
        args: tuple,
        *,
        first_row: int = 0,
    ) -> poutine.Trace:
        """One traced forward pass of the model on ``args = (x, y, mask)`` for ``num`` draws,
        conditioned on ``condition`` (``{site: (num, 1 or n, *shape)}``), inside the plate over
        draws. Call it under ``pyro_scope()`` and ``torch.no_grad()``.

        Raises:
            ValueError: non-finite outputs, or a model that fails on the inputs (naming the rows
                from ``first_row`` on); a likelihood whose batch shape is not ``(num, n)``.
        """
        site = self.model.likelihood_site
        model = _LikelihoodNotSampled(site, self.device)(
            poutine.condition(self.model, data=condition)
        )
        if self.amortized_guide is not None:  # local latents from the guide
            model = amortized(self.amortized_guide)(model)
        try:
            with pyro.plate(DRAWS_PLATE, num, dim=DRAWS_DIM):  # -1: the data plate
                trace = poutine.trace(model).get_trace(*args)
        except ValueError as e:
            if not is_invalid_parameter_error(e):
                raise
            raise ValueError(
                f"the model's outputs are not finite for input rows {first_row} to "
                f"{first_row + args[0].shape[0] - 1}: are the inputs scaled as in training?"
            ) from e
        except RuntimeError as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise ValueError(
                f"the model fails on inputs of shape {tuple(args[0].shape)} under {num} "
                f"vectorized posterior draws ({str(e).splitlines()[0]}): give inputs "
                "shaped as the training data; a model of your own must let each latent "
                "(draws, 1, *shape) broadcast from the right (docs/protocol.md)"
            ) from e
        check_draw_batch_shape(site, trace.nodes[site]["fn"], num, args[0].shape[0])
        return trace

    def linearized_output(
        self,
        condition: dict[str, torch.Tensor],
        modes: dict[str, torch.Tensor],
        num: int,
        args: tuple,
    ) -> torch.Tensor:
        """The likelihood's natural output (``linearized.natural_output``) of the network
        linearized in the sites of ``modes`` (``{site: (num, *shape)}``) around them:
        ``f(modes) + J (draws - modes)``, one forward-mode pass (``torch.func.jvp``) for all
        ``num`` draws."""
        site = self.model.likelihood_site
        primals = {k: v.reshape(num, 1, *v.shape[1:]) for k, v in modes.items()}
        tangents = {k: condition[k] - v for k, v in primals.items()}

        def output(values):
            return natural_output(
                likelihood(self.trace({**condition, **values}, num, args), site)
            ).f

        f, df = torch.func.jvp(output, (primals,), (tangents,))
        return f + df


# -- readers: what a pass returns -------------------------------------------------------------


def likelihood(trace: poutine.Trace, site: str):
    """The likelihood distribution of the observed ``site`` in ``trace``."""
    return trace.nodes[site]["fn"]


def predictive_reader(site: str) -> Reader:
    """Categorical likelihoods: ``probs``; others: ``samples``, ``loc`` and ``variance``, and
    for a Normal or Student-t ``df`` (``inf`` for a Normal), each entry's degrees of freedom."""

    def read(trace):
        fn = likelihood(trace, site)
        categorical = _categorical(fn)
        if categorical is not None:
            return {"probs": categorical.probs}
        out = {"samples": fn.sample(), "loc": fn.mean, "variance": fn.variance}
        df = _student_df(fn)
        if df is not None:
            out["df"] = df.expand(out["loc"].shape)
        return out

    return read


def pointwise_reader(site: str, *, log_lik: bool) -> Reader:
    """``replicated`` draws of the targets and, with ``log_lik``, their pointwise log density."""

    def read(trace):
        fn = likelihood(trace, site)
        out = {"replicated": fn.sample()}
        if log_lik:
            out["log_lik"] = fn.log_prob(trace.nodes[site]["value"])
        return out

    return read


def attention_reader(modules) -> Reader:
    """``attention`` ``(S, n, layer, head, query, key)`` of the given attention modules."""

    def read(trace):
        weights = [m.attention_weights for m in modules]  # each (s, n, H, Tq, Tk)
        size = max(w.shape[0] for w in weights)
        return {"attention": torch.stack([w.expand(size, *w.shape[1:]) for w in weights], 2)}

    return read


def activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Estimated bytes of the intermediate tensors of one forward pass, per draw and input row.

    Attention dominates: each module keeps about 4 float32 ``(H, T, T)`` tensors (logits,
    masked logits, weights, recorded weights) and about 12 ``(T, d)`` activations, with ``T``
    the input length plus one (a CLS token). Models without ``attention_modules`` count 16
    copies of an input row.
    """
    steps = (x.shape[1] if x.dim() > 1 else 1) + 1
    elements = 0
    for modules in getattr(model, "attention_modules", {}).values():
        for m in modules:
            elements += 4 * m.num_heads * steps * steps + 12 * steps * m.d_model
    return 4 * max(elements, 16 * x[0].numel(), 1)


def dropout_modules(model: nn.Module) -> list[nn.Dropout]:
    """The model's ``torch.nn.Dropout`` modules with ``p > 0`` (what MC dropout keeps on)."""
    return [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]


class _LikelihoodNotSampled(poutine.messenger.Messenger):
    """Skip drawing the unobserved likelihood site: every reader uses its ``fn`` (probs, loc,
    or its own ``fn.sample()``), and a categorical draw over (S, N, T, V) costs as much as a
    third of a token model's forward pass. The site's value is a placeholder of zeros."""

    def __init__(self, site: str, device: torch.device) -> None:
        super().__init__()
        self.site = site
        self.device = device

    def _pyro_sample(self, msg) -> None:
        if msg["name"] == self.site and msg["value"] is None and not msg["is_observed"]:
            fn = msg["fn"]
            dtype = torch.long if fn.support.is_discrete else torch.get_default_dtype()
            msg["value"] = torch.zeros(fn.shape(), dtype=dtype, device=self.device)


@contextlib.contextmanager
def _dropout_active(model: nn.Module, active: bool) -> Iterator[None]:
    """Put only the model's ``nn.Dropout`` modules in train mode (when ``active``); restore
    each module's mode afterwards, also on errors."""
    modules = [m for m in model.modules() if isinstance(m, nn.Dropout)] if active else []
    modes = [m.training for m in modules]
    try:
        for module in modules:
            module.train()
        yield
    finally:
        for module, mode in zip(modules, modes, strict=True):
            module.train(mode)


def _set_parameters(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` into the model's parameters of those names, in place."""
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            parameters[name].copy_(value)


@contextlib.contextmanager
def _parameters_kept(model: nn.Module, states: dict | None) -> Iterator[None]:
    """Restore the model's parameters after the block when ``states`` will overwrite them."""
    kept = None
    if states is not None:
        kept = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        yield
    finally:
        if kept is not None:
            _set_parameters(model, kept)


def _student_df(fn) -> torch.Tensor | None:
    """Degrees of freedom of the Normal (``inf``) or Student-t inside ``fn`` (through
    ``.to_event``/``.mask`` wrappers only: a transformed Normal is another family), or None."""
    while isinstance(fn, (torch.distributions.Independent, pyro.distributions.MaskedDistribution)):
        fn = fn.base_dist
    if isinstance(fn, torch.distributions.Normal):
        return torch.full((), torch.inf, device=fn.loc.device)
    if isinstance(fn, torch.distributions.StudentT):
        return fn.df
    return None


def _categorical(fn) -> torch.distributions.Categorical | None:
    """The ``Categorical`` inside ``fn`` (through ``.to_event``/``.mask`` wrappers), or None."""
    while not isinstance(fn, torch.distributions.Categorical):
        fn = getattr(fn, "base_dist", None)
        if fn is None:
            return None
    return fn


def _passes(num: int, step: int, states: dict | None) -> list[tuple[int, int]]:
    """``(start, stop)`` of the vectorized passes over ``num`` draws: at most ``step`` each,
    and, with per-draw parameters ``states`` (ensembles, MoLA), only draws that share them: a
    pass cannot give each draw its own parameters. Draw ``s`` then runs with ``states[.][s]``,
    the model's parameters restored afterwards (``_parameters_kept``)."""
    cuts = [0]
    for s in range(1, num):
        same = states is not None and all(torch.equal(v[s], v[s - 1]) for v in states.values())
        if s - cuts[-1] >= step or (states is not None and not same):
            cuts.append(s)
    return list(zip(cuts, [*cuts[1:], num], strict=True))


def _flatten_chains(draws: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.flatten(0, 1) for name, value in draws.items()}


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MEMORY_BUDGET",
    "PredictionEngine",
    "activation_bytes",
    "attention_reader",
    "dropout_modules",
    "pointwise_reader",
    "predictive_reader",
]
