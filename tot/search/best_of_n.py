"""Best-of-N (self-consistency): N whole solutions of one prompt, the answer by a vote or a score.

Every solution is one reply to the task's whole-solution prompt (GSM8K's zero-shot chain of thought,
a whole Blocksworld plan, a whole passage), sampled in one group, STAND's best case: N long
trajectories of the same prompt. `majority` takes the most frequent parsed answer (no evaluator
call is made), `weighted` the answer with the largest summed value, `best` the best-valued solution
(the one sensible rule where answers do not repeat, as in Creative Writing). A solution is valued by
the task's whole-solution evaluator as soon as it is written (or the reward model: reward.kind=consistency
completes its masked tail, rStar's mutual consistency); vote.weight weighs the vote by a
confidence reading of each solution's tokens instead (CISC, DeepConf). In the tree each solution is a
chain from the root, one node per step the task reads in it (one Blocksworld action per node).

With `wave` the solutions are sampled `wave` at a time, none more once the problem has generated
`token_budget` tokens, and `stop` may end the problem before all n are drawn: `decided` once no
solution still to come can change the vote (the answer is the one all n would give: solution i is
sampled from the same seed either way), `agree` also once a whole wave agrees with the leader
(early-stopping self-consistency's window; it may answer otherwise than all n would).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from decoding import ConfigError
from tasks.base import Problem, Prompt
from tot.search.base import (
    GenerationEngine,
    SearchBase,
    Solution,
    Thinker,
    check_positive,
    choose,
    confidence,
    request_seed,
)
from tot.search.confidence import readings
from tot.search.plugin import SearchPlugin
from tot.search.reward import Discriminator
from tot.search.tree import ReasoningTree, Valuation
from tot.search.vote import Ballot, Own, VoteRule, check_stop, check_stop_name, settled

Vote = Literal["majority", "weighted", "best"]


@dataclass(frozen=True)
class BestOfNSettings:
    n: int = 8
    aggregate: Vote = "majority"
    max_tokens: int = 384  # per solution: a whole chain of thought is longer than a thought
    wave: int = 0  # solutions sampled at a time (0: all n)
    stop: str = "never"  # never | decided | agree: when the vote is settled before n are drawn
    token_budget: int = 0  # a problem's generated tokens after which no wave more is drawn (0: none)

    def __post_init__(self) -> None:
        check_positive(search="best_of_n", n=self.n, max_tokens=self.max_tokens)
        if self.wave < 0:
            raise ConfigError(f"search.wave={self.wave} must be >= 0 (0: all search.n solutions at once)")
        check_stop_name(self.stop, "best_of_n", self.aggregate != "best", "majority or weighted")
        if self.token_budget < 0 or (self.token_budget and not self.wave):
            raise ConfigError(
                f"search.token_budget={self.token_budget} stops between waves: give search.wave (say 2) and a "
                "positive budget, or 0 for none"
            )
        if self.stop == "agree" and self.wave < 2:
            raise ConfigError(
                f"search.stop=agree stops once a whole wave agrees: give search.wave >= 2 (given {self.wave}; "
                "one solution always agrees with itself)"
            )

    @property
    def scored(self) -> bool:
        return self.aggregate != "majority"

    @property
    def own(self) -> Own:
        """What a ballot weighs unless vote.weight says otherwise."""
        return "one" if self.aggregate == "majority" else "value"

    def scaled(self, n: int) -> BestOfNSettings:
        return replace(self, n=n)


class BestOfN(SearchBase):
    settings: BestOfNSettings

    async def solve(self, problem: Problem, engine: GenerationEngine) -> Solution:
        thinker = self.thinker(problem, engine)
        settings = self.settings
        wave = settings.wave or settings.n
        written: list[Written] = []
        while len(written) < settings.n:
            batch = range(len(written), min(settings.n, len(written) + wave))
            written += await asyncio.gather(*(self._solution(thinker, i) for i in batch))
            ballots = [Ballot(w.answer, w.valued.value if w.valued else None, w.confidence) for w in written]
            if settled(self.vote, ballots, settings.own, settings.n - len(written), settings.stop, wave):
                break
            if settings.token_budget and thinker.tokens >= settings.token_budget:
                break
        # The chains are added in solution order once all are written: node ids do not depend on
        # which reply finished first.
        tree = thinker.tree
        leaves = []
        for i, w in enumerate(written):
            node = tree.root
            for j, text in enumerate(w.steps):
                node = tree.add(node, text, solution=i, **({"reply": w.reply, "tokens": w.tokens} if j == 0 else {}))
            # A majority vote is a vote weighted by 1 per solution.
            tree[node].terminal = tree[node].chosen = True
            tree[node].take(w.valued or Valuation(1.0))
            tree[node].confidence = w.confidence
            leaves.append(node)
        answer_of = lambda s: self.task.answer(problem, tree.steps(s))  # noqa: E731
        aggregate = {"best": "best", "majority": "majority"}.get(settings.aggregate, "vote")
        solution = thinker.solution(choose(tree, leaves, answer_of, aggregate, self.vote))
        if len(written) < settings.n or wave < settings.n:
            solution.budget = {"samples": len(written), "budget": settings.n}
        return solution

    async def _solution(self, thinker: Thinker, i: int) -> Written:
        """Solution i: its reply, the steps the task reads in it, its tokens, its confidence readings
        where its log-probabilities were asked and, when the vote needs it, what values it (asked as
        soon as it is written)."""
        scored = self.settings.scored
        request = self.gen.request(
            self.task.solution_prompt(thinker.problem, i),
            group=thinker.siblings("solutions"),
            seed=request_seed(self.seed, thinker.problem.id, "solution", i),
            keep=thinker.in_context and scored,
            max_new_tokens=self.settings.max_tokens,
            logprobs=(thinker.confident and scored) or self.vote.reading is not None,
            top_logprobs=thinker.top_logprobs,
        )
        (out,) = await thinker.call([request], "generate")
        steps = self.task.solution_steps(thinker.problem, out.text, i)
        answer = self.task.answer(thinker.problem, steps)
        valued = None
        if scored and isinstance(self.reward, Discriminator):  # its answer as it votes, stated or not
            valued = await thinker.discriminate(steps, answer, f"s{i}")
        elif scored:

            def prompt(path: list[str], follow_up: bool) -> Prompt:
                return self.values.prompts.solution_evaluator_prompt(thinker.problem, path, follow_up)

            sure = confidence(out) if thinker.confident else None
            context = out.context if request.keep else ()
            valued = await thinker.judge(steps, context, prompt, "solutions/eval", f"s{i}", sure)
        read = readings(out.logprobs) if out.logprobs is not None else None
        return Written(out.text, steps, out.stats.generated_tokens, valued, read, answer)


@dataclass(frozen=True)
class Written:
    """One whole solution as it came back."""

    reply: str
    steps: list[str]
    tokens: int
    valued: Valuation | None
    confidence: dict[str, float] | None
    answer: str


def solution_leaves(tree: ReasoningTree) -> list[int]:
    """The last step of each solution in a saved best-of-N tree, in solution order (what it voted over)."""
    solution = {n: i for n in tree.graph.nodes if (i := tree[n].solution) is not None and tree[n].terminal}
    return sorted(solution, key=solution.__getitem__)


def check_stop_rule(settings: BestOfNSettings, vote: VoteRule, task_options: Mapping[str, Any]) -> None:
    check_stop(settings.stop, vote, settings.own)


PLUGIN = SearchPlugin(
    name="best_of_n",
    build=BestOfN,
    options=BestOfNSettings,
    check_config=check_stop_rule,
    voted=lambda settings: solution_leaves if settings.get("aggregate") in ("majority", "weighted") else None,
)
