"""The model classes a saved run may name, and the one way a run's model is rebuilt.

A saved posterior names its model by class path (``"probtransformer.models.classifier.
SequenceClassifier"``) and keeps its constructor arguments as a JSON ``config``. Loading never
imports what a file names: the class path is looked up among registered classes only.

- Built-in models are registered under their class path, and under the paths that runs saved by
  main 0fadaf9 name, so those runs keep loading.
- A user's class is registered by decorating it with ``@register_model`` (its module must then be
  imported before loading), or by installing it under the entry-point group
  ``probtransformer.models`` (``[project.entry-points."probtransformer.models"]`` in its
  ``pyproject.toml``); entry points are read only when a class path is not registered otherwise.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import os
import warnings
from typing import TypeVar

from pyro.nn import PyroModule

__all__ = [
    "ENTRY_POINT_GROUP",
    "check_config",
    "check_registered",
    "class_path",
    "model_from_config",
    "register_model",
]

#: Entry-point group whose objects are model classes (code the user installed, so loaded on demand).
ENTRY_POINT_GROUP = "probtransformer.models"

#: Class paths of the built-in models in the runs saved by main 0fadaf9, by class name.
_SAVED_BY_0FADAF9 = {
    "probtransformer.models.classifier.SequenceClassifier": "SequenceClassifier",
    "probtransformer.models.token.TokenTagger": "TokenTagger",
    "probtransformer.models.token.CausalLM": "CausalLM",
    "probtransformer.models.regression.SequenceRegressor": "SequenceRegressor",
    "probtransformer.models.regression.Seq2Seq": "Seq2Seq",
    "probtransformer.models.linear.BayesianLinearRegression": "BayesianLinearRegression",
}

_HOW_TO_REGISTER = (
    "decorate the class with @probtransformer.models.register_model and import its module "
    f"before loading, or install it under the entry-point group {ENTRY_POINT_GROUP!r}"
)

#: User classes registered by ``register_model`` or loaded from entry points, by class path.
_registered: dict[str, type[PyroModule]] = {}

ModelClass = TypeVar("ModelClass", bound=type)


def class_path(cls: type) -> str:
    """``"module.QualName"`` of ``cls``: the name a saved posterior gives its model class."""
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache
def _builtin_models() -> dict[str, type[PyroModule]]:
    # imported here: the model modules are imported by probtransformer.models before this one
    from probtransformer import models

    classes = (
        models.BayesianLinearRegression,
        models.CausalLM,
        models.Seq2Seq,
        models.SequenceClassifier,
        models.SequenceRegressor,
        models.TokenTagger,
    )
    by_name = {cls.__name__: cls for cls in classes}
    builtins = {path: by_name[name] for path, name in _SAVED_BY_0FADAF9.items()}
    builtins.update({class_path(cls): cls for cls in classes})
    return builtins


def register_model(cls: ModelClass) -> ModelClass:
    """Class decorator: allow saved posteriors to name ``cls``, so they can be loaded.

    ``cls`` is registered under ``class_path(cls)``; registering a class of the same path again
    (a notebook cell run twice) replaces the earlier one.

    Args:
        cls: a ``pyro.nn.PyroModule`` subclass following the model protocol.

    Returns:
        ``cls`` itself.

    Raises:
        TypeError: ``cls`` is not a ``PyroModule`` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, PyroModule)):
        got = cls.__name__ if isinstance(cls, type) else type(cls).__name__
        raise TypeError(f"register_model expects a pyro.nn.PyroModule subclass, got {got}")
    _registered[class_path(cls)] = cls
    return cls


def _load_entry_points() -> None:
    """Register every class of the entry-point group; warn about and skip the others."""
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = entry.load()
        except Exception as e:  # the user's installed code may fail in any way
            warnings.warn(
                f"skipped the entry point {entry.name} = {entry.value} of group "
                f"{ENTRY_POINT_GROUP!r}: loading it raised {type(e).__name__}: {e}",
                stacklevel=4,
            )
            continue
        if not (isinstance(obj, type) and issubclass(obj, PyroModule)):
            warnings.warn(
                f"skipped the entry point {entry.name} = {entry.value} of group "
                f"{ENTRY_POINT_GROUP!r}: it is a {type(obj).__name__}, not a PyroModule subclass",
                stacklevel=4,
            )
            continue
        register_model(obj)


def _lookup(path: str) -> type[PyroModule] | None:
    """The class registered under ``path``, reading entry points only when none is."""
    cls = _builtin_models().get(path) or _registered.get(path)
    if cls is None:
        _load_entry_points()
        cls = _registered.get(path)
    return cls


def check_registered(cls: type) -> None:
    """Refuse to save a model whose class a load could not rebuild.

    Raises:
        ValueError: ``cls`` is not the class registered under ``class_path(cls)`` (the message
            says how to register it).
    """
    if _lookup(class_path(cls)) is not cls:
        raise ValueError(
            f"the model class {class_path(cls)} is not registered, so a saved posterior of it "
            f"could not be loaded (loading never imports what a file names): {_HOW_TO_REGISTER}"
        )


def check_config(cls: type, config: object, *, source: str | os.PathLike | None = None) -> None:
    """Check ``config`` against the constructor of ``cls`` without building anything.

    Raises:
        ValueError: ``config`` is not a dict with str keys, names arguments the constructor does
            not take, or lacks required ones (all named).
    """
    where = f" of {source}" if source is not None else ""
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        got = type(config).__name__ if not isinstance(config, dict) else "a dict with non-str keys"
        raise ValueError(f"the model config{where} must be a dict with str keys, got {got}")
    params = inspect.signature(cls).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    accepted = {p.name for p in params if p.kind in named}
    unknown = [] if takes_any else sorted(set(config) - accepted)
    missing = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (*named, inspect.Parameter.POSITIONAL_ONLY)
        and p.name not in config
    ]
    if unknown or missing:
        problems = []
        if unknown:
            problems.append(f"unknown keys {unknown}")
        if missing:
            problems.append(f"missing required keys {missing}")
        raise ValueError(
            f"the config{where} does not match the constructor of {cls.__name__}: "
            f"{' and '.join(problems)}; it takes {sorted(accepted)}"
        )


def model_from_config(
    class_path: str, config: dict, *, source: str | os.PathLike | None = None
) -> PyroModule:
    """Rebuild a model from its class path and JSON ``config``: the one way runs are rebuilt.

    The class is looked up among the registered ones (built-in models, ``@register_model``,
    the entry-point group ``probtransformer.models``); nothing named by ``class_path`` is
    imported. ``config`` is checked against the constructor's signature before the class is
    built, by its own ``from_config`` when it has one (built-in models turn prior specs back
    into objects there), else by ``cls(**config)``.

    Args:
        class_path: ``"module.QualName"`` as a saved posterior records it.
        config: the constructor arguments (``model.config``).
        source: where the class path and config were read (a run directory), named in errors.

    Returns:
        The model, with freshly initialised parameters.

    Raises:
        ValueError: ``class_path`` is not a str or names no registered class (the message says
            how to register one); ``config`` is not a dict with str keys, has unknown or missing
            keys; or the constructor refuses the config (its TypeError or ValueError, re-raised).
    """
    where = f" of {source}" if source is not None else ""
    if not isinstance(class_path, str):
        raise ValueError(
            f"the model class{where} must be a str class path, got {type(class_path).__name__}"
        )
    cls = _lookup(class_path)
    if cls is None:
        raise ValueError(
            f"the model class {class_path!r}{where} is not a registered model class; loading "
            f"never imports what a file names. If it is yours, {_HOW_TO_REGISTER}"
        )
    check_config(cls, config, source=source)
    try:
        return cls.from_config(config) if hasattr(cls, "from_config") else cls(**config)
    except (TypeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"cannot rebuild the {cls.__name__}{where} from its config: {first}"
        ) from e
