"""Structural checks of a model before fitting: the silent-wrong-model pitfalls of Pyro.

Each fit traces the model once on a few training rows and rejects, with the site and the fix
named, models that Pyro would fit without complaint but wrongly:

1. a **global** latent (a module ``PyroSample`` attribute) first read inside
   ``pyro.plate("data")``: Pyro then draws it once per data point, so it is no longer shared;
2. the observed site (``likelihood_site``) outside ``pyro.plate("data")``: mini-batches would
   scale the prior instead of the likelihood, and pointwise log-likelihoods (LOO) are wrong;
3. an observed site whose batch shape is not ``(N,)`` for ``N`` observations: extra batch dims
   (per-step terms not declared with ``.to_event``) or a broadcast likelihood of the wrong size;
4. a likelihood whose batch shape is not ``(K, N)`` under ``K`` vectorized posterior draws (the
   prediction engine's layout: each latent arrives as ``(K, 1, *shape)``, inside
   ``pyro.plate("_draws", K, dim=-2)``). A latent broadcast against the draw dim (e.g.
   ``(x * w.unsqueeze(-2)).sum(-1)``) fits without complaint, then gives ``(K, K, N)``
   log-likelihoods: LOO would run on ``K * N`` "observations". Checked with ``K = 2`` draws of
   the prior before every fit (``check_model_structure``), and on every pass of the prediction
   engine (``check_draw_batch_shape``).

``latent_sites`` sorts a model's latent sites into global ones (one value per model) and local
ones (one value per data row, sampled inside ``pyro.plate("data")``), as the ``Posterior``
keeps them.

See the Pyro tensor-shape tutorial (https://pyro.ai/examples/tensor_shapes.html) for the rules.
"""

from __future__ import annotations

import contextlib
import warnings

import pyro
import torch
from pyro import poutine
from pyro.nn import PyroModule

from probtransformer.attention import LOCAL_LATENT
from probtransformer.data import SequenceData
from probtransformer.inference._pyro_compat import module_sample_attributes, site_is_subsample
from probtransformer.inference._runtime import (
    is_invalid_parameter_error,
    is_out_of_memory,
    pyro_scope,
    seeded,
)

#: The name the model protocol gives the plate over observations.
DATA_PLATE = "data"

#: The name and dim of the plate over posterior draws in vectorized passes (the data plate is -1).
DRAWS_PLATE, DRAWS_DIM = "_draws", -2

#: Prior draws of the vectorized-likelihood probe that runs before every fit.
PROBE_DRAWS = 2


def module_sample_sites(model: PyroModule) -> set[str]:
    """Full site names of every ``PyroSample`` attribute of ``model`` and its submodules."""
    names = set()
    for prefix, module in model.named_modules():
        for attr in module_sample_attributes(module):
            names.add(f"{prefix}.{attr}" if prefix else attr)
    return names


def in_data_plate(site: dict) -> bool:
    """True for a trace site inside ``pyro.plate("data")``: one value per data row."""
    return any(frame.name == DATA_PLATE for frame in site["cond_indep_stack"])


def _is_latent(site: dict, likelihood_site: str) -> bool:
    return (
        site["type"] == "sample"
        and not site["is_observed"]
        and not site["infer"].get("_deterministic")
        and not site["infer"].get("is_auxiliary")
        and not site_is_subsample(site)
        and site["name"] != likelihood_site
    )


def latent_sites(
    model: PyroModule, rows: SequenceData
) -> tuple[dict[str, torch.Size], dict[str, torch.Size]]:
    """The model's latent sites, from one trace of ``model`` on ``rows`` (on the model's device).

    Global latents are sampled outside ``pyro.plate("data")``. Local latents are sampled inside
    it, one value per row, and are not the attention-logit latents of stochastic attention
    (``infer[LOCAL_LATENT]``: re-drawn for any input, never kept). A local latent's value must
    be ``(n, *per_row)`` for ``n`` rows: the data plate's dim leads, per-row dims are event dims.

    Returns:
        ``(global_shapes, local_shapes)``: ``{site: shape}`` and ``{site: per_row_shape}``.

    Raises:
        ValueError: the model has no sample site named ``likelihood_site``, or a local latent's
            value does not lead with the data dim (e.g. a second plate around it).
    """
    device = rows.x.device
    with pyro_scope(), seeded(0, device), torch.no_grad(), poutine.block():
        trace = poutine.trace(model).get_trace(rows.x, rows.y, rows.mask)
    name = model.likelihood_site
    if name not in trace.nodes:
        raise ValueError(
            f"{type(model).__name__}.likelihood_site is {name!r}, but the model has no sample "
            "site of that name"
        )
    global_shapes, local_shapes = {}, {}
    n = len(rows)
    for site_name, site in trace.nodes.items():
        if not _is_latent(site, name):
            continue
        if not in_data_plate(site):
            global_shapes[site_name] = site["value"].shape
        elif not site["infer"].get(LOCAL_LATENT):
            event_shape = site["fn"].event_shape
            if tuple(site["value"].shape) != (n, *event_shape):
                raise ValueError(
                    f"the local latent {site_name!r} (sampled inside pyro.plate({DATA_PLATE!r}))"
                    f" has shape {tuple(site['value'].shape)} for {n} rows; expected "
                    f"({n}, *{tuple(event_shape)}): one value per row with the data plate's dim "
                    "leading, per-row dims declared as event dims (`.to_event(k)`), no other "
                    "plate around it"
                )
            local_shapes[site_name] = event_shape
    return global_shapes, local_shapes


def check_sampled_sites(
    initial: dict,
    trace: poutine.Trace,
    global_shapes: dict[str, torch.Size],
    local_shapes: dict[str, torch.Size],
    num_rows: int,
) -> None:
    """Before any transition: the sites the sampler will return (``initial``, shapes read from
    Pyro's prototype ``trace`` in the constrained space) are exactly those the ``Posterior``
    keeps, a global latent with its shape or a local latent ``(num_rows, *per_row)``, plus
    stochastic attention's local sites, which ``fit_mcmc`` drops.

    Raises:
        ValueError: naming the sites the Posterior would refuse or miss, so no run is lost.
    """
    dropped = {
        name for name, site in trace.nodes.items() if site.get("infer", {}).get(LOCAL_LATENT)
    }
    dropped |= {f"{name}_decentered" for name in dropped}
    sampled = {
        name: tuple(trace.nodes[name]["value"].shape) for name in initial if name not in dropped
    }
    expected = {name: tuple(shape) for name, shape in global_shapes.items()}
    expected.update({name: (num_rows, *shape) for name, shape in local_shapes.items()})
    if sampled != expected:
        wrong = sorted(
            name
            for name in sampled.keys() | expected.keys()
            if sampled.get(name) != expected.get(name)
        )
        detail = ", ".join(
            f"{name!r}: sampled {sampled.get(name)}, kept {expected.get(name)}" for name in wrong
        )
        raise ValueError(
            f"fit_mcmc would sample sites the Posterior cannot keep ({detail}; None: absent). "
            "Sample every latent on every call, globals outside pyro.plate('data') and one value "
            "per row inside it; a `poutine.reparam` entered inside the data plate makes Pyro's "
            "initialisation draw one value for all rows: enter it around the plate, or write the "
            "non-centred form by hand (`z = loc + scale * pyro.sample('z_raw', Normal(0, 1))`)"
        )


def check_draw_batch_shape(
    site: str,
    fn,
    num_draws: int,
    num_rows: int,
    event_shape: torch.Size | None = None,
) -> None:
    """Check the likelihood ``fn`` of one vectorized pass over ``num_draws`` draws.

    Args:
        site: the likelihood site's name (for the message).
        fn: its distribution in the pass's trace.
        num_draws: ``K``, the size of the ``_draws`` plate.
        num_rows: ``N``, the rows in the pass.
        event_shape: the single-draw event shape, or None to skip that comparison.

    Raises:
        ValueError: batch shape other than ``(K, N)`` or ``(1, N)``, or another event shape;
            the message names the site, both shapes and the broadcasting fix.
    """
    batch_shape, got_event = tuple(fn.batch_shape), tuple(fn.event_shape)
    allowed = {(num_draws, num_rows), (1, num_rows)}
    if batch_shape in allowed and (event_shape is None or got_event == tuple(event_shape)):
        return
    expected_event = got_event if event_shape is None else tuple(event_shape)
    raise ValueError(
        f"under {num_draws} vectorized posterior draws the likelihood {site!r} has batch shape "
        f"{batch_shape} and event shape {got_event}; expected batch shape "
        f"{(num_draws, num_rows)} (draws, rows) and event shape {expected_event}: each latent "
        f"arrives as (draws, 1, *shape), the 1 at the data plate's dim -1, so index it from the "
        "right and let it broadcast (for a (P,) weight `w` and (N, P) inputs `x`, "
        "`(x * w).sum(-1)` gives (draws, N)); add dims such as `w.unsqueeze(-2)` only after "
        "aligning the draw dims"
    )


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

    Three traces: one draw of the prior, a second, and one vectorized pass conditioned on both
    (``PROBE_DRAWS``), each under a forked RNG, so the caller's random numbers are untouched.

    Args:
        model: a model following the protocol (``likelihood_site``, ``forward(x, y, mask)``).
        data: training data with targets; the first (up to) 3 rows are used.

    Raises:
        ValueError: naming the site, what is wrong, and how to fix it.

    Warns:
        UserWarning: the model fails outright under vectorized draws (a torch shape error):
            it can be fitted, but its predictions and log-likelihoods will fail.
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
    _probe_vectorized_draws(model, rows, trace, site["fn"].event_shape)


def _probe_vectorized_draws(model, rows, trace, event_shape) -> None:
    """Run ``model`` as the prediction engine does, on ``PROBE_DRAWS`` prior draws of its global
    latents (the one of ``trace`` and a fresh one), and check the likelihood's shapes.

    A model that fails outright under vectorized draws (a torch shape error) is not refused:
    it can still be fitted; the warning says that its predictions will fail.
    """
    name = model.likelihood_site
    with pyro_scope(), torch.no_grad(), seeded(1, rows.x.device), _eval_mode(model):
        try:
            second = poutine.trace(model).get_trace(rows.x, rows.y, rows.mask)
            condition = {}
            for site_name, site in trace.nodes.items():
                if _is_latent(site, name) and not in_data_plate(site):
                    value = torch.stack([site["value"], second.nodes[site_name]["value"]])
                    condition[site_name] = value.reshape(PROBE_DRAWS, 1, *site["value"].shape)
            with pyro.plate(DRAWS_PLATE, PROBE_DRAWS, dim=DRAWS_DIM):
                probe = poutine.trace(poutine.condition(model, data=condition)).get_trace(
                    rows.x, rows.y, rows.mask
                )
        except ValueError as e:
            if is_invalid_parameter_error(e):
                return  # non-finite numbers, not structure: the fit names the step and site
            raise
        except RuntimeError as e:
            if is_out_of_memory(e):  # too large, not a broadcasting fault
                raise
            warnings.warn(
                f"{type(model).__name__} fails under {PROBE_DRAWS} vectorized posterior draws "
                f"({str(e).splitlines()[0]}): predictions and log-likelihoods will fail. Each "
                "latent arrives as (draws, 1, *shape); index it from the right and let it "
                "broadcast (e.g. `(x * w).sum(-1)` for a (P,) weight)",
                UserWarning,
                stacklevel=5,  # the caller of fit_svi / fit_mcmc
            )
            return
        check_draw_batch_shape(name, probe.nodes[name]["fn"], PROBE_DRAWS, len(rows), event_shape)
        if not any(_is_latent(s, name) and in_data_plate(s) for s in probe.nodes.values()):
            _check_draws_followed(model, rows, condition, probe.nodes[name]["fn"])


def _check_draws_followed(model, rows, condition: dict, vectorized) -> None:
    """The likelihood of ``PROBE_DRAWS`` vectorized draws must equal each draw's own: a forward
    pass that sums, averages or drops the draw dim (``einsum("...p,np->n", w, x)``,
    ``.mean(0)``) has the right shape but mixes the draws, so every prediction is wrong."""
    name = model.likelihood_site
    try:
        single, together = _one_and_all_draws(model, rows, condition, vectorized)
    except ValueError:
        return  # data out of the likelihood's support: the fit names the site and step
    finite = torch.isfinite(single) & torch.isfinite(together)
    if not torch.allclose(together[finite], single[finite], rtol=1e-4, atol=1e-4):
        raise ValueError(
            f"the observed site {name!r} does not follow each posterior draw: under "
            f"{PROBE_DRAWS} vectorized draws its log-likelihood is {together.tolist()}, but run "
            f"one draw at a time it is {single.tolist()}. The forward pass mixes the draw dim "
            "(a sum or mean over it, an einsum that drops it, a reshape across it): each latent "
            "arrives as (draws, 1, *shape); keep the leading dims and broadcast from the right, "
            "e.g. `(x * w).sum(-1)` for a (P,) weight (docs/protocol.md)"
        )


def _one_and_all_draws(model, rows, condition: dict, vectorized):
    """``(K, N)`` log-likelihoods of the rows: one pass per draw, and the vectorized pass."""
    name = model.likelihood_site
    single = torch.stack(
        [
            poutine.trace(poutine.condition(model, data={k: v[i, 0] for k, v in condition.items()}))
            .get_trace(rows.x, rows.y, rows.mask)
            .nodes[name]["fn"]
            .log_prob(rows.y)
            for i in range(PROBE_DRAWS)
        ]
    )  # (K, N): one pass per draw
    return single, vectorized.log_prob(rows.y).expand_as(single)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """The model in eval mode for the block (dropout off: draws must be comparable)."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)
