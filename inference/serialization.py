"""Saving and loading posteriors: JSON metadata plus tensors read with ``weights_only=True``."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import torch

from probtransformer._io import read_versioned_json, replace_directory
from probtransformer.datasets import SequenceData
from probtransformer.inference._runtime import pyro_scope, resolve_device
from probtransformer.inference.guides import build_guide
from probtransformer.inference.posterior import Posterior
from probtransformer.models.registry import check_config, check_registered, model_from_config

#: Version of the on-disk layout written by ``save_posterior``.
FORMAT_VERSION = 1
_META = "posterior.json"
_TENSORS = "tensors.pt"


def _save_target(path: str | os.PathLike) -> Path:
    """Check that ``path`` may become (or be replaced by) a saved posterior.

    Raises:
        TypeError: ``path`` is not a str or path.
        ValueError: ``path`` exists and is not a directory holding only a saved posterior.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    target = Path(path).absolute()
    if target.exists():
        if not target.is_dir():
            raise ValueError(f"cannot save a posterior to {target}: it exists and is a file")
        others = sorted({p.name for p in target.iterdir()} - {_META, _TENSORS})
        if others:
            raise ValueError(
                f"refusing to replace {target}: it holds files that are not part of a saved "
                f"posterior ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
            )
    return target


def save_posterior(posterior: Posterior, path: str | os.PathLike) -> None:
    """Write ``posterior`` to directory ``path``.

    Layout: ``posterior.json`` (format_version, model class path and config, method, guide kind,
    ``mc_dropout``, record) and ``tensors.pt`` (model and guide state dicts, draws, the example
    rows used to rebuild the guide and, for ensembles, ``members``: each member's model
    parameters) — tensors only, so loading never unpickles objects. Files are written to
    a staging directory next to ``path`` and moved into place at the end; an existing saved
    posterior at ``path`` is replaced, anything else there is never deleted.

    The model's class must be registered (a built-in model, or decorated with
    ``probtransformer.models.register_model``): loading rebuilds only registered classes.

    Raises:
        TypeError: ``path`` is not a str or path.
        ValueError: ``path`` is a file, or a directory holding other files; the model's class is
            not registered; the model cannot be rebuilt from its config (keys that are not its
            constructor's arguments, a callable attention guidance). Nothing is written then.
        OSError: the directory cannot be written (the message names ``path``).
    """
    target = _save_target(path)
    model = posterior.model
    check_registered(type(model))
    check_config(type(model), model.config)
    if hasattr(type(model), "from_config"):
        type(model).from_config(model.config)  # fail now, not at load time (callable priors)
    meta = {
        "format_version": FORMAT_VERSION,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": model.config,
        "guide": posterior.record.get("guide") if posterior.guide is not None else None,
        "mc_dropout": posterior.mc_dropout,
        "record": posterior.record,
    }
    tensors = {
        "model_state": {k: v.cpu() for k, v in model.state_dict().items()},
        "guide_state": (
            None
            if posterior.guide is None
            else {k: v.cpu() for k, v in posterior.guide.state_dict().items()}
        ),
        "samples": (
            None
            if posterior.samples is None
            else {k: v.cpu() for k, v in posterior.samples.items()}
        ),
        "example": {
            "x": posterior.example.x,
            "y": posterior.example.y,
            "mask": posterior.example.mask,
        },
    }
    if posterior.members is not None:  # only then: saves of other posteriors keep their layout
        tensors["members"] = {k: v.cpu() for k, v in posterior.members.items()}
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp makes 0700; give the directory the usual mode
        (staging / _META).write_text(json.dumps(meta, indent=1))
        torch.save(tensors, staging / _TENSORS)
        replace_directory(staging, target)
    except OSError as e:
        raise OSError(f"cannot save the posterior to {target}: {e.strerror or e}") from e
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def load_posterior(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> Posterior:
    """Load a posterior written by ``Posterior.save``.

    Tensors are read with ``torch.load(weights_only=True)``: no object is ever unpickled. The
    model is rebuilt by ``probtransformer.models.registry.model_from_config``: only a registered
    model class is built, and nothing named by the files is imported.

    Args:
        path: the directory.
        device: where to place the model (``"auto"`` for CUDA when available).

    Raises:
        TypeError: ``path`` is not a str or path.
        FileNotFoundError: ``path`` is not a saved posterior.
        ValueError: written by a newer format version, its model class is not registered
            (the message says how to register it), its config does not fit that class, or its
            files are damaged or do not match each other.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if not (path / _META).is_file() or not (path / _TENSORS).is_file():
        raise FileNotFoundError(f"{path} is not a saved posterior (no {_META} / {_TENSORS})")
    device = resolve_device(device)
    meta = read_versioned_json(path / _META, FORMAT_VERSION)
    model = model_from_config(meta.get("model_class"), meta.get("config"), source=path)
    try:
        tensors = torch.load(path / _TENSORS, map_location="cpu", weights_only=True)
        model.load_state_dict(tensors["model_state"])
        model = model.to(device)
        example = SequenceData(**tensors["example"])
        guide = None
        if tensors["guide_state"] is not None:
            record = meta["record"]
            guide = build_guide(meta["guide"], model, init_scale=record.get("init_scale", 1e-3))
            ex = example.to(device)
            with pyro_scope(), torch.no_grad():
                guide(ex.x, ex.y, ex.mask)  # creates the parameters, then overwrite them
            guide.load_state_dict(tensors["guide_state"])
            guide.to(device)
        samples = tensors["samples"]
        if samples is not None:
            samples = {k: v.to(device) for k, v in samples.items()}
        members = tensors.get("members")  # absent from saves before ensembles, and non-ensembles
        if members is not None:
            members = {k: v.to(device) for k, v in members.items()}
        return Posterior(
            model,
            record=meta["record"],
            example=example,
            guide=guide,
            samples=samples,
            members=members,
            mc_dropout=meta.get("mc_dropout", False),
        )
    except (RuntimeError, pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path} holds a damaged saved posterior, or its {_META} and {_TENSORS} do not "
            f"match: {_first_line(e)}"
        ) from e


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
