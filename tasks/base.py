"""What a task is: problems, the prompts for the thought generator and state evaluator, and scoring.

No model code here. A task sees a reasoning path as the list of thought texts from the root.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from decoding import Plugin


class DataError(ValueError):
    """A missing or malformed data file; the message names the file (and line) and the fix."""


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    gold: str
    meta: dict[str, Any] = field(default_factory=dict)
    line: int = field(default=0, compare=False)  # its line in the data file (0: not read from one), for messages


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

    def select(self, problems: list[Problem], source: str = "the data") -> list[Problem]:
        """This run's problems of a file's (`source` names it): DataError where the file's ids are
        not valid and unique, or where data.offset leaves nothing. A shard may be empty (fewer
        problems than shards): the run says so."""
        check_ids(problems, source)
        end = None if self.limit is None else self.offset + self.limit
        window = problems[self.offset : end]
        if not window:
            limit = "null" if self.limit is None else self.limit
            raise DataError(
                f"data.offset={self.offset} data.limit={limit} selects no problem of {source} "
                f"({len(problems)} problems); give data.offset below {len(problems)}"
            )
        # Round robin, so that every shard gets easy and hard problems alike.
        return window[self.shard :: self.num_shards]


def check_ids(problems: list[Problem], source: str) -> None:
    """Every id non-empty, on one line, and unique over the whole file, not only the selection:
    the selections of one file may share a folder, where an id is one problem."""
    where: dict[str, str] = {}
    for i, p in enumerate(problems):
        here = f"line {p.line}" if p.line else f"problem {i + 1}"
        if not p.id.strip() or p.id.splitlines() != [p.id]:
            raise DataError(f"{source}: {here} has the id {p.id!r}; give each problem a non-empty id on one line")
        if p.id in where:
            raise DataError(
                f"{source}: {where[p.id]} and {here} have the same id {p.id!r}; ids must be unique (compared "
                'as the strings runs store: 1 and "1" are one id)'
            )
        where[p.id] = here


EVALUATORS = ("separate", "in_context")
# How a state's value is read (task.value): `sampled`, the number in task.n_evaluate sampled replies to
# the evaluator prompt (their mean); `expected`, the expected score under the model's distribution over
# the score's answers after the prompt; `yes`, the probability of "Yes" against "No" after a yes/no
# question (RAP). Those two read one forward of the prompt (GenRequest.choices): no reply is generated.
# `confidence`: no evaluator at all, the thought's own mean token probability as the model wrote it
# (its geometric mean, from the reply's log-probabilities; self-certainty, as CISC weighs votes by).
# `rollout`: no evaluator either: task.rollouts completions sampled from the state to an answer, the
# state's value the share of them that reach the answer the problem's vote favours (rStar, phi-Decoding).
VALUES = ("sampled", "expected", "yes", "confidence", "rollout")
YES_NO = {" Yes": 1.0, " No": 0.0}


class Task(Protocol):
    """What a search calls to grow a tree and read its answers: 7 members. How a state is valued comes
    to a search apart, as `Values` (the task's value options and its `StatePrompts`), and what a run
    scores with is `Scoring`; a task module's class is usually all three (`FullTask`)."""

    depth: int

    def generator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        """The prompt whose samples are the candidate next thoughts after `steps`."""
        ...

    def parse_thought(self, problem: Problem, steps: list[str], text: str) -> str:
        """The thought a reply (without its prefix) to generator_prompt(problem, steps) stands for."""
        ...

    def is_terminal(self, problem: Problem, steps: list[str]) -> bool:
        """Whether the path `steps` is finished before the depth limit (it is not extended further)."""
        ...

    def solution_prompt(self, problem: Problem, i: int = 0) -> Prompt:
        """The prompt whose one reply solves the whole problem: best-of-N's i-th sample (a task may
        ask its solutions in more than one way, as GSM8K's task.thoughts=mixed does)."""
        ...

    def solution_steps(self, problem: Problem, reply: str, i: int = 0) -> list[str]:
        """The reasoning path the i-th whole reply (without its prefix) stands for: what `answer` reads,
        at least one step."""
        ...

    def answer(self, problem: Problem, steps: list[str]) -> str:
        """The answer the path `steps` gives ("" where it states none): what the vote counts."""
        ...


class StatePrompts(Protocol):
    """How the model is asked for a state's value (task.value = sampled, expected or yes; a judge's
    reward under any value) and how its reply reads: 5 members."""

    def evaluator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        """The prompt that values the state whose last thought is steps[-1]."""
        ...

    def follow_up_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        """The evaluator as a new turn after the reply that wrote steps[-1], in that reply's own
        context (task.evaluator=in_context): only this turn is new to the model, and its reply is
        read by parse_value. It judges the reply as the model wrote it, not the parsed thought."""
        ...

    def solution_evaluator_prompt(self, problem: Problem, steps: list[str], follow_up: bool) -> Prompt:
        """The prompt that values a whole solution, read by parse_value: on its own, or (follow_up,
        with task.evaluator=in_context) as a new turn after the reply that wrote it."""
        ...

    def parse_value(self, text: str) -> float:
        """The value of a state from the evaluator's reply (without its prefix)."""
        ...

    def value_answers(self) -> dict[str, float]:
        """With task.value=expected or yes: the answers that may follow the evaluator prompts (as the
        task writes them for its value mode) and the value each stands for."""
        ...


@runtime_checkable
class Completes(Protocol):
    """A task whose paths a completion can continue to an answer (task.value=rollout, and
    reward.kind=consistency's discriminator): GSM8K."""

    def rollout_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        """The prompt whose one reply completes the path `steps` to an answer (read by `answer` as the
        step after them); task.rollouts of them value the state, each at most task.rollout_tokens long."""
        ...


class Scoring(Protocol):
    """What a run calls to read problems and score answers: 7 members."""

    name: str
    judge_metric: str  # the name judge_prompt's mean score gets in results and summaries

    def load(self, data: DataSpec) -> list[Problem]: ...

    def is_correct(self, problem: Problem, answer: str) -> bool: ...

    def answers(self, problem: Problem, steps: list[str]) -> dict[str, str]:
        """The answer as each of the task's extraction rules reads it (GSM8K: strict and flexible,
        as lm-evaluation-harness reports them), each scored beside `answer`; {} when there is one."""
        ...

    def metrics(self, problem: Problem, answer: str) -> dict[str, float]:
        """Scores of an answer that code computes, beside `correct` (e.g. a constraint check)."""
        ...

    def judge_prompt(self, problem: Problem, answer: str) -> Prompt | None:
        """A prompt whose replies score the answer (`judge_metric`, by parse_value), or None when code
        scores the task alone."""
        ...


class FullTask(Task, StatePrompts, Scoring, Protocol):
    """What a task plug-in builds: the three roles in one object, with the value options a run's
    `Values` is read from (`task.<field>=...`)."""

    value: str  # one of VALUES: how a state is valued
    n_evaluate: int  # evaluator samples per state under task.value=sampled; the state's value is their mean
    evaluator: str  # one of EVALUATORS: a prompt of its own per state, or a follow-up of the thought's reply
    rollouts: int  # task.value=rollout: completions sampled from each state
    rollout_tokens: int  # and the longest of them


@dataclass(frozen=True)
class Values:
    """How a run values a task's states: task.value and the options beside it, and the task's prompts
    that ask the model (what a search reads besides the task's `Task` members)."""

    prompts: StatePrompts
    mode: str = "confidence"  # task.value, one of VALUES
    n_evaluate: int = 1
    in_context: bool = False  # task.evaluator=in_context
    rollouts: int = 2
    rollout_tokens: int = 384
    completes: Completes | None = None  # the task, where its paths can be completed (task.value=rollout)

    @classmethod
    def of(cls, task: FullTask) -> Values:
        return cls(
            prompts=task,
            mode=task.value,
            n_evaluate=task.n_evaluate,
            in_context=task.evaluator == "in_context",
            rollouts=task.rollouts,
            rollout_tokens=task.rollout_tokens,
            completes=task if isinstance(task, Completes) else None,
        )

    def rollout_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        """The task's completion prompt for the path `steps`; a DataError where the task has none."""
        if self.completes is None:
            raise DataError(
                "this task has no rollout_prompt, so its paths cannot be completed: use task.value=rollout and "
                "reward.kind=consistency with a task that has one (gsm8k)"
            )
        return self.completes.rollout_prompt(problem, steps)


class TaskDefaults:
    """What most tasks share: `n_evaluate` evaluator samples per state (averaged), paths that run to
    the depth limit, and scoring by code alone."""

    n_evaluate: int = 1
    value: str = "sampled"
    evaluator: str = "separate"
    judge_metric: str = "judge_score"
    rollouts: int = 2
    rollout_tokens: int = 384

    def is_terminal(self, problem: Problem, steps: list[str]) -> bool:
        return False

    def metrics(self, problem: Problem, answer: str) -> dict[str, float]:
        return {}

    def answers(self, problem: Problem, steps: list[str]) -> dict[str, str]:
        return {}

    def judge_prompt(self, problem: Problem, answer: str) -> Prompt | None:
        return None


def check_evaluator(task: str, evaluator: str) -> None:
    if evaluator not in EVALUATORS:
        raise DataError(
            f"task.evaluator={evaluator!r} is not one of {', '.join(EVALUATORS)} (task={task}): separate values "
            "each state with a prompt of its own, in_context asks the model about its reply as a follow-up turn"
        )


def check_value(task: str, value: str, modes: tuple[str, ...] = VALUES) -> None:
    """task.value is one this task's evaluator can be read by (task.n_evaluate applies to `sampled` alone)."""
    if value is True:  # type: ignore[comparison-overlap]  # YAML 1.1 reads a bare yes as true
        raise DataError(f'task.value=true (task={task}): a bare yes in a yaml file reads as true; write value: "yes"')
    if value not in modes:
        raise DataError(
            f"task.value={value!r} is not one of {', '.join(modes)} (task={task}): sampled reads the number in "
            "sampled evaluations; expected (the expected score) and yes (the probability of Yes) read one forward; "
            "rollout values a state by how often completions from it reach the vote's answer"
        )


def score_answers(low: int, high: int) -> dict[str, float]:
    """An integer score from low to high as it follows a prefix such as "Score:"."""
    return {f" {i}": float(i) for i in range(low, high + 1)}


def check_positive(task: str, **values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DataError(f"task.{key}={value!r} must be a positive integer (task={task})")


def read_jsonl(
    path: Path,
    required: tuple[str, ...] = (),
    expected: str = "an existing JSONL file, or leave data.path unset",
    key: str = "data.path",
) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) pairs of a JSONL file; a missing file or a bad line is a DataError
    naming the file (as the config `key` that gave it, if any), the line, and what it should hold."""
    name = f"{key}={path}" if key else str(path)
    if not path.is_file():
        raise DataError(f"{name} does not exist; give {expected}")
    records = []
    for lineno, line in enumerate(text_lines(path), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove that line") from None
        if not isinstance(rec, dict):
            raise DataError(f"{path}:{lineno}: not a JSON object; the file should be {expected}")
        missing = [k for k in required if k not in rec]
        if missing:
            raise DataError(f"{path}:{lineno}: record has no {', '.join(missing)}; each line needs {required}")
        records.append((lineno, rec))
    if not records:
        raise DataError(f"{name} holds no records; give {expected}")
    return records


def record_id(path: Path, lineno: int, rec: dict[str, Any], default: str) -> str:
    """A record's id as runs store it, a string (a number's digits); `default` where it has none.
    A null, a float or any other JSON value is a DataError naming the line: str() would store
    "None" or "1.0" for it."""
    if "id" not in rec:
        return default
    value = rec["id"]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataError(f"{path}:{lineno}: the id is {json.dumps(value)}; give each problem a string (or integer) id")
    return str(value)


def text_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file, decoded one by one so that a line that is not UTF-8 is a
    DataError naming the file, the line and the byte, not a UnicodeDecodeError."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e.strerror or e}); give a readable data file") from None
    lines = []
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}:{lineno}: byte 0x{line[e.start]:02x} at column {e.start + 1} is not UTF-8 text; "
                "save the file as UTF-8"
            ) from None
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line starts no line of its own
    return lines


@dataclass(frozen=True)
class TaskPlugin(Plugin):
    """A task's declaration (`PLUGIN = TaskPlugin(name=..., build=Cls, options=Cls)` at the end of its
    module): its options are the task dataclass's own fields (`task.<field>=...`), its builder that
    class (tasks/__init__.py gathers them)."""

    KIND: ClassVar[str] = "task"

    section: str = "task"
