"""LSTM counterparts of the built-in Transformer models, for the recurrence-vs-attention claim
of ``benchmarks/claims.py``.

They follow the model protocol (``forward(x, y=None, mask=None, *, num_data=None)``,
``likelihood_site``, ``config``, the likelihood inside ``pyro.plate("data")`` with
``subsample``), so ``fit_svi`` and ``Posterior.predict`` treat them as they treat the
Transformers. Each one differs from its Transformer in the sequence mixer only:

- input: the Transformer's own embedding module (``FeatureEmbedding``: a linear map of the
  features, or ``TokenEmbedding``: a token table; both add sinusoidal positions), deterministic,
  as in the built-in models' default ``bayesian=("attention", "head")``;
- mixer: a deterministic ``torch.nn.LSTM`` (point estimates, as the Transformer's embedding,
  feed-forward and LayerNorm are) in place of the encoder; bidirectional for classification
  and tagging (the counterpart of a bidirectional encoder: every step sees the whole
  sequence), unidirectional for the language model (the counterpart of causal attention).
  Padded steps are packed away (``pack_padded_sequence``), so they never reach a real step in
  either direction; masks must therefore mark a prefix of each sequence as real (right
  padding, as every data set of ``probtransformer.datasets`` has it);
- head and likelihood: as ``SequenceClassifier`` (mean over real steps, latent ``BayesLinear``
  head, ``Categorical`` per sequence) and ``TokenTagger`` (latent ``BayesLinear`` head at every
  step, ``Categorical`` per step masked at padding, one event per sequence), with the same
  prior on the head (``priors.Normal(scale=3.0)``, the built-in models' default).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from probtransformer import priors
from probtransformer.embedding import FeatureEmbedding, TokenEmbedding
from probtransformer.models._base import SequenceModel
from probtransformer.models.heads import CategoricalHead, pool
from probtransformer.validation import check_sizes

#: Prior of the latent output head: the built-in Transformer models' default ``weight_prior``.
HEAD_PRIOR = priors.Normal(scale=3.0)


def check_prefix_mask(mask: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless every row of ``mask`` is True on a prefix, False after it."""
    if mask is not None and (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError(
            "the LSTM models need right padding: each mask row must be True on its first steps "
            "and False after them"
        )


class _LSTMModel(SequenceModel):
    """Embedding -> ``nn.LSTM`` -> a latent linear head; subclasses add pooling and likelihood.

    Args:
        in_features: features per step ``F`` (None with ``vocab_size``).
        num_classes: classes ``C`` (>= 2).
        max_len: longest sequence ``T``.
        vocab_size: token ids in ``[0, vocab_size)`` as input instead of features.
        d_model: embedding width (the LSTM's input size).
        hidden_size: LSTM state size per direction.
        num_layers: stacked LSTM layers.
        bidirectional: a forward and a backward LSTM, outputs concatenated.
    """

    #: One label per sequence (classification) or per step (tagging, language modelling).
    per_step = False

    def __init__(
        self,
        in_features: int | None,
        num_classes: int,
        max_len: int,
        *,
        vocab_size: int | None = None,
        d_model: int = 32,
        hidden_size: int = 32,
        num_layers: int = 1,
        bidirectional: bool = True,
    ) -> None:
        super().__init__()
        if (in_features is None) == (vocab_size is None):
            raise ValueError("give exactly one of in_features and vocab_size")
        check_sizes(
            num_classes=num_classes,
            max_len=max_len,
            d_model=d_model,
            hidden_size=hidden_size,
            num_layers=num_layers,
        )
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.in_features = in_features
        self.vocab_size = vocab_size
        self.num_classes = num_classes
        self.max_len = max_len
        self.config = dict(
            in_features=in_features,
            num_classes=num_classes,
            max_len=max_len,
            vocab_size=vocab_size,
            d_model=d_model,
            hidden_size=hidden_size,
            num_layers=num_layers,
            bidirectional=bidirectional,
        )
        embedding = FeatureEmbedding if vocab_size is None else TokenEmbedding
        self.embedding = embedding(in_features or vocab_size, d_model, max_len)
        self.lstm = nn.LSTM(
            d_model, hidden_size, num_layers, batch_first=True, bidirectional=bidirectional
        )
        width = hidden_size * (2 if bidirectional else 1)
        self.head = CategoricalHead(
            width, num_classes, per_step=self.per_step, bayesian=True, prior=HEAD_PRIOR
        )

    def validate(
        self, x: torch.Tensor, y: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> None:
        """Check inputs as the Transformer counterpart's ``validate`` does, and right padding."""
        super().validate(x, y, mask)
        check_prefix_mask(mask)

    def _encode(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """LSTM outputs ``(1, N, T, width)``; zeros at padded steps."""
        h, _ = self.embedding(x)  # (1, N, T, d): deterministic, one draw
        if mask is None:
            out, _ = self.lstm(h[0])
            return out[None]
        lengths = mask.sum(1).cpu()
        packed = pack_padded_sequence(h[0], lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return out[None]


class LSTMClassifier(_LSTMModel):
    """Sequence classification: the ``SequenceClassifier`` counterpart (mean pooling).

    ``x (N, T, F)`` (or ``(N, T)`` token ids) -> embedding -> LSTM -> mean over real steps ->
    latent linear head -> ``logits (N, C)``; ``y ~ Categorical(logits)`` in ``plate("data")``.
    Arguments as ``_LSTMModel`` (bidirectional by default).
    """

    def _forward(self, x, y, mask, plate) -> torch.Tensor:
        pooled = pool(self._encode(x, mask), mask, "mean")  # (1, N, width)
        return self.head.observe(pooled, y, plate, site=self.likelihood_site)  # (*draws, N, C)


class LSTMTagger(_LSTMModel):
    """Sequence labeling: the ``TokenTagger`` counterpart, one categorical label per step.

    ``logits (N, T, C)`` from the latent head at every step; ``y[n, t] ~ Categorical`` for
    every real step, one event of ``T`` labels per sequence in ``plate("data")``. With
    ``bidirectional=False`` each step sees only itself and the steps before it (the counterpart
    of ``causal=True``). Arguments as ``_LSTMModel``.
    """

    per_step = True

    def _forward(self, x, y, mask, plate) -> torch.Tensor:
        h = self._encode(x, mask)  # (1, N, T, width)
        return self.head.observe(h, y, plate, mask=mask, site=self.likelihood_site)


class LSTMLM(LSTMTagger):
    """Next-token language model: the ``CausalLM`` counterpart (a unidirectional LSTM tagger
    over token ids whose labels are the next tokens).

    Args:
        vocab_size: token ids ``V``; labels are ids too.
        max_len: context window ``T``.
        d_model, hidden_size, num_layers: as ``_LSTMModel``.
    """

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        *,
        d_model: int = 32,
        hidden_size: int = 32,
        num_layers: int = 1,
    ) -> None:
        super().__init__(
            None,
            vocab_size,
            max_len,
            vocab_size=vocab_size,
            d_model=d_model,
            hidden_size=hidden_size,
            num_layers=num_layers,
            bidirectional=False,
        )
        self.config = dict(
            vocab_size=vocab_size,
            max_len=max_len,
            d_model=d_model,
            hidden_size=hidden_size,
            num_layers=num_layers,
        )
