"""Aggregated posterior diagnostics: one row per variable group, plus a printed verdict."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd

from probtransformer.datasets import SequenceData
from probtransformer.inference._arviz import az, pareto_khat
from probtransformer.inference.guides import AmortizedGuide

#: Thresholds of the verdict (Vehtari et al. 2021 for R-hat/ESS; Vehtari et al. 2024 for k-hat).
RHAT_MAX = 1.01
ESS_PER_CHAIN_MIN = 100
PARETO_K_MAX = 0.7
ELBO_CHANGE_PER_OBS_MAX = 0.01
BFMI_MIN = 0.3  # Betancourt 2016


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
    passes or independently fitted members, not a Markov chain (the verdict says so). The verdict
    flags:

    - MCMC: max R-hat > 1.01, min bulk/tail ESS < 100 per chain, divergent transitions, E-BFMI
      < 0.3 in any chain (Betancourt 2016), NUTS transitions at ``max_tree_depth``;
    - SVI: the mean ELBO moving by more than ``ELBO_CHANGE_PER_OBS_MAX`` nats per training
      observation between the last two tenths of the steps, and (with ``data``) the PSIS k̂ of
      the guide as an importance proposal above 0.7 (Yao et al. 2018);
    - both, with ``data``: PSIS-LOO (Vehtari, Gelman & Gabry 2017) with Pareto-k counts.

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
        ``ess_bulk_min``, ``ess_tail_min``; ``attrs["verdict"]`` holds the verdict lines and
        ``attrs["loo"]`` the LOO figures and ``attrs["guide_k_hat"]`` (SVI) with ``data``.
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
    table = _variable_table(idata.posterior)
    chains = idata.posterior.sizes["chain"]
    record = posterior.record
    verdict = [
        f"verdict ({record.get('method', '?')}, {chains} chain(s) x "
        f"{idata.posterior.sizes['draw']} draws"
        + (", PARTIAL: sampling was interrupted" if record.get("partial") else "")
        + "):"
    ]
    if posterior.mc_dropout or posterior.members is not None:
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
    elif table["r_hat_max"].isna().all():
        verdict.append("n/a   R-hat and ESS: too few draws per chain (need at least 4)")
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
        verdict.extend(_sampler_lines(idata.sample_stats, record))
    elbo = record.get("elbo")
    if elbo:
        change = elbo_change_per_obs(elbo, record["num_data"])
        verdict.append(
            _flag(
                change > ELBO_CHANGE_PER_OBS_MAX,
                f"ELBO {np.mean(elbo[-max(1, len(elbo) // 10) :]):.1f} nats; it moved "
                f"{change:.3g} nats per observation over the last tenth of the steps "
                f"(flag > {ELBO_CHANGE_PER_OBS_MAX}: not converged, the guide is still moving)",
            )
        )
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
        verdict.append(
            _flag(
                loo["k_over_0.7"] > 0,
                f"LOO: elpd_loo {loo['elpd_loo']:.1f} ± {loo['se']:.1f}, p_loo "
                f"{loo['p_loo']:.1f}; Pareto k > {PARETO_K_MAX}: {loo['k_over_0.7']} of "
                f"{loo['n']} (k > 1: {loo['k_over_1']})"
                + (
                    "; LOO is unreliable here, compare models on held-out NLL"
                    if loo["k_over_0.7"]
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


def elbo_change_per_obs(elbo: list[float], num_data: int) -> float:
    """``|mean(last tenth) - mean(previous tenth)| / num_data`` of an ELBO trace, in nats.

    Per observation rather than relative to the ELBO, which can be near zero.
    """
    window = max(1, len(elbo) // 10)
    last = float(np.mean(elbo[-window:]))
    previous = float(np.mean(elbo[-2 * window : -window] or elbo[-window:]))
    return abs(last - previous) / num_data


def _flag(bad: bool, text: str) -> str:
    return ("WARN  " if bad else "ok    ") + text


def _sampler_lines(stats, record: dict) -> list[str]:
    """Verdict lines from MCMC ``sample_stats``: divergences, E-BFMI, tree-depth saturation."""
    lines = []
    if "diverging" in stats:
        divergent = int(stats["diverging"].sum())
        total = int(stats["diverging"].size)
        lines.append(
            _flag(
                divergent > 0,
                f"divergent transitions: {divergent} of {total}"
                + ("; raise target_accept_prob or reparameterise" if divergent else ""),
            )
        )
    if "energy" in stats:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bfmi = np.atleast_1d(az.bfmi(stats))
        lines.append(
            "n/a   E-BFMI: too few draws per chain"
            if np.isnan(bfmi).any()
            else _flag(
                bool((bfmi < BFMI_MIN).any()),
                f"E-BFMI per chain {', '.join(f'{b:.2f}' for b in bfmi)} (flag < {BFMI_MIN}: "
                "momentum resampling explores the energy poorly)",
            )
        )
    if record.get("kernel") == "nuts" and "tree_depth" in stats:
        limit = record.get("max_tree_depth")
        saturated = int((stats["tree_depth"] >= limit).sum())
        lines.append(
            _flag(
                saturated > 0,
                f"transitions at max_tree_depth={limit}: {saturated}"
                + ("; trajectories were cut short: raise max_tree_depth" if saturated else ""),
            )
        )
    return lines


def _variable_table(dataset) -> pd.DataFrame:
    sd = dataset.std(dim=("chain", "draw"))
    rhat = bulk = tail = None
    if dataset.sizes["chain"] >= 2:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ArviZ warns about constant draws
            rhat = az.rhat(dataset)
            bulk = az.ess(dataset, method="bulk")
            tail = az.ess(dataset, method="tail")
    rows = {}
    for name, var in dataset.data_vars.items():
        rows[name] = dict(
            size=int(math.prod(var.shape[2:])),
            mean_sd=float(sd[name].mean()),
            r_hat_max=math.nan if rhat is None else float(rhat[name].max()),
            ess_bulk_min=math.nan if bulk is None else float(bulk[name].min()),
            ess_tail_min=math.nan if tail is None else float(tail[name].min()),
        )
    return pd.DataFrame.from_dict(rows, orient="index")


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
        "k_over_0.7": int((k > PARETO_K_MAX).sum()),
        "k_over_1": int((k > 1).sum()),
    }
