"""Best-of-N on a scripted task and engine: the three votes, solutions as chains of steps, one group,
seeds by solution, a tree that does not depend on which reply finished first, config checks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from helpers import ScriptedTask, reply

from decoding.base.values import Completion, DecodeStats, GenRequest, Group
from tasks.base import Problem, Prompt
from tot.runs.config import ConfigError
from tot.search.base import GenSettings, request_seed, run_sync
from tot.search.best_of_n import BestOfN, BestOfNSettings

PROBLEM = Problem(id="p", question="q", gold="")


@dataclass
class WholeTask(ScriptedTask):
    """A reply "s1|s2|...|ans" is the steps s1, s2, ..., ans; its answer is the last step; a solution
    is valued `values[answer position]` by the evaluator, which sees the solution's index."""

    values: dict[int, float] = field(default_factory=dict)
    depth: int = 3
    evaluator: str = "separate"
    name: str = "whole"

    def solution_prompt(self, problem, i=0):
        return Prompt("solve", prefix="S")

    def solution_steps(self, problem, text, i=0):
        return text.split("|")

    def solution_evaluator_prompt(self, problem, steps, follow_up):
        return Prompt("|".join(steps), prefix="E")


class ScriptEngine:
    """Solution i's reply is replies[i] (known by its seed); its value values[i]. With `reverse`,
    later solutions finish first."""

    def __init__(self, replies: list[str], values: list[float] | None = None, reverse: bool = False) -> None:
        self.seeds = {request_seed(0, "p", "solution", i): i for i in range(len(replies))}
        self.replies, self.values, self.reverse = replies, values or [], reverse
        self.requests: list[GenRequest] = []

    async def agenerate(self, requests: list[GenRequest]) -> Completion:
        self.requests += requests
        out = []
        for r in requests:
            if r.prefix == "S":
                i = self.seeds[r.seed]
                for _ in range(len(self.replies) - i if self.reverse else i + 1):
                    await asyncio.sleep(0)
                out.append(reply(self.replies[i], [1] * (i + 1)))
            else:
                i = next(i for i, text in enumerate(self.replies) if text.split("|") == r.prompt.split("|"))
                out.append(reply(str(self.values[i]), [1]))
        return Completion(out, DecodeStats(generated_tokens=sum(len(o.token_ids) for o in out)))


def solve(replies, values=None, aggregate="majority", reverse=False):
    engine = ScriptEngine(replies, values, reverse)
    search = BestOfN.over(
        WholeTask(), BestOfNSettings(n=len(replies), aggregate=aggregate, max_tokens=50), GenSettings(), 0
    )
    return run_sync(search.solve(PROBLEM, engine)), engine


REPLIES = ["a|x", "b|y", "c|d|y", "e|z"]


def test_majority_takes_the_most_frequent_answer_without_an_evaluator():
    sol, engine = solve(REPLIES)
    assert sol.answer == "y"
    assert sol.steps == ["b", "y"]  # the first solution of the winning answer
    assert {r.prefix for r in engine.requests} == {"S"}  # nothing valued


def test_weighted_and_best():
    values = [9, 4, 4, 3]
    assert solve(REPLIES, values, "weighted")[0].answer == "x"  # 9 > 4 + 4
    values = [7, 4, 4, 3]
    weighted, engine = solve(REPLIES, values, "weighted")
    assert weighted.answer == "y" and weighted.steps == ["b", "y"]  # 8 > 7; the first of equal values
    assert [r.prefix for r in engine.requests].count("E") == 4
    best, _ = solve(REPLIES, values, "best")
    assert best.answer == "x"


def test_solutions_are_chains_of_their_steps():
    sol, _ = solve(REPLIES)
    tree = sol.tree
    leaves = [n for n in tree.graph.nodes if tree[n].terminal]
    assert [tree.steps(n) for n in leaves] == [r.split("|") for r in REPLIES]
    assert [tree[n].solution for n in leaves] == [0, 1, 2, 3]
    firsts = list(tree.graph.successors(tree.root))
    assert [tree[n].reply for n in firsts] == REPLIES and [tree[n].tokens for n in firsts] == [1, 2, 3, 4]
    assert [tree[n].text for n in tree.graph.nodes if tree[n].answer] == ["q", "b", "y"]


def test_one_group_seeds_by_solution_and_the_solution_length():
    _, engine = solve(REPLIES, [1, 2, 3, 4], "best")
    solutions = [r for r in engine.requests if r.prefix == "S"]
    assert {r.group for r in solutions} == {Group("p", "solutions")}  # STAND's pool sees all N trajectories
    assert sorted(r.seed for r in solutions) == sorted(engine.seeds)
    assert {r.max_new_tokens for r in solutions} == {50}
    assert {r.group for r in engine.requests if r.prefix == "E"} == {Group("p", "solutions/eval")}


def test_the_tree_does_not_depend_on_which_reply_finished_first():
    in_order, _ = solve(REPLIES, [1, 2, 3, 4], "weighted")
    reversed_, _ = solve(REPLIES, [1, 2, 3, 4], "weighted", reverse=True)
    assert in_order.tree.to_dict() == reversed_.tree.to_dict()
    assert in_order.answer == reversed_.answer == "y"


def test_config():
    from test_run import make_config

    cfg = make_config("search=best_of_n", "search.n=16", "search.aggregate=weighted")
    assert cfg.search_settings == BestOfNSettings(n=16, aggregate="weighted")
    assert cfg.search_settings.scaled(4).n == 4
    for bad, named in (("search.aggregate=mean", "search.aggregate='mean'"), ("search.n=0", "search.n=0")):
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            make_config("search=best_of_n", bad)
    with pytest.raises(ConfigError, match=r"search\.n_thoughts is not an option of search"):
        make_config("search=best_of_n", "+search.n_thoughts=3")
