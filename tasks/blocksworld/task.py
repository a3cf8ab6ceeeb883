"""Blocksworld as SEED runs it (after RAP and ToT): one thought is one action; depth 7 for the 6-step
problems. The generator sees the rules, demonstrations, the statement, the plan so far and the state
it leads to (the project's simulator is the world model); the evaluator labels the latest action good
or bad. Demonstrations are problems the project generates and solves with its own optimal planner.
A run scores a problem as solved when its plan, checked by the simulator, reaches the goal.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from tasks.base import (
    DataError,
    DataSpec,
    Problem,
    Prompt,
    TaskDefaults,
    TaskPlugin,
    check_evaluator,
    check_positive,
    check_value,
)
from tasks.blocksworld.domain import (
    Action,
    action_of,
    action_words,
    apply,
    check_plan,
    parse_action,
    precondition_failure,
    render_action,
    render_facts,
)
from tasks.blocksworld.planner import generate_problems, is_optimal_step, successors
from tasks.blocksworld.validate import BlocksworldProblem, load_problems, problem_from_record

ACTION_PREFIX = "Action:"
LABEL_PREFIX = "Label:"
RULES = (
    "I am playing with a set of blocks where I need to arrange the blocks into stacks. The actions are: "
    "pick up a block, unstack a block from on top of another block, put down a block, stack a block on top "
    "of another block.\nRules: I can only pick up or unstack one block at a time, and only when my hand is "
    "empty. I can only pick up a block that is on the table and clear (no block on top of it). I can only "
    "unstack a block from on top of another block if it really is on top of it and it is clear. I can only "
    "put down or stack a block that I am holding. I can only stack a block on top of a clear block. After "
    "I put down or stack a block my hand is empty."
)
# Where a reply runs on past its action: "unstack ..., then ...", "unstack ... to free ...".
_CLAUSE = re.compile(r"[,;]|\band then\b|\bthen\b|\band\b|\b(?:in order |so as )?to\b|\bso that\b|\bbecause\b", re.I)
# "unstack the blue block" without saying from what: the block it sits on in the current state.
_BARE_UNSTACK = re.compile(r"^unstack ([a-j])$")
# Demonstrations come from their own generated problems, never from the problems being solved.
DEMO_SEED = 1_000_003


def statement(init: frozenset[str], goal: frozenset[str]) -> str:
    return f"As initial conditions I have that {render_facts(init)}.\nMy goal is to have that {render_facts(goal)}."


@dataclass
class Walk:
    """Where a plan's actions lead: the state after the applicable prefix, and the first failure."""

    state: frozenset[str]
    actions: list[Action] = field(default_factory=list)
    failure: str | None = None


def walk(init: frozenset[str], steps: list[str]) -> Walk:
    w = Walk(init)
    for text in steps:
        action = parse_action(text)
        reason = "not an action" if action is None else precondition_failure(w.state, action)
        if action is None or reason is not None:
            w.failure = f'"{text}": {reason}'
            return w
        w.state = apply(w.state, action)
        w.actions.append(action)
    return w


@dataclass
class Blocksworld(TaskDefaults):
    depth: int = 7
    n_evaluate: int = 1
    evaluator: str = "separate"
    value: str = "sampled"  # or expected: P(good) of the label, read in one forward
    # The offline default data: generated problems (used when data.path is unset).
    n_problems: int = 10
    n_blocks: int = 4
    steps: int = 6
    instance_seed: int = 0
    n_demos: int = 2  # solved problems shown to the generator; twice as many labelled actions to the evaluator
    name: str = "blocksworld"

    def __post_init__(self) -> None:
        check_positive(self.name, depth=self.depth, n_evaluate=self.n_evaluate, n_problems=self.n_problems)
        check_positive(self.name, n_blocks=self.n_blocks, steps=self.steps, n_demos=self.n_demos)
        check_evaluator(self.name, self.evaluator)
        check_value(self.name, self.value, ("sampled", "expected", "confidence"))
        if self.n_blocks > 10:
            raise DataError(f"task.n_blocks={self.n_blocks}: blocks are named by 10 colours; use at most 10")
        self._demos = [
            problem_from_record(r) for r in generate_problems(self.n_demos, n_blocks=4, steps=4, seed=DEMO_SEED)
        ]

    def load(self, data: DataSpec) -> list[Problem]:
        if data.path:
            path = Path(data.path).expanduser()
            found, source = load_problems(path, need_gold=False, key="data.path"), f"data file {path}"
        else:
            try:
                records = generate_problems(self.n_problems, self.n_blocks, self.steps, self.instance_seed)
            except ValueError as e:
                raise DataError(f"task.n_blocks/task.steps: {e}") from None
            found, source = [problem_from_record(r) for r in records], "the generated problems (task.n_problems)"
        return data.select([self._problem(p) for p in found], source)

    @staticmethod
    def _problem(p: BlocksworldProblem) -> Problem:
        meta = {"objects": list(p.objects), "init": sorted(p.init), "goal": sorted(p.goal)}
        return Problem(id=p.id, question=statement(p.init, p.goal), gold="\n".join(p.gold_plan), meta=meta)

    @staticmethod
    def _init_goal(problem: Problem) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset(problem.meta["init"]), frozenset(problem.meta["goal"])

    # --- thought generator -------------------------------------------------------------------
    def _solved_demos(self) -> str:
        return "\n\n".join(
            f"[STATEMENT]\n{statement(d.init, d.goal)}\n[PLAN]\n"
            + "\n".join(render_action(action_of(a)) for a in d.gold_plan)
            + "\n[PLAN END]"
            for d in self._demos
        )

    def generator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        init, _ = self._init_goal(problem)
        demos = self._solved_demos()
        done = "\n".join(f"{i}. {s}" for i, s in enumerate(steps, 1)) or "none yet"
        return Prompt(
            f"{RULES}\n\n{demos}\n\n[STATEMENT]\n{problem.question}\n\nPlan so far: {done}\n"
            f"Current state: {render_facts(walk(init, steps).state)}.\n\n"
            'Write only the next action of the plan, as "Action: <action>".',
            prefix=ACTION_PREFIX,
            stop=("\n",),
        )

    def parse_thought(self, problem: Problem, steps: list[str], text: str) -> str:
        """The reply's first action in canonical words (so equal actions read alike): its first line,
        or else the first clause of it that is one action (a model may run on: "unstack ..., then ...");
        without any, the first line as written."""
        line = text.strip().splitlines()[0] if text.strip() else ""
        for clause in [line, *_CLAUSE.split(line)]:
            action = parse_action(clause) or self._bare_unstack(problem, steps, clause)
            if action is not None:
                return render_action(action)
        return line

    def _bare_unstack(self, problem: Problem, steps: list[str], clause: str) -> Action | None:
        words = action_words(clause)
        m = _BARE_UNSTACK.fullmatch(words or "")
        if m is None:
            return None
        below = [f.split()[2] for f in walk(self._init_goal(problem)[0], steps).state if f.startswith(f"on {m[1]} ")]
        return Action("unstack", (m[1], below[0])) if below else None

    def is_terminal(self, problem: Problem, steps: list[str]) -> bool:
        """Finished once the goal holds, or dead once an action cannot be applied."""
        init, goal = self._init_goal(problem)
        w = walk(init, steps)
        return w.failure is not None or goal <= w.state

    # --- state evaluator ---------------------------------------------------------------------
    def evaluator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        init, goal = self._init_goal(problem)
        *before, last = steps
        return Prompt(
            f"{RULES}\n\nLabel an action good if it can be done in the current state and brings the goal "
            f"closer, else bad.\n\n{self._labelled_demos()}\n\nCurrent state: {render_facts(walk(init, before).state)}."
            f"\nGoal: {render_facts(goal)}.\nAction: {last}\n"
            'Reply "Label: good" or "Label: bad".',
            prefix=LABEL_PREFIX,
            stop=("\n",),
        )

    def follow_up_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        # The labelled demonstrations stay in the separate evaluator: here the model has the rules,
        # the solved plans and the current state in view already.
        _, goal = self._init_goal(problem)
        return Prompt(
            f"Is that action good: can it be done in the current state, and does it bring the goal "
            f'({render_facts(goal)}) closer? Reply "Label: good" or "Label: bad".',
            prefix=LABEL_PREFIX,
            stop=("\n",),
        )

    def _labelled_demos(self) -> str:
        """Per demonstration problem, from a state on its optimal plan: the optimal action (good) and an
        applicable action that is not on any optimal plan (bad), in alternating order."""
        rng = random.Random(DEMO_SEED)
        blocks = []
        for i, d in enumerate(self._demos):
            plan = [action_of(a) for a in d.gold_plan]
            k = rng.randrange(len(plan))
            state = d.init
            for a in plan[:k]:
                state = apply(state, a)
            bad = [a for a, _ in successors(state, d.objects) if not is_optimal_step(state, a, d.goal, d.objects)]
            pairs = [(plan[k], "good")] + ([(rng.choice(bad), "bad")] if bad else [])
            for action, label in pairs if i % 2 == 0 else reversed(pairs):
                blocks.append(
                    f"Current state: {render_facts(state)}.\nGoal: {render_facts(d.goal)}.\n"
                    f"Action: {render_action(action)}\nLabel: {label}"
                )
        return "\n\n".join(blocks)

    def value_answers(self) -> dict[str, float]:
        """task.value=expected: the label's probability of good against bad."""
        return {" good": 1.0, " bad": 0.0}

    def parse_value(self, text: str) -> float:
        """1 for good, 0 for bad or an unreadable label."""
        words = text.strip().lower().split()
        return 1.0 if words and words[0].strip(".,!\"'") == "good" else 0.0

    # --- whole solutions (best-of-N) ---------------------------------------------------------
    def solution_prompt(self, problem: Problem, i: int = 0) -> Prompt:
        return Prompt(
            f"{RULES}\n\n{self._solved_demos()}\n\n[STATEMENT]\n{problem.question}\n\n"
            "Write the whole plan as the examples do: one action per line, then [PLAN END].",
            prefix="[PLAN]\n",
            stop=("[PLAN END]", "\n\n"),
        )

    def solution_steps(self, problem: Problem, reply: str, i: int = 0) -> list[str]:
        """One action per line of the plan, each read as parse_thought reads a single action."""
        steps: list[str] = []
        for line in reply.splitlines():
            if line.strip():
                steps.append(self.parse_thought(problem, steps, line))
        return steps or [""]

    def solution_evaluator_prompt(self, problem: Problem, steps: list[str], follow_up: bool) -> Prompt:
        _, goal = self._init_goal(problem)
        ask = (
            f"Label the plan good if each action can be done in turn and the plan ends with the goal "
            f'({render_facts(goal)}) reached, else bad. Reply "Label: good" or "Label: bad".'
        )
        if follow_up:
            return Prompt(ask, prefix=LABEL_PREFIX, stop=("\n",))
        plan = "\n".join(steps)
        return Prompt(
            f"{RULES}\n\n[STATEMENT]\n{problem.question}\n[PLAN]\n{plan}\n[PLAN END]\n\n{ask}",
            prefix=LABEL_PREFIX,
            stop=("\n",),
        )

    # --- scoring -----------------------------------------------------------------------------
    def answer(self, problem: Problem, steps: list[str]) -> str:
        """The plan, one action per line in PDDL form (a line that is no action is kept as written)."""
        return "\n".join(a.pddl() if (a := parse_action(s)) else s for s in steps)

    def is_correct(self, problem: Problem, answer: str) -> bool:
        init, goal = self._init_goal(problem)
        lines = [line for line in answer.splitlines() if line.strip()]
        actions = [a for line in lines if (a := parse_action(line)) is not None]
        return len(actions) == len(lines) and check_plan(init, goal, actions).reached_goal

    def metrics(self, problem: Problem, answer: str) -> dict[str, float]:
        init, _ = self._init_goal(problem)
        lines = [line for line in answer.splitlines() if line.strip()]
        w = walk(init, lines)
        return {"plan_length": float(len(lines)), "applicable_actions": float(len(w.actions))}


PLUGIN = TaskPlugin(name="blocksworld", build=Blocksworld, options=Blocksworld)
