"""Tasks: what a problem is, how it is prompted, parsed and scored."""

from __future__ import annotations

from tasks.base import DataError, DataSpec, Problem, Task
from tasks.gsm8k import GSM8K

TASKS: dict[str, type] = {"gsm8k": GSM8K}


def make_task(name: str, depth: int) -> Task:
    if name not in TASKS:
        raise DataError(f"task={name!r} is not one of {', '.join(TASKS)}")
    return TASKS[name](depth=depth)


__all__ = ["TASKS", "DataError", "DataSpec", "Problem", "Task", "make_task"]
