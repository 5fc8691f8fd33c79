"""Run directories of ``probtransformer fit``: what they hold, writing one atomically, and
reading one back (``diagnose``, ``predict``, ``report``, ``generate``, ``serve``).

Below the CLI, so the report, the server and the CLI read runs without importing each other;
choosing and checking ``--out`` is the CLI's (``probtransformer.cli.out_dir``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from probtransformer._io import staged_directory

METRICS_FILE = "metrics.json"
POSTERIOR_DIR = "posterior"
INFERENCE_DATA_FILE = "inference_data.nc"
ATTENTION_FILE = "attention.png"
DIAGNOSTICS_FILE = "diagnostics.json"  # written by fit since format 1; older runs lack it
REPORT_FILE = "report.html"  # written by ``probtransformer report``, not by fit
#: Every run holds these; each task adds its own ``Task.files``.
COMMON_FILES = (
    METRICS_FILE,
    INFERENCE_DATA_FILE,
    POSTERIOR_DIR,
    ATTENTION_FILE,
    DIAGNOSTICS_FILE,
    REPORT_FILE,
)
DIAGNOSTICS_VERSION = 1
#: ``Posterior.diagnose``'s seed, as ``probtransformer diagnose`` uses it.
DIAGNOSTICS_SEED = 0


class RunWriteError(OSError):
    """A run directory could not be written; the directory it was to replace is left as it was.

    Attributes:
        path: the run directory (absolute).
        reason: the operating system's reason (``strerror``, else the error's text).
    """

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot write run directory {path}: {reason}")
        self.path = path
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Run:
    """A run directory read back.

    Attributes:
        path: the directory.
        record: its metrics.json.
        posterior: its ``Posterior`` (on CPU unless read onto another device).
    """

    path: Path
    record: dict
    posterior: Any

    def meta(self) -> dict:
        """The meta of the run's dataset (loaded from ``dataset`` and ``seed``)."""
        return run_data(self.record, self.path)[2]


def run_files() -> tuple[str, ...]:
    """Everything a run directory may hold, for every registered task (``fit --out`` replaces
    such a directory, nothing else)."""
    from probtransformer.tasks import TASKS

    files = dict.fromkeys(COMMON_FILES)
    for task in TASKS.values():
        files.update(dict.fromkeys(task.files))
    return tuple(files)


def is_run_dir(path: Path) -> bool:
    """``path`` holds a metrics.json and a posterior/ directory."""
    return (path / METRICS_FILE).is_file() and (path / POSTERIOR_DIR).is_dir()


def read_run(run_dir: str | Path, *, device: str = "cpu") -> Run:
    """The metrics.json and the posterior of ``run_dir``, on ``device`` (``load_posterior``'s).

    ``run_dir`` may also be a saved posterior: the ``OUT.posterior`` that ``fit`` keeps when
    its evaluation is interrupted or fails. Its record (the fit's settings, with the dataset,
    seed and class names ``fit`` adds) stands in for metrics.json.

    Raises:
        ValueError: neither a run directory nor a saved posterior, its metrics.json is not a
            JSON object or holds a table schema that is not one (``TableSchema.from_dict``),
            or ``device`` is CUDA where none is available.
    """
    from probtransformer.inference import load_posterior
    from probtransformer.inference.posterior.saving import META_FILE

    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ValueError(f"{run_dir} does not exist: give the directory that fit wrote")
    if not is_run_dir(run_dir) and (run_dir / META_FILE).is_file():
        post = load_posterior(run_dir, device=device)
        return Run(run_dir, dict(post.record), post)
    if not is_run_dir(run_dir):
        raise ValueError(
            f"{run_dir} is not a probtransformer run directory "
            f"(it needs {METRICS_FILE} and {POSTERIOR_DIR}/) or a saved posterior "
            f"(OUT.posterior, with {META_FILE})"
        )
    try:
        record = json.loads((run_dir / METRICS_FILE).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{run_dir / METRICS_FILE} is not valid JSON: {e}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{run_dir / METRICS_FILE} must hold a JSON object")
    if "table" in record:  # checked once here: predict, serve and report encode with it
        from probtransformer.data.table_schema import TableSchema

        try:
            TableSchema.from_dict(record["table"])
        except ValueError as e:
            raise ValueError(f"{run_dir / METRICS_FILE}, field 'table': {e}") from None
    return Run(run_dir, record, load_posterior(run_dir / POSTERIOR_DIR, device=device))


def run_data(record: dict, run_dir: str | Path):
    """``(test, train, meta)``: the run's test split, the training rows its fit saw (the first
    ``num_train`` rows of the training split of ``dataset`` with ``seed``) and the dataset's
    ``meta``.

    Raises:
        ValueError: metrics.json (a saved posterior's record) does not record dataset and
            seed, or records a ``num_train``
            outside the training split.
    """
    from probtransformer import datasets
    from probtransformer.inference.posterior.saving import META_FILE

    metrics_file = Path(run_dir) / METRICS_FILE
    if not metrics_file.is_file():  # a saved posterior (OUT.posterior): its record
        metrics_file = Path(run_dir) / META_FILE
    if "dataset" not in record or "seed" not in record:
        raise ValueError(f"{metrics_file} does not record dataset and seed")
    options = {}
    if record.get("val_fraction") is not None:
        options["val_fraction"] = record["val_fraction"]
    if "data" in record:  # fit --data: the table file again, checked unchanged
        splits = _table_splits(record, metrics_file, options)
    else:
        splits = datasets.load(record["dataset"], seed=record["seed"], **options)
    num_train = record.get("num_train", len(splits.train))
    if (
        isinstance(num_train, bool)
        or not isinstance(num_train, int)
        or not 1 <= num_train <= len(splits.train)
    ):
        raise ValueError(
            f"{metrics_file} records num_train {num_train!r}; the {record['dataset']} training "
            f"split has {len(splits.train)} rows"
        )
    return splits.test, splits.train[:num_train], splits.meta


def _table_splits(record: dict, metrics_file: Path, split_options: dict):
    """The splits of a ``fit --data`` run: its table file read again with the recorded
    options and seed.

    Raises:
        ValueError: the record's ``data`` is malformed, the file is gone, or its SHA-256
            differs from the fit's (the file changed).
    """
    from probtransformer.datasets.tables import file_sha256, from_table

    data = record["data"]
    options = ("target", "id", "time", "features", "task", "context", "horizon")
    keys = {"path", "sha256", *options}
    if not isinstance(data, dict) or set(data) != keys or not isinstance(data["path"], str):
        raise ValueError(f"{metrics_file}: 'data' must record {sorted(keys)}")
    path = Path(data["path"])
    if not path.is_file():
        raise ValueError(f"{metrics_file} records data file {path}, which no longer exists")
    if file_sha256(path) != data["sha256"]:
        raise ValueError(
            f"{path} changed since the fit ({metrics_file} records another SHA-256): its "
            "splits would not be the ones the run was fitted on"
        )
    table = {key: data[key] for key in options}
    return from_table(path, **table, seed=record["seed"], **split_options)


def diagnostic_rows(record: dict, train):
    """The training rows the run's log-likelihood covers: the first
    ``inference_data_rows["train"]`` for token-level tasks, else all."""
    rows = record.get("inference_data_rows", {}).get("train")
    return train if rows is None else train[:rows]


def next_free(default: Path) -> Path:
    """The first of ``default-2``, ``default-3``, ... that does not exist."""
    n = 2
    while (
        candidate := default.with_name(f"{default.name}-{n}")
    ).exists() or candidate.is_symlink():
        n += 1
    return candidate


def write_run(target: Path, post, splits, record: dict, draws: dict, task, evaluation) -> None:
    """Write every file of the run into a staging directory, then move it to ``target``.

    ``inference_data.nc`` (``task.inference_data_rows`` training and test rows, recorded in
    ``record``), ``posterior/``, ``attention.png`` of test example 0, the task's files from the
    predictions ``evaluation`` already holds, ``diagnostics.json`` and ``metrics.json``.

    Raises:
        RunWriteError: a file cannot be written (``target`` is left as it was).
    """
    from probtransformer import plots

    target = target.absolute()
    try:
        with staged_directory(target) as staging:
            test, train = splits.test, splits.train
            rows = task.inference_data_rows
            reused = evaluation.prediction  # the test predictions of the metrics, whole split
            if rows is not None:
                train, test = train[:rows], test[:rows]
                record["inference_data_rows"] = {"train": len(train), "test": len(test)}
                reused = None
            idata = post.to_inference_data(train, test=test, test_prediction=reused, **draws)
            idata.to_netcdf(str(staging / INFERENCE_DATA_FILE))
            post.save(staging / POSTERIOR_DIR)
            first = test[:1]
            attention = post.attention(first.x, first.mask, **draws)
            title = f"posterior attention, {record['dataset']} test example 0{evaluation.label}"
            plots.save_figure(attention.plot(0, title=title), staging / ATTENTION_FILE)
            evaluation.write(staging, record)
            write_diagnostics(staging / DIAGNOSTICS_FILE, post, train, draws, idata)
            (staging / METRICS_FILE).write_text(json.dumps(record, indent=1) + "\n")
    except OSError as e:
        raise RunWriteError(target, str(e.strerror or e)) from e


def _json_nested(value):
    """``value`` with every number through ``_json_number`` (dicts kept), or None."""
    if isinstance(value, dict):
        return {key: _json_nested(item) for key, item in value.items()}
    return _json_number(value)


def write_diagnostics(path: Path, post, train, draws: dict, idata=None) -> None:
    """Write ``Posterior.diagnose(train)`` to ``path`` as JSON.

    The object holds ``format_version``, ``seed``, ``num_train`` (the training rows of the
    log-likelihood), ``table`` (one record per variable group: ``variable``, ``size``,
    ``mean_sd``, ``r_hat_max``, ``ess_bulk_min``, ``ess_tail_min``; null where not defined),
    ``verdict`` (the printed lines), ``warnings`` (the lines flagged WARN), ``ok`` (no such
    line), ``loo`` (PSIS-LOO figures, or null), ``guide_k_hat`` (SVI, or null) and
    ``predictive`` (nested R-hat, R-hat and pooled bulk ESS of lp and of the probe
    log-likelihoods for runs with superchains, or null): the table
    and verdict ``probtransformer diagnose`` prints for the run. ``idata``, exported from the
    fit's ``draws`` (``num_samples``, ``seed``), is reused when those are diagnose's defaults.
    """
    if not _diagnose_defaults(post, draws):
        idata = None  # exported from other draws than diagnose's: export anew
    table = post.diagnose(train, verbose=False, seed=DIAGNOSTICS_SEED, idata=idata)
    verdict = list(table.attrs.get("verdict", []))
    warnings = [line for line in verdict if line.startswith("WARN")]
    rows = [
        {"variable": str(name), **{key: _json_number(value) for key, value in row.items()}}
        for name, row in table.to_dict(orient="index").items()
    ]
    loo = table.attrs.get("loo")
    diagnostics = dict(
        format_version=DIAGNOSTICS_VERSION,
        seed=DIAGNOSTICS_SEED,
        num_train=len(train),
        table=rows,
        verdict=verdict,
        warnings=warnings,
        ok=not warnings,
        loo=None if loo is None else {key: _json_number(value) for key, value in loo.items()},
        guide_k_hat=_json_number(table.attrs.get("guide_k_hat")),
        predictive=_json_nested(table.attrs.get("predictive")),
    )
    path.write_text(json.dumps(diagnostics, indent=1, allow_nan=False) + "\n")


def _diagnose_defaults(post, draws: dict) -> bool:
    """True when ``draws`` are the draws ``Posterior.diagnose`` takes by default: seed
    ``DIAGNOSTICS_SEED`` and every kept draw (sample-based) or ``DEFAULT_NUM_SAMPLES`` (SVI)."""
    from probtransformer.inference.posterior.draws import DEFAULT_NUM_SAMPLES

    every = DEFAULT_NUM_SAMPLES
    if post.samples is not None:
        every = math.prod(next(iter(post.samples.values())).shape[:2])
    num = draws.get("num_samples")
    return draws.get("seed", 0) == DIAGNOSTICS_SEED and num in (None, every)


def _json_number(value: Any) -> Any:
    """A table value for JSON: NaN/inf and None as null, NumPy scalars as Python numbers."""
    if value is None:
        return None
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
