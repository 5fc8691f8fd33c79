"""Token-level models: one categorical output per step. ``TokenTagger`` labels every step
(sequence labeling); ``CausalLM`` predicts the next token from the steps before it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pyro
import pyro.distributions as dist
import torch

from probtransformer import priors
from probtransformer.layers import BayesLinear
from probtransformer.models._base import (
    TransformerModel,
    align_draws,
    check_labels,
    data_plate_for,
)


class TokenTagger(TransformerModel):
    """Sequence labeling: a Transformer encoder with a categorical likelihood at every step.

    ``x (N, T, F)`` features or ``(N, T)`` token ids -> embedding + positions -> encoder ->
    linear head -> ``logits (N, T, C)``; ``y[n, t] ~ Categorical(logits[n, t])`` for every real
    step (``mask``), as one event of ``T`` labels per sequence inside ``pyro.plate("data")``:
    the pointwise log-likelihood (for LOO) is per sequence. Labels at padded steps are ignored
    (any valid label, e.g. 0). Predictions at padded steps are computed but meaningless.

    Args:
        in_features: features per step ``F`` (None with ``vocab_size``).
        num_classes: labels ``C`` (>= 2).
        max_len: longest sequence ``T``.
        vocab_size: token ids in ``[0, vocab_size)`` as input instead of features.
        causal: each step sees only itself and the steps before it (a causal mask).
        Others: as ``SequenceClassifier`` (``grid`` for 2-D positions, ``bayesian``,
            ``weight_prior``, ``attention_prior``, ``head_prior``, sizes, dropout).

    Raises:
        ValueError, TypeError: as ``SequenceClassifier``.
    """

    def __init__(
        self,
        in_features: int | None,
        num_classes: int,
        max_len: int,
        *,
        vocab_size: int | None = None,
        causal: bool = False,
        grid: tuple[int, int] | None = None,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        d_ff: int = 128,
        dropout: float = 0.1,
        norm_first: bool = True,
        layer_norm: bool = True,
        hard_attention: bool = False,
        bayesian: Iterable[str] | str = ("attention", "head"),
        weight_prior: priors.Normal | None = priors.Normal(scale=3.0),
        attention_prior=priors.LogitScalePrior(),
        head_prior: priors.HeadGatePrior | None = None,
    ) -> None:
        super().__init__()
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be >= 2 (an integer), got {num_classes!r}")
        self._build_encoder(
            in_features=in_features,
            vocab_size=vocab_size,
            max_len=max_len,
            grid=grid,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_layers,
            d_ff=d_ff,
            dropout=dropout,
            norm_first=norm_first,
            layer_norm=layer_norm,
            hard_attention=hard_attention,
            bayesian=bayesian,
            weight_prior=weight_prior,
            attention_prior=attention_prior,
            head_prior=head_prior,
            causal=causal,
        )
        self.num_classes = num_classes
        self.config.update(in_features=in_features, num_classes=num_classes, causal=causal)
        self.head = BayesLinear(
            d_model, num_classes, bayesian="head" in self.bayesian_parts, prior=weight_prior
        )

    def validate(
        self, x: torch.Tensor, y: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> None:
        """Check inputs: ``x`` as ``check_sequence_inputs``, ``y`` int64 ``(N, T)`` labels.

        Raises:
            TypeError, ValueError: see ``check_sequence_inputs`` and ``check_labels``.
        """
        self._check_inputs(x, y, mask)
        if y is not None:
            check_labels(y, tuple(x.shape[:2]), self.num_classes, dims="(N, T)")

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        *,
        num_data: int | None = None,
    ) -> torch.Tensor:
        """Run the model; observe ``y`` when given, sample it otherwise.

        Args:
            x: ``(N, T, F)`` float features or ``(N, T)`` int64 token ids.
            y: ``(N, T)`` int64 labels or None.
            mask: ``(N, T)`` bool, True = real step, or None.
            num_data: size of the full data set when ``x`` is a mini-batch.

        Returns:
            logits ``(*draws, N, T, C)``.
        """
        plate = data_plate_for(x, num_data)
        h, _ = self._encode(x, mask, plate)  # (s, N, T, d)
        logits = align_draws(self.head(h))  # (*draws, N, T, C)
        fn = dist.Categorical(logits=logits)
        if mask is not None:
            fn = fn.mask(mask)  # padded steps add nothing to the likelihood
        with plate:
            if y is None:
                pyro.deterministic("logits", logits, event_dim=2)
            pyro.sample(self.likelihood_site, fn.to_event(1), obs=y)
        return logits


class CausalLM(TokenTagger):
    """Next-token language model: ``P(x[t+1] | x[:t+1])`` with a causal attention mask.

    A ``TokenTagger`` over token ids whose labels are the next tokens (``y[:, t] = x[:, t+1]``,
    as ``datasets.load("pydoc-text")`` gives them) and whose attention only looks back. Generate
    text with ``probtransformer.models.generate``; held-out perplexity is ``exp`` of the mean
    per-token NLL of the posterior predictive (``probtransformer.metrics.perplexity``).

    Args:
        vocab: the vocabulary: a list of token strings (index = id; ``"<unk>"``, if present,
            takes characters outside it) or the number of token ids.
        max_len: context window ``T``; longer prompts are cut to their last ``T`` tokens.
        Others: as ``TokenTagger`` (always token input and causal).

    Raises:
        ValueError: a vocabulary of fewer than 2 tokens or with duplicates; others as
            ``TokenTagger``.
        TypeError: ``vocab`` neither an int nor a sequence of str.
    """

    def __init__(
        self,
        vocab: Sequence[str] | int,
        max_len: int,
        *,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        d_ff: int = 128,
        dropout: float = 0.1,
        norm_first: bool = True,
        layer_norm: bool = True,
        hard_attention: bool = False,
        bayesian: Iterable[str] | str = ("attention", "head"),
        weight_prior: priors.Normal | None = priors.Normal(scale=3.0),
        attention_prior=priors.LogitScalePrior(),
        head_prior: priors.HeadGatePrior | None = None,
    ) -> None:
        if isinstance(vocab, int) and not isinstance(vocab, bool):
            tokens, size = None, vocab
        elif isinstance(vocab, Sequence) and not isinstance(vocab, str):
            tokens = list(vocab)
            if not all(isinstance(t, str) for t in tokens):
                raise TypeError("vocab must be a sequence of str tokens (or an int size)")
            if len(set(tokens)) != len(tokens):
                raise ValueError("vocab must not repeat a token")
            size = len(tokens)
        else:
            raise TypeError(
                f"vocab must be a sequence of str tokens or an int size, got {type(vocab).__name__}"
            )
        if size < 2:
            raise ValueError(f"vocab must hold at least 2 tokens, got {size}")
        super().__init__(
            None,
            size,
            max_len,
            vocab_size=size,
            causal=True,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_layers,
            d_ff=d_ff,
            dropout=dropout,
            norm_first=norm_first,
            layer_norm=layer_norm,
            hard_attention=hard_attention,
            bayesian=bayesian,
            weight_prior=weight_prior,
            attention_prior=attention_prior,
            head_prior=head_prior,
        )
        self.vocab = tokens
        for key in ("in_features", "num_classes", "vocab_size", "causal"):
            del self.config[key]
        self.config = {"vocab": tokens if tokens is not None else size, **self.config}
