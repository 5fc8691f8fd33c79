"""What ``probtransformer fit`` reports of a finished fit: the settings ``metrics.json`` records,
the warning line of a guide that kept no spread, and the summary it prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from probtransformer.cli._common import PROG
from probtransformer.cli.library_defaults import KERNEL_DEFAULTS, MANY_CHAIN_KERNELS
from probtransformer.methods import LAPLACE_BASED


def _collapse_line(post, seed: int) -> str | None:
    """``guide_checks.collapse_line`` of an SVI fit whose guide has kept no spread (its
    epistemic figures then mean nothing); None for other fits and for a guide with spread."""
    from probtransformer.inference.diagnostics.guide_checks import (
        SCALE_RATIO_MIN,
        collapse_line,
        guide_scale_ratio,
    )
    from probtransformer.inference.diagnostics.summary import _flag

    if post.guide is None or post.is_point_estimate or post.mc_dropout:
        return None
    ratio = guide_scale_ratio(post, seed=seed)
    if not ratio < SCALE_RATIO_MIN:  # NaN (no prior to compare with) included
        return None
    return collapse_line(ratio, post.record.get("init_scale"), _flag)


def _fit_settings(post) -> dict[str, Any]:
    """What metrics.json records of the fit itself, from the posterior's record."""
    record = post.record
    if record["method"] in LAPLACE_BASED:
        return _laplace_settings(record)
    if record["method"] == "mc-dropout":
        return dict(guide=record["guide"], num_steps=record["num_steps"], dropout=record["dropout"])
    if record["method"] == "ensemble":
        return dict(
            guide=record["guide"],
            num_steps=record["num_steps"],
            n_members=record["n_members"],
            batched=record.get("batched", False),  # False in runs saved before batching
            member_seeds=[member["seed"] for member in record["members"]],
            member_final_losses=[member["final_loss"] for member in record["members"]],
        )
    if record["method"] != "mcmc":
        return dict(
            guide=record["guide"],
            num_steps=record["num_steps"],
            batch_size=record["batch_size"],
            lr=record["lr"],
            lr_decay=record["lr_decay"],
            lr_warmup=record["lr_warmup"],
            lr_schedule=record["lr_schedule"],
        )
    chains, kept = next(iter(post.samples.values())).shape[:2]
    # no sample_stats: an interrupted worker process took them along (recorded as None)
    diverging = (record.get("sample_stats") or {}).get("diverging")
    kernel = record["kernel"]
    settings = dict(
        kernel=kernel,
        num_chains=record["num_chains"],
        num_warmup=record["num_warmup"],
        num_draws=record["num_samples"],
        temperature=record.get("temperature", 1.0),  # runs saved before tempering: 1
    )
    if record.get("route") == "mile":
        ensemble = record["ensemble"]
        settings.update(
            n_members=record["n_members"],
            chains_per_member=record["chains_per_member"],
            ensemble_num_steps=ensemble["num_steps"],
            ensemble_seconds=record["ensemble_seconds"],
        )
    # the kernel's own settings as the run recorded them (those older runs lack: left out)
    settings.update({k: record[k] for k in KERNEL_DEFAULTS.get(kernel, {}) if k in record})
    if kernel in MANY_CHAIN_KERNELS:
        settings.update(
            init=record["init"],
            num_starts=record["num_starts"],
            chain_gradients=record["chain_gradients"],
            # which density ran (runs saved before compiling: eager)
            density_path=record.get("density_path", "eager"),
            compile_seconds=record.get("compile_seconds", 0.0),
            # what warm-up adapted: step size, and ChEES's trajectory length or MCLMC's L
            **{key: value for key, value in record.items() if key.startswith("adapted_")},
        )
    return dict(
        **settings,
        partial=record["partial"],
        chains_kept=chains,
        draws_per_chain=kept,
        divergences=None if diverging is None else int(sum(map(sum, diverging))),
    )


def _laplace_settings(record: dict) -> dict[str, Any]:
    """What metrics.json records of a ``fit_laplace``/``fit_mola`` fit: the mode's fit, the
    Laplace settings, and per member (``record["laplace"]``) the log evidence (nats), the prior
    scale per latent site the evidence chose (beside ``model_prior_scale``, the model's own)
    and whether maximizing the evidence converged (None: the prior precision was fixed)."""
    members = record["laplace"]
    settings = dict(
        guide=record["guide"],
        num_steps=record["num_steps"],
        mode_method=record["mode_method"],
        laplace_subset=record["subset"],
        hessian=record["hessian"],
        prior_precision=record["prior_precision"],
        predictive=record["predictive"],
        laplace_draws=record["num_samples"],
        log_evidence=[member["log_evidence"] for member in members],
        prior_scale=[member["prior_scale"] for member in members],
        model_prior_scale=record["model_prior_scale"],
        evidence_converged=[member["evidence_converged"] for member in members],
        condition_number=[member["condition_number"] for member in members],
        glm_nn_disagreement=record["glm_nn_disagreement"],
        mode_seconds=record["mode_seconds"],
        laplace_seconds=record["laplace_seconds"],
    )
    if record["mode_method"] == "ensemble":
        settings.update(
            n_members=record["n_members"],
            member_seeds=[member["seed"] for member in record["members"]],
        )
    return settings


def _laplace_lines(record: dict) -> list[str]:
    """The lines ``fit`` prints of a Laplace fit: the log evidence per member, the prior scale
    the evidence chose per latent site (per member) beside the model's, and whether the
    evidence maximization converged."""
    evidence = ", ".join(f"{value:.1f}" for value in record["log_evidence"])
    lines = [f"  {'log evidence':<15}{evidence} nats" + _per_member(record)]
    chosen = "the evidence chose" if record["prior_precision"] == "marglik" else "fixed"
    for site, model_scale in record["model_prior_scale"].items():
        scales = ", ".join(f"{member[site]:.3g}" for member in record["prior_scale"])
        lines.append(f"  prior scale of {site}: {scales} ({chosen}); model {model_scale:.3g}")
    converged = record["evidence_converged"]
    if record["prior_precision"] != "marglik":
        lines.append(f"  evidence not maximized: --prior-precision {record['prior_precision']}")
    elif all(converged):
        lines.append(
            "  evidence maximization converged" + " for every member" * (len(converged) > 1)
        )
    else:
        failed = ", ".join(str(k + 1) for k, ok in enumerate(converged) if not ok)
        lines.append(
            f"WARN  evidence maximization did not converge (member {failed} of "
            f"{len(converged)}): its prior scales are the last iterate's"
        )
    return lines


def _per_member(record: dict) -> str:
    return " (per member)" if len(record["log_evidence"]) > 1 else ""


def _print_metrics(target: Path, record: dict, task, lines: list[str]) -> None:
    """The summary line, the task's ``printed_metrics``, its extra ``lines`` and where the run
    went."""
    if record["inference"] in ("mcmc", "mile"):
        how = (
            f"{record['kernel']}, {record['chains_kept']} chain(s) x {record['draws_per_chain']} "
            f"draws after {record['num_warmup']} warmup"
        )
        if record["inference"] == "mile":
            how += f", {record['chains_per_member']} per member of {record['n_members']}"
        elif record["kernel"] in MANY_CHAIN_KERNELS:
            how += f", {record['num_starts']} {record['init']} start(s)"
    elif record["inference"] == "ensemble":
        how = f"{record['n_members']} MAP members"
    elif record["inference"] in LAPLACE_BASED:
        members = len(record["log_evidence"])
        around = "a MAP fit" if members == 1 else f"{members} MAP members"
        how = (
            f"{record['hessian']} GGN of {len(record['laplace_subset'])} site(s) around "
            f"{around}, prior precision {record['prior_precision']}, {record['predictive']} "
            "predictive"
        )
    elif record["inference"] == "mc-dropout":
        how = f"MAP, dropout {', '.join(map(str, record['dropout']))} kept on"
    else:
        how = f"guide {record['guide']}"
    what = record["dataset"]
    if task.names_model:
        what += f" ({record['model']})"
    print(
        f"{what} · {record['inference']} ({how}) · "
        f"{record['num_train']} train / {record['num_test']} test · {record['seconds']:.1f} s fit"
    )
    if record.get("partial"):
        print(
            f"PARTIAL: sampling was interrupted; the run holds the {record['chains_kept']} x "
            f"{record['draws_per_chain']} draws kept of {record['num_chains']} x "
            f"{record['num_draws']} requested"
        )
    printed = [(key, unit) for key, unit in task.printed_metrics if key in record]
    width = max(15, *(len(key) + 1 for key, _ in printed))
    for key, unit in printed:
        print(f"  {key:<{width}}{record[key]:.4f}{unit}")
    for line in lines:
        print(line)
    if record["inference"] in LAPLACE_BASED:
        for line in _laplace_lines(record):
            print(line)
    if record["inference"] in ("mcmc", "mile"):
        divergences = record["divergences"]
        total = record["chains_kept"] * record["draws_per_chain"]
        print(f"  {'divergences':<15}{'?' if divergences is None else divergences} of {total}")
    print(f"wrote {target}")
    if record["inference"] in ("mcmc", "mile"):
        print(f"convergence (R-hat, ESS, E-BFMI): {PROG} diagnose {target}")
