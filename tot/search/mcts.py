"""MCTS over reasoning steps, as RAP runs it (Hao et al. 2023): UCT selection, expansion of
`n_thoughts` valued children, a simulation that keeps expanding the best-valued new child, and the
value of the state it ends in backed up along the path.

Iterations run in waves of up to `parallel` at once, so that one problem keeps the engine's batch
full: each selection in a wave adds a virtual loss to its path (a visit returning the worst value
seen), so the next one looks elsewhere; a wave ends early where a selection reaches a leaf the wave
already holds. Within a wave the expansions and simulations advance in lock step, one grown level
of all of them at a time, and are backed up in selection order: the tree, and each request's seed
(from its node's place), do not depend on which request finished first, so a resumed run and every
decoder build the same tree.

Values are the task's (GSM8K 1-10, Blocksworld 0/1), so UCT reads them rescaled to [0, 1] by the
lowest and highest value seen in the problem's tree (MuZero's normalisation): the exploration
constant means the same on every task. The answer is the best-valued finished state (ties: more
visits, then the earlier one), or (search.aggregate=vote) the answer with the largest summed value over
the finished states; where no path finished, the path of most visits from the root.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from decoding import ConfigError
from tasks.base import Problem
from tot.search.base import (
    Aggregate,
    GenerationEngine,
    SearchBase,
    Solution,
    Thinker,
    check_positive,
    choose,
    finished_states,
    vote_settled,
)
from tot.search.plugin import SearchPlugin
from tot.search.tree import ReasoningTree
from tot.search.vote import VoteRule, check_stop, check_stop_name


@dataclass(frozen=True)
class MCTSSettings:
    iterations: int = 16
    n_thoughts: int = 3  # children sampled (and valued) per expansion
    exploration: float = 1.0  # UCT's constant, on values rescaled to [0, 1]
    simulation_depth: int = 1  # levels a simulation grows below the expanded state
    parallel: int = 4  # iterations per wave (virtual loss keeps them apart)
    aggregate: Aggregate = "best"
    stop: str = "never"  # never | decided | agree: when the vote is settled before every iteration ran

    def __post_init__(self) -> None:
        check_positive(search="mcts", iterations=self.iterations, n_thoughts=self.n_thoughts, parallel=self.parallel)
        if self.exploration < 0 or self.simulation_depth < 0:
            raise ConfigError(
                f"search.exploration={self.exploration} and search.simulation_depth={self.simulation_depth} "
                "must be >= 0 (search=mcts)"
            )
        check_stop_name(self.stop, "mcts", self.aggregate == "vote", "vote")

    def scaled(self, n: int) -> MCTSSettings:
        return replace(self, iterations=n)


@dataclass
class Stats:
    """Visits and summed returns per node, the virtual visits of the wave being selected, and the
    range of values seen (for the rescaling)."""

    visits: Counter[int] = field(default_factory=Counter)
    total: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    virtual: Counter[int] = field(default_factory=Counter)
    low: float = math.inf
    high: float = -math.inf

    def see(self, value: float) -> None:
        self.low, self.high = min(self.low, value), max(self.high, value)

    def scaled(self, value: float) -> float:
        return (value - self.low) / (self.high - self.low) if self.high > self.low else 0.0

    def q(self, tree: ReasoningTree, node: int) -> float:
        """The node's mean return, rescaled; an unvisited node's own value. Virtual visits return the
        worst value (0 once rescaled)."""
        n = self.visits[node] + self.virtual[node]
        if n == 0:
            return self.scaled(tree.value(node))
        return self.scaled(self.total[node] / self.visits[node]) * self.visits[node] / n if self.visits[node] else 0.0


class MCTS(SearchBase):
    settings: MCTSSettings

    async def solve(self, problem: Problem, engine: GenerationEngine) -> Solution:
        thinker = self.thinker(problem, engine)
        tree, settings = thinker.tree, self.settings
        answer_of = lambda s: self.task.answer(problem, tree.steps(s))  # noqa: E731
        stats, done, wave, counted, stopped = Stats(), 0, 0, 0, False
        while done < settings.iterations:
            paths = self._select(tree, stats, settings.iterations - done)
            await self._simulate(thinker, stats, paths, wave)
            for path in paths:
                ret = tree.value(path[-1])
                for node in path:
                    stats.visits[node] += 1
                    stats.total[node] += ret
            done, wave = done + len(paths), wave + 1
            # An iteration adds at most its levels' thoughts, each with its completions under rollouts.
            levels = 1 if thinker.rollouts else 1 + settings.simulation_depth
            per_iteration = levels * settings.n_thoughts * (1 + (self.values.rollouts if thinker.rollouts else 0))
            remaining = (settings.iterations - done) * per_iteration
            stopped = done < settings.iterations and vote_settled(
                tree, answer_of, self.vote, settings.stop, counted, remaining
            )
            if stopped:
                break
            counted = len(finished_states(tree))
        for node, n in stats.visits.items():
            thought = thinker.tree[node]
            thought.visits, thought.q, thought.chosen = n, stats.total[node] / n, True
        finished = finished_states(tree)
        if settings.aggregate == "vote" and finished:
            solution = thinker.solution(choose(tree, finished, answer_of, "vote", self.vote))
        else:
            solution = thinker.solution(self._answer(tree, stats))
        if settings.stop != "never":  # the iterations left unrun by the stop
            solution.budget = {"iterations": done, "budget": settings.iterations if stopped else done}
        return solution

    def _select(self, tree: ReasoningTree, stats: Stats, budget: int) -> list[list[int]]:
        """A wave's paths from the root down to a leaf by UCT, each adding a virtual loss to its path."""
        paths: list[list[int]] = []
        stats.virtual.clear()
        for _ in range(min(self.settings.parallel, budget)):
            path = [tree.root]
            while (children := tree.children(path[-1])) and not tree[path[-1]].terminal:
                path.append(max(children, key=lambda c: self._uct(tree, stats, path[-1], c)))
            if any(p[-1] == path[-1] for p in paths):
                break  # the wave holds this leaf already
            paths.append(path)
            stats.virtual.update(path)
        stats.virtual.clear()
        return paths

    def _uct(self, tree: ReasoningTree, stats: Stats, parent: int, child: int) -> float:
        n_parent = stats.visits[parent] + stats.virtual[parent]
        n_child = stats.visits[child] + stats.virtual[child]
        return stats.q(tree, child) + self.settings.exploration * math.sqrt(math.log(n_parent + 1) / (n_child + 1))

    async def _simulate(self, thinker: Thinker, stats: Stats, paths: list[list[int]], wave: int) -> None:
        """Expand each path's leaf and follow its best-valued new child down, `simulation_depth`
        levels more or until a path finishes, all paths one level at a time; paths are extended. Under
        task.value=rollout the children's completions are the simulation (rStar's): no level more."""
        tree, width = thinker.tree, self.settings.n_thoughts
        for _ in range(1 + (0 if thinker.rollouts else self.settings.simulation_depth)):
            live = [p for p in paths if not tree[p[-1]].terminal]
            if not live:
                return
            children = await thinker.grow([(p[-1], width, "") for p in live], f"w{wave}")
            for i, path in enumerate(live):
                grown = children[i * width : (i + 1) * width]
                for c in grown:
                    stats.see(tree.value(c))
                path.append(max(grown, key=tree.value))  # the first of equals

    @staticmethod
    def _answer(tree: ReasoningTree, stats: Stats) -> int:
        finished = finished_states(tree)
        if finished:
            return max(finished, key=lambda n: (tree[n].value, stats.visits[n], -n))
        node = tree.root
        while children := [c for c in tree.children(node) if stats.visits[c]]:
            node = max(children, key=lambda c: (stats.visits[c], -c))
        return node


def check_stop_rule(settings: MCTSSettings, vote: VoteRule, task_options: Mapping[str, Any]) -> None:
    check_stop(settings.stop, vote, "value")


PLUGIN = SearchPlugin(
    name="mcts",
    build=MCTS,
    options=MCTSSettings,
    check_config=check_stop_rule,
    voted=lambda settings: finished_states if settings.get("aggregate") == "vote" else None,
)
