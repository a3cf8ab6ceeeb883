"""Best-of-N (self-consistency): N whole solutions of one prompt, the answer by a vote or a score.

Every solution is one reply to the task's whole-solution prompt (GSM8K's zero-shot chain of thought,
a whole Blocksworld plan, a whole passage), sampled in one group, STAND's best case: N long
trajectories of the same prompt. `majority` takes the most frequent parsed answer (no evaluator
call is made), `weighted` the answer with the largest summed value, `best` the best-valued solution
(the one sensible rule where answers do not repeat, as in Creative Writing). A solution is valued by
the task's whole-solution evaluator as soon as it is written. In the tree each solution is a chain
from the root, one node per step the task reads in it (one Blocksworld action per node).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Literal

from decoding import GenRequest
from tasks.base import Problem, Prompt
from tot.search.base import (
    GenerationEngine,
    SearchBase,
    Solution,
    Step,
    check_positive,
    choose,
    confidence,
    request_seed,
)
from tot.search.plugin import SearchPlugin
from tot.search.tree import ReasoningTree, Valuation

Vote = Literal["majority", "weighted", "best"]


@dataclass(frozen=True)
class BestOfNSettings:
    n: int = 8
    aggregate: Vote = "majority"
    max_tokens: int = 384  # per solution: a whole chain of thought is longer than a thought

    def __post_init__(self) -> None:
        check_positive(search="best_of_n", n=self.n, max_tokens=self.max_tokens)

    @property
    def scored(self) -> bool:
        return self.aggregate != "majority"

    def scaled(self, n: int) -> BestOfNSettings:
        return replace(self, n=n)


class BestOfN(SearchBase):
    settings: BestOfNSettings

    async def solve(self, problem: Problem, engine: GenerationEngine) -> Solution:
        step = self.step(problem, engine)
        prompt = self.task.solution_prompt(problem)
        requests = [
            self.gen.request(
                prompt,
                group=step.siblings("solutions"),
                seed=request_seed(self.seed, problem.id, "solution", i),
                keep=step.in_context and self.settings.scored,
                max_new_tokens=self.settings.max_tokens,
                logprobs=step.confident and self.settings.scored,
            )
            for i in range(self.settings.n)
        ]
        written = await asyncio.gather(*(self._solution(step, i, r) for i, r in enumerate(requests)))
        # The chains are added in solution order once all are written: node ids do not depend on
        # which reply finished first.
        tree = step.tree
        leaves = []
        for i, (reply, steps, tokens, valued) in enumerate(written):
            node = tree.root
            for j, text in enumerate(steps):
                node = tree.add(node, text, solution=i, **({"reply": reply, "tokens": tokens} if j == 0 else {}))
            # A majority vote is a vote weighted by 1 per solution.
            tree[node].terminal = tree[node].chosen = True
            tree[node].take(valued or Valuation(1.0))
            leaves.append(node)
        aggregate = "best" if self.settings.aggregate == "best" else "vote"
        return step.solution(choose(tree, leaves, lambda s: self.task.answer(problem, tree.steps(s)), aggregate))

    async def _solution(self, step: Step, i: int, request: GenRequest) -> tuple[str, list[str], int, Valuation | None]:
        """One solution: its reply, the steps the task reads in it, its tokens and, when the vote
        needs it, what values it (asked as soon as it is written)."""
        (out,) = await step.call([request], "generate")
        steps = self.task.solution_steps(step.problem, out.text)
        valued = None
        if self.settings.scored:

            def prompt(path: list[str], follow_up: bool) -> Prompt:
                return self.task.solution_evaluator_prompt(step.problem, path, follow_up)

            sure = confidence(out) if request.logprobs else None
            context = out.context if request.keep else ()
            valued = await step.judge(steps, context, prompt, "solutions/eval", f"s{i}", sure)
        return out.text, steps, out.stats.generated_tokens, valued


def solution_leaves(tree: ReasoningTree) -> list[int]:
    """The last step of each solution in a saved best-of-N tree, in solution order (what it voted over)."""
    leaves = [n for n in tree.graph.nodes if tree[n].solution is not None and tree[n].terminal]
    return sorted(leaves, key=lambda n: tree[n].solution)


PLUGIN = SearchPlugin(
    name="best_of_n",
    build=BestOfN,
    options=BestOfNSettings,
    voted=lambda settings: solution_leaves if settings.get("aggregate") in ("majority", "weighted") else None,
)
