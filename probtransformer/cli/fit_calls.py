"""The library calls behind ``probtransformer fit``: the model's options and each inference
method's fit function (``fit_svi`` or its ``MAP_FITS`` or ``LAPLACE_FITS`` function,
``fit_mcmc``, ``fit_mile``) called with the options that were set; unset ones keep the library
defaults."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from probtransformer.cli._common import CLIError, given
from probtransformer.cli.options import LAPLACE_FITS, MAP_FITS


def _sibling(target: Path, suffix: str) -> Path:
    """``OUT<suffix>`` next to the run directory ``OUT`` (``--out .`` included)."""
    target = target.absolute()
    return target.with_name(target.name + suffix)


def _model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The model options that were set, with the attention priors of the --head-gates,
    --stochastic-attention and --local-window flags."""
    from probtransformer import priors

    specs = []
    if args.stochastic_attention:
        specs.append(priors.StochasticAttentionPrior())
    if args.local_window is not None:
        specs.append(
            priors.AttentionLogitPrior(priors.local_window(args.local_window, outside=0.01))
        )
    attention: dict[str, Any] = {}
    if specs:
        attention["attention_prior"] = (priors.LogitScalePrior(), *specs)
    if args.head_gates:
        attention["head_prior"] = priors.HeadGatePrior()
    return given(
        d_model=args.d_model,
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        d_ff=args.d_ff,
        dropout=args.dropout,
        bayesian=args.bayesian,
        **attention,
    )


def _fit_svi(
    model, train, args: argparse.Namespace, guide: str | None, target: Path, distributed: bool
):
    """svi: ``fit_svi``; map, mc-dropout, ensemble: their ``MAP_FITS`` function (fit_svi's
    settings without ``guide``; ensemble: ``n_members`` too); laplace, mola: their
    ``LAPLACE_FITS`` function (the same settings, for the MAP fit or the ensemble, and the
    Laplace options; ``check_applicable`` refused those the method does not read)."""
    from probtransformer import inference
    from probtransformer.inference.posterior.prediction import dropout_modules

    if args.inference == "mc-dropout" and not dropout_modules(model):
        raise CLIError(
            "--inference mc-dropout needs dropout in the model: give --dropout P with 0 < P < 1 "
            f"(this {type(model).__name__} has dropout {model.config.get('dropout')})"
        )
    if args.inference in MAP_FITS:
        fit, specific = getattr(inference, MAP_FITS[args.inference]), dict(n_members=args.n_members)
    elif args.inference in LAPLACE_FITS:
        fit = getattr(inference, LAPLACE_FITS[args.inference])
        specific = dict(
            n_members=args.n_members,
            subset=args.laplace_subset,
            hessian=args.hessian,
            prior_precision=args.prior_precision,
            predictive=args.predictive,
        )
    else:
        fit, specific = (
            inference.fit_svi,
            dict(guide=guide or args.guide, init_scale=args.init_scale),
        )
    checkpoint_dir = args.checkpoint_dir
    if args.checkpoint_every is not None and checkpoint_dir is None:
        checkpoint_dir = _sibling(target, ".checkpoint")
    return fit(
        model,
        train,
        seed=args.seed,
        progress=args.progress,
        **given(
            **specific,
            num_steps=args.num_steps,
            batch_size=args.batch_size,
            lr=args.lr,
            lr_decay=args.lr_decay,
            lr_warmup=args.lr_warmup,
            lr_schedule=args.lr_schedule,
            device=args.device,
            checkpoint_every=args.checkpoint_every,
            checkpoint_dir=checkpoint_dir,
            resume_from=args.resume_from,
            distributed=distributed or None,
        ),
    )


def _fit_mcmc(model, train, args: argparse.Namespace, distributed: bool):
    """``fit_mcmc`` with the kernel's and the starts' settings objects built from the MCMC
    options that were set (after the preset, only those that apply to the kernel); their
    ValueErrors (e.g. --num-starts not dividing --num-chains) reach the user as one line."""
    from probtransformer.inference import fit_mcmc
    from probtransformer.inference.mcmc.registry import KERNELS, MANY_CHAIN_KERNELS, STARTS

    kernel = _settings_object(KERNELS[args.kernel], args)
    starts = None
    if args.kernel in MANY_CHAIN_KERNELS:
        starts = _settings_object(STARTS[args.init or "prior"], args)
    return fit_mcmc(
        model,
        train,
        kernel=kernel,
        starts=starts,
        seed=args.seed,
        progress=args.progress,
        **given(
            num_chains=args.num_chains,
            num_warmup=args.num_warmup,
            num_samples=args.num_draws,
            map_steps=args.map_steps,
            device=args.device,
            distributed=distributed or None,
        ),
    )


def _settings_object(cls, args: argparse.Namespace):
    """``cls`` (a kernel's or starts' settings) with the options of its fields that were set."""
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**given(**{name: getattr(args, name, None) for name in names}))


def _fit_mile(model, train, args: argparse.Namespace):
    """``fit_mile``: the ensemble's settings are the SVI options (after the task's preset),
    the sampling's the MCMC options that apply and ``MILE_OPTIONS``."""
    from probtransformer.inference import fit_mile

    return fit_mile(
        model,
        train,
        seed=args.seed,
        progress=args.progress,
        **given(
            n_members=args.n_members,
            chains_per_member=args.chains_per_member,
            kernel=args.kernel,
            num_warmup=args.num_warmup,
            num_samples=args.num_draws,
            thinning=args.thinning,
            temperature=args.temperature,
            compile=args.compile,
            device=args.device,
            num_steps=args.num_steps,
            batch_size=args.batch_size,
            lr=args.lr,
            lr_decay=args.lr_decay,
            lr_warmup=args.lr_warmup,
            lr_schedule=args.lr_schedule,
        ),
    )
