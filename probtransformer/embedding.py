"""Input embeddings: continuous features or token ids per step -> model width, plus positions."""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample
from torch import nn

from probtransformer import priors
from probtransformer.layers import BayesLinear, flatten_draws
from probtransformer.positional import LearnedPositionalEncoding, SinusoidalPositionalEncoding


def _cls_prior(module: FeatureEmbedding):
    loc = torch.zeros(module.d_model, device=module.device_anchor.device)
    return dist.Normal(loc, 1.0).to_event(1)


class FeatureEmbedding(PyroModule):
    """Projects each step's ``F`` features to ``d_model`` and adds positions.

    With ``cls_token=True`` a learned classification token is prepended (BERT, Devlin et al.
    2019), so sequences grow by one step and the mask gains a leading True column.

    Args:
        in_features: features per step ``F``.
        d_model: model width ``d``.
        max_len: longest input sequence ``T``.
        cls_token: prepend a classification token.
        bayesian: the projection (and CLS token, prior N(0, 1)) are latent.
        prior: prior spec of the projection.
        grid: ``(rows, cols)`` when the steps are image patches in row-major order: 2-D
            positions (see ``SinusoidalPositionalEncoding``).
        positions: ``"sinusoidal"`` (added codes), ``"learned"`` (an added table, latent with
            ``bayesian``), or ``"rotary"``/``"none"`` (nothing added: rotary positions act in
            attention, an ``ALiBiSlopePrior`` or no positions at all).

    Shapes:
        ``forward(x (N, T, F), mask (N, T) | None)`` -> ``h (s, N, T', d)``, ``mask (N, T') | None``
        with ``T' = T + cls_token``.
    """

    site_dims = {"cls": ("features",)}

    def __init__(
        self,
        in_features: int,
        d_model: int,
        max_len: int,
        *,
        cls_token: bool = False,
        bayesian: bool = False,
        prior: priors.Normal | None = None,
        grid: tuple[int, int] | None = None,
        positions: str = "sinusoidal",
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.bayesian = bayesian
        self.projection = self._projection(in_features, d_model, bayesian, prior)
        if positions == "sinusoidal":
            self.positional = SinusoidalPositionalEncoding(
                d_model, max_len, grid=grid, leading=int(cls_token)
            )
        elif positions == "learned":
            self.positional = LearnedPositionalEncoding(
                d_model, max_len, leading=int(cls_token), bayesian=bayesian
            )
        else:
            self.positional = nn.Identity()
        self.register_buffer("device_anchor", torch.zeros(()), persistent=False)
        if not cls_token:
            self.cls = None
        elif bayesian:
            self.cls = PyroSample(_cls_prior)
        else:
            self.cls = nn.Parameter(torch.empty(d_model))
            self.reset_parameters()

    @staticmethod
    def _projection(in_features, d_model, bayesian, prior) -> PyroModule:
        return BayesLinear(in_features, d_model, bayesian=bayesian, prior=prior)

    def reset_parameters(self) -> None:
        """Re-draw a point-estimate CLS token from N(0, 0.02²)."""
        if isinstance(self.cls, nn.Parameter):
            nn.init.normal_(self.cls, std=0.02)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        N = x.shape[0]
        h = self.projection(x.unsqueeze(0))  # (s, N, T, d)
        if self.cls is not None:
            cls = flatten_draws(self.cls, 1)  # (s_c, d)
            S = max(h.shape[0], cls.shape[0])
            cls = cls[:, None, None, :].expand(S, N, 1, self.d_model)  # (S, N, 1, d)
            h = torch.cat([cls, h.expand(S, *h.shape[1:])], dim=2)  # (S, N, T + 1, d)
            if mask is not None:
                mask = torch.cat([mask.new_ones(N, 1), mask], dim=1)  # (N, T + 1)
        return self.positional(h), mask


def _table_prior(module: TokenTable):
    loc = torch.zeros(module.vocab_size, module.d_model, device=module.device_anchor.device)
    return dist.Normal(loc, 1.0).to_event(2)


class TokenTable(PyroModule):
    """Lookup table of token vectors, latent (prior N(0, 1)) or a point estimate (init N(0, 1)).

    Shapes:
        ``forward(ids)``: ``(1, N, T)`` int64 -> ``(s, N, T, d)``.
    """

    site_dims = {"weight": ("vocab", "features")}

    def __init__(self, vocab_size: int, d_model: int, *, bayesian: bool = False) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.register_buffer("device_anchor", torch.zeros(()), persistent=False)
        if bayesian:
            self.weight = PyroSample(_table_prior)
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw a point-estimate table from N(0, 1) (as ``torch.nn.Embedding``)."""
        if isinstance(self.weight, nn.Parameter):
            nn.init.normal_(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = flatten_draws(self.weight, 2)  # (s, V, d)
        return table[:, ids[0]] if table.shape[0] > 1 else table[0][ids]  # (s, N, T, d)


class TokenEmbedding(FeatureEmbedding):
    """Looks up a vector per token id (``vocab_size`` ids) and adds sinusoidal positions.

    Same arguments as ``FeatureEmbedding`` with ``vocab_size`` in place of ``in_features``; the
    prior of a latent table is N(0, 1) per entry.

    Shapes:
        ``forward(x (N, T) int64, mask (N, T) | None)`` -> ``h (s, N, T', d)``, ``mask``.
    """

    site_dims = FeatureEmbedding.site_dims

    @staticmethod
    def _projection(vocab_size, d_model, bayesian, prior) -> PyroModule:
        return TokenTable(vocab_size, d_model, bayesian=bayesian)
