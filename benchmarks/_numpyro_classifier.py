"""``probtransformer.models.SequenceClassifier`` written once more as a NumPyro model.

Used only by ``benchmarks/studies/nuts_vs_numpyro.py``: NumPyro and JAX are a benchmark extra
(``pip install -e ".[bench]"``), never a dependency of the package. The port covers the fully
Bayesian classifier (every part in ``bayesian=``) with mean pooling; its sites carry the Pyro
model's names and shapes, so a draw of one model is a point of the other and the benchmark can
check that both log densities are the same function (``nuts_vs_numpyro.check_log_density``).

What is ported, with the Pyro module it mirrors:

- ``FeatureEmbedding``: ``x W_e^T + b_e`` plus the sinusoidal table of ``positional.py``.
- ``TransformerBlock`` (pre- or post-norm), ``num_layers`` times: ``BayesMultiheadAttention``
  with one ``(4, d, d + 1)`` projection site (rows q, k, v, o; last column the bias) and per-head
  inverse temperatures ``logit_scale`` multiplying ``q·k / sqrt(d_head)``; padding keys masked
  as in ``attention.masked_softmax``; ``FeedForward`` ``W_2 GELU(W_1 h)`` (exact, erf GELU);
  ``BayesLayerNorm`` (biased variance, eps 1e-5).
- ``TransformerEncoder``'s final LayerNorm (pre-norm only), mean pooling over real steps,
  ``BayesLinear`` head, ``y ~ Categorical(logits)`` in the plate ``"data"``.
- Priors: weights and biases ``Normal(loc, scale / sqrt(fan_in))`` from ``weight_prior`` (the
  bias uses its layer's fan-in too, as ``layers.BayesLinear``); LayerNorm gain ``Normal(1, 0.1)``
  and bias ``Normal(0, 0.1)`` (``BayesLayerNorm``'s default: the blocks pass it no prior);
  ``logit_scale ~ LogNormal(loc, scale)`` from ``attention_prior``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

#: ``BayesLayerNorm``'s default prior spread of gain and bias (``layers.py``).
NORM_PRIOR_SCALE = 0.1
#: ``F.layer_norm``'s eps as ``BayesLayerNorm`` calls it.
LAYER_NORM_EPS = 1e-5


@dataclass(frozen=True)
class ClassifierConfig:
    """Sizes and priors of a fully Bayesian ``SequenceClassifier`` (its ``config`` dict)."""

    in_features: int
    num_classes: int
    max_len: int
    d_model: int
    num_heads: int
    num_layers: int
    d_ff: int
    norm_first: bool
    weight_scale: float  # weight_prior.scale
    weight_loc: float  # weight_prior.loc
    weight_fan_in: bool  # weight_prior.fan_in
    logit_scale_prior: tuple[float, float] | None  # (loc, scale) of log tau, or None

    @classmethod
    def from_model_config(cls, config: dict) -> ClassifierConfig:
        """Read ``SequenceClassifier.config``.

        Raises:
            ValueError: a configuration the port does not cover (point-estimate parts, CLS
                pooling, no weight prior).
        """
        parts = set(config["bayesian"])
        every = {"embedding", "attention", "ffn", "norm", "head"}
        if parts != every:
            raise ValueError(
                f"the NumPyro port covers the fully Bayesian classifier (bayesian={sorted(every)})"
                f", got bayesian={sorted(parts)}"
            )
        if config["pooling"] != "mean":
            raise ValueError(f"the NumPyro port covers pooling='mean', got {config['pooling']!r}")
        weight = config["weight_prior"]
        if weight is None or weight["type"] != "Normal":
            raise ValueError(f"the NumPyro port needs a Normal weight_prior, got {weight!r}")
        logit = config["attention_prior"]
        return cls(
            in_features=config["in_features"],
            num_classes=config["num_classes"],
            max_len=config["max_len"],
            d_model=config["d_model"],
            num_heads=config["num_heads"],
            num_layers=config["num_layers"],
            d_ff=config["d_ff"],
            norm_first=config["norm_first"],
            weight_scale=weight["scale"],
            weight_loc=weight["loc"],
            weight_fan_in=weight["fan_in"],
            logit_scale_prior=None if logit is None else (logit["loc"], logit["scale"]),
        )


def positional_table(d_model: int, max_len: int) -> np.ndarray:
    """``(max_len, d_model)`` sinusoidal encoding, computed as ``SinusoidalPositionalEncoding``."""
    position = np.arange(max_len, dtype=np.float32)[:, None]  # (max_len, 1)
    freq = np.exp(np.arange(0, d_model, 2, dtype=np.float32) * np.float32(-math.log(1e4) / d_model))
    pe = np.zeros((max_len, d_model), dtype=np.float32)
    pe[:, 0::2] = np.sin(position * freq)
    pe[:, 1::2] = np.cos(position * freq[: d_model // 2])
    return pe


def _weight(cfg: ClassifierConfig, name: str, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    scale = cfg.weight_scale / math.sqrt(fan_in) if cfg.weight_fan_in else cfg.weight_scale
    prior = dist.Normal(jnp.full(shape, cfg.weight_loc, jnp.float32), scale)
    return numpyro.sample(name, prior.to_event(len(shape)))


def _linear(cfg: ClassifierConfig, prefix: str, h: jax.Array, d_in: int, d_out: int) -> jax.Array:
    weight = _weight(cfg, f"{prefix}.weight", (d_out, d_in), d_in)
    bias = _weight(cfg, f"{prefix}.bias", (d_out,), d_in)
    return h @ weight.T + bias


def _layer_norm(prefix: str, h: jax.Array, d: int) -> jax.Array:
    gain = numpyro.sample(
        f"{prefix}.weight", dist.Normal(jnp.ones(d), NORM_PRIOR_SCALE).to_event(1)
    )
    bias = numpyro.sample(f"{prefix}.bias", dist.Normal(jnp.zeros(d), NORM_PRIOR_SCALE).to_event(1))
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)  # biased, as F.layer_norm
    return (h - mean) / jnp.sqrt(var + LAYER_NORM_EPS) * gain + bias


def _attention(
    cfg: ClassifierConfig, prefix: str, h: jax.Array, mask: jax.Array | None
) -> jax.Array:
    N, T, d = h.shape
    nh, hs = cfg.num_heads, d // cfg.num_heads
    proj = _weight(cfg, f"{prefix}.projection", (4, d, d + 1), d)
    weight, bias = proj[..., :d], proj[..., d]  # (4, d, d), (4, d)
    q, k, v = (h @ weight[i].T + bias[i] for i in range(3))  # each (N, T, d)
    q = q.reshape(N, T, nh, hs).transpose(0, 2, 1, 3)  # (N, nh, T, hs)
    k = k.reshape(N, T, nh, hs).transpose(0, 2, 1, 3)  # (N, nh, T, hs)
    v = v.reshape(N, T, nh, hs).transpose(0, 2, 1, 3)  # (N, nh, T, hs)
    logits = q @ k.swapaxes(-1, -2) / math.sqrt(hs)  # (N, nh, T, T)
    if cfg.logit_scale_prior is not None:
        loc, scale = cfg.logit_scale_prior
        tau = numpyro.sample(
            f"{prefix}.logit_scale", dist.LogNormal(jnp.full(nh, loc), scale).to_event(1)
        )
        logits = logits * tau[:, None, None]
    if mask is None:
        weights = jax.nn.softmax(logits, -1)
    else:
        allowed = mask[:, None, None, :]  # (N, 1, 1, T)
        filled = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
        weights = jax.nn.softmax(filled, -1) * allowed
    ctx = (weights @ v).transpose(0, 2, 1, 3).reshape(N, T, d)  # (N, T, d)
    return ctx @ weight[3].T + bias[3]


def _block(cfg: ClassifierConfig, prefix: str, h: jax.Array, mask: jax.Array | None) -> jax.Array:
    d = cfg.d_model

    def ffn(z: jax.Array) -> jax.Array:
        hidden = jax.nn.gelu(
            _linear(cfg, f"{prefix}.ffn.linear1", z, d, cfg.d_ff), approximate=False
        )
        return _linear(cfg, f"{prefix}.ffn.linear2", hidden, cfg.d_ff, d)

    if cfg.norm_first:
        h = h + _attention(cfg, f"{prefix}.attention", _layer_norm(f"{prefix}.norm1", h, d), mask)
        return h + ffn(_layer_norm(f"{prefix}.norm2", h, d))
    h = _layer_norm(f"{prefix}.norm1", h + _attention(cfg, f"{prefix}.attention", h, mask), d)
    return _layer_norm(f"{prefix}.norm2", h + ffn(h), d)


def network(cfg: ClassifierConfig, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Sample every weight and return ``logits (N, C)`` for ``x (N, T, F)``, ``mask (N, T)``."""
    N, T, F = x.shape
    h = _linear(cfg, "embedding.projection", x, F, cfg.d_model)  # (N, T, d)
    h = h + positional_table(cfg.d_model, cfg.max_len)[:T]
    for i in range(cfg.num_layers):
        h = _block(cfg, f"encoder.layers.{i}", h, mask)  # (N, T, d)
    if cfg.norm_first:
        h = _layer_norm("encoder.norm", h, cfg.d_model)
    if mask is None:
        pooled = h.mean(1)  # (N, d)
    else:
        weights = mask.astype(h.dtype)  # (N, T)
        count = jnp.clip(weights.sum(-1, keepdims=True), 1.0)
        pooled = jnp.einsum("ntd,nt->nd", h, weights) / count
    return _linear(cfg, "head", pooled, cfg.d_model, cfg.num_classes)  # (N, C)


def model(
    cfg: ClassifierConfig,
    x: jax.Array,
    y: jax.Array | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """The NumPyro model: priors, network, ``y ~ Categorical(logits)`` in plate ``"data"``."""
    logits = network(cfg, x, mask)
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=logits), obs=y)
    return logits


def predictive_probs(
    cfg: ClassifierConfig,
    samples: dict[str, np.ndarray],
    x: np.ndarray,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """Class probabilities ``(chain, draw, N, C)`` of ``x (N, T, F)`` under each posterior draw.

    Args:
        samples: ``{site: (chain, draw, *shape)}`` in the constrained space.
    """
    chains, draws = next(iter(samples.values())).shape[:2]
    flat = {k: jnp.asarray(v).reshape(chains * draws, *v.shape[2:]) for k, v in samples.items()}
    x = jnp.asarray(x)

    def one(draw: dict[str, jax.Array]) -> jax.Array:
        logits = numpyro.handlers.substitute(network, data=draw)(cfg, x, mask)  # (N, C)
        return jax.nn.softmax(logits, -1)

    probs = np.asarray(jax.jit(jax.vmap(one))(flat))  # (S, N, C)
    return probs.reshape(chains, draws, *probs.shape[1:])
