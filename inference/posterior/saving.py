"""Saving and loading posteriors: JSON metadata plus tensors read with ``weights_only=True``.

``save_posterior`` writes the layout (``FORMAT_VERSION``); ``load_posterior`` reads it back
without unpickling any object or importing anything the files name."""

from __future__ import annotations

import json
import math
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from probtransformer._io import read_versioned_json, staged_directory
from probtransformer.data import SequenceData
from probtransformer.inference._runtime import pyro_scope, resolve_device
from probtransformer.inference.vi.guides import build_guide
from probtransformer.models.registry import check_config, check_registered, model_from_config

if TYPE_CHECKING:
    from probtransformer.inference.posterior.posterior import Posterior

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
    if posterior.source.modes is not None:  # Laplace's GLM predictive
        tensors["modes"] = _owned(posterior.source.modes)
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


def load_posterior(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> Posterior:
    """Load a posterior written by ``Posterior.save``.

    Tensors are read with ``torch.load(weights_only=True)``: no object is ever unpickled. The
    model is rebuilt by ``probtransformer.models.registry.model_from_config``: only a registered
    model class is built, and nothing named by the files is imported.

    Args:
        path: the directory ``Posterior.save`` wrote, or a run directory of
            ``probtransformer fit`` (its ``posterior/``).
        device: where to place the model (``"auto"`` for CUDA when available).

    Raises:
        TypeError: ``path`` is not a str or path.
        FileNotFoundError: ``path`` is not a saved posterior.
        ValueError: written by a newer format version, its model class is not registered
            (the message says how to register it), its config does not fit that class, or its
            files are damaged or do not match each other.
    """
    from probtransformer.inference.posterior.posterior import Posterior  # it imports this module

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if not _is_saved(path) and _is_saved(path / RUN_POSTERIOR_DIR):  # a run directory
        path = path / RUN_POSTERIOR_DIR
    if not _is_saved(path):
        raise FileNotFoundError(
            f"{path} is not a saved posterior (no {META_FILE} / {TENSORS_FILE})"
        )
    device = resolve_device(device)
    meta = read_versioned_json(path / META_FILE, FORMAT_VERSION)
    if not isinstance(meta.get("record"), dict):
        raise ValueError(
            f"{path / META_FILE}: 'record' must be a JSON object, got "
            f"{type(meta.get('record')).__name__}"
        )
    tensors = _read_tensors(path / TENSORS_FILE)
    _check_shapes(meta, tensors, path)  # before the model is built: a config cannot allocate
    model = model_from_config(meta.get("model_class"), meta.get("config"), source=path)
    try:
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
        x_range = meta["record"].get("x_range")
        if x_range is not None and not (
            isinstance(x_range, list)
            and len(x_range) == 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in x_range)
            and all(math.isfinite(v) for v in x_range)  # NaN would turn the range warning off
            and x_range[0] <= x_range[1]
        ):
            raise ValueError(f"record.x_range must be finite [low, high], got {x_range!r}")
        samples = tensors["samples"]
        if samples is not None:
            samples = {k: v.to(device) for k, v in samples.items()}
        members, modes = (
            None if tensors.get(key) is None else {k: v.to(device) for k, v in tensors[key].items()}
            for key in ("members", "modes")  # absent from saves of other methods
        )
        return Posterior(
            model,
            record=meta["record"],
            example=example,
            guide=guide,
            samples=samples,
            members=members,
            modes=modes,
            mc_dropout=meta.get("mc_dropout", False),
        )
    except (RuntimeError, pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path} holds a damaged saved posterior, or its {META_FILE} and {TENSORS_FILE} do not "
            f"match: {_first_line(e)}"
        ) from e


#: Where a run directory of ``probtransformer fit`` keeps its posterior.
RUN_POSTERIOR_DIR = "posterior"


def _is_saved(path: Path) -> bool:
    """``path`` holds the two files of ``Posterior.save``."""
    return (path / META_FILE).is_file() and (path / TENSORS_FILE).is_file()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _read_tensors(path: Path) -> dict:
    """``torch.load(weights_only=True)`` of ``path``: tensors and plain containers only.

    Raises:
        ValueError: the file holds pickled objects, or is not a torch file at all.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's advice to unpickle is not for strangers
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not zipfile.is_zipfile(path):  # torch.save writes a zip archive
            raise ValueError(f"{path} is not a saved posterior's tensors (not a torch file)") from e
        raise ValueError(
            f"{path} holds pickled objects, not only tensors: refused (a saved posterior is "
            "tensors; loading never unpickles objects)"
        ) from e
    except (KeyError, IndexError, ValueError) as e:  # torch's legacy reader on another format
        raise ValueError(f"{path} is not a saved posterior's tensors (not a torch file)") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{path} is not a saved posterior's tensors: {_first_line(e)}") from e
    if not isinstance(tensors, dict) or not isinstance(tensors.get("model_state"), dict):
        raise ValueError(f"{path} is not a saved posterior's tensors (no model_state)")
    for name, value in _named_tensors(tensors):  # fits keep their last finite state
        if value.is_floating_point() and value.isnan().any():
            raise ValueError(f"{path} is damaged: {name} holds NaN")
    return tensors


def _named_tensors(tree: object, prefix: str = ""):
    """``(name, tensor)`` of the tensors in nested dicts and lists (``name``: the keys' path)."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _named_tensors(value, f"{prefix}[{key!r}]" if prefix else str(key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from _named_tensors(value, f"{prefix}[{i}]")


def _check_shapes(meta: dict, tensors: dict, path: Path) -> None:
    """Build the model on PyTorch's ``meta`` device (shapes, no memory) and compare its
    parameter shapes with the saved ones, so a config that asks for huge sizes is refused
    before anything is allocated. Models whose construction needs values (e.g. a guidance prior
    checked with ``.item()``) cannot be built on ``meta``; their shapes are checked by
    ``load_state_dict`` after the build.

    Raises:
        ValueError: the config's shapes differ from the saved tensors' (naming the first).
    """
    _check_layer_counts(meta.get("config"), tensors["model_state"], path)
    try:
        with torch.device("meta"):
            skeleton = model_from_config(meta.get("model_class"), meta.get("config"), source=path)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return  # not buildable on meta, or not at all: the real build below says why
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    saved = {k: tuple(v.shape) for k, v in tensors["model_state"].items()}
    if expected != saved:
        key = next(k for k in sorted(set(expected) | set(saved)) if expected.get(k) != saved.get(k))
        raise ValueError(
            f"{path}: its {META_FILE} config does not match its {TENSORS_FILE}: {key!r} would "
            f"have shape {expected.get(key)} but the saved tensor has {saved.get(key)}"
        )


#: Config keys that count layers, and the state-dict prefix of their layers.
_LAYER_COUNTS = {"num_layers": "encoder.layers.", "num_decoder_layers": "decoder.layers."}


def _check_layer_counts(config: object, state: dict, path: Path) -> None:
    """Refuse a config that asks for more layers than the saved state holds, before anything
    is built: building 200,000 layers takes minutes even on the ``meta`` device.

    Raises:
        ValueError: naming the key, the count asked for and the count saved.
    """
    if not isinstance(config, dict):
        return
    for key, prefix in _LAYER_COUNTS.items():
        asked = config.get(key)
        saved = {name[len(prefix) :].split(".")[0] for name in state if name.startswith(prefix)}
        if isinstance(asked, int) and saved and asked > len(saved):
            raise ValueError(
                f"{path}: its {META_FILE} config asks for {key}={asked} but its {TENSORS_FILE} "
                f"holds {len(saved)} layer(s)"
            )


__all__ = ["FORMAT_VERSION", "load_posterior", "save_posterior"]
