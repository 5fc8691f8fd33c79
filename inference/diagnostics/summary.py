"""Aggregated posterior diagnostics: one row per variable group, plus a printed verdict.

Many-chain samplers (16-128 short chains from a few starts) are judged on predictive
quantities with nested R-hat (Margossian et al. 2024) and pooled ESS instead of weight-space
R-hat, which head and neuron symmetries make uninformative."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import torch

from probtransformer.attention import BayesMultiheadAttention
from probtransformer.data import SequenceData
from probtransformer.inference.diagnostics import modes
from probtransformer.inference.diagnostics._arviz import az, ess, pareto_khat, rhat, rhat_nested
from probtransformer.inference.diagnostics.guide_checks import (
    collapse_line,
    elbo_line,
    guide_scale_ratio,
)
from probtransformer.inference.diagnostics.inference_data import superchain_ids, with_superchain
from probtransformer.inference.diagnostics.laplace_checks import (
    is_laplace,
    laplace_lines,
)
from probtransformer.inference.diagnostics.sampler_checks import sampler_lines, temperature_line
from probtransformer.inference.vi.guides import AmortizedGuide
from probtransformer.layers import BayesLinear

#: Thresholds of the verdict (Vehtari et al. 2021 for R-hat/ESS; Vehtari et al. 2024 for k-hat).
RHAT_MAX = 1.01
ESS_PER_CHAIN_MIN = 100
PARETO_K_MAX = 0.7

#: Many-chain verdict: nested R-hat (Margossian et al. 2024) and pooled bulk ESS of ``lp`` and
#: of the log-likelihoods of the first ``PROBE_OBS`` training rows, from ``MANY_CHAINS`` chains.
NESTED_RHAT_MAX = 1.01
POOLED_ESS_MIN = 400
MANY_CHAINS = 8
PROBE_OBS = 20


def diagnose(
    posterior,
    data: SequenceData | None = None,
    *,
    num_samples: int | None = None,
    attention_obs: int = 2,
    seed: int = 0,
    verbose: bool = True,
    idata: az.InferenceData | None = None,
) -> pd.DataFrame:
    """Summarise convergence per variable group and print a verdict.

    Every latent site is one row (the attention of ``attention_obs`` sequences is one more), with
    its number of scalars, mean posterior sd and, for two or more chains, max R-hat and min
    bulk/tail ESS (ArviZ; rank-normalised, Vehtari et al. 2021). They are NaN for SVI: its draws
    are independent guide samples, so the ESS equals the number of draws by construction and
    says nothing about the fit, and for MC dropout and deep ensembles, whose draws are dropout
    passes or independently fitted members, not a Markov chain (the verdict says so), and for
    Laplace posteriors, whose draws are independent Gaussian samples. The verdict
    flags:

    - MCMC: max R-hat > 1.01, min bulk/tail ESS < 100 per chain, divergent transitions, E-BFMI
      < 0.3 in any chain (Betancourt 2016), NUTS transitions at ``max_tree_depth``;
    - SVI: the mean ELBO moving by more than ``guide_checks.ELBO_CHANGE_PER_OBS_MAX`` nats per
      training observation between the last two tenths of the steps and by more than 3
      standard errors of its Monte Carlo noise (``guide_checks.elbo_line``), the guide's sd below
      ``guide_checks.SCALE_RATIO_MIN`` of the prior's (a posterior collapsed towards a point,
      ``guide_checks.collapse_line``), and (with ``data``) the PSIS k̂ of the guide as an
      importance proposal above 0.7 (Yao et al. 2018);
    - Laplace (``fit_laplace``, ``fit_mola``; ``laplace_checks.laplace_lines``): a posterior
      precision with condition number above ``laplace_checks.CONDITION_NUMBER_MAX``, an evidence
      maximization that did not converge, GLM and sampled-network predictive means further apart
      than ``laplace_checks.DISAGREEMENT_MAX`` (total variation), and the prior scale per site;
      its draws are independent Gaussian samples, so R-hat and ESS do not apply;
    - all, with ``data``: PSIS-LOO (Vehtari, Gelman & Gabry 2017) with Pareto-k counts.

    Sampled posteriors of two or more superchains (chains that share a start,
    ``record["superchain"]``; without it each chain is its own superchain, counted from
    ``MANY_CHAINS`` chains on) add the column ``nested_r_hat_max`` (Margossian et al. 2024,
    "Nested R-hat: assessing the convergence of Markov chain Monte Carlo when running many short
    chains") and ``attrs["predictive"]``: nested R-hat, R-hat and pooled bulk ESS of ``lp``
    (``sample_stats``) and, with ``data``, of the pointwise log-likelihoods of the first
    ``PROBE_OBS`` training rows (max R-hat, min ESS over the rows). From ``MANY_CHAINS`` chains
    the verdict flags those instead: nested R-hat > ``NESTED_RHAT_MAX`` or pooled bulk ESS <
    ``POOLED_ESS_MIN``; for models with head or unit symmetries (``has_unit_symmetries``:
    attention, a hidden layer) weight-space R-hat, nested R-hat and ESS are printed as
    information (``info``), since those symmetries let chains sit in equivalent modes; for
    other models the weights' nested R-hat is flagged too. With fewer chains the verdict is the
    one above.

    Args:
        posterior: a ``Posterior``.
        data: training data for LOO and the attention group, or None.
        num_samples: posterior draws to summarise (None: every draw of a sampled posterior, 100
            guide draws for SVI).
        attention_obs: sequences whose posterior attention forms the ``attention`` group.
        seed: seeds the draws.
        verbose: print the verdict (the table is returned; ``format_table`` renders it).
        idata: ``posterior.to_inference_data(data, num_samples=num_samples, seed=seed)``
            already made (its ``attention`` is cut to ``attention_obs`` sequences): reused
            instead of exporting again.

    Returns:
        DataFrame indexed by variable with columns ``size``, ``mean_sd``, ``r_hat_max``,
        ``ess_bulk_min``, ``ess_tail_min`` (and ``nested_r_hat_max``, see above);
        ``attrs["verdict"]`` holds the verdict lines and ``attrs["loo"]`` the LOO figures and
        ``attrs["guide_k_hat"]`` (SVI) with ``data``; ``attrs["guide_scale_ratio"]`` (SVI:
        ``guide_checks.guide_scale_ratio``); ``attrs["predictive"]`` is ``{"lp": {"nested_r_hat",
        "r_hat", "ess_bulk"}, "probe_log_lik": {..., "rows"}}`` (each where available) for two
        or more superchains.

    Raises:
        ValueError: ``idata`` without ``data``; a ``record["superchain"]`` that is not one int
            per chain or gives superchains of different sizes.
    """
    if idata is not None:
        if data is None:
            raise ValueError("idata needs data: the training data it was exported from")
        if "attention" in idata.posterior:
            idata = idata.copy()
            idata.posterior = idata.posterior.isel(attention_obs=slice(0, attention_obs))
    elif data is not None:
        idata = posterior.to_inference_data(
            data, attention_obs=attention_obs, num_samples=num_samples, seed=seed
        )
    else:
        draws = posterior.draws(num_samples, seed=seed)
        stats = posterior.sample_stats(num_samples)
        idata = az.from_dict(
            posterior={k: v.cpu().numpy() for k, v in draws.items()},
            sample_stats={k: v.numpy() for k, v in stats.items()} or None,
        )
        idata = with_superchain(idata, posterior.record)
    chains = idata.posterior.sizes["chain"]
    superchain = _superchains(posterior, chains)
    table = _variable_table(idata.posterior, superchain)
    record = posterior.record
    if is_laplace(record):  # independent Gaussian draws: R-hat and ESS say nothing (verdict)
        table[["r_hat_max", "ess_bulk_min", "ess_tail_min"]] = math.nan
    site = posterior.model.likelihood_site
    per_mode = superchain is not None and modes.by_mode(record)
    if per_mode:
        table.attrs["modes"] = modes.within_modes(idata, superchain, site)
        if data is not None:
            table.attrs["modes"]["between"] = modes.between_modes(
                posterior, data, superchain, seed=seed
            )
    elif superchain is not None:
        table.attrs["predictive"] = _predictive(idata, superchain, site)
    many = superchain is not None and chains >= MANY_CHAINS and not per_mode
    verdict = [
        f"verdict ({record.get('method', '?')}, {chains} chain(s) x "
        f"{idata.posterior.sizes['draw']} draws"
        + (f", {len(np.unique(superchain))} superchains" if many else "")
        + (f", {len(np.unique(superchain))} ensemble members" if per_mode else "")
        + (", PARTIAL: sampling was interrupted" if record.get("partial") else "")
        + "):"
    ]
    if is_laplace(record):
        verdict.append(
            "n/a   R-hat and ESS do not apply: Laplace draws are independent samples of a "
            "Gaussian around each mode, not a Markov chain"
        )
        verdict.extend(laplace_lines(record, _flag, record.get("model_prior_scale")))
    elif posterior.mc_dropout or _is_ensemble(posterior):
        verdict.append(
            "n/a   R-hat and ESS do not apply: "
            + (
                "MC-dropout draws are forward passes with independent dropout masks around one "
                "MAP fit (the latent sites hold its point values), not a Markov chain"
                if posterior.mc_dropout
                else "ensemble draws are independently fitted members, not a Markov chain"
            )
        )
    elif chains < 2:
        verdict.append(
            "n/a   R-hat and ESS need two or more chains"
            + (
                " (SVI draws are independent samples of the fitted guide, not a Markov chain)"
                if posterior.guide is not None
                else ""
            )
        )
    elif table["r_hat_max"].isna().all() and not per_mode:
        verdict.append("n/a   R-hat and ESS: too few draws per chain (need at least 4)")
    elif per_mode:
        if has_unit_symmetries(posterior.model):
            verdict.extend(_weight_info(table, superchain))
        figures = table.attrs["modes"]
        verdict.extend(modes.verdict_lines(figures, figures.get("between"), _flag))
    elif many:
        verdict.extend(_many_chain_lines(table, superchain, has_unit_symmetries(posterior.model)))
    else:
        worst = table["r_hat_max"].max()
        verdict.append(_flag(worst > RHAT_MAX, f"max R-hat {worst:.3f} (flag > {RHAT_MAX})"))
        for kind in ("bulk", "tail"):
            ess = table[f"ess_{kind}_min"].min()
            verdict.append(
                _flag(
                    ess < ESS_PER_CHAIN_MIN * chains,
                    f"min {kind} ESS {ess:.0f} (flag < {ESS_PER_CHAIN_MIN} per chain)",
                )
            )
    if "sample_stats" in idata.groups():
        verdict.extend(sampler_lines(idata.sample_stats, record, _flag, many=many or per_mode))
    if record.get("method") == "mcmc":
        verdict.append(temperature_line(record.get("temperature", 1.0)))
    elbo = record.get("elbo")
    if elbo:
        verdict.append(elbo_line(elbo, record["num_data"], _flag))
    if posterior.guide is not None and not (posterior.is_point_estimate or posterior.mc_dropout):
        ratio = guide_scale_ratio(posterior, num_samples or 100, seed=seed)
        table.attrs["guide_scale_ratio"] = ratio
        if math.isfinite(ratio):
            verdict.append(collapse_line(ratio, record.get("init_scale"), _flag))
    if data is not None and isinstance(posterior.guide, AmortizedGuide):
        verdict.append(
            "n/a   PSIS k-hat of the guide: not computed for local latents (stochastic "
            "attention, amortized guide)"
        )
    elif (
        data is not None
        and posterior.guide is not None
        and not (posterior.is_point_estimate or posterior.mc_dropout)
    ):
        log_weights = posterior.log_importance_weights(data, num_samples=num_samples, seed=seed)
        k_hat = pareto_khat(log_weights)
        table.attrs["guide_k_hat"] = k_hat
        if math.isfinite(k_hat):
            verdict.append(
                _flag(
                    k_hat > PARETO_K_MAX,
                    f"PSIS k-hat of the guide as an importance proposal {k_hat:.2f} (flag > "
                    f"{PARETO_K_MAX}: the guide is far from the posterior; trust its uncertainty "
                    "and its LOO less, or use a richer guide or MCMC)",
                )
            )
        else:
            verdict.append(
                f"n/a   PSIS k-hat of the guide: {len(log_weights)} draws are too few to fit the "
                "tail; give num_samples >= 100"
            )
    if data is not None and idata.posterior.sizes["draw"] * chains < 2:
        verdict.append("n/a   LOO: a point estimate has one draw; PSIS-LOO needs several")
    elif data is not None:
        loo = _loo(idata)
        table.attrs["loo"] = loo
        finite = all(np.isfinite(loo[key]) for key in ("elpd_loo", "se", "p_loo"))
        verdict.append(
            _flag(
                loo["k_over_0.7"] > 0 or not finite,
                f"LOO: elpd_loo {loo['elpd_loo']:.1f} ± {loo['se']:.1f}, p_loo "
                f"{loo['p_loo']:.1f}; Pareto k > {PARETO_K_MAX}: {loo['k_over_0.7']} of "
                f"{loo['n']} (k > 1: {loo['k_over_1']})"
                + (
                    "; LOO is unreliable here, compare models on held-out NLL"
                    if loo["k_over_0.7"] or not finite
                    else ""
                ),
            )
        )
    table.attrs["verdict"] = verdict
    if verbose:
        print("\n".join(verdict))
    return table


def format_table(table: pd.DataFrame) -> str:
    """The diagnostics table as text (4 significant digits)."""
    return table.to_string(float_format=lambda v: f"{v:.4g}")


def _flag(bad: bool, text: str) -> str:
    return ("WARN  " if bad else "ok    ") + text


def _is_ensemble(posterior) -> bool:
    """Independently fitted members (MCMC may keep per-chain plain parameters as members too)."""
    return posterior.members is not None and posterior.record.get("method") != "mcmc"


def _superchains(posterior, chains: int) -> np.ndarray | None:
    """``(chain,)`` superchain ids of a sampled posterior with 2+ superchains, else None.

    Without ``record["superchain"]``, or with one start for every chain (``init="map"``, or
    ``num_starts=1``), each chain is its own superchain, from ``MANY_CHAINS`` chains on (fewer
    keep the plain R-hat verdict). Ensembles, Laplace posteriors and MC dropout have none.
    """
    if posterior.samples is None or _is_ensemble(posterior) or is_laplace(posterior.record):
        return None
    ids = superchain_ids(posterior.record, chains)
    if (ids is None or len(np.unique(ids)) < 2) and chains >= MANY_CHAINS:
        ids = np.arange(chains)
    return ids if ids is not None and len(np.unique(ids)) >= 2 else None


def _predictive(idata, superchain: np.ndarray, site: str) -> dict[str, dict[str, float]]:
    """Nested R-hat, R-hat and pooled bulk ESS of ``lp`` and of the probe log-likelihoods.

    ``lp`` (``sample_stats``, ``(chain, draw)``) when it is recorded and finite; the probe is
    the first ``PROBE_OBS`` rows of the ``log_likelihood`` group (``(chain, draw, obs, ...)``,
    max R-hat and min ESS over its scalars) when the group exists.
    """
    out = {}
    if "sample_stats" in idata.groups() and "lp" in idata.sample_stats:
        lp = np.asarray(idata.sample_stats["lp"].transpose("chain", "draw").values, dtype=float)
        if np.isfinite(lp).all():
            out["lp"] = _figures(lp, superchain)
    if "log_likelihood" in idata.groups() and site in idata.log_likelihood:
        ll = idata.log_likelihood[site].transpose("chain", "draw", ...)
        probe = np.asarray(ll.values[:, :, :PROBE_OBS], dtype=float)  # (chain, draw, rows, ...)
        if probe.shape[2] and np.isfinite(probe).all():
            out["probe_log_lik"] = {**_figures(probe, superchain), "rows": probe.shape[2]}
    return out


def _figures(values: np.ndarray, superchain: np.ndarray) -> dict[str, float]:
    """Max nested R-hat, max R-hat and min pooled bulk ESS of ``values (chain, draw, ...)``."""
    return dict(
        nested_r_hat=_nanmax(np.atleast_1d(rhat_nested(values, superchain))),
        r_hat=_nanmax(np.atleast_1d(rhat(values))),
        ess_bulk=_nanmin(np.atleast_1d(ess(values, "bulk"))),
    )


def has_unit_symmetries(model) -> bool:
    """Whether permuting heads or hidden units leaves ``model``'s function unchanged: it has
    multi-head attention or two or more linear layers (a hidden layer). Then equivalent modes
    make weight-space R-hat uninformative."""
    modules = list(model.modules())
    linear = sum(isinstance(m, BayesLinear | torch.nn.Linear) for m in modules)
    return linear >= 2 or any(isinstance(m, BayesMultiheadAttention) for m in modules)


def _many_chain_lines(table: pd.DataFrame, superchain: np.ndarray, symmetric: bool) -> list[str]:
    """Verdict lines for ``MANY_CHAINS`` or more chains: the predictive figures of
    ``table.attrs["predictive"]`` flagged; weight space as information when the model has
    head or unit symmetries (``has_unit_symmetries``), flagged by nested R-hat otherwise."""
    nested = table["nested_r_hat_max"].max()
    if symmetric:
        lines = _weight_info(table, superchain)
    else:
        lines = [
            _flag(
                nested > NESTED_RHAT_MAX,
                f"{_weights(table, superchain)} (flag nested R-hat > {NESTED_RHAT_MAX})",
            )
        ]
    predictive = table.attrs["predictive"]
    for key, label, missing in (
        ("lp", "lp", "the sampler recorded no finite lp"),
        ("probe_log_lik", "the probe log-likelihoods", "pass data to check the log-likelihoods"),
    ):
        figures = predictive.get(key)
        if figures is None:
            lines.append(f"n/a   {label}: {missing}")
            continue
        worst = ("max ", "min ") if key == "probe_log_lik" else ("", "")
        if key == "probe_log_lik":
            label = f"the log-likelihoods of the first {figures['rows']} training rows"
        nested, pooled = figures["nested_r_hat"], figures["ess_bulk"]
        if math.isnan(nested) or math.isnan(pooled):
            lines.append(f"n/a   nested R-hat and ESS of {label}: constant, or under 4 draws")
            continue
        lines.append(
            _flag(
                nested > NESTED_RHAT_MAX,
                f"{worst[0]}nested R-hat of {label} {nested:.3f} (flag > {NESTED_RHAT_MAX})",
            )
        )
        lines.append(
            _flag(
                pooled < POOLED_ESS_MIN,
                f"{worst[1]}pooled bulk ESS of {label} {pooled:.0f} (flag < {POOLED_ESS_MIN})",
            )
        )
    return lines


def _weights(table: pd.DataFrame, superchain: np.ndarray) -> str:
    """Weight-space R-hat, nested R-hat and ESS of the table, in words."""
    num_superchains = len(np.unique(superchain))
    return (
        f"max R-hat {table['r_hat_max'].max():.3f}, max nested R-hat "
        f"{table['nested_r_hat_max'].max():.3f} ({num_superchains} superchains of "
        f"{len(superchain) // num_superchains} chain(s)), min bulk ESS "
        f"{table['ess_bulk_min'].min():.0f}, min tail ESS {table['ess_tail_min'].min():.0f}"
    )


def _weight_info(table: pd.DataFrame, superchain: np.ndarray) -> list[str]:
    """Weight space as information: symmetries make its R-hat uninformative."""
    return [
        "info  weight-space R-hat and ESS are information only: head and neuron symmetries "
        "(permuted heads or hidden units compute the same function) let chains sit in "
        "equivalent modes, which makes weight-space R-hat uninformative; the verdict checks "
        "lp and probe log-likelihoods",
        f"info  {_weights(table, superchain)}",
    ]


def _variable_table(dataset, superchain: np.ndarray | None = None) -> pd.DataFrame:
    """One row per variable of ``dataset`` (an InferenceData group): its number of scalars,
    mean sd and, for 2+ chains, max R-hat and min bulk/tail ESS over its scalars; with
    ``superchain`` ``(chain,)`` also max nested R-hat (column ``nested_r_hat_max``)."""
    sd = dataset.std(dim=("chain", "draw"))
    chains = dataset.sizes["chain"]
    rows = {}
    for name, var in dataset.data_vars.items():
        values = np.asarray(var.transpose("chain", "draw", ...).values)  # (chain, draw, *shape)
        row = dict(
            size=int(math.prod(values.shape[2:])),
            mean_sd=float(sd[name].mean()),
            r_hat_max=_nanmax(rhat(values)) if chains >= 2 else math.nan,
            ess_bulk_min=_nanmin(ess(values, "bulk")) if chains >= 2 else math.nan,
            ess_tail_min=_nanmin(ess(values, "tail")) if chains >= 2 else math.nan,
        )
        if superchain is not None:
            row["nested_r_hat_max"] = _nanmax(rhat_nested(values, superchain))
        rows[name] = row
    return pd.DataFrame.from_dict(rows, orient="index")


def _nanmax(values: np.ndarray) -> float:
    """Max ignoring NaN (as xarray's ``max``); NaN when every value is NaN."""
    finite = values[~np.isnan(values)]
    return float(finite.max()) if finite.size else math.nan


def _nanmin(values: np.ndarray) -> float:
    """Min ignoring NaN (as xarray's ``min``); NaN when every value is NaN."""
    finite = values[~np.isnan(values)]
    return float(finite.min()) if finite.size else math.nan


def _loo(idata) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Pareto-k warning is reported in the verdict
        loo = az.loo(idata, pointwise=True)
    k = np.asarray(loo.pareto_k)
    return {
        "elpd_loo": float(loo.elpd_loo),
        "se": float(loo.se),
        "p_loo": float(loo.p_loo),
        "n": int(k.size),
        "k_over_0.7": int((~(k <= PARETO_K_MAX)).sum()),  # NaN k counts: nothing is known
        "k_over_1": int((~(k <= 1)).sum()),
    }
