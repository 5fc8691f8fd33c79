"""Which sections a report has: ``SECTIONS`` (``{id: heading}``, in page order) and
``TASK_SECTIONS`` (``{task name: section ids}``), read from the task registry when used, so a
task registered later is included."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from probtransformer.tasks import TASKS, Task

_FIRST = {"metrics": "Test metrics"}
_COMMON = {
    "attention": "Posterior attention",
    "head-importance": "Head importance",
    "diagnostics": "Diagnostics",
}


class _Sections(Mapping):
    """``{id: heading}`` of every section: the metrics, each registered task's, the common ones
    (read from ``TASKS`` when used, so a task registered later is included)."""

    def _all(self) -> dict[str, str]:
        tasks = {key: text for task in TASKS.values() for key, text in task.sections.items()}
        return {**_FIRST, **tasks, **_COMMON}

    def __getitem__(self, key: str) -> str:
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class _TaskSections(Mapping):
    """``{task name: section ids}`` in page order, for every registered task."""

    def __getitem__(self, name: str) -> tuple[str, ...]:
        return _section_ids(TASKS[name])

    def __iter__(self) -> Iterator[str]:
        return iter(TASKS)

    def __len__(self) -> int:
        return len(TASKS)


#: ``id`` of each section's ``<h2>``, in page order, with its heading.
SECTIONS: Mapping[str, str] = _Sections()
#: The sections of each task's report, in ``SECTIONS`` order.
TASK_SECTIONS: Mapping[str, tuple[str, ...]] = _TaskSections()


def _section_ids(task: Task) -> tuple[str, ...]:
    return (*_FIRST, *task.sections, *_COMMON)
