"""Tasks: what a problem is, how it is prompted, parsed and scored."""

from __future__ import annotations

import dataclasses
from typing import Any

from tasks.base import DataError, DataSpec, Problem, Task
from tasks.blocksworld.task import Blocksworld
from tasks.creative_writing import CreativeWriting
from tasks.gsm8k import GSM8K

TASKS: dict[str, type] = {"gsm8k": GSM8K, "creative_writing": CreativeWriting, "blocksworld": Blocksworld}


def make_task(name: str, depth: int | None, options: dict[str, Any] | None = None) -> Task:
    """The task `name` with its config options (`task.<key>=...`), each checked by the task; depth
    None: the task's own default."""
    if name not in TASKS:
        raise DataError(f"task={name!r} is not one of {', '.join(TASKS)}")
    cls = TASKS[name]
    known = {f.name for f in dataclasses.fields(cls) if f.init} - {"name", "depth"}
    for key in options or {}:
        if key not in known:
            raise DataError(f"task.{key} is not an option of task={name}; its options are {', '.join(sorted(known))}")
    return cls(**({} if depth is None else {"depth": depth}), **(options or {}))


__all__ = ["TASKS", "DataError", "DataSpec", "Problem", "Task", "make_task"]
