"""The help formatter of ``probtransformer``'s commands: each option left unset shows the library
default it takes, and ``fit``'s help the MCMC preset's values."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Sequence

from probtransformer.cli.options import (
    KERNELS,
    LIBRARY_NAMES,
    MCMC_OPTIONS,
    MILE_OPTIONS,
    UNSET_HELP,
    UNSET_KERNEL_HELP,
    UNSET_MCMC_HELP,
    applies,
    library_functions,
    mcmc_preset,
    mile_preset,
)


def _help_value(value: object) -> str:
    if isinstance(value, tuple | list):
        value = ",".join(map(str, value))
    return str(value).replace("%", "%%")


class LibraryDefaultsFormatter(argparse.HelpFormatter):
    """Help formatter that appends the default of every option left unset (None).

    The defaults are read from the signatures of the library functions named in ``sources``
    (keys of ``options.library_functions``; the first that has the parameter) when help is
    printed, so they are always the ones a run uses. With ``mcmc=True`` (``fit``'s help) the
    ``mile_preset`` values are shown as ``mile: ...`` (the default of the mile-only options),
    and the ``mcmc_preset`` values too: as the default of MCMC-only options (the default
    kernel's, then ``nuts, hmc: ...`` for kernels whose preset differs), as ``mcmc: ...`` next
    to the default of others; and the tasks' ``fit_preset`` values, as ``tagging: ...``.
    """

    def __init__(self, prog: str, *, sources: Sequence[str], mcmc: bool = False) -> None:
        super().__init__(prog, max_help_position=30)
        self._sources = sources
        self._mcmc = mcmc

    def _library_default(self, dest: str) -> str | None:
        functions = library_functions()
        sources, name = self._sources, dest
        if dest in LIBRARY_NAMES:
            source, name = LIBRARY_NAMES[dest]
            sources = (source,)
        for source in sources:
            parameter = inspect.signature(functions[source]).parameters.get(name)
            if parameter is not None and parameter.default is not inspect.Parameter.empty:
                return _help_value(parameter.default)
        return UNSET_HELP.get(dest)

    def _kernel_defaults(self, dest: str) -> list[str]:
        """What the MCMC-only option ``dest`` takes when unset, per kernel it applies to:
        ``["default: v", "nuts, hmc: w"]``, the default kernel's group first."""
        default_kernel = mcmc_preset()["kernel"]
        if dest == "kernel":
            return [f"default: {default_kernel}"]
        groups: dict[str, list[str]] = {}
        for kernel in KERNELS:
            if not applies(dest, kernel):
                continue
            value = mcmc_preset(kernel).get(dest)
            if value is None:
                shown = UNSET_KERNEL_HELP.get(dest, {}).get(kernel, self._library_default(dest))
            else:
                shown = _help_value(value)
            groups.setdefault(str(shown), []).append(kernel)
        if len(groups) == 1:
            return [f"default: {next(iter(groups))}"]
        ordered = sorted(groups.items(), key=lambda item: default_kernel not in item[1])
        return [
            f"{'default' if default_kernel in kernels else ', '.join(kernels)}: {shown}"
            for shown, kernels in ordered
        ]

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is not None or not action.option_strings or "(default:" in text:
            return text  # set, positional, or its help already says
        if self._mcmc and action.dest in MILE_OPTIONS:  # mile only: its preset is the default
            parts = [f"default: {_help_value(mile_preset()[action.dest])}"]
        elif self._mcmc and action.dest in MCMC_OPTIONS:
            parts = self._kernel_defaults(action.dest)
            if action.dest in mile_preset():
                parts.append(f"mile: {_help_value(mile_preset()[action.dest])}")
        else:
            preset = mcmc_preset() if self._mcmc else {}
            default = self._library_default(action.dest)
            parts = [] if default is None else [f"default: {default}"]
            if self._mcmc:  # fit's help: the task presets of SVI and the MAP-based fits
                parts += _task_presets(action.dest)
            if action.dest in preset:
                parts.append(f"mcmc: {_help_value(preset[action.dest])}")
            elif self._mcmc and action.dest in UNSET_MCMC_HELP:
                parts.append(f"mcmc: {UNSET_MCMC_HELP[action.dest]}")
            if self._mcmc and action.dest in mile_preset():
                parts.append(f"mile: {_help_value(mile_preset()[action.dest])}")
        return f"{text} ({'; '.join(parts)})" if parts else text


def _task_presets(dest: str) -> list[str]:
    """``["tagging: v", "language-modeling: w"]``: what tasks take for ``dest`` when it is
    unset, where that differs from the default shown: a task's ``fit_preset``, or its model's
    own default of a model option (tasks with the same value share one entry)."""
    from probtransformer.tasks import TASKS

    shared = inspect.signature(library_functions()["model"]).parameters.get(dest)
    groups: dict[str, list[str]] = {}
    for task in TASKS.values():
        if dest in task.fit_preset:
            value = task.fit_preset[dest]
        else:
            own = inspect.signature(task.model_classes()[0].__init__).parameters.get(dest)
            if shared is None or own is None or own.default == shared.default:
                continue
            value = own.default
        groups.setdefault(_help_value(value), []).append(task.name)
    return [f"{', '.join(names)}: {value}" for value, names in groups.items()]
