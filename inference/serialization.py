"""Saving and loading posteriors: JSON metadata plus tensors read with ``weights_only=True``."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from probtransformer.datasets import SequenceData
from probtransformer.inference._runtime import pyro_scope, resolve_device
from probtransformer.inference.guides import build_guide
from probtransformer.inference.posterior import Posterior

#: Version of the on-disk layout written by ``save_posterior``.
FORMAT_VERSION = 1
_META = "posterior.json"
_TENSORS = "tensors.pt"


def save_posterior(posterior: Posterior, path: str | os.PathLike) -> None:
    """Write ``posterior`` to directory ``path`` (created; replaced atomically if present).

    Layout: ``posterior.json`` (format_version, model class path and config, method, guide kind,
    record) and ``tensors.pt`` (model and guide state dicts, draws, the example rows used to
    rebuild the guide) — tensors only, so loading never unpickles objects.
    """
    path = Path(path)
    model = posterior.model
    meta = {
        "format_version": FORMAT_VERSION,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": model.config,
        "guide": posterior.record.get("guide") if posterior.guide is not None else None,
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
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp makes 0700; give the directory the usual mode
    try:
        (staging / _META).write_text(json.dumps(meta, indent=1))
        torch.save(tensors, staging / _TENSORS)
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def load_posterior(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> Posterior:
    """Load a posterior written by ``Posterior.save``.

    Args:
        path: the directory.
        device: where to place the model (``"auto"`` for CUDA when available).

    Raises:
        FileNotFoundError: ``path`` is not a saved posterior.
        ValueError: written by a newer format version, or its model class cannot be imported.
    """
    path = Path(path)
    if not (path / _META).is_file() or not (path / _TENSORS).is_file():
        raise FileNotFoundError(f"{path} is not a saved posterior (no {_META} / {_TENSORS})")
    meta = json.loads((path / _META).read_text())
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {version!r}; this probtransformer reads versions "
            f"<= {FORMAT_VERSION}: upgrade probtransformer"
        )
    module_name, _, class_name = meta["model_class"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import model class {meta['model_class']!r}") from e
    model = (
        cls.from_config(meta["config"]) if hasattr(cls, "from_config") else cls(**meta["config"])
    )
    tensors = torch.load(path / _TENSORS, map_location="cpu", weights_only=True)
    model.load_state_dict(tensors["model_state"])
    device = resolve_device(device)
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
    return Posterior(model, record=meta["record"], example=example, guide=guide, samples=samples)
