"""MILE on the quality benchmark's classifier: the prior scale on the validation split, and the
convergence row (within-mode R-hat and ESS), factors against circuits.

Two studies, each in one process, one torch thread:

- ``--prior``: for each prior (``weight_prior`` of the latent parts: the library default
  ``Normal(3, fan_in=True)``, ``Normal(1, fan_in=True)``, ``Normal(0.5, fan_in=True)``, MILE's
  attention model's ``Normal(0.2, fan_in=False)``), a batched deep ensemble and ``fit_mile``
  from it, each scored on the validation split of digits (classes 8 and 9 held out, as
  ``benchmarks.quality``): NLL, accuracy, ECE and OOD AUROC (entropy) against the held-out
  rows; then the ablations of the default prior: the head alone latent, and temperatures
  below 1. The test split is never touched: this chooses the prior.
- ``--convergence``: ``fit_mile`` on all training digits (the quality benchmark's classifier,
  d_model 32, 4 heads, attention and head latent), with ``--members`` members of
  ``--chains-per-member`` chains, judged per mode as ``diagnose`` judges it: within-mode R-hat
  and bulk ESS of lp and of the first 20 training rows' log-likelihoods, the seconds; the
  factors and the circuits parameterization one after the other.

Reproduce::

    python -m benchmarks.studies.mile --prior                    # about an hour of one core
    python -m benchmarks.studies.mile --convergence              # up to 2 x 20 minutes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence

import torch

from benchmarks.quality import MODEL, evaluate, load_splits
from benchmarks.quality_fits import SETUPS
from benchmarks.studies.task_families import _patch
from probtransformer import datasets, priors
from probtransformer.datasets import SequenceData
from probtransformer.inference import fit_ensemble, fit_mile
from probtransformer.models import SequenceClassifier

#: The priors the validation study compares: label -> weight_prior.
PRIORS = {
    "Normal(3/sqrt(fan_in)) (default)": priors.Normal(3.0),
    "Normal(1/sqrt(fan_in))": priors.Normal(1.0),
    "Normal(0.5/sqrt(fan_in))": priors.Normal(0.5),
    "Normal(0.2)": priors.Normal(0.2, fan_in=False),
}
CIRCUITS = dict(attention_parameterization="circuits", attention_prior=None)
#: The temperatures of the ablation (default prior): how far a tempered posterior moves.
ABLATION_TEMPERATURES = (0.3, 0.1)


def validation_splits(name: str = "digits", seed: int = 0):
    """``(train, val, ood, num_classes)``: the quality benchmark's held-out classes, with a
    validation part carved from its training split."""
    splits = datasets.load(name, seed=seed, val_fraction=0.1, holdout_classes=SETUPS[name].holdout)
    patch = 1 if splits.train.mask is not None else math.ceil(splits.train.x.shape[1] / 50)
    train, val, ood = (
        _patch(part, patch) for part in (splits.train, splits.val, splits.meta["ood"])
    )
    return train, val, ood, len(splits.meta["class_names"])


def classifier(train: SequenceData, num_classes: int, **options) -> SequenceClassifier:
    return SequenceClassifier(
        train.x.shape[2], num_classes, train.x.shape[1], **{**MODEL, **options}
    )


def ensemble_settings(name: str, train: SequenceData) -> dict:
    setup = SETUPS[name]
    return dict(
        num_steps=setup.num_steps, lr=setup.lr, lr_decay=setup.lr_decay,
        batch_size=setup.batch_size or len(train),
    )  # fmt: skip


def prior_study(
    *, members: int, chains: int, warmup: int, draws: int, thinning: int, seed: int
) -> list[dict]:
    """The rows of ``--prior`` (see the module docstring), then two ablations on the default
    prior: the head alone latent (the rest each member's point estimates), and MILE at
    temperatures ``ABLATION_TEMPERATURES`` (a tempered posterior: how far from the ensemble
    the Bayesian one sits)."""
    train, val, ood, classes = validation_splits()
    rows = []
    variants = [(label, {"weight_prior": spec}, 1.0) for label, spec in PRIORS.items()]
    variants.append(("default prior, head alone latent", {"bayesian": ("head",)}, 1.0))
    default = next(iter(PRIORS))
    variants += [(default, {}, t) for t in ABLATION_TEMPERATURES]
    ensembles = {}
    for label, options, temperature in variants:
        model = classifier(train, classes, **options)
        key = json.dumps(model.config, sort_keys=True)
        if key not in ensembles:  # the temperatures share the default prior's ensemble
            start = time.perf_counter()
            ensembles[key] = fit_ensemble(
                model, train, n_members=members, seed=seed, progress=False,
                **ensemble_settings("digits", train),
            )  # fmt: skip
            scores = evaluate(ensembles[key], val, ood, None, seed)
            seconds = time.perf_counter() - start
            rows.append(dict(variant=label, method="ensemble", seconds=seconds, **scores))
            print(json.dumps(rows[-1]), flush=True)
        post = fit_mile(
            model, train, ensemble=ensembles[key], chains_per_member=chains, num_warmup=warmup,
            num_samples=draws, thinning=thinning, temperature=temperature, seed=seed,
            progress=False,
        )  # fmt: skip
        scores = evaluate(post, val, ood, None, seed)
        record = post.record
        stats = {k: torch.tensor(v) for k, v in record["sample_stats"].items()}
        rows.append(
            dict(variant=label, method="mile", temperature=temperature,
                 seconds=record["seconds"], **scores,
                 energy_error_var_per_dim=record["energy_error_var_per_dim_by_start"],
                 divergences=int(stats["diverging"].sum()))
        )  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def convergence(
    parameterization: str, *, members: int, chains: int, warmup: int, draws: int,
    thinning: int, seed: int, weight_prior: priors.Normal,
) -> dict:  # fmt: skip
    """The convergence row of one parameterization (see the module docstring)."""
    data = load_splits("digits", seed, None)
    train, test = data.train, data.test
    options = CIRCUITS if parameterization == "circuits" else {}
    model = classifier(train, len(data.class_names), weight_prior=weight_prior, **options)
    start = time.perf_counter()
    post = fit_mile(
        model, train, n_members=members, chains_per_member=chains, num_warmup=warmup,
        num_samples=draws, thinning=thinning, seed=seed, progress=False,
        **ensemble_settings("digits", train),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    table = post.diagnose(train, verbose=False)
    figures = table.attrs["modes"]
    scores = evaluate(post, test, data.ood, 200, seed)
    return dict(
        parameterization=parameterization,
        latents=sum(v[0, 0].numel() for v in post.samples.values()),
        members=members,
        chains_per_member=chains,
        num_warmup=warmup,
        num_draws=draws,
        thinning=thinning,
        seconds=seconds,
        ensemble_seconds=post.record["ensemble_seconds"],
        within_mode_r_hat_lp=figures["lp"]["r_hat"],
        within_mode_ess_lp=figures["lp"]["ess_bulk"],
        within_mode_r_hat_probe=figures["probe_log_lik"]["r_hat"],
        within_mode_ess_probe=figures["probe_log_lik"]["ess_bulk"],
        between_modes=figures["between"],
        verdict=table.attrs["verdict"],
        energy_error_var_per_dim=post.record["energy_error_var_per_dim_by_start"],
        adapted_step_size=post.record["adapted_step_size"],
        adapted_L=post.record["adapted_L"],
        **{f"test_{k}": v for k, v in scores.items()},
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.mile")
    parser.add_argument("--prior", action="store_true", help="the prior-scale study")
    parser.add_argument("--convergence", action="store_true", help="the convergence row")
    parser.add_argument("--members", type=int, default=5)
    parser.add_argument("--chains-per-member", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--thinning", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scale", type=float, default=3.0, help="--convergence: weight_prior scale (fan-in)"
    )
    parser.add_argument(
        "--parameterizations", nargs="+", default=["factors", "circuits"],
        help="--convergence: which to run",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    before = os.getloadavg()[0]
    sizes = dict(
        members=args.members, chains=args.chains_per_member, warmup=args.warmup,
        draws=args.draws, thinning=args.thinning, seed=args.seed,
    )  # fmt: skip
    if args.prior:
        prior_study(**sizes)
    if args.convergence:
        for parameterization in args.parameterizations:
            row = convergence(parameterization, weight_prior=priors.Normal(args.scale), **sizes)
            print(json.dumps(row, indent=1, default=str), flush=True)
    print(f"load average {before:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
