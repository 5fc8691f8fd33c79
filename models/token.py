"""Token-level models: one categorical output per step. ``TokenTagger`` labels every step
(sequence labeling); ``CausalLM`` predicts the next token from the steps before it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from probtransformer import priors
from probtransformer.layers import align_draws
from probtransformer.models._base import TransformerModel, data_plate_for
from probtransformer.models._config import EncoderConfig, takes_encoder_options
from probtransformer.models.heads import CategoricalHead
from probtransformer.validation import check_num_classes

#: The text recipe (``benchmarks/studies/text_recipe.py``, the "Text models" section of
#: ``benchmarks/BENCHMARKS.md``): no added positions but a distance-decay bias with a latent
#: slope per head (ALiBi, prior scale chosen on validation from 0.1 to 10), a depthwise
#: convolution over the 9 nearest characters before attention in every block, and no dropout
#: (short fits on large texts are far from over-fitting). With the tagging task's fit
#: (``probtransformer.tasks.TAGGER_FIT``: lr 6e-2, warm-up, cosine decay) they raised
#: validation boundary F1 on word segmentation from 0.37 to 0.93.
TAGGER_RECIPE = dict(
    positions="none",
    attention_prior=(priors.LogitScalePrior(), priors.ALiBiSlopePrior(scale=5.0)),
    conv_kernel=9,
    dropout=0.0,
)
#: The causal LM's recipe: as the tagger's, with the slope prior scale and the kernel chosen
#: on the character LM's validation perplexity (9.1 before, 4.1 with this and lr 3e-2).
LM_RECIPE = dict(
    positions="none",
    attention_prior=(priors.LogitScalePrior(), priors.ALiBiSlopePrior(scale=2.0)),
    conv_kernel=5,
    dropout=0.0,
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
        Others: as ``SequenceClassifier`` (``bayesian``, ``weight_prior``, ``head_prior``,
            sizes), except the text recipe's defaults (``TAGGER_RECIPE``): ``positions="none"``
            with ``attention_prior=(LogitScalePrior(), ALiBiSlopePrior(5.0))``,
            ``conv_kernel=9`` and ``dropout=0.0``. ``grid`` (2-D positions of image patches)
            needs ``positions="sinusoidal"`` and no ``ALiBiSlopePrior``.

    Shapes:
        ``forward(x, y=None, mask=None, *, num_data=None)``: ``x`` as ``SequenceClassifier``,
        ``y (N, T)`` int64 labels or None -> ``logits (*draws, N, T, C)``.

    Raises:
        ValueError, TypeError: as ``SequenceClassifier``.
    """

    @takes_encoder_options(**TAGGER_RECIPE)
    def __init__(
        self,
        in_features: int | None,
        num_classes: int,
        max_len: int,
        *,
        vocab_size: int | None = None,
        causal: bool = False,
        grid: tuple[int, int] | None = None,
        **options,
    ) -> None:
        super().__init__()
        check_num_classes(num_classes)
        config = EncoderConfig(max_len, in_features, vocab_size, grid, **options, causal=causal)
        self._build_encoder(config)
        self.num_classes = num_classes
        self.config.update(in_features=in_features, num_classes=num_classes, causal=causal)
        self._build_head(num_classes, CategoricalHead, per_step=True)

    def _forward(self, x, y, mask, plate) -> torch.Tensor:
        h, _ = self._encode(x, mask, plate)  # (s, N, T, d)
        return self.head.observe(h, y, plate, mask=mask, site=self.likelihood_site)

    def logits(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The network alone, without the likelihood site: ``logits (*draws, N, T, C)`` for
        ``x`` as in ``forward`` (what ``generate`` reads at each step)."""
        with self._pyro_context:  # the latents' sample statements, as in a call of the model
            h, _ = self._encode(x, mask, data_plate_for(x, None))  # (s, N, T, d)
            return align_draws(self.head(h))


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
        Others: as ``TokenTagger`` (always token input and causal), with the LM's recipe as
            defaults (``LM_RECIPE``: ``ALiBiSlopePrior(2.0)``, ``conv_kernel=5``).

    Raises:
        ValueError: a vocabulary of fewer than 2 tokens or with duplicates; others as
            ``TokenTagger``.
        TypeError: ``vocab`` neither an int nor a sequence of str.
    """

    @takes_encoder_options(**LM_RECIPE)
    def __init__(self, vocab: Sequence[str] | int, max_len: int, **options) -> None:
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
        super().__init__(None, size, max_len, vocab_size=size, causal=True, **options)
        self.vocab = tokens
        for key in ("in_features", "num_classes", "vocab_size", "causal"):
            del self.config[key]
        self.config = {"vocab": tokens if tokens is not None else size, **self.config}
