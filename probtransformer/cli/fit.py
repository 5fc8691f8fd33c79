"""``probtransformer fit``: fit the model of the dataset's task, measure the test split and write
the run directory (or keep the fitted posterior next to it when that fails). The library calls
are built in ``cli.fit_calls``; what the run records and prints of the fit, in
``cli.fit_summary``."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import warnings
from pathlib import Path

from probtransformer.cli._common import PROG, CLIError, given, warn
from probtransformer.cli.fit_calls import _fit_mcmc, _fit_mile, _fit_svi, _model_options, _sibling
from probtransformer.cli.fit_summary import _collapse_line, _fit_settings, _print_metrics
from probtransformer.cli.options import (
    DISTRIBUTED_INFERENCE,
    INFERENCE_GUIDES,
    MANY_CHAIN_KERNELS,
    check_applicable,
    with_mcmc_preset,
    with_mile_preset,
    with_svi_preset,
)
from probtransformer.cli.out_dir import out_directory
from probtransformer.cli.threads import fit_threads, intra_op_threads
from probtransformer.rundir import is_run_dir, next_free, write_run


def run(args: argparse.Namespace) -> int:
    """Fit, evaluate on the test split, write the run directory and print the metrics.

    Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment) the process joins the
    process group, and the fit is data-parallel SVI (``fit_svi(distributed=True)``) or, for
    the many-chain kernels, sharded chains (``fit_mcmc(distributed=True)``); rank 0 evaluates,
    writes the run and prints, the other ranks exit 0 after the fit.

    Returns:
        The exit status: 0, or 130 when MCMC sampling was interrupted (Ctrl-C) and the run
        holds the draws kept so far (``partial``; a line on stderr says so at once).

    Raises:
        KeyboardInterrupt: Ctrl-C after the fit, while the run is evaluated or written: nothing
            is written to the run directory, and the fitted posterior is saved next to it
            (``OUT.posterior``, or ``OUT.posterior-2`` ... when that exists; loaded by
            ``inference.load_posterior``) so the fit is not lost.
        FloatingPointError: the SVI fit diverged; its last finite state is kept the same way.
    """
    from probtransformer.tasks import TASKS, task_for_dataset

    splits = _table_splits(args)  # --data: read and checked before anything is written
    task = task_for_dataset(args.dataset if splits is None else splits.meta)
    check_applicable(args, task, TASKS)
    guide = INFERENCE_GUIDES.get(args.inference)
    if guide is not None and args.guide not in (None, guide):
        raise CLIError(
            f"--inference {args.inference} fits guide {guide!r}; got --guide {args.guide}"
        )
    name = args.dataset + ("" if args.model == "auto" else f"-{args.model}")
    if args.out is not None and not args.out.strip():
        raise CLIError("--out must name a directory, got an empty string")
    target = out_directory(
        args.out, Path("runs") / f"{name}-{args.inference}", overwrite=args.overwrite
    )
    asked_batch_size = args.batch_size  # before the preset fills it in
    threads_from = "--threads" if args.threads is not None else None  # or the preset's
    if args.inference == "mcmc":
        from probtransformer.tasks._tokens import TokenTask

        args = with_mcmc_preset(args, jit=not isinstance(task, TokenTask))
    elif args.inference == "mile":
        args = with_mile_preset(args, task.fit_preset)
    else:
        args = with_svi_preset(args, task.fit_preset)
    if threads_from is None and args.threads is not None:
        threads_from = f"the {args.inference} preset"
    args.threads_from = threads_from
    parallel = _joined_process_group(args)
    try:
        return _run(args, task, guide, target, parallel, asked_batch_size, splits)
    finally:
        if parallel is not None:
            import torch.distributed

            torch.distributed.destroy_process_group()


#: ``fit``'s options that describe ``--data``'s table (``datasets.tables.from_table``'s).
TABLE_OPTIONS = ("target", "id", "time", "features", "task", "context", "horizon")


def _table_splits(args: argparse.Namespace):
    """``--data``'s ``DatasetSplits`` (``datasets.tables.from_table``), or None for
    ``--dataset`` (filled in: digits); ``args.dataset`` becomes the file's name.

    Raises:
        CLIError: --data with --dataset, or a table option without --data, or --data without
            --target.
        ValueError: the table's own checks (file, column and row named).
    """
    table = {name: getattr(args, name) for name in TABLE_OPTIONS}
    if args.data is None:
        given_ = [f"--{name}" for name, value in table.items() if value is not None]
        if given_:
            verb = "describes" if len(given_) == 1 else "describe"
            raise CLIError(f"{', '.join(given_)} {verb} --data FILE, which was not given")
        args.dataset = args.dataset or "digits"
        return None
    if args.dataset is not None:
        raise CLIError(f"give --data or --dataset, not both (got --dataset {args.dataset})")
    if args.target is None:
        raise CLIError("--data needs --target COL, the column to predict")
    from probtransformer.datasets.tables import file_sha256, from_table

    path = Path(args.data)
    splits = from_table(path, **table, seed=args.seed)
    args.dataset = path.stem
    splits.meta["data"] = {"path": str(path.absolute()), "sha256": file_sha256(path), **table}
    return splits


def _joined_process_group(args: argparse.Namespace):
    """This process's ``DataParallel`` when ``torchrun`` started it, else None.

    Raises:
        CLIError: an inference method that data-parallel SVI does not cover.
    """
    if not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return None
    sharded = args.inference == "mcmc" and args.kernel in MANY_CHAIN_KERNELS
    if args.inference not in DISTRIBUTED_INFERENCE and not sharded:
        kernels = " or ".join(MANY_CHAIN_KERNELS)
        raise CLIError(
            f"under torchrun, --inference must be one of {', '.join(DISTRIBUTED_INFERENCE)} "
            f"(data-parallel SVI) or mcmc with --kernel {kernels} (sharded chains), not "
            f"{args.inference}"
            + (f" with --kernel {args.kernel}" if args.inference == "mcmc" else "")
        )
    from probtransformer.inference._runtime import resolve_device
    from probtransformer.inference.distributed import init_from_environment

    parallel = init_from_environment(resolve_device(args.device or "auto").type)
    if not parallel.is_main:  # every rank runs the same code: rank 0 says it once
        warnings.filterwarnings("ignore")
    return parallel


def _run(
    args: argparse.Namespace,
    task,
    guide: str | None,
    target: Path,
    parallel,
    asked_batch_size: int | None,
    splits=None,
) -> int:
    """``run`` after the checks: load (unless ``--data`` gave ``splits``), fit, evaluate,
    write and print (rank 0 only)."""
    import torch

    from probtransformer import datasets
    from probtransformer.inference.inputs import check_inputs

    if splits is None:
        splits = datasets.load(args.dataset, seed=args.seed)
    meta = splits.meta
    if args.num_train is not None:
        if args.num_train > len(splits.train):
            raise CLIError(
                f"--num-train {args.num_train} exceeds the {len(splits.train)} rows of the "
                f"{args.dataset} training split"
            )
        splits = dataclasses.replace(splits, train=splits.train[: args.num_train])
    if asked_batch_size is not None and asked_batch_size > len(splits.train):
        warn(
            f"--batch-size {asked_batch_size} exceeds the {len(splits.train)} training rows: "
            "every step uses all of them"
        )
    from probtransformer.models._config import FIT_COPIES, memory_use

    with memory_use(FIT_COPIES, "fitting"):  # a model too large to fit is refused unbuilt
        model = task.build_model(meta, _model_options(args), model=args.model)
    threads, threads_chosen = fit_threads(args, model, splits.train)
    if args.progress and (parallel is None or parallel.is_main):  # the progress's first line
        print(
            f"{PROG}: fitting on {threads} CPU thread{'s' * (threads != 1)} ({threads_chosen})",
            file=sys.stderr,
            flush=True,
        )
    with intra_op_threads(threads):
        start = time.perf_counter()
        if args.inference == "mcmc":
            post = _fit_mcmc(model, splits.train, args, parallel is not None)
        elif args.inference == "mile":
            post = _fit_mile(model, splits.train, args)
        else:  # svi, the MAP-based fits and the Laplace fits around them
            try:
                post = _fit_svi(model, splits.train, args, guide, target, parallel is not None)
            except FloatingPointError as e:  # NonFiniteELBOError: keep its last finite state
                last = getattr(e, "posterior", None)
                if last is None or (parallel is not None and not parallel.is_main):
                    raise
                _describe(last, args, splits, meta)
                kept = _kept_fit(last, target, "the fit diverged", "its last finite state")
                raise FloatingPointError(f"{e}; {kept}") from e
        seconds = time.perf_counter() - start
        if parallel is not None and not parallel.is_main:
            return 0
        _describe(post, args, splits, meta)
        partial = bool(post.record.get("partial"))
        if partial:  # said at once: the predictions take a while before the run is written
            print(
                f"{PROG}: sampling was interrupted; evaluating and writing the draws kept so "
                "far (Ctrl-C again stops, keeping only the posterior next to the run directory)",
                file=sys.stderr,
                flush=True,
            )
        try:  # a Ctrl-C from here on, or an error of the evaluation, keeps the fit (_kept_fit)
            try:
                draws = given(num_samples=_prediction_draws(post, args.num_samples), seed=args.seed)
                test = splits.test  # validated once, with its targets: later passes reuse it
                check_inputs(post.model, test.x, test.y, test.mask)
                evaluation = task.evaluate(post, splits, draws)
            except Exception as e:  # out of memory for the draws, say: minutes of fit kept
                message = _kept_fit(
                    post, target, f"the fit finished, but evaluating it failed ({e})"
                )
                if isinstance(e, (ValueError, TypeError, OSError, RuntimeError, MemoryError)):
                    raise CLIError(message) from e
                e.add_note(message)  # a bug: its traceback, and where the fit is
                raise
            record = dict(
                **evaluation.metrics,
                num_train=len(splits.train),
                num_test=len(splits.test),
                **evaluation.sizes,
                seconds=seconds,
                dataset=args.dataset,
                task=task.name,
                model=type(model).__name__,
                val_fraction=meta["val_fraction"],
                inference=args.inference,
                **_fit_settings(post),
                **given(world_size=post.record.get("world_size")),  # under torchrun
                num_samples=evaluation.num_samples,
                seed=args.seed,
                device=str(post.device),
                threads=torch.get_num_threads(),
                threads_chosen=threads_chosen,
            )
            record |= _data_record(meta)
            collapse = _collapse_line(post, args.seed)
            if collapse is not None:  # said with the metrics, not only by diagnose
                record["warnings"] = [*record.get("warnings", []), collapse]
            if not args.overwrite and is_run_dir(target):  # another fit wrote it meanwhile
                taken, target = target, next_free(target)
                warn(f"{taken} received another run during this fit; writing {target} instead")
            write_run(target, post, splits, record, draws, task, evaluation)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(_kept_fit(post, target)) from None
    _print_metrics(target, record, task, [*evaluation.lines, *([collapse] if collapse else [])])
    return 130 if partial else 0


def _kept_path(target: Path) -> Path:
    """Where a Ctrl-C after the fit keeps the fitted posterior: ``OUT.posterior``, or the first
    free ``OUT.posterior-2``, ``-3``, ... (nothing there is replaced)."""
    kept = _sibling(target, ".posterior")
    return next_free(kept) if kept.exists() or kept.is_symlink() else kept


def _describe(post, args: argparse.Namespace, splits, meta: dict) -> None:
    """Add to ``post.record`` what predict and serve need of a posterior kept without its run
    (``OUT.posterior``)."""
    post.record |= dict(dataset=args.dataset, seed=args.seed, num_train=len(splits.train))
    post.record["val_fraction"] = meta["val_fraction"]
    post.record |= _data_record(meta)


def _data_record(meta: dict) -> dict:
    """What a run records of its data beyond dataset and seed: the class names, and for
    ``--data`` the file, its options and the table schema (``run_data``, ``predict``)."""
    return {key: meta[key] for key in ("class_names", "data", "table") if key in meta}


def _kept_fit(
    post,
    target: Path,
    cause: str = "interrupted after the fit",
    what: str = "the fitted posterior",
) -> str:
    """Save ``post`` to ``_kept_path(target)`` after a Ctrl-C, or an error, during the
    evaluation, or the last finite state of a diverged fit; the message saying what happened
    (``cause``) and where ``what`` is (or why it could not be kept)."""
    kept = _kept_path(target)
    try:
        post.save(kept)
    except (OSError, ValueError) as e:
        return f"{cause}; nothing was written, and the fit was lost: {e}"
    except KeyboardInterrupt:
        return f"{cause}, and interrupted while keeping it; nothing was written"
    return (
        f"{cause}; nothing was written to {target}, and {what} "
        f"is kept in {kept} (probtransformer.inference.load_posterior loads it)"
    )


def _prediction_draws(post, num_samples: int | None) -> int | None:
    """``--num-samples``; unset: every kept draw of a sampled posterior, None (the library
    default) for SVI."""
    if num_samples is None and post.samples is not None:
        return math.prod(next(iter(post.samples.values())).shape[:2])  # chains x draws
    return num_samples
