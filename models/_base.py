"""What every built-in Transformer model shares: the input embedding and encoder stack, their
config, input checks, and the alignment of draw dims with plates."""

from __future__ import annotations

from collections.abc import Iterable

import pyro
import torch
from pyro.nn import PyroModule

from probtransformer import priors
from probtransformer.attention import BayesMultiheadAttention, data_plate
from probtransformer.block import BAYESIAN_PARTS
from probtransformer.embedding import FeatureEmbedding, TokenEmbedding
from probtransformer.encoder import TransformerEncoder
from probtransformer.layers import align_draws, draw_batch_shape

__all__ = [
    "TransformerModel",
    "align_draws",
    "check_labels",
    "check_sequence_inputs",
    "check_values",
    "draw_batch_shape",
]

_PRIOR_KEYS = ("weight_prior", "attention_prior", "head_prior")


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} and dtype {t.dtype}"


def _parse_bayesian(bayesian: Iterable[str] | str) -> frozenset[str]:
    if isinstance(bayesian, str):
        bayesian = (bayesian,)
    if not isinstance(bayesian, Iterable) or not all(isinstance(p, str) for p in bayesian):
        raise TypeError(
            f"bayesian must be a str or an iterable of str among {BAYESIAN_PARTS}, got {bayesian!r}"
        )
    parts = tuple(bayesian)
    unknown = sorted(set(parts) - set(BAYESIAN_PARTS))
    if unknown:
        raise ValueError(f"bayesian must name parts among {BAYESIAN_PARTS}, got unknown {unknown}")
    return frozenset(parts)


def check_sizes(**sizes: object) -> None:
    """Raise ``ValueError`` unless every value is an int ``>= 1`` (bools refused)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {_value_and_type(value)}")


def _value_and_type(value: object) -> str:
    """``value`` for an error message, with its type when that is what is wrong (a NumPy
    integer prints like an int)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return repr(value)
    return f"{value!r} of type {type(value).__name__} (pass a Python int)"


def check_sequence_inputs(
    x: torch.Tensor,
    y: torch.Tensor | None,
    mask: torch.Tensor | None,
    *,
    in_features: int | None,
    max_len: int,
    num_classes: int | None = None,
    vocab_size: int | None = None,
) -> None:
    """Validate ``(x, y, mask)`` for a sequence model.

    ``x`` is ``(N, T, F)`` float features, or with ``vocab_size`` ``(N, T)`` int64 token ids in
    ``[0, vocab_size)``. With ``num_classes``, ``y`` must be ``(N,)`` int64 labels (models with
    other targets check ``y`` themselves: ``check_labels``, ``check_values``).

    Raises:
        TypeError: wrong type or dtype.
        ValueError: wrong rank or size, an empty batch, non-finite features, token ids or labels
            out of range, a mask of the wrong shape, or a sequence that is all padding.
    """
    if not isinstance(x, torch.Tensor):
        expected = "(N, T) token ids" if vocab_size else "(N, T, F)"
        raise TypeError(f"x must be a torch.Tensor of shape {expected}, got {type(x).__name__}")
    if vocab_size is not None:
        if x.dim() != 2:
            raise ValueError(f"x must hold token ids of shape (N, T), got {_describe(x)}")
        if x.dtype != torch.int64:
            raise TypeError(f"x must hold int64 token ids of shape (N, T), got {_describe(x)}")
    else:
        if x.dim() != 3:
            raise ValueError(f"x must have shape (N, T, F={in_features}), got {_describe(x)}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor of features, got {_describe(x)}")
    N, T = x.shape[:2]
    if N == 0 or T == 0:
        raise ValueError(
            f"x must hold at least one sequence of at least one step, got {_describe(x)}"
        )
    if vocab_size is None and x.shape[2] != in_features:
        raise ValueError(f"x must have F={in_features} features per step, got {_describe(x)}")
    if T > max_len:
        raise ValueError(f"x has T={T} steps but the model was built for max_len={max_len}")
    if vocab_size is not None:
        if x.min() < 0 or x.max() >= vocab_size:
            raise ValueError(
                f"x must hold token ids in [0, {vocab_size}), got values in "
                f"[{int(x.min())}, {int(x.max())}]"
            )
    elif not torch.isfinite(x).all():
        raise ValueError("x contains NaN or inf values")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = _describe(mask) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"mask must be a bool tensor of shape (N, T)=({N}, {T}), got {got}")
        if tuple(mask.shape) != (N, T):
            raise ValueError(f"mask must have shape (N, T)=({N}, {T}), got {tuple(mask.shape)}")
        if mask.device != x.device:
            raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
        empty = (~mask.any(dim=1)).nonzero().flatten()
        if len(empty):
            rows = ", ".join(map(str, empty[:5].tolist())) + (", ..." if len(empty) > 5 else "")
            raise ValueError(
                f"mask marks every step of sequence(s) {rows} as padding: each sequence needs "
                "at least one real step"
            )
    if y is not None:
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
        if y.device != x.device:
            raise ValueError(f"y is on {y.device} but x is on {x.device}")
        if num_classes is not None:
            check_labels(y, (N,), num_classes, dims="(N,)")


def check_labels(
    y: torch.Tensor, shape: tuple[int, ...], num_classes: int, *, dims: str = ""
) -> None:
    """``y`` must be int64 of ``shape`` (named ``dims``, e.g. ``"(N, T)"``) with values in
    ``[0, num_classes)``.

    Raises:
        TypeError: not int64. ValueError: wrong shape or a label out of range.
    """
    if not isinstance(y, torch.Tensor) or y.dtype != torch.int64:
        got = _describe(y) if isinstance(y, torch.Tensor) else type(y).__name__
        raise TypeError(f"y must be int64 class labels of shape {dims}={shape}, got {got}")
    if tuple(y.shape) != shape:
        raise ValueError(f"y must have shape {dims}={shape}, got {tuple(y.shape)}")
    if y.numel() and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(
            f"y must hold labels in [0, {num_classes}), got values in "
            f"[{int(y.min())}, {int(y.max())}]"
        )


def check_values(y: torch.Tensor, shape: tuple[int, ...], *, dims: str = "") -> None:
    """``y`` must be a finite float tensor of ``shape`` (named ``dims``, e.g. ``"(N, H)"``).

    Raises:
        TypeError: not floating point. ValueError: wrong shape, NaN or inf.
    """
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        got = _describe(y) if isinstance(y, torch.Tensor) else type(y).__name__
        raise TypeError(f"y must be a float tensor of shape {dims}={shape}, got {got}")
    if tuple(y.shape) != shape:
        raise ValueError(f"y must have shape {dims}={shape}, got {tuple(y.shape)}")
    if not torch.isfinite(y).all():
        raise ValueError("y contains NaN or inf values: drop or impute those targets first")


class TransformerModel(PyroModule):
    """Base of the built-in models: input embedding -> Transformer encoder, plus their config.

    Subclasses call ``_build_encoder`` in ``__init__``, add their head and likelihood, and list
    their own constructor arguments in ``self.config``. Inputs are ``(N, T, F)`` features or,
    with ``vocab_size``, ``(N, T)`` token ids; ``grid=(rows, cols)`` gives the steps 2-D
    positions (image patches).
    """

    likelihood_site = "y"

    def _build_encoder(
        self,
        *,
        in_features: int | None,
        vocab_size: int | None,
        max_len: int,
        grid: tuple[int, int] | None,
        d_model: int,
        num_heads: int,
        num_layers: int,
        d_ff: int,
        dropout: float,
        norm_first: bool,
        bayesian: Iterable[str] | str,
        weight_prior: priors.Normal | None,
        attention_prior,
        head_prior: priors.HeadGatePrior | None,
        layer_norm: bool = True,
        hard_attention: bool = False,
        causal: bool = False,
        cls_token: bool = False,
    ) -> None:
        if (in_features is None) == (vocab_size is None):
            raise ValueError(
                "give exactly one of in_features (feature sequences) and vocab_size (token ids); "
                f"got in_features={in_features!r}, vocab_size={vocab_size!r}"
            )
        if in_features is not None and not isinstance(in_features, int):
            raise TypeError(
                "in_features must be an int (features per step), or None for token ids with "
                f"vocab_size=len(vocab); got {type(in_features).__name__}"
            )
        inputs = {"in_features": in_features} if vocab_size is None else {"vocab_size": vocab_size}
        sizes = dict(
            **inputs,
            max_len=max_len,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_layers,
        )
        check_sizes(**sizes)
        if isinstance(d_ff, bool) or not isinstance(d_ff, int) or d_ff < 0:
            raise ValueError(
                f"d_ff must be an integer >= 0 (0: no feed-forward), got {_value_and_type(d_ff)}"
            )
        for name, flag in (("layer_norm", layer_norm), ("hard_attention", hard_attention)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        sizes["d_ff"] = d_ff
        if grid is not None:
            if not (isinstance(grid, (tuple, list)) and len(grid) == 2):
                raise ValueError(f"grid must be (rows, cols) of patches, got {grid!r}")
            check_sizes(grid_rows=grid[0], grid_cols=grid[1])
            grid = (int(grid[0]), int(grid[1]))
        if weight_prior is not None and not isinstance(weight_prior, priors.Normal):
            raise TypeError(
                f"weight_prior must be a priors.Normal or None, got {type(weight_prior).__name__}"
            )
        specs = priors.attention_specs(attention_prior)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        parts = _parse_bayesian(bayesian)
        if "norm" in parts and not layer_norm:
            raise ValueError("bayesian includes 'norm', but layer_norm=False drops LayerNorm")
        if "ffn" in parts and not d_ff:
            raise ValueError("bayesian includes 'ffn', but d_ff=0 drops the feed-forward layers")
        self.in_features = in_features
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.config = dict(
            **sizes,
            grid=grid and list(grid),
            dropout=dropout,
            norm_first=norm_first,
            bayesian=sorted(parts),
            weight_prior=priors.to_config(weight_prior),
            attention_prior=priors.to_config(specs[0] if len(specs) == 1 else specs or None),
            head_prior=priors.to_config(head_prior),
        )
        if grid is None:
            del self.config["grid"]  # keeps configs saved before 2-D positions loadable as is
        # ablations (benchmarks/claims.py): recorded only when switched on, like grid
        if not layer_norm:
            self.config["layer_norm"] = False
        if hard_attention:
            self.config["hard_attention"] = True
        embedding = FeatureEmbedding if vocab_size is None else TokenEmbedding
        self.embedding = embedding(
            in_features or vocab_size,
            d_model,
            max_len,
            cls_token=cls_token,
            bayesian="embedding" in parts,
            prior=weight_prior,
            grid=grid,
        )
        self.encoder = TransformerEncoder(
            num_layers,
            d_model,
            num_heads,
            d_ff,
            dropout=dropout,
            norm_first=norm_first,
            causal=causal,
            bayesian=parts,
            weight_prior=weight_prior,
            attention_prior=specs,
            head_prior=head_prior,
            max_len=max_len + cls_token,
            layer_norm=layer_norm,
            hard_attention=hard_attention,
        )
        self.bayesian_parts = parts

    @classmethod
    def from_config(cls, config: dict) -> TransformerModel:
        """Rebuild a model from its ``config`` (prior specs given as dicts)."""
        kwargs = dict(config)
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

    def _check_inputs(self, x, y, mask, *, num_classes: int | None = None) -> None:
        check_sequence_inputs(
            x,
            y,
            mask,
            in_features=self.in_features,
            max_len=self.max_len,
            num_classes=num_classes,
            vocab_size=self.vocab_size,
        )

    def _encode(
        self, x: torch.Tensor, mask: torch.Tensor | None, plate: pyro.plate
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedding and encoder: ``h (s, N, T', d)`` and the key mask ``(N, T') | None``."""
        h, key_mask = self.embedding(x, mask)  # (s, N, T', d)
        with data_plate(plate):  # stochastic attention samples its local latents in it
            h = self.encoder(h, key_padding_mask=key_mask)  # (s, N, T', d)
        return h, key_mask


def data_plate_for(x: torch.Tensor, num_data: int | None) -> pyro.plate:
    """The protocol's ``pyro.plate("data")`` over the rows of ``x`` (of ``num_data`` in all)."""
    N = x.shape[0]
    return pyro.plate("data", num_data or N, subsample=torch.arange(N, device=x.device))
