"""The quality benchmark's Laplace rows (``benchmarks.quality``) and their part of the report.

- ``laplace``: ``fit_laplace(subset="head", hessian="full")`` around a MAP fit of ``MODEL``
  with the ``map`` row's optimised settings (the ``map`` row's own fit when it ran in this
  process, otherwise one fitted by the first Laplace row of the data set and seed, which the
  other then reuses);
- ``laplace-attention``: the same around the same MAP fit, over the attention projections,
  with the GGN's diagonal (``hessian="diag"``);
- ``mola``: ``fit_laplace(ensemble=..., subset="head", hessian="full")`` around every member
  of the batched ensemble fitted in this process for the same data set and seed (the
  ``ensemble-batched`` row's; without one, an ensemble fitted here with that row's settings);
- ``mola-attention``: the same over the attention projections with the GGN's diagonal.

All three choose one prior precision per latent site by maximizing the Laplace evidence
(``prior_precision="marglik"``) and predict by Monte Carlo over the linearized (GLM) network.
Each row's ``fit_seconds`` are the mode's fit seconds (MAP or ensemble) plus the Laplace
seconds, and ``ensemble_ratio`` those against the batched ensemble row's fit seconds of the
same process (None when no batched ensemble was fitted in it). Only the mode's fit keeps to
the row's time budget (``fit_optimised``); the Laplace step, one GGN pass over the training
split per member and the evidence's maximization, is never cut (its seconds are in each row's
``laplace_seconds``: 2-20 s per fit here). Each row records, per member,
the prior scale the evidence chose per site (``prior_scale``), the log evidence, the evidence's
convergence and the posterior precision's condition number, the GLM-against-network
disagreement on training rows, and the model's fixed prior scale of each site
(``default_prior_scale``: the built-in ``N(0, 3/sqrt(fan_in))``, read from a trace of the
model).
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks._suite import Context, fmt
from benchmarks.quality_fits import Setup, Sizes, fit_optimised
from probtransformer.datasets import SequenceData
from probtransformer.inference import Posterior, fit_laplace

#: Row method: ``fit_laplace``'s subset and curvature.
LAPLACE = {
    "laplace": dict(subset="head", hessian="full"),
    "laplace-attention": dict(subset="attention", hessian="diag"),
    "mola": dict(subset="head", hessian="full"),
    "mola-attention": dict(subset="attention", hessian="diag"),
}
LAPLACE_METHODS = tuple(LAPLACE)
#: The issue's goal for ``mola``: at most this many times the batched ensemble's fit seconds.
MOLA_COST_RATIO = 2.0


def mode_method(method: str) -> str:
    """The optimised row whose fit ``method`` takes as its mode(s): ``map`` or
    ``ensemble-batched``."""
    if method not in LAPLACE:
        raise ValueError(f"method must be one of {LAPLACE_METHODS}, got {method!r}")
    return "ensemble-batched" if method.startswith("mola") else "map"


def fit_laplace_row(
    method: str,
    model,
    train: SequenceData,
    setup: Setup,
    mode: tuple[Posterior, dict, str] | None,
    sizes: Sizes,
    seed: int,
    ctx: Context,
    *,
    reference_seconds: float | None,
) -> tuple[Posterior, dict, tuple[Posterior, dict, str]]:
    """One Laplace row (the module docstring).

    Args:
        method: one of ``LAPLACE_METHODS``.
        model: the ``MODEL`` classifier (fitted here only when ``mode`` is None).
        train: training split.
        setup, sizes, seed, ctx: the data set's optimiser settings, the run sizes, the fit seed
            and the run's context (``fit_optimised``'s).
        mode: ``(posterior, fit record, where it comes from)`` of the ``mode_method(method)``
            fit of the same data set and seed made in this process, or None: fitted here with
            ``fit_optimised`` (the same settings, pilot and budget as that row).
        reference_seconds: the batched ensemble row's fit seconds in this process, the cost
            ratio's denominator; None: ``mola``'s own ensemble's (the ratio is None for the
            other rows).

    Returns:
        ``(posterior, row fields, mode)``; ``mode`` as given or as fitted here, for the next
        row to reuse.
    """
    if mode is None:
        fitted, fitted_fit = fit_optimised(
            mode_method(method), model, train, setup, sizes, seed, ctx
        )
        mode = (fitted, fitted_fit, f"fitted by the {method} row, this process")
    mode_post, mode_fit, basis = mode
    start = time.perf_counter()
    post = fit_laplace(
        model, train, ensemble=mode_post, num_samples=sizes.draws, seed=seed,
        progress=False, **LAPLACE[method],
    )  # fmt: skip
    laplace_seconds = time.perf_counter() - start
    mode_seconds = mode_fit["fit_seconds"]
    fit_seconds = mode_seconds + laplace_seconds
    if reference_seconds is None and method.startswith("mola"):
        reference_seconds = mode_seconds
    ratio = None if reference_seconds is None else fit_seconds / reference_seconds
    record = post.record
    members = record["laplace"]
    return (
        post,
        {
            "fit_seconds": fit_seconds,
            "mode_seconds": mode_seconds,
            "laplace_seconds": laplace_seconds,
            "mode_basis": basis,
            "ensemble_seconds": reference_seconds,
            "ensemble_ratio": ratio,
            "num_members": len(members),
            "num_steps": mode_fit["num_steps"],
            "planned_steps": mode_fit["planned_steps"],
            "budget_cut": mode_fit["budget_cut"],
            "subset": record["subset"],
            "hessian": record["hessian"],
            "prior_scale": [m["prior_scale"] for m in members],
            "prior_precision": [m["prior_precision"] for m in members],
            "default_prior_scale": record["model_prior_scale"],
            "log_evidence": [m["log_evidence"] for m in members],
            "evidence_converged": [m["evidence_converged"] for m in members],
            "condition_number": [m["condition_number"] for m in members],
            "glm_nn_disagreement": record["glm_nn_disagreement"],
            "settings": {
                **mode_fit["settings"],
                "mode_method": mode_method(method),
                **LAPLACE[method],
                "prior_precision": record["prior_precision"],
                "predictive": record["predictive"],
                "num_samples": sizes.draws,
            },
        },
        mode,
    )


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def prior_scale_table(groups: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Per data set, Laplace row and site: the prior scale the evidence chose (mean and range
    over seeds and members) beside the model's fixed default; no lines without Laplace rows."""
    lines = []
    for name, methods in groups.items():
        for method in LAPLACE_METHODS:
            group = methods.get(method, [])
            if not group:
                continue
            for site, default in group[0]["default_prior_scale"].items():
                chosen = [m[site] for row in group for m in row["prior_scale"]]
                mean = float(np.mean(chosen))
                ratio = "" if default is None else f"{mean / default:.2g}"
                lines.append(
                    f"| {name} | {method} | `{site}` | {fmt(default)} | {mean:.3g} "
                    f"({min(chosen):.3g}-{max(chosen):.3g}) | {ratio} | {len(chosen)} |"
                )
    if not lines:
        return []
    return [
        "Prior scale per weight group (latent site) chosen by the Laplace evidence: mean "
        "(range) over seeds and members, beside the model's fixed default N(0, 3/sqrt(fan_in)) "
        "of that site.",
        "",
        "| data set | method | site | default scale | evidence's scale | ratio | fits |",
        "|---|---|---|---:|---:|---:|---:|",
        *lines,
    ]


def _mola_goal(groups: dict[str, dict[str, list[dict]]], method: str) -> list[str]:
    """The goal line of one MoLA row (see ``laplace_reading``), or none."""
    verdicts, nll_met = [], 0
    for name, methods in groups.items():
        if method not in methods or "ensemble-batched" not in methods:
            continue
        seeds = {r["seed"] for r in methods[method]} & {
            r["seed"] for r in methods["ensemble-batched"]
        }
        if not seeds:
            continue
        new = [r for r in methods[method] if r["seed"] in seeds]
        ens = [r for r in methods["ensemble-batched"] if r["seed"] in seeds]

        def mean(group: list[dict], key: str) -> float:
            return float(np.mean([r[key] for r in group]))

        def sd(group: list[dict], key: str) -> float:
            return float(np.std([r[key] for r in group], ddof=1)) if len(group) > 1 else 0.0

        misses = []
        nll_ok = mean(new, "nll") <= mean(ens, "nll")
        nll_met += nll_ok
        if not nll_ok:
            misses.append(f"NLL {fmt(mean(new, 'nll'))} vs {fmt(mean(ens, 'nll'))}")
        tolerance = max(sd(new, "auroc_entropy"), sd(ens, "auroc_entropy"))
        if mean(new, "auroc_entropy") < mean(ens, "auroc_entropy") - tolerance:
            misses.append(
                f"OOD AUROC {fmt(mean(new, 'auroc_entropy'))} vs "
                f"{fmt(mean(ens, 'auroc_entropy'))} (tolerance {fmt(tolerance)})"
            )
        ratio = max(r["ensemble_ratio"] for r in new)
        if ratio > MOLA_COST_RATIO:
            misses.append(f"fit up to {ratio:.2f}x the batched ensemble's seconds")
        if name == "digits" and mean(new, "ece") > mean(ens, "ece"):
            misses.append(f"ECE {fmt(mean(new, 'ece'))} vs {fmt(mean(ens, 'ece'))}")
        verdicts.append(
            f"{name}: " + ("met" if not misses else "missed: " + ", ".join(misses))
            + f" (fit {ratio:.2f}x the batched ensemble's at most)"
        )  # fmt: skip
    if not verdicts:
        return []
    return [
        f"- **{method} against the batched ensemble** (the goal: NLL at most the ensemble's on at "
        "least 2 data sets, OOD AUROC by entropy at least its minus the larger seed sd, at "
        f"<= {MOLA_COST_RATIO:g}x its fit seconds, ECE at most its on digits): NLL met on "
        f"{nll_met} of {len(verdicts)}; " + "; ".join(verdicts) + "."
    ]


def laplace_reading(groups: dict[str, dict[str, list[dict]]]) -> list[str]:
    """The issue's goal for each MoLA row (``mola``, ``mola-attention``) against
    ``ensemble-batched`` on the seeds both have (NLL at most the ensemble's on at least 2 data
    sets, OOD AUROC by entropy at least its minus the larger seed sd, at most
    ``MOLA_COST_RATIO`` x its fit seconds, ECE at most its on digits), and the Laplace rows'
    cost, evidence convergence and GLM-network disagreement."""
    lines = [
        line
        for method in LAPLACE_METHODS
        if method.startswith("mola")
        for line in _mola_goal(groups, method)
    ]
    rows = [r for methods in groups.values() for m in LAPLACE_METHODS for r in methods.get(m, [])]
    if rows:
        ratios = [r["ensemble_ratio"] for r in rows if r["ensemble_ratio"] is not None]
        converged = [c for r in rows for c in r["evidence_converged"]]
        disagreement = [r["glm_nn_disagreement"] for r in rows if r["glm_nn_disagreement"]]
        lines.append(
            f"- **Laplace rows** ({len(rows)}): the evidence's maximization converged in "
            f"{sum(bool(c) for c in converged)} of {len(converged)} fits"
            + (
                f"; fit {min(ratios):.2f}-{max(ratios):.2f}x the batched ensemble's seconds"
                if ratios
                else ""
            )
            + (
                f"; GLM against network predictive on training rows: mean total variation "
                f"{min(disagreement):.3g}-{max(disagreement):.3g}"
                if disagreement
                else ""
            )
            + "."
        )
    return lines
