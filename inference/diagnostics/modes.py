"""Diagnostics per mode: chains started from different ensemble members, judged one member at a
time.

Chains started from the members of a deep ensemble (``fit_mile``, ``fit_mcmc(init="ensemble")``)
sit in different modes of the posterior. Weight-space symmetries and the barriers between modes
of a neural network's posterior (Wiese et al. 2023; Sommer et al. 2024) mean that they are not
expected to mix, so nested R-hat across members, which asks them to, flags every such run. MILE
(Sommer et al. 2025) judges each member's chains on their own instead. Here:

- **within each mode**: R-hat and bulk ESS of ``lp`` and of the pointwise log-likelihoods of
  the first ``PROBE_OBS`` training rows, over that member's chains (one chain: split R-hat of
  its halves); the verdict wants R-hat below ``RHAT_MAX`` and ESS of at least
  ``ESS_PER_MODE_MIN`` in every mode;
- **between modes**, reported apart: how much the members' predictive distributions differ on
  the first ``SPREAD_ROWS`` training rows (the mutual information between member and label,
  and how often the members' predicted classes differ; for regression, the share of the
  predictive variance between the members' means).

When every mode converged, the posterior is read as an equally weighted mixture of the members'
local posteriors, which is what the predictions average over.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from probtransformer.inference.diagnostics._arviz import ess, rhat

#: Within-mode thresholds: R-hat (Vehtari et al. 2021) and bulk ESS per mode (the issue's 400).
RHAT_MAX = 1.01
ESS_PER_MODE_MIN = 400

#: Training rows whose log-likelihoods are checked per mode (as ``diagnostics.PROBE_OBS``).
PROBE_OBS = 20

#: Training rows on which the members' predictions are compared.
SPREAD_ROWS = 200


def by_mode(record: dict) -> bool:
    """Whether a sampled posterior's chains start from distinct ensemble members (one mode
    each), so that ``diagnose`` judges them per mode."""
    return record.get("method") == "mcmc" and record.get("init") == "ensemble"


def within_modes(idata, superchain: np.ndarray, site: str) -> dict:
    """Per-mode R-hat and bulk ESS of ``lp`` and of the probe log-likelihoods.

    Args:
        idata: ``InferenceData`` with ``sample_stats.lp`` and/or ``log_likelihood[site]``.
        superchain: ``(chain,)`` mode (start) of each chain.
        site: the likelihood site.

    Returns:
        ``{"modes": [{"mode", "chains", "lp": {"r_hat", "ess_bulk"}, "probe_log_lik": {...,
        "rows"}}, ...], "lp": worst, "probe_log_lik": worst}``: worst is the largest R-hat and
        the smallest ESS over the modes (and over the probe rows); a quantity that is missing,
        not finite or constant is left out.
    """
    quantities = {}
    if "sample_stats" in idata.groups() and "lp" in idata.sample_stats:
        lp = np.asarray(idata.sample_stats["lp"].transpose("chain", "draw").values, dtype=float)
        if np.isfinite(lp).all():
            quantities["lp"] = lp
    if "log_likelihood" in idata.groups() and site in idata.log_likelihood:
        ll = idata.log_likelihood[site].transpose("chain", "draw", ...).values[:, :, :PROBE_OBS]
        if ll.shape[2] and np.isfinite(ll).all():
            quantities["probe_log_lik"] = np.asarray(ll, dtype=float)
    modes = []
    for mode in np.unique(superchain):
        chains = superchain == mode
        row = {"mode": int(mode), "chains": int(chains.sum())}
        for name, values in quantities.items():
            figures = _figures(values[chains])
            if name == "probe_log_lik":
                figures["rows"] = values.shape[2]
            row[name] = figures
        modes.append(row)
    out: dict = {"modes": modes}
    for name in quantities:
        r_hats = [m[name]["r_hat"] for m in modes]
        esses = [m[name]["ess_bulk"] for m in modes]
        out[name] = dict(r_hat=_nan_max(r_hats), ess_bulk=_nan_min(esses))
        if name == "probe_log_lik":
            out[name]["rows"] = quantities[name].shape[2]
    return out


def _figures(values: np.ndarray) -> dict[str, float]:
    """Max R-hat and min bulk ESS of one mode's ``(chain, draw, ...)`` draws; a single chain
    is split into two halves for R-hat."""
    if values.shape[0] == 1:
        half = values.shape[1] // 2
        split = values[0, : 2 * half].reshape(2, half, *values.shape[2:])
        r_hat = rhat(split)
    else:
        r_hat = rhat(values)
    return dict(
        r_hat=_nan_max(np.atleast_1d(r_hat)), ess_bulk=_nan_min(np.atleast_1d(ess(values, "bulk")))
    )


def between_modes(posterior, data, superchain: np.ndarray, *, seed: int = 0) -> dict:
    """How much the members' predictions differ, on the first ``SPREAD_ROWS`` rows of
    ``data``, from every kept draw.

    Returns:
        Classification: ``{"rows", "mutual_information"`` (nats: the entropy of the mixture's
        predictive minus the mean entropy of the members' predictives, averaged over the rows;
        the part of the epistemic uncertainty that comes from the members differing),
        ``"disagreement"`` (share of rows where some member's most probable class differs from
        the mixture's)}. Regression: ``{"rows", "between_share"}``, the variance of the
        members' predictive means over the total predictive variance, averaged over the rows.
    """
    rows = data[: min(SPREAD_ROWS, len(data))]
    prediction = posterior.predict(rows.x, rows.mask, num_samples=None, seed=seed)
    chains = len(superchain)
    modes = np.unique(superchain)
    ids = torch.as_tensor(superchain)
    if hasattr(prediction, "probs"):
        probs = prediction.probs.double()  # (chains * draws, n, ..., C)
        probs = probs.reshape(chains, -1, *probs.shape[1:]).mean(1)  # per chain
        per_mode = torch.stack([probs[ids == m].mean(0) for m in modes])  # (M, n, ..., C)
        mixture = per_mode.mean(0)
        entropy = _entropy(mixture)
        mutual = (entropy - _entropy(per_mode).mean(0)).clamp_min(0.0)
        differs = (per_mode.argmax(-1) != mixture.argmax(-1)).any(0)
        return dict(
            rows=len(rows),
            mutual_information=float(mutual.mean()),
            disagreement=float(differs.double().mean()),
        )
    loc = prediction.loc.double()  # (chains * draws, n, ...)
    loc = loc.reshape(chains, -1, *loc.shape[1:])
    per_mode = torch.stack([loc[ids == m].flatten(0, 1).mean(0) for m in modes])
    total = prediction.std.double().square()  # (n, ...)
    share = per_mode.var(0, unbiased=False) / total.clamp_min(1e-300)
    return dict(rows=len(rows), between_share=float(share.mean()))


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * probs.clamp_min(1e-300).log()).sum(-1)


def verdict_lines(figures: dict, between: dict | None, flag) -> list[str]:
    """The verdict of a per-mode posterior: within-mode R-hat and ESS flagged, the spread
    between the modes as information, and the reading when every mode converged.

    Args:
        figures: ``within_modes``'s result.
        between: ``between_modes``'s result, or None (no data given).
        flag: ``diagnostics._flag``.
    """
    modes = figures["modes"]
    sizes = sorted({m["chains"] for m in modes})
    per = "/".join(str(s) for s in sizes)
    lines = [
        f"info  {len(modes)} modes (chains started from {len(modes)} ensemble members, {per} "
        "chain(s) each), judged one at a time: chains of different members are not expected "
        "to mix (weight symmetries; Sommer et al. 2025), so nested R-hat across them does not "
        "apply"
    ]
    converged = True
    for key, label in (("lp", "lp"), ("probe_log_lik", "the log-likelihoods of the first")):
        worst = figures.get(key)
        if worst is None:
            lines.append(
                f"n/a   within-mode R-hat and ESS of {'lp' if key == 'lp' else 'the probe rows'}"
                ": " + ("no finite lp recorded" if key == "lp" else "pass data to check them")
            )
            converged = False
            continue
        if key == "probe_log_lik":
            label = f"{label} {worst['rows']} training rows"
        r_hat, ess_bulk = worst["r_hat"], worst["ess_bulk"]
        if math.isnan(r_hat) or math.isnan(ess_bulk):
            lines.append(f"n/a   within-mode R-hat and ESS of {label}: under 4 draws per mode")
            converged = False
            continue
        bad = [m["mode"] for m in modes if not m[key]["r_hat"] <= RHAT_MAX]
        few = [m["mode"] for m in modes if not m[key]["ess_bulk"] >= ESS_PER_MODE_MIN]
        converged &= not bad and not few
        lines.append(
            flag(
                bool(bad),
                f"within-mode R-hat of {label}: max {r_hat:.3f} over the modes (flag > "
                f"{RHAT_MAX})" + (f"; modes {bad[:10]} over it" if bad else ""),
            )
        )
        lines.append(
            flag(
                bool(few),
                f"within-mode bulk ESS of {label}: min {ess_bulk:.0f} per mode (flag < "
                f"{ESS_PER_MODE_MIN})" + (f"; modes {few[:10]} under it" if few else ""),
            )
        )
    if between is not None:
        if "mutual_information" in between:
            spread = (
                f"mutual information between member and label {between['mutual_information']:.3g}"
                f" nats per row, most probable class differs between members on "
                f"{100 * between['disagreement']:.1f}% of rows"
            )
        else:
            spread = (
                f"{100 * between['between_share']:.1f}% of the predictive variance lies between "
                "the members' means"
            )
        lines.append(f"info  between modes (first {between['rows']} training rows): {spread}")
    if converged:
        lines.append(
            "ok    each mode converged; modes not mixed, treated as an equally weighted mixture"
        )
    else:
        lines.append(
            "WARN  not every mode converged: run longer (num_warmup, num_samples) before reading "
            "the mixture"
        )
    return lines


def _nan_max(values) -> float:
    finite = [v for v in np.ravel(values) if not math.isnan(v)]
    return float(max(finite)) if finite else math.nan


def _nan_min(values) -> float:
    finite = [v for v in np.ravel(values) if not math.isnan(v)]
    return float(min(finite)) if finite else math.nan


__all__ = ["between_modes", "by_mode", "verdict_lines", "within_modes"]
