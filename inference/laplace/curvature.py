"""The generalized Gauss-Newton (GGN) of a model's log-likelihood in a subset of its latents.

For a likelihood ``p(y | f)`` of the network's output ``f(x; theta)``, the GGN is
``G = sum_n J_n^T Lambda_n J_n`` with ``J_n = df(x_n)/dtheta`` and ``Lambda_n`` the Hessian of
``-log p(y_n | f)`` in ``f`` (Schraudolph 2002; Martens 2020, "New insights and perspectives
on the natural gradient method"). It is positive semi-definite and, for the exponential-family
likelihoods here, equals the Fisher information (Kunstner, Balles & Hennig 2019). ``Lambda`` per
output position:

- Categorical with logits ``f`` (``C`` classes): ``diag(p) - p p^T``, ``p = softmax(f)``;
- Normal with location ``f``: ``1 / sigma^2`` (the scale is held at its value);
- Student-t with location ``f``: ``(nu + 1) / ((nu + 3) sigma^2)``, the Fisher information of
  the location (Lange, Little & Taylor 1989).

The Jacobians come from ``torch.func.jacrev`` on a few rows at a time, for any model that
follows ``docs/protocol.md``: ``laplace-torch`` (Daxberger et al. 2021) needs an ``nn.Module``
whose ``forward(x)`` returns the output and whose weights are its parameters, while here the
weights are Pyro sample sites, and its curvature back ends (BackPACK, ASDL, curvlinops) pull a
CUDA build of torch over the CPU one this project pins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from pyro import poutine

from probtransformer.inference._runtime import pyro_scope
from probtransformer.inference.laplace.blocks import DiagBlock, FullBlock, KronBlock
from probtransformer.inference.posterior.linearized import natural_output
from probtransformer.inference.posterior.prediction import (
    _LikelihoodNotSampled,
    activation_bytes,
    model_device,
)

#: Bytes of one chunk's Jacobian ``(rows * outputs, d)`` in float32, and of the intermediates
#: of its backward passes, one per output of every row, each through all rows of the chunk
#: (``rows^2 * outputs`` row passes): the rows per chunk follow from both.
JACOBIAN_BYTES = 2**26
BACKWARD_BYTES = 2**29
#: Outputs per chunk (backward passes of one vectorized ``jacrev``): each runs through every
#: row of the chunk, so the work per row grows with the chunk while the per-call overhead
#: shrinks. On digits' attention subset (1,081 rows, 8 classes, 4,224 latents) 8 to 128 took
#: 2.5-3.0 s against 131 s with the memory bounds alone (36 rows per chunk).
BASIS_VECTORS = 32


def likelihood_fn(model, condition: dict[str, torch.Tensor], x, mask):
    """The likelihood distribution of ``model`` on ``(x, mask)`` with its latents conditioned
    on ``condition`` (single-draw shapes), nothing drawn. Call inside ``pyro_scope()``."""
    site = model.likelihood_site
    conditioned = _LikelihoodNotSampled(site, model_device(model))(
        poutine.condition(model, data=condition)
    )
    return poutine.trace(conditioned).get_trace(x, None, mask).nodes[site]["fn"]


def mask_rows(mask: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if mask is None else mask[start:stop]


@dataclass
class Curvature:
    """The GGN of the log-likelihood at a mode and the log-likelihood there.

    Attributes:
        blocks: the GGN's diagonal blocks in the order of ``theta`` (``inference.laplace.
            blocks``): one ``FullBlock`` (``structure="full"``), one ``DiagBlock``
            (``"diag"``), or one block per site (``"kron"``).
        log_likelihood: ``sum_n log p(y_n | f(x_n; mode))``, nats.
        structure: ``"full"``, ``"diag"`` or ``"kron"``.
    """

    blocks: list
    log_likelihood: float
    structure: str


class Subset:
    """The latents the Laplace approximation covers, flattened into one vector ``theta``.

    Args:
        sites: ``{site: shape}`` in the order of ``theta``.
    """

    def __init__(self, sites: dict[str, torch.Size]) -> None:
        self.sites = dict(sites)
        self.sizes = [math.prod(shape) for shape in self.sites.values()]
        self.dim = sum(self.sizes)

    def flatten(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """``{site: (*lead, *shape)}`` -> ``(*lead, d)``."""
        parts = []
        for name, shape in self.sites.items():
            value = values[name]
            parts.append(value.reshape(*value.shape[: value.dim() - len(shape)], -1))
        return torch.cat(parts, -1)

    def unflatten(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        """``(*lead, d)`` -> ``{site: (*lead, *shape)}``."""
        pieces = torch.split(theta, self.sizes, dim=-1)
        lead = theta.shape[:-1]
        return {
            name: piece.reshape((*lead, *shape))
            for (name, shape), piece in zip(self.sites.items(), pieces, strict=True)
        }

    def groups(self) -> torch.Tensor:
        """``(d,)`` index of each entry's site: the weight groups of the prior precision."""
        return torch.repeat_interleave(torch.arange(len(self.sizes)), torch.tensor(self.sizes))


def ggn(
    model,
    subset: Subset,
    mode: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    structure: str,
) -> Curvature:
    """The GGN of ``sum_n log p(y_n | x_n, theta)`` in ``subset`` at ``mode`` (every latent
    site, single-draw shapes), and the log-likelihood there.

    ``structure``: ``"full"`` (one ``d x d`` block), ``"diag"``, or ``"kron"`` (one block per
    site: ``KronBlock`` for sites of two or more dims, a full block for the others). The GGN is
    accumulated as ``sum R^T R`` over rows of ``R = Lambda^(1/2) J``: ``sqrt(p) (J - p^T J)``
    for a categorical (``Lambda = diag(p) - p p^T``), ``sqrt(w) J`` for a location. Rows go
    through ``torch.func.jacrev`` in chunks whose Jacobian ``(rows * outputs, d)`` holds at most
    ``JACOBIAN_BYTES``, in float64 from there. The model must be in eval mode (dropout off):
    the curvature is that of the deterministic network.

    Raises:
        ValueError: an unsupported likelihood (``natural_output``); non-finite outputs.
    """
    d = subset.dim
    theta0 = subset.flatten(mode).detach()
    fixed = {k: v.detach() for k, v in mode.items() if k not in subset.sites}
    sums = _Sums(subset, structure)
    log_lik = 0.0
    start, rows = 0, 1  # the first row tells how many outputs a row has
    with pyro_scope():
        with torch.no_grad():  # mirrors the plain parameters into the scope's param store
            first = likelihood_fn(
                model, {**fixed, **subset.unflatten(theta0)}, x[:1], mask_rows(mask, 0, 1)
            )
        categorical = natural_output(first).kind == "categorical"
        while start < len(x):
            chunk = slice(start, start + rows)
            xs, ms = x[chunk], mask_rows(mask, chunk.start, chunk.stop)

            def outputs(theta, xs=xs, ms=ms, ys=y[chunk]):
                fn = likelihood_fn(model, {**fixed, **subset.unflatten(theta)}, xs, ms)
                out = natural_output(fn)
                weight = out.f.new_ones(()) if out.weight is None else out.weight
                return out.f, (out.f, fn.log_prob(ys).sum(), weight, out.mask)

            jac, aux = torch.func.jacrev(outputs, has_aux=True)(theta0)
            # the plain parameters require grad: nothing of theirs is kept
            jac, (f, chunk_log_lik, weight, out_mask) = jac.detach(), [a.detach() for a in aux]
            if not torch.isfinite(f).all():
                raise ValueError(
                    f"the model's outputs at the mode are not finite for rows {start} to "
                    f"{start + len(xs) - 1}"
                )
            log_lik += float(chunk_log_lik.detach())
            k = f.shape[-1]
            jac = jac.reshape(-1, k, d).double()  # (P, K, d)
            m = out_mask.reshape(-1, 1, 1).double()
            if categorical:
                p = torch.softmax(f.reshape(-1, k).double(), -1)[..., None]  # (P, C, 1)
                root = p.sqrt() * (jac - (p * jac).sum(1, keepdim=True))
            else:
                root = weight.reshape(-1, 1, 1).double().sqrt() * jac
            sums.add((root * m).reshape(-1, d).cpu())  # the blocks live on the CPU, in float64
            if start == 0:  # size the next chunks from the first row's outputs
                outputs_per_row = k * jac.shape[0]
                backward = outputs_per_row * activation_bytes(model, xs)  # per row, all outputs
                rows = max(
                    1,
                    min(
                        max(1, BASIS_VECTORS // outputs_per_row),
                        JACOBIAN_BYTES // (4 * outputs_per_row * d),
                        math.isqrt(BACKWARD_BYTES // max(1, backward)),
                    ),
                )
            start = chunk.stop
    return Curvature(sums.blocks(), log_lik, structure)


def kron_shape(shape: torch.Size) -> tuple[int, int] | None:
    """``(out, in)`` of a site's Kronecker factors (all dims but the last, the last), or None
    for a site of fewer than two dims."""
    if len(shape) < 2:
        return None
    return math.prod(shape[:-1]), shape[-1]


def memory_bytes(subset: Subset, structure: str) -> int:
    """Bytes of the curvature blocks of ``structure`` over ``subset`` (float64)."""
    if structure == "full":
        return 8 * subset.dim**2
    if structure == "diag":
        return 8 * subset.dim
    total = 0
    for shape, size in zip(subset.sites.values(), subset.sizes, strict=True):
        factors = kron_shape(shape)
        total += 8 * (size**2 if factors is None else factors[0] ** 2 + factors[1] ** 2)
    return total


class _Sums:
    """Running sums of ``R^T R`` in the blocks of ``structure``."""

    def __init__(self, subset: Subset, structure: str) -> None:
        self.structure = structure
        self.subset = subset
        d = subset.dim
        if structure == "full":
            self.parts = [torch.zeros(d, d, dtype=torch.float64)]
        elif structure == "diag":
            self.parts = [torch.zeros(d, dtype=torch.float64)]
        else:
            self.parts = []
            for shape, size in zip(subset.sites.values(), subset.sizes, strict=True):
                factors = kron_shape(shape)
                if factors is None:
                    self.parts.append(torch.zeros(size, size, dtype=torch.float64))
                else:
                    out, inp = factors
                    self.parts.append(
                        [
                            torch.zeros(out, out, dtype=torch.float64),
                            torch.zeros(inp, inp, dtype=torch.float64),
                            torch.zeros((), dtype=torch.float64),
                        ]
                    )

    def add(self, root: torch.Tensor) -> None:
        """``root``: ``(rows, d)`` rows of ``Lambda^(1/2) J``."""
        if self.structure == "full":
            self.parts[0] += root.T @ root
            return
        if self.structure == "diag":
            self.parts[0] += root.pow(2).sum(0)
            return
        pieces = torch.split(root, self.subset.sizes, dim=1)
        for part, piece, shape in zip(self.parts, pieces, self.subset.sites.values(), strict=True):
            factors = kron_shape(shape)
            if factors is None:
                part += piece.T @ piece
                continue
            v = piece.reshape(-1, *factors)  # (rows, out, in)
            part[0] += torch.einsum("roi,rpi->op", v, v)
            part[1] += torch.einsum("roi,roj->ij", v, v)
            part[2] += v.pow(2).sum()

    def blocks(self) -> list:
        if self.structure == "diag":
            return [DiagBlock(self.parts[0])]
        return [
            KronBlock(*part) if isinstance(part, list) else FullBlock(part) for part in self.parts
        ]


__all__ = [
    "BACKWARD_BYTES",
    "BASIS_VECTORS",
    "Curvature",
    "JACOBIAN_BYTES",
    "Subset",
    "ggn",
    "kron_shape",
    "likelihood_fn",
    "memory_bytes",
]
