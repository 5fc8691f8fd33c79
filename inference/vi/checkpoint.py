"""Checkpoints of an SVI fit: everything needed to continue it to the same numbers.

A checkpoint is a directory holding ``checkpoint.json`` (format version, model class and config,
the fit's settings, a fingerprint of the data, the completed steps and the ELBO trace) and
``state.pt`` (model, guide, optimizer and learning-rate schedule states, the RNG state and the
mini-batch order), written to a staging directory and moved into place, so a crash while
writing leaves the previous checkpoint intact. Tensors are read back with
``torch.load(weights_only=True)``: loading never unpickles objects.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from probtransformer._io import read_versioned_json, staged_directory
from probtransformer.data import SequenceData
from probtransformer.inference.distributed import check_same, together
from probtransformer.inference.inputs import rows_digest

if TYPE_CHECKING:
    from probtransformer.inference.vi.state import SVIState

#: Version of the on-disk layout written by ``save_checkpoint``.
CHECKPOINT_VERSION = 1
_META = "checkpoint.json"
_STATE = "state.pt"


def data_fingerprint(data: SequenceData) -> list[float]:
    """Cheap summary of the training data (size and sums), to refuse resuming on other data."""
    parts = [float(len(data)), float(data.x.double().sum()), float(data.y.double().sum())]
    if data.mask is not None:
        parts.append(float(data.mask.sum()))
    return parts


def save_checkpoint(path: str | os.PathLike, meta: dict, state: dict) -> None:
    """Write ``meta`` (JSON) and ``state`` (tensors and plain containers) to directory ``path``.

    Raises:
        ValueError: ``path`` exists and is not a checkpoint directory.
        OSError: it cannot be written (the message names ``path``).
    """
    target = Path(path).absolute()
    if target.exists() and not (target.is_dir() and (target / _META).is_file()):
        if not target.is_dir() or any(target.iterdir()):
            raise ValueError(f"refusing to write a checkpoint over {target}: it is not one")
    try:
        with staged_directory(target) as staging:
            (staging / _META).write_text(
                json.dumps({"format_version": CHECKPOINT_VERSION, **meta}, indent=1)
            )
            torch.save(state, staging / _STATE)
    except OSError as e:
        raise OSError(f"cannot write the checkpoint {target}: {e.strerror or e}") from e


def load_checkpoint(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(meta, state)`` of the checkpoint directory ``path``.

    Raises:
        FileNotFoundError: ``path`` is not a checkpoint.
        ValueError: written by a newer version, or damaged.
    """
    path = Path(path)
    if not (path / _META).is_file() or not (path / _STATE).is_file():
        raise FileNotFoundError(f"{path} is not an SVI checkpoint (no {_META} / {_STATE})")
    meta = read_versioned_json(path / _META, CHECKPOINT_VERSION, "checkpoint format_version")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's advice to unpickle is not for strangers
            state = torch.load(path / _STATE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not zipfile.is_zipfile(path / _STATE):  # torch.save writes a zip archive
            raise ValueError(f"{path / _STATE} is damaged: not a torch file") from e
        raise ValueError(
            f"{path / _STATE} holds pickled objects, not only tensors: refused (a checkpoint "
            "is tensors; loading never unpickles objects)"
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{path / _STATE} is damaged: {str(e).splitlines()[0]}") from e
    return meta, state


#: ``fit_svi`` settings added after checkpoints were first written, with the value a checkpoint
#: without them was fitted with.
LATER_SETTINGS = {"lr_warmup": 0.0, "lr_schedule": "exponential"}


def check_compatible(meta: dict, expected: dict, path: str | os.PathLike) -> None:
    """Refuse to resume when the model, its configuration, the settings or the data differ.

    Raises:
        ValueError: naming the first field that differs, with both values.
    """
    for key, value in expected.items():
        saved, value = meta.get(key), json.loads(json.dumps(value))
        if value != saved:
            if isinstance(value, dict) and isinstance(saved, dict):  # name the entries
                names = sorted(k for k in set(value) | set(saved) if value.get(k) != saved.get(k))
                saved = {k: saved.get(k) for k in names}
                value = {k: value.get(k) for k in names}
            verb = "are" if key.endswith("s") else "is"
            raise ValueError(
                f"cannot resume from {path}: its {key} {verb} {saved!r} but this fit has "
                f"{value!r}; resume with the same model, data and settings (num_steps included)"
            )


def _identity(state: SVIState) -> dict:
    """What a checkpoint must share with a fit to resume it."""
    model = state.model
    return dict(
        model_class=f"{type(model).__module__}.{type(model).__qualname__}",
        config=model.config,
        settings=state.settings,
        data=state.fingerprint,
    )


def save_svi_checkpoint(state: SVIState, path: str | os.PathLike) -> None:
    """Write ``state`` (an ``inference.vi.state.SVIState``) as the checkpoint directory ``path``.

    ``restore_svi_checkpoint`` on a fresh ``svi_init`` state of the same model, data and
    settings brings it back, and the steps after it give the numbers ``state`` would have given.

    Raises:
        ValueError: ``path`` exists and is not a checkpoint directory.
        OSError: it cannot be written (the message names ``path``).
    """
    save_checkpoint(
        path,
        {**_identity(state), "step": state.step, "elbo": state.elbo[: state.step]},
        dict(
            model_state=state.model.state_dict(),
            guide_state=state.guide.state_dict(),
            optimizer_state=state.optimizer.state_dict(),
            scheduler_state=state.scheduler.state_dict(),
            rng=state.rng,
            order=state.order.cpu(),
            cursor=state.cursor,
        ),
    )


def restore_svi_checkpoint(state: SVIState, path: str | os.PathLike) -> None:
    """Load the checkpoint directory ``path`` into ``state``, in place.

    ``state`` comes from ``svi_init`` with the model, data and settings of the saved fit: the
    parameters, optimizer and schedule, mini-batch order and cursor, RNG state, completed steps
    and ELBO trace become the saved ones. In a data-parallel fit every rank must restore the
    same checkpoint (checked).

    Raises:
        FileNotFoundError: ``path`` is not a checkpoint.
        ValueError: written by a newer version, damaged, or of another model class or config,
            other settings or other data (the message names the first field that differs);
            another rank restored another checkpoint.
    """
    with together(state.parallel, "reading the checkpoint"):
        meta, saved = load_checkpoint(path)
        if isinstance(meta.get("settings"), dict):  # saved before these settings existed
            meta["settings"] = {**LATER_SETTINGS, **meta["settings"]}
        check_compatible(meta, _identity(state), path)
    state.model.load_state_dict(saved["model_state"])
    state.guide.load_state_dict(saved["guide_state"])
    state.optimizer.load_state_dict(saved["optimizer_state"])
    state.scheduler.load_state_dict(saved["scheduler_state"])
    state.order = saved["order"].to(state.device)
    state.cursor, state.step = saved["cursor"], meta["step"]
    state.elbo = list(meta["elbo"])
    state.rng = saved["rng"]
    with torch.no_grad():  # the restored parameters are the last finite ones
        torch._foreach_copy_(state.last_finite, state.params)
    if state.parallel is not None:
        check_same(
            state.parallel,
            f"every rank must resume from the same checkpoint ({path} is read by each rank: on "
            "several nodes, keep it on shared storage or copy it to each)",
            **{
                "checkpoint step": state.step,
                "checkpoint state": rows_digest(state.order, *state.params),
            },
        )
