"""Task families of ``probtransformer fit``: one ``Task`` object each, in ``TASKS``.

A task builds its model from a dataset's meta, measures the test split, writes its run files,
supplies its report sections and reads ``predict`` inputs (``probtransformer.tasks._base``).
The CLI and the report find a dataset's task with ``task_for_dataset`` and a fitted run's with
``task_of``; adding a task family is one module with a ``Task`` subclass and one ``register``
call below. Tasks may use ``probtransformer.models`` and ``probtransformer.inference``; the
building blocks and ``inference`` never import this package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from probtransformer.tasks._base import Evaluation, ReportContext, Task
from probtransformer.tasks._tokens import LM_FIT, TAGGER_FIT
from probtransformer.tasks.classification import ClassificationTask
from probtransformer.tasks.forecasting import ForecastingTask
from probtransformer.tasks.language_modeling import LanguageModelingTask
from probtransformer.tasks.tagging import TaggingTask

#: The registered task families by name, in registration order.
TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    """Add ``task`` to ``TASKS`` under ``task.name`` and return it.

    Raises:
        TypeError: ``task`` is not a ``Task`` instance.
        ValueError: another task is registered under that name.
    """
    if not isinstance(task, Task):
        raise TypeError(f"task must be a Task instance, got {type(task).__name__}")
    if task.name in TASKS and TASKS[task.name] is not task:
        raise ValueError(f"a task named {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


register(ClassificationTask())
register(TaggingTask())
register(LanguageModelingTask())
register(ForecastingTask())


def task_for_dataset(dataset: str | Mapping[str, Any]) -> Task:
    """The task of a dataset: its name in ``datasets.available()`` (read without loading the
    data), or its ``meta`` (the ``task`` key).

    Raises:
        ValueError: an unknown dataset name, a meta without ``task``, or a task no registered
            ``Task`` handles.
        TypeError: ``dataset`` is neither a name nor a mapping.
    """
    if isinstance(dataset, str):
        from probtransformer import datasets

        table = datasets.available()
        tasks = dict(zip(table["name"], table["task"], strict=True))
        if dataset not in tasks:
            raise ValueError(f"unknown dataset {dataset!r}; see datasets.available()")
        name, what = tasks[dataset], f"dataset {dataset}"
    elif isinstance(dataset, Mapping):
        if "task" not in dataset:
            raise ValueError(f"dataset meta must hold 'task', got keys {sorted(dataset)}")
        name, what = dataset["task"], f"dataset {dataset.get('name', '?')}"
    else:
        raise TypeError(f"dataset must be a name or a meta dict, got {type(dataset).__name__}")
    if name not in TASKS:
        hint = (
            ": a number per sequence is fitted in Python by "
            "probtransformer.sklearn.BayesianTransformerRegressor"
            if name == "regression"
            else ""
        )
        raise ValueError(
            f"{what} has task {name!r}, which probtransformer fit does not handle{hint}"
        )
    return TASKS[name]


def task_of(model: Any) -> Task:
    """The task of a fitted model, from its class (so runs written before metrics.json recorded
    ``task`` are read too): the task whose model class is nearest in the model's MRO (a
    ``CausalLM`` is a ``TokenTagger``, and is language modelling).

    Raises:
        ValueError: no registered task fits models of this class.
    """
    matches = [(task.handles(model), task) for task in TASKS.values()]
    matches = [(position, task) for position, task in matches if position is not None]
    if not matches:
        raise ValueError(f"probtransformer fit does not write runs of a {type(model).__name__}")
    return min(matches, key=lambda match: match[0])[1]


__all__ = [
    "LM_FIT",
    "TAGGER_FIT",
    "TASKS",
    "Evaluation",
    "ReportContext",
    "Task",
    "register",
    "task_for_dataset",
    "task_of",
]
