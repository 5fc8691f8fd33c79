"""How many heads does each layer need: posterior head importance and pruning."""

from __future__ import annotations

import copy
import math

import pandas as pd
import torch

from probtransformer import priors
from probtransformer.inference._pyro_compat import module_site_name


def _gated_modules(posterior) -> list[tuple[str, int, torch.nn.Module]]:
    """``(kind, layer, module)`` of every attention module with head gates.

    Raises:
        ValueError: the model has none.
    """
    kinds = getattr(posterior.model, "attention_modules", None) or {}
    found = [
        (kind, layer, module)
        for kind, modules in kinds.items()
        for layer, module in enumerate(modules)
        if getattr(module, "head_prior", None) is not None
    ]
    if not found:
        raise ValueError(
            f"{type(posterior.model).__name__} has no head gates: build it with "
            "head_prior=priors.HeadGatePrior() to measure head importance"
        )
    return found


def head_importance(
    posterior, *, num_samples: int | None = None, prob: float = 0.9, seed: int = 0
) -> pd.DataFrame:
    """Posterior of each head's gate ``g = 1 - κ`` in [0, 1] (see ``priors.HeadGatePrior``).

    Args:
        posterior: a fitted ``Posterior`` of a model built with ``head_prior``.
        num_samples: posterior draws (None: every draw of a sampled posterior, 100 guide draws).
        prob: mass of the equal-tailed credible interval, in (0, 1).
        seed: seeds the guide draws.

    Returns:
        DataFrame, one row per (module, layer, head): ``module``, ``layer``, ``head``, ``mean``,
        ``lower``, ``upper`` and ``active`` (False once pruned).

    Raises:
        ValueError: the model has no head gates, or ``prob`` not in (0, 1).
    """
    if not (isinstance(prob, (int, float)) and 0 < prob < 1):
        raise ValueError(f"prob must be in (0, 1), got {prob!r}")
    modules = _gated_modules(posterior)
    draws = posterior.draws(num_samples, seed=seed)
    rows = []
    for kind, layer, module in modules:
        tau = draws[module_site_name(module, "head_global_scale")].flatten(0, 1)  # (S,)
        lam = draws[module_site_name(module, "head_local_scale")].flatten(0, 1)  # (S, H)
        gate = priors.HeadGatePrior.gate(tau, lam).double().cpu()  # (S, H)
        q = torch.tensor([(1 - prob) / 2, (1 + prob) / 2], dtype=gate.dtype)
        lower, upper = torch.quantile(gate, q, dim=0)
        for head in range(gate.shape[1]):
            rows.append(
                dict(
                    module=kind,
                    layer=layer,
                    head=head,
                    mean=float(gate[:, head].mean()),
                    lower=float(lower[head]),
                    upper=float(upper[head]),
                    active=bool(module.head_active[head]),
                )
            )
    return pd.DataFrame(rows)


def prune_heads(posterior, threshold: float, *, num_samples: int | None = None, seed: int = 0):
    """A copy of ``posterior`` whose model skips the heads with mean importance < ``threshold``.

    Pruned heads are not computed at all (their Q/K/V rows and O columns are dropped), so the
    forward pass is cheaper; every layer keeps at least its most important head. The posterior
    draws are shared; ``record["pruned_heads"]`` lists ``[module, layer, head]`` of the pruned.

    Raises:
        ValueError: ``threshold`` not in [0, 1], or the model has no head gates.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(f"threshold must be a number in [0, 1], got {type(threshold).__name__}")
    if not (math.isfinite(threshold) and 0 <= threshold <= 1):
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    table = head_importance(posterior, num_samples=num_samples, seed=seed)
    pruned = copy.copy(posterior)
    pruned.model = copy.deepcopy(posterior.model)
    removed = []
    for (kind, layer), rows in table.groupby(["module", "layer"], sort=False):
        module = pruned.model.attention_modules[kind][layer]
        keep = torch.tensor((rows["mean"] >= threshold).to_numpy())
        # a layer keeps one head at least: its most important head still active
        keep[int(rows["mean"].where(rows["active"], -1.0).to_numpy().argmax())] = True
        keep &= module.head_active.cpu()
        module.head_active.copy_(keep)
        removed += [[kind, int(layer), int(h)] for h in (~keep).nonzero().flatten().tolist()]
    pruned.record = {**posterior.record, "pruned_heads": removed, "prune_threshold": threshold}
    return pruned
