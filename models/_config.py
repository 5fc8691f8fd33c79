"""The options of the built-in Transformer models, in one frozen dataclass (as nanoGPT's
``GPTConfig``), and the decorator that shows them in each model's constructor signature."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields

from probtransformer import priors
from probtransformer.block import BAYESIAN_PARTS
from probtransformer.circuits import PARAMETERIZATIONS
from probtransformer.positional import POSITIONS
from probtransformer.validation import check_int, check_sizes

__all__ = ["OPTIONS", "EncoderConfig", "takes_encoder_options"]


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


#: The longest sequence a built-in model takes: attention holds T x T logits per head and draw,
#: 16 GiB of float32 at this length.
MAX_LEN = 2**16


@dataclass(frozen=True)
class EncoderConfig:
    """What the input embedding and the encoder stack of a built-in model are built from.

    Each model builds one from its constructor arguments and hands it to
    ``TransformerModel._build_encoder``. The fields named in ``OPTIONS`` are the keyword
    arguments every model takes (documented in ``SequenceClassifier``); the others describe the
    input or are fixed by the model. Validated once, in ``__post_init__``, which also stores
    ``bayesian`` as a frozenset, ``attention_prior`` as a tuple of specs and ``grid`` as a tuple.

    Raises:
        ValueError: both or neither of ``in_features`` and ``vocab_size``; a size < 1 (``d_ff``
            < 0); sizes whose weights alone (or held as often as ``memory_use`` says) would
            not fit in this machine's memory;
            ``dropout`` outside [0, 1); a ``grid`` that is not two sizes; an unknown
            ``bayesian`` part, or a part that ``layer_norm=False`` or ``d_ff=0`` removes.
        TypeError: ``in_features`` not an int; ``layer_norm`` or ``hard_attention`` not a bool;
            ``bayesian`` not strings; a prior of the wrong spec type.
    """

    max_len: int  # longest sequence T: sizes the positional table, no sensible default
    in_features: int | None = None  # features per step F; None for token ids (vocab_size)
    vocab_size: int | None = None  # token ids in [0, vocab_size); None for features
    grid: tuple[int, int] | None = None  # None: 1-D positions; (rows, cols) for image patches
    # Width 64, 4 heads, 2 layers, d_ff = 2 d_model, dropout 0.1: the digits defaults, chosen on
    # the validation split (benchmarks/BENCHMARKS.md, "Digits classifier"); the fit takes a
    # minute on 2 CPU cores and meets the accuracy, NLL and ECE targets.
    d_model: int = 64
    num_heads: int = 4  # d_head = 16, wide enough per head at d_model 64
    num_layers: int = 2
    d_ff: int = 128  # 2 * d_model; 0 drops the feed-forward sublayer (an ablation)
    dropout: float = 0.1  # used by point-estimate parts and MC dropout; inert for latent ones
    norm_first: bool = True  # pre-norm: trains without warm-up at these small sizes
    layer_norm: bool = True  # False is the LayerNorm ablation of benchmarks/claims.py
    hard_attention: bool = False  # True is the hard-attention ablation of benchmarks/claims.py
    # How steps know their position: "sinusoidal" codes added to the embedding (Vaswani et al.
    # 2017; every run saved before the option existed), "learned" absolute positions, "rotary"
    # (RoPE in self-attention), or "none" (with an ALiBiSlopePrior, or no positions at all).
    positions: str = "sinusoidal"
    # How attention's latents are parameterized: "factors" (W_Q, W_K, W_V, W_O; every run saved
    # before the option existed) or "circuits" (per-head W_QK and W_OV, no gauge symmetry
    # between factors; takes attention_prior=None: W_QK carries the logit scale itself).
    attention_parameterization: str = "factors"
    # Local token mixing: > 0 adds a depthwise convolution over this many steps before
    # attention in every block (probtransformer.block.ConvMixing); 0 (every run saved before the
    # option existed): none.
    conv_kernel: int = 0
    # Attention projections and the head latent, the rest point estimates: latent attention is
    # what the package is about, the latent head carries the predictive uncertainty, and keeping
    # the embedding and feed-forward deterministic keeps mean-field SVI fast (stored as a
    # frozenset after validation).
    bayesian: Iterable[str] | str = ("attention", "head")
    # sd 3 / sqrt(fan_in): chosen on the digits validation split; the variance-preserving scale
    # 1 shrinks the output logits and leaves predictions under-confident (validation NLL 0.119
    # vs 0.064, ECE 0.030 vs 0.024).
    weight_prior: priors.Normal | None = priors.Normal(scale=3.0)
    # A per-head temperature (median at the usual 1 / sqrt(d_head) scaling): its posterior says
    # how sharply each head attends, at the cost of num_heads latents per layer (stored as a
    # tuple of specs after validation).
    attention_prior: priors.AttentionSpec | Sequence[priors.AttentionSpec] | None = (
        priors.LogitScalePrior()
    )
    head_prior: priors.HeadGatePrior | None = None  # head gates are opt-in (head pruning study)
    causal: bool = False  # set by the model: True for language models and causal taggers
    cls_token: bool = False  # set by the model: True for CLS pooling

    def __post_init__(self) -> None:
        in_features, vocab_size = self.in_features, self.vocab_size
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
        check_sizes(**self.input_sizes)
        if self.max_len > MAX_LEN:
            raise ValueError(
                f"max_len must be <= {MAX_LEN} (attention holds T x T logits per head), got "
                f"{self.max_len}"
            )
        d_ff = self.d_ff
        check_int("d_ff", d_ff, minimum=0)  # 0: no feed-forward sublayer
        check_int("conv_kernel", self.conv_kernel, minimum=0)  # 0: no convolution sublayer
        for name in ("layer_norm", "hard_attention"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.attention_parameterization not in PARAMETERIZATIONS:
            raise ValueError(
                f"attention_parameterization must be one of {PARAMETERIZATIONS}, got "
                f"{self.attention_parameterization!r}"
            )
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.grid is not None and self.positions != "sinusoidal":
            raise ValueError(
                f"grid gives image patches 2-D sinusoidal positions; got positions="
                f"{self.positions!r}: leave positions at 'sinusoidal' or drop grid"
            )
        if self.positions == "rotary" and (self.d_model // self.num_heads) % 2:
            raise ValueError(
                "rotary positions rotate pairs of features: d_model / num_heads must be even, "
                f"got {self.d_model} / {self.num_heads}"
            )
        grid = self.grid
        if grid is not None:
            if not (isinstance(grid, (tuple, list)) and len(grid) == 2):
                raise ValueError(f"grid must be (rows, cols) of patches, got {grid!r}")
            check_sizes(grid_rows=grid[0], grid_cols=grid[1])
            object.__setattr__(self, "grid", (int(grid[0]), int(grid[1])))
        weight_prior = self.weight_prior
        if weight_prior is not None and not isinstance(weight_prior, priors.Normal):
            raise TypeError(
                f"weight_prior must be a priors.Normal or None, got {type(weight_prior).__name__}"
            )
        object.__setattr__(self, "attention_prior", priors.attention_specs(self.attention_prior))
        if any(isinstance(spec, priors.ALiBiSlopePrior) for spec in self.attention_prior) and (
            self.grid is not None or self.cls_token
        ):
            raise ValueError(
                "ALiBiSlopePrior biases attention by the distance between steps of a sequence; "
                "a grid of image patches (2-D neighbours) or a CLS token (no position of its "
                "own) would get a wrong distance: use pooling='mean' and no grid"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        parts = _parse_bayesian(self.bayesian)
        if "norm" in parts and not self.layer_norm:
            raise ValueError("bayesian includes 'norm', but layer_norm=False drops LayerNorm")
        if "ffn" in parts and not d_ff:
            raise ValueError("bayesian includes 'ffn', but d_ff=0 drops the feed-forward layers")
        object.__setattr__(self, "bayesian", parts)
        check_fits_in_memory(self)

    @property
    def input_sizes(self) -> dict[str, int]:
        """The sizes that must be ``>= 1``, in the order the protocol's config lists them."""
        if self.vocab_size is None:
            inputs = {"in_features": self.in_features}
        else:
            inputs = {"vocab_size": self.vocab_size}
        return dict(
            **inputs,
            max_len=self.max_len,
            d_model=self.d_model,
            num_heads=self.num_heads,
            num_layers=self.num_layers,
        )

    def block_options(self) -> dict:
        """Keyword arguments every Transformer block of the model takes (encoder and decoder)."""
        return dict(
            dropout=self.dropout,
            norm_first=self.norm_first,
            bayesian=self.bayesian,
            weight_prior=self.weight_prior,
            head_prior=self.head_prior,
            layer_norm=self.layer_norm,
            hard_attention=self.hard_attention,
            rotary=self.positions == "rotary",
            attention_parameterization=self.attention_parameterization,
            conv_kernel=self.conv_kernel,
        )

    def to_dict(self) -> dict:
        """The encoder's part of the model protocol's JSON ``config`` (priors as dicts).

        ``grid``, ``layer_norm=False``, ``hard_attention=True``, ``positions`` other than
        ``"sinusoidal"``, ``conv_kernel`` other than 0 and ``attention_parameterization`` other
        than ``"factors"`` are recorded only when set, so configs
        saved before those options existed load as they are (a missing key means the old
        behaviour; ``TransformerModel.from_config`` fills it in).
        """
        specs = self.attention_prior
        config = dict(
            **self.input_sizes,
            d_ff=self.d_ff,
            grid=self.grid and list(self.grid),
            dropout=self.dropout,
            norm_first=self.norm_first,
            bayesian=sorted(self.bayesian),
            weight_prior=priors.to_config(self.weight_prior),
            attention_prior=priors.to_config(specs[0] if len(specs) == 1 else specs or None),
            head_prior=priors.to_config(self.head_prior),
        )
        if self.grid is None:
            del config["grid"]
        if not self.layer_norm:
            config["layer_norm"] = False
        if self.hard_attention:
            config["hard_attention"] = True
        if self.positions != "sinusoidal":
            config["positions"] = self.positions
        if self.conv_kernel:
            config["conv_kernel"] = self.conv_kernel
        if self.attention_parameterization != "factors":
            config["attention_parameterization"] = self.attention_parameterization
        return config


#: The ``EncoderConfig`` fields every built-in model takes as keyword arguments.
OPTIONS = (
    "d_model",
    "num_heads",
    "num_layers",
    "d_ff",
    "dropout",
    "norm_first",
    "layer_norm",
    "hard_attention",
    "positions",
    "attention_parameterization",
    "conv_kernel",
    "bayesian",
    "weight_prior",
    "attention_prior",
    "head_prior",
)


def takes_encoder_options(init: Callable | None = None, /, **defaults) -> Callable:
    """Decorate a model's ``__init__(self, ..., **options)`` that passes ``options`` on to
    ``EncoderConfig``; ``@takes_encoder_options(name=value, ...)`` gives this model's own
    defaults for some options (the text models' recipe).

    The constructor's signature gains the ``OPTIONS`` as keyword-only parameters with
    ``EncoderConfig``'s defaults (or the model's own), so ``help()``, ``inspect.signature`` and
    the CLI read them from the one place they are defined, and a call with a name that is
    neither the constructor's own nor an option raises ``TypeError`` as Python does.

    Raises:
        TypeError: a default for a name that is not among ``OPTIONS``.
    """
    unknown = sorted(set(defaults) - set(OPTIONS))
    if unknown:
        raise TypeError(f"takes_encoder_options: {unknown} are not encoder options {OPTIONS}")
    if init is None:
        return functools.partial(takes_encoder_options, **defaults)
    own = inspect.signature(init)
    fields_ = {f.name: f for f in fields(EncoderConfig)}
    options = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=defaults.get(name, fields_[name].default),
            annotation=fields_[name].type,
        )
        for name in OPTIONS
    ]
    kept = [p for p in own.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    signature = own.replace(parameters=[*kept, *options])

    @functools.wraps(init)
    def checked(self, *args, **kwargs) -> None:
        try:
            signature.bind(self, *args, **kwargs)
        except TypeError as e:  # a missing or unknown argument, named as Python names it
            raise TypeError(f"{init.__qualname__}() {e}") from None
        init(self, *args, **{**defaults, **kwargs})

    checked.__signature__ = signature
    return checked


#: float32 copies of every weight that fitting holds at least: the guide's location and scale,
#: their gradients, and Adam's two moments of each (MCMC's chains hold position, momentum and
#: gradient per chain, more than this from 3 chains on).
FIT_COPIES = 8


_MEMORY_USE: contextvars.ContextVar[tuple[int, str]] = contextvars.ContextVar(
    "memory_use", default=(1, "")
)


@contextlib.contextmanager
def memory_use(copies: int, use: str) -> Iterator[None]:
    """Within it, every ``EncoderConfig`` checks that its weights fit in memory ``copies``
    times (for example ``FIT_COPIES`` times, ``use="fitting"``), so a model too large to fit is
    refused before it is built, rather than after its point estimates are allocated."""
    token = _MEMORY_USE.set((copies, use))
    try:
        yield
    finally:
        _MEMORY_USE.reset(token)


def usable_memory() -> int | None:
    """Bytes this process may use: the machine's physical memory, or less under an address-space
    limit (``ulimit -v``); None where neither can be read (Windows)."""
    import os

    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return memory
    return memory if limit == resource.RLIM_INFINITY else min(memory, limit)


def check_fits_in_memory(config: EncoderConfig) -> None:
    """Refuse sizes whose weights (embeddings and encoder blocks, float32), held once or as
    many times as ``memory_use`` says, exceed the machine's physical memory, before any of
    them is allocated.

    Raises:
        ValueError: naming the estimate and the memory.
    """
    copies, use = _MEMORY_USE.get()
    memory = usable_memory()
    if memory is None:
        return
    d, inputs = config.d_model, config.in_features or config.vocab_size
    attention = 4 * d * (d + 1)
    if config.attention_parameterization == "circuits":
        attention = 2 * config.num_heads * d * (d + 1) + d
    per_block = attention + 2 * d * config.d_ff + config.d_ff + d * (config.conv_kernel + 5)
    weights = config.num_layers * per_block + 2 * inputs * d + config.max_len * d
    needed = 4 * copies * weights
    if needed > memory:
        held = f"; {use} holds {copies} copies of each" if copies > 1 else ""
        raise ValueError(
            f"d_model={d}, d_ff={config.d_ff}, num_layers={config.num_layers} give at least "
            f"{weights:.3g} weights{held} ({needed / 2**30:,.0f} GiB in float32), more than "
            f"the {memory / 2**30:,.0f} GiB of memory this process may use: choose smaller sizes"
        )
