"""Structural checks of a model before fitting: the silent-wrong-model pitfalls of Pyro.

Each fit traces the model once on a few training rows and rejects, with the site and the fix
named, models that Pyro would fit without complaint but wrongly:

1. a **global** latent (a module ``PyroSample`` attribute) first read inside
   ``pyro.plate("data")``: Pyro then draws it once per data point, so it is no longer shared;
2. the observed site (``likelihood_site``) outside ``pyro.plate("data")``: mini-batches would
   scale the prior instead of the likelihood, and pointwise log-likelihoods (LOO) are wrong;
3. an observed site whose batch shape is not ``(N,)`` for ``N`` observations: extra batch dims
   (per-step terms not declared with ``.to_event``) or a broadcast likelihood of the wrong size.

See the Pyro tensor-shape tutorial (https://pyro.ai/examples/tensor_shapes.html) for the rules.
"""

from __future__ import annotations

import torch
from pyro import poutine
from pyro.nn import PyroModule

from probtransformer.attention import LOCAL_LATENT
from probtransformer.datasets import SequenceData
from probtransformer.inference._runtime import is_invalid_parameter_error, pyro_scope, seeded

#: The name the model protocol gives the plate over observations.
DATA_PLATE = "data"


def module_sample_sites(model: PyroModule) -> set[str]:
    """Full site names of every ``PyroSample`` attribute of ``model`` and its submodules."""
    names = set()
    for prefix, module in model.named_modules():
        for attr in getattr(module, "_pyro_samples", {}):
            names.add(f"{prefix}.{attr}" if prefix else attr)
    return names


class _GlobalsOutsideDataPlate(poutine.messenger.Messenger):
    """Raise at the sample statement of a module ``PyroSample`` made inside the data plate:
    before the model uses the per-data-point draw (which usually fails with a shape error
    deep inside torch)."""

    def __init__(self, global_sites: set[str]) -> None:
        super().__init__()
        self.global_sites = global_sites

    def _pyro_sample(self, msg) -> None:
        name = msg["name"]
        if (
            name in self.global_sites
            and not msg["is_observed"]
            and not msg["infer"].get(LOCAL_LATENT)
            and any(f.name == DATA_PLATE for f in msg["cond_indep_stack"])
        ):
            raise ValueError(
                f"the global latent {name!r} (a PyroSample attribute) was first read "
                f"inside pyro.plate({DATA_PLATE!r}), so Pyro drew it once per data point "
                "instead of once for the model: read it before entering the plate (e.g. "
                "`w = self.weight` above `with plate:`)"
            )


def check_model_structure(model: PyroModule, data: SequenceData) -> None:
    """Trace ``model`` on the first rows of ``data`` and reject the pitfalls listed above.

    Args:
        model: a model following the protocol (``likelihood_site``, ``forward(x, y, mask)``).
        data: training data with targets; the first (up to) 3 rows are used.

    Raises:
        ValueError: naming the site, what is wrong, and how to fix it.
    """
    rows = data[: min(3, len(data))]
    try:
        with pyro_scope(), torch.no_grad(), seeded(0, torch.device("cpu")):  # caller's RNG kept
            checked = _GlobalsOutsideDataPlate(module_sample_sites(model))(model)
            trace = poutine.trace(checked).get_trace(rows.x, rows.y, rows.mask)
    except ValueError as e:
        if is_invalid_parameter_error(e):
            return  # non-finite numbers, not structure: the fit names the step and site
        raise
    n = len(rows)
    name = model.likelihood_site
    site = trace.nodes.get(name)
    if site is None or not site.get("is_observed"):
        return  # check_model's protocol check and the Posterior report a missing site
    if not any(f.name == DATA_PLATE for f in site["cond_indep_stack"]):
        raise ValueError(
            f"the observed site {name!r} is outside pyro.plate({DATA_PLATE!r}): sample it "
            f"inside `with pyro.plate({DATA_PLATE!r}, num_data or len(x), "
            "subsample=torch.arange(len(x))):` so mini-batches scale the likelihood (not the "
            "prior) and pointwise log-likelihoods are per observation"
        )
    batch_shape = tuple(site["fn"].batch_shape)
    data_shape = batch_shape[-1:]  # the data plate's dim, -1 by the protocol
    extra = [s for s in batch_shape[:-1] if s != 1]
    if data_shape != (n,) or extra:
        raise ValueError(
            f"the observed site {name!r} has batch shape {batch_shape} for {n} observations; "
            f"expected ({n},): declare per-observation dims as event dims with "
            "`.to_event(k)` (e.g. one label per step: `dist.Categorical(logits).to_event(1)`), "
            "and give the likelihood one batch entry per observation"
        )
