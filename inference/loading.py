"""Loading a posterior written by ``Posterior.save`` (layout: ``inference.serialization``)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch

from probtransformer._io import read_versioned_json
from probtransformer.datasets import SequenceData
from probtransformer.inference._runtime import pyro_scope, resolve_device
from probtransformer.inference.guides import build_guide
from probtransformer.inference.posterior import Posterior
from probtransformer.inference.serialization import FORMAT_VERSION, META_FILE, TENSORS_FILE
from probtransformer.models.registry import model_from_config


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
    if not (path / META_FILE).is_file() or not (path / TENSORS_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a saved posterior (no {META_FILE} / {TENSORS_FILE})"
        )
    device = resolve_device(device)
    meta = read_versioned_json(path / META_FILE, FORMAT_VERSION)
    model = model_from_config(meta.get("model_class"), meta.get("config"), source=path)
    try:
        tensors = torch.load(path / TENSORS_FILE, map_location="cpu", weights_only=True)
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
            f"{path} holds a damaged saved posterior, or its {META_FILE} and {TENSORS_FILE} do not "
            f"match: {_first_line(e)}"
        ) from e


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
