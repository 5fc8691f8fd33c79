"""Text generation from a fitted ``CausalLM`` posterior, with per-token uncertainty."""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from probtransformer.models.token import CausalLM

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
    logits = probs.clamp_min(1e-30).log() / temperature
    probs = torch.softmax(logits, -1)
    if top_k is not None and top_k < probs.shape[-1]:
        kth = probs.topk(top_k).values[-1]
        probs = probs.where(probs >= kth, 0.0)
    if top_p is not None and top_p < 1:
        ordered, order = probs.sort(descending=True)
        cumulative = ordered.cumsum(-1) / ordered.sum()
        keep = cumulative - ordered / ordered.sum() < top_p  # mass before this token < top_p
        probs = torch.zeros_like(probs).scatter(0, order, ordered * keep)
    return probs / probs.sum()


def _check_options(max_new_tokens, strategy, temperature, top_k, top_p, seed) -> None:
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


def _prompt_ids(model: CausalLM, prompt) -> tuple[torch.Tensor, int]:
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
    ids = torch.as_tensor(np.asarray(prompt) if isinstance(prompt, list | tuple) else prompt)
    if ids.device.type == "meta":
        raise ValueError("prompt is on the 'meta' device, which holds no values")
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(
            "prompt must be a non-empty str or a 1-D sequence of int token ids, got "
            f"shape {tuple(ids.shape)} and dtype {ids.dtype}"
        )
    ids = ids.long()
    if ids.min() < 0 or ids.max() >= model.vocab_size:
        raise ValueError(
            f"prompt token ids must lie in [0, {model.vocab_size}), got values in "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
    return ids, 0


def generate(
    posterior,
    prompt: str | list[int] | torch.Tensor,
    *,
    max_new_tokens: int = 100,
    strategy: str = "greedy",
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    bayes_average: bool = True,
    num_samples: int = 100,
    seed: int = 0,
) -> Generation:
    """Generate tokens after ``prompt`` from a fitted ``CausalLM`` posterior.

    At each step the model reads the last ``max_len`` tokens and gives, for each of
    ``num_samples`` posterior draws, a next-token distribution ``p_s (V,)``.

    - ``bayes_average=True``: decode from the posterior predictive ``mean_s p_s`` (the model
      average over draws).
    - ``bayes_average=False``: one posterior draw is chosen at the start and decodes the whole
      sequence (Thompson-style sampling of a model, then of text).

    The chosen distribution is sharpened or flattened by ``temperature``, truncated to the
    ``top_k`` most probable tokens and to the nucleus of mass ``top_p``, and then decoded by
    ``strategy``: ``"greedy"`` (most probable token) or ``"sample"``. Each step records the
    entropy of the posterior predictive split into aleatoric and epistemic parts (nats), before
    the truncation.

    Args:
        posterior: ``Posterior`` of a ``CausalLM`` (any fit method).
        prompt: text, read character by character (characters outside the vocabulary map to
            ``"<unk>"`` with a warning; without ``"<unk>"`` they raise), or 1-D token ids (list,
            tensor, numpy array or pandas Series).
        max_new_tokens: tokens to generate ``K``.
        strategy: ``"greedy"`` or ``"sample"``.
        temperature: ``> 0``; 1 leaves the distribution as it is.
        top_k: keep only the ``k >= 1`` most probable tokens, or None.
        top_p: keep the smallest set of tokens with mass ``>= top_p``, in ``(0, 1]``, or None.
        bayes_average: average over posterior draws (True) or follow one draw (False).
        num_samples: posterior draws ``S``.
        seed: seeds the draws and the sampling; same seed, same text.

    Returns:
        ``Generation`` with ``text``, ``token_ids``, ``entropy``, ``aleatoric``, ``epistemic``.

    Raises:
        TypeError: ``posterior`` not of a ``CausalLM``; a text prompt for an integer vocabulary.
        ValueError: an empty prompt, token ids out of range, ``top_p`` outside (0, 1],
            ``top_k < 1``, ``temperature <= 0``, an unknown ``strategy``, ``max_new_tokens < 1``.
    """
    model = getattr(posterior, "model", None)
    if not isinstance(model, CausalLM):
        raise TypeError(
            f"generate needs the Posterior of a CausalLM, got one of {type(model).__name__}"
        )
    _check_options(max_new_tokens, strategy, temperature, top_k, top_p, seed)
    ids, unknown = _prompt_ids(model, prompt)
    if unknown:
        warnings.warn(
            f"{unknown} prompt character(s) are outside the vocabulary and were mapped to <unk>",
            stacklevel=2,
        )
    generator = torch.Generator().manual_seed(int(seed))
    new, stats = [], []
    draw = None
    for _ in range(max_new_tokens):
        context = torch.cat([ids, torch.tensor(new, dtype=torch.long)])[-model.max_len :]
        pred = posterior.predict(context[None], num_samples=num_samples, seed=seed)
        probs = pred.probs[:, 0, -1]  # (S, V) next-token distribution of each draw
        mean = probs.mean(0)
        entropy = -torch.special.xlogy(mean, mean).sum()
        aleatoric = -torch.special.xlogy(probs, probs).sum(-1).mean()
        stats.append((entropy, aleatoric, (entropy - aleatoric).clamp(min=0.0)))
        if not bayes_average and draw is None:
            draw = int(torch.randint(probs.shape[0], (1,), generator=generator))
        chosen = _filter(mean if bayes_average else probs[draw], temperature, top_k, top_p)
        if strategy == "greedy":
            token = int(chosen.argmax())
        else:
            token = int(torch.multinomial(chosen, 1, generator=generator))
        new.append(token)
    token_ids = torch.tensor(new, dtype=torch.long)
    entropy, aleatoric, epistemic = (torch.stack(v) for v in zip(*stats, strict=True))
    tokens = None if model.vocab is None else tuple(model.vocab[i] for i in new)
    return Generation(
        prompt=prompt if isinstance(prompt, str) else None,
        text=None if tokens is None else "".join(tokens),
        tokens=tokens,
        token_ids=token_ids,
        entropy=entropy,
        aleatoric=aleatoric,
        epistemic=epistemic,
        unknown=unknown,
    )
