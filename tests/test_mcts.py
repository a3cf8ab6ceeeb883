"""MCTS on a scripted task and engine: expansion and simulation, waves under virtual loss, the
iteration budget, backed-up returns, the answer, a tree that does not depend on completion order,
config checks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from helpers import ScriptedTask, reply

from decoding.base.values import Completion, DecodeStats, GenRequest
from tasks.base import Problem
from tot.runs.config import ConfigError
from tot.search.base import GenSettings, run_sync
from tot.search.mcts import MCTS, MCTSSettings

PROBLEM = Problem(id="p", question="q", gold="")


@dataclass
class HashTask(ScriptedTask):
    """A thought is "h<seed>" of the request that wrote it; its value is seed % 7; paths run to `depth`."""

    depth: int = 3
    name: str = "hash"


class HashEngine:
    """Replies as HashTask says; with `scramble`, each request waits a seed-given number of turns, so
    requests finish out of order."""

    def __init__(self, scramble: bool = False) -> None:
        self.scramble, self.calls = scramble, []

    async def agenerate(self, requests: list[GenRequest]) -> Completion:
        self.calls.append(requests)
        for _ in range(requests[0].seed % 5 if self.scramble else 1):
            await asyncio.sleep(0)
        out = [
            reply(f"h{r.seed}", [1, 2]) if r.prefix == "G" else reply(str(int(r.prompt[1:]) % 7), [1]) for r in requests
        ]
        return Completion(out, DecodeStats(generated_tokens=sum(len(o.token_ids) for o in out)))


def solve(scramble=False, depth=3, **settings):
    engine = HashEngine(scramble)
    search = MCTS.over(HashTask(depth=depth), MCTSSettings(**settings), GenSettings(), seed=0)
    return run_sync(search.solve(PROBLEM, engine)), engine


def children(tree, node):
    return list(tree.graph.successors(node))


def test_one_iteration_expands_the_root_and_simulates_its_best_child():
    sol, _ = solve(iterations=1, n_thoughts=3, simulation_depth=1)
    tree = sol.tree
    first = children(tree, tree.root)
    assert len(first) == 3 and all(tree[c].value is not None for c in first)
    best = max(first, key=lambda c: tree[c].value)
    assert [len(children(tree, c)) for c in first] == [3 if c == best else 0 for c in first]
    assert tree.graph.number_of_nodes() == 1 + 3 + 3
    end = max(children(tree, best), key=lambda c: tree[c].value)
    # The return is the value of the state the simulation ended in, backed up along the path.
    for node in (tree.root, best, end):
        assert tree[node].visits == 1 and tree[node].q == tree[end].value


def test_a_wave_selects_apart_under_virtual_loss():
    sol, engine = solve(iterations=3, n_thoughts=3, simulation_depth=0, parallel=2, exploration=2.0)
    tree = sol.tree
    # wave 1: the root alone (every selection reaches it); wave 2: two different children at once.
    grown = [c for c in engine.calls if c[0].prefix == "G"]
    assert len(grown) == 3 + 6
    assert tree[tree.root].visits == 3
    expanded = [c for c in children(tree, tree.root) if children(tree, c)]
    assert len(expanded) == 2


def test_the_budget_is_the_root_visits_and_visits_add_up():
    sol, _ = solve(iterations=7, n_thoughts=2, simulation_depth=1, parallel=3)
    tree = sol.tree
    assert tree[tree.root].visits == 7
    for node in tree.graph.nodes:
        kids = [c for c in children(tree, node) if tree[c].visits]
        if kids and tree[node].visits and not tree[node].terminal:
            # A node's visits are its children's plus the iterations that ended at it.
            assert tree[node].visits >= sum(tree[c].visits for c in kids)


def test_the_answer_is_the_best_valued_finished_state():
    sol, _ = solve(iterations=6, n_thoughts=2, simulation_depth=2, parallel=2)
    tree = sol.tree
    finished = [n for n in tree.graph.nodes if n != tree.root and tree[n].terminal]
    assert finished and all(tree[n].depth == 3 for n in finished)
    best = max(tree[n].value for n in finished)
    answer = [n for n in tree.graph.nodes if tree[n].answer]
    assert tree[answer[-1]].value == best and tree[answer[-1]].terminal
    assert sol.steps == tree.steps(answer[-1])


def test_the_tree_does_not_depend_on_completion_order():
    plain, _ = solve(iterations=9, n_thoughts=3, simulation_depth=1, parallel=3)
    scrambled, _ = solve(scramble=True, iterations=9, n_thoughts=3, simulation_depth=1, parallel=3)
    assert plain.tree.to_dict() == scrambled.tree.to_dict()


def test_exploration_spreads_the_visits():
    greedy, _ = solve(iterations=12, n_thoughts=3, simulation_depth=0, parallel=1, exploration=0.0)
    wide, _ = solve(iterations=12, n_thoughts=3, simulation_depth=0, parallel=1, exploration=5.0)

    def visited_first_level(sol):
        return sum(1 for c in children(sol.tree, sol.tree.root) if sol.tree[c].visits)

    assert visited_first_level(wide) == 3 > visited_first_level(greedy)


def test_config():
    from test_run import make_config

    cfg = make_config("search=mcts", "search.iterations=32", "search.exploration=0.5")
    assert cfg.search_settings == MCTSSettings(iterations=32, exploration=0.5)
    assert cfg.search_settings.scaled(8).iterations == 8
    for bad, named in (
        ("search.iterations=0", "search.iterations=0"),
        ("search.exploration=-1", "search.exploration=-1.0"),
        ("search.parallel=x", "search.parallel='x'"),
    ):
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            make_config("search=mcts", bad)
