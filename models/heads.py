"""What turns per-step outputs into predictions, shared by the built-in models and the LSTM
baseline (``benchmarks/_lstm.py``): pooling to one vector per sequence, and the categorical
output head with its likelihood."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch

from probtransformer import priors
from probtransformer.layers import BayesLinear, align_draws
from probtransformer.validation import check_labels

__all__ = ["POOLINGS", "CategoricalHead", "check_pooling", "pool"]

#: ``"mean"`` over real steps, ``"cls"``: the prepended token's output, ``"last"`` real step.
POOLINGS = ("mean", "cls", "last")


def check_pooling(pooling: object, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``pooling`` is one of the model's ``choices``."""
    if pooling not in choices:
        raise ValueError(f"pooling must be {' or '.join(map(repr, choices))}, got {pooling!r}")


def pool(h: torch.Tensor, mask: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """One vector per sequence from the per-step outputs.

    Args:
        h: ``(s, N, T, d)`` per-step outputs (with a CLS token, its output at step 0).
        mask: ``(N, T)`` bool, True = real step, or None (every step real).
        pooling: one of ``POOLINGS``. A row with no real step pools to 0 under ``"mean"``.

    Returns:
        ``(s, N, d)``.
    """
    if pooling == "cls":
        return h[:, :, 0]
    if pooling == "last":
        if mask is None:
            return h[:, :, -1]
        last = mask.long().cumsum(1).argmax(1)  # (N,) index of the last real step
        return h[:, torch.arange(h.shape[1], device=h.device), last]  # (s, N, d)
    if mask is None:
        return h.mean(dim=2)
    weights = mask.to(h.dtype)  # (N, T)
    count = weights.sum(-1, keepdim=True).clamp(min=1.0)  # (N, 1); all-padding rows pool to 0
    return torch.einsum("sntd,nt->snd", h, weights) / count


class CategoricalHead(BayesLinear):
    """Linear map to class logits and the categorical likelihood, per sequence or per step.

    Per sequence (``per_step=False``): ``h (s, N, d)`` -> ``logits (*draws, N, C)``,
    ``y[n] ~ Categorical(logits[n])``. Per step: ``h (s, N, T, d)`` -> ``logits
    (*draws, N, T, C)``, ``y[n, t] ~ Categorical(logits[n, t])`` at every real step, as one event
    of ``T`` labels per sequence (the pointwise log-likelihood is per sequence).

    Args:
        in_features: width ``d`` of ``h``.
        num_classes: classes ``C``.
        per_step: one label per step instead of one per sequence.
        bayesian: weight and bias are latent sites (``head.weight``, ``head.bias``).
        prior: their prior spec.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        per_step: bool,
        bayesian: bool,
        prior: priors.Normal | None,
    ) -> None:
        super().__init__(in_features, num_classes, bayesian=bayesian, prior=prior)
        self.per_step = per_step

    def check_targets(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y`` must be int64 labels in ``[0, C)``, ``(N,)`` or per step ``(N, T)``.

        Raises:
            TypeError: not int64. ValueError: wrong shape or a label out of range.
        """
        shape, dims = (tuple(x.shape[:2]), "(N, T)") if self.per_step else ((len(x),), "(N,)")
        check_labels(y, shape, self.out_features, dims=dims)

    def observe(
        self,
        h: torch.Tensor,
        y: torch.Tensor | None,
        plate: pyro.plate,
        *,
        mask: torch.Tensor | None = None,
        site: str = "y",
    ) -> torch.Tensor:
        """Observe ``y`` at ``site`` inside ``plate`` (sample it when None); returns the logits.

        Args:
            h: ``(s, N, d)``, or ``(s, N, T, d)`` per step.
            y: ``(N,)`` or ``(N, T)`` int64 labels, or None (then the logits are recorded as the
                deterministic site ``"logits"``).
            plate: the model's ``pyro.plate("data")``.
            mask: ``(N, T)`` bool, per step only: padded steps add nothing to the likelihood.
            site: name of the observed site.

        Returns:
            logits ``(*draws, N, C)`` or ``(*draws, N, T, C)``; ``draws`` are the sizes of the
            enclosing vectorizing plates.
        """
        logits = align_draws(self(h))  # (*draws, N, [T,] C)
        fn = dist.Categorical(logits=logits)
        if self.per_step:
            fn = (fn if mask is None else fn.mask(mask)).to_event(1)
        with plate:
            if y is None:
                pyro.deterministic("logits", logits, event_dim=1 + self.per_step)
            pyro.sample(site, fn, obs=y)
        return logits
