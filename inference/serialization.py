"""Saving and loading posteriors: JSON metadata plus tensors read with ``weights_only=True``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from probtransformer._io import staged_directory
from probtransformer.models.registry import check_config, check_registered

#: Version of the on-disk layout written by ``save_posterior``.
FORMAT_VERSION = 1
META_FILE = "posterior.json"
TENSORS_FILE = "tensors.pt"


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
        others = sorted({p.name for p in target.iterdir()} - {META_FILE, TENSORS_FILE})
        if others:
            raise ValueError(
                f"refusing to replace {target}: it holds files that are not part of a saved "
                f"posterior ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
            )
    return target


def save_posterior(posterior, path: str | os.PathLike) -> None:
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
        "model_state": _owned(model.state_dict()),
        "guide_state": None if posterior.guide is None else _owned(posterior.guide.state_dict()),
        "samples": None if posterior.samples is None else _owned(posterior.samples),
        "example": _owned(
            {"x": posterior.example.x, "y": posterior.example.y, "mask": posterior.example.mask}
        ),
    }
    if posterior.members is not None:  # only then: saves of other posteriors keep their layout
        tensors["members"] = _owned(posterior.members)
    try:
        with staged_directory(target) as staging:
            (staging / META_FILE).write_text(json.dumps(meta, indent=1))
            torch.save(tensors, staging / TENSORS_FILE)
    except OSError as e:
        raise OSError(f"cannot save the posterior to {target}: {e.strerror or e}") from e


def _owned(tensors: dict) -> dict:
    """CPU copies with storage of their own: ``torch.save`` writes a view's whole storage, so the
    example row, a slice of the data set, would otherwise carry every training row with it."""
    return {k: None if v is None else v.detach().cpu().clone() for k, v in tensors.items()}
