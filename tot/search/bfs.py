"""ToT-BFS (SEED Algorithm 2): at each depth every kept state grows `search.n_thoughts` thoughts, each
is valued, and the `search.breadth` best of them all go on; the answer is the one with the largest summed
value over every finished state (search.aggregate=vote, the default: on 200 GSM8K problems at breadth
4 it answered 53 right where the best state answered 46, and within one of it at breadth 1; README
Results), or the best state at the last depth (best). A state whose steps equal a kept one's (a
sibling sampled twice) takes no second place in the frontier (search.distinct), and the problem may grow
more first thoughts than a state does (search.root_thoughts): at breadth 4 a fifth of the frontier's
places went to copies, and every path began with one of two first paragraphs. Under the vote, `search.stop`
ends a problem between levels once the ballots still to come cannot change the answer (decided) or a
level's new ballots all name the leader (agree), as best-of-N's waves do."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
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
class BFSSettings:
    n_thoughts: int = 3
    breadth: int = 1
    aggregate: Aggregate = "vote"
    distinct: bool = True
    root_thoughts: int = 0  # thoughts grown from the problem; 0: n_thoughts, as from any state
    # task.value=rollout: a state's thoughts are the first steps of completions sampled from it, each valued
    # by the rest of its completion (phi-Decoding's foresight): no thought is sampled apart from its valuation.
    foresight: bool = False
    token_budget: int = 0  # a problem's generated tokens after which no level more is grown (0: none)
    stop: str = "never"  # never | decided | agree: when the vote is settled before the last level

    def __post_init__(self) -> None:
        # As in ToT, the b best of all the frontier's thoughts go on: breadth may exceed n_thoughts.
        check_positive(search="bfs", n_thoughts=self.n_thoughts, breadth=self.breadth)
        if self.token_budget < 0:
            raise ConfigError(f"search.token_budget={self.token_budget}: a positive number of tokens, or 0 for none")
        if self.root_thoughts < 0:
            raise ConfigError(f"search.root_thoughts={self.root_thoughts}: 0 (n_thoughts) or a positive count")
        check_stop_name(self.stop, "bfs", self.aggregate == "vote", "vote")

    def thoughts_at(self, depth: int) -> int:
        return self.root_thoughts if depth == 1 and self.root_thoughts else self.n_thoughts

    def scaled(self, n: int) -> BFSSettings:
        """The settings with n thoughts per state (the scaling curve's N)."""
        return replace(self, n_thoughts=n)


class BFS(SearchBase):
    settings: BFSSettings

    async def solve(self, problem: Problem, engine: GenerationEngine) -> Solution:
        thinker = self.thinker(problem, engine)
        tree = thinker.tree
        frontier = [tree.root]
        grown = counted = 0  # levels grown, ballots cast before this level
        stopped = False
        for depth in range(1, self.task.depth + 1):
            # Finished states are not extended; they compete with the new thoughts for the frontier.
            done = [s for s in frontier if s != tree.root and tree[s].terminal]
            open_ = [s for s in frontier if s not in done]
            if not open_ or (self.settings.token_budget and thinker.tokens >= self.settings.token_budget):
                break
            n = self.settings.thoughts_at(depth)
            if self.settings.foresight:
                children = await thinker.foresee([(s, n, "") for s in open_])
            else:
                children = await thinker.grow([(s, n, "") for s in open_], f"d{depth}")
            # Stable sort: among equal values the earlier thought wins, deterministically.
            ranked = sorted(done + children, key=lambda c: -tree.value(c))
            if self.settings.distinct:
                ranked = first_of_each_state(tree, ranked)
            frontier = ranked[: self.settings.breadth]
            for c in frontier:
                tree[c].chosen = True
            grown = depth
            stopped = depth < self.task.depth and self._settled(thinker, problem, depth, counted)
            if stopped:
                break
            counted = len(finished_states(tree))
        finished = finished_states(tree)
        if self.settings.aggregate == "vote" and finished:
            answer_of = lambda s: self.task.answer(problem, tree.steps(s))  # noqa: E731
            solution = thinker.solution(choose(tree, finished, answer_of, "vote", self.vote))
        else:
            solution = thinker.solution(frontier[0])
        if self.settings.stop != "never":
            # The levels left ungrown by the stop (none where the search ended by itself).
            solution.budget = {"levels": grown, "budget": self.task.depth if stopped else grown}
        return solution

    def _settled(self, thinker: Thinker, problem: Problem, depth: int, counted: int) -> bool:
        """search.stop after level `depth` (`vote_settled`). At most breadth states grow their thoughts a
        level, each thought a ballot and, valued by rollouts, as many more as its completions (none at
        the depth limit, where a thought is finished; foresight's one completion a thought no more than
        task.rollouts)."""

        def ballots_at(d: int) -> int:
            completed = thinker.rollouts and (d < self.task.depth or self.settings.foresight)
            return (
                self.settings.breadth * self.settings.thoughts_at(d) * (1 + (self.values.rollouts if completed else 0))
            )

        remaining = sum(ballots_at(d) for d in range(depth + 1, self.task.depth + 1))
        tree = thinker.tree
        answer_of = lambda s: self.task.answer(problem, tree.steps(s))  # noqa: E731
        return vote_settled(tree, answer_of, self.vote, self.settings.stop, counted, remaining)


def first_of_each_state(tree: ReasoningTree, states: list[int]) -> list[int]:
    """`states` less each one whose steps equal an earlier one's (the copies stay in the tree)."""
    seen: set[tuple[str, ...]] = set()
    kept = []
    for s in states:
        steps = tuple(tree.steps(s))
        if steps not in seen:
            seen.add(steps)
            kept.append(s)
    return kept


def check_config(settings: BFSSettings, vote: VoteRule, task_options: Mapping[str, Any]) -> None:
    check_stop(settings.stop, vote, "value")
    if settings.foresight and task_options.get("value") != "rollout":
        raise ConfigError(
            "search.foresight=true takes a state's thoughts from completions that value them: it needs "
            f"task.value=rollout (given task.value={task_options.get('value')})"
        )


PLUGIN = SearchPlugin(
    name="bfs",
    build=BFS,
    options=BFSSettings,
    check_config=check_config,
    voted=lambda settings: finished_states if settings.get("aggregate") == "vote" else None,
)
