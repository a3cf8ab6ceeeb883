"""Reading blocksworld data files and checking plans against them with the simulator: the gold plans of the data
file itself, or plans from another file (e.g. a run's results.jsonl) matched to problems by id."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from tasks.base import DataError, read_jsonl
from tasks.blocksworld.domain import apply, goal_reached, is_fact, parse_action, precondition_failure

DATA_FORMAT = (
    'a blocksworld JSONL file with one {"id", "objects", "init", "goal", "gold_plan"} record per line, '
    "like ../shared/data/blocksworld/step_6.jsonl"
)
PLANS_FORMAT = 'a JSONL file with one {"id", "plan"} or {"id", "answer"} record per line'


@dataclass(frozen=True)
class BlocksworldProblem:
    id: str
    objects: tuple[str, ...]
    init: frozenset[str]
    goal: frozenset[str]
    gold_plan: tuple[str, ...]  # action texts as the file gives them (PDDL in the benchmark)
    steps: int | None  # the optimal plan length the file claims, if it says


@dataclass(frozen=True)
class PlanVerdict:
    problem_id: str
    valid: bool  # every line an applicable action and the goal holds at the end
    reason: str | None  # one line saying what went wrong first, without the id


@dataclass(frozen=True)
class Report:
    verdicts: tuple[PlanVerdict, ...]

    @property
    def n_valid(self) -> int:
        return sum(v.valid for v in self.verdicts)

    @property
    def all_valid(self) -> bool:
        return self.n_valid == len(self.verdicts)

    def lines(self) -> list[str]:
        """One line per invalid plan, then 'N/M plans valid'."""
        failed = [f"{v.problem_id}: {v.reason}" for v in self.verdicts if not v.valid]
        return [*failed, f"{self.n_valid}/{len(self.verdicts)} plans valid"]


def _strings(value: object) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def problem_from_record(rec: dict[str, Any], need_gold: bool = True) -> BlocksworldProblem:
    """ValueError saying which field is wrong."""
    required = ("id", "objects", "init", "goal", *(("gold_plan",) if need_gold else ()))
    missing = [k for k in required if k not in rec]
    if missing:
        raise ValueError(f"record has no {', '.join(missing)}")
    if not isinstance(rec["id"], str) or not rec["id"].strip() or rec["id"].splitlines() != [rec["id"]]:
        raise ValueError(f"id must be a non-empty string on one line, got {json.dumps(rec['id'])}")
    for key in ("objects", "init", "goal", "gold_plan"):
        if key in rec and not _strings(rec[key]):
            raise ValueError(f"{key} must be a list of strings")
    bad = [f for f in (*rec["init"], *rec["goal"]) if not is_fact(f)]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a blocksworld-4ops fact (e.g. 'on c d', 'ontable a', 'handempty')")
    steps = rec.get("steps")
    if steps is not None and not isinstance(steps, int):
        raise ValueError(f"steps must be an integer, got {steps!r}")
    return BlocksworldProblem(
        id=rec["id"],
        objects=tuple(rec["objects"]),
        init=frozenset(rec["init"]),
        goal=frozenset(rec["goal"]),
        gold_plan=tuple(rec.get("gold_plan", ())),
        steps=steps,
    )


def load_problems(path: Path, need_gold: bool = True, key: str = "") -> list[BlocksworldProblem]:
    """The problems of a data file; `key` names the config key that gave the path, for messages."""
    problems: list[BlocksworldProblem] = []
    seen: dict[str, int] = {}
    for lineno, rec in read_jsonl(path, expected=DATA_FORMAT, key=key):
        try:
            problem = problem_from_record(rec, need_gold)
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: {e}; each line should be as in {DATA_FORMAT}") from None
        if problem.id in seen:
            raise DataError(
                f"data file {path}: line {seen[problem.id]} and line {lineno} have the same id {problem.id!r}; "
                "ids must be unique"
            )
        seen[problem.id] = lineno
        problems.append(problem)
    return problems


def plan_lines(plan: object) -> list[str]:
    """The action texts of a plan given as a list of strings or as one newline-separated string (None: none)."""
    if plan is None:
        return []
    if isinstance(plan, str):
        return [line for line in plan.splitlines() if line.strip()]
    if _strings(plan):
        return [line for line in plan if line.strip()]
    raise ValueError("a plan must be a list of action strings or a newline-separated string")


def load_plans(path: Path) -> list[tuple[str, list[str]]]:
    """(problem id, action texts) per record, in file order."""
    plans = []
    for lineno, rec in read_jsonl(path, expected=PLANS_FORMAT, key=""):
        key = "plan" if "plan" in rec else "answer"
        if "id" not in rec or key not in rec:
            raise DataError(
                f'{path}:{lineno}: record needs "id" and "plan" or "answer"; the file should be {PLANS_FORMAT}'
            )
        try:
            plans.append((str(rec["id"]), plan_lines(rec[key])))
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: {key}: {e}") from None
    return plans


def check_plan_text(problem: BlocksworldProblem, lines: list[str]) -> PlanVerdict:
    """Parses and simulates the plan line by line; the first unparsable or inapplicable line, or else the unmet
    goal, is the reason it is invalid."""
    state = problem.init
    for step, line in enumerate(lines, 1):
        action = parse_action(line)
        reason = "not a blocksworld action" if action is None else precondition_failure(state, action)
        if action is None or reason is not None:
            return PlanVerdict(problem.id, False, f'step {step} "{line.strip()}": {reason}')
        state = apply(state, action)
    if not goal_reached(state, problem.goal):
        missing = ", ".join(sorted(problem.goal - state))
        return PlanVerdict(problem.id, False, f"does not reach the goal (missing: {missing})")
    return PlanVerdict(problem.id, True, None)


def validate(problems: Iterable[BlocksworldProblem], plans: list[tuple[str, list[str]]] | None = None) -> Report:
    """Checks each problem's gold plan, or, given plans, each plan against the problem with its id."""
    by_id = {p.id: p for p in problems}
    if plans is None:
        return Report(tuple(check_plan_text(p, list(p.gold_plan)) for p in by_id.values()))
    verdicts = []
    for problem_id, lines in plans:
        if problem_id in by_id:
            verdicts.append(check_plan_text(by_id[problem_id], lines))
        else:
            verdicts.append(PlanVerdict(problem_id, False, "no problem with this id in the data file"))
    return Report(tuple(verdicts))
