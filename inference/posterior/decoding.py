"""Step-by-step decoding of a causal model over one explicit set of posterior draws.

``Posterior.decoder`` builds a ``NextTokenDecoder``; ``models.generate`` drives it. The draws
are taken once and condition every step. Each step returns every draw's next-token
distribution for a batch of sequences that advance in lockstep. With a key-value cache
(``probtransformer.kv_cache``) a step encodes only the newest tokens; without it, the window
of the last ``max_len`` tokens. Draws that run vectorized share one pass and one cache;
ensemble members and MC-dropout draws run one pass each, with their own cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyro
import torch
from pyro import poutine
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from probtransformer import kv_cache
from probtransformer.inference._runtime import pyro_scope, seeded
from probtransformer.inference.model_checks import DRAWS_DIM, DRAWS_PLATE
from probtransformer.inference.posterior.draws import Draws
from probtransformer.inference.posterior.prediction import _dropout_active, _flatten_chains
from probtransformer.inference.vi.guides import has_local_latents


@dataclass
class _Pass:
    """One forward pass of a decoding step: draws ``first`` to ``first + num`` of the flat
    draws, their conditioned latents, their KV cache, the model parameters they run with, and
    their latent values once computed."""

    first: int
    num: int
    condition: dict[str, torch.Tensor]
    cache: kv_cache.KVCache | None
    parameters: dict[str, torch.Tensor]
    values: dict[str, torch.Tensor] = field(default_factory=dict)


class NextTokenDecoder:
    """Next-token probabilities of every posterior draw for sequences decoded in lockstep.

    ``step(history, new)`` takes the ``(B, L)`` tokens so far, the last ``new`` of them not
    yet seen, and returns ``(S, B, V)`` (CPU): each draw's distribution of the token after each
    sequence. Without a cache each call re-encodes the last ``max_len`` tokens. With it, only
    the new tokens are encoded; when the window would outgrow ``max_len`` the cache restarts
    from the last ``max_len // 2`` tokens (or the last ``max_len`` new ones).

    Call ``step`` inside ``held()``. It runs the model without gradients, in its own Pyro
    param store, seeded, with dropout on for MC dropout. It also keeps each pass's latent
    values, conditioned on the draws, once they are computed: ``PyroModule`` caches a sample
    site's value while its context is open, so later steps skip Pyro's sample statements. The
    model's parameters are swapped for plain tensors (each member's for an ensemble, as
    ``torch.func.functional_call`` does): PyroModule issues a ``pyro.param`` statement at every
    access of an ``nn.Parameter``. The model itself is not changed.

    Args:
        model: a causal model with ``logits(x)`` (``(*draws, B, T, V)``) and ``max_len``.
        draws: the posterior draws (``Posterior.draw``), without local latents.
        device: where the model lives.
        seed: seeds what the passes draw (MC-dropout masks).
        cache: use the KV cache (True), re-encode the window at every step (False), or use
            it where the model allows (None: not with stochastic attention).

    Raises:
        TypeError: ``cache`` not None, True or False.
        ValueError: ``cache=True`` for a model with stochastic attention, whose per-sequence
            logit events a cache cannot extend step by step.
    """

    def __init__(
        self,
        model: nn.Module,
        draws: Draws,
        *,
        device: torch.device,
        seed: int,
        cache: bool | None = None,
    ) -> None:
        if cache is not None and not isinstance(cache, bool):
            raise TypeError(f"cache must be None, True or False, got {cache!r}")
        stochastic = has_local_latents(model)
        if cache and stochastic:
            raise ValueError(
                "cache=True, but this model's stochastic attention samples a logit event per "
                "sequence that a KV cache cannot extend: use cache=None or False"
            )
        self.model, self.device, self.seed, self.dropout = model, device, seed, draws.dropout
        self.num = draws.num
        flat = _flatten_chains(draws.latents)
        states = None if draws.states is None else _flatten_chains(draws.states)
        size = 1 if draws.dropout or states is not None else draws.num
        shared = {name: p.detach() for name, p in model.named_parameters()}
        use_cache = cache is not False and not stochastic
        self.passes = [
            _Pass(
                first=s,
                num=min(size, draws.num - s),
                condition={
                    k: v[s : s + size].reshape(-1, 1, *v.shape[1:]) for k, v in flat.items()
                },
                cache=kv_cache.KVCache() if use_cache else None,
                parameters=shared
                if states is None
                else shared | {k: v[s] for k, v in states.items()},
            )
            for s in range(0, draws.num, size)
        ]

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The context of the steps: no gradients, own param store, seeded, MC dropout on,
        the model's sample-value cache open and, with a single pass, its parameters swapped
        for tensors once (several passes swap at each step) and its attributes pinned."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(pyro_scope())
            stack.enter_context(torch.inference_mode())
            stack.enter_context(seeded(self.seed, self.device))
            stack.enter_context(_dropout_active(self.model, self.dropout))
            stack.enter_context(self.model._pyro_context)
            if len(self.passes) == 1:
                stack.enter_context(_reparametrize_module(self.model, self.passes[0].parameters))
                stack.enter_context(_pinned(self.model))
            yield

    def step(self, history: torch.Tensor, new: int) -> torch.Tensor:
        """``(S, B, V)`` next-token probabilities after ``history (B, L)``, whose last ``new``
        tokens the decoder has not seen yet."""
        max_len, length = self.model.max_len, history.shape[1]
        context = self.model._pyro_context
        probs = []
        for p in self.passes:
            cache = p.cache
            if cache is None:
                feed = history[:, -max_len:]
            elif cache.offset + new <= max_len:
                feed = history[:, length - new :]
            else:  # the window is full: encode the recent tokens afresh
                cache.reset()
                feed = history[:, -min(length, max(max_len // 2, min(new, max_len))) :]
            context.cache = p.values  # this pass's latent values (filled at its first step)
            with (
                kv_cache.decoding(cache),
                poutine.condition(data=p.condition),
                pyro.plate(DRAWS_PLATE, p.num, dim=DRAWS_DIM),
                contextlib.nullcontext()  # one pass: swapped once, in held()
                if len(self.passes) == 1
                else _reparametrize_module(self.model, p.parameters),
            ):
                logits = self.model.logits(feed)[:, :, -1]  # (s', B, V)
            if cache is not None:
                cache.advance(feed.shape[1])
            probs.append(torch.softmax(logits, -1).expand(p.num, *logits.shape[1:]))
        return torch.cat(probs).cpu()


@contextlib.contextmanager
def _pinned(model: nn.Module) -> Iterator[None]:
    """Every module's submodules, parameters and buffers also set in its instance ``__dict__``
    (removed on exit), where attribute lookup finds them before ``nn.Module.__getattr__`` and
    ``PyroModule.__getattr__`` run: about 70 lookups per decoding step, a tenth of its time.
    The values are those already swapped in, which the steps do not reassign; the latent
    sites (``PyroSample``) are not pinned and keep going through Pyro."""
    pinned = []
    for module in model.modules():
        for name, value in (*module._modules.items(), *module._parameters.items(),
                            *module._buffers.items()):  # fmt: skip
            if value is not None and name not in module.__dict__:
                module.__dict__[name] = value
                pinned.append((module, name))
    try:
        yield
    finally:
        for module, name in pinned:
            del module.__dict__[name]


__all__ = ["NextTokenDecoder"]
