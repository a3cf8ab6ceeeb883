"""What a task is: problems, the prompts for the thought generator and state evaluator, and scoring.

No model code here. A task sees a reasoning path as the list of thought texts from the root.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


class DataError(ValueError):
    """A missing or malformed data file; the message names the file (and line) and the fix."""


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    gold: str
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Prompt:
    """A user message, the start of the model's reply (`prefix`) and strings that end the reply."""

    text: str
    prefix: str = ""
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class DataSpec:
    path: str | None = None
    limit: int | None = None
    offset: int = 0
    shard: int = 0  # this run takes problems shard, shard + num_shards, ... of the selection
    num_shards: int = 1

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise DataError(f"data.limit={self.limit} must be a positive number of problems, or null for all")
        if self.offset < 0:
            raise DataError(f"data.offset={self.offset} must be >= 0")
        if self.num_shards < 1 or not 0 <= self.shard < self.num_shards:
            raise DataError(
                f"data.shard={self.shard} data.num_shards={self.num_shards}: need num_shards >= 1 "
                "and 0 <= shard < num_shards"
            )

    def select(self, problems: list[Problem]) -> list[Problem]:
        end = None if self.limit is None else self.offset + self.limit
        # Round robin, so that every shard gets easy and hard problems alike.
        return problems[self.offset : end][self.shard :: self.num_shards]


class Task(Protocol):
    name: str
    depth: int

    def load(self, data: DataSpec) -> list[Problem]: ...

    def generator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        """The prompt whose samples are the candidate next thoughts after `steps`."""
        ...

    def parse_thought(self, problem: Problem, steps: list[str], text: str) -> str:
        """The thought a reply (without its prefix) to generator_prompt(problem, steps) stands for."""
        ...

    def evaluator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        """The prompt that values the state whose last thought is steps[-1]."""
        ...

    def parse_value(self, text: str) -> float:
        """The value of a state from the evaluator's reply (without its prefix)."""
        ...

    def answer(self, problem: Problem, steps: list[str]) -> str: ...

    def is_correct(self, problem: Problem, answer: str) -> bool: ...


def read_jsonl(path: Path, required: tuple[str, ...]) -> list[tuple[int, dict]]:
    """(line number, record) pairs of a JSONL file; a missing file or a bad line is a DataError
    naming file and line."""
    if not path.is_file():
        raise DataError(f"data.path={path} does not exist; give an existing JSONL file or leave data.path unset")
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove that line") from None
            missing = [k for k in required if not isinstance(rec, dict) or k not in rec]
            if missing:
                raise DataError(f"{path}:{lineno}: record has no {', '.join(missing)}; each line needs {required}")
            records.append((lineno, rec))
    if not records:
        raise DataError(f"data.path={path} holds no records")
    return records
