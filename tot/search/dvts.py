"""DVTS, diverse verifier tree search (Beeching et al. 2024), as STAND runs it (section 5.3, A.2).

`n` trajectories are split into n / beam_width independent subtrees. At each step every live subtree
samples `beam_width` candidate next steps from its current state, the task's state evaluator (the
verifier) values them, and the best candidate becomes the subtree's state; a subtree whose state is
finished stops. The answer is the best final value, or a majority vote over subtrees weighted by
their final values. The candidates of all subtrees share one group per step, so that STAND's pools see
the sibling trajectories of the same problem.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from decoding import ConfigError
from tasks.base import Problem
from tot.search.base import Aggregate, GenerationEngine, SearchBase, Solution, Thinker, check_positive, choose
from tot.search.plugin import SearchPlugin
from tot.search.tree import ReasoningTree


@dataclass(frozen=True)
class DVTSSettings:
    n: int = 4
    beam_width: int = 2
    aggregate: Aggregate = "best"

    def __post_init__(self) -> None:
        check_positive(search="dvts", n=self.n, beam_width=self.beam_width)
        if self.n % self.beam_width:
            fix = self.n - self.n % self.beam_width or self.beam_width
            raise ConfigError(
                f"search.n={self.n} is not a multiple of search.beam_width={self.beam_width}; DVTS splits n "
                f"trajectories into n / beam_width subtrees, so use e.g. search.n={fix}"
            )

    @property
    def subtrees(self) -> int:
        return self.n // self.beam_width

    def scaled(self, n: int) -> DVTSSettings:
        """The settings with n trajectories (the scaling curve's N), beams no wider than n."""
        return replace(self, n=n, beam_width=self.beam_width if n % self.beam_width == 0 else 1)


class DVTS(SearchBase):
    settings: DVTSSettings

    async def solve(self, problem: Problem, engine: GenerationEngine) -> Solution:
        thinker = self.thinker(problem, engine)
        tree, width = thinker.tree, self.settings.beam_width
        current = [tree.root] * self.settings.subtrees
        live = list(range(self.settings.subtrees))
        for depth in range(1, self.task.depth + 1):
            if not live:
                break
            # The seed key names the subtree: subtrees that start from the same state sample apart.
            # All subtrees' thoughts of a depth are siblings: one STAND pool sees every candidate.
            children = await thinker.grow([(current[k], width, f"s{k}") for k in live], f"d{depth}", together=True)
            for i, k in enumerate(live):
                candidates = children[i * width : (i + 1) * width]
                for c in candidates:
                    tree[c].subtree = k
                current[k] = max(candidates, key=tree.value)  # the first of equals
                tree[current[k]].chosen = True
            live = [k for k in live if not tree[current[k]].terminal]
        return thinker.solution(self.choose(thinker, current))

    def choose(self, thinker: Thinker, leaves: list[int]) -> int:
        return choose(
            thinker.tree,
            leaves,
            lambda s: thinker.task.answer(thinker.problem, thinker.tree.steps(s)),
            self.settings.aggregate,
            self.vote,
        )


def final_states(tree: ReasoningTree) -> list[int]:
    """Each subtree's last state in a saved DVTS tree, in subtree order (what `choose` chose among)."""
    last: dict[int, int] = {}
    for n in tree.graph.nodes:
        node = tree[n]
        k = node.subtree
        if node.chosen and k is not None and (k not in last or node.depth > tree[last[k]].depth):
            last[k] = n
    return [last[k] for k in sorted(last)]


PLUGIN = SearchPlugin(
    name="dvts",
    build=DVTS,
    options=DVTSSettings,
    voted=lambda settings: final_states if settings.get("aggregate") == "vote" else None,
)
