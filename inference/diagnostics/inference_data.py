"""Posterior -> ArviZ InferenceData through ``az.from_dict`` (for SVI and MCMC alike)."""

from __future__ import annotations

import numpy as np
import torch

from probtransformer.data import SequenceData
from probtransformer.inference._runtime import seeded
from probtransformer.inference.diagnostics._arviz import az
from probtransformer.inference.inputs import check_data
from probtransformer.validation import check_int


def _numpy(t: torch.Tensor):
    return t.detach().cpu().numpy()


def superchain_ids(record: dict, num_chains: int) -> np.ndarray | None:
    """``(num_chains,)`` superchain id of each chain from ``record["superchain"]``, or None.

    Many-chain samplers run ``num_chains`` chains from fewer starts; the chains of one start
    form a superchain (nested R-hat, Margossian et al. 2024). Posteriors without the entry
    (NUTS, HMC) return None: each chain is then its own superchain.

    Raises:
        ValueError: ``record["superchain"]`` is not a list of ``num_chains`` ints.
    """
    ids = record.get("superchain")
    if ids is None:
        return None
    if (
        not isinstance(ids, (list, tuple))
        or len(ids) != num_chains
        or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids)
    ):
        shown = f"{len(ids)} entries" if isinstance(ids, (list, tuple)) else type(ids).__name__
        raise ValueError(
            f"record['superchain'] must list the superchain id (an int) of each of the "
            f"{num_chains} chains, got {shown}: {str(ids)[:80]}"
        )
    return np.asarray(ids, dtype=np.int64)


def with_superchain(idata: az.InferenceData, record: dict) -> az.InferenceData:
    """``idata`` with a non-dimension coordinate ``superchain`` along ``chain`` in every group
    that has a ``chain`` dim, when ``record`` has ``"superchain"`` (else ``idata`` itself).

    Raises:
        ValueError: as ``superchain_ids``.
    """
    if "superchain" not in record:
        return idata
    chains = idata.posterior.sizes["chain"]
    ids = superchain_ids(record, chains)
    groups = [g for g in idata.groups() if "chain" in idata[g].dims]
    return idata.map(lambda ds: ds.assign_coords(superchain=("chain", ids)), groups=groups)


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
    test_prediction=None,
) -> az.InferenceData:
    """Export ``posterior`` with ArviZ's group layout.

    Groups: ``posterior`` (every latent site with ``(chain, draw, *named dims)``; local latents
    kept by the posterior with ``(chain, draw, obs, ...)``, ``obs`` the training rows; plus
    ``attention`` of the first ``attention_obs`` sequences of ``data`` with dims
    ``(chain, draw, attention_obs, layer, head, query, key)``), ``log_likelihood`` (pointwise on
    ``data``, dim ``obs``, for LOO/WAIC), ``posterior_predictive``, ``observed_data`` and, with
    ``test``, ``predictions`` (dim ``test_obs``). Sample-based posteriors add their per-draw
    ``sample_stats`` (``record["sample_stats"]``). A record with ``"superchain"`` (many-chain
    samplers) gives every group with a ``chain`` dim the coordinate ``superchain`` along it.

    The posterior is drawn once (``posterior.draw(num_samples, seed=seed)``) and every group is
    computed from those draws. ``test_prediction``, a ``Prediction`` or ``RegressionPrediction``
    of ``test.x`` made with the same ``num_samples`` and ``seed``, is reused for the
    ``predictions`` group instead of a second pass over ``test`` (its replicates are drawn from
    its probabilities, or are its samples).

    Raises:
        ValueError: ``data`` without targets, ``attention_obs < 0``, a ``test_prediction``
            without ``test`` or of another number of draws or rows, or a
            ``record["superchain"]`` that is not one int per chain.
    """
    check_data(data)
    if test is not None:
        check_data(test, "test")
    if data.y is None:
        raise ValueError("data.y is None: the log-likelihood needs observed targets")
    check_int("attention_obs", attention_obs, minimum=0)
    if test_prediction is not None and test is None:
        raise ValueError("test_prediction needs test: the test split it was made from")
    posterior._inputs(data.x, data.mask, data.y)  # validate all of data before any slice of it
    if test is not None:
        posterior._inputs(test.x, test.mask, test.y)
    model = posterior.model
    site = model.likelihood_site
    draws = posterior.draw(num_samples, seed=seed)
    dims, coords = site_dims(model)
    post = {name: _numpy(value) for name, value in draws.latents.items()}
    for name, shape in posterior.local_shapes.items():
        dims[name] = ["obs", *(f"{name}.event_{i}" for i in range(len(shape)))]
    if attention_obs and getattr(model, "attention_modules", None):
        rows = data[: min(attention_obs, len(data))]
        attention = posterior.attention(rows.x, rows.mask, seed=seed, draws=draws)
        post["attention"] = _numpy(attention.samples)
        dims["attention"] = ["attention_obs", "layer", "head", "query", "key"]
    ll, replicated = posterior.pointwise(data, seed=seed, draws=draws)
    dims[site] = ["obs"]
    groups = dict(
        posterior=post,
        log_likelihood={site: _numpy(ll)},
        posterior_predictive={site: _numpy(replicated)},
        observed_data={site: _numpy(data.y)},
    )
    if test_prediction is not None:
        groups["predictions"] = {site: _numpy(_replicates(test_prediction, draws, test, seed))}
    elif test is not None:
        inputs = SequenceData(test.x, None, test.mask)  # the group holds replicates only
        _, predicted = posterior.pointwise(inputs, seed=seed, draws=draws)
        groups["predictions"] = {site: _numpy(predicted)}
    stats = posterior.sample_stats(num_samples)
    if stats:
        groups["sample_stats"] = {k: _numpy(v) for k, v in stats.items()}
    idata = az.from_dict(
        **groups,
        dims=dims,
        coords=coords,
        pred_dims={site: ["test_obs"]},
        attrs={"inference_library": "pyro", "method": posterior.record.get("method", "")},
    )
    return with_superchain(idata, posterior.record)


def _replicates(prediction, draws, test: SequenceData, seed: int) -> torch.Tensor:
    """``(chain, draw, N, ...)`` draws of the targets from a test prediction of ``draws``."""
    samples = getattr(prediction, "samples", None)
    if samples is None:  # categorical: one draw of the labels per posterior draw
        with seeded(seed, torch.device("cpu")):
            samples = torch.distributions.Categorical(probs=prediction.probs).sample()
    if samples.shape[:2] != (draws.num, len(test)):
        raise ValueError(
            f"test_prediction must hold (S, N)=({draws.num}, {len(test)}) draws of the test "
            f"rows (the same num_samples and seed), got {tuple(samples.shape[:2])}"
        )
    return samples.reshape(draws.chains, draws.per_chain, *samples.shape[1:])
