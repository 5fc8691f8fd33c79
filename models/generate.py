"""Text generation from a fitted ``CausalLM`` posterior, with per-token uncertainty.

The engine conditions the model on one set of posterior draws for the whole generation and
decodes a batch of prompts in lockstep: every sequence advances one step per forward pass, a
sequence whose prompt is longer than the shortest one being fed its own prompt tokens (forced)
until they run out, so all sequences share their positions and need no padding. With the key-value
cache (``probtransformer.kv_cache``) a pass computes only the new step of each sequence.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from probtransformer.models.token import CausalLM
from probtransformer.validation import int_text

STRATEGIES = ("greedy", "sample")


@dataclass(frozen=True)
class Generation:
    """The result of ``generate``.

    Attributes:
        prompt: the prompt as given (text, or None for token ids).
        text: the generated continuation (None when the model has no string vocabulary).
        tokens: the generated tokens as strings (None without a string vocabulary).
        token_ids: ``(K,)`` int64 ids of the ``K`` generated tokens.
        entropy: ``(K,)`` total entropy in nats of the posterior predictive at each step
            (before temperature, top-k and top-p).
        aleatoric: ``(K,)`` expected entropy of the per-draw next-token distributions, nats.
        epistemic: ``(K,)`` mutual information between the next token and the weights, nats.
        unknown: number of prompt characters outside the vocabulary (mapped to ``<unk>``).
    """

    prompt: str | None
    text: str | None
    tokens: tuple[str, ...] | None
    token_ids: torch.Tensor
    entropy: torch.Tensor
    aleatoric: torch.Tensor
    epistemic: torch.Tensor
    unknown: int = 0

    def to_dataframe(self) -> pd.DataFrame:
        """One row per generated token: ``token_id``, ``token``, ``entropy``, ``aleatoric``,
        ``epistemic``."""
        return pd.DataFrame(
            {
                "token_id": self.token_ids.numpy(),
                "token": list(self.tokens or [None] * len(self)),
                "entropy": self.entropy.numpy(),
                "aleatoric": self.aleatoric.numpy(),
                "epistemic": self.epistemic.numpy(),
            }
        )

    def __len__(self) -> int:
        return len(self.token_ids)


def _filter(probs: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None):
    """Temperature, then top-k, then nucleus (top-p) truncation of ``probs (V,)``; renormalised.

    Top-p keeps the smallest set of most probable tokens whose mass reaches ``top_p`` (Holtzman
    et al. 2020, "The Curious Case of Neural Text Degeneration").
    """
    dtype = probs.dtype
    # in float64, where a temperature or top_p as small as 1e-300 is not 0
    log_probs = probs.clamp_min(1e-30).log().double()
    # the largest log-probability is 0 before the division: no overflow at any temperature > 0
    probs = torch.softmax((log_probs - log_probs.max()) / temperature, -1)
    if top_k is not None and top_k < probs.shape[-1]:
        kth = probs.topk(top_k).values[-1]
        probs = probs.where(probs >= kth, 0.0)
    if top_p is not None and top_p < 1:
        ordered, order = probs.sort(descending=True)
        cumulative = ordered.cumsum(-1) / ordered.sum()
        keep = cumulative - ordered / ordered.sum() < top_p  # mass before this token < top_p
        probs = torch.zeros_like(probs).scatter(0, order, ordered * keep)
    return (probs / probs.sum()).to(dtype)


def _check_options(
    max_new_tokens, strategy, temperature, top_k, top_p, seed, bayes_average, **_
) -> None:
    if not isinstance(bayes_average, bool):
        raise TypeError(f"bayes_average must be True or False, got {bayes_average!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not (0 < temperature < math.inf)
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1
    ):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1
    ):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


def prompt_ids(model: CausalLM, prompt) -> tuple[torch.Tensor, int]:
    """Token ids ``(T,)`` of the prompt and the number of characters outside the vocabulary.

    Text is read character by character (the vocabularies of ``datasets.load`` are characters);
    for other vocabularies give token ids.
    """
    if isinstance(prompt, str):
        if model.vocab is None:
            raise TypeError(
                "this CausalLM was built with an integer vocabulary size: give the prompt as a "
                "list or tensor of token ids"
            )
        if not prompt:
            raise ValueError("prompt must hold at least one character, got ''")
        index = {token: i for i, token in enumerate(model.vocab)}
        unknown = [ch for ch in prompt if ch not in index]
        if unknown and "<unk>" not in index:
            raise ValueError(
                f"prompt characters {sorted(set(unknown))[:10]} are outside the vocabulary, "
                "which has no '<unk>' token"
            )
        ids = [index.get(ch, index.get("<unk>")) for ch in prompt]
        return torch.tensor(ids, dtype=torch.long), len(unknown)
    if isinstance(prompt, pd.Series):
        prompt = prompt.to_numpy()
    if not isinstance(prompt, list | tuple | torch.Tensor | np.ndarray):
        raise TypeError(
            "prompt must be a str or a 1-D list / tensor / numpy array of int token ids, got "
            f"{type(prompt).__name__}"
        )
    if isinstance(prompt, list | tuple):
        prompt = [_as_id(t) for t in prompt]
    if isinstance(prompt, list | tuple) and not all(
        isinstance(t, numbers.Integral | np.integer) and not isinstance(t, bool | np.bool_)
        for t in prompt
    ):
        kinds = sorted({type(t).__name__ for t in prompt})
        raise TypeError(
            "a prompt of token ids must hold ints (or be a str, or a list of prompts), got "
            f"elements of type {', '.join(kinds)}"
        )
    if isinstance(prompt, list | tuple) and prompt:  # in Python ints: ids beyond int64 too
        _check_id_range(model, min(prompt), max(prompt))
    if isinstance(prompt, np.ndarray) and prompt.dtype.kind not in "iu":
        raise ValueError(
            f"prompt token ids must be integers, got a numpy array of dtype {prompt.dtype}"
        )
    if isinstance(prompt, np.ndarray) and prompt.size:  # before uint64 ids wrap in int64
        _check_id_range(model, int(prompt.min()), int(prompt.max()))
    # a copy: a read-only array (a pandas Series's values) would make torch warn
    ids = torch.as_tensor(prompt if isinstance(prompt, torch.Tensor) else np.array(prompt))
    if ids.device.type == "meta":
        raise ValueError("prompt is on the 'meta' device, which holds no values")
    if (
        ids.dim() != 1
        or ids.numel() == 0
        or ids.is_floating_point()
        or ids.is_complex()
        or ids.dtype == torch.bool
    ):
        raise ValueError(
            "prompt must be a non-empty str or a 1-D sequence of int token ids, got "
            f"shape {tuple(ids.shape)} and dtype {ids.dtype}"
        )
    ids = ids.long()
    _check_id_range(model, int(ids.min()), int(ids.max()))
    return ids, 0


def _check_id_range(model: CausalLM, low: int, high: int) -> None:
    if low < 0 or high >= model.vocab_size:
        raise ValueError(
            f"prompt token ids must lie in [0, {model.vocab_size}), got values in "
            f"[{int_text(low)}, {int_text(high)}]"
        )


def _as_id(t):
    """A 0-d integer tensor or array as a Python int (a token id); anything else as it is."""
    if isinstance(t, torch.Tensor | np.ndarray) and t.ndim == 0:
        if np.asarray(t.cpu() if isinstance(t, torch.Tensor) else t).dtype.kind in "iu":
            return int(t)
    return t


def _prompts(model: CausalLM, prompt) -> tuple[list, list[torch.Tensor], list[int], bool]:
    """The prompts one by one, their token ids, their counts of characters outside the
    vocabulary, and whether ``prompt`` was a batch (a list of prompts, or a 2-D tensor or array
    of token ids)."""

    def is_prompt(p) -> bool:  # a 0-d tensor or array is a token id, not a prompt
        if isinstance(p, torch.Tensor | np.ndarray):
            return p.ndim >= 1
        return isinstance(p, str | list | tuple | pd.Series)

    if isinstance(prompt, list | tuple) and prompt and all(is_prompt(p) for p in prompt):
        items, batched = list(prompt), True
    elif isinstance(prompt, torch.Tensor | np.ndarray) and prompt.ndim == 2:
        items, batched = list(prompt), True
    else:
        items, batched = [prompt], False
    if not items:
        raise ValueError("prompt is an empty batch: give at least one prompt")
    parsed = [prompt_ids(model, p) for p in items]
    return items, [ids for ids, _ in parsed], [unknown for _, unknown in parsed], batched


def generate(
    posterior,
    prompt,
    *,
    max_new_tokens: int = 100,
    strategy: str = "greedy",
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    bayes_average: bool = True,
    num_samples: int = 100,
    seed: int = 0,
    cache: bool | None = None,
) -> Generation | list[Generation]:
    """Generate tokens after ``prompt`` from a fitted ``CausalLM`` posterior.

    ``num_samples`` posterior draws are taken once (``posterior.draw(num_samples, seed=seed)``)
    and condition every step. At each step the model reads the tokens so far (the last
    ``max_len``) and gives, for each draw ``s``, a next-token distribution ``p_s (V,)``.

    - ``bayes_average=True``: decode from the posterior predictive ``mean_s p_s`` (the model
      average over draws).
    - ``bayes_average=False``: Thompson decoding: each sequence picks one posterior draw at
      the start and decodes from it alone (sampling a model, then text from it).

    The chosen distribution is sharpened or flattened by ``temperature``, truncated to the
    ``top_k`` most probable tokens and to the nucleus of mass ``top_p``, and then decoded by
    ``strategy``: ``"greedy"`` (most probable token) or ``"sample"``. Each step records the
    entropy of the posterior predictive split into aleatoric and epistemic parts (nats), before
    the truncation.

    A batch of prompts (ragged lengths allowed) is decoded together, one forward pass per
    step for all of them. With the key-value cache (``cache``, ``probtransformer.kv_cache``) a
    step encodes only the newest token of each sequence instead of the whole window, with the
    same tokens (up to floating-point rounding) as long as prompt plus output fit in
    ``max_len``. Beyond ``max_len`` the uncached engine reads the last ``max_len`` tokens at
    every step, while the cached one re-encodes the last ``max_len // 2`` tokens whenever its
    window is full and extends them step by step, so it reads between ``max_len / 2`` and
    ``max_len`` tokens. Ensemble members and MC-dropout draws run one pass (and cache) each; an
    MC-dropout cache keeps each step's dropout mask, so its tokens differ from the uncached
    engine's, which draws fresh masks for the whole window at every step.

    Args:
        posterior: ``Posterior`` of a ``CausalLM`` (any fit method).
        prompt: text, read character by character (characters outside the vocabulary map to
            ``"<unk>"`` with a warning; without ``"<unk>"`` they raise), or 1-D token ids (list,
            tensor, numpy array or pandas Series); or a batch: a list of such prompts, or a
            2-D tensor or array of token ids ``(B, L)``.
        max_new_tokens: tokens to generate ``K`` for each prompt.
        strategy: ``"greedy"`` or ``"sample"``.
        temperature: ``> 0``; 1 leaves the distribution as it is.
        top_k: keep only the ``k >= 1`` most probable tokens, or None.
        top_p: keep the smallest set of tokens with mass ``>= top_p``, in ``(0, 1]``, or None.
        bayes_average: average over posterior draws (True) or Thompson decoding (False).
        num_samples: posterior draws ``S`` (1 for point estimates).
        seed: seeds the draws and the sampling; same seed, same text.
        cache: use the key-value cache (True), re-encode the window at every step (False), or
            use it where the model allows (None: not with stochastic attention, whose
            per-sequence logits cannot be extended step by step).

    Returns:
        One ``Generation`` for one prompt; a list of them, in order, for a batch.

    Raises:
        TypeError: ``posterior`` not of a ``CausalLM``; a text prompt for an integer vocabulary;
            a prompt list holding something other than ints; ``bayes_average`` or ``cache``
            not a bool (or None for ``cache``).
        ValueError: an empty prompt or batch, token ids out of range, ``top_p`` outside (0, 1],
            ``top_k < 1``, ``temperature <= 0``, an unknown ``strategy``, ``max_new_tokens < 1``,
            ``cache=True`` for a model with stochastic attention.
    """
    options = dict(
        max_new_tokens=max_new_tokens,
        strategy=strategy,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        bayes_average=bayes_average,
        num_samples=num_samples,
        seed=seed,
        cache=cache,
    )
    model, items, prompts, unknown, batched = _checked(posterior, prompt, options)
    _warn_unknown(unknown)
    new: list[list[int]] = [[] for _ in prompts]
    stats: list[list[torch.Tensor]] = [[] for _ in prompts]
    steps = _decode(posterior, prompts, **options)
    for b, token, stat in steps:
        new[b].append(token)
        stats[b].append(stat)
    out = [
        _generation(model, p, ids, torch.stack(s), u)
        for p, ids, s, u in zip(items, new, stats, unknown, strict=True)
    ]
    return out if batched else out[0]


@dataclass(frozen=True)
class TokenStep:
    """One generated token of ``generate_stream``.

    Attributes:
        index: its position among the generated tokens, from 0.
        token_id: its id.
        token: its string (None when the model has no string vocabulary).
        entropy: total entropy of the posterior predictive at this step, nats.
        aleatoric: expected entropy of the per-draw next-token distributions, nats.
        epistemic: mutual information between the token and the weights, nats.
    """

    index: int
    token_id: int
    token: str | None
    entropy: float
    aleatoric: float
    epistemic: float


def generate_stream(
    posterior,
    prompt,
    *,
    max_new_tokens: int = 100,
    strategy: str = "greedy",
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    bayes_average: bool = True,
    num_samples: int = 100,
    seed: int = 0,
    cache: bool | None = None,
) -> Iterator[TokenStep]:
    """``generate`` for one prompt, token by token: an iterator of ``TokenStep`` that decodes
    each token when asked for it (the same tokens and figures as ``generate``).

    The arguments are checked (and prompt characters outside the vocabulary warned about) when
    this is called; the posterior draws are taken at the first step. Stopping early stops the
    decoding.

    Raises:
        TypeError, ValueError: as ``generate``; ``ValueError`` for a batch of prompts.
    """
    options = dict(
        max_new_tokens=max_new_tokens,
        strategy=strategy,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        bayes_average=bayes_average,
        num_samples=num_samples,
        seed=seed,
        cache=cache,
    )
    model, _, prompts, unknown, batched = _checked(posterior, prompt, options)
    if batched:
        raise ValueError("generate_stream takes one prompt; use generate for a batch")
    _warn_unknown(unknown, stacklevel=3)
    steps = _decode(posterior, prompts, **options)

    def tokens() -> Iterator[TokenStep]:
        for index, (_, token, stat) in enumerate(steps):
            entropy, aleatoric = float(stat[0]), float(stat[1])
            yield TokenStep(
                index=index,
                token_id=token,
                token=None if model.vocab is None else model.vocab[token],
                entropy=entropy,
                aleatoric=aleatoric,
                epistemic=max(entropy - aleatoric, 0.0),
            )

    return tokens()


def generation_from_steps(model: CausalLM, prompt, steps: list[TokenStep]) -> Generation:
    """The ``Generation`` of ``generate_stream``'s ``steps`` (every one, or those decoded before
    it was stopped) for ``prompt``."""
    stats = torch.tensor([[s.entropy, s.aleatoric] for s in steps]).reshape(-1, 2)
    return _generation(model, prompt, [s.token_id for s in steps], stats, unknown=0)


def _checked(posterior, prompt, options: dict):
    """``(model, items, prompts, unknown, batched)`` after checking ``generate``'s arguments."""
    model = getattr(posterior, "model", None)
    if not isinstance(model, CausalLM):
        what = (
            f"a {type(posterior).__name__}" if model is None else f"one of {type(model).__name__}"
        )
        raise TypeError(f"generate needs the Posterior of a CausalLM (a fit's result), got {what}")
    _check_options(**options)
    return model, *_prompts(model, prompt)


def _warn_unknown(unknown: list[int], stacklevel: int = 3) -> None:
    if sum(unknown):
        warnings.warn(
            f"{sum(unknown)} prompt character(s) are outside the vocabulary and were mapped to "
            "<unk>",
            stacklevel=stacklevel,
        )


def _decode(
    posterior,
    prompts,
    *,
    max_new_tokens,
    strategy,
    temperature,
    top_k,
    top_p,
    bayes_average,
    num_samples,
    seed,
    cache,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """The lockstep decoding of ``generate``: ``(sequence, token id, (entropy, aleatoric))``
    for each new token, in the order they are decoded."""
    decoder = posterior.decoder(num_samples, seed=seed, cache=cache)
    generator = torch.Generator().manual_seed(int(seed))
    B, shortest = len(prompts), min(len(p) for p in prompts)
    choice = None if bayes_average else torch.randint(decoder.num, (B,), generator=generator)
    forced = [p[shortest:].tolist() for p in prompts]  # prompt tokens past the shortest
    done = [0] * B
    last = [0] * B
    history = torch.stack([p[:shortest] for p in prompts]).to(decoder.device)  # (B, L)
    fresh = shortest
    with decoder.held():
        while True:
            probs = decoder.step(history, fresh)  # (S, B, V)
            mean = probs.mean(0)  # (B, V)
            entropy = -torch.special.xlogy(mean, mean).sum(-1)
            aleatoric = -torch.special.xlogy(probs, probs).sum(-1).mean(0)
            tokens = []
            for b in range(B):
                if forced[b]:
                    tokens.append(forced[b].pop(0))
                    continue
                if done[b] == max_new_tokens:  # done: any token keeps the lockstep
                    tokens.append(last[b])
                    continue
                chosen = mean[b] if choice is None else probs[choice[b], b]
                if temperature != 1 or top_k is not None or top_p is not None:
                    chosen = _filter(chosen, temperature, top_k, top_p)
                if strategy == "greedy":
                    token = int(chosen.argmax())
                else:
                    token = int(torch.multinomial(chosen, 1, generator=generator))
                done[b] += 1
                last[b] = token
                tokens.append(token)
                yield b, token, torch.stack([entropy[b], aleatoric[b]])
            if all(n == max_new_tokens for n in done):
                break
            history = torch.cat([history, history.new_tensor(tokens)[:, None]], 1)
            fresh = 1


def _generation(model: CausalLM, prompt, new: list[int], stats: torch.Tensor, unknown: int):
    """The ``Generation`` of one prompt from its new token ids and ``(K, 2)`` entropy and
    aleatoric entropy per token."""
    entropy, aleatoric = stats[:, 0], stats[:, 1]
    tokens = None if model.vocab is None else tuple(model.vocab[i] for i in new)
    return Generation(
        prompt=prompt if isinstance(prompt, str) else None,
        text=None if tokens is None else "".join(tokens),
        tokens=tokens,
        token_ids=torch.tensor(new, dtype=torch.long),
        entropy=entropy,
        aleatoric=aleatoric,
        epistemic=(entropy - aleatoric).clamp(min=0.0),
        unknown=unknown,
    )
