"""DVTS on a scripted task and engine: subtrees, one engine call per step, finished subtrees stop,
aggregation by best value and by weighted vote, seeds, groups, config checks."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from helpers import AwaitableFake, ScriptedTask, reply

from decoding.base.values import DecodeStats, GenRequest, GenResult, Group
from tasks.base import Problem
from tot.runs.config import ConfigError
from tot.search.base import GenSettings, run_sync
from tot.search.dvts import DVTS, DVTSSettings

PROBLEM = Problem(id="p", question="q", gold="")


@dataclass
class ScriptTask(ScriptedTask):
    """Thought k is the text "t<k>"; its value is values[k]; thoughts in `terminal` finish a path;
    a path's answer is answers[k] of its last thought k (default: "a<k>")."""

    values: dict[int, float]
    terminal: set[int] = field(default_factory=set)
    answers: dict[int, str] = field(default_factory=dict)
    depth: int = 3
    name: str = "script"

    def is_terminal(self, problem, steps):
        return int(steps[-1][1:]) in self.terminal

    def answer(self, problem, steps):
        k = int(steps[-1][1:])
        return self.answers.get(k, f"a{k}")


class ScriptEngine(AwaitableFake):
    def __init__(self, task: ScriptTask) -> None:
        self.task, self.thoughts, self.calls = task, 0, []
        self.last_stats = DecodeStats()

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        # `calls`: runs of calls of one kind (thoughts "G" or evaluations "E"), a step as the engine sees it.
        if self.calls and (self.calls[-1][0].prefix == "E") == (requests[0].prefix == "E"):
            self.calls[-1].extend(requests)
        else:
            self.calls.append(list(requests))
        out = []
        for r in requests:
            if r.prefix == "E":
                out.append(reply(str(self.task.values[int(r.prompt[1:])]), [1]))
            else:
                out.append(reply(f"t{self.thoughts}", [1, 2]))
                self.thoughts += 1
        self.last_stats = DecodeStats(generated_tokens=sum(len(o.token_ids) for o in out), target_forwards=1)
        return out


def solve(values, n=4, width=2, aggregate="best", depth=3, **task_kw):
    task = ScriptTask(values=values, depth=depth, **task_kw)
    engine = ScriptEngine(task)
    dvts = DVTS.over(task, DVTSSettings(n=n, beam_width=width, aggregate=aggregate), GenSettings(), seed=0)
    sol = run_sync(dvts.solve(PROBLEM, engine))
    return sol, engine


def node_of(sol, k: int) -> int:
    return next(n for n, t in sol.tree.thoughts.items() if t.text == f"t{k}")


# n=4, width 2: subtrees 0 and 1. Step 1: t0,t1 (subtree 0), t2,t3 (subtree 1).
VALUES = {0: 1, 1: 5, 2: 7, 3: 7, 4: 2, 5: 3, 6: 9, 7: 1, 8: 4, 9: 6, 10: 8, 11: 8}


def test_subtrees_expand_their_best_candidate():
    sol, engine = solve(VALUES)
    gen_calls = [c for c in engine.calls if c[0].prefix == "G"]
    assert [len(c) for c in gen_calls] == [4, 4, 4]  # every live subtree's candidates in one call
    assert [len(c) for c in engine.calls if c[0].prefix == "E"] == [4, 4, 4]
    t = sol.tree
    # subtree 0 keeps t1 (5 > 1), subtree 1 keeps t2 (7 = 7: the first of equals)
    assert t[node_of(sol, 1)].chosen and t[node_of(sol, 2)].chosen
    assert not t[node_of(sol, 3)].chosen
    # step 2: t4,t5 continue t1; t6,t7 continue t2
    assert sol.tree.steps(node_of(sol, 5)) == ["t1", "t5"] and sol.tree.steps(node_of(sol, 6)) == ["t2", "t6"]
    assert {t[node_of(sol, k)].subtree for k in (0, 1, 4, 5, 8, 9)} == {0}
    assert {t[node_of(sol, k)].subtree for k in (2, 3, 6, 7, 10, 11)} == {1}
    # step 3: subtree 0 ends at t9 (6), subtree 1 at t10 (8) -> best is subtree 1
    assert sol.answer == "a10"
    answer_path = [n for n in t.graph if t[n].answer]
    assert [t[n].text for n in answer_path] == ["q", "t2", "t6", "t10"]


def test_groups_and_seeds():
    _, engine = solve(VALUES)
    first = engine.calls[0]
    assert {r.group for r in first} == {Group("p", "d1")}  # all subtrees of a step share one STAND pool
    assert len({r.seed for r in first}) == 4  # subtrees starting from the root still sample apart
    assert {r.group for r in engine.calls[1]} == {Group("p", "d1/eval")}
    again = solve(VALUES)[1]
    assert [r.seed for c in again.calls for r in c] == [r.seed for c in engine.calls for r in c]


def test_finished_subtrees_stop():
    # t1 finishes subtree 0 at step 1: later steps expand subtree 1 only.
    sol, engine = solve(VALUES, terminal={1})
    assert [len(c) for c in engine.calls if c[0].prefix == "G"] == [4, 2, 2]
    assert sol.tree[node_of(sol, 1)].terminal
    # subtree 1: t2 -> t4,t5 (2, 3) -> t5 -> t6,t7 (9, 1) -> t6; best final values: t1 5, t6 9
    assert sol.answer == "a6"


def test_all_finished_ends_early():
    _, engine = solve(VALUES, terminal={1, 2})
    assert len(engine.calls) == 2


def test_weighted_vote_beats_single_best():
    # n=6, width 1: 6 subtrees, depth 1. Values 9, 4, 4, 3, 1, 1; answers x, y, y, y, z, z.
    values = {0: 9, 1: 4, 2: 4, 3: 3, 4: 1, 5: 1}
    answers = {0: "x", 1: "y", 2: "y", 3: "y", 4: "z", 5: "z"}
    best, _ = solve(values, n=6, width=1, depth=1, answers=answers)
    vote, _ = solve(values, n=6, width=1, depth=1, answers=answers, aggregate="vote")
    assert best.answer == "x"
    assert vote.answer == "y"  # 4 + 4 + 3 = 11 > 9
    answer_nodes = [n for n, t in vote.tree.thoughts.items() if t.answer and n != 0]
    assert [vote.tree[n].text for n in answer_nodes] == ["t1"]  # the best state of the winning answer


def test_vote_ties_go_to_more_subtrees_then_earlier():
    values = {0: 2, 1: 1, 2: 1, 3: 2}
    answers = {0: "x", 1: "y", 2: "y", 3: "z"}
    vote, _ = solve(values, n=4, width=1, depth=1, answers=answers, aggregate="vote")
    assert vote.answer == "y"  # x, y and z weigh 2 each; y has two subtrees
    values = {0: 2, 1: 2}
    vote, _ = solve(values, n=2, width=1, depth=1, answers={0: "x", 1: "y"}, aggregate="vote")
    assert vote.answer == "x"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["search.n=6", "search.beam_width=4"], "search.n=6 is not a multiple of search.beam_width=4"),
        (["search.beam_width=0"], "search.beam_width=0"),
        (["search.aggregate=mean"], "search.aggregate='mean' is not one of best, vote"),
    ],
)
def test_config_errors(overrides, named):
    from test_run import make_config

    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        make_config("search=dvts", *overrides)


def test_config_reads_dvts():
    from test_run import make_config

    cfg = make_config("search=dvts", "search.n=8", "search.beam_width=4", "search.aggregate=vote")
    assert cfg.search == "dvts" and cfg.search_settings == DVTSSettings(n=8, beam_width=4, aggregate="vote")
    assert cfg.search_settings.subtrees == 2
