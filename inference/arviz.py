"""Posterior -> ArviZ InferenceData through ``az.from_dict`` (for SVI and MCMC alike)."""

from __future__ import annotations

import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference._arviz import az
from probtransformer.inference.posterior import check_data


def _numpy(t: torch.Tensor):
    return t.detach().cpu().numpy()


def site_dims(model: torch.nn.Module) -> tuple[dict[str, list[str]], dict[str, list]]:
    """Dimension names (and coords) of every latent site declared by the model's modules.

    A module's ``site_dims = {attr: (dim, ...)}`` gives site ``f"{path}.{attr}"`` the dims
    ``f"{path}.{dim}"``: unique per module, shared by the sites of one module.
    """
    dims: dict[str, list[str]] = {}
    coords: dict[str, list] = {}
    for path, module in model.named_modules():
        for attr, names in getattr(module, "site_dims", {}).items():
            site = f"{path}.{attr}" if path else attr
            dims[site] = [f"{path}.{d}" if path else d for d in names]
            if "qkvo" in names:
                coords[dims[site][names.index("qkvo")]] = ["q", "k", "v", "o"]
    return dims, coords


def to_inference_data(
    posterior,
    data: SequenceData,
    *,
    test: SequenceData | None = None,
    attention_obs: int = 4,
    num_samples: int | None = None,
    seed: int = 0,
) -> az.InferenceData:
    """Export ``posterior`` with ArviZ's group layout.

    Groups: ``posterior`` (every latent site with ``(chain, draw, *named dims)``; local latents
    kept by the posterior with ``(chain, draw, obs, ...)``, ``obs`` the training rows; plus
    ``attention`` of the first ``attention_obs`` sequences of ``data`` with dims
    ``(chain, draw, attention_obs, layer, head, query, key)``), ``log_likelihood`` (pointwise on
    ``data``, dim ``obs``, for LOO/WAIC), ``posterior_predictive``, ``observed_data`` and, with
    ``test``, ``predictions`` (dim ``test_obs``). Sample-based posteriors add their per-draw
    ``sample_stats`` (``record["sample_stats"]``).

    Raises:
        ValueError: ``data`` without targets, or ``attention_obs < 0``.
    """
    check_data(data)
    if test is not None:
        check_data(test, "test")
    if data.y is None:
        raise ValueError("data.y is None: the log-likelihood needs observed targets")
    if isinstance(attention_obs, bool) or not isinstance(attention_obs, int) or attention_obs < 0:
        raise ValueError(f"attention_obs must be an integer >= 0, got {attention_obs!r}")
    posterior._inputs(data.x, data.mask, data.y)  # validate all of data before any slice of it
    model = posterior.model
    site = model.likelihood_site
    draws = posterior.draws(num_samples, seed=seed)
    dims, coords = site_dims(model)
    post = {name: _numpy(value) for name, value in draws.items()}
    for name, shape in posterior.local_shapes.items():
        dims[name] = ["obs", *(f"{name}.event_{i}" for i in range(len(shape)))]
    if attention_obs and getattr(model, "attention_modules", None):
        rows = data[: min(attention_obs, len(data))]
        attention = posterior.attention(rows.x, rows.mask, num_samples=num_samples, seed=seed)
        post["attention"] = _numpy(attention.samples)
        dims["attention"] = ["attention_obs", "layer", "head", "query", "key"]
    ll, replicated = posterior.pointwise(data, num_samples=num_samples, seed=seed)
    dims[site] = ["obs"]
    groups = dict(
        posterior=post,
        log_likelihood={site: _numpy(ll)},
        posterior_predictive={site: _numpy(replicated)},
        observed_data={site: _numpy(data.y)},
    )
    if test is not None:
        _, predicted = posterior.pointwise(test, num_samples=num_samples, seed=seed)
        groups["predictions"] = {site: _numpy(predicted)}
    stats = posterior.sample_stats(num_samples)
    if stats:
        groups["sample_stats"] = {k: _numpy(v) for k, v in stats.items()}
    return az.from_dict(
        **groups,
        dims=dims,
        coords=coords,
        pred_dims={site: ["test_obs"]},
        attrs={"inference_library": "pyro", "method": posterior.record.get("method", "")},
    )
