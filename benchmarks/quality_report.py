"""The quality benchmark's tables, reading and plot (``benchmarks.quality``): one table per data
set (mean ± sd over seeds, the best mean in bold), statements computed from the rows, and the
OOD AUROC against NLL plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from benchmarks._suite import Context, fmt, mean_spread
from benchmarks.quality import (
    BAYESIAN,
    CHEAP,
    CHEES_METHODS,
    COLUMNS,
    DIGITS,
    ECE_BINS,
    METHODS,
    MILE_METHODS,
    MODEL,
    NAME,
    NUTS_MODEL,
    STOCHASTIC_KL_WEIGHT,
    VERDICT,
    row_keys,
)
from benchmarks.quality_fits import (
    CHEES_COST_RATIO,
    ENSEMBLE_MEMBERS,
    FULL,
    MILE_COST_RATIO,
    QUICK,
)
from benchmarks.quality_laplace import (
    LAPLACE_METHODS,
    MOLA_COST_RATIO,
    laplace_reading,
    prior_scale_table,
)


def _groups(rows: dict[str, dict], ctx: Context) -> dict[str, dict[str, list[dict]]]:
    """``{dataset: {method: [rows over seeds]}}`` in ``row_keys`` order, measured rows only."""
    groups: dict[str, dict[str, list[dict]]] = {}
    for key in row_keys(ctx):
        if key in rows:
            row = rows[key]
            groups.setdefault(row["dataset"], {}).setdefault(row["method"], []).append(row)
    return groups


def _values(group: list[dict], key: str) -> list[float]:
    return [row[key] for row in group if row.get(key) is not None]


def _mean(group: list[dict], key: str) -> float | None:
    values = _values(group, key)
    return float(np.mean(values)) if values else None


def _sd(group: list[dict], key: str) -> float:
    values = _values(group, key)
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _best(methods: dict[str, list[dict]], key: str, higher: bool, names=METHODS) -> str | None:
    """The method of ``names`` with the best mean of ``key`` (None when none has one)."""
    means = {m: _mean(methods[m], key) for m in names if m in methods}
    means = {m: v for m, v in means.items() if v is not None}
    if not means:
        return None
    return (max if higher else min)(means, key=means.get)


def _setting_line(name: str, methods: dict[str, list[dict]]) -> str:
    """What the data set's rows ran: sizes, held-out classes, fit settings."""
    optimised = next((g[0] for m, g in methods.items() if m not in ("nuts", *CHEES_METHODS)), None)
    any_row = next(iter(methods.values()))[0]
    held_out = any_row["holdout_classes"]
    parts = [
        f"**{name}**: class{'es' if len(held_out) > 1 else ''} {', '.join(held_out)} held out; "
        f"{any_row['num_test']:,} test / {any_row['num_ood']:,} OOD rows"
    ]
    if any_row["patch"] > 1:
        parts.append(f"patches of {any_row['patch']} steps ({any_row['tokens']} tokens)")
    if optimised is not None:
        s = optimised["settings"]
        parts.append(
            f"{optimised['num_train']:,} training rows, {optimised['planned_steps']:,} steps of "
            f"batch {s['batch_size']} at lr {s['lr']:g} (decaying to {s['lr'] * s['lr_decay']:g})"
        )
    if "nuts" in methods:
        n = methods["nuts"][0]
        parts.append(
            f"NUTS: {n['num_train']} training rows, 1 chain of {n['settings']['num_warmup']} + "
            f"{n['planned_draws']} transitions, tree depth <= {n['settings']['max_tree_depth']}"
        )
    for method in CHEES_METHODS:
        if method not in methods:
            continue
        group = methods[method]
        c = group[0]["settings"]

        def span(key: str, group: list[dict] = group) -> str:
            low, high = (f(r["settings"][key] for r in group) for f in (min, max))
            return f"{low}" if low == high else f"{low}-{high}"

        parts.append(
            f"{method}: {group[0]['num_train']:,} training rows, {c['num_chains']} chains from "
            f"{c['num_starts']} MAP starts (map_steps {span('map_steps')}), {span('num_warmup')} + "
            f"{span('num_samples')} transitions per chain"
        )
    for method in LAPLACE_METHODS:
        if method in methods:
            s = methods[method][0]["settings"]
            parts.append(
                f"{method}: {s['subset']} ({s['hessian']} GGN) around "
                f"{methods[method][0]['num_members']} {s['mode_method']} mode(s), "
                f"{s['num_samples']} draws"
            )
    return "; ".join(parts) + "."


def _table(methods: dict[str, list[dict]]) -> list[str]:
    """Mean ± sd over seeds per method; the best mean of each column in bold."""
    lines = [
        "| method | " + " | ".join(title for _, title, _, _ in COLUMNS) + " | seeds |",
        "|---|" + "---:|" * (len(COLUMNS) + 1),
    ]
    best = {}
    for key, _, digits, higher in COLUMNS:
        winner = _best(methods, key, higher)
        best[key] = None if winner is None else round(_mean(methods[winner], key), digits)
    for method, group in methods.items():
        cells = []
        for key, _, digits, _ in COLUMNS:
            text = mean_spread(_values(group, key), digits)
            mean = _mean(group, key)
            if mean is not None and len(methods) > 1 and round(mean, digits) == best[key]:
                text = f"**{text}**"
            cells.append(text)
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {len(group)} |")
    return lines


def _verdict(groups: dict[str, dict[str, list[dict]]]) -> str | None:
    """Best Bayesian method against best cheap one, per data set and ``VERDICT`` metric. A lead
    is clear when it exceeds the larger sd over seeds of the two (both need 2+ seeds)."""
    columns = {key: (title, up) for key, title, _, up in COLUMNS}
    ahead = {"Bayesian": 0, "cheap": 0}
    clear: dict[str, list[str]] = {"Bayesian": [], "cheap": []}
    compared = 0
    for name, methods in groups.items():
        for key in VERDICT:
            title, higher = columns[key]
            bayes = _best(methods, key, higher, BAYESIAN)
            cheap = _best(methods, key, higher, CHEAP)
            if bayes is None or cheap is None:
                continue
            compared += 1
            b, c = _mean(methods[bayes], key), _mean(methods[cheap], key)
            if b == c:
                continue
            bayes_ahead = (b > c) == higher
            side = "Bayesian" if bayes_ahead else "cheap"
            win, lose = (bayes, cheap) if bayes_ahead else (cheap, bayes)
            ahead[side] += 1
            pair = (methods[bayes], methods[cheap])
            seeded = all(len(_values(group, key)) > 1 for group in pair)
            if seeded and abs(b - c) > max(_sd(group, key) for group in pair):
                digits = DIGITS[key]
                clear[side].append(
                    f"{name} {title} {win} {fmt(_mean(methods[win], key), digits)} vs {lose} "
                    f"{fmt(_mean(methods[lose], key), digits)}"
                )
    if not compared:
        return None
    parts = [
        f"the {side} one is ahead in {ahead[side]}, clearly in {len(clear[side])}"
        + (f" ({'; '.join(clear[side])})" if clear[side] else "")
        for side in ahead
    ]
    return (
        "- **Bayesian vs cheap.** The best Bayesian method (SVI, NUTS, ChEES, MILE, Laplace) "
        "against the best cheap one (MAP, MC dropout, ensemble) on NLL, ECE, Brier, OOD AUROC "
        "by entropy and AURC, "
        f"{compared} comparisons (data set x metric; clearly: by more than the larger sd over "
        f"seeds of the two): {'; '.join(parts)}."
    )


def _reading(groups: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Statements computed from the rows (each only where its rows exist)."""
    lines = []
    verdict = _verdict(groups)
    if verdict:
        lines.append(verdict)
    best = []
    for name, methods in groups.items():
        nll, auroc = _best(methods, "nll", False), _best(methods, "auroc_entropy", True)
        best.append(
            f"{name}: NLL {nll} ({fmt(_mean(methods[nll], 'nll'))}), OOD AUROC {auroc} "
            f"({fmt(_mean(methods[auroc], 'auroc_entropy'))})"
        )
    lines.append("- **Best per data set.** " + "; ".join(best) + ".")
    pairs = [
        (name, method)
        for name, methods in groups.items()
        for method, group in methods.items()
        if _mean(group, "auroc_epistemic") is not None
    ]
    if pairs:
        better = [
            f"{name} {method}"
            for name, method in pairs
            if _mean(groups[name][method], "auroc_epistemic")
            > _mean(groups[name][method], "auroc_entropy")
        ]
        lines.append(
            f"- **Epistemic part vs total entropy as OOD score.** The epistemic part is the "
            f"better score in {len(better)} of {len(pairs)} (data set, method) pairs"
            + (f" ({', '.join(better)})" if better else "")
            + "; MAP has no epistemic part (one draw)."
        )
    ratios = {}
    for methods in groups.values():
        if "map" in methods:
            for method, group in methods.items():
                ratios.setdefault(method, []).append(
                    _mean(group, "fit_seconds") / _mean(methods["map"], "fit_seconds")
                )
    if len(ratios) > 1:
        lines.append(
            "- **Cost.** Fit seconds relative to MAP on the same data set, mean over data sets: "
            + ", ".join(f"{m} {np.mean(r):.1f}x" for m, r in ratios.items() if m != "map")
            + "."
        )
    nuts = [row for methods in groups.values() for row in methods.get("nuts", [])]
    if nuts:
        depth = max(row["settings"]["max_tree_depth"] for row in nuts)
        at_cap = np.mean([row["share_at_max_depth"] for row in nuts])
        gaps = [
            f"{name} {fmt(_mean(m['nuts'], 'accuracy'))} vs {fmt(_mean(m['map'], 'accuracy'))}"
            for name, m in groups.items()
            if "nuts" in m and "map" in m
        ]
        lines.append(
            f"- **NUTS** runs a smaller model (d_model {NUTS_MODEL['d_model']}, every part latent) "
            f"on at most {max(row['num_train'] for row in nuts)} training rows: {at_cap:.0%} of "
            f"its kept transitions hit the tree-depth cap ({depth}), with "
            f"{sum(row['divergences'] for row in nuts)} divergences over {len(nuts)} rows"
            + (f"; test accuracy against MAP: {'; '.join(gaps)}" if gaps else "")
            + "."
        )
    lines += [line for m in CHEES_METHODS if (line := _chees_reading(groups, m))]
    lines += [line for m in MILE_METHODS if (line := _mile_reading(groups, m))]
    if goal := _route_goal(groups):
        lines.append(goal)
    lines += laplace_reading(groups)
    cut = [
        f"{row['dataset']}/{row['method']}/{row['seed']}"
        for methods in groups.values()
        for group in methods.values()
        for row in group
        if row["budget_cut"]
    ]
    if cut:
        lines.append(
            f"- Cut short by the time budget (fewer steps or draws than planned): {', '.join(cut)}."
        )
    return lines


def _chees_reading(groups: dict[str, dict[str, list[dict]]], method: str) -> str | None:
    """ChEES against the ensemble on the seeds both have, the issue's goal per data set: mean
    NLL <= the ensemble's + tolerance, mean OOD AUROC (entropy) >= the ensemble's - tolerance
    (tolerance: the larger sd over seeds of the two, at least 0.005), every seed's fit within
    ``CHEES_COST_RATIO`` x the ensemble's fit seconds of the same process."""
    verdicts = []
    for name, methods in groups.items():
        seeds = {r["seed"] for r in methods.get(method, [])}
        seeds &= {r["seed"] for r in methods.get("ensemble", [])}
        if not seeds:
            continue
        new = [r for r in methods[method] if r["seed"] in seeds]
        ens = [r for r in methods["ensemble"] if r["seed"] in seeds]
        misses = []
        for key, title, sign in (("nll", "NLL", 1), ("auroc_entropy", "OOD AUROC", -1)):
            tolerance = max(_sd(new, key), _sd(ens, key), 0.005)
            a, b = _mean(new, key), _mean(ens, key)
            if sign * (a - b) > tolerance:
                misses.append(f"{title} {fmt(a)} vs {fmt(b)} (tolerance {fmt(tolerance)})")
        ratio = max(row["ensemble_ratio"] for row in new)
        if ratio > CHEES_COST_RATIO:
            misses.append(f"fit up to {ratio:.1f}x the ensemble's seconds")
        verdicts.append(
            f"{name} (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, sorted(seeds)))}): "
            + ("met" if not misses else "missed: " + ", ".join(misses))
            + f" (fit {ratio:.1f}x the ensemble's at most)"
        )
    rows = [row for methods in groups.values() for row in methods.get(method, [])]
    if not rows:
        return None
    # one step size per row, or one per superchain where the starts adapted apart
    steps = [float(v) for row in rows for v in np.atleast_1d(row["adapted_step_size"])]
    return (
        f"- **{method} against the ensemble** (the goal: mean NLL within, and mean OOD AUROC by "
        "entropy within, the larger seed sd of the two (at least 0.005) of the ensemble's, at "
        f"<= {CHEES_COST_RATIO:g}x its fit seconds): "
        + ("; ".join(verdicts) if verdicts else "no ensemble rows to compare")
        + f". Over {len(rows)} rows: {sum(r['divergences'] for r in rows)} divergent "
        f"transitions, mean acceptance {np.mean([r['mean_acceptance'] for r in rows]):.2f}, "
        f"adapted step size {min(steps):.2g}-{max(steps):.2g}, "
        f"{min(r['mean_leapfrog_steps_sampling'] for r in rows):.0f}-"
        f"{max(r['mean_leapfrog_steps_sampling'] for r in rows):.0f} leapfrog steps per kept "
        "transition, nested R-hat of the log density "
        f"{min(r['nested_rhat_lp'] for r in rows):.2f}-"
        f"{max(r['nested_rhat_lp'] for r in rows):.2f}."
    )


def _against_ensemble(methods: dict[str, list[dict]], method: str) -> tuple[list[str], float]:
    """How ``method`` misses the issue's goal against ``ensemble-batched`` on the seeds both
    have: mean NLL above the ensemble's, mean OOD AUROC (entropy) below it by more than the
    larger seed sd of the two, fit seconds over ``MILE_COST_RATIO`` x the batched ensemble's,
    or NLL above MAP's. Returns ``(misses, largest cost ratio)``."""
    seeds = {r["seed"] for r in methods.get(method, [])}
    seeds &= {r["seed"] for r in methods.get("ensemble-batched", [])}
    new = [r for r in methods[method] if r["seed"] in seeds]
    ens = [r for r in methods["ensemble-batched"] if r["seed"] in seeds]
    misses = []
    nll, ens_nll = _mean(new, "nll"), _mean(ens, "nll")
    if nll > ens_nll:
        misses.append(f"NLL {fmt(nll)} vs {fmt(ens_nll)}")
    auroc, ens_auroc = _mean(new, "auroc_entropy"), _mean(ens, "auroc_entropy")
    tolerance = max(_sd(new, "auroc_entropy"), _sd(ens, "auroc_entropy"))
    if auroc < ens_auroc - tolerance:
        misses.append(f"OOD AUROC {fmt(auroc)} vs {fmt(ens_auroc)} (tolerance {fmt(tolerance)})")
    ratio = max(row["ensemble_ratio"] for row in new)
    if ratio > MILE_COST_RATIO:
        misses.append(f"fit up to {ratio:.1f}x the batched ensemble's seconds")
    if "map" in methods and nll > _mean(methods["map"], "nll"):
        misses.append(f"NLL above MAP's {fmt(_mean(methods['map'], 'nll'))}")
    return misses, ratio


def _mile_reading(groups: dict[str, dict[str, list[dict]]], method: str) -> str | None:
    """A MILE row against the batched ensemble, per data set (``_against_ensemble``)."""
    verdicts = []
    for name, methods in groups.items():
        if method not in methods or "ensemble-batched" not in methods:
            continue
        misses, ratio = _against_ensemble(methods, method)
        verdicts.append(
            f"{name}: " + ("met" if not misses else "missed: " + ", ".join(misses))
            + f" (fit {ratio:.1f}x the batched ensemble's)"
        )  # fmt: skip
    rows = [row for methods in groups.values() for row in methods.get(method, [])]
    if not rows or not verdicts:
        return None
    r_hats = [row["within_mode_r_hat_lp"] for row in rows]
    esses = [row["within_mode_ess_lp"] for row in rows]
    return (
        f"- **{method} against the batched ensemble** (the goal: mean NLL at most the "
        "ensemble's, mean OOD AUROC by entropy at least the ensemble's minus the larger seed sd, "
        f"at <= {MILE_COST_RATIO:g}x the batched ensemble's fit seconds, NLL at most MAP's): "
        + "; ".join(verdicts)
        + f". Over {len(rows)} rows: within-mode R-hat of lp {min(r_hats):.2f}-"
        f"{max(r_hats):.2f}, within-mode bulk ESS of lp {min(esses):.0f}-{max(esses):.0f}, "
        f"{sum(r['divergences'] for r in rows)} divergent transitions."
    )


def _route_goal(groups: dict[str, dict[str, list[dict]]]) -> str | None:
    """The issue's acceptance: the best sampled route (NUTS, ChEES or MILE, by mean NLL) meets
    the goal against the batched ensemble on at least 2 of the 3 data sets."""
    routes = ("nuts", *CHEES_METHODS, *MILE_METHODS)
    lines = []
    met = 0
    for name, methods in groups.items():
        if "ensemble-batched" not in methods:
            continue
        best = _best(methods, "nll", False, routes)
        if best is None:
            continue
        misses, _ = _against_ensemble(methods, best)
        met += not misses
        lines.append(f"{name} {best}: " + ("met" if not misses else ", ".join(misses)))
    if not lines:
        return None
    return (
        f"- **The sampled route against the batched ensemble** (the best sampled route per data "
        f"set by NLL; the goal: met on at least 2 data sets): met on {met} of {len(lines)} "
        f"({'; '.join(lines)})."
    )


def markdown(rows: dict[str, dict], ctx: Context) -> str:
    """One table per data set (mean ± sd over seeds, best mean in bold) and the reading."""
    groups = _groups(rows, ctx)
    sizes = QUICK if ctx.quick else FULL
    out = [
        "Are the Bayesian fits' uncertainties better than the cheap alternatives? Classes held "
        "out of training are the OOD inputs. Mean ± sd over seeds; best mean of each column in "
        f"bold. NLL in nats; ECE with {ECE_BINS} equal-width bins; AURC: area under the "
        "risk-coverage "
        "curve, test rows accepted by increasing predictive entropy (lower is better); OOD "
        "AUROC: test rows against held-out rows, scored by total predictive entropy or its "
        f"epistemic part (mutual information). Predictions from {sizes.draws} draws (ensemble: "
        f"{ENSEMBLE_MEMBERS} members; NUTS: its kept draws; ChEES: its kept draws, each chain "
        f"thinned evenly to {sizes.draws} / K when there are more; MAP: one). Every method but "
        "NUTS fits the same classifier "
        f"(d_model {MODEL['d_model']}, {MODEL['num_heads']} heads, {MODEL['num_layers']} layer, "
        f"d_ff {MODEL['d_ff']}, dropout {MODEL['dropout']}); `svi-stochastic` adds stochastic "
        f"attention (kl_weight {STOCHASTIC_KL_WEIGHT}); `chees` makes every part latent, "
        "dropout 0; `chees-perchain` samples the classifier's own latent parts (attention, head) "
        "and each chain keeps its MAP start's point estimates; both may take "
        f"{CHEES_COST_RATIO:g}x the (sequential) ensemble's fit seconds; `ensemble-batched` fits "
        "the ensemble's members as one batched optimisation; `mile` (MILE, `fit_mile`) starts "
        "MCLMC chains from the batched ensemble's members, tuned per member with MILE's warm-up, "
        "`chees-permember` ChEES chains, `mile-circuits` MCLMC on the circuit-parameterized "
        "classifier (per-head W_QK, W_OV; its own ensemble); their fit seconds count the "
        "ensemble's. `laplace` (`fit_laplace`, last layer, full GGN) and `laplace-attention` "
        "(attention projections, diagonal GGN) sit around the MAP fit, `mola` around every "
        "member of the batched ensemble, each with the prior precision per site chosen by the "
        "Laplace evidence and the linearized (GLM) predictive; their fit seconds count the "
        f"MAP's or the ensemble's (MoLA's goal: <= {MOLA_COST_RATIO:g}x the batched ensemble's). "
        "`benchmarks/quality.py` documents the details.",
        "",
    ]
    for name, methods in groups.items():
        out += [_setting_line(name, methods), "", *_table(methods), ""]
    if groups:
        out += _reading(groups)
        if scales := prior_scale_table(groups):
            out += ["", *scales]
    missing: dict[str, list[str]] = {}  # "dataset/method": seeds not measured
    for key in row_keys(ctx):
        if key not in rows:
            prefix, seed = key.rsplit("/", 1)
            missing.setdefault(prefix, []).append(seed)
    if missing:
        listed = ", ".join(f"{p} (seed {', '.join(s)})" for p, s in missing.items())
        out += ["", f"Not measured yet: {listed}; `python -m benchmarks.run --only {NAME}`."]
    return "\n".join(out)


def plot(rows: dict[str, dict], ctx: Context) -> list[Path]:
    """OOD AUROC (entropy) against NLL per method, one panel per data set, seed sd as bars."""
    groups = _groups(rows, ctx)
    if not groups:
        return []
    fig = Figure(figsize=(4 * len(groups), 3.8), layout="constrained")
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    markers = dict(zip(METHODS, "os^D*8pHdXx+<>vP1", strict=True))
    for ax, (name, methods) in zip(axes, groups.items(), strict=True):
        for method, group in methods.items():
            ax.errorbar(
                _mean(group, "nll"),
                _mean(group, "auroc_entropy"),
                xerr=_sd(group, "nll"),
                yerr=_sd(group, "auroc_entropy"),
                marker=markers[method],
                linestyle="none",
                capsize=3,
                label=method,
            )
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on short ranges
        ax.set_xlabel("test NLL (nats, log scale)")
        ax.set_ylabel("OOD AUROC, predictive entropy")
        ax.set_title(name)
    axes[0].legend(fontsize="small")
    path = ctx.cache(NAME).with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return [path]
