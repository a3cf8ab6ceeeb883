"""GSM8K: a thought is a paragraph of the model's own zero-shot solution (the default), a paragraph of
a Python function that computes the answer (run for it: tasks/program.py), or, as SEED sets it up
(Appendix D), a sub-question together with its answer, three of them and a final answer; a 1-10 value
with a short explanation for each state. Prompts are ours, written for a small chat model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cached_property
from importlib import resources
from pathlib import Path

from tasks.base import (
    YES_NO,
    DataError,
    DataSpec,
    Problem,
    Prompt,
    TaskDefaults,
    TaskPlugin,
    check_evaluator,
    check_positive,
    check_value,
    read_jsonl,
    record_id,
    score_answers,
)
from tasks.program import Runner, function_source

FINAL_PREFIX = "The answer is"
SCORE_PREFIX = "Score:"
YES_PREFIX = "Answer:"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_SCORE = re.compile(r"(?:score|rating|rate|value)\D{0,12}?(\d+(?:\.\d+)?)", re.IGNORECASE)


# What GSM8K evaluations read first (lm-evaluation-harness's strict match): the number stated right
# after the answer phrase: "The answer is 10.", "The final answer is: $1,250", "#### 72".
_STATED = re.compile(
    r"(?:\b(?:the\s+)?(?:final\s+)?answer\s+is|####)\s*[:=]?\s*(?:\*\*|\\boxed\{)?\s*"
    r"(?:approximately\s+|about\s+)?(?P<sign>[-−])?\s*\$?\s*(?P<minus>[-−])?(?P<number>\d[\d,]*(?:\.\d+)?)"
    # Not the first operand of a calculation ("The answer is 40 - 12 = 28."): no number stated.
    r"(?!\d|[,.]\d|\s*(?:[-+/×÷=:^]|\*(?!\*)|x\s*\d))",
    re.IGNORECASE,
)
# A boxed number, as chat models trained on math state their answer: "\\boxed{10}", "\\boxed{\\$1,250}".
_BOXED = re.compile(r"\\boxed\{\s*(?:\\?\$\s*)?(-?\d[\d,]*(?:\.\d+)?)\s*\}")
# Where the stated answer's sentence ends: a full stop after it, not a decimal point.
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")


def strict_answer(text: str) -> str | None:
    """The number stated after the first answer phrase ("The answer is N", "#### N"), else the last
    boxed number (chat models' "\\boxed{N}"), or None."""
    m = _STATED.search(text)
    if m is None:
        boxed = _BOXED.findall(text)
        return normalize_number(re.sub(r",(?=\d{3})", "", boxed[-1])) if boxed else None
    number = re.sub(r",(?=\d{3})", "", m.group("number")).rstrip(",")
    return normalize_number(("-" if m.group("sign") or m.group("minus") else "") + number)


def stated_sentence(text: str) -> str:
    """`text` cut after the sentence that states the answer ("The answer is 10. To calculate ..." ->
    "The answer is 10."); unchanged when no answer is stated."""
    m = _STATED.search(text)
    if m is None:
        return text
    end = _SENTENCE_END.search(text, m.end())
    return text if end is None else text[: end.end()].rstrip()


def extract_number(text: str) -> str | None:
    """The last number in text, with thousands separators and currency signs removed (the flexible
    extraction)."""
    cleaned = re.sub(r"(?<=\d),(?=\d{3})", "", text).replace("$", "")
    found = _NUMBER.findall(cleaned)
    if not found:
        return None
    value = found[-1].rstrip(".")
    return normalize_number(value)


def normalize_number(value: str) -> str:
    """'18.00' -> '18', '-3.50' -> '-3.5': one spelling per number, for exact comparison."""
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return "0" if value in ("-0", "") else value


def gold_answer(answer: str) -> str:
    """The number after '####' in a GSM8K answer field."""
    if "####" not in answer:
        raise ValueError("no '####' in the answer")
    tail = answer.split("####")[-1].strip().replace(",", "").replace("$", "")
    if not _NUMBER.fullmatch(tail):
        raise ValueError(f"'{tail}' after '####' is not a number")
    return normalize_number(tail)


def parse_value(text: str) -> float:
    """A 1-10 value from an evaluation: 'Score: 7', else the first number in range; 0 if none."""
    m = _SCORE.search(text)
    candidates = [m.group(1)] if m else []
    candidates += _NUMBER.findall(text)
    for c in candidates:
        v = float(c)
        if 1 <= v <= 10:
            return v
    return 0.0


# What a thought is, with the depth a path is bounded by unless task.depth says otherwise:
# paragraphs: a paragraph of the model's own solution (a path ends where one states the answer; of
#   the 0.5B's BFS paths on 30 test problems most took 5-7); code: a paragraph of a Python function
#   `solution()` (a path ends at its `return`; the answer is what it returns when run); subquestions:
#   SEED's setup, a sub-question and its answer a thought, the final answer at the depth.
THOUGHTS = {"paragraphs": 10, "code": 12, "subquestions": 4}
# How best-of-N writes its whole solutions where the thoughts are written (with task.thoughts=code every
# one is a function): same, written out, or mixed: the i-th the (i mod 2)-th way of MIXED, whose errors
# differ (the 0.5B's greedy chains, first 100 test problems: 22 right written out, 23 as code, 10 both).
SOLUTIONS = ("same", "mixed")
MIXED = ("paragraphs", "code")
# Where the model's function starts: its reply is the body, so a path's steps are the body's paragraphs.
CODE_HEAD = "def solution():"
CODE_PREFIX = f"```python\n{CODE_HEAD}\n"
# Where the function has ended: the code block closes, or a line that is not indented starts (the model
# goes on to test calls and prints; a stop is a string, so these are the starts it writes).
CODE_END = ("```", "\n#", "\ndef ", "\nprint", "\nassert", "\nif ", "\nresult", "\nanswer", "\nsolution")
CODE_GAP = "\n    \n"  # the blank line between a function's paragraphs, as the Qwen2.5-Coder models write it
# A code paragraph ends at a blank line (the model writes it indented or not) or where the function does.
CODE_STOPS = ("\n\n", CODE_GAP, *CODE_END)
_RETURN = re.compile(r"^\s{4}return\b", re.MULTILINE)


def indented(step: str) -> str:
    """A code paragraph as it stands in the function: a step is stored stripped, as every step is, so
    its first line's indentation is read back from the lines after it (one level less after a line
    ending in a colon), at least the function body's four spaces."""
    first, *rest = step.splitlines() or [""]
    below = [len(line) - len(line.lstrip()) for line in rest if line.strip()]
    if not below:
        return "    " + step
    depth = below[0] - (4 if first.rstrip().endswith(":") else 0)
    return " " * max(4, depth) + step


@dataclass
class GSM8K(TaskDefaults):
    depth: int = 0  # 0: THOUGHTS' depth for `thoughts`
    n_evaluate: int = 1
    evaluator: str = "separate"
    thoughts: str = "paragraphs"
    solutions: str = "mixed"
    value: str = "confidence"
    rollouts: int = 2  # task.value=rollout: completions sampled from each state
    rollout_tokens: int = 384  # the longest completion (as best-of-N's whole solutions)
    name: str = "gsm8k"

    def __post_init__(self) -> None:
        if self.thoughts not in THOUGHTS:
            raise DataError(f"task.thoughts={self.thoughts!r} is not one of {', '.join(THOUGHTS)}")
        self.depth = self.depth or THOUGHTS[self.thoughts]
        check_positive(
            self.name,
            depth=self.depth,
            n_evaluate=self.n_evaluate,
            rollouts=self.rollouts,
            rollout_tokens=self.rollout_tokens,
        )
        check_evaluator(self.name, self.evaluator)
        check_value(self.name, self.value)
        if self.solutions not in SOLUTIONS:
            raise DataError(f"task.solutions={self.solutions!r} is not one of {', '.join(SOLUTIONS)}")
        if self.value == "rollout" and self.thoughts == "subquestions":
            raise DataError(
                "task.value=rollout completes a state's solution paragraph by paragraph: use it with "
                "task.thoughts=paragraphs or code (sub-questions are not a solution a completion can continue)"
            )

    @cached_property
    def program(self) -> Runner:
        """task.thoughts=code: runs a path's function, each once."""
        return Runner()

    def value_answers(self) -> dict[str, float]:
        return YES_NO if self.value == "yes" else score_answers(1, 10)

    def _rate(self, question: str, yes: str, low: str, high: str, stop: tuple[str, ...] = ("\n\n",)) -> Prompt:
        """An evaluation's question and how it is answered: a 1-10 score ("Score: 7", explained in a
        sentence: what task.value=sampled reads, and expected in one forward), or Yes / No (task.value=yes)."""
        if self.value == "yes":
            return Prompt(f"{yes} Answer Yes or No.", prefix=YES_PREFIX, stop=("\n",))
        return Prompt(
            f'{question} Rate it from 1 ({low}) to 10 ({high}). Reply as "Score: <number>", then one sentence '
            "explaining why.",
            prefix=SCORE_PREFIX,
            stop=stop,
        )

    def load(self, data: DataSpec) -> list[Problem]:
        if data.path:
            path = Path(data.path).expanduser()
        else:
            path = Path(str(resources.files("tasks.data") / "gsm8k_examples.jsonl"))
        problems = []
        for i, (lineno, rec) in enumerate(read_jsonl(path, ("question", "answer"))):
            try:
                gold = gold_answer(str(rec["answer"]))
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: {e}; the answer must end with '#### <number>'") from None
            question = rec["question"]
            if not isinstance(question, str) or not question.strip():
                raise DataError(f"{path}:{lineno}: the question is {question!r}; give each problem its question text")
            pid = record_id(path, lineno, rec, f"{path.stem}-{i}")
            problems.append(Problem(id=pid, question=question, gold=gold, line=lineno))
        return data.select(problems, f"data file {path}")

    # --- thought generator -------------------------------------------------------------------
    def generator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        if self.thoughts == "paragraphs":  # the model's own solution, continued a paragraph at a time
            solve = self.whole_prompt(problem, "paragraphs")
            return Prompt(solve.text, prefix="".join(f"{s}\n\n" for s in steps), stop=("\n\n",))
        if self.thoughts == "code":  # the function's body, likewise
            solve = self.whole_prompt(problem, "code")
            body = "".join(f"{indented(s)}{CODE_GAP}" for s in steps)
            return Prompt(solve.text, prefix=solve.prefix + body, stop=CODE_STOPS)
        k = len(steps) + 1
        head = f"Question: {problem.question}\n\n{_steps_block(steps)}\n\n"
        if k < self.depth:
            return Prompt(
                head + "Break the question into small steps. Write only the next step: one sub-question "
                "that moves toward the final answer, then its answer with the calculation, in this form:\n"
                f"Sub-question {k}: <question>\nSub-answer {k}: <answer>",
                prefix=f"Sub-question {k}:",
                stop=(f"Sub-question {k + 1}", "\n\n"),
            )
        return Prompt(
            head + 'Using the steps above, give the final answer to the question as "The answer is <number>."',
            prefix=FINAL_PREFIX,
            stop=("\n",),
        )

    def parse_thought(self, problem: Problem, steps: list[str], text: str) -> str:
        if self.thoughts != "subquestions":
            return text.strip()
        return (self.generator_prompt(problem, steps).prefix + text).strip()

    def is_terminal(self, problem: Problem, steps: list[str]) -> bool:
        # A paragraph that states the answer ends the solution, one that returns ends the function
        # (or one that leaves it: a line not indented); sub-questions end at the depth.
        if not steps or self.thoughts == "subquestions":
            return False
        if self.thoughts == "code":
            last = indented(steps[-1])
            left = any(line.strip() and not line[0].isspace() for line in last.splitlines())
            return left or bool(_RETURN.search(last))
        return strict_answer(steps[-1]) is not None

    # --- state evaluator ---------------------------------------------------------------------
    def evaluator_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        *before, last = steps
        if self.thoughts != "subquestions":
            if self.thoughts == "code":
                so_far = "\n\n".join(indented(s) for s in before) or "    (nothing yet)"
                so_far, last = f"{CODE_PREFIX}{so_far}\n```", indented(last)
            else:
                so_far = "\n\n".join(before) if before else "(nothing yet)"
            head = f"Question: {problem.question}\n\nA solution so far:\n{so_far}\n\nIts next part:\n{last}\n\n"
            asked = self._rate(
                "Is the next part correct (its facts taken from the question, its arithmetic right) and a step toward "
                "the answer?",
                "Is the next part correct (its facts taken from the question, its arithmetic right)?",
                "wrong",
                "certainly correct",
            )
            return replace(asked, text=head + asked.text)
        final = len(steps) >= self.depth
        what = "final answer" if final else "latest step"
        if final:  # the final step may run past its answer (it stops at a newline): value what it states
            last = stated_sentence(last)
        head = f"Question: {problem.question}\n\n{_steps_block(before)}\n\nThe {what} is:\n{last}\n\n"
        asked = self._rate(
            f"How much does the {what} help to answer the question correctly?",
            f"Is the {what} correct and helpful to answer the question?",
            "wrong or useless",
            "correct and very helpful",
        )
        return replace(asked, text=head + asked.text)

    def follow_up_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        # Short on purpose: this turn is all an in-context evaluation computes, and its value is
        # the score on the reply's first line.
        what = "final answer correct" if len(steps) >= self.depth else "step correct and helpful"
        if self.value == "yes":
            return Prompt(f"Is this {what}? Answer Yes or No.", prefix=YES_PREFIX, stop=("\n",))
        return Prompt(f"Is this {what}? Score it from 1 to 10.", prefix=SCORE_PREFIX, stop=("\n",))

    def parse_value(self, text: str) -> float:
        return parse_value(SCORE_PREFIX + text)

    # --- whole solutions (best-of-N) ---------------------------------------------------------
    def kind(self, i: int) -> str:
        """How the i-th whole solution is written: as a function or written out (`paragraphs`)."""
        if self.thoughts == "code":
            return "code"
        return MIXED[i % len(MIXED)] if self.solutions == "mixed" else "paragraphs"

    def solution_prompt(self, problem: Problem, i: int = 0) -> Prompt:
        return self.whole_prompt(problem, self.kind(i))

    def whole_prompt(self, problem: Problem, kind: str) -> Prompt:
        """A whole solution's prompt written the `kind` way (a tree's paths continue its reply)."""
        if kind == "code":
            # The reply starts inside the function, so every reply is a body to run.
            return Prompt(
                f"{problem.question}\n\nWrite a Python function `solution()` that computes the answer to this "
                "problem step by step, with a variable for each quantity, and returns the final number. Reply with "
                "the code only.",
                prefix=CODE_PREFIX,
                stop=CODE_END,
            )
        # Zero-shot, in the chat model's own style: on the first 50 GSM8K test problems the
        # Qwen2.5-Coder-0.5B solved 12 this way against 5 with Wei et al.'s few-shot chains, whose
        # terse one-paragraph form it copied and made more mistakes in.
        return Prompt(
            f"{problem.question}\n\nSolve the problem step by step, then end with the sentence "
            '"The answer is <number>."',
        )

    def rollout_prompt(self, problem: Problem, steps: list[str]) -> Prompt:
        # The prompt the state's next paragraphs are sampled from, without the paragraph stop: its keys
        # and values are those its children's thoughts read.
        return replace(self.generator_prompt(problem, steps), stop=CODE_END if self.thoughts == "code" else ())

    def solution_steps(self, problem: Problem, reply: str, i: int = 0) -> list[str]:
        # A whole program is kept as its function, so a path says itself whether it is code.
        return [function_source("solution", reply).rstrip()] if self.kind(i) == "code" else [reply.strip()]

    def solution_evaluator_prompt(self, problem: Problem, steps: list[str], follow_up: bool) -> Prompt:
        if follow_up:
            if self.value == "yes":
                return Prompt("Is this final answer correct? Answer Yes or No.", prefix=YES_PREFIX, stop=("\n",))
            return Prompt("Is this final answer correct? Score it from 1 to 10.", prefix=SCORE_PREFIX, stop=("\n",))
        asked = self._rate(
            "Is the solution's reasoning and final answer correct?",
            "Is the solution's reasoning and final answer correct?",
            "wrong",
            "certainly correct",
        )
        shown = self._program(steps) if self._is_code(steps) else steps[-1]
        return replace(asked, text=f"Question: {problem.question}\n\nA solution:\n{shown}\n\n{asked.text}")

    # --- scoring -----------------------------------------------------------------------------
    def answer(self, problem: Problem, steps: list[str]) -> str:
        """The stated answer, else the last number of the final step."""
        found = self.answers(problem, steps)
        return found["strict"] or found["flexible"]

    def answers(self, problem: Problem, steps: list[str]) -> dict[str, str]:
        """Both extractions of the final step, as lm-evaluation-harness reports GSM8K: `strict` (the
        number after the answer phrase, "" if none is stated) and `flexible` (its last number). With
        task.thoughts=code both are what the path's function returns when run ("" if it fails)."""
        if self._is_code(steps):
            returned = self.program.value(self._program(steps))
            return {"strict": returned, "flexible": returned}
        last = steps[-1] if steps else ""
        return {"strict": strict_answer(last) or "", "flexible": extract_number(last) or ""}

    def _is_code(self, steps: list[str]) -> bool:
        return bool(steps) and (self.thoughts == "code" or steps[0].startswith(CODE_HEAD))

    def _program(self, steps: list[str]) -> str:
        """A code path's function: a whole one as written, or a tree's paragraphs in order, cut where the
        function ends."""
        if steps[0].startswith(CODE_HEAD):
            return function_source("solution", steps[0].removeprefix(CODE_HEAD).lstrip("\n"))
        return function_source("solution", "\n\n".join(indented(s) for s in steps))

    def is_correct(self, problem: Problem, answer: str) -> bool:
        return bool(answer) and answer == problem.gold


def _steps_block(steps: list[str]) -> str:
    if not steps:
        return "Steps so far: none yet."
    return "Steps so far:\n" + "\n".join(steps)


PLUGIN = TaskPlugin(name="gsm8k", build=GSM8K, options=GSM8K)
