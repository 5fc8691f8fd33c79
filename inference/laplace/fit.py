"""``fit_laplace`` and ``fit_mola``: the Laplace approximation around a MAP fit or around every
member of a deep ensemble, with the prior precision the evidence chooses."""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from pyro import poutine

from probtransformer.data import SequenceData
from probtransformer.inference._runtime import pyro_scope
from probtransformer.inference.ensembles.baselines import _MAP_SIGNATURE, fit_ensemble, fit_map
from probtransformer.inference.inputs import check_model, check_training_data, example_of
from probtransformer.inference.laplace.curvature import Subset, ggn, memory_bytes
from probtransformer.inference.laplace.evidence import Gaussian, log_evidence, maximize_evidence
from probtransformer.inference.model_checks import latent_sites
from probtransformer.inference.posterior.posterior import Posterior
from probtransformer.inference.posterior.prediction import _set_parameters, model_device
from probtransformer.validation import check_int, described

SUBSETS = ("head", "attention", "all")
HESSIANS = ("full", "kron", "diag")
PREDICTIVES = ("glm", "nn")
#: Draws of the training rows on which ``record["glm_nn_disagreement"]`` is measured.
DISAGREEMENT_ROWS = 256
#: Bytes a full GGN may take by default (its Cholesky factor and inverse come on top).
DEFAULT_MAX_MEMORY = 2**30


def fit_laplace(
    model: torch.nn.Module,
    data: SequenceData,
    *,
    subset: str | list[str] = "head",
    hessian: str = "full",
    prior_precision: str | float = "marglik",
    predictive: str = "glm",
    ensemble: Posterior | None = None,
    num_samples: int = 100,
    max_memory: int = DEFAULT_MAX_MEMORY,
    seed: int = 0,
    progress: bool = True,
    **kwargs,
) -> Posterior:
    """Laplace approximation (MacKay 1992; Daxberger et al. 2021, "Laplace Redux") around a MAP
    fit, or around each member of a fitted deep ensemble (a mixture of Laplace approximations,
    MoLA: Eschenhagen et al. 2021, "Mixtures of Laplace approximations for improved post-hoc
    uncertainty in deep learning").

    Around each mode ``theta*`` the latents in ``subset`` get the Gaussian
    ``N(theta*, (G + diag(delta))^-1)``: ``G`` the generalized Gauss-Newton of the
    log-likelihood over the whole training set (``inference.laplace.curvature``), ``delta`` one
    prior precision per latent site. The other latents and the plain parameters stay at the
    mode. ``delta`` maximizes the Laplace evidence (``prior_precision="marglik"``,
    ``inference.laplace.evidence``), or is the model's own prior's (``"prior"``: the fixed
    ``N(0, 3/sqrt(fan_in))`` of the built-in layers), or one number for every site. The mode
    stays the MAP under the model's prior (post-hoc, as ``laplace-torch``).

    Predictions (``predictive``): ``"glm"`` evaluates the likelihood at the network linearized
    around each draw's mode, ``f(x, theta*) + J(x) (theta - theta*)`` (Monte Carlo over the GLM
    predictive, Immer, Korzepa & Bauer 2021), by one forward-mode pass (``torch.func.jvp``)
    for all draws; ``"nn"`` runs the network at the drawn weights. For the last layer alone
    the network is linear in the subset and both agree. Attention and the ArviZ posterior
    always come from the weight draws.

    Args:
        model: a ``PyroModule`` following ``docs/protocol.md`` with a Categorical, Normal or
            Student-t likelihood and Normal priors on the subset's sites.
        data: training split; ``data.y`` required.
        subset: ``"head"`` (sites under the model's ``head``: the output layer),
            ``"attention"`` (sites of the attention modules with real support: the
            projections), ``"all"`` (every global latent with real support), or a list of site
            names.
        hessian: ``"full"`` GGN (``d x d``), ``"kron"`` (one block per site, Kronecker-factored
            for sites of two or more dims: ``inference.laplace.blocks.KronBlock``), or
            ``"diag"`` (its diagonal); each refused when its blocks take more than
            ``max_memory``.
        prior_precision: ``"marglik"``, ``"prior"``, or a number ``> 0`` (precision, 1/scale^2).
        predictive: ``"glm"`` or ``"nn"`` (above).
        ensemble: a fitted ``fit_ensemble`` or ``fit_map`` posterior of ``model``'s class: one
            Gaussian around each member (MoLA), no new fit. None: ``fit_map`` runs first with
            ``seed``, ``progress`` and ``**kwargs``.
        num_samples: draws kept in total, ``ceil(num_samples / M)`` per member.
        max_memory: bytes the GGN's blocks may take (float64; full: ``8 d^2``), checked
            before any is allocated.
        seed: seeds the MAP fit and the draws.
        progress: show the MAP fit's progress bar.
        **kwargs: ``fit_map``'s other settings (``num_steps``, ``lr``, ``batch_size`` ...);
            only without ``ensemble``.

    Returns:
        A ``Posterior`` with ``samples {site: (M, S, *shape)}`` (one chain per member), the
        members' plain parameters (``members``) when the ensemble has them, and each draw's
        mode (``modes``, ``predictive="glm"``). ``record``: ``method`` (``"laplace"``, or
        ``"mola"`` over several members), ``subset`` (site names), ``hessian``,
        ``prior_precision``, ``model_prior_scale`` (per site: the model's own prior sd,
        ``mean precision ** -0.5`` over its scalars, as ``prior_scale`` is), ``predictive``,
        ``laplace`` (per member: ``log_evidence`` nats, ``prior_precision`` per site,
        ``prior_scale`` per site, ``evidence_gradient``, ``evidence_converged``,
        ``condition_number`` of the posterior precision,
        ``log_likelihood``), ``glm_nn_disagreement`` (mean total variation distance between the
        GLM and network predictive means on up to 256 training rows; categorical only),
        ``mode_seconds``, ``laplace_seconds`` and ``seconds``.

    Raises:
        TypeError: ``ensemble`` not a Posterior, or given with ``fit_map`` settings; a setting
            of the wrong type; an unknown keyword.
        ValueError: an unknown ``subset``, ``hessian`` or ``predictive``; a subset that names
            no latent, a site that is not one, or a site without real support or Normal prior;
            ``prior_precision`` not "marglik", "prior" or a number > 0; a full GGN above
            ``max_memory`` (names the bytes it needs and the limit); an ensemble fitted by
            another method or of another model class; an unsupported likelihood.
    """
    if ensemble is not None:
        _check_ensemble(ensemble, model, kwargs)
    _check_before_fit(
        model, data, subset, hessian, prior_precision, predictive, num_samples, max_memory, seed
    )
    start = time.perf_counter()
    if ensemble is None:
        try:
            _MAP_SIGNATURE.bind(model, data, **kwargs)
        except TypeError as e:
            raise TypeError(f"fit_laplace(): {e}") from None
        ensemble = fit_map(model, data, seed=seed, progress=progress, **kwargs)
    mode_seconds = ensemble.record.get("seconds", time.perf_counter() - start)
    start = time.perf_counter()
    fitted = ensemble.model
    rows = ensemble.example.to(ensemble.device)
    sites, priors = _subset_sites(fitted, rows, subset)
    flat = Subset(sites)
    prior_loc, prior_prec = _gaussian_prior(priors, flat)
    groups = flat.groups()
    model_scale = {s: float(prior_prec[groups == g].mean()) ** -0.5 for g, s in enumerate(sites)}
    modes, states = _modes(ensemble)
    num_members = len(modes)
    per_member = math.ceil(num_samples / num_members)
    generator = torch.Generator().manual_seed(seed)
    train = data.to(ensemble.device)
    draws, summaries = [], []
    try:
        for k, mode in enumerate(modes):
            if states is not None:
                _set_parameters(fitted, {name: value[k] for name, value in states.items()})
            curvature = ggn(fitted, flat, mode, train.x, train.y, train.mask, structure=hessian)
            mean = flat.flatten(mode).double().cpu()
            try:
                gaussian, evidence = _prior_precision(
                    prior_precision, curvature, mean, mean - prior_loc, prior_prec, flat
                )
                condition_number = gaussian.condition_number()
                draws.append(gaussian.sample(per_member, generator).float())
            except torch.linalg.LinAlgError as e:
                raise ValueError(
                    f"the posterior precision of member {k} is not positive definite in float64 "
                    f"(prior_precision={prior_precision!r}): the prior precision is too small for "
                    "the GGN's round-off; use a larger one, or 'marglik'"
                ) from e
            summaries.append(
                dict(
                    log_evidence=evidence["log_evidence"],
                    prior_precision=dict(zip(sites, evidence["precision"], strict=True)),
                    prior_scale={
                        s: p**-0.5 for s, p in zip(sites, evidence["precision"], strict=True)
                    },
                    evidence_gradient=evidence.get("gradient"),
                    evidence_converged=evidence.get("converged"),
                    condition_number=condition_number,
                    log_likelihood=curvature.log_likelihood,
                )
            )
    finally:  # the model holds member 0's parameters, as an ensemble's between calls
        if states is not None:
            _set_parameters(fitted, {name: value[0] for name, value in states.items()})
    theta = torch.stack(draws)  # (M, S, d)
    device = ensemble.device
    subset_samples = {k: v.to(device) for k, v in flat.unflatten(theta).items()}
    samples, mode_draws = {}, {}
    for name in ensemble.latent_shapes:
        at_mode = torch.stack([mode[name] for mode in modes])  # (M, *shape)
        repeated = at_mode[:, None].expand(num_members, per_member, *at_mode.shape[1:])
        samples[name] = subset_samples.get(name, repeated).contiguous()
        if name in sites:
            mode_draws[name] = repeated.contiguous()
    members = None
    if states is not None:
        members = {
            name: value[:, None].expand(num_members, per_member, *value.shape[1:]).contiguous()
            for name, value in states.items()
        }
    record = dict(
        {k: v for k, v in ensemble.record.items() if k not in ("elbo", "seconds", "method")},
        method="laplace" if num_members == 1 else "mola",
        mode_method=ensemble.record.get("method"),
        subset=list(sites),
        hessian=hessian,
        prior_precision=prior_precision,
        model_prior_scale=model_scale,
        predictive=predictive,
        num_samples=num_samples,
        laplace=summaries,
        seed=seed,
    )
    posterior = Posterior(
        fitted, samples=samples, members=members, record=record, example=ensemble.example,
        modes=mode_draws if predictive == "glm" else None,
    )  # fmt: skip
    record["glm_nn_disagreement"] = _disagreement(posterior, train, mode_draws, seed)
    record["laplace_seconds"] = time.perf_counter() - start
    record["mode_seconds"] = mode_seconds
    record["seconds"] = mode_seconds + record["laplace_seconds"]
    return posterior


def fit_mola(
    model: torch.nn.Module,
    data: SequenceData,
    *,
    n_members: int = 5,
    seed: int = 0,
    progress: bool = True,
    subset: str | list[str] = "head",
    hessian: str = "full",
    prior_precision: str | float = "marglik",
    predictive: str = "glm",
    num_samples: int = 100,
    max_memory: int = DEFAULT_MAX_MEMORY,
    **kwargs,
) -> Posterior:
    """MoLA preset: ``fit_ensemble(model, data, n_members=n_members, seed=seed, **kwargs)``, then
    ``fit_laplace(..., ensemble=...)`` around every member (Eschenhagen et al. 2021).

    Args:
        n_members, seed, progress, **kwargs: ``fit_ensemble``'s.
        subset, hessian, prior_precision, predictive, num_samples, max_memory: ``fit_laplace``'s.

    Returns:
        ``fit_laplace``'s ``Posterior``; ``record["method"] == "mola"`` (``"laplace"`` for one
        member), ``record["seconds"]`` the ensemble's fit seconds plus the Laplace ones.

    Raises:
        what ``fit_ensemble`` and ``fit_laplace`` raise.
    """
    _check_before_fit(
        model, data, subset, hessian, prior_precision, predictive, num_samples, max_memory, seed
    )
    ensemble = fit_ensemble(
        model, data, n_members=n_members, seed=seed, progress=progress, **kwargs
    )
    return fit_laplace(
        model, data, subset=subset, hessian=hessian, prior_precision=prior_precision,
        predictive=predictive, ensemble=ensemble, num_samples=num_samples,
        max_memory=max_memory, seed=seed,
    )  # fmt: skip


# -- settings -------------------------------------------------------------------------------


def _check_before_fit(
    model, data, subset, hessian, prior_precision, predictive, num_samples, max_memory, seed
) -> None:
    """Everything ``fit_laplace`` and ``fit_mola`` can check before the MAP or ensemble fit:
    the settings, the model and data, and the subset and the memory it needs (known from the
    model)."""
    _check_settings(hessian, prior_precision, predictive, num_samples, max_memory)
    check_int("seed", seed, minimum=None, type_error=True)
    check_model(model)
    check_training_data(model, data)
    sites, _ = _subset_sites(model, example_of(data).to(model_device(model)), subset)
    _check_memory(sites, hessian, num_samples, max_memory)


def _check_settings(hessian, prior_precision, predictive, num_samples, max_memory) -> None:
    for name, value, choices in (
        ("hessian", hessian, HESSIANS),
        ("predictive", predictive, PREDICTIVES),
    ):
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {described(value)}")
    if isinstance(prior_precision, str):
        if prior_precision not in ("marglik", "prior"):
            raise ValueError(
                f"prior_precision must be 'marglik', 'prior' or a number > 0, got "
                f"{prior_precision!r}"
            )
    elif isinstance(prior_precision, bool) or not isinstance(prior_precision, (int, float)):
        raise TypeError(
            f"prior_precision must be 'marglik', 'prior' or a number > 0, got "
            f"{described(prior_precision)}"
        )
    elif not (0 < prior_precision < math.inf):
        raise ValueError(f"prior_precision must be a finite number > 0, got {prior_precision!r}")
    check_int("num_samples", num_samples)
    check_int("max_memory", max_memory)


def _check_memory(sites: dict, hessian: str, num_samples: int, max_memory: int) -> None:
    """Refuse a GGN (``curvature.memory_bytes``) or draws (``8 * num_samples * d`` bytes of
    float64) above ``max_memory`` bytes, naming both."""
    flat = Subset(sites)
    needed = memory_bytes(flat, hessian)
    if needed > max_memory:
        better = {"full": "hessian='kron' or 'diag'", "kron": "hessian='diag'"}.get(hessian)
        raise ValueError(
            f"a {hessian} GGN over {flat.dim} latent scalars takes {needed:,} bytes, above "
            f"max_memory={max_memory:,}: use {better + ', ' if better else ''}a smaller subset, "
            "or raise max_memory"
        )
    if 8 * num_samples * flat.dim > max_memory:
        raise ValueError(
            f"{num_samples:,} draws of {flat.dim} latent scalars take "
            f"{8 * num_samples * flat.dim:,} bytes, above max_memory={max_memory:,}: draw fewer"
        )


def _check_ensemble(ensemble, model, kwargs) -> None:
    if not isinstance(ensemble, Posterior):
        raise TypeError(
            f"ensemble must be a Posterior from fit_ensemble or fit_map, got {described(ensemble)}"
        )
    if kwargs:
        raise TypeError(
            f"fit_laplace(ensemble=...) fits nothing, so it takes no fit_map settings; got "
            f"{', '.join(sorted(kwargs))}"
        )
    method = ensemble.record.get("method")
    if method not in ("map", "ensemble"):
        raise ValueError(
            f"ensemble must come from fit_ensemble or fit_map (its modes are the Laplace "
            f"approximation's centres), got a posterior of method {method!r}"
        )
    if type(ensemble.model) is not type(model) or ensemble.model.config != model.config:
        raise ValueError(
            f"ensemble was fitted on a {type(ensemble.model).__name__} with config "
            f"{ensemble.model.config}, not on the {type(model).__name__} given (config "
            f"{model.config}): pass the model the ensemble was fitted with"
        )


def _subset_sites(model, rows: SequenceData, subset) -> tuple[dict[str, torch.Size], dict]:
    """``{site: shape}`` of the subset, in the model's site order, and ``{site: prior}`` of
    every global latent (``_priors``)."""
    shapes, priors = _priors(model, rows)
    real = [name for name in shapes if _is_real(priors[name])]
    if isinstance(subset, str):
        if subset not in SUBSETS:
            raise ValueError(
                f"subset must be one of {SUBSETS} or a list of latent site names, got {subset!r}"
            )
        if subset == "head":
            chosen = [name for name in real if name.startswith("head.")]
        elif subset == "attention":
            prefixes = _attention_prefixes(model)
            chosen = [name for name in real if name.startswith(prefixes)]
        else:
            chosen = real
        if not chosen:
            raise ValueError(
                f"subset={subset!r} names no latent site with real support of "
                f"{type(model).__name__} (its latents: {sorted(shapes)}); pass a list of site names"
            )
    elif isinstance(subset, (list, tuple)) and subset and all(isinstance(s, str) for s in subset):
        unknown = sorted(set(subset) - set(shapes))
        if unknown:
            raise ValueError(
                f"subset names {unknown}, which are not latent sites of {type(model).__name__} "
                f"(its latents: {sorted(shapes)})"
            )
        bad = sorted(set(subset) - set(real))
        if bad:
            raise ValueError(
                f"the Laplace approximation needs latents with real support, and {bad} have "
                "none: leave them out of subset (they stay at the mode)"
            )
        chosen = [name for name in shapes if name in subset]
    else:
        raise TypeError(
            f"subset must be one of {SUBSETS} or a non-empty list of site names, got "
            f"{described(subset)}"
        )
    for name in chosen:
        if _normal(priors[name]) is None:
            raise ValueError(
                f"the Laplace evidence needs a Normal prior on {name!r}, got "
                f"{type(priors[name]).__name__}: leave it out of subset"
            )
    return {name: shapes[name] for name in chosen}, priors


def _priors(model, rows: SequenceData) -> tuple[dict[str, torch.Size], dict]:
    """``({site: shape}, {site: prior distribution})`` of the model's global latents, from
    traces of ``model`` on ``rows`` (on its device)."""
    shapes, _ = latent_sites(model, rows)
    with pyro_scope(), torch.no_grad(), poutine.block():
        trace = poutine.trace(model).get_trace(rows.x, rows.y, rows.mask)
    return shapes, {name: trace.nodes[name]["fn"] for name in shapes}


def _is_real(fn) -> bool:
    support = fn.support
    while isinstance(support, torch.distributions.constraints.independent):
        support = support.base_constraint
    return support is torch.distributions.constraints.real


def _normal(fn) -> torch.distributions.Normal | None:
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    return fn if isinstance(fn, torch.distributions.Normal) else None


def _attention_prefixes(model) -> tuple[str, ...]:
    modules = [m for group in getattr(model, "attention_modules", {}).values() for m in group]
    ids = {id(m) for m in modules}
    return tuple(f"{name}." for name, module in model.named_modules() if id(module) in ids)


def _gaussian_prior(priors: dict, flat: Subset) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d,)`` prior mean and precision of the subset under the model's own Normal priors
    (``priors``: ``{site: prior distribution}``)."""
    locs, precisions = {}, {}
    for name, shape in flat.sites.items():
        normal = _normal(priors[name])
        locs[name] = normal.loc.detach().expand(shape)
        precisions[name] = normal.scale.detach().pow(-2).expand(shape)
    return flat.flatten(locs).double().cpu(), flat.flatten(precisions).double().cpu()


def _modes(posterior: Posterior) -> tuple[list[dict], dict | None]:
    """Each member's latent values ``{site: shape}`` and, for an ensemble with per-member
    parameters, ``{name: (M, *shape)}``."""
    if posterior.samples is not None:
        samples = {k: v.detach().flatten(0, 1) for k, v in posterior.samples.items()}
        count = len(next(iter(samples.values())))
        modes = [{k: v[i] for k, v in samples.items()} for i in range(count)]
    else:
        modes = [{k: v[0, 0].detach() for k, v in posterior.draws(1).items()}]
    members = posterior.members
    states = None if members is None else {k: v.detach().flatten(0, 1) for k, v in members.items()}
    return modes, states


def _prior_precision(setting, curvature, mean, offset, prior_prec, flat: Subset):
    """The Gaussian and what the run records of its prior precision and evidence."""
    groups = flat.groups()
    if setting == "marglik":
        initial = torch.stack([prior_prec[groups == g].mean() for g in range(len(flat.sites))])
        best = maximize_evidence(
            curvature.log_likelihood, offset, curvature.blocks, groups, initial
        )
        precision = best.precision[groups]
        found = dict(
            precision=best.precision.tolist(),
            log_evidence=best.log_evidence,
            gradient=best.gradient,
            converged=best.converged,
        )
    else:
        precision = prior_prec if setting == "prior" else torch.full_like(prior_prec, setting)
        value = log_evidence(curvature.log_likelihood, offset, curvature.blocks, precision)
        found = dict(
            precision=[float(precision[groups == g].mean()) for g in range(len(flat.sites))],
            log_evidence=float(value),
        )
    return Gaussian(mean, curvature.blocks, precision), found


def _disagreement(posterior: Posterior, train: SequenceData, modes: dict, seed: int):
    """Mean total variation distance between the GLM and network predictive means on the first
    ``DISAGREEMENT_ROWS`` training rows (categorical likelihoods; None otherwise)."""
    rows = train[: min(len(train), DISAGREEMENT_ROWS)]
    draws = posterior.draw(seed=seed)  # every draw
    glm, network = (
        posterior.predict(rows.x, rows.mask, seed=seed, draws=dataclasses.replace(draws, modes=m))
        for m in (modes, None)
    )
    if not hasattr(glm, "probs"):
        return None
    return float(0.5 * (glm.mean - network.mean).abs().sum(-1).mean())


__all__ = ["DEFAULT_MAX_MEMORY", "HESSIANS", "PREDICTIVES", "SUBSETS", "fit_laplace", "fit_mola"]
