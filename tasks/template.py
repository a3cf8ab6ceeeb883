"""A task in a few members: what a problem is (`load`, `answer`, `is_correct`, and `is_terminal` where
a path may end early) apart from how it is prompted, which templates say.

A task module's class plays the three roles of tasks/base.py (`Task`: 7 members a search calls,
`StatePrompts`: 5, how a state's value is asked, `Scoring`: 7, what a run scores with). A new
task subclasses `TemplateTask`, sets its `name`, `depth` and templates, and overrides what its problems need:

    @dataclass
    class Riddles(TemplateTask):
        name: str = "riddles"
        generator_template: str = "Riddle: {question}\\n{steps}Think one step further."
        evaluator_template: str = "Riddle: {question}\\n{steps}Is this on the right track? Answer Yes or No."

        def answer(self, problem, steps):
            return steps[-1].split("answer is")[-1].strip(" .") if steps else ""

    PLUGIN = TaskPlugin(name="riddles", build=Riddles, options=Riddles)

Templates take `{question}`, `{steps}` (the path so far, one numbered line a step, then a blank
line; empty at the root) and `{n}` (the number of the step being written). A thought is the reply up
to the next step's header or a blank line; a state is valued as `value` says: `yes` (P(Yes) after the
evaluator, one forward), `expected` (the expected 1-10 score, one forward), `sampled` (the number in a
sampled reply) or `confidence` (the thought's own token probabilities, no evaluator asked).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tasks.base import (
    YES_NO,
    DataError,
    DataSpec,
    Problem,
    Prompt,
    TaskDefaults,
    check_evaluator,
    check_positive,
    check_value,
    read_jsonl,
    record_id,
    score_answers,
)

_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass
class TemplateTask(TaskDefaults):
    """A task from templates; the defaults read JSONL problems with `question` and `answer` fields, take
    the text after `answer_phrase` in the last step as the answer, and compare it with the gold
    answer ignoring case, spaces and a final full stop."""

    name: str = "template"
    depth: int = 4
    generator_template: str = "{question}\n\n{steps}Write step {n} of the solution, one short paragraph."
    generator_prefix: str = "Step {n}:"
    evaluator_template: str = (
        "{question}\n\nSteps so far:\n{steps}Is the last step correct and useful? Answer Yes or No."
    )
    solution_template: str = "{question}\n\nSolve it step by step, then say: The answer is ..."
    answer_phrase: str = "The answer is"
    value: str = "yes"
    n_evaluate: int = 1
    evaluator: str = "separate"  # or in_context (tasks.base.EVALUATORS)

    def __post_init__(self) -> None:
        check_positive(self.name, depth=self.depth, n_evaluate=self.n_evaluate)
        check_value(self.name, self.value, ("sampled", "expected", "yes", "confidence"))
        check_evaluator(self.name, self.evaluator)
        if not isinstance(self.answer_phrase, str) or not self.answer_phrase.strip():
            raise DataError(
                f"task.answer_phrase={self.answer_phrase!r} is empty: give the words a final step states its answer "
                "after (say 'The answer is')"
            )
        # Every templated field rendered as a search renders it, on a sample problem at the root and a
        # step in: a bad template stops the run here, before the model loads.
        sample = Problem(id="sample", question="What is 2 + 3?", gold="5")
        paths: tuple[list[str], ...] = ([], ["2 + 3 = 5."])
        renders: dict[str, Callable[[], object]] = {
            "generator_template": lambda: [self._fill(self.generator_template, sample, p) for p in paths],
            "generator_prefix": lambda: [self.generator_prefix.format(n=len(p) + 1) for p in paths],
            "evaluator_template": lambda: [self._fill(self.evaluator_template, sample, p) for p in paths],
            "solution_template": lambda: self._fill(self.solution_template, sample, []),
        }
        for key, render in renders.items():
            template = getattr(self, key)
            if not isinstance(template, str):
                raise DataError(f"task.{key}={template!r} is not text: give a template string")
            takes = "{n}" if key == "generator_prefix" else "{question}, {steps} and {n}"
            try:
                render()
            except Exception as e:  # any error of str.format: a field, an index, an attribute, a spec
                raise DataError(
                    f"task.{key}={template!r} is not a template of {takes} ({type(e).__name__}: {e}); write a "
                    "literal brace as {{ or }}"
                ) from None

    # What a problem is: override these where the defaults do not fit.

    def load(self, data: DataSpec) -> list[Problem]:
        if data.path is None:
            raise DataError(
                f"task={self.name} has no built-in problems; give data.path, a JSONL file of question/answer"
            )
        path = Path(data.path).expanduser()
        expected = "a JSONL file with a question and an answer per line"
        records = read_jsonl(path, ("question", "answer"), expected)
        problems = [
            Problem(record_id(path, line, r, str(i)), str(r["question"]), str(r["answer"]), line=line)
            for i, (line, r) in enumerate(records)
        ]
        return data.select(problems, f"data.path={data.path}")

    def answer(self, problem: Problem, steps: list[str]) -> str:
        last = steps[-1] if steps else ""
        at = last.lower().rfind(self.answer_phrase.lower())
        return (last[at + len(self.answer_phrase) :] if at >= 0 else last).strip(" :.\n")

    def is_correct(self, problem: Problem, answer: str) -> bool:
        return _plain(answer) == _plain(problem.gold)

    def is_terminal(self, problem: Problem, steps: list[str]) -> bool:
        return bool(steps) and self.answer_phrase.lower() in steps[-1].lower()

    # How it is prompted: from the templates.

    def _fill(self, template: str, problem: Problem, steps: list[str]) -> str:
        lines = "".join(f"{i}. {s}\n" for i, s in enumerate(steps, 1))
        return template.format(question=problem.question, steps=lines + "\n" if lines else "", n=len(steps) + 1)

    def generator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        prefix = self.generator_prefix.format(n=len(steps) + 1)
        header = self.generator_prefix.split("{", 1)[0].strip()
        stop = ("\n\n", f"\n{header}") if header else ("\n\n",)
        return Prompt(self._fill(self.generator_template, problem, steps), prefix=prefix, stop=stop)

    def parse_thought(self, problem: Problem, steps: list[str], text: str) -> str:
        return " ".join(text.split())

    def evaluator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        return self._ask(self._fill(self.evaluator_template, problem, steps))

    def follow_up_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        return self._ask(self._fill(self.evaluator_template, problem, steps))

    def solution_prompt(self, problem: Problem, i: int = 0) -> Prompt:
        return Prompt(self._fill(self.solution_template, problem, []))

    def solution_steps(self, problem: Problem, reply: str, i: int = 0) -> list[str]:
        return [p for p in (" ".join(p.split()) for p in reply.split("\n\n")) if p] or [reply.strip()]

    def solution_evaluator_prompt(self, problem: Problem, steps: list[str], follow_up: bool) -> Prompt:
        return self._ask(self._fill(self.evaluator_template, problem, steps))

    def _ask(self, text: str) -> Prompt:
        # yes: the Yes/No answer read after "Answer:"; otherwise a 1-10 score after "Score:".
        if self.value == "yes":
            return Prompt(text, prefix="Answer:", stop=("\n",))
        return Prompt(text + " Rate it from 1 to 10.", prefix="Score:", stop=("\n",))

    def parse_value(self, text: str) -> float:
        if self.value == "yes":
            return 1.0 if text.strip().lower().startswith("yes") else 0.0
        found = _NUMBER.search(text)
        return min(float(found.group()), 10.0) if found else 0.0

    def value_answers(self) -> dict[str, float]:
        return dict(YES_NO) if self.value == "yes" else score_answers(1, 10)


def _plain(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".")
