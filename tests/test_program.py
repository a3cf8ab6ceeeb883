"""Answers from programs (tasks/program.py, GSM8K's task.thoughts=code): a model's function checked
before it runs, run in a limited child Python, its value read as GSM8K writes answers; a code path's
paragraphs indented back into one function; a rollout-valued BFS and best-of-N over scripted code."""

from __future__ import annotations

import time

import pytest
from helpers import reply

from decoding.base.values import Completion, DecodeStats, GenRequest
from tasks.base import DataError, Problem
from tasks.gsm8k import CODE_END, CODE_PREFIX, CODE_STOPS, GSM8K, indented
from tasks.program import Runner, function_source, number, refusal
from tot.search.base import GenSettings, run_sync
from tot.search.best_of_n import BestOfN, BestOfNSettings
from tot.search.bfs import BFS, BFSSettings
from tot.search.vote import VoteRule

PROBLEM = Problem(id="p", question="Two boxes of 3 eggs each. How many eggs?", gold="6")


def test_the_function_ends_where_a_line_is_not_indented():
    body = "    a = 3\n\n    return a * 2\n\n# Check it\nprint(solution())\n"
    assert function_source("solution", body) == "def solution():\n    a = 3\n\n    return a * 2\n"


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("def solution():\n    import os\n    return 1\n", "imports os"),
        ("def solution():\n    from subprocess import run\n    return 1\n", "imports subprocess"),
        ("def solution():\n    return open('x').read()\n", "calls open"),
        ("def solution():\n    return eval('1')\n", "calls eval"),
        ("def solution():\n    return ().__class__\n", "reads .__class__"),
        ("def solution():\n    return (\n", "syntax"),
    ],
)
def test_a_program_that_reaches_past_arithmetic_is_refused(source: str, why: str):
    assert refusal(source).startswith(why)
    assert Runner().value(source) == ""


def test_pure_modules_may_be_imported():
    assert refusal("def solution():\n    import math\n    from fractions import Fraction\n    return 1\n") == ""


@pytest.mark.parametrize(
    ("returned", "answer"),
    [
        ("12", "12"),
        ("12.0", "12"),
        ("2.5", "2.5"),
        ("-3", "-3"),
        ("'$1,250'", "1250"),
        ("0.1 + 1e-9", "0.1"),
        ("inf", ""),
        ("None", ""),
        ("'many'", ""),
    ],
)
def test_a_returned_value_reads_as_gsm8k_writes_answers(returned: str, answer: str):
    assert number(returned) == answer


def test_a_program_runs_for_its_value_once():
    runner = Runner()
    source = "def solution():\n    total = 0\n    for box in range(2):\n        total += 3\n    return total / 1\n"
    assert runner.value(source) == "6"
    calls = []
    runner._run = lambda *a: calls.append(a) or "7"  # type: ignore[method-assign]
    assert runner.value(source) == "6" and calls == []  # read back, not run again


def test_a_program_that_fails_or_runs_on_has_no_answer():
    runner = Runner(seconds=1.0)
    assert runner.value("def solution():\n    return 1 / 0\n") == ""
    assert runner.value("def solution():\n    x = 1\n") == ""  # returns None
    start = time.monotonic()
    assert runner.value("def solution():\n    while True:\n        pass\n") == ""
    assert time.monotonic() - start < 5.0
    assert runner.value("def solution():\n    return [0] * 10 ** 10\n") == ""  # past the memory limit


def test_a_stored_code_paragraph_is_indented_back_into_the_function():
    assert indented("a = 3") == "    a = 3"
    assert indented("# eggs\n    eggs = 16") == "    # eggs\n    eggs = 16"
    assert indented("for i in range(2):\n        total += i") == "    for i in range(2):\n        total += i"
    assert indented("if a:\n            b = 1") == "        if a:\n            b = 1"  # inside a block


def code_task(**options) -> GSM8K:
    return GSM8K(**{"thoughts": "code", "solutions": "same", **options})


def test_a_code_path_is_answered_by_running_its_function():
    task = code_task()
    steps = ["boxes = 2", "eggs = 3", "return boxes * eggs\n\n# Test\nprint(solution())"]
    assert task.answers(PROBLEM, steps) == {"strict": "6", "flexible": "6"}
    assert task.is_correct(PROBLEM, task.answer(PROBLEM, steps))
    assert task.is_terminal(PROBLEM, steps) and not task.is_terminal(PROBLEM, steps[:2])
    prompt = task.generator_prompt(PROBLEM, steps[:2])
    assert prompt.prefix == CODE_PREFIX + "    boxes = 2\n    \n    eggs = 3\n    \n" and prompt.stop == CODE_STOPS
    assert task.rollout_prompt(PROBLEM, steps[:2]).stop == CODE_END
    assert task.solution_prompt(PROBLEM).prefix == CODE_PREFIX
    assert task.depth == 12


def test_rollout_values_take_code_but_not_subquestions():
    assert code_task(value="rollout").value == "rollout"
    with pytest.raises(DataError, match=r"task\.thoughts=paragraphs or code"):
        GSM8K(thoughts="subquestions", value="rollout")


class CodeEngine:
    """Code as a small model writes it: from the empty body first paragraphs `eggs = 3` (right),
    `eggs = 4` (wrong), `eggs = 3` in turn, then `return` of twice the eggs; completions return the
    state's eggs twice; a whole solution (best-of-N) the i-th of SOLUTIONS."""

    SOLUTIONS = ("    eggs = 3\n    return eggs * 2\n", "    return 7\n", "    eggs = 3\n    return 2 * eggs\n")

    def __init__(self) -> None:
        self.requests: list[GenRequest] = []
        self.solutions = 0
        self.firsts = 0

    async def agenerate(self, requests: list[GenRequest]) -> Completion:
        self.requests += requests
        out = [reply(self.text(r), [1, 2, 3]) for r in requests]
        return Completion(out, DecodeStats(generated_tokens=3 * len(out)))

    def text(self, r: GenRequest) -> str:
        body = r.prefix.removeprefix(CODE_PREFIX)
        if r.stop == CODE_STOPS:  # a thought
            if not body:
                self.firsts += 1
                return "    eggs = 4" if self.firsts % 3 == 2 else "    eggs = 3"
            return "    return eggs * 2"
        if body:  # a completion of a state
            return "    return eggs * 2\n\nprint(solution())"
        self.solutions += 1
        return self.SOLUTIONS[(self.solutions - 1) % len(self.SOLUTIONS)]


def test_a_rollout_valued_bfs_searches_code_and_votes_on_what_it_returns():
    engine = CodeEngine()
    task = code_task(value="rollout", rollouts=2)
    search = BFS.over(task, BFSSettings(n_thoughts=3), GenSettings(), 0, vote=VoteRule(weight="one"))
    sol = run_sync(search.solve(PROBLEM, engine))
    tree = sol.tree
    firsts = tree.children(tree.root)
    assert [tree[n].text for n in firsts] == ["eggs = 3", "eggs = 4", "eggs = 3"]
    # Completions run: 6, 6 below each `eggs = 3`, 8, 8 below `eggs = 4`: the plurality is 6.
    ran = [[task.answer(PROBLEM, tree.steps(c)) for c in tree.rollouts(n)] for n in firsts]
    assert ran == [["6", "6"], ["8", "8"], ["6", "6"]]
    assert [tree[n].value for n in firsts] == [1.0, 0.0, 1.0]
    assert sol.answer == "6" and not any(tree[c].chosen for c in [firsts[1]])
    assert all(r.stop == CODE_END for r in engine.requests if r.stop != CODE_STOPS)


def test_best_of_n_votes_on_what_the_programs_return():
    engine = CodeEngine()
    search = BestOfN.over(code_task(), BestOfNSettings(n=3), GenSettings(), 0)
    sol = run_sync(search.solve(PROBLEM, engine))
    assert sol.answer == "6"  # 6, 7, 6
    assert {r.prefix for r in engine.requests} == {CODE_PREFIX}
    first = sol.tree.children(sol.tree.root)[0]
    assert sol.tree[first].text == "def solution():\n    eggs = 3\n    return eggs * 2"  # kept as its function


class MixedEngine(CodeEngine):
    """Written solutions state 7, 6, 7 in turn; programs return 6 (CodeEngine's first)."""

    def text(self, r: GenRequest) -> str:
        if r.prefix == CODE_PREFIX:
            return "    eggs = 3\n    return eggs * 2\n\nprint(solution())"
        self.solutions += 1
        return f"Two boxes. The answer is {7 if self.solutions % 2 else 6}."


def test_mixed_solutions_alternate_written_and_code_and_vote_together():
    engine = MixedEngine()
    task = GSM8K(solutions="mixed")
    search = BestOfN.over(task, BestOfNSettings(n=4), GenSettings(), 0)
    sol = run_sync(search.solve(PROBLEM, engine))
    # Written 7 and 6 (solutions 0 and 2), programs 6 and 6 (1 and 3): 6 three times.
    assert [r.prefix for r in engine.requests] == ["", CODE_PREFIX, "", CODE_PREFIX]
    assert sol.answer == "6"
    tree = sol.tree
    answers = [task.answer(PROBLEM, tree.steps(n)) for n in tree.children(tree.root)]
    assert answers == ["7", "6", "6", "6"]
    # A tree's thoughts stay what task.thoughts says, whatever solution 0 is.
    assert task.generator_prompt(PROBLEM, []).prefix == ""
    coded = GSM8K(thoughts="code", solutions="mixed")
    assert coded.generator_prompt(PROBLEM, []).prefix == CODE_PREFIX
    assert {coded.solution_prompt(PROBLEM, i).prefix for i in range(4)} == {CODE_PREFIX}  # every one a function
    with pytest.raises(DataError, match=r"task\.solutions='both' is not one of same, mixed"):
        GSM8K(solutions="both")
