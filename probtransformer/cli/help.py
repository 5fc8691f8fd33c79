"""The help formatter of ``probtransformer``'s commands: each option left unset shows the library
default it takes, and ``fit``'s help the MCMC preset's values."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from probtransformer.cli.library_defaults import DEFAULTS, TASK_MODEL_DEFAULTS, help_value
from probtransformer.cli.options import (
    KERNELS,
    LIBRARY_NAMES,
    MCMC_OPTIONS,
    MILE_OPTIONS,
    UNSET_HELP,
    UNSET_MCMC_HELP,
    applies,
    kernel_default,
    mcmc_preset,
    mile_preset,
)


class LibraryDefaultsFormatter(argparse.HelpFormatter):
    """Help formatter that appends the default of every option left unset (None).

    The defaults are those of the library functions named in ``sources`` (keys of
    ``options.library_functions``; the first that has the parameter), from
    ``library_defaults.DEFAULTS``: their signatures' defaults, named there so help imports no
    torch, and tested to be the ones a run uses. With ``mcmc=True`` (``fit``'s help) the
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
        sources, name = self._sources, dest
        if dest in LIBRARY_NAMES:
            source, name = LIBRARY_NAMES[dest]
            sources = (source,)
        for source in sources:
            if name in DEFAULTS[source]:
                return DEFAULTS[source][name]
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
                shown = kernel_default(dest, kernel) or self._library_default(dest)
            else:
                shown = help_value(value)
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
            parts = [f"default: {help_value(mile_preset()[action.dest])}"]
        elif self._mcmc and action.dest in MCMC_OPTIONS:
            parts = self._kernel_defaults(action.dest)
            if action.dest in mile_preset():
                parts.append(f"mile: {help_value(mile_preset()[action.dest])}")
        else:
            preset = mcmc_preset() if self._mcmc else {}
            default = self._library_default(action.dest)
            parts = [] if default is None else [f"default: {default}"]
            if self._mcmc:  # fit's help: the task presets of SVI and the MAP-based fits
                parts += _task_presets(action.dest)
            if action.dest in preset:
                parts.append(f"mcmc: {help_value(preset[action.dest])}")
            elif self._mcmc and action.dest in UNSET_MCMC_HELP:
                parts.append(f"mcmc: {UNSET_MCMC_HELP[action.dest]}")
            if self._mcmc and action.dest in mile_preset():
                parts.append(f"mile: {help_value(mile_preset()[action.dest])}")
        return f"{text} ({'; '.join(parts)})" if parts else text


def _task_presets(dest: str) -> list[str]:
    """``["tagging: v", "language-modeling: w"]``: what tasks take for ``dest`` when it is
    unset, where that differs from the default shown: a task's ``fit_preset``, or its model's
    own default of a model option (tasks with the same value share one entry)."""
    from probtransformer.tasks import TASKS

    shared = DEFAULTS["model"].get(dest)
    groups: dict[str, list[str]] = {}
    for task in TASKS.values():
        if dest in task.fit_preset:
            value = help_value(task.fit_preset[dest])
        else:
            value = TASK_MODEL_DEFAULTS[task.name].get(dest)
            if shared is None or value is None or value == shared:
                continue
        groups.setdefault(value, []).append(task.name)
    return [f"{', '.join(names)}: {value}" for value, names in groups.items()]
