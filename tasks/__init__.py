"""Tasks: what a problem is, how it is prompted, parsed and scored. They import `decoding`'s public
face alone (errors, plug-ins), never `tot`."""

from __future__ import annotations

import dataclasses
from typing import Any

from decoding import ENV, table
from tasks.base import DataError, DataSpec, FullTask, Problem, Scoring, StatePrompts, Task, TaskPlugin, Values

# A task is one module ending with `PLUGIN = TaskPlugin(...)` and its yaml (conf/task/NAME.yaml);
# TOT_SPEC_PLUGINS adds modules from outside the project (decoding/base/plugins.py).
MODULES = ("tasks.gsm8k", "tasks.creative_writing", "tasks.blocksworld.task")
TASKS = table(TaskPlugin, MODULES)


def make_task(name: str, depth: int | None, options: dict[str, Any] | None = None) -> FullTask:
    """The task `name` with its config options (`task.<key>=...`), each checked by the task; depth
    None: the task's own default."""
    if name not in TASKS:
        raise DataError(
            f"task={name!r} is not one of {', '.join(TASKS)} (a plug-in outside the project is named in {ENV})"
        )
    plugin = TASKS[name]
    declared = dataclasses.fields(plugin.options) if plugin.options is not None else ()
    known = {f.name for f in declared if f.init} - {"name", "depth"}
    for key in options or {}:
        if key not in known:
            raise DataError(f"task.{key} is not an option of task={name}; its options are {', '.join(sorted(known))}")
    task: FullTask = plugin.build(**({} if depth is None else {"depth": depth}), **(options or {}))
    return task


__all__ = [
    "TASKS",
    "DataError",
    "DataSpec",
    "FullTask",
    "Problem",
    "Scoring",
    "StatePrompts",
    "Task",
    "TaskPlugin",
    "Values",
    "make_task",
]
