"""The verdict lines that read a sampler's own statistics: divergences, E-BFMI, NUTS tree depth,
stuck ChEES chains, MCLMC's energy error, and the posterior's temperature."""

from __future__ import annotations

import math
import warnings

import numpy as np

from probtransformer.inference.diagnostics._arviz import az

BFMI_MIN = 0.3  # Betancourt 2016
#: A ChEES chain whose mean acceptance probability is below this is stuck.
STUCK_ACCEPTANCE = 0.05
#: MCLMC's energy-error variance per dimension above this many times its tuning target (5e-4
#: of Robnik et al. 2023 by default; MILE's 0.1) flags its bias.
MCLMC_ENERGY_VAR_RATIO = 10


def temperature_line(temperature: float) -> str:
    """The posterior's temperature, shown in every sampled posterior's verdict."""
    if temperature == 1:
        return "info  temperature 1: the Bayesian posterior"
    return (
        f"info  temperature {temperature:g}: the likelihood enters as p(y | θ)^(1/{temperature:g})"
        ", a tempered posterior, not the Bayesian one"
        + (" (cold: sharper than the data warrant)" if temperature < 1 else "")
    )


def sampler_lines(stats, record: dict, flag, *, many: bool = False) -> list[str]:
    """Verdict lines from MCMC ``sample_stats``: divergences, E-BFMI, tree-depth saturation,
    stuck ChEES chains, MCLMC's energy error (``flag(bad, text)`` marks each line).

    With ``many`` chains E-BFMI is summarised (min and count below ``BFMI_MIN``) instead of
    listed per chain.
    """
    lines = []
    if "diverging" in stats:
        divergent = int(stats["diverging"].sum())
        total = int(stats["diverging"].size)
        remedy = (  # MCLMC has no acceptance step: a divergence is an energy error blow-up
            "; lower Tuning.desired_energy_var (a smaller step) or reparameterise"
            if record.get("kernel") == "mclmc"
            else "; raise target_accept_prob or reparameterise"
        )
        lines.append(
            flag(
                divergent > 0,
                f"divergent transitions: {divergent} of {total}" + (remedy if divergent else ""),
            )
        )
    if "energy" in stats:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bfmi = np.atleast_1d(az.bfmi(stats))
        low = int((bfmi < BFMI_MIN).sum())
        shown = (
            f"E-BFMI min {bfmi.min():.2f} over {bfmi.size} chains, {low} below {BFMI_MIN}"
            if many
            else f"E-BFMI per chain {', '.join(f'{b:.2f}' for b in bfmi)}"
        )
        lines.append(
            "n/a   E-BFMI: too few draws per chain"
            if np.isnan(bfmi).any()
            else flag(
                low > 0,
                f"{shown} (flag < {BFMI_MIN}: momentum resampling explores the energy poorly)",
            )
        )
    if record.get("kernel") == "nuts" and "tree_depth" in stats:
        limit = record.get("max_tree_depth")
        saturated = int((stats["tree_depth"] >= limit).sum())
        lines.append(
            flag(
                saturated > 0,
                f"transitions at max_tree_depth={limit}: {saturated}"
                + ("; trajectories were cut short: raise max_tree_depth" if saturated else ""),
            )
        )
    if record.get("kernel") == "chees" and "acceptance_rate" in stats:
        per_chain = stats["acceptance_rate"].mean("draw").values
        stuck = [int(c) for c in np.flatnonzero(per_chain < STUCK_ACCEPTANCE)]
        lines.append(
            flag(
                bool(stuck),
                f"stuck chains (mean acceptance < {STUCK_ACCEPTANCE}): {len(stuck)} of "
                f"{len(per_chain)}"
                + (f" (chains {stuck[:10]}): start them elsewhere (init=)" if stuck else ""),
            )
        )
    energy_var = record.get("energy_error_var_per_dim")
    if record.get("kernel") == "mclmc" and energy_var is not None:
        by_start = record.get("energy_error_var_per_dim_by_start") or [energy_var]
        worst = max((v for v in by_start if not math.isnan(v)), default=math.nan)
        target = (record.get("adapted_desired_energy_var") or [5e-4])[-1]
        limit = MCLMC_ENERGY_VAR_RATIO * target
        lines.append(
            flag(
                not worst <= limit,
                f"MCLMC is unadjusted: energy-error variance per dimension {energy_var:.2g}"
                + (f" (worst member {worst:.2g})" if len(by_start) > 1 else "")
                + f" (tuned towards {target:g}; flag > {limit:g}: the step-size bias grows "
                "with it)",
            )
        )
    return lines


__all__ = ["sampler_lines", "temperature_line"]
