"""What the built-in models share: the model protocol's ``forward`` and ``validate`` around the
data plate, and for the Transformers the input embedding, the encoder stack and the output head
built from one ``EncoderConfig``."""

from __future__ import annotations

import pyro
import torch
from pyro.nn import PyroModule

from probtransformer import priors
from probtransformer.attention import BayesMultiheadAttention, data_plate
from probtransformer.embedding import FeatureEmbedding, TokenEmbedding
from probtransformer.encoder import TransformerEncoder
from probtransformer.layers import BayesLinear
from probtransformer.models._config import EncoderConfig
from probtransformer.validation import check_sequence_inputs

__all__ = ["ProtocolModel", "SequenceModel", "TransformerModel", "data_plate_for"]

_PRIOR_KEYS = ("weight_prior", "attention_prior", "head_prior")


def data_plate_for(x: torch.Tensor, num_data: int | None) -> pyro.plate:
    """The protocol's ``pyro.plate("data")`` over the rows of ``x`` (of ``num_data`` in all)."""
    N = x.shape[0]
    return pyro.plate("data", num_data or N, subsample=torch.arange(N, device=x.device))


class ProtocolModel(PyroModule):
    """A model of the protocol: ``forward(x, y=None, mask=None, *, num_data=None)``.

    ``forward`` makes the data plate (a mini-batch of ``N`` rows of ``num_data`` scales the
    likelihood by ``num_data / N``, never the prior) and hands it to the subclass's
    ``_forward(x, y, mask, plate)``, which reads its global latents, runs the network and
    observes ``y`` at ``likelihood_site`` inside the plate (samples it when ``y`` is None).
    The class docstring of each model gives its shapes.
    """

    likelihood_site = "y"

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
            x: the inputs: ``(N, T, F)`` float features or ``(N, T)`` int64 token ids for the
                sequence models.
            y: the targets (shapes in the model's docstring) or None.
            mask: ``(N, T)`` bool, True = real step, or None.
            num_data: size of the full data set when ``x`` is a mini-batch.

        Returns:
            the model's output (logits or the predictive mean) with the draw dims of the
            enclosing vectorizing plates first: ``(*draws, N, ...)``.
        """
        return self._forward(x, y, mask, data_plate_for(x, num_data))


class SequenceModel(ProtocolModel):
    """A protocol model over sequences: ``in_features`` or ``vocab_size``, ``max_len``; the
    subclass checks its targets in ``_check_targets`` (by default its ``head`` does)."""

    def validate(
        self, x: torch.Tensor, y: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> None:
        """Check inputs before fitting or predicting.

        Raises:
            TypeError, ValueError: see ``check_sequence_inputs``, and for ``y`` the model's
                targets (``check_labels``, ``check_values``).
        """
        check_sequence_inputs(
            x,
            y,
            mask,
            in_features=self.in_features,
            max_len=self.max_len,
            vocab_size=self.vocab_size,
        )
        if y is not None:
            self._check_targets(x, y)

    def _check_targets(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.head.check_targets(x, y)


class TransformerModel(SequenceModel):
    """Base of the built-in Transformers: input embedding -> Transformer encoder -> head.

    Subclasses build an ``EncoderConfig`` from their arguments, call ``_build_encoder`` and
    ``_build_head`` in ``__init__``, add their likelihood, and list their own constructor
    arguments in ``self.config``. Inputs are ``(N, T, F)`` features or, with ``vocab_size``,
    ``(N, T)`` token ids; ``grid=(rows, cols)`` gives the steps 2-D positions (image patches).
    """

    def _build_encoder(self, config: EncoderConfig) -> None:
        """Keep ``config``, start ``self.config`` (the protocol's JSON dict) from it, and build
        the embedding and the encoder."""
        self.encoder_config = config
        self.in_features = config.in_features
        self.vocab_size = config.vocab_size
        self.max_len = config.max_len
        self.bayesian_parts = config.bayesian
        self.config = config.to_dict()
        embedding = FeatureEmbedding if config.vocab_size is None else TokenEmbedding
        self.embedding = embedding(
            config.in_features or config.vocab_size,
            config.d_model,
            config.max_len,
            cls_token=config.cls_token,
            bayesian="embedding" in config.bayesian,
            prior=config.weight_prior,
            grid=config.grid,
            positions=config.positions,
        )
        self.encoder = TransformerEncoder(
            config.num_layers,
            config.d_model,
            config.num_heads,
            config.d_ff,
            causal=config.causal,
            attention_prior=config.attention_prior,
            max_len=config.max_len + config.cls_token,
            **config.block_options(),
        )

    def _build_head(self, out_features: int, head: type[BayesLinear] = BayesLinear, **kwargs):
        """``self.head``: a ``head`` from ``d_model`` to ``out_features``, latent when
        ``"head"`` is among the Bayesian parts, with the weight prior."""
        config = self.encoder_config
        self.head = head(
            config.d_model,
            out_features,
            bayesian="head" in config.bayesian,
            prior=config.weight_prior,
            **kwargs,
        )

    @classmethod
    def from_config(cls, config: dict) -> TransformerModel:
        """Rebuild a model from its ``config`` (prior specs given as dicts)."""
        kwargs = dict(config)
        # options added after runs were saved, recorded only when not their first value: a
        # missing key means that value (not the model's default, which may have changed since)
        kwargs.setdefault("positions", "sinusoidal")
        kwargs.setdefault("conv_kernel", 0)
        for key in _PRIOR_KEYS:
            if key in kwargs:
                kwargs[key] = priors.from_config(kwargs[key])
        if kwargs.get("grid") is not None:
            kwargs["grid"] = tuple(kwargs["grid"])
        return cls(**kwargs)

    @property
    def attention_modules(self) -> dict[str, list[BayesMultiheadAttention]]:
        """Attention modules by kind; each kind lists one module per layer."""
        return {"encoder.self": self.encoder.attention_modules}

    def _encode(
        self, x: torch.Tensor, mask: torch.Tensor | None, plate: pyro.plate
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedding and encoder: ``h (s, N, T', d)`` and the key mask ``(N, T') | None``."""
        h, key_mask = self.embedding(x, mask)  # (s, N, T', d)
        with data_plate(plate):  # stochastic attention samples its local latents in it
            h = self.encoder(h, key_padding_mask=key_mask)  # (s, N, T', d)
        return h, key_mask
