"""The verdict lines of a Laplace approximation (``fit_laplace``, ``fit_mola``): is the
posterior precision well conditioned, did the evidence maximization converge, and does the
linearized (GLM) predictive agree with the sampled network?

Every line reads the run's record (``record["laplace"]``, one summary per member, and
``record["glm_nn_disagreement"]``; ``inference.laplace.fit.fit_laplace`` documents the keys),
so a saved and loaded posterior gets the same verdict; ``diagnostics.diagnose`` prints them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

#: Methods whose records these lines read.
LAPLACE_METHODS = ("laplace", "mola")

#: Largest condition number of the posterior precision ``G + diag(delta)`` that is trusted.
#: The draws are ``theta* + L^-T z`` with ``L`` its Cholesky factor in float64 (unit roundoff
#: ``u = 1.1e-16``); a triangular solve's relative error grows as ``kappa * u`` (Higham 2002,
#: "Accuracy and Stability of Numerical Algorithms", ch. 8 and 10), so at ``1e12`` the draws'
#: covariance is still right to about ``1e-4``, while towards ``1/u ~ 1e16`` the factorization
#: itself fails. Above it the directions the data barely constrain are set by roundoff.
CONDITION_NUMBER_MAX = 1e12

#: Largest mean total variation distance between the GLM and the sampled network's predictive
#: means on the training rows. 0.05 moves five percentage points of probability between
#: classes on an average row: as large as the calibration errors (ECE of a few percent) the
#: predictive is judged by, so above it the choice of predictive changes the answer more than
#: the comparisons it serves can resolve. For the last layer alone both agree up to roundoff.
DISAGREEMENT_MAX = 0.05


def is_laplace(record: dict) -> bool:
    """Whether ``record`` is a Laplace approximation's (``record["method"]`` in
    ``LAPLACE_METHODS``)."""
    return record.get("method") in LAPLACE_METHODS


def laplace_lines(
    record: dict, flag: Callable[[bool, str], str], model_scales: dict[str, float] | None = None
) -> list[str]:
    """Verdict lines of a Laplace posterior's record.

    - ``WARN`` a posterior precision whose condition number (``condition_number``, largest over
      smallest eigenvalue) is above ``CONDITION_NUMBER_MAX`` or not finite, naming the member;
    - ``WARN`` an evidence maximization (``prior_precision="marglik"``) that did not converge
      (``evidence_converged`` not True), naming the member and ``evidence_gradient``
      (``max |d log Z / d log delta|``, nats); a fixed prior precision (a number, or
      ``"prior"``) has no maximization, which the line says;
    - ``WARN`` ``glm_nn_disagreement`` above ``DISAGREEMENT_MAX``: the network is far from
      linear in the subset over the posterior's spread (``n/a`` when it is None: not a
      categorical likelihood);
    - ``info`` the prior scale ``1/sqrt(delta)`` of each site (over several members: median,
      min and max), beside the model's own prior scale where ``model_scales`` has it.

    Args:
        record: the posterior's record; ``record["laplace"]`` a list of one dict per member.
        flag: ``flag(bad, text)`` marks a line ``WARN`` or ``ok``.
        model_scales: ``{site: scale}`` of the model's own prior
            (``record["model_prior_scale"]``), or None.

    Returns:
        The lines; a single ``WARN`` line when ``record["laplace"]`` is missing or not a list
        of dicts (a record of another version, or edited by hand).
    """
    members = record.get("laplace")
    if not (isinstance(members, list) and members and all(isinstance(m, dict) for m in members)):
        return [
            f"WARN  record['laplace'] is not a list of one summary per member (got "
            f"{type(members).__name__}): the Laplace checks are skipped"
        ]
    several = len(members) > 1
    return [
        _conditioning_line(members, several, flag),
        _evidence_line(members, record.get("prior_precision"), several, flag),
        _disagreement_line(record.get("glm_nn_disagreement"), record.get("subset"), flag),
        *_scale_lines(members, record.get("prior_precision"), model_scales or {}),
    ]


def _who(k: int, several: bool) -> str:
    return f"member {k}" if several else "the posterior"


def _number(value) -> float | None:
    """``value`` as a float, or None when it is no real number (bool included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _conditioning_line(members: list[dict], several: bool, flag) -> str:
    numbers = [_number(m.get("condition_number")) for m in members]
    bad = [
        (k, c)
        for k, c in enumerate(numbers)
        if c is None or not math.isfinite(c) or c > CONDITION_NUMBER_MAX
    ]
    limit = f"(flag > {CONDITION_NUMBER_MAX:.0e} in float64)".replace("e+", "e")
    if bad:
        named = ", ".join(
            f"{_who(k, several)} {c:.3g}" if c is not None else f"{_who(k, several)} missing"
            for k, c in bad
        )
        return flag(
            True,
            f"condition number of the posterior precision: {named} {limit}: its Cholesky factor "
            "and the draws lose accuracy in the directions the data barely constrain; raise the "
            "prior precision, use hessian='diag' or a smaller subset",
        )
    worst = max(range(len(numbers)), key=lambda k: numbers[k])
    where = f" ({_who(worst, several)})" if several else ""
    return flag(
        False,
        f"condition number of the posterior precision: max {numbers[worst]:.3g}{where} {limit}",
    )


def _evidence_line(members: list[dict], setting, several: bool, flag) -> str:
    if setting != "marglik":
        what = (
            "the model's own prior ('prior')"
            if setting == "prior"
            else f"the number {setting!r}"
            if _number(setting) is not None
            else repr(setting)
        )
        return (
            f"n/a   evidence maximization: the prior precision was given as {what}, so none ran "
            "(not a failure); pass prior_precision='marglik' to choose it by the evidence"
        )
    named = []
    for k, m in enumerate(members):
        if m.get("evidence_converged") is not True:
            gradient = _number(m.get("evidence_gradient"))
            shown = f"{gradient:.3g}" if gradient is not None else repr(m.get("evidence_gradient"))
            named.append(f"{_who(k, several)} (gradient {shown})")
    if named:
        return flag(
            True,
            f"evidence maximization did not converge: {', '.join(named)} (max |d log Z / d log "
            "prior precision|, nats): its prior precision is not the evidence's maximum and its "
            "log evidence understates it; compare models by this evidence with care",
        )
    gradients = [_number(m.get("evidence_gradient")) or 0.0 for m in members]
    return flag(
        False,
        f"evidence maximization converged for {'every member' if several else 'the mode'} "
        f"(max gradient {max(gradients):.2g})",
    )


def _disagreement_line(value, subset, flag) -> str:
    label = "GLM against sampled-network predictive"
    if value is None:
        return f"n/a   {label}: measured for categorical likelihoods only"
    distance = _number(value)
    if distance is None or not math.isfinite(distance):
        return flag(True, f"{label}: recorded disagreement {value!r} is not a finite number")
    sites = ", ".join(subset) if isinstance(subset, list) else repr(subset)
    text = (
        f"{label}: mean total variation distance of the means on the training rows "
        f"{distance:.3g} (flag > {DISAGREEMENT_MAX})"
    )
    if distance > DISAGREEMENT_MAX:
        text += (
            f": the linearization is poor for the subset [{sites}]; the GLM and 'nn' "
            "predictives differ, so prefer a smaller subset (the last layer is linear) or check "
            "both on held-out data"
        )
    return flag(distance > DISAGREEMENT_MAX, text)


def _scale_lines(members: list[dict], setting, model_scales: dict[str, float]) -> list[str]:
    scales = [m.get("prior_scale") for m in members]
    if not all(isinstance(s, dict) and s for s in scales):
        return ["n/a   prior scale per site: not recorded"]
    source = "chosen by the evidence" if setting == "marglik" else "given"
    shown = []
    for site in scales[0]:
        values = sorted(v for s in scales if (v := _number(s.get(site))) is not None)
        notes = [f"{values[0]:.3g}-{values[-1]:.3g}"] if len(values) > 1 else []
        if site in model_scales:
            notes.append(f"model's prior {model_scales[site]:.3g}")
        value = f"{statistics.median(values):.3g}" if values else "?"
        shown.append(f"{site} {value}" + (f" ({'; '.join(notes)})" if notes else ""))
    over = f", median (min-max) over {len(members)} members" if len(members) > 1 else ""
    return [f"info  prior scale 1/sqrt(precision) per site, {source}{over}: " + "; ".join(shown)]


__all__ = [
    "CONDITION_NUMBER_MAX",
    "DISAGREEMENT_MAX",
    "LAPLACE_METHODS",
    "is_laplace",
    "laplace_lines",
]
