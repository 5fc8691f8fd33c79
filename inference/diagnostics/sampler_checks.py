"""The verdict lines that read a sampler's own statistics: divergences and E-BFMI for every
kernel, each kernel's own lines (``Kernel.verdict_lines``: NUTS's tree depth, stuck ChEES
chains, MCLMC's energy error ...), and the posterior's temperature."""

from __future__ import annotations

import math
import warnings

import numpy as np

from probtransformer.inference.diagnostics._arviz import az
from probtransformer.inference.mcmc.kernel import Kernel
from probtransformer.inference.mcmc.registry import KERNELS

BFMI_MIN = 0.3  # Betancourt 2016


def temperature_line(temperature: float) -> str:
    """The posterior's temperature, shown in every sampled posterior's verdict (a recorded
    value that is not a finite number > 0, from a hand-edited run, is flagged)."""
    if isinstance(temperature, bool) or not (
        isinstance(temperature, int | float) and 0 < temperature < math.inf
    ):
        return f"WARN  temperature {temperature!r} in the record is not a finite number > 0"
    if temperature == 1:
        return "info  temperature 1: the Bayesian posterior"
    return (
        f"info  temperature {temperature:g}: the likelihood enters as p(y | θ)^(1/{temperature:g})"
        ", a tempered posterior, not the Bayesian one"
        + (" (cold: sharper than the data warrant)" if temperature < 1 else "")
    )


def sampler_lines(stats, record: dict, flag, *, many: bool = False) -> list[str]:
    """Verdict lines from MCMC ``sample_stats``: divergences, E-BFMI, and the lines of the kernel
    ``record["kernel"]`` names (``flag(bad, text)`` marks each line).

    With ``many`` chains E-BFMI is summarised (min and count below ``BFMI_MIN``) instead of
    listed per chain.
    """
    lines = []
    name = record.get("kernel")
    kernel = KERNELS.get(name, Kernel) if isinstance(name, str) else Kernel
    if kernel is Kernel:  # a run of another version, or edited by hand
        lines.append(
            f"WARN  kernel {name!r} is not one of {tuple(KERNELS)}: its own checks are skipped"
        )
    if "diverging" in stats:
        divergent = int(stats["diverging"].sum())
        total = int(stats["diverging"].size)
        remedy = f"; {kernel.divergence_remedy}"
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
    lines.extend(kernel.verdict_lines(stats, record, flag))
    return lines


__all__ = ["sampler_lines", "temperature_line"]
